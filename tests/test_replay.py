"""`outrate replay` re-runs every kind of counterexample `outrate conform` saves.

The gate saves two JSON formats (``adapter/conform.py``): a rate-limit ``Scenario``
(checks rate-limit/*, invariants/*) and a ``StepScenario`` (checks base-fidelity/*, with
the feature off, and white-box/*, with it on). Each test saves a counterexample that fails
on one class and replays it through the command line: exit 1 and the failure on that
class, exit 0 on the reference.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from fractions import Fraction

import pytest
from click.testing import CliRunner
from test_gate import one_stream_of_8_tokens_at_10_tok_s
from test_spec_step import TWO_USERS_THREE_STREAMS

from vllm_output_rate.adapter import conform as gate
from vllm_output_rate.adapter.fidelity import StepScenario
from vllm_output_rate.adapter.harness import REFERENCE_SCHEDULER, STOCK_SCHEDULER
from vllm_output_rate.adapter.scenarios import Hunt
from vllm_output_rate.cli import main
from vllm_output_rate.spec.events import AddRequest, Step
from vllm_output_rate.spec.state import EngineConfig

MS = 1_000_000
NO_ROTATION = "vllm_output_rate.adapter.mutants.NoRotation"

# A stock-vLLM subclass that breaks V4 with the feature off: every chunk is cut to 1 token.
# Written to a temporary module, as a third-party patch would be (no mutant of
# adapter/mutants.py differs from stock vLLM with the feature off: they all defer to it).
ONE_TOKEN_CHUNKS = """
from vllm.v1.core.sched.scheduler import Scheduler


class OneTokenChunks(Scheduler):
    def _reserve_prefill_lookahead(self, request, num_computed_tokens, num_new_tokens):
        return min(super()._reserve_prefill_lookahead(request, num_computed_tokens, num_new_tokens), 1)
"""


def replay(path, *args):
    """``outrate replay PATH ARGS`` in this process: (exit code, output)."""
    result = CliRunner().invoke(main, ["replay", str(path), *args])
    return result.exit_code, result.output


def assert_fails_then_passes(path, failing_cls: str, failure: tuple[str, ...], passed: str) -> None:
    """Replaying the counterexample ``path`` on ``failing_cls`` exits 1, its output holding
    every string of ``failure``; replayed on the file's default class it exits 0, printing
    ``passed``."""
    code, out = replay(path, "--scheduler-cls", failing_cls)
    assert code == 1, out
    assert all(part in out for part in failure), out
    code, out = replay(path)
    assert code == 0, out
    assert passed in out


def add(rid, user, prompt=4, max_tokens=16):
    return AddRequest(rid, user=user, prompt_len=prompt, max_tokens=max_tokens)


@pytest.mark.rules("R2")
def test_r2_rate_limit_counterexample_replays(tmp_path):
    # Rate 10 tok/s, one stream of 8 tokens, a step every 10 ms: stock vLLM samples every
    # step, the third one at t=20 ms is over the rate (the spec limiter refuses it, R2).
    scenario = one_stream_of_8_tokens_at_10_tok_s(prompt_len=3, step_interval_ns=10 * MS, num_steps=61)
    path = tmp_path / "counterexample-rate-limit-sync.json"
    path.write_text(scenario.to_json())  # what adapter/conform.check_scheduler saves
    assert_fails_then_passes(
        path, STOCK_SCHEDULER, ("rate-limit scenario", "FAIL [must] R2"), f"PASS 61 steps on {REFERENCE_SCHEDULER}"
    )


@pytest.mark.rules("R14")
def test_r14_white_box_counterexample_replays(tmp_path):
    # tests/test_spec_step.py two_users_three_streams: at t=200 ms rotation (R14) serves
    # a1 after the last-served a0; the NoRotation mutant schedules a0 again.
    config = EngineConfig(
        max_num_seqs=4, max_num_batched_tokens=64, block_size=4, num_blocks=65, default_rate_tokens_per_s=Fraction(10)
    )
    path = tmp_path / "counterexample-white-box-sync.json"
    path.write_text(StepScenario(config, TWO_USERS_THREE_STREAMS).to_json())
    assert_fails_then_passes(
        path,
        NO_ROTATION,
        ("white box", "FAIL event 8: scheduled: NoRotation [('a0', 1), ('b0', 1)]"),  # the class by its name
        f"PASS 9 events, 4 steps: {REFERENCE_SCHEDULER} agrees with the spec",
    )


def test_white_box_counterexample_saved_by_the_gate_replays_from_the_command_line(tmp_path):
    # The gate's white-box check on stock vLLM (which ignores the output_rate section) fails
    # and saves its counterexample; the installed command replays it.
    result = gate.check_white_box(STOCK_SCHEDULER, False, Hunt(20, save_dir=tmp_path))
    assert result.result == "fail" and result.saved
    outrate = [sys.executable, "-m", "vllm_output_rate.cli", "replay", result.saved]
    env = dict(os.environ, VLLM_LOGGING_LEVEL="ERROR")
    bad = subprocess.run(outrate + ["--scheduler-cls", STOCK_SCHEDULER], capture_output=True, text=True, env=env)
    assert bad.returncode == 1, bad.stdout[-2000:] + bad.stderr[-2000:]
    assert "FAIL event" in bad.stdout and "first difference" in bad.stdout
    good = subprocess.run(outrate, capture_output=True, text=True, env=env)
    assert good.returncode == 0, good.stdout[-2000:] + good.stderr[-2000:]
    assert f"{REFERENCE_SCHEDULER} agrees with the spec" in good.stdout


def test_v4_base_fidelity_counterexample_replays(tmp_path, monkeypatch):
    # Feature off: the spec predicts stock vLLM, and the reference too (R18). A class that
    # cuts chunks to 1 token differs at the first step.
    (tmp_path / "outrate_replay_patch.py").write_text(ONE_TOKEN_CHUNKS)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, block_size=4, num_blocks=65)
    path = tmp_path / "counterexample-base-fidelity-sync.json"
    path.write_text(StepScenario(config, (add("A", "u", prompt=6, max_tokens=3), Step(), Step())).to_json())
    code, out = replay(path, "--scheduler-cls", "outrate_replay_patch.OneTokenChunks")
    assert code == 1, out
    assert "base fidelity" in out and "FAIL event 1: scheduled" in out
    code, out = replay(path, "--scheduler-cls", REFERENCE_SCHEDULER)
    assert code == 0, out
    code, out = replay(path)  # default: stock vLLM, the class base fidelity judges
    assert code == 0 and STOCK_SCHEDULER in out, out


def test_unknown_file_format_is_refused_naming_the_keys(tmp_path):
    path = tmp_path / "other.json"
    path.write_text('{"checks": []}')
    code, out = replay(path)
    assert code == 2
    assert "neither a counterexample file" in out and "rate-limit scenario" in out and "['checks']" in out


def _edited_rate_limit_file(tmp_path, edit):
    """A saved rate-limit counterexample (as `outrate conform` writes it) after ``edit``
    changed its decoded JSON in place."""
    data = json.loads(
        one_stream_of_8_tokens_at_10_tok_s(prompt_len=3, step_interval_ns=10 * MS, num_steps=61).to_json()
    )
    edit(data)
    path = tmp_path / "counterexample-rate-limit-sync.json"
    path.write_text(json.dumps(data))
    return path


def _set(*keys_and_value):
    *keys, value = keys_and_value

    def edit(data):
        for key in keys[:-1]:
            data = data[key]
        data[keys[-1]] = value

    return edit


def _drop(key):
    return lambda data: data.pop(key)


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        (_set("default_rate_tokens_per_s", "-1"), "default_rate_tokens_per_s: a rate must be a positive finite"),
        (_set("default_rate_tokens_per_s", "NaN"), "got 'NaN'"),
        (_set("default_rate_tokens_per_s", "abc"), "default_rate_tokens_per_s: a rate must be"),
        (_set("default_rate_tokens_per_s", "Infinity"), "got 'Infinity'"),
        (_set("rates_tokens_per_s", {"u": "0"}), "rates_tokens_per_s['u']: a rate must be"),
        (_set("rates_tokens_per_s", {"": "5"}), "rates_tokens_per_s key: a user id must be a non-empty string"),
        (_set("requests", 0, "user", ""), "requests[0].user: a user id must be a non-empty string of at most 256"),
        (_set("requests", 0, "user", "x" * 300), "(302 characters)"),
        (_set("num_steps", -5), "num_steps: must be an integer >= 1, got -5"),
        (_set("num_steps", "61"), "num_steps: must be an integer >= 1, got '61'"),
        (_set("requests", 0, "max_tokens", 0), "requests[0].max_tokens: must be an integer >= 1, got 0"),
        (_set("policy", "lifo"), 'policy: must be "fcfs" or "priority", got \'lifo\''),
        (_set("feature_on", "yes"), "feature_on: must be true or false"),
        (_set("advances_ns", [1, -2]), "advances_ns[1]: must be an integer >= 0, got -2"),
        (_set("requests", 0, "prompt", 3), "requests[0]: unknown key(s) 'prompt'"),
        (_set("num_step", 3), "the scenario: unknown key(s) 'num_step'"),
        (_drop("num_steps"), "the scenario: missing key(s) num_steps"),
        (_set("requests", [{"request_id": "a"}]), "requests[0]: missing key(s) user, prompt_len, max_tokens"),
        (_set("requests", {"a": 1}), "requests: must be a list of request objects"),
    ],
)
def test_bad_values_in_a_rate_limit_counterexample_are_usage_errors_naming_the_field(tmp_path, edit, says):
    # A hand-edited counterexample is refused on load (exit 2, not 1: exit 1 means the
    # scenario fails), naming the file, the field and the value; nothing runs.
    assert_refused_on_load(_edited_rate_limit_file(tmp_path, edit), says, "rate-limit scenario on")


def assert_refused_on_load(path, says: str, run_header: str) -> None:
    """``outrate replay path`` is a usage error (exit 2) whose message names the file and
    holds ``says``, printed before anything ran (no ``run_header``)."""
    code, out = replay(path)
    assert code == 2, out
    last = " ".join(out.split())
    assert str(path.name) in last and " ".join(says.split()) in last, out
    assert run_header not in out and "Traceback" not in out


def test_rate_given_as_a_json_number_replays(tmp_path):
    path = _edited_rate_limit_file(tmp_path, _set("default_rate_tokens_per_s", 1000))
    code, out = replay(path)
    assert code == 0, out


def test_replay_output_has_no_vllm_log_noise(tmp_path):
    # vLLM configures no logging outside a server: its WARNING records for each engine
    # config built (block size not a multiple of 32, SSM cache type, Triton) reached stderr
    # between the scenario and the verdict. A fresh process, so no other test quieted them.
    path = _edited_rate_limit_file(tmp_path, lambda data: None)
    env = {k: v for k, v in os.environ.items() if k != "VLLM_LOGGING_LEVEL"}
    run = subprocess.run(
        [sys.executable, "-m", "vllm_output_rate.cli", "replay", str(path)], capture_output=True, text=True, env=env
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    noise = [line for line in run.stderr.splitlines() if line.strip() and "site-packages/torch/" not in line]
    assert noise == [], run.stderr
    assert run.stdout.splitlines()[-1].startswith("PASS"), run.stdout


def _edited_step_file(tmp_path, edit):
    """A saved white-box counterexample (``StepScenario.to_json``) after ``edit`` changed
    its decoded JSON in place."""
    config = EngineConfig(
        max_num_seqs=4, max_num_batched_tokens=64, block_size=4, num_blocks=65, default_rate_tokens_per_s=Fraction(5, 2)
    )
    data = json.loads(StepScenario(config, TWO_USERS_THREE_STREAMS).to_json())
    assert data["config"]["default_rate_tokens_per_s"] == "5/2"  # the saved form of 2.5
    edit(data)
    path = tmp_path / "counterexample-white-box-sync.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        (_set("config", "default_rate_tokens_per_s", "-1"), "config.default_rate_tokens_per_s: a rate must be"),
        (_set("config", "default_rate_tokens_per_s", "abc"), "got 'abc'"),
        (_set("config", "default_rate_tokens_per_s", "1/3"), "at most 9 decimal places"),
        (_set("config", "user_rates_tokens_per_s", [["", "5"]]), "config.user_rates_tokens_per_s[0][0]: a user id"),
        (_set("config", "user_rates_tokens_per_s", {"a": "5"}), "must be a list of [user, rate] pairs"),
        (_set("config", "max_num_seqs", "4"), "config.max_num_seqs: must be an integer, got '4'"),
        (_set("config", "max_num_seqs", -5), "config: max_num_seqs -5"),
        (_set("config", "nope", 1), "config: unknown key(s) 'nope'"),
        (_set("events", 0, "user", ""), "events[0].user: a user id must be a non-empty string of at most 256"),
        (_set("events", 0, "user", "x" * 300), "(302 characters)"),
        (_set("events", 0, "type", "Foo"), "events[0].type: must be one of AddRequest"),
        (_set("events", 0, "max_tokens", 0), "events[0] (AddRequest): max_tokens 0 out of range"),
        (_set("events", 5, "delta_ns", "5"), "events[5].delta_ns: must be an integer, got '5'"),
        (lambda data: data["events"][0].pop("request_id"), "events[0]: missing key(s) request_id"),
        (lambda data: data["events"].append({"type": "ChangeRates", "default_rate_tokens_per_s": "0"}), "got '0'"),
    ],
)
def test_bad_values_in_a_step_counterexample_are_usage_errors_naming_the_field(tmp_path, edit, says):
    # Before: a 300-character user ran (and its request was charged to __anonymous__), an
    # empty override user was a traceback (exit 1), other values an unnamed AssertionError().
    assert_refused_on_load(_edited_step_file(tmp_path, edit), says, "step scenario (")


def test_saved_step_counterexample_with_a_fraction_rate_replays(tmp_path):
    code, out = replay(_edited_step_file(tmp_path, lambda data: None))
    assert code == 0, out
