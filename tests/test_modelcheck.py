"""The explicit-state model checker of the spec (proofs/modelcheck.py, ``outrate check``).

* The quick profile explores exactly the pinned numbers of states and transitions per
  scope (a spec change that alters the state space is noticed) with zero violations.
* The reductions are sound: from any concrete state, every event leads to the same
  canonical successor as the same event from the canonical representative.
* I7 in ledger form agrees with ``invariants.i7_window_bound`` over the whole history.
* Seeded spec bugs are found, with the shortest counterexample, replayable (official
  invariants, saved ``StepScenario`` JSON that replays on real vLLM); a stuck spec is
  reported as a liveness violation; explored paths replay on real vLLM.
"""

from __future__ import annotations

import json
import random
from fractions import Fraction
from pathlib import Path

import pytest
from click.testing import CliRunner

from vllm_output_rate.adapter.fidelity import StepScenario
from vllm_output_rate.adapter.whitebox import replay_file
from vllm_output_rate.cli import main
from vllm_output_rate.proofs import modelcheck as mc
from vllm_output_rate.spec import invariants
from vllm_output_rate.spec import limiter as spec_limiter
from vllm_output_rate.spec.events import Abort, AddRequest, Step
from vllm_output_rate.spec.state import Observation, initial_state

UPDATE_HINT = (
    "the spec's state space changed. If that is intended, review the change and update the manifest "
    "deliberately: python -m vllm_output_rate.proofs.modelcheck --profile quick --pin "
    "(then commit proofs/modelcheck_scopes.json)"
)


def test_quick_profile_matches_pinned_counts_and_has_no_violation(tmp_path):
    out = tmp_path / "check.json"
    result = CliRunner().invoke(
        main,
        ["check", "--profile", "quick", "--jobs", "2", "--json", str(out), "--counterexamples", str(tmp_path / "cx")],
    )
    doc = json.loads(out.read_text())
    scopes = {s.name: s for s in mc.profile_scopes("quick")}
    assert [r["name"] for r in doc["scopes"]] == list(scopes)
    for r in doc["scopes"]:
        assert {"name", "states", "transitions", "states_per_s", "violations"} <= set(r)
        assert r["violations"] == 0, (r["name"], r["counterexamples"])
        pinned = scopes[r["name"]].pinned
        assert pinned is not None, f"{r['name']} has no pinned counts: {UPDATE_HINT}"
        assert (r["states"], r["transitions"]) == pinned, (
            f"{r['name']}: {r['states']} states / {r['transitions']} transitions, pinned {pinned[0]} / {pinned[1]}: "
            f"{UPDATE_HINT}"
        )
        assert r["states_per_s"] > 0 and isinstance(r["states_per_s"], float)
    assert result.exit_code == 0, result.output
    assert "invariants checked" in result.output
    # Every behaviour the explorer counts (rate-limit rules among them) is reached somewhere.
    covered = {k for r in doc["scopes"] for k, n in r["coverage"].items() if n}
    assert covered >= set(mc.COVERAGE_KEYS), set(mc.COVERAGE_KEYS) - covered


def _map_event(event, context):
    """The event of a concrete world, as seen from its canonical representative."""
    mapping, index = context[0], context[1]
    if isinstance(event, AddRequest):
        return AddRequest(
            "n",
            user=mapping[event.user],
            priority=event.priority,
            prompt_len=event.prompt_len,
            max_tokens=event.max_tokens,
            eos_index=event.eos_index,
        )
    if isinstance(event, Abort):
        return Abort(f"q{index[event.request_id]}")
    return event


@pytest.mark.parametrize("name", ["async-eos-drain", "sync-priority-kv", "sync-3users-cap", "sync-nochunk-rates"])
def test_canonical_reduction_is_a_bisimulation_on_random_walks(name):
    scope = mc.scope_by_name(name)
    cs = mc.Compiled(scope)
    rng = random.Random(7)
    for _ in range(12):
        world = mc.initial_world(cs)
        for depth in range(rng.randint(5, 30)):
            _, context = mc.canonical_key(world, cs)
            rep = mc.canonical_world(world, cs, context)
            events = mc.enabled_events(world, cs, depth, concrete=True)
            for event in events:
                concrete = mc.transition(world, event, cs)
                canonical = mc.transition(rep, _map_event(event, context), cs)
                assert [c for c, _ in concrete.violations] == [c for c, _ in canonical.violations]
                assert mc.canonical_key(concrete.world, cs)[0] == mc.canonical_key(canonical.world, cs)[0], (
                    f"{name}: {event} from a concrete state and from its representative differ"
                )
            world = mc.transition(world, rng.choice(events), cs).world


def test_i7_ledger_form_equals_the_window_bound_over_the_whole_history():
    scope = mc.scope_by_name("sync-nochunk-rates")  # rate 3 tok/s: fractional emission interval
    cs = mc.Compiled(scope)
    rng = random.Random(11)
    for _ in range(300):
        ledger = (None,) * len(cs.users)
        history = invariants.DispatchHistory()
        now = 0
        for k in range(rng.randint(1, 12)):
            now += rng.choice([0, 0, 10, 50, 100, 333, 400]) * mc.MS
            burst = [f"r{k}-{i}" for i in range(rng.choice([1, 1, 2]))]
            obs = Observation("step", now, sampled=tuple(burst))
            ledger, found = mc._advance_ledger(ledger, dict.fromkeys(burst, "a"), obs, cs)
            for _ in burst:
                history = history.add("a", now)
            official = invariants.i7_window_bound(history, "a", initial_state(scope.config))
            assert bool(found) == bool(official), (history, ledger, found, official)
            if found:
                break


def test_seeded_refund_bug_is_found_with_a_short_replayable_counterexample(tmp_path):
    scope = mc.scope_by_name("sync-victims")
    mutation = next(m for m in mc.MUTATIONS if m.name == "NoRefund")
    with mc.applied(mutation, scope.config):
        result = mc.explore(scope, save_dir=tmp_path)
    violation = result.violations["I13"]
    assert violation.concrete and violation.length == len(violation.events) <= 6
    assert violation.official is not None and "I13" in violation.official
    scenario = StepScenario.from_json(Path(violation.scenario_path).read_text())
    assert scenario.events == violation.events and scenario.config == scope.config
    # Without the mutation the same events are fine (the spec as written keeps I13), and the
    # saved file replays on real vLLM: the reference scheduler agrees with that spec throughout.
    assert mc.official_verdict(scope.config, violation.events) is None
    verdict = replay_file(violation.scenario_path)
    assert verdict.failure is None and verdict.events == len(violation.events)


def test_explored_paths_replay_on_real_vllm():
    rows = mc.replay_sample_on_vllm(["async-eos-drain", "off-sync-fcfs"], count=2)
    for name, count, events, failure in rows:
        assert failure is None, f"{name}: {failure}"
        assert count == 2 and events > 0


def test_a_stuck_spec_is_a_liveness_violation():
    scope = mc.scope_by_name("sync-fcfs-kv")
    never = mc.Mutation(
        "NeverGrant",
        "R2",
        "the limiter never grants",
        lambda config: [
            (spec_limiter, "allows", lambda state, user, now, burst=0: False),
            (spec_limiter, "try_take", lambda state, user, rate, now, burst=0: (state, False)),
        ],
    )
    with mc.applied(never, scope.config):
        result = mc.explore(scope)
    assert {"liveness-a", "liveness-b"} <= set(result.violations)
    stuck = result.violations["liveness-b"]
    assert stuck.concrete and isinstance(stuck.events[-2], Step)
    assert stuck.events[0] == AddRequest("a-0", user="a", prompt_len=2, max_tokens=3)


def test_scope_bound_is_asserted():
    scope = mc.scope_by_name("sync-fcfs-kv")
    with pytest.raises(mc.ScopeBoundExceeded, match="max_states"):
        mc.explore(scope, max_states=50)


def test_manifest_scopes_are_valid_and_profiles_nest():
    manifest = mc.load_manifest()
    names = [s["name"] for s in manifest["scopes"]]
    assert len(set(names)) == len(names)
    for data in manifest["scopes"]:
        mc.scope_from_json(data)  # asserts the scope is inside what vLLM accepts
    quick, ci, release = (set(manifest["profiles"][p]) for p in ("quick", "ci", "release"))
    assert quick <= ci <= release
    assert Fraction(3) in {s.config.default_rate_tokens_per_s for s in mc.profile_scopes("quick")}
