"""Z3 proofs of the GCRA limiter rules R1-R6 (spec and integer-scaled reference).

Each property below is proved for *unbounded* integers and reals by an inductive argument
(an inductive invariant, a simulation relation or a bisimulation, each checked one step at a
time), never by unrolling a bounded number of steps. A property is a list of proof
obligations ``hypotheses => conclusion``; it is *proved* when Z3 shows every obligation
valid (``Not(conclusion)`` unsatisfiable under the hypotheses). Each obligation is also
checked for *vacuity*: its hypotheses alone must be satisfiable, otherwise the "proof" would
hold of nothing.

What is modelled
----------------
One user's limiter state, because every operation of ``spec/limiter.py`` and
``reference/limiter.py`` reads and writes only the entry of the user it names (cleanup
decides per user too), so users are independent and a one-user proof is a proof for each
user of a map.

* Spec state (``spec/limiter.py``): ``known: Bool`` (user present in the map) and
  ``tat: Real`` (TAT in ns, exact rational). Emission interval ``T = 10**9 / rate`` ns.
* Reference state (``reference/limiter.py``): ``known: Bool`` and ``S: Int`` with
  ``S = TAT_ns * p`` for a rate ``p/q`` tokens/s; the increment is ``10**9 * q`` and the
  scaled burst ``tau * p`` (R3).
* The scheduler's use of the limiter (``reference/scheduler.py``): the clock is monotonic;
  one ``schedule()`` call reads it once (``now``) and then performs ``try_take``, ``refund``
  (only of a grant made earlier in the *same* call, R9) and ``cleanup_idle_users`` (R6) at
  that ``now``, in any interleaving. The proofs track the number ``pend`` of grants made in
  the current call and not yet refunded, and allow a refund only while ``pend > 0``.

Units: times ``now``, ``tat``, ``tau`` (burst), ``T`` and windows ``W`` are nanoseconds;
rates are tokens per second; scaled values ``S``, ``inc``, ``burst*p`` are ns x p.
Where a proof uses real-valued times it is *stronger* than needed: integer nanoseconds are a
special case, and no operation of the spec rounds (only ``ready_at`` rounds, and its proof
uses integers).

Refutations
-----------
``BROKEN_VARIANTS`` holds deliberately wrong limiters (``<`` instead of ``<=``, ready_at
rounded down, refund by 2T, cleanup of users with TAT > now, ...). ``run_property(name,
variant)`` runs a property against one. If an obligation fails, a counterexample to an
inductive step alone could be an unreachable state, so the result is ``refuted`` only when a
bounded search from the *empty* limiter (used for refutation only, never as a proof) finds a
concrete operation sequence that violates the property; the counterexample printed is that
sequence. Otherwise the result is ``unknown``.

Run ``python -m vllm_output_rate.proofs.z3_limiter`` for the results table, or with
``--variant NAME`` to run every property against a broken variant.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

from vllm_output_rate.proofs.z3_obligations import Checked, Obligation, z3_proof_record
from vllm_output_rate.proofs.z3_rerate import (
    rerate_burst_obligations,
    rerate_burst_search,
    rerate_window_obligations,
    rerate_window_search,
)
from vllm_output_rate.proofs.z3_semantics import CORRECT, VARIANTS, Semantics
from vllm_output_rate.proofs.z3_simulation import (
    cleanup_obligations,
    divergence_search,
    ready_obligations,
    ready_search,
    sim_obligations,
    sim_search,
    take_refund_obligations,
)
from vllm_output_rate.proofs.z3_window import burst_obligations, burst_search, window_obligations, window_search


@dataclass(frozen=True)
class Property:
    """A named property: its rules, its proof obligations and a refutation search.

    ``run(timeout_ms, variant)`` returns the result record (see ``run_all``).
    """

    name: str
    rules: list[str]
    doc: str
    obligations: Callable[[Semantics], list[Obligation]]
    search: Callable[[Semantics, int], str | None]

    def run(self, timeout_ms: int = 5000, variant: Semantics | str = CORRECT) -> dict:
        sem = VARIANTS[variant] if isinstance(variant, str) else variant

        def verdict(checked: Checked) -> tuple[str, str | None]:
            if checked.all_proved:
                return "proved", None
            # A failed inductive step may be unreachable: refute only with a concrete trace.
            counterexample = self.search(sem, timeout_ms)
            return ("refuted" if counterexample is not None else "unknown"), counterexample

        return z3_proof_record(self.name, self.rules, lambda: self.obligations(sem), timeout_ms, verdict)

    # `fn` is the spelling the project's manifest uses for "the function returning the result".
    @property
    def fn(self) -> Callable[..., dict]:
        return self.run


# --------------------------------------------------------------------------------------
# The catalogue
# --------------------------------------------------------------------------------------

PROPERTIES: list[Property] = [
    Property(
        "r2_window_bound",
        ["R1", "R2", "R4", "R6", "R9"],
        window_obligations.__doc__ or "",
        window_obligations,
        window_search,
    ),
    Property("r2_idle_burst", ["R1", "R2", "R6"], burst_obligations.__doc__ or "", burst_obligations, burst_search),
    Property(
        "r3_integer_scaling_simulates_spec",
        ["R1", "R2", "R3", "R4", "R6"],
        sim_obligations.__doc__ or "",
        sim_obligations,
        sim_search,
    ),
    Property("r5_ready_at_exact", ["R3", "R5"], ready_obligations.__doc__ or "", ready_obligations, ready_search),
    Property(
        "r4_take_refund_noop",
        ["R2", "R4", "R9"],
        take_refund_obligations.__doc__ or "",
        take_refund_obligations,
        lambda sem, ms: divergence_search(sem, ms, "take_refund"),
    ),
    Property(
        "r6_cleanup_noop",
        ["R2", "R6"],
        cleanup_obligations.__doc__ or "",
        cleanup_obligations,
        lambda sem, ms: divergence_search(sem, ms, "cleanup"),
    ),
]

PROPERTIES += [
    Property(
        "r21_window_bound_across_change",
        ["R2", "R4", "R6", "R21"],
        rerate_window_obligations.__doc__ or "",
        rerate_window_obligations,
        rerate_window_search,
    ),
    Property(
        "r21_no_burst_from_change",
        ["R2", "R21"],
        rerate_burst_obligations.__doc__ or "",
        rerate_burst_obligations,
        rerate_burst_search,
    ),
]

PROPERTIES_BY_NAME: dict[str, Property] = {prop.name: prop for prop in PROPERTIES}

# Which property must refute which broken variant (each variant is caught by at least one).
EXPECTED_REFUTATIONS: dict[str, tuple[str, ...]] = {
    "allow_strict_lt": ("r2_idle_burst", "r5_ready_at_exact"),
    "ready_at_round_down": ("r5_ready_at_exact",),
    "refund_2T": ("r2_window_bound", "r4_take_refund_noop"),
    "cleanup_tat_gt_now": ("r2_window_bound", "r6_cleanup_noop"),
    "take_without_max": ("r2_window_bound",),
    "ref_increment_uses_p": ("r3_integer_scaling_simulates_spec",),
    "ref_now_unscaled": ("r3_integer_scaling_simulates_spec",),
    "ref_ready_at_round_down": ("r5_ready_at_exact",),
    "rerate_reset_to_now": ("r21_window_bound_across_change", "r21_no_burst_from_change"),
    "rerate_keep_tat": ("r21_window_bound_across_change",),
}


def run_property(name: str, variant: str | Semantics = CORRECT, timeout_ms: int = 5000) -> dict:
    """Run one property against ``variant`` (a name in ``VARIANTS`` or a ``Semantics``)."""
    return PROPERTIES_BY_NAME[name].run(timeout_ms=timeout_ms, variant=variant)


def run_all(timeout_ms: int = 5000, variant: str | Semantics = CORRECT) -> list[dict]:
    """Run every property; one record per property:
    ``{"name", "rules", "tool": "z3", "result": "proved"|"refuted"|"unknown", "seconds",
    "vacuity_ok", "counterexample"}``."""
    return [prop.run(timeout_ms=timeout_ms, variant=variant) for prop in PROPERTIES]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", default=CORRECT.name, choices=sorted(VARIANTS))
    parser.add_argument("--timeout-ms", type=int, default=5000)
    args = parser.parse_args(argv)
    results = run_all(args.timeout_ms, args.variant)
    print(f"variant: {args.variant}")
    print(f"{'property':38} {'result':8} {'seconds':>8} vacuity_ok  rules")
    for r in results:
        print(f"{r['name']:38} {r['result']:8} {r['seconds']:8.3f} {r['vacuity_ok']!s:10}  {','.join(r['rules'])}")
        if r["counterexample"]:
            print(f"    counterexample: {r['counterexample']}")
    expect = "proved" if args.variant == CORRECT.name else None
    return 0 if expect is None or all(r["result"] == expect for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
