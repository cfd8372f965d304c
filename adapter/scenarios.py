"""Rate-limit scenarios on a real scheduler, judged step by step against the spec limiter.

A ``Scenario`` is plain data (JSON-able, replayable): an engine shape, per-user rates, a
list of requests each arriving at some step, a fixed clock advance between steps. Running
it drives a ``Harness`` and applies these checks after every step (black-box: only what
vLLM exposes is used, so any scheduler class can be judged):

- R2/R7 grant: each user's sampling dispatches in the step, replayed as ``try_take`` on
  the exact spec limiter at the step's time, must all be granted (no over-grant);
- R11/R2 pause only when refused (sync mode): if one of the user's unfinished requests
  did not sample in the step, the spec limiter must refuse one more take (the limit, not
  something else, paused it; the scenarios give ample token budget, KV and seats);
- R2 window bound: in every window [t_i, t_j] of step times, a user's sampling dispatches
  <= floor((t_j - t_i + tau) x rate) + 1;
- R11 pause-not-truncate: at the end every request finished with exactly ``max_tokens``
  outputs, or ``eos_index + 1`` if its EOS came first.

Ample sync scenarios also check R11 "kept resident" (no preemption) and R14 rotation.
Ample async scenarios check the under-grant (P4) for the requests with a token left to
dispatch (outputs plus in-flight placeholders below ``max_tokens``); a pressured scenario
with ``ample_from_step`` (its author guarantees seats, budget and KV from that step on)
checks it from that step; before it (and in every pressured scenario), sync and async, the
running requests are judged in each step that left token budget, preempted nothing and did
not fill the active cap (``_Judge._pressured_under_grant_check``). At should, R13 is
judged black-box: under PRIORITY no victim above vLLM's victim level, under FCFS no victim
granted for all its user's running requests while a throttled request the running loop
already passed keeps its KV (``_Judge._fcfs_victim_check``: both timings of "throttled",
the article's and ours).
At should, ``adapter/step_checks.py`` closes the blind spots of issue 26: R12 a batch within
the active cap, R10 no split prompt without chunked prefill and a running refused prefill
advanced to n - 1, R13 throttled victims within the PRIORITY level, R14 other users' places
in ``running`` kept; head-of-line blocking caused by the limit (a refused waiting request
that could advance ends admission, R10/P4) is told apart from vLLM's own stops; under FCFS
the under-grant check also judges steps that preempted. n > 1 requests are drawn as vLLM's
front end builds them (``parallel_children``: children sharing one ``SamplingParams``).
Scenarios with resource pressure (``pressured_scenarios``) are judged by the black-box
checks that still hold under pressure plus the white-box invariants on the scheduler's
observation (docs/OBSERVATION.md): charges minus refunds equal sampling dispatches (R7,
R9), refunds only of this step's charges, once (R9), throttled never scheduled (R11),
scheduled running requests <= max_num_active_seqs (R12), every user's TAT equal to the
spec limiter's replay (R1-R6), and the wait hint the earliest ready time (R16).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from decimal import Decimal
from fractions import Fraction
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

from vllm_output_rate.adapter import attribution, coverage, step_checks
from vllm_output_rate.spec import limiter as spec_limiter
from vllm_output_rate.spec import properties as spec_properties

MAX_SCENARIO_STEPS = 400
DRAIN_STEP_LIMIT = 2_000  # steps allowed after the scenario to let every request finish
DRAIN_IDLE_NS = 10_000_000  # clock advance of an idle drain step when the spec sees no one waiting


@dataclass(frozen=True)
class RequestSpec:
    """One request: it is added just before step ``at_step`` is scheduled."""

    request_id: str
    user: str | None  # None: no ``output_rate_user`` (the shared ``__anonymous__`` bucket, R17)
    prompt_len: int
    max_tokens: int
    eos_index: int | None = None
    at_step: int = 0
    priority: int = 0
    abort_at_step: int | None = None  # aborted just before this step is scheduled
    # n > 1: the request id of the parent whose children share one SamplingParams, built as
    # vLLM's front end builds them (``parallel_children``); None: a request of its own.
    parent: str | None = None


@dataclass(frozen=True)
class Scenario:
    """A replayable rate-limit scenario (see module docstring)."""

    rates_tokens_per_s: dict[str, str]  # user -> rate as an exact decimal string
    requests: tuple[RequestSpec, ...]
    step_interval_ns: int
    num_steps: int
    chunked_prefill: bool = True
    async_scheduling: bool = False
    default_rate_tokens_per_s: str = "10"
    # Resource pressure; None everywhere = ample (only the rate limit can pause a request).
    max_num_seqs: int | None = None
    max_num_active_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    num_blocks: int | None = None
    block_size: int = 16
    policy: str = "fcfs"
    # Burst tolerance in ms; None: the article's fixed 100 ms, and no ``burst_ms`` key is
    # configured (only candidates that read ``burst_ms`` get other values).
    burst_ms: int | None = None
    feature_on: bool = True  # False: no output-rate configuration at all (R18)
    # Per-step clock advances in ns (step i advances by advances_ns[i]); None, or past its
    # end: ``step_interval_ns``. Boundary scenarios (adapter/boundaries.py) set it.
    advances_ns: tuple[int, ...] | None = None
    # The scenario's author guarantees that from this step on seats, token budget and KV
    # suffice (e.g. the pressure requests have finished): the judge's under-grant check
    # (P4) applies from it on although the scenario is not ``ample``. None: never.
    ample_from_step: int | None = None
    # vLLM's prefix caching (its default: on). The black-box properties need no model of the
    # cache (they judge what the candidate dispatches); the step spec has none, so the
    # step-identity checks (adapter/fidelity.py, white box) always run with it off.
    prefix_caching: bool = False

    def abort_schedule(self) -> list[tuple[int, RequestSpec]]:
        """The aborted requests as (step before which it is aborted, request), in abort
        order (requests aborted before the same step: in scenario order)."""
        aborts = [(r.abort_at_step, r) for r in self.requests if r.abort_at_step is not None]
        return sorted(aborts, key=lambda abort: abort[0])

    @property
    def ample(self) -> bool:
        """True when nothing but the rate limit (and the active cap, R12) can keep a request
        from sampling: ample seats, budget and KV, no aborts."""
        return (self.max_num_seqs, self.max_num_batched_tokens, self.num_blocks) == (None, None, None) and not any(
            r.abort_at_step is not None for r in self.requests
        )

    def ample_at(self, step: int) -> bool:
        """True when only the rate limit (and the active cap) can keep a request from
        sampling at ``step``: an ``ample`` scenario, or ``step >= ample_from_step``."""
        return self.ample or (self.ample_from_step is not None and step >= self.ample_from_step)

    @property
    def burst_ns(self) -> int:
        """The GCRA burst tolerance tau in ns (R2)."""
        return (self.burst_ms if self.burst_ms is not None else 100) * 1_000_000

    def output_rate_config(self) -> dict[str, Any] | None:
        """``additional_config["output_rate"]`` for this scenario (None: feature off)."""
        if not self.feature_on:
            return None
        config: dict[str, Any] = {
            "default_tokens_per_s": _as_number(self.default_rate_tokens_per_s),
            "user_tokens_per_s": {u: _as_number(r) for u, r in self.rates_tokens_per_s.items()},
        }
        if self.burst_ms is not None:
            config["burst_ms"] = self.burst_ms
        return config

    def rate_of(self, user: str) -> Fraction:
        """The configured rate of bucket ``user`` (override, else the default), tokens/s."""
        return Fraction(self.rates_tokens_per_s.get(user, self.default_rate_tokens_per_s))

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @staticmethod
    def from_json(text: str) -> Scenario:
        """The scenario of a file ``to_json`` wrote (``outrate conform`` saves them), every
        field validated: nothing runs on a hand-edited value that the run would misread.
        A field left out takes its default (counterexamples saved before it existed).

        Raises:
            ScenarioFileError: not a JSON object, an unknown or missing key, or a bad value
                (a user id that is not a non-empty string of at most 256 characters, R17; a
                rate that is not a positive finite decimal number of tokens/s; a count out of
                range; ...), the message naming the field and the value.
        """
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ScenarioFileError(f"not JSON: {exc}") from None
        values = checked_object(data, "the scenario", _SCENARIO_FIELDS, required=_SCENARIO_REQUIRED)
        values["rates_tokens_per_s"] = _checked_rates(values["rates_tokens_per_s"])
        requests = values["requests"]
        if not isinstance(requests, list):
            raise bad_value("requests", requests, "must be a list of request objects")
        values["requests"] = tuple(_checked_request(r, f"requests[{i}]") for i, r in enumerate(requests))
        ids = [r.request_id for r in values["requests"]]
        repeated = sorted({i for i in ids if ids.count(i) > 1})
        if repeated:
            raise bad_value("requests", repeated, "request ids must differ; repeated")
        if "default_rate_tokens_per_s" in values:
            values["default_rate_tokens_per_s"] = checked_rate(
                values["default_rate_tokens_per_s"], "default_rate_tokens_per_s"
            )
        for name, check in _SCENARIO_CHECKS.items():
            if name in values:
                values[name] = check(values[name], name)
        return Scenario(**values)

    def events(self) -> list[str]:
        """The scenario as a short list of events, for printing counterexamples: the first
        line gives every configuration value the scenario sets (burst included)."""
        out = []
        for r in sorted(self.requests, key=lambda r: r.at_step):
            eos = f", eos@{r.eos_index}" if r.eos_index is not None else ""
            prio = f", priority={r.priority}" if self.policy == "priority" else ""
            user = "(none: __anonymous__)" if r.user is None else repr(r.user)
            child = f", child of {r.parent!r} (n > 1: one shared SamplingParams)" if r.parent is not None else ""
            out.append(
                f"step {r.at_step}: add {r.request_id} user={user} prompt={r.prompt_len} "
                f"max_tokens={r.max_tokens}{eos}{prio}{child}"
            )
            if r.abort_at_step is not None:
                out.append(f"step {r.abort_at_step}: abort {r.request_id}")
        steps = f"{self.num_steps} step{'s' if self.num_steps != 1 else ''}"
        drain = f", then more at that interval until every request has finished (at most {DRAIN_STEP_LIMIT})"
        if self.advances_ns is not None:
            out.append(
                f"clock advances after each step (ns): {list(self.advances_ns)}, then "
                f"+{self.step_interval_ns} ns each; {steps}{drain}"
            )
        else:
            out.append(f"then {steps}, clock +{self.step_interval_ns} ns each{drain}")
        rates = ", ".join(f"{u!r}={r}" for u, r in sorted(self.rates_tokens_per_s.items()))
        burst = f"{self.burst_ms} ms (burst_ms)" if self.burst_ms is not None else "100 ms (fixed)"
        seqs = self.max_num_seqs or max(len(self.requests), 1)
        feature = (
            f"default rate {self.default_rate_tokens_per_s} tokens/s, overrides {{{rates}}}, burst {burst}"
            if self.feature_on
            else "feature OFF (no output-rate configuration)"
        )
        out.insert(
            0,
            f"config: {feature}; max_num_seqs={seqs}, max_num_active_seqs={self.max_num_active_seqs}, "
            f"max_num_batched_tokens={self.max_num_batched_tokens or 2048}, "
            f"num_blocks={self.num_blocks or 4096}x{self.block_size}, policy={self.policy}, "
            f"chunked_prefill={self.chunked_prefill}, async={self.async_scheduling}"
            + (", prefix_caching=True" if self.prefix_caching else ""),
        )
        return out


class ScenarioFileError(ValueError):
    """A saved scenario (``outrate replay FILE``) that cannot be replayed as written: the
    message names the field (a path such as ``requests[2].user``) and the bad value, and
    says what a valid one is."""


def _shown(value: Any) -> str:
    """``repr(value)``, cut to 80 characters (a 300-character user id stays readable)."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}... ({len(text)} characters)"


def bad_value(field_name: str, value: Any, want: str) -> ScenarioFileError:
    """The error for ``value`` of ``field_name``: ``FIELD: WANT, got VALUE``."""
    return ScenarioFileError(f"{field_name}: {want}, got {_shown(value)}")


def checked_user_id(value: Any, field_name: str) -> str:
    """R17 (reference/identity.py): ``value`` if it is a valid user id, a non-empty string
    of at most 256 characters.

    Raises:
        ScenarioFileError: naming ``field_name`` and the value (shortened).
    """
    from vllm_output_rate.reference.identity import MAX_USER_ID_CHARS, is_user_id

    if not is_user_id(value):
        raise bad_value(
            field_name, value, f"a user id must be a non-empty string of at most {MAX_USER_ID_CHARS} characters"
        )
    return value


def checked_rate(value: Any, field_name: str, ratio_ok: bool = False) -> str:
    """A rate in tokens/s as its exact string: a positive finite decimal (a JSON string
    such as ``"2.5"``, or a JSON number), at most 10**9 tokens/s with at most 9 decimal
    places (``reference.limiter.parse_rate``); with ``ratio_ok`` also written ``"p/q"``
    (a step scenario's form: ``"5/2"``), still of at most 9 decimal places.

    Raises:
        ScenarioFileError: naming ``field_name`` and the value.
    """
    from vllm_output_rate.reference.limiter import MAX_RATE_TOKENS_PER_S, parse_rate

    numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
    text = value.strip() if isinstance(value, str) else repr(value) if numeric else ""
    try:
        rate = Fraction(text) if text and (ratio_ok or "/" not in text) else None
        if (parse_rate(rate, field_name) * 10**9).denominator != 1:  # "1/3": no exact decimal to configure
            raise ValueError(field_name)
    except (ValueError, ZeroDivisionError):
        raise bad_value(
            field_name,
            value,
            f"a rate must be a positive finite decimal number of tokens/s (at most {MAX_RATE_TOKENS_PER_S}, "
            'at most 9 decimal places), e.g. "10" or "2.5"',
        ) from None
    return text


def _checked_int(low: int, optional: bool = False) -> Callable[[Any, str], int | None]:
    """A check of an integer field: an int >= ``low`` (None too if ``optional``)."""

    def check(value: Any, field_name: str) -> int | None:
        if value is None and optional:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise bad_value(field_name, value, f"must be an integer >= {low}" + (" or null" if optional else ""))
        return value

    return check


def _checked_bool(value: Any, field_name: str) -> bool:
    """A boolean field: JSON ``true`` or ``false``."""
    if not isinstance(value, bool):
        raise bad_value(field_name, value, "must be true or false")
    return value


def _checked_policy(value: Any, field_name: str) -> str:
    """vLLM's scheduling policy, ``"fcfs"`` or ``"priority"``."""
    if value not in ("fcfs", "priority"):
        raise bad_value(field_name, value, 'must be "fcfs" or "priority"')
    return value


def _checked_advances(value: Any, field_name: str) -> tuple[int, ...] | None:
    """``advances_ns``: null, or a list of clock advances in ns, each an integer >= 0."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise bad_value(field_name, value, "must be null or a list of integers >= 0 (ns)")
    check = _checked_int(0)
    return tuple(int(check(v, f"{field_name}[{i}]") or 0) for i, v in enumerate(value))


def checked_object(value: Any, where: str, known: tuple[str, ...], required: tuple[str, ...]) -> dict[str, Any]:
    """``value`` as a dict if it is a JSON object with no key outside ``known`` and every
    key of ``required``; else ``ScenarioFileError`` naming ``where`` and the keys."""
    if not isinstance(value, dict):
        raise bad_value(where, value, "must be a JSON object")
    unknown = sorted(set(value) - set(known), key=str)
    if unknown:
        raise ScenarioFileError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; known: {', '.join(known)}")
    missing = [k for k in required if k not in value]
    if missing:
        raise ScenarioFileError(f"{where}: missing key(s) {', '.join(missing)}")
    return dict(value)


def _checked_rates(value: Any) -> dict[str, str]:
    """``rates_tokens_per_s``: an object of user id -> rate (``checked_user_id``, ``checked_rate``)."""
    if not isinstance(value, dict):
        raise bad_value("rates_tokens_per_s", value, "must be a JSON object of user id -> rate")
    return {
        checked_user_id(user, "rates_tokens_per_s key"): checked_rate(rate, f"rates_tokens_per_s[{user!r}]")
        for user, rate in value.items()
    }


_REQUEST_CHECKS: dict[str, Callable[[Any, str], Any]] = {
    "prompt_len": _checked_int(1),
    "max_tokens": _checked_int(1),
    "eos_index": _checked_int(0, optional=True),
    "at_step": _checked_int(0),
    "priority": _checked_int(-(2**63)),
    "abort_at_step": _checked_int(0, optional=True),
}


def _checked_request(value: Any, where: str) -> RequestSpec:
    """One object of ``requests`` as a ``RequestSpec``, every field checked."""
    known = tuple(f.name for f in fields(RequestSpec))
    data = checked_object(value, where, known, required=("request_id", "user", "prompt_len", "max_tokens"))
    request_id = data["request_id"]
    if not isinstance(request_id, str) or not request_id:
        raise bad_value(f"{where}.request_id", request_id, "must be a non-empty string")
    if data["user"] is not None:  # null: no output_rate_user, the __anonymous__ bucket (R17)
        checked_user_id(data["user"], f"{where}.user")
    parent = data.get("parent")
    if parent is not None and (not isinstance(parent, str) or not parent):
        raise bad_value(f"{where}.parent", parent, "must be null or a non-empty string (the n > 1 parent's id)")
    for name, check in _REQUEST_CHECKS.items():
        if name in data:
            data[name] = check(data[name], f"{where}.{name}")
    return RequestSpec(**data)


def _as_number(text: str) -> int | float:
    value = Fraction(text)
    return int(value) if value.denominator == 1 else float(text)


_SCENARIO_FIELDS = tuple(f.name for f in fields(Scenario))
_SCENARIO_REQUIRED = ("rates_tokens_per_s", "requests", "step_interval_ns", "num_steps")
_SCENARIO_CHECKS: dict[str, Callable[[Any, str], Any]] = {
    "step_interval_ns": _checked_int(0),
    "num_steps": _checked_int(1),
    "chunked_prefill": _checked_bool,
    "async_scheduling": _checked_bool,
    "max_num_seqs": _checked_int(1, optional=True),
    "max_num_active_seqs": _checked_int(1, optional=True),
    "max_num_batched_tokens": _checked_int(1, optional=True),
    "num_blocks": _checked_int(1, optional=True),
    "block_size": _checked_int(1),
    "policy": _checked_policy,
    "burst_ms": _checked_int(1, optional=True),
    "feature_on": _checked_bool,
    "advances_ns": _checked_advances,
    "ample_from_step": _checked_int(0, optional=True),
    "prefix_caching": _checked_bool,
}


@dataclass
class Verdict:
    """Outcome of one scenario: ``failure`` is None when every check passed."""

    steps: int
    failure: str | None = None
    rule: str | None = None
    step: int | None = None
    sampled_per_user: dict[str, int] = field(default_factory=dict)
    level: str | None = None  # the level of the failed property (adapter/levels.py)
    # run_scenario(attribute=True): (context, step records) of the whole run (adapter/attribution.py)
    history: Any = None


@dataclass(frozen=True)
class Hunt:
    """How one gate row hunts (``adapter/conform.check_scheduler``, ``check_white_box``,
    the ``PairedCheck`` and ``HuntedCheck`` rows): ``examples`` seeded Hypothesis scenarios
    drawn with ``seed``, each of at most ``max_steps`` steps where the row draws by steps;
    ``tick()`` after each (progress); a failing scenario saved in ``save_dir`` (None: not
    saved, replayable with ``outrate replay`` when it is)."""

    examples: int
    seed: int = 0
    max_steps: int = 40
    tick: Callable[[], None] = lambda: None
    save_dir: Path | None = None


def spec_limiter_user(user: str | None) -> str:
    """R17: the limiter bucket of a request's ``output_rate_user`` (None: anonymous)."""
    return "__anonymous__" if user is None else user


RATES = ("2", "5", "10", "20", "50", "100", "3.5", "0.5", "0.3", "1000", "7.25")
INTEGER_RATES = ("1", "2", "5", "10", "20", "50", "100", "1000")
BURSTS_MS = (100, 100, 20, 250)
# User ids real traffic has (R17: ids are kept exactly as given; None = no
# ``output_rate_user``, the shared ``__anonymous__`` bucket).
USER_IDS = ("u0", "u1", "u2", "User-A", "user-a", " spaced ", "ünï-東京", "x" * 256, None)
# Clock advances between steps, ns: 1 ns to 250 ms (sub-ms steps reach the burst edge and
# ``ready_at`` closely).
STEP_INTERVALS_NS = (
    1,
    999_999,
    1_000_000,
    5_000_000,
    10_000_000,
    20_000_000,
    33_333_333,
    50_000_000,
    100_000_000,
    250_000_000,
)


@st.composite
def _users(draw, integer_rates: bool) -> tuple[list[str | None], dict[str, str], str]:
    """1-3 distinct users drawn from ``USER_IDS``; overrides for some of them (the others,
    and the anonymous bucket, use the default rate). Returns (users, overrides, default)."""
    users = draw(st.lists(st.sampled_from(USER_IDS), min_size=1, max_size=3, unique=True))
    pool = INTEGER_RATES if integer_rates else RATES
    default = draw(st.sampled_from(pool))
    overrides = {u: draw(st.sampled_from(pool)) for u in users if u is not None and draw(st.booleans())}
    return users, overrides, default


def _request_id(user: str | None, k: int, index: int) -> str:
    return f"anon-r{k}" if user is None else f"u{index}-r{k}"


@st.composite
def scenarios(
    draw,
    async_scheduling: bool | None = None,
    max_steps: int = 40,
    integer_rates: bool = False,
    burst_configurable: bool = False,
) -> Scenario:
    """Hypothesis strategy: 1-3 users (named, odd ids, anonymous), 1-4 streams each, ample
    budget, KV and seats, sometimes an active cap (R12) below the number of streams, prefix
    caching on or off (the prompts share a prefix: cached-prompt admissions).

    ``integer_rates``: draw integer rates only (the article's flags take integers).
    ``burst_configurable``: sometimes configure a ``burst_ms`` other than 100.
    """
    users, overrides, default = draw(_users(integer_rates))
    num_steps = draw(st.integers(1, max_steps))
    requests = []
    for index, user in enumerate(users):
        for k in range(draw(st.integers(1, 4))):
            eos = draw(st.one_of(st.none(), st.integers(0, 20)))
            requests.append(
                RequestSpec(
                    request_id=_request_id(user, k, index),
                    user=user,
                    prompt_len=draw(st.integers(1, 40)),
                    max_tokens=draw(st.integers(1, 24)),
                    eos_index=eos,
                    at_step=draw(st.integers(0, max(0, num_steps - 1))),
                )
            )
    cap = draw(st.one_of(st.none(), st.integers(1, max(1, len(requests) - 1)))) if len(requests) > 1 else None
    step_interval_ns = draw(st.sampled_from(STEP_INTERVALS_NS))
    chunked = draw(st.booleans())
    async_mode = draw(st.booleans()) if async_scheduling is None else async_scheduling
    drawn = (overrides, default, requests, step_interval_ns, num_steps, chunked, async_mode)
    return _fanned_out(draw, _drawn_scenario(draw, drawn, burst_configurable, max_num_active_seqs=cap))


def _fanned_out(draw, scenario: Scenario) -> Scenario:
    """Sometimes (1 in 4, drawn last) one user's streams made the children of one n > 1
    request, as vLLM's front end fans it out: one prompt, one ``max_tokens``, one arrival,
    one shared ``SamplingParams`` (``parallel_children``); each child keeps its own EOS."""
    by_user: dict[str | None, list[RequestSpec]] = {}
    for r in scenario.requests:
        by_user.setdefault(r.user, []).append(r)
    families = [rs for rs in by_user.values() if len(rs) >= 2]
    if not families or draw(st.integers(0, 3)) != 0:
        return scenario
    family = draw(st.sampled_from(families))
    first = family[0]
    parent = f"{first.request_id.rpartition('-')[0]}-n{len(family)}"
    shared = {"prompt_len": first.prompt_len, "max_tokens": first.max_tokens, "at_step": first.at_step}
    ids = {r.request_id for r in family}
    requests = tuple(replace(r, parent=parent, **shared) if r.request_id in ids else r for r in scenario.requests)
    return replace(scenario, requests=requests)


def _drawn_scenario(draw, drawn: tuple, burst_configurable: bool, **pressure: Any) -> Scenario:
    """The strategies' common end: the scenario of ``drawn`` (overrides, default rate,
    requests, clock step in ns, steps, chunked prefill, async mode) and ``pressure`` (the
    resource limits), all drawn by the caller, with a ``burst_ms`` (sometimes, with
    ``burst_configurable``) and prefix caching drawn last."""
    overrides, default, requests, step_interval_ns, num_steps, chunked, async_mode = drawn
    return Scenario(
        rates_tokens_per_s=overrides,
        default_rate_tokens_per_s=default,
        requests=tuple(requests),
        step_interval_ns=step_interval_ns,
        num_steps=num_steps,
        chunked_prefill=chunked,
        async_scheduling=async_mode,
        **pressure,
        burst_ms=draw(st.sampled_from(BURSTS_MS)) if burst_configurable and draw(st.booleans()) else None,
        prefix_caching=draw(st.booleans()),  # swarm: vLLM's default, a cached-prompt path (issue 18)
    )


@st.composite
def pressured_scenarios(
    draw,
    async_scheduling: bool | None = None,
    max_steps: int = 40,
    integer_rates: bool = False,
    burst_configurable: bool = False,
) -> Scenario:
    """Hypothesis strategy with resource pressure: few KV blocks (preemption), small token
    budgets (chunking), an active cap below max_num_seqs, FCFS or PRIORITY, aborts; and
    sometimes a run past step 256 (R6 cleanup). Users, rates and clock steps as in
    ``scenarios``."""
    users, overrides, default = draw(_users(integer_rates))
    long_run = draw(st.integers(0, 9)) == 0
    num_steps = 260 if long_run else draw(st.integers(1, max_steps))
    policy = draw(st.sampled_from(["fcfs", "priority"]))
    requests = []
    for index, user in enumerate(users):
        for k in range(draw(st.integers(1, 3))):
            at = draw(st.integers(0, max(0, min(num_steps, 40) - 1)))
            abort = draw(st.integers(at + 1, at + 30)) if draw(st.integers(0, 4)) == 0 else None
            requests.append(
                RequestSpec(
                    request_id=_request_id(user, k, index),
                    user=user,
                    prompt_len=draw(st.integers(1, 40)),
                    max_tokens=draw(st.integers(1, 16)),
                    eos_index=draw(st.one_of(st.none(), st.integers(0, 16))),
                    at_step=at,
                    priority=draw(st.integers(0, 4)) if policy == "priority" else 0,
                    abort_at_step=abort,
                )
            )
    max_num_seqs = draw(st.integers(1, len(requests) + 1))
    block_size = draw(st.sampled_from([4, 8, 16]))
    # The longest request (prompt 40 + 16 outputs) must fit alone; vLLM keeps one null block.
    longest_blocks = -(-(40 + 16) // block_size) + 1
    chunked = draw(st.booleans())
    step_interval_ns = draw(st.sampled_from(STEP_INTERVALS_NS[1:]))
    async_mode = draw(st.booleans()) if async_scheduling is None else async_scheduling
    max_num_active_seqs = draw(st.integers(1, max_num_seqs))
    # Without chunked prefill a whole prompt must fit the budget.
    # vLLM requires max_num_batched_tokens >= max_num_seqs.
    budget = max(draw(st.sampled_from([8, 16, 32, 64, 2048])), max_num_seqs) if chunked else 2048
    drawn = (overrides, default, requests, step_interval_ns, num_steps, chunked, async_mode)
    return _drawn_scenario(
        draw,
        drawn,
        burst_configurable,
        max_num_seqs=max_num_seqs,
        max_num_active_seqs=max_num_active_seqs,
        max_num_batched_tokens=budget,
        num_blocks=draw(st.integers(longest_blocks, longest_blocks * 3)),
        block_size=block_size,
        policy=policy,
    )


def feature_off(scenario: Scenario) -> Scenario:
    """The same scenario with no output-rate configuration at all (R18)."""
    from dataclasses import replace

    return replace(scenario, feature_on=False, burst_ms=None)


def build_harness(scheduler_cls: str, scenario: Scenario, style=None, output_rate_extra=None):
    """A ``Harness`` for ``scenario`` with ample resources (only the limit can pause).

    ``style``: an ``adapter.configstyle.ConfigStyle`` (None: ``AdditionalConfigStyle``).
    ``output_rate_extra``: keys added to the scenario's ``output_rate`` section (the gate's
    ``shadow/*`` check adds ``{"shadow": True}``); feature on only.
    Raises ``ValueError`` when the style cannot express the scenario's rates.
    """
    from vllm_output_rate.adapter.harness import EngineShape, Harness

    shape = EngineShape(
        max_num_seqs=scenario.max_num_seqs or max(len(scenario.requests), 1),
        max_num_active_seqs=scenario.max_num_active_seqs,
        max_num_batched_tokens=scenario.max_num_batched_tokens or 2048,
        chunked_prefill=scenario.chunked_prefill,
        block_size=scenario.block_size,
        num_blocks=scenario.num_blocks or 4096,
        policy=scenario.policy,
        async_scheduling=scenario.async_scheduling,
        output_rate=scenario.output_rate_config(),
        enable_prefix_caching=scenario.prefix_caching,
    )
    if output_rate_extra:
        if shape.output_rate is None:
            raise ValueError(f"output_rate_extra {output_rate_extra!r} needs a scenario with the feature on")
        shape = replace(shape, output_rate={**shape.output_rate, **output_rate_extra})
    return Harness(scheduler_cls, shape, style=style)


def run_scenario(
    scheduler_cls: str, scenario: Scenario, level: str = "exact", style=None, attribute: bool = False
) -> Verdict:
    """Run ``scenario`` on ``scheduler_cls``; stop at the first failing property.

    ``attribute``: a failure of the dispatch replay (over-grant, window bound, under-grant)
    is named by the rule it breaks (``adapter/attribution.py``): the run goes on to its end
    recording what the candidate does (judging nothing more), and the one-rule change of
    the spec limiter that explains the whole history names the rule; without it (the
    cheap default, for hunting and shrinking) the property's own rule is named.

    ``level`` (``adapter/levels.py``) chooses which properties are judged, each tagged with
    its level in the verdict:

    - must: R2/R7 every sampling dispatch granted by the spec limiter at its instant;
      R2 window bound; R11/P3 every request ends with exactly its outputs; in ample sync
      scenarios P4 no under-grant (a request of a user the limiter still grants is not
      paused, unless the active cap is full).
    - should: R11 throttled requests stay resident (no preemption in ample scenarios);
      R12 scheduled running requests <= the active cap; R14 a user's streams take turns
      (bounded bypass, ``R14_BYPASS_FACTOR``).
    - exact: the white-box invariants on the scheduler's ``last_step_observation``.

    ``style``: how the candidate is configured (``adapter/configstyle.py``; None: through
    ``additional_config["output_rate"]``).
    """
    harness = (
        build_harness(scheduler_cls, scenario, style) if style is not None else build_harness(scheduler_cls, scenario)
    )
    judge = _Judge(scenario, harness, level)
    pending = sorted(scenario.requests, key=lambda r: r.at_step)
    aborts = scenario.abort_schedule()
    children = parallel_children(scenario.requests)
    rate_failure: tuple[tuple[str, str, str], int] | None = None  # kept while the rest is recorded
    for step in range(scenario.num_steps + DRAIN_STEP_LIMIT):
        judge.aborted_in_flight = _arrivals_and_aborts(harness, pending, aborts, step, children)
        if step >= scenario.num_steps and not pending and not aborts and len(harness.finished) == len(judge.by_id):
            break
        unfinished = [rid for rid in harness.num_outputs if rid not in harness.finished]
        resident = {r.request_id for r in harness.scheduler.running}
        judge.before_step()
        if rate_failure is not None:  # naming the rule: record the rest of the run, judge nothing
            try:
                trace = harness.step()
            except Exception:  # a later crash of the candidate: name the rule from the record so far
                break
            judge.record_only(step, trace, unfinished, resident)
        else:
            held = judge.crash_triggers() if attribute else []
            try:
                trace = harness.step()
            except Exception as exc:
                crash = judge.crash_verdict(step, exc, held) if attribute else None
                if crash is None:
                    raise
                return crash
            judge.triggers_seen.update(held)
            failure = judge.after_step(step, trace, unfinished, resident)
            if failure:
                if not (attribute and judge.nameable):
                    return Verdict(judge.steps, failure[2], failure[0], step, level=failure[1])
                rate_failure = failure, step
        harness.advance(_next_advance_ns(scenario, step, trace, judge.state, judge.by_id, harness))
    return _final_verdict(judge, harness, level, attribute, rate_failure)


def parallel_children(requests: tuple[RequestSpec, ...] | list[RequestSpec]) -> dict[str, Any]:
    """n > 1 (R17): request id -> the ``SamplingParams`` of each child request, built as
    vLLM's front end builds them: one ``SamplingParams`` of the parent (its user in
    ``extra_args["output_rate_user"]``, ``n`` = its children) handed to vLLM's
    ``ParentRequest``, whose children share one copy of it (and so one ``extra_args`` dict).
    Children of one parent have the same user and ``max_tokens``. Requests without a
    ``parent`` are not in the map. Call once per harness: the copies are live objects."""
    from vllm import SamplingParams
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine.parallel_sampling import ParentRequest

    from vllm_output_rate.adapter.harness import EOS_TOKEN_ID

    families: dict[str, list[RequestSpec]] = {}
    for r in requests:
        if r.parent is not None:
            families.setdefault(r.parent, []).append(r)
    out: dict[str, Any] = {}
    for parent_id, children in families.items():
        first = children[0]
        extra = None if first.user is None else {"output_rate_user": first.user}
        params = SamplingParams(n=len(children), max_tokens=first.max_tokens, extra_args=extra)
        params.update_from_generation_config({}, eos_token_id=EOS_TOKEN_ID)
        parent = ParentRequest(
            EngineCoreRequest(
                request_id=parent_id,
                prompt_token_ids=None,
                mm_features=None,
                sampling_params=params,
                pooling_params=None,
                arrival_time=0.0,
                lora_request=None,
                cache_salt=None,
                data_parallel_rank=None,
                external_req_id=parent_id,
            )
        )
        for index, child in enumerate(children):
            out[child.request_id] = parent.get_child_info(index)[1]
    return out


def add_spec(harness: Any, r: RequestSpec, children: dict[str, Any]) -> None:
    """Add request ``r`` to ``harness`` (an n > 1 child with its shared ``SamplingParams``
    from ``children``, ``parallel_children``)."""
    harness.add_request(
        r.request_id,
        r.user,
        r.prompt_len,
        r.max_tokens,
        r.eos_index,
        r.priority,
        sampling_params=children.get(r.request_id),
    )


def _arrivals_and_aborts(
    harness: Any,
    pending: list[RequestSpec],
    aborts: list[tuple[int, RequestSpec]],
    step: int,
    children: dict[str, Any] | None = None,
) -> list[str]:
    """Before ``step``: add the requests that arrive by then and abort the ones due (a
    request is never aborted in the step it arrives); both lists are consumed in order.
    ``children``: the n > 1 children's shared params (``parallel_children``).
    Returns the requests aborted with a step still in flight (vLLM's output placeholders)."""
    while pending and pending[0].at_step <= step:
        add_spec(harness, pending.pop(0), children or {})
    in_flight = []
    while aborts and aborts[0][0] <= step and aborts[0][1].at_step < step:
        rid = aborts.pop(0)[1].request_id
        request = harness.scheduler.requests.get(rid)
        if request is not None and getattr(request, "num_output_placeholders", 0) > 0:
            in_flight.append(rid)
        harness.abort(rid)
    return in_flight


def _final_verdict(
    judge: _Judge, harness: Any, level: str, attribute: bool, rate_failure: tuple[tuple[str, str, str], int] | None
) -> Verdict:
    """The verdict after the stepping loop: the rate failure kept for naming (with the
    run's history), else a request cut short after the drain, else a pass with each
    user's sampled tokens."""
    from vllm_output_rate.adapter.levels import includes

    if rate_failure is not None:
        (rule, failed_level, text), step = rate_failure
        return Verdict(judge.steps, text, rule, step, level=failed_level, history=judge.naming_history())
    harness.drain()
    cut = _cut_request(judge, harness)
    if cut is not None:
        return cut
    assert includes(level, "must")
    return Verdict(
        judge.steps,
        None,
        sampled_per_user={u: len(t) for u, t in judge.history.items()},
        history=judge.naming_history() if attribute else None,
    )


def _cut_request(judge: _Judge, harness: Any) -> Verdict | None:
    """R11/P3 after the drain: the first request (not aborted) that did not end with exactly
    its outputs (``max_tokens``, or up to its EOS), as a failed verdict; None if all did."""
    for rid, r in judge.by_id.items():
        got = harness.finished.get(rid)
        if got is not None and got[0] == "abort":
            continue
        expected = r.max_tokens if r.eos_index is None or r.eos_index >= r.max_tokens else r.eos_index + 1
        if got is None or got[1] != expected:
            return Verdict(
                judge.steps,
                f"{judge.name}: {rid} ended with {got} but must end with {expected} "
                "outputs: the article pauses a request, it never cuts or fails it",
                "R11",
                None,
                level="must",
            )
    return None


PROBE_TOKEN_FACTOR = 4  # a naming probe asks this many times each request's outputs (at most PROBE_MAX_TOKENS)
PROBE_MIN_TOKENS = 32  # and, KV ample, at least this many: past a 1 s burst at 20 tok/s (R1's slip of tau shows)
PROBE_MAX_TOKENS = 64
PROBE_RATE_FACTOR = 25  # the faster probe's rates, x the counterexample's
PROBE_CROWD = 6  # the crowd probe runs each named user's requests this many times over


def naming_probes(scenario: Scenario) -> list[Scenario]:
    """Scenarios derived from a counterexample that give the rule naming more of the
    candidate's behaviour to explain (``named_verdict``): the same requests, arrivals and
    clock with more outputs each (longer decoding, more pacing decisions), also without
    EOS, and, for a scenario under pressure, also without it (ample seats, budget and KV,
    no aborts: every pause is then the limiter's); the counterexample at 25 x its rates
    (pressure kept: two refund slips part there); each named user idle 10 s, then a crowd
    of its requests (``_idle_probes``); the named users' requests six times over
    (a crowd of first tokens); in async mode, also in sync mode (a slip
    of the step in flight, R8, acts only in async); with chunked prefill, also without it
    (a slip of the n - 1 advance, R10, acts only with it); and those requests again beside copies
    for a twin of each named user at the same rate (one bucket or one per user?), and, with
    per-user overrides, that again with the slowest override as every user's rate (a limiter
    at the default rate, or none at all, then shows); under pressure, ``REFUND_PROBE`` (a
    refund given twice, R9, and a TAT forgotten, R4, part there)."""
    least = PROBE_MIN_TOKENS if scenario.num_blocks is None else 0  # a small KV cache must still hold them
    longer = tuple(
        replace(r, max_tokens=min(PROBE_MAX_TOKENS, max(r.max_tokens * PROBE_TOKEN_FACTOR, r.max_tokens + 8, least)))
        for r in scenario.requests
    )
    # (``ample_from_step`` is the author's guarantee for the original requests, not for longer ones.)
    probes = [replace(scenario, requests=longer, ample_from_step=None)]
    if any(r.eos_index is not None for r in longer):
        probes.append(
            replace(scenario, requests=tuple(replace(r, eos_index=None) for r in longer), ample_from_step=None)
        )
    unpressured = tuple(replace(r, abort_at_step=None) for r in longer)
    if not scenario.ample:  # the same without pressure: every pause is then the limiter's (evidence)
        probes.append(
            replace(scenario, requests=unpressured, max_num_seqs=None, max_num_batched_tokens=None, num_blocks=None)
        )
    # The same, pressure kept, at 25 x every rate: a user's lead can then exceed two
    # emission intervals, where a refund given twice (R9) and a TAT forgotten (R4) differ.
    faster = {u: str(Decimal(r) * PROBE_RATE_FACTOR) for u, r in scenario.rates_tokens_per_s.items()}
    probes.append(
        replace(
            scenario,
            rates_tokens_per_s=faster,
            default_rate_tokens_per_s=str(Decimal(scenario.default_rate_tokens_per_s) * PROBE_RATE_FACTOR),
        )
    )
    probes += _mode_probes(scenario, unpressured)
    probes += _twin_probes(scenario, unpressured)
    probes += _idle_probes(scenario)
    if not scenario.ample:  # a refund slip acts only under pressure
        probes.append(REFUND_PROBE)
    return probes


# R4 vs R9: a charge refunded while its user's TAT is more than one emission interval ahead.
# User b at 20 tokens/s (T = 50 ms, tau = 100 ms = 2 T) on 4 KV blocks of 16, FCFS. Step 0
# (t = 0) a-r0 (prompt 17, 2 blocks) and b-r0 (prompt 4) sample; step 1 (1 ms) b-r0 decodes
# and b-r1 (prompt 16, arrived with b-r2 and b-r3 behind it) is charged, then its allocation
# fails: refunded, b's TAT is 100 ms. Step 2 (2 ms) a-r0 and b-r0 have finished and b's
# three requests are admitted: the spec grants 1 (lead 98 ms), a refund given twice 2 (lead
# 48 ms), a TAT forgotten on the refund 3 (a fresh bucket).
REFUND_PROBE = Scenario(
    rates_tokens_per_s={"b": "20"},
    default_rate_tokens_per_s="1000",
    requests=(
        RequestSpec("a-r0", "a", 17, 2),
        RequestSpec("b-r0", "b", 4, 2),
        RequestSpec("b-r1", "b", 16, 4, at_step=1),
        RequestSpec("b-r2", "b", 4, 4, at_step=1),
        RequestSpec("b-r3", "b", 4, 4, at_step=1),
    ),
    step_interval_ns=1_000_000,
    num_steps=8,
    num_blocks=4,
)


PROBE_IDLE_NS = 10_000_000_000  # the idle probe's gap between a user's first token and its crowd


def _idle_probes(scenario: Scenario) -> list[Scenario]:
    """Each named user samples one token, idles 10 s, then a crowd of ``PROBE_CROWD`` of its
    requests arrives together, well before any cleanup (R6): a limiter that banks idle time
    (no clamp of the TAT up to now, R2) grants the whole crowd, one with a cleanup slip does
    not."""
    users = sorted({r.user for r in scenario.requests if r.user is not None})
    if not users:
        return []
    first = tuple(RequestSpec(f"{u}~i0", u, 4, 1) for u in users)
    crowd = tuple(RequestSpec(f"{u}~i{k}", u, 4, 1, at_step=2) for u in users for k in range(1, PROBE_CROWD + 1))
    return [
        replace(
            scenario,
            requests=first + crowd,
            num_steps=4,
            advances_ns=(1, PROBE_IDLE_NS),
            step_interval_ns=1_000_000,
            ample_from_step=None,
            max_num_seqs=None,
            max_num_batched_tokens=None,
            num_blocks=None,
            max_num_active_seqs=None,
        )
    ]


def _mode_probes(scenario: Scenario, unpressured: tuple[RequestSpec, ...]) -> list[Scenario]:
    """``naming_probes``' variants of ``unpressured`` (the longer requests, no aborts) with
    ample resources: a crowd of the named users' requests, the same in sync mode (async
    scenarios), the same without chunked prefill (chunked scenarios)."""
    probes: list[Scenario] = []
    # Each named user's requests six times over, arriving together: first tokens alone then
    # pass the burst (a limiter that charges only them, R9, refuses; no limiter does not).
    crowd = tuple(
        replace(r, request_id=f"{r.request_id}~c{k}")
        for k in range(1, PROBE_CROWD)
        for r in unpressured
        if r.user is not None
    )
    if crowd:
        probes.append(
            replace(
                scenario,
                requests=unpressured + crowd,
                max_num_seqs=None,
                max_num_batched_tokens=None,
                num_blocks=None,
                max_num_active_seqs=None,
            )
        )
    if scenario.async_scheduling:  # the same in sync mode: a slip of the in-flight step (R8) or not?
        probes.append(
            replace(
                scenario,
                requests=unpressured,
                async_scheduling=False,
                max_num_seqs=None,
                max_num_batched_tokens=None,
                num_blocks=None,
            )
        )
    if scenario.chunked_prefill:  # the same without chunked prefill: R10's n - 1 advance or not?
        probes.append(
            replace(
                scenario,
                requests=unpressured,
                chunked_prefill=False,
                max_num_seqs=None,
                max_num_batched_tokens=None,
                num_blocks=None,
            )
        )
    return probes


def _twin_probes(scenario: Scenario, unpressured: tuple[RequestSpec, ...]) -> list[Scenario]:
    """``naming_probes``' twin variants: ``unpressured`` beside copies for a twin of each
    named user at the same rate, and that again with the slowest override as the default."""
    probes: list[Scenario] = []
    # The same requests again for a second user of the same rate (one bucket or two?).
    twin = {u: f"{u}~2" for u in {r.user for r in scenario.requests if r.user is not None}}
    if twin:
        copies = tuple(
            replace(r, request_id=f"{r.request_id}~2", user=twin[r.user]) for r in unpressured if r.user is not None
        )
        rates = dict(scenario.rates_tokens_per_s) | {
            twin[u]: r for u, r in scenario.rates_tokens_per_s.items() if u in twin
        }
        twins = replace(
            scenario,
            requests=unpressured + copies,
            rates_tokens_per_s=rates,
            max_num_seqs=None,
            max_num_batched_tokens=None,
            num_blocks=None,
            max_num_active_seqs=None,
        )
        probes.append(twins)
        if scenario.rates_tokens_per_s:  # and with the slowest override as the default (does the default bind?)
            slowest = min(scenario.rates_tokens_per_s.values(), key=Fraction)
            probes.append(replace(twins, rates_tokens_per_s={}, default_rate_tokens_per_s=slowest))
    return probes


# The dispatch replay's properties (over-grant, window bound, under-grant), and the rate
# layer's should-level ones (R12 active cap, R13 victims, R14/R15 turns): a slip of the
# limiter underneath shows in them too, and is named when the dispatches contradict the spec
# limiter (``attribution.attribute``); when they do not, the property's own rule stands.
NAMEABLE_RULES = ("R2", "R10", "R11", "R12", "R13", "R14/R15")


def named_verdict(scheduler_cls: str, scenario: Scenario, level: str = "exact", style=None) -> Verdict:
    """``run_scenario`` on a counterexample, with a failure of the dispatch replay named
    by the rule it breaks (``adapter/attribution.py``): the one-rule change of the spec
    limiter that explains the candidate's whole run on the counterexample and on its
    ``naming_probes`` (each run to its end, recorded). Without one, or for any other
    failure, the verdict is ``run_scenario``'s."""
    verdict = run_scenario(scheduler_cls, scenario, level, style, attribute=True)
    if verdict.failure is None or verdict.history is None or verdict.rule not in NAMEABLE_RULES:
        return verdict
    histories = [verdict.history]
    for probe in naming_probes(scenario):
        try:
            probe_verdict = run_scenario(scheduler_cls, probe, level, style, attribute=True)
        except Exception:  # a probe the candidate crashes on gives no evidence
            continue
        if probe_verdict.history is not None:
            histories.append(probe_verdict.history)
    found = attribution.attribute(histories)
    if found is None:
        return verdict
    hyp, others = found
    name = scheduler_cls.rpartition(".")[2]
    text = (
        f"{attribution.message(name, hyp, others, sum(len(h) for _, h in histories), len(histories))}. "
        f"Seen first: {verdict.failure}"
    )
    return replace(verdict, failure=text, rule=hyp.rule)


R14_BYPASS_FACTOR = 2  # R14: a ready stream waits at most this x (the user's streams) grants


@dataclass(frozen=True)
class _StepStart:
    """vLLM's requests before one ``schedule()`` (``_Judge.before_step``): ``running`` in
    order; the unfinished requests with only their sampling position left
    (``decoding``), and those with a token still to dispatch (``demand``)."""

    running: list[str]
    decoding: set[str]
    demand: set[str]
    fresh: set[str] = field(default_factory=set)  # no output and no step in flight yet
    in_flight: set[str] = field(default_factory=set)  # a step still in flight (async placeholders)
    untouched: set[str] = field(default_factory=set)  # no token computed yet
    # FCFS: the first request of vLLM's ``waiting`` and the tokens its whole prompt still needs
    waiting_head: tuple[str, int] | None = None


class _Judge:
    """Per-step checks of one scenario run; keeps the spec limiter replay.

    A failure is ``(rule, level, message)``; messages name the class under test.
    """

    def __init__(self, scenario: Scenario, harness, level: str) -> None:
        from vllm_output_rate.adapter.levels import includes

        self.scenario = scenario
        self.harness = harness
        self.name = harness.cls_path.rpartition(".")[2]
        self.should = includes(level, "should")
        self.exact = includes(level, "exact")
        self.by_id = {r.request_id: r for r in scenario.requests}
        self.state = spec_limiter.EMPTY
        self.history: dict[str, list[int]] = {}  # user -> time of each sampling dispatch
        self.last_sample_step: dict[str, int] = {}  # request id -> last step it sampled
        self.bypassed: dict[str, int] = {}  # R14: request id -> same-user grants since it last sampled
        self.bypass_bound: dict[str, int] = {}  # R14: request id -> the largest bound since then
        self.steps = 0
        self.start: _StepStart | None = None  # what vLLM's requests looked like before this step
        self.records: list[attribution.StepRecord] = []  # the black-box history, for naming a rule
        self.nameable = False  # the failure is one of the dispatch replay (``_named``)
        self.aborted_in_flight: list[str] = []  # aborted before this step with a step in flight
        self.triggers_seen: set[tuple[str, str]] = set()  # ``crash_triggers`` held before a step that ran

    def crash_triggers(self) -> list[tuple[str, str]]:
        """The rare events of the rate layer due in the next ``schedule()``, as (rule, what),
        from what vLLM exposes (``before_step`` first): R6 its cleanup cadence; R14 a user's
        last-served stream (the one of its resident streams that sampled last, alone in
        its step) is the last of them in ``running``, so the next turn wraps around."""
        due = []
        if (self.steps + 1) % spec_limiter.CLEANUP_INTERVAL_STEPS == 0:
            due.append(("R6", "the cleanup of idle users is due (every 256th schedule())"))
        assert self.start is not None, "before_step() first"
        groups: dict[tuple[str, int], list[str]] = {}
        for rid in self.start.running:
            if rid in self.by_id and rid in self.last_sample_step:
                groups.setdefault((self.user_of(rid), self.by_id[rid].priority), []).append(rid)
        for members in groups.values():
            latest = max(self.last_sample_step[rid] for rid in members)
            served = [rid for rid in members if self.last_sample_step[rid] == latest]
            if len(members) > 1 and served == [members[-1]]:
                due.append(("R14", "a user's turn wraps around: its last-served stream is the last of its streams"))
                break
        return due

    def crash_verdict(self, step: int, exc: Exception, held: list[tuple[str, str]]) -> Verdict | None:
        """The candidate raised ``exc`` in the ``schedule()`` of ``step``: a verdict naming the
        rule whose rare event (``crash_triggers``) is due for the first time in the run at
        that step, when exactly one is; else None (an unnamed crash). Re-raises an error of
        the gate's own code."""
        from vllm_output_rate.adapter.conform import _reraise_gate_error

        _reraise_gate_error(exc)
        first = [t for t in held if t not in self.triggers_seen]
        if len(first) != 1:
            return None
        rule, what = first[0]
        failure = (
            f"{self.name} raised {type(exc).__name__}: {exc} in the schedule() of step {step}, the first step of "
            f"the run in which {what} ({rule}): a crash on {rule}'s path"
        )
        return Verdict(self.steps, failure, rule, step, level="must")

    def before_step(self) -> None:
        """Record, from vLLM's own ``Request`` fields, the state the next ``schedule()``
        starts from: ``running`` in order and, per unfinished request, whether only its
        sampling position is left (decoding, R10) and whether it still has a token to
        dispatch (outputs plus in-flight placeholders below ``max_tokens``, V3)."""
        scheduler = self.harness.scheduler
        decoding, demand, fresh, in_flight, untouched = set(), set(), set(), set(), set()
        for rid, r in scheduler.requests.items():
            placeholders = getattr(r, "num_output_placeholders", 0)
            if placeholders > 0:
                in_flight.add(rid)
            elif r.num_output_tokens == 0:
                fresh.add(rid)
            if r.num_computed_tokens == 0:
                untouched.add(rid)
            if r.num_computed_tokens >= r.num_tokens + placeholders - 1:
                decoding.add(rid)
            last_in_flight = placeholders > 0 and (
                r.num_computed_tokens + 2 - placeholders >= r.num_prompt_tokens + r.max_tokens
            )
            if r.num_output_tokens + placeholders < r.max_tokens and not last_in_flight:
                demand.add(rid)
        head = None
        if self.scenario.policy == "fcfs" and scheduler.waiting:
            first = next(iter(scheduler.waiting))
            head = (first.request_id, first.num_tokens - first.num_computed_tokens)
        self.start = _StepStart(
            [r.request_id for r in scheduler.running], decoding, demand, fresh, in_flight, untouched, head
        )

    def user_of(self, rid: str) -> str:
        """The R17 bucket of request ``rid``."""
        user = self.by_id[rid].user
        return spec_limiter_user(user)

    def _replay_dispatches(self, trace) -> tuple[str, str, str] | None:
        """R2 (must): replay the step's sampling dispatches (``trace.sampled``, at
        ``trace.now_ns``) on the spec GCRA, one take each, into ``state`` and ``history``.
        The first dispatch the GCRA refuses is a failure, named from the dispatch replay
        (``_named``); the dispatches after it are not replayed."""
        scenario, now = self.scenario, trace.now_ns
        for rid in trace.sampled:
            user = self.user_of(rid)
            self.state, granted = spec_limiter.try_take(
                self.state, user, scenario.rate_of(user), now, scenario.burst_ns
            )
            if not granted:
                return self._named(
                    "R2",
                    "must",
                    (
                        f"{self.name} dispatched {rid} (user {user!r}) to sample at t={now} ns although the GCRA "
                        f"(rate {scenario.rate_of(user)} tokens/s, burst {scenario.burst_ns // 1_000_000} ms) "
                        f"refuses it: over the user's rate"
                    ),
                )
            self.history.setdefault(user, []).append(now)
        return None

    def _under_grant_checks(
        self, step: int, trace, unfinished: list[str], resident: set[str], state_before
    ) -> tuple[str, str, str] | None:
        """P4 for the regime of ``step`` (``state_before``: the replay at the step's start):
        ample and sync, ``_ample_sync_checks``; ample under async scheduling, or past the
        pressure, ``_under_grant_check`` alone; under pressure,
        ``_pressured_under_grant_check``. The first failure, or None."""
        scenario = self.scenario
        if scenario.ample and not scenario.async_scheduling:
            return self._ample_sync_checks(step, trace, unfinished, resident, state_before)
        if scenario.ample_at(step):
            # Async (ample, or ample from a step on), or sync past the pressure: the
            # under-grant check (P4) alone, for the requests that still have a token to
            # dispatch (async: the last one may be in flight).
            demand = self.start.demand if self.start is not None else set(unfinished)
            return self._under_grant_check(trace, [r for r in unfinished if r in demand], resident)
        # under pressure, sync and async: where the article fixes the outcome
        return self._pressured_under_grant_check(trace, unfinished)

    def after_step(self, step: int, trace, unfinished: list[str], resident: set[str]) -> tuple[str, str, str] | None:
        """Judge the step ``step`` just run (``trace``: its black-box facts; ``unfinished``
        and ``resident``: request ids after it): replay its dispatches (R2), the under-grant
        checks of its regime (P4, R11, R12), the window bound (R2), then at level should
        the active cap (R12), victim choice (R13) and ``_blind_spot_checks``, and at level
        exact the white-box checks. Returns the first failure as (rule, level, message), or
        None; with the feature off it only records coverage."""
        self.steps += 1
        scenario, now = self.scenario, trace.now_ns
        coverage.observe(self, step, trace, unfinished, resident)  # obligations reached (adapter/coverage.py)
        if not scenario.feature_on:
            return None
        state_before = self.state  # the replay at the step's start (before its dispatches)
        self._record(trace)
        failure = self._replay_dispatches(trace)
        if failure:
            return failure
        if self.steps % spec_limiter.CLEANUP_INTERVAL_STEPS == 0:
            self.state = spec_limiter.cleanup_idle_users(self.state, now)  # R6, same cadence
        failure = self._under_grant_checks(step, trace, unfinished, resident, state_before)
        if failure:
            return failure
        for rid in trace.sampled:
            self.last_sample_step[rid] = step
        window_failure = _window_violation(self.history, scenario)
        if window_failure:
            return self._named("R2", "must", f"{self.name}: {window_failure}")
        if self.should and scenario.max_num_active_seqs is not None:
            scheduled_running = [r for r in trace.scheduled if r not in trace.admitted]
            if len(scheduled_running) > scenario.max_num_active_seqs:
                return self._named(
                    "R12",
                    "should",
                    (
                        f"{self.name} scheduled {len(scheduled_running)} running requests in one step, more than "
                        f"--max-num-active-seqs {scenario.max_num_active_seqs}"
                    ),
                )
        if self.should and scenario.policy == "priority" and trace.preempted:
            failure = self._priority_victim_check(trace, resident)
            if failure:
                return failure
        if self.should:
            failure = self._blind_spot_checks(trace, state_before)
            if failure:
                return failure
        if self.should and scenario.policy == "fcfs" and trace.preempted and self.start is not None:
            failure = self._fcfs_victim_check(trace, state_before, now)
            if failure:
                return failure
        if self.exact and trace.white is not None:
            failure2 = self._white_box_checks(trace)
            return (failure2[0], "exact", failure2[1]) if failure2 else None
        return None

    def _blind_spot_checks(self, trace, state_before) -> tuple[str, str, str] | None:
        """The should-level properties of ``adapter/step_checks.py`` (issue 26): R12 batch
        within the active cap, R10 no split prompt without chunked prefill and a running
        refused prefill advanced to n - 1, R13 throttled victims within the PRIORITY level,
        R14 other users' order in ``running`` kept by the rotation."""
        return (
            step_checks.batch_over_cap(self, trace)
            or step_checks.split_prompt(self, trace)
            or step_checks.running_prefill_held(self, trace, state_before)
            or step_checks.victim_within_level(self, trace, state_before)
            or step_checks.others_reordered(self)
        )

    def _ample_sync_checks(
        self, step: int, trace, unfinished: list[str], resident: set[str], state_before=None
    ) -> tuple[str, str, str] | None:
        failure = self._under_grant_check(trace, unfinished, resident) or self._admission_cap_check(
            trace, unfinished, resident
        )
        if failure or not self.should:
            return failure
        if trace.preempted:
            return (
                "R11",
                "should",
                (
                    f"{self.name} preempted {trace.preempted} although KV and seats are ample: "
                    "the article keeps throttled requests resident"
                ),
            )
        failure = self._prefill_advance_check(trace, unfinished, state_before)
        return failure or self._bypass_check(step, trace, unfinished)

    def _prefill_advance_check(self, trace, unfinished: list[str], state_before) -> tuple[str, str, str] | None:
        """R10 (level should), ample sync scenarios with chunked prefill, without prefix
        caching (a cache hit may already reach n - 1) or an active cap (admission under it is
        the article's open choice): a waiting request with no token computed and a prompt of
        2 or more tokens, whose user the GCRA refuses at the step's start (so at its charge
        point too: within ``schedule()`` a TAT only rises), still advances its prefill short
        of sampling in that step ("开启 chunked prefill 时，prefill 可以先推进到倒数第二个位置"),
        unless a waiting request before it was not admitted either (vLLM 0.32 stops admitting
        behind a request given 0 tokens: the open choice ``_under_grant_check`` excuses too)."""
        scenario, start = self.scenario, self.start
        if (
            start is None
            or not scenario.chunked_prefill
            or scenario.prefix_caching
            or scenario.max_num_active_seqs is not None
        ):
            return None
        now, burst = trace.now_ns, scenario.burst_ns
        rid = self._first_left_waiting(trace, unfinished, set(start.running))
        if rid is not None:
            r = self.by_id[rid]
            if (
                rid not in start.untouched
                or r.prompt_len < 2
                or scenario.policy != "fcfs"
                or spec_limiter.allows(state_before, self.user_of(rid), now, burst)
            ):
                return None  # the first waiting request left out is not judged here: all behind it are excused
            return self._named(
                "R10",
                "should",
                (
                    f"{self.name} left {rid} (user {self.user_of(rid)!r}, prompt {r.prompt_len} tokens) waiting at "
                    f"t={now} ns with nothing computed: its user is refused, and with chunked prefill the article "
                    f"still advances a refused prefill to n - 1 = {r.prompt_len - 1} (R10), seats and budget being "
                    "ample"
                ),
            )
        return None

    def _first_left_waiting(self, trace, unfinished: list[str], resident: set[str]) -> str | None:
        """The first request, in arrival order (= vLLM's FCFS waiting order), that was not
        running at the step start and was not scheduled in it; None if there is none."""
        return next(
            (rid for rid in unfinished if rid in self.by_id and rid not in resident and rid not in trace.scheduled),
            None,
        )

    def _admission_cap_check(self, trace, unfinished: list[str], resident: set[str]) -> tuple[str, str, str] | None:
        """R12 black-box at admission (level must), ample sync FCFS scenarios with an active
        cap A: the article's waiting loop admits while ``len(running) < M`` and ``len(running)
        - throttled < A`` ("先确认 running 总数没有达到 max_num_running_reqs，再把被跳过的请求从
        running 数里减掉，和 max_num_active_reqs 比较"). So when the running loop did not fill
        the cap (no running request was left out by it, so every running request left out at
        its sampling position is a throttled one: its user refused, ``_throttled_seats``) and,
        after the step, ``len(running) - throttled < A``, the first waiting request left
        waiting must not be of a user the GCRA still grants; a waiting request behind one
        left out is excused (the head-of-line open choice of ``_under_grant_check``)."""
        scenario, start = self.scenario, self.start
        cap = scenario.max_num_active_seqs
        if cap is None or start is None or scenario.policy != "fcfs":
            return None
        if sum(1 for r in trace.scheduled if r not in trace.admitted) >= cap:
            return None  # the running loop filled the cap: requests it left out count as running
        throttled = self._throttled_seats(trace, resident)
        counted = trace.num_running - len(throttled)  # len(running) when schedule() returned
        if counted >= cap:
            return None
        now, burst = trace.now_ns, scenario.burst_ns
        rid = self._first_left_waiting(trace, unfinished, resident)
        if rid is not None:
            user = self.user_of(rid)
            if not spec_limiter.allows(self.state, user, now, burst):
                if self.should and step_checks.can_advance(self, rid):
                    return (
                        "R10",
                        "should",
                        (
                            f"{self.name} left {rid} (user {user!r}) waiting at t={now} ns with its prefill not "
                            f"advanced although the active cap has room ({counted} < --max-num-active-seqs {cap} "
                            "after R12's count): its user is refused, and with chunked prefill the article still "
                            "admits it and advances its prefill to n - 1 (R10), so other users behind it proceed (P4)"
                        ),
                    )
                return None  # the first left waiting is refused: it and those behind it are not judged
            return self._named(
                "R12",
                "must",
                (
                    f"R12 broken: {self.name} left {rid} (user {user!r}) waiting at t={now} ns although the GCRA "
                    f"grants that user a token and the active cap has room: {trace.num_running} running after "
                    f"schedule(), {len(throttled)} of them throttled ({sorted(throttled)}, users the GCRA refuses), so "
                    f"{counted} < --max-num-active-seqs {cap}; R12: the waiting loop admits while len(running) - "
                    "throttled < A, throttled requests give up their place in the active cap"
                ),
            )
        return None

    def _under_grant_check(self, trace, unfinished: list[str], resident: set[str]) -> tuple[str, str, str] | None:
        """P4 (level must): a request of a user the GCRA still grants after this step's
        dispatches is scheduled to sample, unless the active cap is full; a waiting request
        behind a refused user's waiting request is excused (the article's open choice).
        Judged only where nothing but the limit can be short (``Scenario.ample_at``)."""
        now, sampled, cap = trace.now_ns, set(trace.sampled), self.scenario.max_num_active_seqs
        cap_full = cap is not None and len(trace.scheduled) >= cap
        burst = self.scenario.burst_ns
        blocked_behind = False  # an earlier waiting request of a refused user was not admitted
        limit_blocked: str | None = None  # ... one the article would have advanced to n - 1 (R10)
        for rid in unfinished:  # in arrival order (= vLLM's FCFS waiting order)
            user = self.user_of(rid)
            if (
                rid not in resident
                and rid not in trace.scheduled
                and not spec_limiter.allows(self.state, user, now, burst)
            ):
                # Open choice (docs/SPEC.md "What the article leaves open"): checking the user at
                # the charge point, after vLLM's own checks, gives that request 0 tokens, and vLLM
                # 0.32 then stops admitting the waiting requests behind it in this step. That stop
                # is vLLM's only where the refused request cannot advance short of sampling.
                if step_checks.can_advance(self, rid) and not blocked_behind:
                    limit_blocked = limit_blocked or rid
                else:
                    blocked_behind = True
                continue
            if cap is not None and rid not in resident:
                continue  # admission under an active cap is the article's open choice
            if rid not in resident and blocked_behind:
                continue
            if rid not in resident and limit_blocked is not None and rid not in trace.scheduled:
                if self.should and spec_limiter.allows(self.state, user, now, burst):
                    return self._head_of_line(rid, limit_blocked, now)
                continue
            if rid in sampled or cap_full:
                continue
            if self.records:
                self.records[-1].pauses.append(rid)  # the judge holds this pause to be the limiter's
            if spec_limiter.allows(self.state, user, now, burst):
                seated = self._throttled_seats(trace, resident) if cap is not None else []
                if cap is not None and len(trace.scheduled) + len(seated) >= cap:
                    # R12: the cap is full only if throttled running requests hold seats in it.
                    return (
                        "R12",
                        "must",
                        (
                            f"R12 broken: {self.name} paused {rid} (user {user!r}) at t={now} ns although the GCRA "
                            f"still grants that user a token: {len(trace.scheduled)} requests scheduled, below "
                            f"--max-num-active-seqs {cap}, which the throttled running requests {sorted(seated)} (users "
                            f"the GCRA refuses) fill only if they are counted; R12: throttled requests give up their "
                            f"place in the active cap. Seen: under-grant"
                        ),
                    )
                return self._named(
                    "R11",
                    "must",
                    (
                        f"{self.name} paused {rid} (user {user!r}) at t={now} ns although the GCRA still grants "
                        f"that user a token and nothing else (seats, budget, KV, active cap) was short: under-grant"
                    ),
                )
        return None

    def _head_of_line(self, rid: str, blocker: str, now: int) -> tuple[str, str, str]:
        """R10/P4 (should): ``rid`` left waiting behind ``blocker``, a refused waiting request
        whose prefill could have advanced short of sampling (``step_checks.can_advance``)."""
        return (
            "R10",
            "should",
            (
                f"R10 broken (P4): {self.name} left {rid} (user {self.user_of(rid)!r}) waiting at t={now} ns although "
                f"the GCRA grants that user and nothing else was short, behind {blocker} (user "
                f"{self.user_of(blocker)!r}, refused) whose prefill could still advance to n - 1: a refused waiting "
                "request ended admission, so other users' requests behind it wait (promise 4: 一个用户被限速时，其他用户"
                "照常推进). vLLM's own stops (a prompt that does not fit, a request left with only its sampling "
                "position) are stock; a stop caused by the refusal is not"
            ),
        )

    def _throttled_seats(self, trace, resident: set[str]) -> list[str]:
        """Running requests at the step start, not scheduled, with only their sampling
        position left and a token to dispatch, whose user the GCRA refuses (after the
        step's dispatches): the throttled requests R12 excludes from the active cap."""
        start, now, burst = self.start, trace.now_ns, self.scenario.burst_ns
        if start is None:
            return []
        return [
            rid
            for rid in start.running
            if rid in resident
            and rid in self.by_id
            and rid not in trace.scheduled
            and rid in start.decoding
            and rid in start.demand
            and not spec_limiter.allows(self.state, self.user_of(rid), now, burst)
        ]

    def _record(self, trace) -> None:
        """Append this step's black-box facts to ``records`` (``adapter/attribution.py``)."""
        start = self.start
        fresh = start.fresh if start is not None else set()
        in_flight = start.in_flight if start is not None else set()
        decoding = start.decoding if start is not None else set()
        untouched = start.untouched if start is not None else set(self.by_id)
        demand = start.demand if start is not None else set()
        sampled = set(trace.sampled)
        admitted = set(trace.admitted)
        # A chunk starts the prompt where SchedulerOutput says it starts at token 0 (a
        # prefix-cache hit starts it above 0); without that field, where nothing was computed.
        starts = trace.chunk_start
        untouched = {rid for rid in trace.scheduled if starts.get(rid, 0 if rid in untouched else 1) == 0}
        self.records.append(
            attribution.StepRecord(
                self.steps,
                trace.now_ns,
                [
                    attribution.Dispatch(rid, rid in fresh, rid in in_flight, rid in admitted, rid in untouched)
                    for rid in trace.sampled
                    if rid in self.by_id
                ],
                skipped=[
                    rid
                    for rid in self.by_id
                    if rid in demand and rid not in sampled and (rid in decoding or rid in trace.preempted)
                ]
                + self._blocked_head(trace),
                chunks=[
                    rid for rid in trace.scheduled if rid in self.by_id and rid not in sampled and rid not in decoding
                ],
                first_chunks=[rid for rid in trace.scheduled if rid in untouched and rid not in sampled],
                finished_in_flight=[
                    rid for rid in trace.finished if rid in in_flight and rid in sampled and rid in self.by_id
                ],
                held=self._held_at_n_minus_1(trace, fresh),
                aborted_in_flight=[rid for rid in self.aborted_in_flight if rid in self.by_id],
            )
        )

    def _held_at_n_minus_1(self, trace, fresh: set[str]) -> list[str]:
        """Requests with no output yet whose chunk ends exactly at ``prompt - 1`` in a step
        that left token budget: a final chunk held short of sampling (R10), so their user was
        asked at its charge point and refused."""
        budget = self.scenario.max_num_batched_tokens or 2048
        if sum(trace.scheduled.values()) >= budget:
            return []
        return [
            rid
            for rid, n in trace.scheduled.items()
            if rid in fresh
            and rid in self.by_id
            and rid not in trace.sampled
            and rid in trace.chunk_start
            and trace.chunk_start[rid] + n == self.by_id[rid].prompt_len - 1
        ]

    def _blocked_head(self, trace) -> list[str]:
        """The waiting request vLLM's waiting loop reached and could not admit, as a list
        (empty if none): FCFS, the first of ``waiting`` at the step start, not admitted, in a
        step that preempted nothing (vLLM then runs the waiting loop), left a seat free
        (``max_num_seqs``) and left token budget for its whole remaining prompt, so that its
        chunk would sample: its charge point (R7) came before the KV allocation that failed,
        and R9 refunds that charge."""
        head = self.start.waiting_head if self.start is not None else None
        if head is None or trace.preempted or head[0] not in self.by_id or head[0] in trace.scheduled:
            return []
        scenario = self.scenario
        if scenario.max_num_seqs is not None and trace.num_running >= scenario.max_num_seqs:
            return []
        budget = scenario.max_num_batched_tokens or 2048
        return [head[0]] if budget - sum(trace.scheduled.values()) >= head[1] else []

    def _named(self, rule: str, level: str, text: str) -> tuple[str, str, str]:
        """A rate failure of the dispatch replay: ``run_scenario(attribute=True)`` names
        its rule from the whole run (``name_rule``)."""
        self.nameable = True
        return rule, level, text

    def record_only(self, step: int, trace, unfinished: list[str], resident: set[str]) -> None:
        """After a rate failure: record the step's black-box facts and the pauses the judge
        would hold to be the limiter's, judging nothing."""
        self.steps += 1
        scenario, now = self.scenario, trace.now_ns
        self._record(trace)
        for rid in trace.sampled:
            user = self.user_of(rid)
            self.state, _ = spec_limiter.try_take(self.state, user, scenario.rate_of(user), now, scenario.burst_ns)
        if self.steps % spec_limiter.CLEANUP_INTERVAL_STEPS == 0:
            self.state = spec_limiter.cleanup_idle_users(self.state, now)
        if scenario.ample and not scenario.async_scheduling:
            self._under_grant_check(trace, unfinished, resident)
        elif scenario.ample_at(step):
            demand = self.start.demand if self.start is not None else set(unfinished)
            self._under_grant_check(trace, [r for r in unfinished if r in demand], resident)
        else:
            self._pressured_under_grant_check(trace, unfinished)

    def _pressured_under_grant_check(self, trace, unfinished: list[str]) -> tuple[str, str, str] | None:
        """P4 under pressure (level must, sync and async), where the article fixes the
        outcome: a step that left token budget, preempted nothing (so every KV allocation of
        vLLM's running loop succeeded and the loop reached every running request) and did
        not fill the active cap must serve every request that was running at its start with
        only its sampling position left and a token to dispatch, whose user the GCRA still
        grants after the step's dispatches (within ``schedule()`` a TAT only rises, so the
        user was granted at that request's charge point too). Under FCFS a step that
        preempted is judged too (``step_checks.fcfs_preempting_step_judged``: the loop still
        reached every request left running). Waiting requests are not
        judged here (admission under pressure is vLLM's and the article's open choice).

        Async (one step in flight): the same outcome is fixed. The charge condition counts
        the in-flight placeholders (R7; the article: "判断条件不变"), so a request with a
        step in flight is decoding (``_StepStart.decoding``); one whose placeholders already
        carry it to ``max_tokens`` has no token to dispatch (V3, R11: not ``demand``); the
        step after an unseen EOS is dispatched and charged like any other (R8), and nothing
        waits for model output (R8), so a granted request is not held for its in-flight
        output. A request the delivered output finished (its final token was in flight) is
        not judged: dispatching it again would give its user nothing. Refunds (R9) happen
        only at the end of ``schedule()``, after the running loop, and this check judges no
        step that preempted."""
        start, scenario = self.start, self.scenario
        if start is None or (trace.preempted and not step_checks.fcfs_preempting_step_judged(self, trace)):
            return None
        if not step_checks.left_room(self, trace):
            return None
        scheduled_running = [r for r in trace.scheduled if r not in trace.admitted]
        running_after = {r.request_id for r in self.harness.scheduler.running}
        now, burst = trace.now_ns, scenario.burst_ns
        for rid in start.running:
            if (
                rid not in self.by_id
                or rid not in unfinished
                or rid in trace.scheduled
                or rid not in running_after
                or rid not in start.decoding
                or rid not in start.demand
            ):
                continue
            user = self.user_of(rid)
            if self.records:
                self.records[-1].pauses.append(rid)  # the judge holds this pause to be the limiter's
            if spec_limiter.allows(self.state, user, now, burst):
                return self._paused_while_granted(trace, start, rid, user, scheduled_running)
        return None

    def _paused_while_granted(
        self, trace, start: _StepStart, rid: str, user: str, scheduled_running: list[str]
    ) -> tuple[str, str, str]:
        """The failure of ``_pressured_under_grant_check`` for running ``rid`` paused although
        the GCRA still grants ``user`` (``scheduled_running``: the step's scheduled requests
        that were not admitted in it): R12 (must) when those fill --max-num-active-seqs only
        if the throttled running requests (``_throttled_seats``) are counted, else R11
        (must, named from the dispatch replay: P4 under-grant under pressure)."""
        scenario, now = self.scenario, trace.now_ns
        budget, cap = scenario.max_num_batched_tokens or 2048, scenario.max_num_active_seqs
        seated = self._throttled_seats(trace, set(start.running)) if cap is not None else []
        if cap is not None and len(scheduled_running) + len(seated) >= cap:
            return (
                "R12",
                "must",
                (
                    f"R12 broken: {self.name} paused running {rid} (user {user!r}) at t={now} ns although the "
                    f"GCRA still grants that user a token and the step left budget and preempted nothing: "
                    f"{len(scheduled_running)} running requests scheduled, below --max-num-active-seqs {cap}, "
                    f"which the throttled running requests {sorted(seated)} (users the GCRA refuses) fill only "
                    f"if they are counted; R12: throttled requests give up their place. Seen: under-grant"
                ),
            )
        return self._named(
            "R11",
            "must",
            (
                f"{self.name} paused running {rid} (user {user!r}) at t={now} ns although the GCRA still grants "
                f"that user a token, the step left token budget ({sum(trace.scheduled.values())} of {budget} "
                "scheduled) and did not fill the active cap, "
                + (
                    f"and under FCFS vLLM's loop reached it after preempting {trace.preempted} from the end "
                    "of `running` (a preemption must not skip the next request)"
                    if trace.preempted
                    else "and preempted nothing"
                )
                + ": under-grant under pressure, other users must proceed (P4)"
            ),
        )

    def naming_history(self) -> tuple[attribution.Context, list[attribution.StepRecord]]:
        """(the scenario's facts, the recorded steps) for ``adapter/attribution.py``."""
        scenario = self.scenario
        ctx = attribution.Context(
            {rid: r.user for rid, r in self.by_id.items()},
            {u: Fraction(r) for u, r in scenario.rates_tokens_per_s.items()},
            Fraction(scenario.default_rate_tokens_per_s),
            scenario.burst_ns,
            scenario.chunked_prefill,
            scenario.async_scheduling,
        )
        return ctx, self.records

    def _grants_at(self, state, user: str, now: int, at_most: int) -> int:
        """How many takes (up to ``at_most``) the replay ``state`` grants ``user`` at ``now``."""
        rate, burst, n = self.scenario.rate_of(user), self.scenario.burst_ns, 0
        while n < at_most:
            state, granted = spec_limiter.try_take(state, user, rate, now, burst)
            if not granted:
                break
            n += 1
        return n

    def _fcfs_victim_check(self, trace, state_before, now: int) -> tuple[str, str, str] | None:
        """R13 under FCFS (level should), black-box, accepting both timings of "throttled"
        (the article: recorded so far in this step's loop; this spec: at the step start).

        Let Q be a request running at the step start, of a user the GCRA refuses at the
        step's instant (replay), with only its sampling position left and a token still to
        dispatch, that is neither scheduled nor preempted in the step, and whose (user,
        priority) group stands, in ``running`` at the step start, before every group with a
        request scheduled in the step (so vLLM's loop, which preempts only while sizing a
        request it then schedules, passed Q, refused it and recorded it as throttled
        before any allocation failed, whatever the rotation within groups). Then a
        preempted request P whose user the GCRA grants at the step start at least once per
        request it has running (so P is throttled at no timing) is a victim chosen over a
        throttled request: a violation."""
        throttled, grants, counts = self._fcfs_passed_throttled(trace, state_before, now)
        if not throttled:
            return None
        start = self.start
        assert start is not None, "checked only with the step start recorded"
        for rid in trace.preempted:
            if rid not in self.by_id or rid not in start.running:
                continue
            user = self.user_of(rid)
            if grants.get(user, 0) >= counts.get(user, 0) > 0:
                q = throttled[-1]
                return (
                    "R13",
                    "should",
                    (
                        f"{self.name} preempted {rid} (user {user!r}, granted at t={now} ns for each of its running "
                        f"requests) while {q} (user {self.user_of(q)!r}, refused at t={now} ns, throttled and passed "
                        "by the running loop before any KV allocation failed) kept its KV: the article preempts "
                        "throttled requests first"
                    ),
                )
        return None

    def _fcfs_passed_throttled(self, trace, state_before, now: int):
        """For ``_fcfs_victim_check``: (the requests Q, in ``running`` order; each running
        user's grants at the step start, up to its running requests; those counts)."""
        assert self.start is not None, "checked only with the step start recorded"
        if not any(rid in self.by_id for rid in self.start.running):
            return [], {}, {}
        return step_checks.passed_throttled(self, trace, state_before, set())

    def _priority_victim_check(self, trace, resident: set[str]) -> tuple[str, str, str] | None:
        """R13 under PRIORITY (level should): vLLM preempts at its victim level, the highest
        priority value in ``running``, and the article's preferred throttled victims are
        taken only within that level; so no request preempted in a step may have a lower
        priority value than a request that was running at the step start and still is."""
        running = {r.request_id for r in self.harness.scheduler.running}
        survivors = [rid for rid in resident if rid in running and rid in self.by_id]
        for rid in trace.preempted:
            if rid not in self.by_id:
                continue
            level = self.by_id[rid].priority
            above = sorted(s for s in survivors if self.by_id[s].priority > level)
            if above:
                return self._named(
                    "R13",
                    "should",
                    (
                        f"{self.name} preempted {rid} (priority {level}) while {above[0]} (priority "
                        f"{self.by_id[above[0]].priority}, a lower priority) kept its KV: under PRIORITY the victim is "
                        "taken at the lowest priority level, and the article's throttled victims only within it"
                    ),
                )
        return None

    def _bypass_check(self, step: int, trace, unfinished: list[str]) -> tuple[str, str, str] | None:
        """R14 as bounded bypass: while stream ``s`` of a user is decoding and unfinished,
        at most ``R14_BYPASS_FACTOR x n`` of that user's grants go to its other streams
        before ``s`` samples again (n: the user's unfinished streams)."""
        sampled = set(trace.sampled)
        by_user: dict[str, list[str]] = {}
        for rid in unfinished:
            by_user.setdefault(self.user_of(rid), []).append(rid)
        for user, streams in by_user.items():
            grants = [rid for rid in trace.sampled if self.user_of(rid) == user]
            bound = R14_BYPASS_FACTOR * len(streams)
            for rid in streams:
                if rid in sampled:
                    self.bypassed[rid] = 0
                    self.bypass_bound.pop(rid, None)
                elif rid in self.last_sample_step:
                    self.bypassed[rid] = self.bypassed.get(rid, 0) + len(grants)
                    # The bound of the longest turn cycle since rid last sampled: streams that
                    # finish meanwhile (n > 1 children end together) do not shrink it.
                    held = self.bypass_bound[rid] = max(bound, self.bypass_bound.get(rid, 0))
                    if self.bypassed[rid] > held:
                        # Turns (R14) start after the last-served stream (R15): a slip of either
                        # shows as the same bypass, so both are named.
                        return self._named(
                            "R14/R15",
                            "should",
                            (
                                f"{self.name}: {rid} of user {user!r} waited while {self.bypassed[rid]} of that "
                                f"user's tokens went to its other streams (bound {held}): the article's streams "
                                "of one user take turns (R14), each turn starting after the stream served last (R15)"
                            ),
                        )
        return None

    def _white_box_checks(self, trace) -> tuple[str, str] | None:
        white, now = trace.white, trace.now_ns
        charged, refunded, sampled = white["charged"], white["refunded"], set(trace.sampled)
        refund_error = spec_properties.charge_refund_error(charged, refunded, sampled)
        if refund_error is not None:
            return refund_error
        charged_chunks = (set(refunded) & set(trace.scheduled)) - sampled
        if charged_chunks:
            return "R7", (
                f"{sorted(charged_chunks)} charged (then refunded) for a step in which they are "
                "scheduled but do not sample: a prompt chunk was charged"
            )
        accounting = spec_properties.accounting_error(charged, refunded, sampled)
        if accounting is not None:
            return accounting
        throttled_scheduled = set(white["throttled"]) & set(trace.scheduled)
        if throttled_scheduled:
            return "R11", f"throttled requests {sorted(throttled_scheduled)} were scheduled"
        active_cap = self.scenario.max_num_active_seqs or self.scenario.max_num_seqs or len(self.by_id)
        scheduled_running = [r for r in trace.scheduled if r not in trace.admitted]
        if len(scheduled_running) > active_cap:
            return "R12", f"{len(scheduled_running)} running requests scheduled > max_num_active_seqs {active_cap}"
        expected = {u: t for u, t in self.state.tat_ns.items() if t > now}
        got = {u: t for u, t in white["tat_ns"].items() if t > now}
        if expected != got:
            return "R1", f"limiter state {_fmt_tats(got)} differs from the spec's {_fmt_tats(expected)}"
        hint = white["wait_hint_ns"]
        if hint is not None:
            ready = {u: spec_limiter.ready_at_ns(self.state, u) for u in self.state.tat_ns}
            throttled_users = {self.user_of(r) for r in white["throttled"] if r in self.by_id}
            if hint not in ready.values() or any(ready.get(u) is not None and hint > ready[u] for u in throttled_users):
                return "R16", (
                    f"wait hint {hint} ns is not the earliest ready time of the refused users (spec ready_at: {ready})"
                )
        return None


def _fmt_tats(tats) -> str:
    return "{" + ", ".join(f"{u}: {float(t) / 1e6:.3f} ms" for u, t in sorted(tats.items())) + "}"


def _next_advance_ns(scenario, step, trace, state, by_id, harness) -> int:
    """The scenario's clock step; after its last step, an idle step jumps to the next
    instant at which the spec limiter grants one of the waiting users (drain phase)."""
    interval = scenario.step_interval_ns
    if scenario.advances_ns is not None and step < len(scenario.advances_ns):
        return scenario.advances_ns[step]
    if step < scenario.num_steps or trace.sampled or trace.scheduled:
        return interval
    users = {spec_limiter_user(by_id[rid].user) for rid in harness.num_outputs if rid not in harness.finished}
    ready = [
        t
        for u in users
        if (t := spec_limiter.ready_at_ns(state, u, scenario.burst_ns)) is not None and t > trace.now_ns
    ]
    # A candidate may be more conservative than the spec replay (R8: async over-charges are
    # allowed): when the spec says "ready now" and nothing ran, move on by DRAIN_IDLE_NS.
    return max(interval, min(ready) - trace.now_ns) if ready else max(interval, DRAIN_IDLE_NS)


def _window_violation(history: dict[str, list[int]], scenario: Scenario) -> str | None:
    """R2 bound on the newest dispatch time against every earlier start time."""
    for user, times in history.items():
        rate = scenario.rate_of(user)
        excess = spec_properties.window_excess(times, rate, scenario.burst_ns)
        if excess is not None:
            return (
                f"user {user!r}: {excess.count} sampling dispatches in [{excess.start_ns}, {excess.end_ns}] ns "
                f"> bound {excess.bound} = floor((W + tau) x {rate}) + 1: over the user's rate"
            )
    return None


def minimize(scheduler_cls: str, scenario: Scenario, level: str = "exact", style=None, run=None) -> Scenario:
    """Make a failing scenario 1-minimal: drop single requests, aborts and trailing steps
    while it still fails (after Hypothesis's own shrinking). ``run(scenario) -> Verdict``
    replaces ``run_scenario`` (the feature-off comparison uses its own)."""
    from dataclasses import replace

    if run is None:

        def run(candidate: Scenario) -> Verdict:
            return run_scenario(scheduler_cls, candidate, level, style)

    def fails(candidate: Scenario) -> bool:
        return bool(candidate.requests) and run(candidate).failure is not None

    assert fails(scenario), "minimize() needs a failing scenario"
    progress = True
    while progress:
        progress = False
        for i, request in enumerate(scenario.requests):
            smaller = [
                replace(scenario, requests=scenario.requests[:i] + scenario.requests[i + 1 :]),
                replace(
                    scenario,
                    requests=scenario.requests[:i]
                    + (replace(request, abort_at_step=None),)
                    + scenario.requests[i + 1 :],
                )
                if request.abort_at_step is not None
                else None,
            ]
            for candidate in smaller:
                if candidate is not None and fails(candidate):
                    scenario, progress = candidate, True
                    break
            if progress:
                break
    step = run(scenario).step
    if step is not None and step + 1 < scenario.num_steps:
        candidate = replace(scenario, num_steps=step + 1)
        if fails(candidate):
            scenario = candidate
    return scenario


def event_count(scenario: Scenario) -> int:
    """Length of a counterexample: request additions, aborts, and one "run the steps" event."""
    return len(scenario.requests) + sum(r.abort_at_step is not None for r in scenario.requests) + 1
