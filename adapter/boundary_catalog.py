"""The catalogue of Z3-directed boundaries (``adapter/boundaries.py``): each boundary's name,
rules, what it reaches, the slip it targets, and the rate pools its scenarios draw from.

Data only (no solver, no scenario): the coverage obligations (``adapter/coverage.py``) list
these names without building a scenario. The scenario each boundary builds is in
``adapter/boundary_shapes.py`` (``BUILDERS``, by name). Rates are tokens/s, decimal strings.
"""

from __future__ import annotations

from dataclasses import dataclass

# Rate pools per boundary (tokens/s, decimal strings): (integer rates, non-integer rates).
# Only rates with a model that Z3 finds in well under a second: an exact-ns edge needs an
# integer TAT, so e.g. 7.25 tok/s (T = 4/29 s) has none within a few grants.
# 3, 6, 7 and 9 tok/s are integer rates whose T = 10**9 / r is not a whole number of ns.
EDGE = (("2", "3", "5", "7", "10", "20"), ("0.5", "2.5", "3.5"))
EDGE_PLUS = (("2", "3", "5", "10", "20"), ("0.5", "2.5"))
FRACTIONAL_T = (("3", "7", "6", "9"), ("3.5", "7.25"))
READY_AT = (("3", "7", "9"), ("3.5", "7.25"))  # ceil(x) - x = 1/p ns after >= 2 grants
INTEGER_TAT = (("2", "4", "5", "10"), ("0.5", "2.5"))  # T a whole number of ns
FAST_PACED = (("10", "16", "20", "25", "50"), ("12.5",))  # T <= tau
TWO_AT_ONCE = (("16", "20", "24", "25"), ("12.5",))  # 2 grants at once after one grant
SLOW = (("1", "2", "4", "5"), ("0.5", "2.5"))  # T > tau: refused one step after a grant
ROTATION = (("20", "25", "30"), ("20.5", "33.3"))  # idle burst >= 3
RECOMPUTE = (("16", "20", "25"), ("12.5",))  # >= 3 grants from idle, paced 1 ms apart
CAP_PLACES = (("10", "12", "15", "16"), ("12.5", "10.5"))  # 2 grants at once, then 2 T > tau (1 a step)


@dataclass(frozen=True)
class Boundary:
    """One named boundary of issue 18 item 1.

    ``rules``: the rules it sits on. ``targets``: the slip its scenarios are built to kill
    (black-box, at the level given), or why none can be. Its scenario builder is
    ``boundary_shapes.BUILDERS[name]``: ``build(rate, async_mode, seed)`` returns the
    scenario (None: no model for that rate). ``rates(integer_rates)``: the rate pool the
    seed draws from."""

    name: str
    rules: tuple[str, ...]
    what: str
    targets: str
    pools: tuple[tuple[str, ...], tuple[str, ...]]

    def rates(self, integer_rates: bool) -> tuple[str, ...]:
        """The rates the seed draws from (integer rates only with ``integer_rates``)."""
        return self.pools[0] if integer_rates else self.pools[0] + self.pools[1]


BOUNDARIES: tuple[Boundary, ...] = (
    Boundary(
        "burst-edge",
        ("R2",),
        "a take granted at TAT - now = tau exactly",
        "sync: `<` instead of `<=` at the burst edge (under-grant)",
        EDGE,
    ),
    Boundary(
        "burst-edge+1ns",
        ("R2",),
        "a take refused at TAT - now = tau + 1 ns",
        "a burst edge 1 ns (or 1 us) too wide (over-grant)",
        EDGE_PLUS,
    ),
    Boundary(
        "ready-at",
        ("R5", "R2"),
        "a take granted at ready_at = ceil(TAT - tau), TAT - tau not a whole ns",
        "sync: T rounded up to whole ns (under-grant)",
        READY_AT,
    ),
    Boundary(
        "ready-at-1ns",
        ("R5", "R2"),
        "a take refused at ready_at - 1 ns",
        "grants from floor(TAT - tau) (ready_at rounded down, over-grant)",
        FRACTIONAL_T,
    ),
    Boundary(
        "cleanup-tat-now",
        ("R6",),
        "the 256th schedule() with a user's TAT = now (deleted)",
        "none black-box: deleting a user with TAT <= now is a no-op (Z3 r6_cleanup_noop)",
        INTEGER_TAT,
    ),
    Boundary(
        "cleanup-tat-now+1ns",
        ("R6",),
        "the 256th schedule() with a user's TAT = now + 1 ns (kept)",
        "cleanup deleting TAT = now + 1 ns (over-grant 1 ns past the kept burst edge)",
        INTEGER_TAT,
    ),
    Boundary(
        "prefill-reaches-n",
        ("R7",),
        "a chunked prefill whose final chunk reaches n exactly (charged)",
        "the final prefill chunk not charged (over-grant)",
        FAST_PACED,
    ),
    Boundary(
        "prefill-ends-n-1",
        ("R10", "R7"),
        "a refused prefill advanced to n - 1, its last token sampled later",
        "a refused prefill advanced to n (samples uncharged: over-grant)",
        EDGE_PLUS,
    ),
    Boundary(
        "charged-then-preempted",
        ("R9",),
        "charged, then preempted in the same step (refunded)",
        "a refund of 2 T (over-grant later); a missing refund only at level exact",
        SLOW,
    ),
    Boundary(
        "charged-then-alloc-failure",
        ("R9",),
        "a waiting request charged, then its KV allocation fails",
        "a refund of 2 T (over-grant later); a missing refund only at level exact",
        TWO_AT_ONCE,
    ),
    Boundary(
        "fractional-interval",
        ("R3", "R2"),
        "a refusal by < 1/2 ns after >= 3 grants at a T that is not whole ns",
        "T truncated to whole ns (over-grant)",
        FRACTIONAL_T,
    ),
    Boundary(
        "all-refused",
        ("R16", "R11", "R17"),
        "every user refused while requests wait",
        "granting someone when everyone is refused (over-grant)",
        EDGE_PLUS,
    ),
    Boundary(
        "rotation-wrap",
        ("R14", "R15"),
        "one grant per step among 3 streams: the turn wraps around",
        "should, sync: no rotation (one stream starves, R14 bounded bypass)",
        ROTATION,
    ),
    Boundary(
        "priority-throttled-victim",
        ("R13",),
        "under PRIORITY a throttled request is preempted",
        "should: a victim above vLLM's victim level (R13 PRIORITY victim check)",
        SLOW,
    ),
    Boundary(
        "priority-throttled-victim-above",
        ("R13",),
        "under PRIORITY a throttled request of a higher priority than the other user's keeps its KV",
        "should: a throttled victim taken across priority levels (R13 PRIORITY victim check)",
        SLOW,
    ),
    Boundary(
        "fcfs-throttled-victim",
        ("R13",),
        "under FCFS a throttled request passed by the loop is preempted",
        "should: vLLM's own last-running victim instead of the throttled one (R13 FCFS victim check)",
        SLOW,
    ),
    Boundary(
        "refused-prompt-ahead",
        ("R10",),
        "without chunked prefill a refused prompt waits whole, ahead of another user's waiting request",
        "a refused prompt prefilled whole anyway (its last chunk samples uncharged: over-grant)",
        SLOW,
    ),
    Boundary(
        "active-cap-binds",
        ("R12",),
        "a request admitted while throttled requests fill the active cap, then the cap binds",
        "throttled requests counted toward the active cap (the other user is not admitted: under-grant)",
        SLOW,
    ),
)
BOUNDARIES += (
    Boundary(
        "refused-prefill-ahead",
        ("R10",),
        "with chunked prefill a refused waiting prompt that can advance to n - 1, ahead of another user's request",
        "should: a refused waiting request that ends admission (head-of-line blocking caused by the limit, P4)",
        SLOW,
    ),
    Boundary(
        "active-cap-throttled-places",
        ("R12",),
        "two throttled streams of one user free two active places; another user's requests take exactly those",
        "one place freed per throttled user (under-grant, must); one request admitted past A (should)",
        CAP_PLACES,
    ),
    Boundary(
        "running-prefill-refused",
        ("R10",),
        "a running request's refused final prefill chunk advances to n - 1",
        "should: the refused running prefill given 0 tokens (R10)",
        SLOW,
    ),
    Boundary(
        "rotation-beside-others",
        ("R14",),
        "a user's two streams take turns in places 0 and 2 of running, another user's stream in place 1",
        "should: the rotation moving a stream across another user's (R14, other users' order)",
        CAP_PLACES,
    ),
    Boundary(
        "recompute-after-preemption",
        ("R7",),
        "a preempted request with outputs recomputes in chunks; only the chunk that samples is charged",
        "a recompute chunk that does not sample charged (over-charge: under-grant later, must)",
        RECOMPUTE,
    ),
    Boundary(
        "parallel-children",
        ("R17",),
        "an n > 1 request's children share one SamplingParams (vLLM's front end)",
        "the identity read once and removed from the shared params: later children anonymous (over-grant)",
        SLOW,
    ),
)
BOUNDARY_NAMES: tuple[str, ...] = tuple(b.name for b in BOUNDARIES)
