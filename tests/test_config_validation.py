"""Start-up validation: the engine modes the output-rate accounting does not cover.

docs/SPEC.md "Configuration": with the feature on, speculative decoding, data parallel > 1,
pipeline parallel > 1, multimodal / encoder-decoder / hybrid (mamba) / attention-free /
diffusion / pooling models, KV connectors, KV offload, EC connectors and aux-output
connectors are refused with a message saying what to change; with the feature off
(R18) nothing is checked and the class is exactly vLLM's ``Scheduler``.

Most cases build a REAL ``VllmConfig`` on this CPU machine (tiny model directories written
here: Llama, Mamba, Jamba, Whisper) and construct the real ``RateLimitedScheduler`` /
``RateLimitedAsyncScheduler`` with it; the check runs before vLLM's own constructor, so
the error comes before any connector is built. Where vLLM cannot build the config on CPU,
the test says so and uses:

- diffusion: vLLM refuses diffusion models without Model Runner V2 (needs Triton), so a
  real ``ModelConfig`` of a diffusion model (``canvas_length`` set) is assigned into a real
  ``VllmConfig`` built for the plain model;
- aux-output connector: ``--enable-return-routed-experts`` needs Model Runner V2 as well,
  so a real ``AuxOutputConfig`` is assigned the same way;
- multimodal only (not encoder-decoder): every multimodal decoder architecture needs
  torchvision, which this environment leaves out, so a stand-in model config
  (``SimpleNamespace``) with only ``is_multimodal_model`` set is checked by
  ``check_engine_supported`` directly (Whisper covers multimodal with a real config).

The front-end check (``plugin.py`` wraps ``EngineArgs.create_engine_config``) is tested
with real ``EngineArgs``.
"""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import pytest

from vllm_output_rate.adapter.engine_shape import EngineShape, build_kv_cache_config
from vllm_output_rate.adapter.harness import load_class
from vllm_output_rate.adapter.tinymodel import CONFIG, default_model_dir
from vllm_output_rate.reference.engine_checks import check_engine_supported, unsupported_modes
from vllm_output_rate.reference.section import OutputRateConfigError

pytestmark = pytest.mark.check

FEATURE_ON = {"output_rate": {"default_tokens_per_s": 100}}
SYNC = "vllm_output_rate.reference.scheduler.RateLimitedScheduler"
ASYNC = "vllm_output_rate.reference.scheduler.RateLimitedAsyncScheduler"
STOCK = "vllm.v1.core.sched.scheduler.Scheduler"
TEXT = {
    k: CONFIG[k]
    for k in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "max_position_embeddings",
        "rms_norm_eps",
    )
}

# Tiny config.json of each model kind (dummy weights are never loaded here).
MODEL_KINDS = {
    "mamba": {
        "architectures": ["MambaForCausalLM"],
        "model_type": "mamba",
        "hidden_size": 64,
        "state_size": 16,
        "num_hidden_layers": 2,
        "vocab_size": 512,
        "expand": 2,
        "conv_kernel": 4,
    },
    "jamba": {
        "architectures": ["JambaForCausalLM"],
        "model_type": "jamba",
        **TEXT,
        "attn_layer_period": 2,
        "attn_layer_offset": 1,
        "expert_layer_period": 2,
        "expert_layer_offset": 1,
        "num_experts": 1,
        "mamba_d_state": 16,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "mamba_dt_rank": 8,
    },
    "whisper": {
        "architectures": ["WhisperForConditionalGeneration"],
        "model_type": "whisper",
        "d_model": 64,
        "encoder_layers": 1,
        "decoder_layers": 1,
        "encoder_attention_heads": 2,
        "decoder_attention_heads": 2,
        "encoder_ffn_dim": 128,
        "decoder_ffn_dim": 128,
        "vocab_size": 512,
        "num_mel_bins": 80,
        "max_source_positions": 1500,
        "max_target_positions": 448,
        "is_encoder_decoder": True,
    },
    "diffusion": {**CONFIG, "canvas_length": 32},
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    base = tmp_path_factory.mktemp("models")
    dirs = {"llama": str(default_model_dir())}
    for name, cfg in MODEL_KINDS.items():
        path = base / name
        path.mkdir()
        (path / "config.json").write_text(json.dumps(cfg))
        dirs[name] = str(path)
    return dirs


def model_config(path: str, **kw):
    from vllm.config import ModelConfig

    return ModelConfig(model=path, skip_tokenizer_init=True, dtype="float32", max_model_len=256, **kw)


def vllm_config(model_dirs, feature_on: bool = True, model: str = "llama", model_kw=None, **kw):
    """A real ``VllmConfig`` (tiny model) with the given sub-configs."""
    from vllm.config import VllmConfig

    config = VllmConfig(
        model_config=model_config(model_dirs[model], **(model_kw or {})),
        additional_config=copy.deepcopy(FEATURE_ON) if feature_on else {},
        **kw,
    )
    config.cache_config.num_gpu_blocks = 64
    return config


def build_scheduler(cls_path: str, config):
    """Construct the scheduler class on ``config`` the way vLLM's engine core does."""
    from vllm.v1.structured_output import StructuredOutputManager

    return load_class(cls_path)(
        vllm_config=config,
        kv_cache_config=build_kv_cache_config(EngineShape(num_blocks=64)),
        structured_output_manager=StructuredOutputManager(config),
        block_size=16,
        log_stats=False,
    )


# -- the configurations, each with the mode its message must name ----------------------
def _pp2(d):
    from vllm.config import ParallelConfig

    return vllm_config(d, parallel_config=ParallelConfig(pipeline_parallel_size=2))


def _dp2(d):
    from vllm.config import ParallelConfig

    return vllm_config(d, parallel_config=ParallelConfig(data_parallel_size=2))


def _spec(d):
    from vllm.config import ParallelConfig, SpeculativeConfig, VllmConfig

    target = model_config(d["llama"])
    spec = SpeculativeConfig(
        method="ngram",
        num_speculative_tokens=2,
        prompt_lookup_max=3,
        prompt_lookup_min=1,
        target_model_config=target,
        target_parallel_config=ParallelConfig(),
    )
    config = VllmConfig(model_config=target, speculative_config=spec, additional_config=copy.deepcopy(FEATURE_ON))
    config.cache_config.num_gpu_blocks = 64
    return config


def _pooling(d):
    return vllm_config(d, model_kw={"runner": "pooling"})


def _kv_connector(d):
    from vllm.config import KVTransferConfig

    return vllm_config(d, kv_transfer_config=KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both"))


def _kv_offload(d):
    from vllm.config import CacheConfig

    return vllm_config(d, cache_config=CacheConfig(kv_offloading_size=1.0))


def _ec_connector(d):
    from vllm.config import ECTransferConfig

    return vllm_config(d, ec_transfer_config=ECTransferConfig(ec_connector="ECExampleConnector", ec_role="ec_both"))


def _diffusion(d):
    # Stand-in assembly (see module docstring): vLLM refuses diffusion on Model Runner V1.
    config = vllm_config(d)
    config.model_config = model_config(d["diffusion"])
    return config


def _aux(d):
    # Stand-in assembly (see module docstring): routed-experts output needs Model Runner V2.
    from vllm.config.aux_output import AuxOutputConfig

    config = vllm_config(d)
    config.aux_output_config = AuxOutputConfig(enable_return_routed_experts=True)
    return config


def _sleep_mode(d):
    # Stand-in assembly: vLLM's CPU platform refuses --enable-sleep-mode itself (ModelConfig
    # raises "Sleep mode is not supported on current platform"), so the flag is set on a
    # real ModelConfig after it was built; on a GPU it is refused by the check below.
    config = vllm_config(d)
    config.model_config.enable_sleep_mode = True
    return config


def _disaggregated_prefill(d):
    # Disaggregated prefill: a prefill instance (kv_producer) hands its KV to a decode
    # instance through a KV connector; refused as a KV connector.
    from vllm.config import KVTransferConfig

    return vllm_config(d, kv_transfer_config=KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_producer"))


CASES = {
    "pipeline-parallel": (_pp2, ["pipeline parallel > 1"], "--pipeline-parallel-size 1"),
    "data-parallel": (_dp2, ["data parallel > 1"], "--data-parallel-size 1"),
    "speculative": (_spec, ["speculative decoding"], "remove --speculative-config"),
    "pooling": (_pooling, ["pooling model"], "--runner generate"),
    "attention-free": (
        lambda d: vllm_config(d, model="mamba"),
        ["attention-free model"],
        "text-only decoder-only attention model (--model)",
    ),
    "hybrid": (
        lambda d: vllm_config(d, model="jamba"),
        ["hybrid (mamba) model"],
        "text-only decoder-only attention model (--model)",
    ),
    "encoder-decoder": (
        lambda d: vllm_config(d, model="whisper"),
        ["multimodal model", "encoder-decoder model"],
        "decoder-only attention model (--model)",
    ),
    "kv-connector": (_kv_connector, ["KV connector"], "remove --kv-transfer-config"),
    "kv-offload": (_kv_offload, ["KV offload"], "remove --kv-offloading-size"),
    "ec-connector": (_ec_connector, ["EC connector"], "remove --ec-transfer-config"),
    "diffusion": (_diffusion, ["diffusion model"], "autoregressive text model (--model)"),
    "aux-output": (_aux, ["aux output connector"], "--enable-return-routed-experts"),
    "sleep-mode": (_sleep_mode, ["sleep mode"], "remove --enable-sleep-mode"),
    "disaggregated-prefill": (_disaggregated_prefill, ["KV connector"], "remove --kv-transfer-config"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_unsupported_mode_is_named_exactly(case, model_dirs):
    build, modes, _ = CASES[case]
    config = build(model_dirs)
    # Exactly the intended modes, nothing else (the tiny Llama itself is supported).
    assert [mode for mode, _ in unsupported_modes(config)] == modes


@pytest.mark.parametrize("cls_path", [SYNC, ASYNC], ids=["sync", "async"])
@pytest.mark.parametrize("case", list(CASES))
def test_feature_on_scheduler_refuses_unsupported_mode(case, cls_path, model_dirs):
    build, modes, fix = CASES[case]
    config = build(model_dirs)
    with pytest.raises(OutputRateConfigError) as err:
        build_scheduler(cls_path, config)
    message = str(err.value)
    for mode in modes:
        assert f"- {mode}:" in message, message
    assert fix in message, message  # says what to change
    assert "removing the output_rate section" in message  # and how to turn the feature off


@pytest.mark.parametrize("case", ["pipeline-parallel", "data-parallel", "speculative", "pooling"])
def test_r18_feature_off_no_checks_same_as_stock(case, model_dirs, monkeypatch):
    # R18: no output_rate section -> no checks at all; the class constructs wherever vLLM's does.
    build, _, _ = CASES[case]
    config = build(model_dirs)
    config.additional_config = {}
    import vllm_output_rate.reference.scheduler as sched_module

    def must_not_run(_):
        raise AssertionError("R18: feature off must not run the start-up checks")

    monkeypatch.setattr(sched_module, "check_engine_supported", must_not_run)
    ours = build_scheduler(SYNC, config)
    stock = build_scheduler(STOCK, config)
    assert ours.rate_limiter is None
    assert ours.max_num_running_reqs == stock.max_num_running_reqs
    assert ours.max_num_active_reqs == stock.max_num_active_reqs


def test_supported_config_constructs(model_dirs):
    # The tiny Llama with tensor parallel 1, prefix caching, chunked prefill: accepted.
    config = vllm_config(model_dirs)
    assert unsupported_modes(config) == []
    scheduler = build_scheduler(SYNC, config)
    assert scheduler.rate_limiter is not None


def test_all_problems_listed_in_one_message(model_dirs):
    # Several unsupported modes at once: one error naming each (no fix-one-retry loop).
    from vllm.config import CacheConfig, ParallelConfig

    config = vllm_config(
        model_dirs,
        model="jamba",
        parallel_config=ParallelConfig(pipeline_parallel_size=2),
        cache_config=CacheConfig(kv_offloading_size=1.0),
    )
    with pytest.raises(OutputRateConfigError) as err:
        check_engine_supported(config)
    message = str(err.value)
    for mode in ("pipeline parallel > 1", "hybrid (mamba) model", "KV offload"):
        assert f"- {mode}:" in message, message
    assert "KV connector" not in message  # offload is reported once, as offload


def test_multimodal_decoder_stand_in():
    # Stand-in (module docstring): multimodal decoders need torchvision to build on this machine.
    config = SimpleNamespace(model_config=SimpleNamespace(is_multimodal_model=True))
    with pytest.raises(OutputRateConfigError, match=r"- multimodal model: .*text-only"):
        check_engine_supported(config)
    assert [m for m, _ in unsupported_modes(SimpleNamespace())] == []  # nothing visible, nothing refused


def test_bad_section_stops_before_vllm_builds_anything(model_dirs, monkeypatch):
    # The output_rate section is parsed before vLLM's constructor runs (bad rate -> no KV manager).
    from vllm.v1.core.sched.scheduler import Scheduler

    config = vllm_config(model_dirs)
    config.additional_config = {"output_rate": {"default_tokens_per_s": -5}}
    monkeypatch.setattr(Scheduler, "__init__", lambda *a, **k: pytest.fail("vLLM's constructor ran"))
    with pytest.raises(OutputRateConfigError, match="-5"):
        build_scheduler(SYNC, config)


# -- the front end refuses before the engine core starts (plugin.py) --------------------
def _engine_args(model_dirs, scheduler_cls=SYNC, **kw):
    """vLLM ``EngineArgs`` on the tiny llama (float32, 256 tokens) with ``scheduler_cls``
    (a dotted path, a class or None: stock vLLM's default), plus the ``kw`` fields."""
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        model=model_dirs["llama"],
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=256,
        scheduler_cls=scheduler_cls,
        **kw,
    )


def test_front_end_refuses_unsupported_mode(model_dirs):
    from vllm_output_rate.reference import plugin

    plugin.register()  # idempotent: vLLM may already have loaded it in this process
    args = _engine_args(model_dirs, additional_config=copy.deepcopy(FEATURE_ON), pipeline_parallel_size=2)
    with pytest.raises(OutputRateConfigError, match=r"- pipeline parallel > 1:"):
        args.create_engine_config()


def test_front_end_refuses_bad_section(model_dirs):
    from vllm_output_rate.reference import plugin

    plugin.register()
    args = _engine_args(model_dirs, additional_config={"output_rate": {"default_tokens_per_s": 0}})
    with pytest.raises(OutputRateConfigError, match="default_tokens_per_s must be > 0"):
        args.create_engine_config()


def test_front_end_feature_off_unchanged(model_dirs):
    from vllm_output_rate.reference import plugin

    plugin.register()
    config = _engine_args(model_dirs, pipeline_parallel_size=2).create_engine_config()
    assert config.parallel_config.pipeline_parallel_size == 2  # R18: accepted as vLLM accepts it


# -- Configuration (issue 15): typos refused in the front end, saying what to change -------
# Plain `vllm serve` runs EngineArgs.create_engine_config in the API-server process before
# the engine core is spawned; the plugin's check there makes the message the last line the
# operator sees (gpu_tests/test_live_config_errors.py checks that on a real `vllm serve`).
class MySubclassScheduler(load_class(SYNC)):
    """A subclass of the reference: implements output_rate, accepted."""


@pytest.mark.parametrize(
    ("kw", "says"),
    [
        (
            {"additional_config": {"output_rate": {"default_token_per_s": 100}}},
            "'default_token_per_s' (did you mean 'default_tokens_per_s'?)",
        ),
        (
            {"additional_config": {"output_rate": {"default_tokens_per_s": 100, "burst": 50}}},
            "'burst' (did you mean 'burst_ms'?)",
        ),
        (
            {"additional_config": {"output_rate": {"user_tokens_per_s": {"a": 5}}}},
            "output_rate is configured without default_tokens_per_s",
        ),
        (
            {
                "additional_config": {"output_rate": {"default_tokens_per_s": 100, "max_num_active_seqs": 16}},
                "max_num_seqs": 8,
            },
            'additional_config["output_rate"]["max_num_active_seqs"] (16) must be <= --max-num-seqs (8)',
        ),
        (
            {"additional_config": {"output_rate": {"default_tokens_per_s": 100}}, "scheduler_cls": None},
            "--scheduler-cls is vLLM's default scheduler, which does not implement it",
        ),
        (
            {"additional_config": {"output_rate": {"default_tokens_per_s": 100}}, "scheduler_cls": STOCK},
            f"--scheduler-cls is {STOCK!r}, which does not implement it",
        ),
        (
            {"additional_config": {"output_rate": {"user_tokens_per_s": {"a": 5}}}, "scheduler_cls": STOCK},
            "add --scheduler-cls vllm_output_rate.reference.scheduler.RateLimitedScheduler",
        ),
        (
            {"additional_config": {"output_rates": {"default_tokens_per_s": 100}}},
            "has a key 'output_rates' but no 'output_rate': did you mean 'output_rate'?",
        ),
        (
            {"additional_config": {"output_rate": {"default_tokens_per_s": 100, "user_tokens_per_s": {"x" * 300: 5}}}},
            "user ids in user_tokens_per_s must be non-empty strings of at most 256 characters",
        ),
    ],
    ids=[
        "misspelt-key",
        "misspelt-burst",
        "no-default",
        "active-above-seqs",
        "stock-default-class",
        "stock-class-path",
        "stock-class-no-default",
        "misspelt-section",
        "override-key-longer-than-a-user-id",
    ],
)
def test_configuration_typo_refused_in_the_front_end(kw, says, model_dirs):
    from vllm_output_rate.reference import plugin

    plugin.register()
    args = _engine_args(model_dirs, **kw)
    with pytest.raises(OutputRateConfigError) as err:
        args.create_engine_config()
    assert says in str(err.value), str(err.value)
    assert "\n" not in str(err.value)  # one line: the last line of the traceback says it all


def test_configuration_accepted_front_end_cases(model_dirs):
    # A subclass of the reference implements the section; an empty section on a class that
    # does not read it changes nothing; a section-less stock engine is untouched (R18).
    from vllm_output_rate.reference import plugin

    plugin.register()
    _engine_args(model_dirs, MySubclassScheduler, additional_config=copy.deepcopy(FEATURE_ON)).create_engine_config()
    _engine_args(model_dirs, None, additional_config={"output_rate": {}}).create_engine_config()
    _engine_args(model_dirs, None, additional_config={"output_rates": {"x": 1}}).create_engine_config()
    config = _engine_args(
        model_dirs,
        max_num_seqs=8,
        additional_config={"output_rate": {"default_tokens_per_s": 100, "max_num_active_seqs": 8}},
    ).create_engine_config()
    assert config.additional_config["output_rate"]["max_num_active_seqs"] == 8


def test_active_cap_above_max_num_seqs_refused_by_the_scheduler_too(model_dirs):
    # The scheduler's constructor is authoritative (the plugin may be filtered out).
    config = vllm_config(model_dirs)
    config.scheduler_config.max_num_seqs = 8
    config.additional_config = {"output_rate": {"default_tokens_per_s": 100, "max_num_active_seqs": 16}}
    with pytest.raises(OutputRateConfigError, match=r"\(16\) must be <= --max-num-seqs \(8\)"):
        build_scheduler(SYNC, config)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (
            '{"output_rate": {"default_tokens_per_s": 5, "default_tokens_per_s": 7}}',
            "key 'default_tokens_per_s' is given twice",
        ),
        (
            '{"output_rate": {"default_tokens_per_s": 5, "user_tokens_per_s": {"a": 5, "a": 7}}}',
            "key 'a' is given twice",
        ),
        (
            '{"output_rate": {"default_tokens_per_s": 5}, "output_rate": {"default_tokens_per_s": 7}}',
            'key "output_rate" is given twice',
        ),
    ],
    ids=["key", "user", "section"],
)
def test_configuration_duplicate_json_keys_refused_by_vllm_parser(text, says, capsys):
    # vLLM parses --additional-config with json.loads (the last of two keys wins); the plugin
    # makes vLLM's own parser refuse a key given twice inside output_rate.
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm_output_rate.reference import plugin

    plugin.register()
    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    with pytest.raises(SystemExit):
        parser.parse_args(["--additional-config", text])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert says in last and "JSON keeps only the last one" in last, last
    # Other keys of additional_config are vLLM's and other plugins': untouched.
    args = parser.parse_args(["--additional-config", '{"other": {"x": 1, "x": 2}, "output_rate": {}}'])
    assert args.additional_config == {"other": {"x": 2}, "output_rate": {}}


def test_unknown_key_suggestion_and_duplicates_helpers():
    from vllm_output_rate.reference.config import parse_output_rate
    from vllm_output_rate.reference.section import loads_no_duplicates, nearest_key

    assert nearest_key("max_active_seqs", ("max_num_active_seqs", "burst_ms")) == "max_num_active_seqs"
    assert nearest_key("zzz", ("max_num_active_seqs",)) is None
    with pytest.raises(OutputRateConfigError, match=r"'zzz'; known keys: default_tokens_per_s, "):
        parse_output_rate({"default_tokens_per_s": 1, "zzz": 1})
    with pytest.raises(OutputRateConfigError, match=r"X: key 'a' is given twice \(5 and 7\)"):
        loads_no_duplicates('{"a": 5, "a": 7}', "X")
    assert loads_no_duplicates('{"a": {"b": 1}, "c": [{"b": 2}]}', "X") == {"a": {"b": 1}, "c": [{"b": 2}]}


def _prefill_cadence(d, interval: int = 4):
    from vllm.config import SchedulerConfig

    return vllm_config(
        d,
        scheduler_config=SchedulerConfig(
            max_model_len=2048, is_encoder_decoder=False, prefill_schedule_interval=interval
        ),
    )


@pytest.mark.parametrize("cls_path", [SYNC, ASYNC], ids=["sync", "async"])
def test_local_prefill_cadence_refused_where_the_scheduler_applies_it(cls_path, model_dirs):
    # vLLM 0.33 holds prefill inside the scheduler until prefill_schedule_interval executed
    # steps have passed while a decode is resident: a throttled user's paused decodes leave
    # the steps empty and hold every other user's prefill (P4). 0.32 applies the interval
    # only in the data-parallel engine core: without data parallelism it is a no-op.
    from vllm_output_rate.reference.vllm_compat import INSTALLED_PROFILE

    applies = INSTALLED_PROFILE.local_prefill_cadence
    config = _prefill_cadence(model_dirs)
    assert [mode for mode, _ in unsupported_modes(config)] == (["local prefill cadence"] if applies else [])
    if applies:
        with pytest.raises(OutputRateConfigError) as err:
            build_scheduler(cls_path, config)
        assert "set --prefill-schedule-interval 1 (got 4)" in str(err.value)
    else:
        assert build_scheduler(cls_path, config).rate_limiter is not None


def _scheduler_has_field(name: str) -> bool:
    import dataclasses

    from vllm.config import SchedulerConfig

    return name in {f.name for f in dataclasses.fields(SchedulerConfig)}


@pytest.mark.parametrize("cls_path", [SYNC, ASYNC], ids=["sync", "async"])
def test_cache_aware_admission_window_refused_in_the_scheduler_and_the_front_end(cls_path, model_dirs):
    # vLLM 0.34 reorders the first N waiting requests by cached prefix (FCFS, prefix caching):
    # an order the spec does not model. With the feature on it is refused at start-up, naming
    # the flag; on releases without the setting an engine configuration cannot carry it, so the
    # duck-typed check is shown on the attribute.
    from vllm.config import SchedulerConfig

    from vllm_output_rate.reference import plugin

    if _scheduler_has_field("cache_aware_admission_window"):
        sched = SchedulerConfig(max_model_len=256, is_encoder_decoder=False, cache_aware_admission_window=8)
        config = vllm_config(model_dirs, scheduler_config=sched)
    else:
        config = vllm_config(model_dirs)
        object.__setattr__(config.scheduler_config, "cache_aware_admission_window", 8)
    assert [mode for mode, _ in unsupported_modes(config)] == ["cache-aware admission"]
    with pytest.raises(OutputRateConfigError) as err:
        build_scheduler(cls_path, config)
    assert "set --cache-aware-admission-window 0 (got 8)" in str(err.value).splitlines()[1]
    if _scheduler_has_field("cache_aware_admission_window"):
        plugin.register()
        args = _engine_args(
            model_dirs, cls_path, additional_config=copy.deepcopy(FEATURE_ON), cache_aware_admission_window=8
        )
        with pytest.raises(OutputRateConfigError, match=r"- cache-aware admission: .*--cache-aware-admission-window 0"):
            args.create_engine_config()
        # Feature off: stock vLLM's setting, untouched (R18).
        _engine_args(model_dirs, cls_path, cache_aware_admission_window=8).create_engine_config()


def test_default_prefill_cadence_is_accepted(model_dirs):
    assert unsupported_modes(_prefill_cadence(model_dirs, interval=1)) == []


@pytest.mark.rules("R18")
@pytest.mark.parametrize("cls_path", [SYNC, ASYNC], ids=["sync", "async"])
def test_r18_empty_section_on_our_class_is_refused_not_off(cls_path, model_dirs):
    # An operator who picks our class and writes {"output_rate": {}} meant the feature on:
    # refused naming the missing default, in the scheduler and in the front end (it used to
    # start with the feature off).
    from vllm_output_rate.reference import plugin

    config = vllm_config(model_dirs)
    config.additional_config = {"output_rate": {}}
    with pytest.raises(OutputRateConfigError, match="is empty: set default_tokens_per_s"):
        build_scheduler(cls_path, config)
    plugin.register()
    with pytest.raises(OutputRateConfigError, match="remove the output_rate section"):
        _engine_args(model_dirs, additional_config={"output_rate": {}}).create_engine_config()


SHARED_URL = "redis://127.0.0.1:1/0"  # never reached: the refill thread absorbs the refusal (R25)


def _dp2_shared(d, **scheduler_kw):
    from vllm.config import ParallelConfig, SchedulerConfig

    kw = (
        {"scheduler_config": SchedulerConfig(max_model_len=2048, is_encoder_decoder=False, **scheduler_kw)}
        if scheduler_kw
        else {}
    )
    config = vllm_config(d, parallel_config=ParallelConfig(data_parallel_size=2), **kw)
    config.additional_config["output_rate"]["shared_budget_url"] = SHARED_URL
    return config


@pytest.mark.rules("R24")
def test_r24_data_parallel_accepted_only_with_a_shared_budget_url(model_dirs):
    # Without a store every rank would grant its own budget: refused, naming the flag to give.
    (fix,) = [fix for mode, fix in unsupported_modes(_dp2(model_dirs)) if mode == "data parallel > 1"]
    assert "give --shared-budget-url" in fix and "--data-parallel-size 1 (got 2)" in fix
    # With one, every rank's scheduler leases from the user's one budget (R23-R26): accepted.
    config = _dp2_shared(model_dirs)
    assert unsupported_modes(config) == []
    scheduler = build_scheduler(SYNC, config)
    try:
        from vllm_output_rate.reference.shared_budget import SharedBudgetLimiter

        assert isinstance(scheduler.rate_limiter, SharedBudgetLimiter)
        assert scheduler.rate_limiter.url == SHARED_URL
    finally:
        scheduler.rate_limiter.close()


def test_data_parallel_with_a_prefill_cadence_is_refused_on_every_release(model_dirs):
    # 0.32's data-parallel engine core and 0.33's scheduler both hold prefill to the cadence.
    found = unsupported_modes(_dp2_shared(model_dirs, prefill_schedule_interval=4))
    assert [mode for mode, _ in found] == ["local prefill cadence"]


def test_data_parallel_ranks_write_their_own_trace(model_dirs, tmp_path):
    from vllm_output_rate.reference.trace import rank_trace_path

    path = str(tmp_path / "t.jsonl")
    config = _dp2_shared(model_dirs)
    assert rank_trace_path(path, config) == path  # rank 0
    config.parallel_config.reconfigure_for_independent_dp_rank()  # what vLLM does in a dense model's rank
    config.parallel_config.data_parallel_index = 1
    assert config.parallel_config.data_parallel_size == 1
    assert rank_trace_path(path, config) == path + ".dp1"
    assert rank_trace_path(path, vllm_config(model_dirs)) == path
