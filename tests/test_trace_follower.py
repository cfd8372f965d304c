"""The streaming online checker (``adapter.trace_check.TraceFollower``).

A trace fed to the follower in arbitrary byte chunks (lines cut anywhere, a poll after
each chunk) must give exactly the report of ``check_records`` on the whole trace; a
violation is listed once however often one polls; and the follower's memory does not
grow with the number of steps. Synthetic traces come from the builders of
``tests/test_trace.py``.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_trace import HEADER, MS, _lines, _rules, _step

from vllm_output_rate.adapter.trace_check import TraceFollower, check_records, check_trace
from vllm_output_rate.adapter.trace_checker import ABORTED
from vllm_output_rate.adapter.trace_report import TraceReport
from vllm_output_rate.spec.limiter import EMPTY, try_take, window_bound_tokens

SETTINGS = settings(derandomize=True, max_examples=150, deadline=None, database=None)
USERS = ("u", "slow", "v")
RIDS = ("a-12345678", "b", "c-abcdefgh", "d")
CLIENT_IDS = ("a", "b", "c-abcdefgh", "d", "zz")
STATUSES = ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED", ABORTED)


# -- helpers -----------------------------------------------------------------------
def _follow(
    path: Path, data: bytes, cuts: list[int], completions=None, cancelled=(), **kwargs
) -> tuple[TraceReport, list[TraceReport]]:
    """Append ``data`` to ``path`` in pieces cut at ``cuts``, polling after each piece."""
    path.write_bytes(b"")
    follower = TraceFollower(path, **kwargs)
    polls = []
    bounds = [0, *sorted(cuts), len(data)]
    for lo, hi in itertools.pairwise(bounds):
        with open(path, "ab") as f:
            f.write(data[lo:hi])
        polls.append(follower.poll())
    return follower.finish(completions, cancelled), polls


def _assert_same(streamed: TraceReport, batch: TraceReport) -> None:
    assert streamed.violations == batch.violations
    assert streamed.runs == batch.runs  # headers, steps, per-user and per-request summaries
    assert streamed.ignored_partial_line == batch.ignored_partial_line


def _assert_listed_once(final: TraceReport, polls: list[TraceReport]) -> None:
    """Each poll's violations are a prefix of the final ones: none repeated, none retracted."""
    for report in polls:
        assert final.violations[: len(report.violations)] == report.violations


# -- a generator of valid and broken traces -------------------------------------------
@st.composite
def _requests(draw, clean: bool, done: set[str]) -> dict:
    """{rid: (user, tokens, sampled, throttled)}; ``clean``: consistent users, no throttled scheduling."""
    pool = [r for r in RIDS if r not in done] if clean else list(RIDS)
    rids = draw(st.lists(st.sampled_from(pool), unique=True, max_size=3)) if pool else []
    reqs = {}
    for rid in rids:
        user = ("u", "v")[RIDS.index(rid) % 2] if clean else draw(st.sampled_from(USERS))  # "slow": 1 tok/s
        sampled = draw(st.booleans())
        throttled = draw(st.booleans()) and (not sampled or not clean)
        tokens = 0 if clean and throttled else 1 if clean and sampled else draw(st.integers(0, 2))
        reqs[rid] = (user, tokens, sampled, throttled)
    return reqs


@st.composite
def _finished(draw, clean: bool, done: set[str], sampled: Counter, busy=()) -> dict:
    """Requests freed; ``clean``: each once, with output tokens == its dispatches so far."""
    pool = [r for r in RIDS if r not in done and r not in busy] if clean else list(RIDS)
    freed = draw(st.lists(st.sampled_from(pool), unique=True, max_size=2)) if pool else []
    out = {
        rid: {
            "status": draw(st.sampled_from(STATUSES)),
            "output_tokens": sampled[rid] if clean else draw(st.integers(0, 6)),
        }
        for rid in freed
    }
    if clean:
        done.update(out)
    return out


@st.composite
def _record_lines(draw, step: int, now_ms: int, clean: bool, done: set[str], sampled: Counter) -> tuple[str, int, int]:
    """One trace event: a step (maybe broken unless ``clean``), an idle line, or a bad line."""
    kinds = ["step"] * 8 + ["idle", "blank"] + ([] if clean else ["garbage", "clock"])
    kind = draw(st.sampled_from(kinds))
    if kind == "idle":
        return json.dumps({"now_ns": None, "finished": draw(_finished(clean, done, sampled))}) + "\n", step, now_ms
    if kind == "garbage":
        return draw(st.sampled_from(["{not json\n", "[1]\n", '"x"\n'])), step, now_ms
    if kind == "blank":
        return "\n", step, now_ms
    if kind == "clock":  # a step number skipped or time going back
        step += draw(st.sampled_from([1, -1]))
        now_ms -= draw(st.sampled_from([0, 30]))
    reqs = draw(_requests(clean, done))
    finished = draw(_finished(clean, done, sampled, busy=reqs))
    sampled.update(rid for rid, (_, _, s, _) in reqs.items() if s)
    if clean:
        charges, refunds, preempted = None, [], []
    else:
        charges = draw(st.none() | st.lists(st.sampled_from(RIDS), max_size=3))
        refunds = [r for r in draw(st.lists(st.sampled_from(RIDS), max_size=2)) if r in reqs]
        preempted = draw(st.lists(st.sampled_from(RIDS), unique=True, max_size=1))
    rec = _step(step, max(now_ms, 0), reqs, charges=charges, refunds=refunds, finished=finished, preempted=preempted)
    return json.dumps(rec) + "\n", step + 1, now_ms + draw(st.sampled_from([0, 10, 50, 100, 300]))


@st.composite
def traces(draw) -> list[str]:
    """A trace's lines: 1-2 runs, each valid (``clean``) or broken in random ways."""
    clean = draw(st.booleans())
    lines = ['{"step": 0}\n'] if not clean and draw(st.integers(0, 9)) == 0 else []  # a record before any header
    for _ in range(draw(st.integers(1, 2))):
        rate = "1000" if clean else draw(st.sampled_from(["10", "1000", "7/3"]))
        header = {**HEADER["header"], "async_scheduling": draw(st.booleans()), "default_tokens_per_s": rate}
        lines.append(json.dumps({"header": header}) + "\n")
        step, now_ms, done, sampled = 0, 0, set(), Counter()
        for _ in range(draw(st.integers(0, 20))):
            line, step, now_ms = draw(_record_lines(step, now_ms, clean, done, sampled))
            lines.append(line)
    if draw(st.booleans()):  # the engine is still writing the last line
        lines[-1] = lines[-1][: draw(st.integers(1, max(1, len(lines[-1]) - 1)))]
    return lines


@st.composite
def _cuts(draw, size: int) -> list[int]:
    return draw(st.lists(st.integers(0, size), max_size=12))


# -- (a) streaming == batch ------------------------------------------------------------
@SETTINGS
@given(data=st.data())
def test_all_rules_streaming_equals_batch(tmp_path_factory, data):
    """clock, format, R2-window, R2-gcra, R7-once, R9-refund, R7/R9-accounting, R11,
    R17, tokens: any chunking of the file gives check_records' report."""
    lines = data.draw(traces())
    completions = data.draw(st.dictionaries(st.sampled_from(CLIENT_IDS), st.integers(0, 8), max_size=3))
    cancelled = data.draw(st.sets(st.sampled_from(CLIENT_IDS), max_size=2))
    raw = "".join(lines).encode()
    path = tmp_path_factory.mktemp("t") / "trace.jsonl"
    for partial in (False, True):
        batch = check_records(lines, completions, cancelled, partial=partial)
        final, polls = _follow(path, raw, data.draw(_cuts(len(raw))), completions, cancelled)
        if partial:
            final = TraceFollower(path).finish(completions, cancelled, partial=True)
        _assert_same(final, batch)
        _assert_listed_once(final, polls)
        assert check_trace(path, completions, cancelled, partial=partial) == batch


def _broken_traces() -> dict[str, list[str]]:
    paced = [_step(k, 100 * k, {"a": ("u", 1, True, False)}) for k in range(6)]
    burst = [_step(0, 0, dict.fromkeys("abc", ("u", 1, True, False)))] + paced[1:]
    return {
        "R2-window": _lines(*burst),
        "R2-gcra": _lines(*burst),
        "R7-once": _lines(_step(0, 0, {"a": ("u", 1, True, False)}, charges=["a", "a"], refunds=["a"]), *paced[1:]),
        "R9-refund": _lines(*paced[:2], _step(2, 200, {"a": ("u", 0, False, False)}, charges=[], refunds=["a"])),
        "R7/R9-accounting": _lines(*paced[:3], _step(3, 300, {"a": ("u", 1, True, False)}, charges=[])),
        "R11-throttled": _lines(*paced[:2], _step(2, 200, {"a": ("u", 1, True, True)})),
        "R17-identity": _lines(*paced[:2], _step(2, 200, {"a": ("v", 1, True, False)})),
        "clock": _lines(*paced[:2], _step(3, 150, {"a": ("u", 1, True, False)})),
        "tokens": _lines(
            *paced, {"now_ns": None, "finished": {"a": {"status": "FINISHED_STOPPED", "output_tokens": 5}}}
        ),
    }


@pytest.mark.parametrize("rule", sorted(_broken_traces()))
@pytest.mark.parametrize("piece", [1, 7, 64, 10_000])
def test_rule_streaming_equals_batch(tmp_path, rule, piece):
    """Each rule's violation is found, once, whatever the size of the appended pieces."""
    lines = _broken_traces()[rule]
    raw = "".join(lines).encode()
    batch = check_records(lines)
    assert rule in _rules(batch)
    final, polls = _follow(tmp_path / "trace.jsonl", raw, list(range(piece, len(raw), piece)))
    _assert_same(final, batch)
    _assert_listed_once(final, polls)


@pytest.mark.rules("R2")
@SETTINGS
@given(
    rate=st.sampled_from([Fraction(1), Fraction(3, 2), Fraction(10), Fraction(20, 3)]),
    gaps=st.lists(st.sampled_from([0, 0, 10, 30, 50, 100, 400]), min_size=1, max_size=40),
    data=st.data(),
)
def test_r2_window_and_gcra_streaming_equal_brute_force(tmp_path_factory, rate, gaps, data):
    """R2-window against every window [t_i, t_j]; R2-gcra against a full spec replay."""
    times, t = [], 0
    for gap in gaps:
        t += gap * MS
        times.append(t)
    window_ok = all(
        j - i + 1 <= window_bound_tokens(times[j] - times[i], rate)
        for i in range(len(times))
        for j in range(i, len(times))
    )
    state, gcra_ok = EMPTY, True
    for t in times:
        state, granted = try_take(state, "u", rate, t)
        gcra_ok = gcra_ok and granted
        if not granted:
            break
    header = {"header": {**HEADER["header"], "default_tokens_per_s": str(rate)}}
    lines = _lines(*[_step(k, t // MS, {f"r{k}": ("u", 1, True, False)}) for k, t in enumerate(times)], header=header)
    raw = "".join(lines).encode()
    final, polls = _follow(tmp_path_factory.mktemp("w") / "trace.jsonl", raw, data.draw(_cuts(len(raw))))
    assert ("R2-window" not in _rules(final)) == window_ok
    assert ("R2-gcra" not in _rules(final)) == gcra_ok
    _assert_same(final, check_records(lines))
    _assert_listed_once(final, polls)
    assert final.runs[0].users["u"].dispatch_ns == times
    assert max(Counter(v.rule for v in final.violations).values(), default=0) <= 1  # once per user and run


# -- (b) a violation is listed once ---------------------------------------------------
@pytest.mark.rules("R2", "R7")
def test_r2_and_r7_violations_listed_once_over_many_polls(tmp_path):
    path = tmp_path / "trace.jsonl"
    broken = _step(0, 0, dict.fromkeys("abc", ("u", 1, True, False)), charges=["a", "a", "b", "c"], refunds=["a"])
    path.write_text("".join(_lines(broken)))
    follower = TraceFollower(path)
    expected = {"R2-gcra": 1, "R2-window": 1, "R7-once": 1}
    for k in range(1, 300):
        if k % 3 == 0:  # every third poll a new step: 20 tok/s > 10, so R2 stays broken
            with open(path, "a") as f:
                f.write(json.dumps(_step(k // 3, 50 * (k // 3), {"a": ("u", 1, True, False)})) + "\n")
        report = follower.poll()
        assert Counter(v.rule for v in report.violations) == expected
    final = follower.finish()
    assert Counter(v.rule for v in final.violations) == expected
    assert final.runs[0].steps == 1 + 299 // 3
    with pytest.raises(RuntimeError):
        follower.poll()


def test_tokens_violation_listed_once_when_freed_mid_run(tmp_path):
    """tokens: a freed request is checked when the free is read, not again at the end."""
    path = tmp_path / "trace.jsonl"
    recs = [_step(k, 100 * k, {"a-12345678": ("u", 1, True, False)}) for k in range(3)]
    recs.append(_step(3, 300, {}, finished={"a-12345678": {"status": "FINISHED_STOPPED", "output_tokens": 2}}))
    path.write_text("".join(_lines(*recs)))
    follower = TraceFollower(path)
    assert _rules(follower.poll()) == ["tokens"]
    assert _rules(follower.poll()) == ["tokens"]
    final = follower.finish(completions={"a": 3})  # the client saw 3: fine
    assert [v.rule for v in final.violations] == ["tokens"]


def test_tokens_freed_request_touched_again_is_rechecked_at_run_end(tmp_path):
    """tokens: a request sampled after it was freed (a broken trace) is checked again when
    its run ends, as a one-shot check of the whole run would."""
    freed = {"a": {"status": "FINISHED_STOPPED", "output_tokens": 1}}
    recs = [
        _step(0, 0, {"a": ("u", 1, True, False)}),
        _step(1, 100, {}, finished=freed),
        _step(2, 200, {"a": ("u", 1, True, False)}),
    ]
    raw = "".join(_lines(*recs) + _lines()).encode()  # a second run starts after
    final, polls = _follow(tmp_path / "trace.jsonl", raw, [len("".join(_lines(*recs[:2])))])
    assert polls[0].ok
    assert [v.rule for v in final.violations] == ["tokens"] and "2 sampling dispatches" in final.violations[0].message
    _assert_same(final, check_records(_lines(*recs) + _lines()))


# -- partial lines, errors -------------------------------------------------------------
def test_format_partial_line_stays_unread_until_newline(tmp_path):
    path = tmp_path / "trace.jsonl"
    first, second = _lines(_step(0, 0, {"a": ("u", 1, True, False)}), _step(1, 100, {"a": ("u", 1, True, False)}))[1:]
    path.write_text(_lines()[0] + first + second[:10])
    follower = TraceFollower(path)
    report = follower.poll()
    assert report.ok and report.ignored_partial_line and report.runs[0].steps == 1
    assert follower.offset == len((_lines()[0] + first).encode())
    with open(path, "a") as f:
        f.write(second[10:])
    report = follower.poll()
    assert report.ok and not report.ignored_partial_line and report.runs[0].steps == 2
    assert follower.finish().runs[0].users["u"].dispatch_ns == [0, 100 * MS]


def test_format_unterminated_tail_at_finish(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text(_lines()[0] + '{"step": 1, "now')
    assert _rules(TraceFollower(path).finish()) == ["format"]
    report = TraceFollower(path).finish(partial=True)
    assert report.ok and report.ignored_partial_line


def test_follower_truncated_or_missing_file_raises(tmp_path):
    path = tmp_path / "trace.jsonl"
    follower = TraceFollower(path)
    with pytest.raises(FileNotFoundError):
        follower.poll()
    path.write_text("".join(_lines(_step(0, 0, {}))))
    follower.poll()
    path.write_text(_lines()[0])
    with pytest.raises(ValueError, match="truncated"):
        follower.poll()


# -- tokens: client ids matched through an index ---------------------------------------
def test_tokens_client_id_matching_indexed():
    recs = [
        _step(
            0,
            0,
            {
                "a": ("u", 1, True, False),
                "a-12345678": ("u", 1, True, False),
                "b-1234567": ("u", 1, True, False),
                "c-x-abcdefgh": ("v", 1, True, False),
            },
        )
    ]
    header = {"header": {**HEADER["header"], "default_tokens_per_s": "1000"}}
    report = check_records(
        _lines(*recs, header=header), completions={"a": 1, "b": 1, "b-1234567": 1, "c-x": 1, "c-x-abcdefgh": 1}
    )
    messages = sorted(v.message for v in report.violations)
    assert messages == [
        "client request 'a': 2 engine requests match it",
        "client request 'b': 0 engine requests match it",
    ]


def test_tokens_many_clients_linear():
    """20k client streams against 20k engine requests: an O(clients x requests) match
    would take minutes."""
    n = 20_000
    header = {"header": {**HEADER["header"], "default_tokens_per_s": "1000000"}}
    reqs = {f"req{k}-{k:08d}": ("u", 1, True, False) for k in range(n)}
    finished = {rid: {"status": "FINISHED_STOPPED", "output_tokens": 1} for rid in reqs}
    lines = _lines(_step(0, 0, reqs), {"now_ns": None, "finished": finished}, header=header)
    report = check_records(lines, completions={f"req{k}": 1 for k in range(n)})
    assert report.ok, report.summary()


# -- (c) memory bounded by users and requests, not by steps ---------------------------
def _sizes(root) -> int:
    """Total number of items in every container reachable from ``root`` (attributes,
    slots, dicts, lists, sets, tuples), each container counted once."""
    seen, todo, total = set(), [root], 0
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, (str, bytes, int, float, bool, Fraction, type(None), Path)):
            continue
        seen.add(id(obj))
        if isinstance(obj, dict):
            total += len(obj)
            todo += [*obj.keys(), *obj.values()]
        elif isinstance(obj, (list, set, tuple, frozenset)):
            total += len(obj)
            todo += list(obj)
        else:
            todo += list(getattr(obj, "__dict__", {}).values())
            todo += [getattr(obj, s) for s in getattr(type(obj), "__slots__", ()) if hasattr(obj, s)]
            mapping = getattr(obj, "tat_ns", None)  # spec LimiterState: a read-only mapping
            if mapping is not None:
                todo.append(dict(mapping))
    return total


def _append_steps(path: Path, first: int, count: int) -> None:
    with open(path, "a") as f:
        for k in range(first, first + count):
            reqs = {f"r{k % 4}": (f"user{k % 2}", 1, True, False), f"r{k % 4 + 4}": (f"user{k % 2}", 1, True, False)}
            f.write(json.dumps(_step(k, 10 * k, reqs)) + "\n")


@pytest.mark.rules("R2")
@pytest.mark.parametrize("keep_dispatch_ns", [False, True])
def test_r2_state_bounded_after_50k_steps(tmp_path, keep_dispatch_ns):
    """R2-window/R2-gcra keep O(1) state per user; nothing grows per record: after 5k and
    after 50k steps the follower holds the same number of items, except the dispatch
    times it was asked to keep."""
    path = tmp_path / "trace.jsonl"
    header = {"header": {**HEADER["header"], "default_tokens_per_s": "1000"}}
    path.write_text(json.dumps(header) + "\n")
    follower = TraceFollower(path, keep_dispatch_ns=keep_dispatch_ns)
    _append_steps(path, 0, 5_000)
    follower.poll()
    small = _sizes(follower)
    for first in range(5_000, 50_000, 15_000):
        _append_steps(path, first, 15_000)
        report = follower.poll()
    run = report.runs[0]
    assert report.ok, report.summary()
    assert run.steps == 50_000 and len(run.requests) == 8 and len(run.users) == 2
    assert sum(u.dispatches for u in run.users.values()) == 100_000
    kept = sum(len(u.dispatch_ns) for u in run.users.values())
    assert kept == (100_000 if keep_dispatch_ns else 0)
    assert _sizes(follower) - small == (90_000 if keep_dispatch_ns else 0)
    assert follower.offset == path.stat().st_size
    assert run.users["user0"].engine_rate == pytest.approx(50_000 / 499.98)
