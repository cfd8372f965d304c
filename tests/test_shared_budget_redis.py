"""R23-R26 against a real Redis: two reference schedulers (in-process, real clock) share
one user's budget through one redis-server started on a free loopback port by the
fixture (the root conftest); judged by the spec's cross-engine bound (spec/shared_budget.py). Marker
``multi_engine``. ``redis-server`` comes from Debian's package (``.ci/run`` installs it)."""

from __future__ import annotations

import contextlib
import time
from fractions import Fraction

import pytest

from vllm_output_rate.reference.config import parse_output_rate
from vllm_output_rate.reference.section import OutputRateConfigError
from vllm_output_rate.spec import limiter as spec_limiter
from vllm_output_rate.spec import shared_budget as sb

SCHEDULER = "vllm_output_rate.reference.scheduler.RateLimitedScheduler"
RATE = 20  # tokens/s for the user "big": T = 50 ms, L = 1, H = 1


def _harness(url: str, streams: int, max_tokens: int, prefix: str):
    from vllm_output_rate.adapter.engine_shape import EngineShape
    from vllm_output_rate.adapter.harness import Harness

    shape = EngineShape(max_num_seqs=8, output_rate={"default_tokens_per_s": RATE, "shared_budget_url": url})
    h = Harness(SCHEDULER, shape)
    h.scheduler.clock_ns = time.monotonic_ns  # real time: the store's clock is real too
    for i in range(streams):
        h.add_request(f"{prefix}{i}", user="big", prompt_len=4, max_tokens=max_tokens)
    return h


@contextlib.contextmanager
def _two_engines(url: str, streams: int, max_tokens: int):
    """Two reference schedulers ("a", "b") sharing ``url``, each with ``streams`` of user
    "big"; their refill threads are stopped on exit."""
    engines = (_harness(url, streams, max_tokens, "a"), _harness(url, streams, max_tokens, "b"))
    try:
        yield engines
    finally:
        for h in engines:
            h.scheduler.rate_limiter.close()


def _run(harnesses, seconds: float, dispatches: list[tuple[int, str]]) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for h in harnesses:
            now = time.monotonic_ns()
            trace = h.step()
            dispatches.extend((now, rid) for rid in trace.sampled)
        time.sleep(0.002)


def _ledger_ok(times: list[int], engines: int) -> bool:
    """R24 in ledger form over every window of the run (T rounded up as the store does)."""
    rate = Fraction(RATE)
    tolerance = sb.shared_ledger_burst_ns(rate, engines, sb.lease_size(rate))
    ledger = Fraction(0)
    for t in sorted(times):
        if ledger - t > tolerance:
            return False
        ledger = max(ledger, Fraction(t)) + spec_limiter.emission_interval_ns(rate)
    return True


@pytest.mark.multi_engine
@pytest.mark.rules("R23", "R24")
def test_r24_two_schedulers_one_store_stay_within_the_cross_engine_bound(redis_server) -> None:
    with _two_engines(redis_server.url, 4, 400) as (a, b):
        dispatches: list[tuple[int, str]] = []
        _run([a, b], 3.0, dispatches)
        times = [t for t, _ in dispatches]
        assert _ledger_ok(times, 2), "the two engines together exceeded the R24 bound"
        span = (max(times) - min(times)) if len(times) > 1 else 0
        bound = sb.shared_window_bound_tokens(span, Fraction(RATE), 2, sb.lease_size(Fraction(RATE)))
        assert len(times) <= bound
        on_a = sum(1 for _, rid in dispatches if rid.startswith("a"))
        # Both engines served the user, and together about one budget (not two): the
        # refill starts after the start-up hold, then the store paces the sum at RATE.
        assert on_a > 0 and len(times) - on_a > 0
        assert len(times) >= 0.6 * RATE * (3.0 - sb.STARTUP_HOLD_NS / 1e9), len(times)


@pytest.mark.multi_engine
@pytest.mark.rules("R25")
def test_r25_redis_killed_mid_run_no_overshoot_and_every_stream_completes(redis_server) -> None:
    with _two_engines(redis_server.url, 3, 25) as (a, b):
        before: list[tuple[int, str]] = []
        _run([a, b], 1.5, before)
        redis_server.kill()
        outage: list[tuple[int, str]] = []
        _run([a, b], 1.0, outage)
        # R25: no lease while down: at most what the engines held (H each, a grant refunded
        # back in the last step at most) is dispatched during the outage.
        H = sb.holding_cap(sb.lease_size(Fraction(RATE)))
        assert len(outage) <= 2 * (H + 1), len(outage)
        assert not a.scheduler.rate_limiter.store_ok
        redis_server.start()  # the same port: recovery
        after: list[tuple[int, str]] = []
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and len(a.finished) + len(b.finished) < 6:
            _run([a, b], 0.2, after)
        assert len(a.finished) + len(b.finished) == 6, "a stream did not complete after the store returned"
        assert all(n == 25 for _, n in list(a.finished.values()) + list(b.finished.values()))
        assert a.scheduler.rate_limiter.store_ok
        assert _ledger_ok([t for t, _ in before + outage + after], 2)


@pytest.mark.multi_engine
@pytest.mark.rules("R23", "R26")
def test_r26_crashed_engine_leases_are_not_spent_again_and_returns_apply_once(redis_server) -> None:
    import redis

    from vllm_output_rate.reference.shared_budget import RETURN_LUA, SharedBudgetLimiter, user_key

    clock = [10**12]
    first = SharedBudgetLimiter(RATE, url=redis_server.url, clock_ns=lambda: clock[0], start_thread=False)
    first.grants_at("u", 0)  # demand
    clock[0] += sb.STARTUP_HOLD_NS
    first.refill_once()
    assert first.shared_available("u") == 1
    client = redis.Redis.from_url(redis_server.url)
    tat_after_lease = int(client.hget(user_key("u"), "tat"))
    lease_id = int(client.hget(user_key("u"), "seq"))
    # A new incarnation (the crashed engine restarted) holds nothing and cannot return the old lease.
    second = SharedBudgetLimiter(RATE, url=redis_server.url, clock_ns=lambda: clock[0], start_thread=False)
    assert second.shared_available("u") == 0 and second.grants_at("u", 0) == 0
    ret = client.register_script(RETURN_LUA)
    record = f"{user_key('u')}:lease:{lease_id}"
    assert ret(keys=[user_key("u"), record], args=[second.emission_ns("u"), 1, second.engine_id]) == 0
    assert int(client.hget(user_key("u"), "tat")) == tat_after_lease
    # The holder's return applies once; a second one is a no-op.
    assert ret(keys=[user_key("u"), record], args=[first.emission_ns("u"), 1, first.engine_id]) == 1
    assert ret(keys=[user_key("u"), record], args=[first.emission_ns("u"), 1, first.engine_id]) == 0
    assert int(client.hget(user_key("u"), "tat")) < tat_after_lease


@pytest.mark.rules("R25")
def test_r25_shared_budget_url_is_validated() -> None:
    cfg = parse_output_rate({"default_tokens_per_s": 5, "shared_budget_url": "redis://127.0.0.1:6379/0"})
    assert cfg.shared_budget_url == "redis://127.0.0.1:6379/0"
    with pytest.raises(OutputRateConfigError, match=r"shared_budget_url.*'http://x'"):
        parse_output_rate({"default_tokens_per_s": 5, "shared_budget_url": "http://x"})
    with pytest.raises(OutputRateConfigError, match="shared_budget_url"):
        parse_output_rate({"default_tokens_per_s": 5, "shared_budget_url": 6379})


@pytest.mark.rules("R24")
def test_r24_outrate_serve_flag_puts_the_url_in_the_section() -> None:
    import json
    import shlex

    from click.testing import CliRunner

    from vllm_output_rate.cli import main

    def print_command(*flags: str):
        """``outrate serve MODEL FLAGS --print-command`` in this process (click's Result)."""
        return CliRunner().invoke(main, ["serve", "MODEL", *flags, "--print-command"])

    url = "redis://10.0.0.5:6379/0"
    result = print_command("--default-user-output-tokens-per-second", "10", "--shared-budget-url", url)
    assert result.exit_code == 0, result.output
    argv = shlex.split(result.output.strip())
    section = json.loads(argv[argv.index("--additional-config") + 1])["output_rate"]
    assert section == {"default_tokens_per_s": 10, "shared_budget_url": url}
    assert "--shared-budget-url" not in argv  # ours, not vLLM's
    bad = print_command("--default-user-output-tokens-per-second", "10", "--shared-budget-url", "http://x")
    assert bad.exit_code != 0 and "shared_budget_url" in bad.output and "http://x" in bad.output
    alone = print_command("--shared-budget-url", url)
    assert alone.exit_code != 0 and "--shared-budget-url needs --default-user-output-tokens-per-second" in alone.output


@pytest.mark.rules("R24")
def test_r24_engine_args_style_carries_the_store_url() -> None:
    from vllm_output_rate.adapter.configstyle import SHARED_BUDGET_FLAG, EngineArgsStyle, engine_argv
    from vllm_output_rate.adapter.engine_shape import EngineShape

    url = "redis://127.0.0.1:6379/0"
    argv = engine_argv(EngineShape(output_rate={"default_tokens_per_s": 5, "shared_budget_url": url}))
    assert argv[argv.index(SHARED_BUDGET_FLAG) + 1] == url
    # Stock vLLM's engine arguments have no such flag: the style says so instead of dropping it.
    with pytest.raises(ValueError, match="the candidate does not add --"):
        EngineArgsStyle().build_vllm_config(
            EngineShape(output_rate={"default_tokens_per_s": 5, "shared_budget_url": url})
        )
