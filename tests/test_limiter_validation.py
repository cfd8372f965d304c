"""Validation of rates, bursts, user ids (reference limiter) and of the ``output_rate`` config.

Rule ids: R1 (tau), R3 (exact rates: at most 9 decimal places), R18 (feature off).
Every rejection must be a ``ValueError`` whose message names the bad value (its repr), so
an operator sees what to change.
"""

from __future__ import annotations

import math
from decimal import Decimal
from fractions import Fraction
from typing import Any

import pytest

from vllm_output_rate.reference.config import parse_output_rate
from vllm_output_rate.reference.limiter import OutputRateLimiter
from vllm_output_rate.reference.scales import parse_rate
from vllm_output_rate.reference.section import OutputRateConfig, OutputRateConfigError

pytestmark = pytest.mark.check

BAD_RATES = [
    0,
    -1,
    0.0,
    -0.5,
    Fraction(-1, 2),
    Fraction(0),
    Decimal("0"),
    Decimal("-2.5"),
    math.nan,
    math.inf,
    -math.inf,
    Decimal("NaN"),
    Decimal("Infinity"),
    Decimal("-Infinity"),
    True,
    False,
    None,
    "10",
    "0.5",
    [10],
    (10,),
    {"rate": 10},
    complex(10, 0),
    10**9 + 1,  # above one token per ns
    1e10,
]

TOO_MANY_DECIMALS = [
    Decimal("0.0000000001"),  # 10 decimal places
    Decimal("1.0000000001"),
    1e-10,
    0.1234567891,
    1 / 3,  # 0.3333333333333333: 16 decimal places as written
    Fraction(1, 10**10),
    Fraction(1, 1_000_000_007),  # denominator above 10**9
]

GOOD_RATES = [
    (10, Fraction(10)),
    (1, Fraction(1)),
    (10**9, Fraction(10**9)),  # the maximum, one token per ns
    (2.5, Fraction(5, 2)),
    (0.5, Fraction(1, 2)),
    (0.1, Fraction(1, 10)),  # read as written, not as the binary double
    (1e-9, Fraction(1, 10**9)),  # exactly 9 decimal places
    (Fraction(1, 3), Fraction(1, 3)),
    (Fraction(1, 7), Fraction(1, 7)),
    (Fraction(6, 4), Fraction(3, 2)),  # reduced
    (Decimal("2.5"), Fraction(5, 2)),
    (Decimal("0.000000001"), Fraction(1, 10**9)),
    (Decimal("1E+3"), Fraction(1000)),
]


def _rid(v: object) -> str:
    return repr(v)


# ---------------------------------------------------------------------------------------
# parse_rate and OutputRateLimiter rates


# Each way a rate comes in: the call given the bad value, and what its error must name
# besides the value's repr.
RATE_ENTRIES = {
    "parse_rate": (lambda bad: parse_rate(bad, "my_rate"), ("my_rate",)),
    "limiter_default": (lambda bad: OutputRateLimiter(bad), ()),
    "limiter_override": (lambda bad: OutputRateLimiter(10, {"alice": 5, "bob": bad}), ("'bob'",)),
}


@pytest.mark.parametrize("entry", RATE_ENTRIES)
@pytest.mark.parametrize("bad", BAD_RATES, ids=_rid)
def test_bad_rate_rejected_naming_value_and_where(bad: object, entry: str) -> None:
    take, named = RATE_ENTRIES[entry]
    with pytest.raises(ValueError) as info:
        take(bad)
    msg = str(info.value)
    assert repr(bad) in msg
    for word in named:
        assert word in msg


@pytest.mark.parametrize("bad", TOO_MANY_DECIMALS, ids=_rid)
def test_rates_with_more_than_9_decimals_rejected(bad: object) -> None:
    with pytest.raises(ValueError) as info:
        parse_rate(bad)
    assert repr(bad) in str(info.value)
    with pytest.raises(ValueError):
        OutputRateLimiter(bad)
    with pytest.raises(ValueError):
        OutputRateLimiter(10, {"u": bad})


@pytest.mark.parametrize(("value", "expected"), GOOD_RATES, ids=[_rid(v) for v, _ in GOOD_RATES])
def test_good_rates_accepted_exactly(value: object, expected: Fraction) -> None:
    rate = parse_rate(value)
    assert isinstance(rate, Fraction)
    assert rate == expected
    lim = OutputRateLimiter(value, {"o": value})
    assert lim.rate_of("x") == expected
    assert lim.rate_of("o") == expected


def test_accepted_rate_is_used_exactly() -> None:
    # 0.1 tok/s read as 1/10: T = 10**10 ns exactly (the double would give 9999999999.99.. ns)
    lim = OutputRateLimiter(0.1)
    assert lim.try_take("u", 0)
    assert lim.tat_ns("u") == 10_000_000_000


@pytest.mark.parametrize("bad", [0, -1, 1.5, 1e8, True, False, None, "100", Fraction(10**8), [1]], ids=_rid)
def test_limiter_rejects_bad_burst(bad: Any) -> None:
    with pytest.raises(ValueError) as info:
        OutputRateLimiter(10, burst_ns=bad)
    msg = str(info.value)
    assert "burst_ns" in msg
    assert repr(bad) in msg


def test_limiter_accepts_positive_int_burst() -> None:
    # R1: tau = 1 ns at 10/s: the second take at t=0 sees lead 10**8 > 1 -> refused
    lim = OutputRateLimiter(10, burst_ns=1)
    assert lim.burst_ns == 1
    assert lim.try_take("u", 0)
    assert not lim.try_take("u", 0)
    assert lim.ready_at_ns("u") == 10**8 - 1


@pytest.mark.parametrize("bad_user", [1, None, "", b"alice", ("alice",), 2.5], ids=_rid)
def test_limiter_rejects_bad_user_ids_in_overrides(bad_user: Any) -> None:
    with pytest.raises(ValueError) as info:
        OutputRateLimiter(10, {bad_user: 5})
    assert repr(bad_user) in str(info.value)


# ---------------------------------------------------------------------------------------
# parse_output_rate (additional_config["output_rate"])


def test_config_empty_section_is_refused_not_off() -> None:
    # R18: "off" is no section at all; an empty one names the missing default.
    with pytest.raises(OutputRateConfigError, match="is empty: set default_tokens_per_s"):
        parse_output_rate({})


@pytest.mark.parametrize("off", [None])
def test_config_no_section_means_feature_off(off: object) -> None:
    cfg = parse_output_rate(off)
    assert cfg == OutputRateConfig()
    assert not cfg.enabled
    assert cfg.default_rate is None
    assert dict(cfg.user_rates) == {}


def test_config_full_section_parsed() -> None:
    cfg = parse_output_rate(
        {
            "default_tokens_per_s": 20,
            "user_tokens_per_s": {"user-a": 100, "user-b": 0.5},
            "max_num_active_seqs": 4,
            "burst_ms": 50,
        }
    )
    assert cfg.enabled
    assert cfg.default_rate == 20
    assert dict(cfg.user_rates) == {"user-a": Fraction(100), "user-b": Fraction(1, 2)}
    assert cfg.max_num_active_seqs == 4
    assert cfg.burst_ns == 50_000_000  # 50 ms


def test_config_defaults() -> None:
    cfg = parse_output_rate({"default_tokens_per_s": 2.5})
    assert cfg.default_rate == Fraction(5, 2)
    assert dict(cfg.user_rates) == {}
    assert cfg.max_num_active_seqs is None
    assert cfg.burst_ns == 100_000_000  # R1: tau = 100 ms


def test_config_error_is_a_value_error() -> None:
    assert issubclass(OutputRateConfigError, ValueError)


def test_config_unknown_keys_listed_with_known_keys() -> None:
    with pytest.raises(OutputRateConfigError) as info:
        parse_output_rate({"default_tokens_per_s": 10, "user_rates": {"a": 1}, "burst": 5})
    msg = str(info.value)
    assert "'burst'" in msg and "'user_rates'" in msg
    # says what to use instead
    assert "default_tokens_per_s" in msg and "user_tokens_per_s" in msg


@pytest.mark.parametrize(
    "section",
    [
        {"user_tokens_per_s": {"a": 5}},
        {"max_num_active_seqs": 4},
        {"default_tokens_per_s": None, "user_tokens_per_s": {"a": 5}},
    ],
)
def test_config_without_default_rejected(section: dict) -> None:
    with pytest.raises(OutputRateConfigError) as info:
        parse_output_rate(section)
    msg = str(info.value)
    assert "default_tokens_per_s" in msg
    assert "set a default rate" in msg


@pytest.mark.parametrize("bad", [-1, 0, "100", math.nan, math.inf, True, None, [5], 1e-10], ids=_rid)
def test_config_bad_override_rate_names_user_and_value(bad: object) -> None:
    with pytest.raises(OutputRateConfigError) as info:
        parse_output_rate({"default_tokens_per_s": 10, "user_tokens_per_s": {"alice": 5, "bob": bad}})
    msg = str(info.value)
    assert "user_tokens_per_s" in msg
    assert "'bob'" in msg
    assert repr(bad) in msg


@pytest.mark.parametrize("bad_user", ["", 3], ids=_rid)
def test_config_bad_user_id(bad_user: object) -> None:
    with pytest.raises(OutputRateConfigError) as info:
        parse_output_rate({"default_tokens_per_s": 10, "user_tokens_per_s": {bad_user: 5}})
    msg = str(info.value)
    assert "user_tokens_per_s" in msg
    assert repr(bad_user) in msg


def test_config_null_overrides_mean_none() -> None:
    cfg = parse_output_rate({"default_tokens_per_s": 10, "user_tokens_per_s": None})
    assert dict(cfg.user_rates) == {}


# Keys of the section, bad values for each, and what the refusal must name besides the key
# and the value's repr.
BAD_VALUES_BY_KEY = [
    ("default_tokens_per_s", [0, -5, "10", math.nan, True, [10]], ()),
    ("user_tokens_per_s", [[["a", 5]], "a=5", 5, [], "", 0, False], ()),  # must be an object
    ("max_num_active_seqs", [0, -1, 1.5, True, False, "4", [4]], ("integer >= 1",)),
    ("burst_ms", [0, -1, 1.5, True, "100", None], ()),
]
BAD_VALUE_CASES = [(key, bad, words) for key, bads, words in BAD_VALUES_BY_KEY for bad in bads]


@pytest.mark.parametrize(("key", "bad", "words"), BAD_VALUE_CASES, ids=[f"{k}={b!r}" for k, b, _ in BAD_VALUE_CASES])
def test_config_bad_value_refused_naming_key_and_value(key: str, bad: object, words: tuple[str, ...]) -> None:
    # A valid section with ``key`` set to the bad value (for the default rate: replaced).
    with pytest.raises(OutputRateConfigError) as info:
        parse_output_rate({"default_tokens_per_s": 10, key: bad})
    msg = str(info.value)
    assert key in msg
    assert repr(bad) in msg
    for word in words:
        assert word in msg


@pytest.mark.parametrize("bad", ["10", [1], 10, "default_tokens_per_s=10"], ids=_rid)
def test_config_section_must_be_an_object(bad: object) -> None:
    with pytest.raises(OutputRateConfigError) as info:
        parse_output_rate(bad)
    assert repr(bad) in str(info.value)


def test_config_override_key_no_request_can_name_is_refused() -> None:
    # R17: a request's user id has at most 256 characters (longer ones get HTTP 400), so an
    # override keyed by a longer id could never match: start-up refuses it, naming the key
    # (shortened) and the limit; 256 characters are accepted.
    long_key = "x" * 300
    with pytest.raises(OutputRateConfigError) as info:
        parse_output_rate({"default_tokens_per_s": 10, "user_tokens_per_s": {"ok": 1, long_key: 5}})
    msg = str(info.value)
    assert "user_tokens_per_s" in msg and "at most 256 characters" in msg and "(300 characters)" in msg, msg
    assert "'xxxx" in msg and long_key not in msg and len(msg) < 400, msg
    cfg = parse_output_rate({"default_tokens_per_s": 10, "user_tokens_per_s": {"y" * 256: 5}})
    assert cfg.user_rates == {"y" * 256: Fraction(5)}


def test_rates_file_override_key_no_request_can_name_is_refused() -> None:
    from vllm_output_rate.reference.ratesfile import parse_rates_file

    text = '{"default_tokens_per_s": 10, "user_tokens_per_s": {"%s": 5}}' % ("z" * 257)
    with pytest.raises(OutputRateConfigError) as info:
        parse_rates_file(text, "r.json")
    msg = str(info.value)
    assert msg.startswith("rates file r.json:") and "at most 256 characters" in msg and "(257 characters)" in msg
