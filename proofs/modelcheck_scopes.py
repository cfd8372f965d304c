"""The model checker's scopes (``proofs/modelcheck.py``): the declared engine
configurations, users and streams of ``proofs/modelcheck_scopes.json``, their profiles,
and a scope compiled for exploration (``Compiled``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

from vllm_output_rate.spec import limiter as spec_limiter
from vllm_output_rate.spec.events import AdvanceClock, ChangeRates
from vllm_output_rate.spec.state import EngineConfig, blocks_for

MANIFEST_PATH = Path(__file__).with_name("modelcheck_scopes.json")
MS = 1_000_000
MAX_SCOPE_STATES = 20_000_000  # no scope may declare more (memory: ~100 bytes per state)
MAX_STREAMS_PER_SCOPE = 12


@dataclass(frozen=True)
class Stream:
    """One request a user may send: sizes, EOS index (None: never), priority."""

    prompt_len: int
    max_tokens: int
    eos_index: int | None = None
    priority: int = 0

    def as_tuple(self) -> tuple:
        return (self.prompt_len, self.max_tokens, self.eos_index, self.priority)


@dataclass(frozen=True)
class Scope:
    """A declared finite scope: engine configuration, users and their streams, events.

    ``users``: (name, streams) in a fixed order. ``clock_ns``: the ``AdvanceClock``
    increments. ``max_aborts``: aborts allowed over a whole run. ``drain``: async only,
    ``Drain`` events enabled. ``horizon``: adds and aborts only within the first
    ``horizon`` events (None: any time). ``max_states``: asserted bound on distinct states.
    ``pinned``: the manifest's expected (states, transitions), None if not pinned.
    """

    name: str
    config: EngineConfig
    users: tuple[tuple[str, tuple[Stream, ...]], ...]
    clock_ns: tuple[int, ...] = (50 * MS, 100 * MS)
    max_aborts: int = 0
    drain: bool = False
    horizon: int | None = None
    max_states: int = 100_000
    pinned: tuple[int, int] | None = None
    note: str = ""
    fair_admission: bool = False  # F2 (R20): checked; needs max_num_seqs_per_user C with users x C <= M
    # R21: rate tables the operator may install, each once and in this order, at any point
    # within the horizon (``ChangeRates``); the feature must be on.
    rate_changes: tuple[ChangeRates, ...] = ()

    def __post_init__(self) -> None:
        c = self.config
        names = [u for u, _ in self.users]
        assert names and len(set(names)) == len(names), f"{self.name}: user names must be distinct: {names}"
        assert all("-" not in u for u in names), f"{self.name}: user names may not contain '-'"
        num_streams = sum(len(s) for _, s in self.users)
        assert 1 <= num_streams <= MAX_STREAMS_PER_SCOPE, f"{self.name}: {num_streams} streams"
        assert 0 <= self.max_aborts <= num_streams, f"{self.name}: max_aborts {self.max_aborts}"
        assert not self.drain or c.async_scheduling, f"{self.name}: Drain only in async scopes"
        assert self.horizon is None or self.horizon >= 1, f"{self.name}: horizon {self.horizon}"
        assert 1 <= self.max_states <= MAX_SCOPE_STATES, f"{self.name}: max_states {self.max_states}"
        assert all(d > 0 for d in self.clock_ns), f"{self.name}: clock increments must be > 0"
        assert c.rate_limited or not self.clock_ns, f"{self.name}: feature off, the clock changes nothing"
        assert c.rate_limited or not self.rate_changes, f"{self.name}: R21 rate changes need the feature on"
        # vLLM refuses to start unless one max_model_len sequence fits in the KV cache, and
        # its front end rejects prompts of max_model_len tokens or more (fidelity EXCLUSIONS).
        assert blocks_for(c.max_model_len, c) <= c.num_usable_blocks, (
            f"{self.name}: max_model_len {c.max_model_len} does not fit {c.num_usable_blocks} blocks of {c.block_size}"
        )
        for _, streams in self.users:
            for s in streams:
                assert 1 <= s.prompt_len < c.max_model_len and s.max_tokens >= 1, f"{self.name}: {s}"
                assert s.priority == 0 or c.policy == "priority", f"{self.name}: priority under FCFS"

        # F2 (R20): with every user at its cap C a slot is still free (users x C <= M).
        assert not self.fair_admission or (
            c.max_num_seqs_per_user is not None and len(self.users) * c.max_num_seqs_per_user <= c.max_num_seqs
        ), f"{self.name}: fair_admission needs max_num_seqs_per_user C with users x C <= max_num_seqs"

    @property
    def user_names(self) -> tuple[str, ...]:
        return tuple(u for u, _ in self.users)


def scope_from_json(data: dict) -> Scope:
    """A scope from its manifest entry (see ``proofs/modelcheck_scopes.json``)."""
    c = dict(data["config"])
    rates = c.pop("user_rates", {})
    default = c.pop("default_rate", None)
    burst_ms = c.pop("burst_ms", 100)
    config = EngineConfig(
        default_rate_tokens_per_s=None if default is None else Fraction(default),
        # R28: "unlimited" is a user with no TAT, never refused
        user_rates_tokens_per_s=tuple((u, None if r == "unlimited" else Fraction(r)) for u, r in rates.items()),
        burst_ns=int(Fraction(burst_ms) * MS),
        **c,
    )
    users = tuple((name, tuple(Stream(*s) for s in streams)) for name, streams in data["users"].items())
    pinned = data.get("pinned")
    return Scope(
        name=data["name"],
        config=config,
        users=users,
        clock_ns=tuple(int(Fraction(ms) * MS) for ms in data.get("clock_ms", [50, 100])),
        max_aborts=data.get("max_aborts", 0),
        drain=data.get("drain", False),
        horizon=data.get("horizon"),
        max_states=data["max_states"],
        pinned=None if pinned is None else (pinned["states"], pinned["transitions"]),
        note=data.get("note", ""),
        fair_admission=data.get("fair_admission", False),
        rate_changes=tuple(
            ChangeRates(t["default"], tuple(sorted(t.get("users", {}).items()))) for t in data.get("rate_changes", [])
        ),
    )


def load_manifest(path: Path = MANIFEST_PATH) -> dict:
    with open(path) as handle:
        return json.load(handle)


def profile_scopes(profile: str, path: Path = MANIFEST_PATH) -> list[Scope]:
    """The scopes of ``profile`` (quick, ci, release), in manifest order."""
    manifest = load_manifest(path)
    assert profile in manifest["profiles"], f"unknown profile {profile!r}: {sorted(manifest['profiles'])}"
    wanted = set(manifest["profiles"][profile])
    scopes = [scope_from_json(s) for s in manifest["scopes"] if s["name"] in wanted]
    assert len(scopes) == len(wanted), f"profile {profile} names scopes missing from the manifest"
    return scopes


def scope_by_name(name: str, path: Path = MANIFEST_PATH) -> Scope:
    for data in load_manifest(path)["scopes"]:
        if data["name"] == name:
            return scope_from_json(data)
    raise KeyError(name)


def interval_ns(rate: Fraction | None) -> Fraction | None:
    """The emission interval of ``rate`` (ns); None for an unlimited user (R28: no ledger)."""
    return None if rate is None else spec_limiter.emission_interval_ns(rate)


class Compiled:
    """Per-scope constants used on the hot path."""

    def __init__(self, scope: Scope) -> None:
        config = scope.config
        self.scope = scope
        self.config = config
        self.users = scope.user_names
        self.uidx = {u: i for i, u in enumerate(self.users)}
        self.identity = {u: u for u in self.users}
        self.rate_limited = config.rate_limited
        self.burst = config.burst_ns
        self.interval = {u: interval_ns(config.rate_of(u)) for u in self.users} if self.rate_limited else {}
        # Symmetry classes: users of equal rate (feature off: all users are alike).
        by_rate: dict[Any, list[str]] = {}
        for u in self.users:
            by_rate.setdefault(config.rate_of(u) if self.rate_limited else None, []).append(u)
        # R21: after a change users of one rate may differ, so no symmetry with rate changes.
        self.classes = [sorted(c) for c in by_rate.values() if len(c) > 1] if not scope.rate_changes else []
        self.rate_changes = scope.rate_changes
        # F1 bound, per priority: the most streams one user has at that priority, minus one
        # (the same for every user, so that renaming users keeps it).
        self.bypass_bound: dict[int, int] = {}
        for _, streams in scope.users:
            for prio in {s.priority for s in streams}:
                count = sum(s.priority == prio for s in streams)
                self.bypass_bound[prio] = max(self.bypass_bound.get(prio, 0), count - 1)
        self.clock_events = tuple(AdvanceClock(d) for d in scope.clock_ns)
        self.async_mode = config.async_scheduling
