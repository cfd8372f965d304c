"""Rate-limit scenarios: plain data (JSON-able, replayable) for running a real scheduler.

A ``Scenario`` is an engine shape, per-user rates, a list of requests each arriving at some
step, a fixed clock advance between steps. Running it (``adapter/scenario_run.py``) drives a
``Harness`` and judges every step (``adapter/judge.py``); its outcome is a ``Verdict``. The
Hypothesis strategies that draw scenarios are in ``adapter/scenario_strategies.py``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from fractions import Fraction
from pathlib import Path
from typing import Any

from vllm_output_rate.adapter.scenario_file import (
    ScenarioFileError,
    bad_value,
    checked_advances,
    checked_bool,
    checked_int,
    checked_object,
    checked_policy,
    checked_rate,
    checked_user_id,
)

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


def _checked_rates(value: Any) -> dict[str, str]:
    """``rates_tokens_per_s``: an object of user id -> rate (``checked_user_id``, ``checked_rate``)."""
    if not isinstance(value, dict):
        raise bad_value("rates_tokens_per_s", value, "must be a JSON object of user id -> rate")
    return {
        checked_user_id(user, "rates_tokens_per_s key"): checked_rate(rate, f"rates_tokens_per_s[{user!r}]")
        for user, rate in value.items()
    }


_REQUEST_CHECKS: dict[str, Callable[[Any, str], Any]] = {
    "prompt_len": checked_int(1),
    "max_tokens": checked_int(1),
    "eos_index": checked_int(0, optional=True),
    "at_step": checked_int(0),
    "priority": checked_int(-(2**63)),
    "abort_at_step": checked_int(0, optional=True),
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
    "step_interval_ns": checked_int(0),
    "num_steps": checked_int(1),
    "chunked_prefill": checked_bool,
    "async_scheduling": checked_bool,
    "max_num_seqs": checked_int(1, optional=True),
    "max_num_active_seqs": checked_int(1, optional=True),
    "max_num_batched_tokens": checked_int(1, optional=True),
    "num_blocks": checked_int(1, optional=True),
    "block_size": checked_int(1),
    "policy": checked_policy,
    "burst_ms": checked_int(1, optional=True),
    "feature_on": checked_bool,
    "advances_ns": checked_advances,
    "ample_from_step": checked_int(0, optional=True),
    "prefix_caching": checked_bool,
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


def feature_off(scenario: Scenario) -> Scenario:
    """The same scenario with no output-rate configuration at all (R18)."""
    return replace(scenario, feature_on=False, burst_ms=None)


def event_count(scenario: Scenario) -> int:
    """Length of a counterexample: request additions, aborts, and one "run the steps" event."""
    return len(scenario.requests) + sum(r.abort_at_step is not None for r in scenario.requests) + 1
