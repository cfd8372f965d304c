"""Z3 proofs of the limiter rules R1-R6 (proofs/z3_limiter.py).

* Each property is proved (unbounded integers/reals, inductive argument) and non-vacuous.
* Each deliberately broken limiter is refuted with a concrete counterexample trace.
* The Z3 encoding of the correct limiter agrees, step for step, with the Python code it
  stands for (spec/limiter.py and reference/limiter.py), so the proofs are about that code.
"""

from __future__ import annotations

import random
from fractions import Fraction

import pytest
import z3

from vllm_output_rate.proofs import z3_limiter as zl
from vllm_output_rate.proofs import z3_obligations as zo
from vllm_output_rate.proofs import z3_semantics as zs
from vllm_output_rate.proofs import z3_window as zw
from vllm_output_rate.reference.limiter import OutputRateLimiter
from vllm_output_rate.spec import limiter as spec

TIMEOUT_MS = 5000
# Each proof takes ~0.1 s; the bound leaves room for a loaded CI machine.
MAX_PROOF_SECONDS = 3.0


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    return {r["name"]: r for r in zl.run_all(timeout_ms=TIMEOUT_MS)}


def _assert_proved(results: dict[str, dict], name: str, rules: set[str]) -> None:
    record = results[name]
    assert record["result"] == "proved", record
    assert record["vacuity_ok"] is True, record
    assert record["counterexample"] is None, record
    assert record["tool"] == "z3"
    assert rules <= set(record["rules"]), record["rules"]
    assert record["seconds"] < MAX_PROOF_SECONDS, record


# Each limiter proof and the rules its record must declare (at least those).
PROVED = {
    "r2_window_bound": {"R2", "R4", "R6"},
    "r2_idle_burst": {"R2"},
    "r3_integer_scaling_simulates_spec": {"R3"},
    "r5_ready_at_exact": {"R5"},
    "r4_take_refund_noop": {"R4"},
    "r6_cleanup_noop": {"R6"},
    "r21_window_bound_across_change": {"R21"},
    "r21_no_burst_from_change": {"R21"},
}


@pytest.mark.rules("R2", "R3", "R4", "R5", "R6", "R21")
@pytest.mark.parametrize(("name", "rules"), PROVED.items(), ids=list(PROVED))
def test_r2_r3_r4_r5_r6_r21_limiter_property_proved(results, name, rules):
    _assert_proved(results, name, rules)


@pytest.mark.rules("R21")
@pytest.mark.parametrize(("old", "new", "lead"), [(10, 2, 150_000_000), (1, 3, 10), (3, 7, 1), (5, 5, 7), (2, 9, 0)])
def test_r21_z3_encoding_is_the_spec_rule(old, new, lead):
    # The Z3 term of the correct rule admits the spec's TAT (any rounding up by < 1 ns; the
    # proofs hold for each of them, so for the spec's whole-ns one too), and no TAT earlier.
    from fractions import Fraction

    from vllm_output_rate.spec import limiter as spec_limiter

    now = 1_000
    known, tat, side = zs._spec_rerate(
        z3.BoolVal(True), z3.RealVal(now + lead), z3.RealVal(now), z3.RealVal(old), z3.RealVal(new)
    )
    want = spec_limiter.rescaled_tat_ns(Fraction(now + lead), Fraction(old), Fraction(new), now)
    solver = z3.Solver()
    solver.add(*side)
    assert solver.check() == z3.sat
    assert z3.is_true(z3.simplify(known)) == (want is not None)
    if want is None:
        return
    solver.push()
    solver.add(tat == z3.RealVal(want))
    assert solver.check() == z3.sat  # the spec's TAT is admitted
    solver.pop()
    solver.add(tat < z3.RealVal(now + Fraction(lead) * old / new))
    assert solver.check() == z3.unsat  # nothing below the exact lead in tokens


def test_run_all_records_have_the_manifest_shape(results):
    assert [p.name for p in zl.PROPERTIES] == list(results)
    for record in results.values():
        assert set(record) == {"name", "rules", "tool", "result", "seconds", "vacuity_ok", "counterexample"}
        assert record["result"] in {"proved", "refuted", "unknown"}
        assert isinstance(record["rules"], list) and record["rules"], record
        assert isinstance(record["seconds"], float)


def test_properties_expose_name_rules_and_a_function():
    for prop in zl.PROPERTIES:
        assert prop.name and prop.rules and prop.doc.strip(), prop.name
        assert prop.fn(timeout_ms=TIMEOUT_MS)["result"] == "proved", prop.name


# -- vacuity -----------------------------------------------------------------------------


@pytest.mark.parametrize("prop", zl.PROPERTIES, ids=lambda p: p.name)
def test_every_obligation_has_satisfiable_hypotheses(prop):
    for ob in prop.obligations(zs.CORRECT):
        solver = z3.Solver()
        solver.set(timeout=TIMEOUT_MS)
        solver.add(*ob.hypotheses)
        assert solver.check() == z3.sat, f"{prop.name}/{ob.name}: hypotheses unsatisfiable (vacuous)"


def test_vacuity_check_flags_contradictory_hypotheses():
    x = z3.Int("x")
    vacuous = zo.Obligation("vacuous", (x > 1, x < 0), x == 42)
    status, vacuity_ok, _ = zo._check(vacuous, TIMEOUT_MS)
    assert status == "proved"  # anything follows from a contradiction...
    assert vacuity_ok is False  # ...which the vacuity check reports


# -- broken variants -----------------------------------------------------------------------


def test_every_broken_variant_has_an_expected_refutation():
    assert set(zl.EXPECTED_REFUTATIONS) == set(zs.BROKEN_VARIANTS)
    for props in zl.EXPECTED_REFUTATIONS.values():
        assert props and set(props) <= set(zl.PROPERTIES_BY_NAME)


_CASES = [(v, p) for v, props in zl.EXPECTED_REFUTATIONS.items() for p in props]


@pytest.mark.parametrize(("variant", "prop"), _CASES, ids=[f"{v}-{p}" for v, p in _CASES])
def test_broken_variant_refuted_with_counterexample(variant, prop):
    record = zl.run_property(prop, variant, timeout_ms=TIMEOUT_MS)
    assert record["result"] == "refuted", record
    assert record["vacuity_ok"] is True, record
    cex = record["counterexample"]
    assert isinstance(cex, str) and "rate=" in cex and "try_take" in cex, cex


# -- the encoding is the code ------------------------------------------------------------------


def _val(term):
    v = z3.simplify(term)
    if z3.is_bool(v):
        assert z3.is_true(v) or z3.is_false(v), v
        return z3.is_true(v)
    if z3.is_int_value(v):
        return v.as_long()
    assert z3.is_rational_value(v), v
    return v.as_fraction()


@pytest.mark.parametrize("rate", [Fraction(10), Fraction(3), Fraction(1, 2), Fraction(7, 3), Fraction(20)])
def test_z3_encoding_matches_spec_and_reference(rate):
    """Random scheduler-like operation sequences: the CORRECT Z3 terms, evaluated on
    concrete values, give the same decisions, TATs and ready_at as the Python code."""
    sem, rng = zs.CORRECT, random.Random(f"z3-encoding-{rate}")
    p, q, tau = rate.numerator, rate.denominator, spec.BURST_NS
    T = spec.emission_interval_ns(rate)
    inc, burst = sem.ref_scale(z3.IntVal(p), z3.IntVal(q), z3.IntVal(tau))
    state, ref = spec.EMPTY, OutputRateLimiter(rate)
    z_known, z_tat, r_known, r_s = z3.BoolVal(False), z3.RealVal(0), z3.BoolVal(False), z3.IntVal(0)
    now, pending = 0, 0
    for _ in range(300):
        op = rng.choice(["advance", "take", "take", "refund", "cleanup"])
        if op == "advance":
            now += rng.choice([0, 1, 7, tau // 3, int(T) // 2, int(T), int(T) + 1, 2 * tau])
            pending = 0
        elif op == "take":
            state, granted = spec.try_take(state, "u", rate, now, tau)
            assert ref.try_take("u", now) == granted
            g, z_known, z_tat = sem.spec_take(z_known, z_tat, now, z3.RealVal(T), tau)
            rg, r_known, r_s = sem.ref_take(r_known, r_s, z3.IntVal(now), z3.IntVal(p), inc, burst)
            assert _val(g) == granted and _val(rg) == granted, (now, op)
            pending += granted
        elif op == "refund" and pending:
            state = spec.refund(state, "u", rate)
            ref.refund("u")
            z_known, z_tat = sem.spec_refund(z_known, z_tat, z3.RealVal(T))
            r_known, r_s = sem.ref_refund(r_known, r_s, inc)
            pending -= 1
        elif op == "cleanup":
            state = spec.cleanup_idle_users(state, now)
            ref.cleanup_idle_users(now)
            z_known = sem.spec_cleanup(z_known, z_tat, now, tau)
            r_known = sem.ref_cleanup(r_known, r_s, z3.IntVal(now), z3.IntVal(p), burst)
        # Fold the terms back to constants so they do not grow with the sequence.
        z_known, z_tat, r_known, r_s = (z3.simplify(t) for t in (z_known, z_tat, r_known, r_s))
        known = "u" in state.tat_ns
        assert _val(z_known) == known and _val(r_known) == known and (ref.tat_ns("u") is not None) == known
        assert _val(sem.spec_allows(z_known, z_tat, now, tau)) == spec.allows(state, "u", now, tau)
        if known:
            assert _val(z_tat) == state.tat_ns["u"] == ref.tat_ns("u")
            assert _val(r_s) == state.tat_ns["u"] * p
            ready = spec.ready_at_ns(state, "u", tau)
            assert _val(sem.spec_ready_at(z_tat, tau)) == ready == ref.ready_at_ns("u")
            assert _val(sem.ref_ready_at(r_s, z3.IntVal(p), burst)) == ready


@pytest.mark.rules("R2")
def test_r2_window_bound_plus_one_is_needed():
    """The closing step of the window proof fails for the bound without its ``+ 1``: Z3
    finds a state, so the proved bound is not weaker than what the invariant gives."""
    close = next(ob for ob in zw.window_obligations(zs.CORRECT) if ob.name == "close")
    k, (W, tau, rate) = z3.Int("k"), z3.Reals("W tau rate")
    tighter = zo.Obligation("close_without_plus_one", close.hypotheses, k <= (W + tau) * rate / zs.NS_PER_S)
    status, vacuity_ok, cex = zo._check(tighter, TIMEOUT_MS)
    assert status == "refuted" and vacuity_ok and cex, (status, cex)
