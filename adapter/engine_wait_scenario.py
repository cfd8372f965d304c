"""R16's engine-wait check (``adapter/engine_wait.py``): the rule's constants, its tolerances,
the seeded scenario and the verdict record.

Times are ns (``MS`` ns per millisecond), rates tokens/s. The scenario (users A, B, C, a
new request and an abort at seeded instants) is what the child process drives through
vLLM's engine-core loop (``adapter/engine_wait_child.py``); ``EngineWaitVerdict`` is what
the judge (``adapter/engine_wait_judge.py``) fills from the child's observation.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from typing import Any

from vllm_output_rate.spec.limiter import BURST_NS

MS = 1_000_000  # ns per millisecond

# -- the rule ---------------------------------------------------------------------------
ARTICLE_RECHECK_NS = 50 * MS
"""The article's engine waits min(next ready time, 50 ms): it re-checks at least this often
even if no throttled user is ready sooner. R16 does not require it (the reference waits until
the ready time); the check accepts it: a wait of this length that ends before a ready time is
not an early wake, and the spin bound allows one idle wake-up per this much throttled time."""

STOCK_IDLE_SLEEP_NS = 1 * MS
"""vLLM 0.32 ``EngineCoreProc._process_engine_step``: ``time.sleep(0.001)`` after a step that
ran no model while requests remain -- the spin R16 forbids when every user is throttled."""

# -- tolerances -------------------------------------------------------------------------
LATENESS_TOLERANCE_NS = 1 * MS + 10_000
"""How late (ns) a throttled user's next token may be dispatched after its ready time: one stock 1 ms idle sleep (vLLM's own
``_process_engine_step`` still sleeps it before a plugin's wait) plus 10 us for float-second
timeouts; it also covers a ready time that falls inside a ``MODEL_STEP_NS`` model step."""

FLOAT_TIMEOUT_SLACK_NS = 10_000
"""How far (ns) a wait's length may differ from the timeout it was given in float seconds."""

WAKE_TOLERANCE_NS = 1 * MS + 10_000
"""How long (ns) after its arrival a new request may be first scheduled, or an abort handed
to the scheduler: at most one stock 1 ms idle sleep (not interruptible) plus 10 us."""

SPIN_SLACK_WAKEUPS = 2
"""Idle wake-ups allowed per throttled interval on top of ceil(interval / ARTICLE_RECHECK_NS): the step
that finds everyone refused, and one at an interval's edge."""

# -- the scenario -----------------------------------------------------------------------
USER_A = "user-a"
USER_B = "user-b"
USER_C = "user-c"
A_RATE_TOKENS_PER_S = 3
"""User A's rate (the default rate): a token every 333.33... ms, one at a time (burst
100 ms); the emission interval 10**9 / 3 ns is not whole, so A's ready times are not whole
ns either and a ready time rounded down (R5) wakes the engine 1 ns early."""
C_RATE_TOKENS_PER_S = 5
"""User C's override: a token every 200 ms, one stream; C's ready times fall between A's,
so an engine waiting for the latest ready time (not the earliest) wakes late for one."""
A_STREAMS = 2
A_MAX_TOKENS = 1_000
"""Large: A's streams never finish in the run (and within the tiny model's 2048 positions)."""
B_RATE_TOKENS_PER_S = 1000
"""User B's override: B is never throttled in its short request."""
B_MAX_TOKENS = 4
PROMPT_LEN = 4
RUN_NS = 1_200 * MS
"""Fake time (ns) the engine runs: A's tokens at 0, 233.3, 566.7, 900 ms, C's every 200 ms
from 100 ms on."""
NEW_REQUEST_WINDOW_NS = (320 * MS, 480 * MS)
"""B's request arrives at a seeded instant in here: after C's token at 300 ms, inside A's
throttled interval 233-567 ms."""
ABORT_WINDOW_NS = (720 * MS, 880 * MS)
"""One of A's streams is aborted at a seeded instant in here (A's interval 567-900 ms)."""
MODEL_STEP_NS = 200_000
"""Fake time (ns) one model step that computes tokens takes."""
POLLING_EMPTY_STEP_NS = 5_000
"""Fake time (ns) an empty step takes in the polling world (the executor's round trip for a
step with no token); inside the 10 us slack of ``WAKE_TOLERANCE_NS``, so a request taken
during an empty step may still be scheduled after one stock 1 ms idle sleep."""

# -- bounds -----------------------------------------------------------------------------
MAX_LOOP_ITERATIONS = 20_000
"""Engine-loop iterations after which a run stops (stock vLLM needs ~1,200 for ``RUN_NS``)."""
WALL_LIMIT_S = 60.0
"""Real seconds after which the child stops the loop (a wait the gate cannot drive)."""
CHILD_TIMEOUT_S = 240.0
"""Real seconds after which the parent kills the child process."""


@dataclass(frozen=True)
class ScriptedInput:
    """One input put into the engine's input queue at fake instant ``at_ns``.

    ``kind`` "add" (a request of ``user`` with ``max_tokens``) or "abort" (of ``request_id``).
    ``during_step``: the input arrives during the first empty engine step at or after
    ``at_ns`` (polling world), never during a wait.
    """

    at_ns: int
    kind: str
    request_id: str
    user: str = ""
    max_tokens: int = 0
    during_step: bool = False


@dataclass(frozen=True)
class EngineWaitScenario:
    """The seeded R16 scenario: inputs, rates, run length (all times ns)."""

    inputs: tuple[ScriptedInput, ...]
    rates: dict[str, int]  # user -> tokens/s
    burst_ns: int
    run_ns: int
    new_request_id: str
    aborted_request_id: str
    polling: bool = False  # the multiproc-like world: steps return a polling future

    def output_rate(self) -> dict[str, Any]:
        """The ``output_rate`` section of ``EngineShape`` for this scenario."""
        return {
            "default_tokens_per_s": A_RATE_TOKENS_PER_S,
            "user_tokens_per_s": {USER_B: B_RATE_TOKENS_PER_S, USER_C: C_RATE_TOKENS_PER_S},
        }


def engine_wait_scenario(seed: int = 0, polling: bool = False) -> EngineWaitScenario:
    """The R16 scenario for ``seed`` (only the arrival instants of B's request and the abort vary).

    ``polling``: the multiproc-like world, where B's request arrives during an empty step.
    """
    rng = random.Random(seed)
    t_new = rng.randrange(*NEW_REQUEST_WINDOW_NS)
    t_abort = rng.randrange(*ABORT_WINDOW_NS)
    inputs = [ScriptedInput(0, "add", f"a{i}", USER_A, A_MAX_TOKENS) for i in range(A_STREAMS)]
    inputs.append(ScriptedInput(0, "add", "c0", USER_C, A_MAX_TOKENS))
    inputs.append(ScriptedInput(t_new, "add", "b0", USER_B, B_MAX_TOKENS, during_step=polling))
    inputs.append(ScriptedInput(t_abort, "abort", f"a{A_STREAMS - 1}"))
    return EngineWaitScenario(
        inputs=tuple(sorted(inputs, key=lambda i: i.at_ns)),
        rates={USER_A: A_RATE_TOKENS_PER_S, USER_B: B_RATE_TOKENS_PER_S, USER_C: C_RATE_TOKENS_PER_S},
        burst_ns=BURST_NS,
        run_ns=RUN_NS,
        new_request_id="b0",
        aborted_request_id=f"a{A_STREAMS - 1}",
        polling=polling,
    )


@dataclass
class EngineWaitVerdict:
    """The R16 verdict on one candidate (times in ns, counts of loop events).

    ``failure``: None if R16 held, else one sentence in the article's terms.
    ``wakeups``: engine-loop iterations (``step_fn`` calls) in the run; ``idle_wakeups``
    those that scheduled no token; ``throttled_ns`` the fake time of the intervals in which
    idle wake-ups happened (every user with pending requests throttled) and
    ``allowed_idle_wakeups`` the bound for them. ``max_lateness_ns``: the latest dispatch of
    a throttled user's next token after its ready time; ``max_wait_ns`` the longest gap
    between wake-ups while requests were pending; ``new_request_latency_ns`` /
    ``abort_latency_ns``: arrival to first scheduled / to the scheduler's
    ``finish_requests`` (None: never); in the polling world B's arrival is the instant it
    reached the input queue, during an empty step. ``plugins``: the general plugins allowed to load;
    ``max_early_ns``: how long before the next ready time of a user with pending
    requests a wait on the input queue, other than one of ``ARTICLE_RECHECK_NS``, timed out (0:
    never early); ``seconds``: real seconds of the run (a batch's time shared equally);
    ``engine_step``: the engine's step function (``step``, or ``step_with_batch_queue`` for
    async scheduling); ``over_grants``: sampling dispatches the spec limiter refuses (an R2
    matter, reported, not judged here); ``stopped_by``: what ended the run; ``rule``: the
    rule the failure names (R16; R5 when the early wake is at ``floor(TAT - tau)``, 1 ns
    before ``ready_at``: the rounding of R5 broken, ``early_rounded_down``).
    """

    scheduler_cls: str
    async_mode: bool = False
    polling: bool = False  # the multiproc-like world (``_PollingFuture``)
    failure: str | None = None
    rule: str = "R16"
    seed: int = 0
    fake_ns: int = 0
    wakeups: int = 0
    productive_steps: int = 0
    idle_wakeups: int = 0
    throttled_ns: int = 0
    allowed_idle_wakeups: int = 0
    median_idle_gap_ns: int | None = None
    max_lateness_ns: int = 0
    lateness_detail: str = ""
    max_early_ns: int = 0
    early_detail: str = ""
    early_rounded_down: bool = False  # the early wake is at floor(TAT - tau): R5's rounding, not R16's wait
    max_wait_ns: int = 0
    new_request_latency_ns: int | None = None
    abort_latency_ns: int | None = None
    tokens: dict[str, int] = field(default_factory=dict)
    over_grants: int = 0
    plugins: list[str] = field(default_factory=list)
    stopped_by: str = ""
    engine_step: str = ""
    seconds: float = 0.0
    error: str | None = None

    def as_json(self) -> dict[str, Any]:
        """The verdict as a JSON-ready dict."""
        return asdict(self)
