"""The event alphabet: one vocabulary for the spec, the adapter and a model checker.

A scenario is a finite sequence of these events. The spec consumes them with
``spec.scheduler.step(state, event)``; the adapter (``adapter/fidelity.py``,
``adapter/whitebox.py``) replays the same sequence on a real vLLM scheduler through
``adapter.harness.Harness``; a model checker enumerates them. Faults (aborts, KV
shortage) are ordinary events or consequences of them, never hidden randomness.

| event | Harness call | meaning |
|---|---|---|
| ``AddRequest`` | ``add_request`` | a client request arrives (vLLM ``Scheduler.add_request``) |
| ``Abort`` | ``abort`` | the client disconnects (``finish_requests(..., FINISHED_ABORTED)``) |
| ``AdvanceClock`` | ``advance`` | the monotonic clock moves forward (R16: the only time source) |
| ``Step`` | ``step`` | one scheduling cycle and the model output (see below) |
| ``Drain`` | ``drain`` | async only: deliver the output in flight, schedule nothing |
| ``ChangeRates`` | ``change_rates`` | R21: the operator replaces the rate table; it takes effect at the start of the next ``schedule()``, at that cycle's clock reading |

``Step``: in sync mode, ``schedule()`` and then ``update_from_output()`` of that same
step. In async mode (``AsyncScheduler``, one step in flight), ``schedule()`` of step N+1
and then ``update_from_output()`` of step N, exactly as ``Harness.step`` does.

The fabricated model samples one token per sampling dispatch: the token of a request's
k-th sampling dispatch (k counted from 0 over its whole life, across preemptions) is EOS
iff ``k == eos_index``.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

# Bounds on one event's values (TigerBeetle style: everything has a limit).
MAX_PROMPT_TOKENS: int = 1 << 16
MAX_OUTPUT_TOKENS: int = 1 << 16
MAX_PRIORITY: int = 1 << 16
MAX_DELTA_NS: int = 10**15  # about 11.6 days of clock advance in one event
MAX_LORA_ID: int = 1 << 16  # bound on a LoRA adapter id (vLLM ``lora_int_id``)
ANONYMOUS_USER: str = "__anonymous__"  # R17: requests that name no user share this bucket


@dataclass(frozen=True)
class AddRequest:
    """A request arrives: ``prompt_len`` prompt tokens, at most ``max_tokens`` outputs.

    ``user``: the R17 identity (``extra_args["output_rate_user"]``, or ``__anonymous__``).
    ``priority``: vLLM's PRIORITY policy serves smaller values first (ignored under FCFS).
    ``eos_index``: the 0-based output index at which the model emits EOS (None: never).
    ``lora``: the LoRA adapter the request runs on (vLLM ``lora_request.lora_int_id``; 0:
    the base model). A LoRA > 0 needs ``EngineConfig.max_loras`` (V8 LoRA slots).
    """

    request_id: str
    user: str = ANONYMOUS_USER
    priority: int = 0
    prompt_len: int = 4
    max_tokens: int = 16
    eos_index: int | None = None
    lora: int = 0

    def __post_init__(self) -> None:
        # Every field is inside its bound; a scenario generator that drifts fails here.
        assert isinstance(self.request_id, str) and self.request_id, f"bad request id {self.request_id!r}"
        assert isinstance(self.user, str) and self.user, f"bad user {self.user!r}"
        assert 0 <= self.priority <= MAX_PRIORITY, f"priority {self.priority} out of range"
        assert 1 <= self.prompt_len <= MAX_PROMPT_TOKENS, f"prompt_len {self.prompt_len} out of range"
        assert 1 <= self.max_tokens <= MAX_OUTPUT_TOKENS, f"max_tokens {self.max_tokens} out of range"
        assert self.eos_index is None or 0 <= self.eos_index <= MAX_OUTPUT_TOKENS, f"eos_index {self.eos_index}"
        assert 0 <= self.lora <= MAX_LORA_ID, f"lora {self.lora} out of range"

    def __str__(self) -> str:
        eos = "" if self.eos_index is None else f" eos@{self.eos_index}"
        lora = f" lora={self.lora}" if self.lora else ""
        return (
            f"add {self.request_id} user={self.user} prio={self.priority} prompt={self.prompt_len} "
            f"max_tokens={self.max_tokens}{eos}{lora}"
        )


@dataclass(frozen=True)
class Abort:
    """The client of ``request_id`` disconnects; unknown or finished ids are ignored."""

    request_id: str

    def __str__(self) -> str:
        return f"abort {self.request_id}"


@dataclass(frozen=True)
class AdvanceClock:
    """The clock moves ``delta_ns`` >= 0 forward (it never goes back)."""

    delta_ns: int

    def __post_init__(self) -> None:
        assert 0 <= self.delta_ns <= MAX_DELTA_NS, f"delta_ns {self.delta_ns} out of range"

    def __str__(self) -> str:
        return f"clock +{self.delta_ns / 1e6:g} ms"


@dataclass(frozen=True)
class Step:
    """One scheduling cycle plus the delivery of one model output (module docstring)."""

    def __str__(self) -> str:
        return "step"


@dataclass(frozen=True)
class Drain:
    """Async mode: deliver the model output in flight without scheduling (no-op in sync)."""

    def __str__(self) -> str:
        return "drain"


@dataclass(frozen=True)
class ChangeRates:
    """R21: the rate table is replaced without a restart (the reference's ``rates_file``).

    ``default_rate_tokens_per_s``: the new default (an exact decimal or ``p/q`` string,
    tokens/s, > 0); ``user_rates_tokens_per_s``: the new overrides as ``(user, rate)``
    pairs (a user left out moves to the default). The change is applied at the start of
    the next ``Step``'s ``schedule()``, at that cycle's one clock reading (R16), never in
    the middle of one; of several changes before one ``Step`` the last one counts. Only
    with the feature on: a change can neither turn the feature on nor off (R18).
    """

    default_rate_tokens_per_s: str
    user_rates_tokens_per_s: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "user_rates_tokens_per_s", tuple((str(u), str(r)) for u, r in self.user_rates_tokens_per_s)
        )
        rates = [self.default_rate_tokens_per_s] + [r for _, r in self.user_rates_tokens_per_s]
        assert all(Fraction(r) > 0 for r in rates), f"R21: rates must be positive, got {rates}"
        users = [u for u, _ in self.user_rates_tokens_per_s]
        assert all(users) and len(set(users)) == len(users), f"R21: bad or repeated users {users}"

    def rates(self) -> tuple[Fraction, tuple[tuple[str, Fraction], ...]]:
        """``(default, overrides)`` as exact Fractions."""
        return (
            Fraction(self.default_rate_tokens_per_s),
            tuple((u, Fraction(r)) for u, r in self.user_rates_tokens_per_s),
        )

    def __str__(self) -> str:
        users = " ".join(f"{u}={r}" for u, r in self.user_rates_tokens_per_s)
        return f"rates default={self.default_rate_tokens_per_s}" + (f" {users}" if users else "")


Event = AddRequest | Abort | AdvanceClock | Step | Drain | ChangeRates
EVENT_TYPES = (AddRequest, Abort, AdvanceClock, Step, Drain, ChangeRates)
