"""Config styles (adapter/configstyle.py): how the gate configures the class under test.

Every style must build a config the stock vLLM scheduler accepts and that carries the
shape exactly; the engine-args style goes through vLLM's own ``EngineArgs`` path and must
fail clearly when the candidate lacks the article's flags (stock vLLM has none); the hook
style hands the documented dict to a user function.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

import pytest

from vllm_output_rate.adapter import configstyle, tinymodel
from vllm_output_rate.adapter import engine_shape as engine_shape_module
from vllm_output_rate.adapter.configstyle import (
    AdditionalConfigStyle,
    EngineArgsStyle,
    HookStyle,
    engine_argv,
    parse_config_style,
    rates_of,
)
from vllm_output_rate.adapter.engine_shape import EngineShape
from vllm_output_rate.adapter.harness import REFERENCE_SCHEDULER, STOCK_ASYNC_SCHEDULER, STOCK_SCHEDULER, Harness

MS = 1_000_000
RATES = {"default_tokens_per_s": "10", "user_tokens_per_s": {"u0": "3.5", "u1": "20"}}  # as scenarios write them
HOOK = f"{__name__}.record_hook"
CARRY_HOOK = f"{__name__}.additional_config_hook"

# -- test hooks ------------------------------------------------------------------------
HOOK_CALLS: list[tuple[object, dict]] = []


def record_hook(vllm_config, rates) -> None:
    """Test hook: record the call."""
    HOOK_CALLS.append((vllm_config, json.loads(json.dumps(rates))))


def additional_config_hook(vllm_config, rates) -> None:
    """Test hook: put the rates where the reference reads them."""
    section = {"default_tokens_per_s": rates["default_tokens_per_s"], "user_tokens_per_s": rates["user_tokens_per_s"]}
    if "burst_ms" in rates:
        section["burst_ms"] = rates["burst_ms"]
    vllm_config.additional_config["output_rate"] = section


def returning_hook(vllm_config, rates):
    """Test hook that wrongly returns a value."""
    return vllm_config


NOT_A_FUNCTION = 3


@pytest.fixture(autouse=True)
def _clear_hook_calls():
    HOOK_CALLS.clear()
    yield
    HOOK_CALLS.clear()


# -- helpers ---------------------------------------------------------------------------
def run_to_end(h: Harness, max_steps: int = 500) -> None:
    for _ in range(max_steps):
        if len(h.finished) == len(h.num_outputs) and h._in_flight is None:
            return
        if not h.scheduler.has_requests():
            h.drain()
            continue
        h.step()
        h.advance(10 * MS)
    raise AssertionError(f"requests did not finish: {h.finished}")


def scheduler_view(config) -> dict:
    """The scheduler and cache settings the class under test reads."""
    sc, cc = config.scheduler_config, config.cache_config
    return {
        "max_num_seqs": sc.max_num_seqs,
        "max_num_active_seqs": sc.max_num_active_seqs,
        "max_num_batched_tokens": sc.max_num_batched_tokens,
        "enable_chunked_prefill": sc.enable_chunked_prefill,
        "policy": sc.policy,
        "async_scheduling": sc.async_scheduling,
        "max_model_len": config.model_config.max_model_len,
        "block_size": cc.block_size,
        "num_gpu_blocks": cc.num_gpu_blocks,
        "enable_prefix_caching": cc.enable_prefix_caching,
    }


def expected_view(shape: EngineShape) -> dict:
    return {
        "max_num_seqs": shape.max_num_seqs,
        "max_num_active_seqs": shape.max_num_active_seqs,
        "max_num_batched_tokens": shape.max_num_batched_tokens,
        "enable_chunked_prefill": shape.chunked_prefill,
        "policy": shape.policy,
        "async_scheduling": shape.async_scheduling,
        "max_model_len": shape.max_model_len,
        "block_size": shape.block_size,
        "num_gpu_blocks": shape.num_blocks,
        "enable_prefix_caching": shape.enable_prefix_caching,
    }


SHAPES = [
    EngineShape(),
    EngineShape(
        max_num_seqs=3,
        max_num_active_seqs=2,
        max_num_batched_tokens=32,
        block_size=8,
        num_blocks=40,
        policy="priority",
        async_scheduling=True,
    ),
    EngineShape(
        max_num_seqs=5,
        chunked_prefill=False,
        max_num_batched_tokens=512,
        max_model_len=512,
        block_size=32,
        num_blocks=77,
        enable_prefix_caching=True,
    ),
]
SHAPE_IDS = ["default", "pressured-priority-async", "unchunked-prefix-caching"]


# -- every style: a config the stock scheduler accepts ----------------------------------
@pytest.mark.parametrize("style_text", ["additional-config", "engine-args", f"hook:{HOOK}"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_stock_scheduler_runs_on_every_style(style_text, async_scheduling):
    style = parse_config_style(style_text)
    # Stock vLLM has no rate flags: the engine-args style can only run it with the feature off.
    rates = None if style_text == "engine-args" else RATES
    shape = EngineShape(max_num_seqs=4, async_scheduling=async_scheduling, output_rate=rates)
    cls = STOCK_ASYNC_SCHEDULER if async_scheduling else STOCK_SCHEDULER
    h = Harness(cls, shape, style=style)
    assert h.style is style
    for i in range(3):
        h.add_request(f"r{i}", f"u{i}", prompt_len=5 + i, max_tokens=6, eos_index=3 if i == 0 else None)
    run_to_end(h)
    assert h.finished == {"r0": ("stop", 4), "r1": ("length", 6), "r2": ("length", 6)}
    assert len(HOOK_CALLS) == (1 if style_text.startswith("hook:") else 0)


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("style_text", ["additional-config", "engine-args", f"hook:{HOOK}"])
def test_every_style_carries_the_shape(style_text, shape):
    style = parse_config_style(style_text)
    config = style.build_vllm_config(shape)
    want = expected_view(shape)
    if not isinstance(style, EngineArgsStyle):
        # vLLM's CPU platform forces async scheduling off; only engine-args restores it.
        want["async_scheduling"] = False
    assert scheduler_view(config) == want
    scheduler = Harness(
        STOCK_ASYNC_SCHEDULER if shape.async_scheduling else STOCK_SCHEDULER, shape, style=style
    ).scheduler
    assert scheduler.max_num_running_reqs == shape.max_num_seqs
    assert scheduler.max_num_active_reqs == (shape.max_num_active_seqs or shape.max_num_seqs)
    assert scheduler.max_num_scheduled_tokens == shape.max_num_batched_tokens
    assert scheduler.policy.value == shape.policy
    assert scheduler.kv_cache_manager.enable_caching == shape.enable_prefix_caching
    # Every block but vLLM's null block is free.
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == shape.num_blocks - 1


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_engine_args_config_equals_direct_config(shape):
    """Beyond the fields the gate names: vLLM's CLI path and the direct constructors agree
    on every scheduler and cache setting (async scheduling apart, restored on purpose)."""
    via_flags = EngineArgsStyle().build_vllm_config(shape)
    direct = AdditionalConfigStyle().build_vllm_config(shape)
    for part in ("scheduler_config", "cache_config"):
        a, b = getattr(via_flags, part), getattr(direct, part)
        differ = {
            f.name: (getattr(a, f.name), getattr(b, f.name))
            for f in dataclasses.fields(a)
            if getattr(a, f.name) != getattr(b, f.name)
        }
        if part == "scheduler_config" and shape.async_scheduling:
            assert differ.pop("async_scheduling") == (True, False)
        assert differ == {}, part


def test_engine_argv_from_shape():
    shape = SHAPES[1]
    argv = engine_argv(shape)
    pairs = dict(itertools.pairwise(argv))
    assert pairs["--model"] == str(tinymodel.default_model_dir())
    assert pairs["--max-num-seqs"] == "3" and pairs["--max-num-active-seqs"] == "2"
    assert pairs["--max-num-batched-tokens"] == "32" and pairs["--block-size"] == "8"
    assert pairs["--scheduling-policy"] == "priority" and pairs["--dtype"] == "float32"
    assert {
        "--skip-tokenizer-init",
        "--enable-chunked-prefill",
        "--no-enable-prefix-caching",
        "--async-scheduling",
    } <= set(argv)
    # Feature off: no rate flags at all; no active cap: no --max-num-active-seqs.
    plain = engine_argv(EngineShape())
    assert not any("output-tokens-per-second" in a for a in plain)
    assert "--max-num-active-seqs" not in plain
    on = engine_argv(EngineShape(output_rate=RATES))
    assert on[-4:] == [
        "--default-user-output-tokens-per-second",
        "10",
        "--user-output-tokens-per-second",
        '{"u0": 3.5, "u1": 20}',
    ]
    only_users = engine_argv(EngineShape(output_rate={"user_tokens_per_s": {"a": 2}}))
    assert "--default-user-output-tokens-per-second" not in only_users
    assert only_users[-2:] == ["--user-output-tokens-per-second", '{"a": 2}']
    # The section's own active cap is the article's single --max-num-active-seqs.
    capped = engine_argv(EngineShape(output_rate={"default_tokens_per_s": 5, "max_num_active_seqs": 2}))
    assert dict(itertools.pairwise(capped))["--max-num-active-seqs"] == "2"


def test_engine_args_cache_hands_out_independent_copies():
    style = EngineArgsStyle()
    shape = EngineShape(max_num_seqs=6, num_blocks=99)
    first = style.build_vllm_config(shape)
    entries = len(configstyle._CONFIG_CACHE)
    first.scheduler_config.max_num_seqs = 1
    first.cache_config.num_gpu_blocks = 1
    first.additional_config["x"] = 1
    second = EngineArgsStyle().build_vllm_config(shape)
    assert len(configstyle._CONFIG_CACHE) == entries, "the second build is a cache hit"
    assert second is not first and second.scheduler_config is not first.scheduler_config
    assert second.model_config is not first.model_config
    assert scheduler_view(second) == expected_view(shape) | {"async_scheduling": False}
    assert second.additional_config == {}
    other = style.build_vllm_config(dataclasses.replace(shape, num_blocks=12))
    assert other.cache_config.num_gpu_blocks == 12  # set after the copy, not part of the key


# -- engine-args: clear errors ---------------------------------------------------------
def test_engine_args_without_article_flags_says_what_to_do():
    # Stock vLLM 0.32 has no rate flags.
    with pytest.raises(ValueError) as error:
        EngineArgsStyle().build_vllm_config(EngineShape(output_rate=RATES))
    message = str(error.value)
    assert "candidate does not add --default-user-output-tokens-per-second to vLLM's engine arguments" in message
    assert "--config-style additional-config" in message and "hook:" in message
    with pytest.raises(ValueError, match="does not add --user-output-tokens-per-second"):
        EngineArgsStyle().build_vllm_config(EngineShape(output_rate={"user_tokens_per_s": {"a": 2}}))
    with pytest.raises(ValueError, match="does not add"):
        Harness(STOCK_SCHEDULER, EngineShape(output_rate=RATES), style=EngineArgsStyle())


@pytest.mark.parametrize(
    "section, match",
    [
        (dict(RATES, burst_ms=50), "burst_ms=50.*no burst flag"),
        (dict(RATES, trace_path="/tmp/t.jsonl"), r"\['trace_path'\] have no engine flag"),
    ],
)
def test_engine_args_rejects_what_the_article_cannot_express(section, match):
    with pytest.raises(ValueError, match=match):
        EngineArgsStyle().build_vllm_config(EngineShape(output_rate=section))


def test_engine_args_rejects_two_active_caps():
    shape = EngineShape(max_num_active_seqs=3, output_rate={"default_tokens_per_s": 5, "max_num_active_seqs": 2})
    with pytest.raises(ValueError, match="max_num_active_seqs=2 differs from the engine's max_num_active_seqs=3"):
        engine_argv(shape)


# -- engine-args with the flags: a test-only shim of the article's fork ----------------
ARTICLE_FIELDS = {
    "--default-user-output-tokens-per-second": "default_user_output_tokens_per_second",
    "--user-output-tokens-per-second": "user_output_tokens_per_second",
}


def install_flag_shim(monkeypatch, carry: bool) -> None:
    """Add the article's two flags to EngineArgs's parser; with ``carry`` also bring their
    values into ``additional_config["article"]`` (monkeypatched: undone after the test)."""
    from vllm.engine.arg_utils import EngineArgs

    add_cli_args = EngineArgs.add_cli_args
    from_cli_args = EngineArgs.from_cli_args.__func__
    create_engine_config = EngineArgs.create_engine_config

    def shim_add_cli_args(parser):
        parser = add_cli_args(parser)
        group = parser.add_argument_group("article")
        group.add_argument("--default-user-output-tokens-per-second", type=float, default=None)
        group.add_argument("--user-output-tokens-per-second", type=json.loads, default=None)
        return parser

    monkeypatch.setattr(EngineArgs, "add_cli_args", staticmethod(shim_add_cli_args))
    if not carry:
        return

    def shim_from_cli_args(cls, args):
        engine_args = from_cli_args(cls, args)
        # from_cli_args keeps only dataclass fields: carry ours by hand.
        engine_args._article = {dest: getattr(args, dest) for dest in ARTICLE_FIELDS.values()}
        return engine_args

    def shim_create_engine_config(self, *args, **kwargs):
        config = create_engine_config(self, *args, **kwargs)
        config.additional_config["article"] = dict(getattr(self, "_article", {}))
        return config

    monkeypatch.setattr(EngineArgs, "from_cli_args", classmethod(shim_from_cli_args))
    monkeypatch.setattr(EngineArgs, "create_engine_config", shim_create_engine_config)


def test_from_cli_args_drops_flags_that_are_not_dataclass_fields(monkeypatch):
    """What a fork must handle: parsed flags without an EngineArgs field never reach the config."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    install_flag_shim(monkeypatch, carry=False)
    argv = engine_argv(EngineShape(output_rate=RATES))
    args = EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(argv)
    assert args.default_user_output_tokens_per_second == 10.0
    assert args.user_output_tokens_per_second == {"u0": 3.5, "u1": 20}
    engine_args = EngineArgs.from_cli_args(args)
    field_names = {f.name for f in dataclasses.fields(EngineArgs)}
    for dest in ARTICLE_FIELDS.values():
        assert dest not in field_names and not hasattr(engine_args, dest)
    # So the style builds (the parser knows the flags), but nothing of the rates arrives.
    config = EngineArgsStyle().build_vllm_config(EngineShape(output_rate=RATES))
    assert config.additional_config == {}
    assert not any(hasattr(config.scheduler_config, d) for d in ARTICLE_FIELDS.values())


def test_engine_args_rate_flags_arrive_through_a_fork(monkeypatch):
    install_flag_shim(monkeypatch, carry=True)
    shape = EngineShape(max_num_seqs=4, max_num_active_seqs=2, output_rate=RATES)
    config = EngineArgsStyle().build_vllm_config(shape)
    assert config.additional_config["article"] == {
        "default_user_output_tokens_per_second": 10.0,
        "user_output_tokens_per_second": {"u0": 3.5, "u1": 20},
    }
    assert config.scheduler_config.max_num_active_seqs == 2
    # The stock class ignores the flags and still runs on this config.
    h = Harness(STOCK_SCHEDULER, shape, style=EngineArgsStyle())
    h.add_request("a", "u0", max_tokens=3)
    run_to_end(h)
    assert h.finished == {"a": ("length", 3)}
    # Feature off: no rate flags, nothing carried.
    off = EngineArgsStyle().build_vllm_config(EngineShape())
    assert off.additional_config["article"] == dict.fromkeys(ARTICLE_FIELDS.values())
    # Once the shim is gone, the same shape fails again: the config cache is not stale.
    monkeypatch.undo()
    with pytest.raises(ValueError, match="does not add --default-user-output-tokens-per-second"):
        EngineArgsStyle().build_vllm_config(shape)


# -- hook style ------------------------------------------------------------------------
def test_hook_gets_the_documented_rates():
    shape = EngineShape(max_num_active_seqs=3, output_rate=RATES)
    config = HookStyle(HOOK).build_vllm_config(shape)
    assert len(HOOK_CALLS) == 1
    called_with, rates = HOOK_CALLS[0]
    assert called_with is config
    assert rates == {"default_tokens_per_s": 10, "user_tokens_per_s": {"u0": 3.5, "u1": 20}, "max_num_active_seqs": 3}
    assert type(rates["default_tokens_per_s"]) is int and type(rates["user_tokens_per_s"]["u0"]) is float
    assert config.additional_config == {}, "the hook style puts no output_rate section"


def test_hook_rates_burst_and_own_active_cap():
    section = {"default_tokens_per_s": 2.5, "max_num_active_seqs": 1, "burst_ms": 40}
    HookStyle(HOOK).build_vllm_config(EngineShape(output_rate=section))
    assert HOOK_CALLS[-1][1] == {
        "default_tokens_per_s": 2.5,
        "user_tokens_per_s": {},
        "max_num_active_seqs": 1,
        "burst_ms": 40,
    }
    assert rates_of(EngineShape(output_rate={"user_tokens_per_s": {"a": "7/2"}})) == {
        "default_tokens_per_s": None,
        "user_tokens_per_s": {"a": 3.5},
        "max_num_active_seqs": None,
    }


def test_hook_not_called_when_the_feature_is_off():
    config = HookStyle(HOOK).build_vllm_config(EngineShape(output_rate=None))
    assert HOOK_CALLS == []
    assert config.additional_config == {}


def test_hook_placing_the_section_matches_additional_config():
    """A hook that writes additional_config["output_rate"] gives the reference exactly the
    run it has when configured directly (same limits, same steps)."""
    from vllm_output_rate.adapter.scenario_run import build_harness
    from vllm_output_rate.adapter.scenarios import RequestSpec, Scenario

    scenario = Scenario(
        rates_tokens_per_s={"u0": "20", "u1": "3.5"},
        requests=tuple(RequestSpec(f"u{i % 2}-r{i}", f"u{i % 2}", 4 + i, 5) for i in range(4)),
        step_interval_ns=20 * MS,
        num_steps=30,
    )
    runs = []
    for style in (None, HookStyle(CARRY_HOOK)):
        h = build_harness(REFERENCE_SCHEDULER, scenario, style)
        for r in scenario.requests:
            h.add_request(r.request_id, r.user, r.prompt_len, r.max_tokens)
        traces = []
        for _ in range(scenario.num_steps):
            t = h.step()
            traces.append((t.scheduled, t.sampled, t.finished))
            h.advance(scenario.step_interval_ns)
        runs.append(traces)
    assert runs[0] == runs[1]
    sampled_u1 = sum(rid.startswith("u1") for _, sampled, _ in runs[0] for rid in sampled)
    assert 1 < sampled_u1 < 10, "u1 at 3.5 tokens/s is throttled over 600 ms"


def test_hook_must_return_none():
    with pytest.raises(ValueError, match="returned VllmConfig, expected None"):
        HookStyle(f"{__name__}.returning_hook").build_vllm_config(EngineShape(output_rate=RATES))


@pytest.mark.parametrize(
    "dotted, match",
    [
        ("no_dots", "dotted path pkg.module.function"),
        (f"{__name__}:record_hook", "dotted path pkg.module.function"),
        ("no_such_pkg_xyz.mod.fn", "cannot import module 'no_such_pkg_xyz.mod'"),
        (f"{__name__}.no_such_hook", "has no function 'no_such_hook'"),
        (f"{__name__}.NOT_A_FUNCTION", "has no function 'NOT_A_FUNCTION'"),
    ],
)
def test_bad_hook_path(dotted, match):
    with pytest.raises(ValueError, match=match) as error:
        parse_config_style(f"hook:{dotted}")
    assert repr(dotted) in str(error.value)


# -- parse_config_style, defaults ------------------------------------------------------
def test_parse_config_style_forms():
    assert isinstance(parse_config_style("additional-config"), AdditionalConfigStyle)
    assert isinstance(parse_config_style("engine-args"), EngineArgsStyle)
    hook = parse_config_style(f"hook:{HOOK}")
    assert isinstance(hook, HookStyle) and hook.function is record_hook
    assert [parse_config_style(t).name for t in ("additional-config", "engine-args", f"hook:{HOOK}")] == [
        "additional-config",
        "engine-args",
        f"hook:{HOOK}",
    ]


@pytest.mark.parametrize(
    "bad", ["", "engine_args", "Additional-Config", "additional_config", "hooks:x.y", " engine-args"]
)
def test_parse_config_style_rejects(bad):
    with pytest.raises(ValueError) as error:
        parse_config_style(bad)
    message = str(error.value)
    assert repr(bad) in message
    for form in ("additional-config", "engine-args", "hook:pkg.module.function"):
        assert form in message


def test_harness_default_style_is_additional_config(monkeypatch):
    """Callers that patch engine_shape.build_vllm_config keep working (the default delegates)."""
    calls = []
    build = engine_shape_module.build_vllm_config

    def spy(shape):
        calls.append(shape)
        return build(shape)

    monkeypatch.setattr(engine_shape_module, "build_vllm_config", spy)
    shape = EngineShape(output_rate={"default_tokens_per_s": 10}, enable_prefix_caching=True)
    h = Harness(REFERENCE_SCHEDULER, shape)
    assert isinstance(h.style, AdditionalConfigStyle) and calls == [shape]
    assert h.scheduler.vllm_config.additional_config == {"output_rate": {"default_tokens_per_s": 10}}
    assert h.scheduler.kv_cache_manager.enable_caching


# -- the independent implementation of the article, when present ------------------------
FIXTURES = Path(__file__).parent / "fixtures"
needs_article = pytest.mark.skipif(
    not (FIXTURES / "article_style" / "flags.py").exists(), reason="tests/fixtures/article_style absent"
)


def run_article(shape: EngineShape, style) -> tuple[Harness, list[str]]:
    cls = (
        "article_style.scheduler.ArticleAsyncScheduler"
        if shape.async_scheduling
        else "article_style.scheduler.ArticleScheduler"
    )
    h = Harness(cls, shape, style=style)
    for i in range(2):
        h.add_request(f"slow{i}", "slow", max_tokens=4)
    h.add_request("fast", "fast", max_tokens=4)
    sampled = []
    for _ in range(20):  # 200 ms
        sampled += h.step().sampled
        h.advance(10 * MS)
    return h, sampled


@needs_article
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_article_scheduler_through_engine_args(article_flags, async_scheduling):
    section = {"default_tokens_per_s": 100, "user_tokens_per_s": {"slow": 5}}
    shape = EngineShape(max_num_seqs=4, async_scheduling=async_scheduling, output_rate=section)
    h, sampled = run_article(shape, EngineArgsStyle())
    sc = h.scheduler.scheduler_config
    assert (sc.default_user_output_tokens_per_second, sc.user_output_tokens_per_second) == (100, {"slow": 5})
    assert sc.async_scheduling == async_scheduling
    assert "fast" in h.finished and h.finished["fast"][1] == 4
    slow = sum(rid.startswith("slow") for rid in sampled)
    # Unthrottled, the two slow streams sample 8 times within ~6 steps; at 5 tokens/s far fewer.
    assert 1 <= slow < 8, sampled
    # The feature off: no rate flags; the article class runs like the stock one.
    h, sampled = run_article(dataclasses.replace(shape, output_rate=None), EngineArgsStyle())
    assert getattr(h.scheduler.scheduler_config, "default_user_output_tokens_per_second", None) is None
    assert sum(rid.startswith("slow") for rid in sampled) == 8


@needs_article
def test_article_scheduler_through_its_hook(article_flags):
    """The article's own hook (``article_style.hook.configure``) and its flags give the
    article scheduler the same run."""
    section = {"default_tokens_per_s": 100, "user_tokens_per_s": {"slow": 5}}
    shape = EngineShape(max_num_seqs=4, output_rate=section)
    _, via_flags = run_article(shape, EngineArgsStyle())
    _, via_hook = run_article(shape, parse_config_style("hook:article_style.hook.configure"))
    assert via_hook == via_flags


def test_article_flags_reject_fractional_rates_clearly(monkeypatch):
    """A fork whose flag parser rejects a value: a ValueError carrying argparse's message,
    nothing printed, no SystemExit."""
    from vllm.engine.arg_utils import EngineArgs

    add_cli_args = EngineArgs.add_cli_args

    def int_rates(parser):
        parser = add_cli_args(parser)
        parser.add_argument("--default-user-output-tokens-per-second", type=int)
        return parser

    monkeypatch.setattr(EngineArgs, "add_cli_args", staticmethod(int_rates))
    with pytest.raises(ValueError, match=r"reject .*invalid int value: '3\.5'"):
        EngineArgsStyle().build_vllm_config(EngineShape(output_rate={"default_tokens_per_s": "3.5"}))


def test_conform_refuses_a_style_the_candidate_cannot_take_as_a_usage_error():
    # A gate set up wrong is exit 2 (click usage error) naming --config-style, before any
    # check runs; it used to end "REJECTED" (exit 1) with a "counterexample".
    from click.testing import CliRunner

    from vllm_output_rate.cli import main

    result = CliRunner().invoke(
        main,
        [
            "conform",
            "--sync-only",
            "--level",
            "must",
            "--config-style",
            "engine-args",
            "--scheduler-cls",
            REFERENCE_SCHEDULER,
        ],
    )
    assert result.exit_code == 2, result.output
    assert "--config-style" in result.output and "does not add --default-user-output-tokens-per-second" in " ".join(
        result.output.split()
    )
    assert "REJECTED" not in result.output


def test_conform_refuses_a_class_that_is_not_a_scheduler():
    from click.testing import CliRunner

    from vllm_output_rate.cli import main

    result = CliRunner().invoke(
        main, ["conform", "--sync-only", "--scheduler-cls", "vllm_output_rate.reference.limiter.OutputRateLimiter"]
    )
    assert result.exit_code == 2, result.output
    assert "is not a vLLM scheduler class" in " ".join(result.output.split())


def test_conform_stops_with_a_usage_error_naming_integer_rates_when_the_flags_refuse_fractions(article_flags):
    # The article's flags parse integers: without --integer-rates every fractional-rate
    # scenario used to fail as "crash: ArticleScheduler raised ValueError" and end REJECTED.
    from click.testing import CliRunner

    from vllm_output_rate.cli import main

    args = ["conform", "--sync-only", "--level", "must", "--config-style", "engine-args", "--no-spec-health"]
    args += ["--path", str(FIXTURES), "--scheduler-cls", "article_style.scheduler.ArticleScheduler"]
    result = CliRunner().invoke(main, args)
    output = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert "--integer-rates" in output and "refuse the fractional rate 3.5 tokens/s" in output and "got 3.5" in output
    assert "crash" not in output and "REJECTED" not in output
