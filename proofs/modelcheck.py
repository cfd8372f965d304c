"""Explicit-state model checking of the step spec over small declared scopes.

``spec.scheduler.step`` is a deterministic function of (state, event). For a *scope* -- a
small engine configuration, a few users each with a finite multiset of streams, a few
clock increments, a budget of aborts -- this module enumerates, breadth first, every
state reachable by any interleaving of the scope's events, checks every invariant of
``spec/invariants.py`` on every transition, and then checks two liveness properties on
the explored graph. A violation comes out as the *shortest* event sequence (BFS parents)
that exhibits it, written as a ``StepScenario`` JSON file (``adapter/fidelity.py``) that
replays on real vLLM with ``python -m vllm_output_rate.adapter.whitebox FILE``.

The checker's transition system
-------------------------------
A checker state ("world") is the spec's ``SchedulerState`` plus what the events still
may do: each user's pending streams (not yet added), the aborts left, and two pieces of
bookkeeping the checker needs for properties over whole runs (below): each user's
dispatch ledger (I7, I13) and each resident stream's bypass count (F1). Enabled events:
``Step``; ``AdvanceClock(d)`` for each declared increment ``d``; ``Drain`` (async scopes
that declare it, when output is in flight); ``AddRequest`` of any user's pending stream
and ``Abort`` of any live request, and (R21) ``ChangeRates`` of the scope's next rate
table, while fewer than ``horizon`` events have happened (``horizon`` None: always).
Every state keeps ``Step`` and ``AdvanceClock`` enabled, so liveness is decided exactly
on the explored graph.

Canonical states (what makes the state space finite and small)
--------------------------------------------------------------
Two worlds with the same canonical form have the same future up to renaming and a shift
of time, so only one is explored. Each reduction is sound for a stated reason:

- *Clock.* Nothing in ``step`` depends on absolute time, only on ``TAT - now`` (R2, R5,
  R6 are all written in differences). The canonical world has ``now_ns = 0`` and every
  TAT replaced by its lead ``TAT - now``. A TAT ``<= now`` is dropped: R6 says such a
  user behaves exactly as an unknown one (``allows`` is true, ``max(TAT, now) = now``).
  The leads are bounded (``<= tau + T`` after any grant), so the clock adds finitely many
  states although it advances forever.
- *Cleanup cadence.* ``num_schedules`` only decides *when* R6 cleanup runs. Cleanup only
  deletes TATs ``<= now`` and last-served entries of requests that left, both of which the
  canonical form drops anyway. The checker *verifies* this after every ``Step``: it
  applies ``limiter.cleanup_idle_users`` to the new state and requires the canonical
  limiter to be unchanged (check "R6"). Hence ``num_schedules`` is dropped.
- *Request names and counters.* Live requests are renamed ``q0, q1, ...`` in arrival
  order and their ``arrival`` replaced by that rank (only the order of arrivals matters:
  PRIORITY compares ``(priority, arrival)``, R13 takes the latest arrival);
  ``num_preemptions`` (read by nothing) is zeroed; in-flight outputs and last-served
  entries of requests that left are dropped (``deliver`` drops such output, R14 ignores
  a last-served stream that is not running; scopes never reuse a request id); R14's
  ``turns`` keep only running requests (``turn_order`` drops the others); an empty
  in-flight output equals none.
- *Symmetry over users.* Users with the same rate are interchangeable: nothing in the
  spec compares user names, and the checker state carries each user's pending streams
  and ledger with the user. Within each class of equal-rate users, names are assigned in
  a canonical order: users with live requests by their first live arrival, the others by
  (pending streams, TAT lead, ledger lead); users tied on the latter are identical, so
  the choice between them does not matter.

States are stored as 128-bit BLAKE2b fingerprints of the canonical key (hash compaction,
as TLC does with 64 bits): the chance that two distinct states collide, silently merging
them, is below ``n^2 / 2^129`` (< 10^-26 at 10^6 states).

Properties
----------
- Every transition: ``invariants.check`` (I1-I18; I7's window bound is evaluated by the
  checker in ledger form, see below) and any ``AssertionError`` raised inside the spec
  (check "assert").
- I7 in ledger form: for each user the checker replays GCRA over the user's *sampling
  dispatches* (not the limiter's charges): ``L := max(L, t) + T`` per dispatch at time
  ``t``. A dispatch sequence satisfies the window bound "dispatches in any window of W
  ns <= floor((W + tau) x rate) + 1" iff every dispatch happens at ``t >= L - tau``
  (after k dispatches from idle, ``L = max_j (t_j + (k - j + 1) T)``, so ``t_{k+1} >=
  L - tau`` is exactly the bound for every window ``[t_j, t_{k+1}]``). So the check is
  exact over the whole, unbounded history, with one number per user. Counterexamples
  are confirmed with ``invariants.i7_window_bound`` on the concrete history.
- F1 (R14, bounded bypass): a running stream refused (throttled) in a step in which
  another stream of its (user, priority) group was dispatched has been bypassed; its
  count resets when it is dispatched or leaves ``running``. Rotation guarantees at most
  (streams of one user at that priority in the scope - 1) consecutive bypasses.
- I18 (R19, not binding = stock): in every Step in which no limit binds (no user refused
  or held, nothing throttled, the active cap never reached), the spec's step equals the
  base scheduler's step from the same state (``invariants.i18_not_binding_is_stock``);
  coverage ``not_binding`` counts those steps per scope.
- Liveness (a): from every reachable state, a state where every live request has
  finished is reachable by ``Step`` and ``AdvanceClock`` events alone (no adds, aborts
  or drains): every request that is not aborted eventually finishes.
- Liveness (b): no reachable state holds work from which no ``Step``/``AdvanceClock``
  sequence ever schedules a token ("engine healthy but stuck").
  Both by backward reachability on the explored graph (exact: every explored state has
  all its ``Step``/``AdvanceClock`` successors explored).

Scopes and profiles live in ``proofs/modelcheck_scopes.json`` with their pinned numbers
of distinct states and transitions (``tests/test_modelcheck.py``).

Layout: ``modelcheck_scopes`` (scopes, profiles, ``Compiled``), ``modelcheck_reduction``
(worlds and their canonical form), ``modelcheck_transitions`` (enabled events, one
checked transition), ``modelcheck_explorer`` (the breadth-first search),
``modelcheck_liveness``, ``modelcheck_results`` (violations, a scope's result),
``modelcheck_counterexamples`` (shortest paths, concrete and saved),
``modelcheck_replay`` (sampled paths on vLLM), ``modelcheck_mutations`` (the
spec-mutation table); this module runs profiles, holds the command line and re-exports
the names of all of them (``vllm_output_rate.proofs.modelcheck`` is the import path).

``python -m vllm_output_rate.proofs.modelcheck --profile quick`` runs a profile;
``--pin`` rewrites the pinned counts of the profile's scopes (deliberately, after a spec
change); ``--mutations`` runs the spec-mutation table and writes docs/SPEC_MUTATIONS.md.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import queue as queue_mod
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from vllm_output_rate.proofs.modelcheck_counterexamples import concrete_path, official_verdict
from vllm_output_rate.proofs.modelcheck_explorer import COVERAGE_KEYS, explore
from vllm_output_rate.proofs.modelcheck_mutations import (
    MUTATION_PROFILE,
    MUTATIONS,
    MUTATIONS_DOC,
    Mutation,
    MutationRow,
    _fmt_caught,
    applied,
    mutations_markdown,
    run_mutation,
    run_mutations,
)
from vllm_output_rate.proofs.modelcheck_reduction import (
    World,
    canonical_key,
    canonical_world,
    canonicalize,
    initial_world,
)
from vllm_output_rate.proofs.modelcheck_replay import replay_sample_on_vllm, sample_scenarios
from vllm_output_rate.proofs.modelcheck_results import ConcretizationError, ScopeBoundExceeded, ScopeResult, Violation
from vllm_output_rate.proofs.modelcheck_scopes import (
    MANIFEST_PATH,
    MAX_SCOPE_STATES,
    MAX_STREAMS_PER_SCOPE,
    MS,
    Compiled,
    Scope,
    Stream,
    load_manifest,
    profile_scopes,
    scope_by_name,
    scope_from_json,
)
from vllm_output_rate.proofs.modelcheck_transitions import CHECK_IDS, Outcome, enabled_events, transition
from vllm_output_rate.proofs.modelcheck_transitions import (
    _advance_ledger as _advance_ledger,  # tests: I7 in ledger form
)

__all__ = [
    "CHECK_IDS",
    "COVERAGE_KEYS",
    "MANIFEST_PATH",
    "MAX_SCOPE_STATES",
    "MAX_STREAMS_PER_SCOPE",
    "MS",
    "MUTATIONS",
    "MUTATIONS_DOC",
    "MUTATION_PROFILE",
    "Compiled",
    "ConcretizationError",
    "Mutation",
    "MutationRow",
    "Outcome",
    "Scope",
    "ScopeBoundExceeded",
    "ScopeResult",
    "Stream",
    "Violation",
    "World",
    "applied",
    "canonical_key",
    "canonical_world",
    "canonicalize",
    "concrete_path",
    "enabled_events",
    "explore",
    "initial_world",
    "load_manifest",
    "main",
    "mutations_markdown",
    "official_verdict",
    "pin_profile",
    "profile_scopes",
    "replay_sample_on_vllm",
    "run_mutation",
    "run_mutations",
    "run_profile",
    "run_scope",
    "sample_scenarios",
    "scope_by_name",
    "scope_from_json",
    "transition",
]


def run_scope(name: str, save_dir: str | None = None, progress_queue=None) -> dict:
    """Explore one manifest scope (a worker entry point); the result as JSON."""
    scope = scope_by_name(name)

    def report(states: int, transitions: int) -> None:
        if progress_queue is not None:
            progress_queue.put((name, states, transitions))

    try:
        result = explore(scope, on_progress=report, save_dir=None if save_dir is None else Path(save_dir))
    except ScopeBoundExceeded as error:
        return {"name": name, "error": str(error)}
    return result.as_json()


def run_profile(
    profile: str,
    jobs: int = 2,
    save_dir: str | None = None,
    on_progress: Callable[[str, int, int], None] | None = None,
    on_done: Callable[[dict], None] | None = None,
) -> list[dict]:
    """Explore every scope of ``profile`` on ``jobs`` processes; results in manifest order."""
    names = [s.name for s in profile_scopes(profile)]
    results: dict[str, dict] = {}
    if jobs <= 1:
        for name in names:
            results[name] = (
                run_scope(name, save_dir, None) if on_progress is None else _run_inline(name, save_dir, on_progress)
            )
            if on_done is not None:
                on_done(results[name])
        return [results[n] for n in names]
    context = multiprocessing.get_context("fork")
    manager = context.Manager()
    progress_queue = manager.Queue()
    # Biggest scopes first, so that two workers finish at about the same time.
    order = sorted(names, key=lambda n: -scope_by_name(n).max_states)
    with ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
        futures = {pool.submit(run_scope, n, save_dir, progress_queue): n for n in order}
        pending = set(futures)
        while pending:
            try:
                while True:
                    name, states, transitions = progress_queue.get(timeout=0.2)
                    if on_progress is not None:
                        on_progress(name, states, transitions)
            except queue_mod.Empty:
                pass
            for future in [f for f in pending if f.done()]:
                pending.discard(future)
                results[futures[future]] = future.result()
                if on_done is not None:
                    on_done(results[futures[future]])
        for _ in as_completed(futures):
            pass
    manager.shutdown()
    return [results[n] for n in names]


def _run_inline(name: str, save_dir: str | None, on_progress: Callable[[str, int, int], None]) -> dict:
    class _Queue:
        @staticmethod
        def put(item) -> None:
            on_progress(*item)

    return run_scope(name, save_dir, _Queue())


def pin_profile(profile: str, path: Path = MANIFEST_PATH, jobs: int = 2) -> list[dict]:
    """Explore ``profile`` and write its scopes' state and transition counts into the
    manifest (only when no scope has a violation)."""
    results = run_profile(profile, jobs=jobs)
    bad = [r["name"] for r in results if "error" in r or r["violations"]]
    assert not bad, f"not pinning: violations or errors in {bad}"
    manifest = load_manifest(path)
    by_name = {r["name"]: r for r in results}
    for entry in manifest["scopes"]:
        if entry["name"] in by_name:
            r = by_name[entry["name"]]
            entry["pinned"] = {"states": r["states"], "transitions": r["transitions"]}
    path.write_text(json.dumps(manifest, indent=1) + "\n")
    return results


def _print_results(results: list[dict]) -> int:
    bad = 0
    for r in results:
        if "error" in r:
            print(f"{r['name']}: ERROR {r['error']}")
            bad += 1
            continue
        pin = r["pinned"]
        pin_note = (
            ""
            if pin is None or (pin["states"], pin["transitions"]) == (r["states"], r["transitions"])
            else f"  (pinned {pin['states']}/{pin['transitions']}: update the manifest deliberately)"
        )
        print(
            f"{r['name']:<28} states {r['states']:>9} transitions {r['transitions']:>10} "
            f"{r['states_per_s']:>8.0f} st/s depth {r['max_depth']:>3} violations {r['violations']}{pin_note}"
        )
        for v in r["details"]:
            print(f"    {v['check']}: {v['message']}")
            for line in v["events"]:
                print(f"        {line}")
        bad += r["violations"] > 0
    return bad


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vllm_output_rate.proofs.modelcheck")
    parser.add_argument("--profile", default="quick")
    parser.add_argument("--scope", action="append", default=[])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--pin", action="store_true", help="rewrite the profile's pinned counts in the manifest")
    parser.add_argument("--mutations", action="store_true", help="run the spec mutations, write docs/SPEC_MUTATIONS.md")
    parser.add_argument("--mutation", action="append", default=None, help="only these mutations (no doc written)")
    parser.add_argument("--save", default=None, help="directory for counterexample scenarios")
    parser.add_argument(
        "--replay-sample",
        type=int,
        default=0,
        metavar="N",
        help="replay N explored paths per scope of the profile on real vLLM (fidelity check)",
    )
    args = parser.parse_args(argv)
    if args.replay_sample:
        names = args.scope or [s.name for s in profile_scopes(args.profile)]
        failed = 0
        for name, count, events, failure in replay_sample_on_vllm(names, args.replay_sample):
            print(f"{name:<28} {count} scenarios, {events} events: {'PASS' if failure is None else 'FAIL'}", flush=True)
            if failure:
                failed += 1
                print(failure)
        return 1 if failed else 0
    if args.mutations or args.mutation:
        started = time.perf_counter()
        rows = run_mutations(
            jobs=args.jobs,
            names=args.mutation,
            on_row=lambda r: print(
                f"{r.mutation:<30} {r.rule:<6} {_fmt_caught(r.caught_by)} [{r.seconds:.0f} s]", flush=True
            ),
        )
        assert not rows[0].caught_by, f"the spec as written fails: {rows[0].caught_by}"
        if args.mutation is None:
            MUTATIONS_DOC.write_text(
                mutations_markdown(rows, profile_scopes(MUTATION_PROFILE), time.perf_counter() - started)
            )
            print(f"wrote {MUTATIONS_DOC}")
        return 0
    if args.pin:
        results = pin_profile(args.profile, jobs=args.jobs)
        _print_results(results)
        print(f"pinned {len(results)} scopes of profile {args.profile} in {MANIFEST_PATH}")
        return 0
    if args.scope:
        results = []
        for name in args.scope:
            results.append(
                explore(scope_by_name(name), save_dir=None if args.save is None else Path(args.save)).as_json()
            )
    else:
        results = run_profile(args.profile, jobs=args.jobs, save_dir=args.save)
    return 1 if _print_results(results) else 0


if __name__ == "__main__":
    sys.exit(main())
