"""docs/TRACEABILITY.md, the traceability table of docs/SPEC.md's rules, is generated
(``make traceability``) and checked here.

It fails when the committed block differs from what the declarations give (a hand-edited
row, a test or check added without regenerating), when a rule has no test or no gate
check, when an entry names code that does not exist, when a test declares an id that is
no rule, and when a Python snippet of SPEC.md is not an excerpt of the spec's source.
"""

from __future__ import annotations

import pytest

from vllm_output_rate import traceability
from vllm_output_rate.spec.rules import RULES, Rule, expand

pytestmark = pytest.mark.check


@pytest.fixture(scope="module")
def cover() -> dict[str, traceability.Coverage]:
    return traceability.gather()


@pytest.fixture(scope="module")
def trace_text() -> str:
    return traceability.TRACE_MD.read_text()


def test_committed_table_matches_the_declarations(cover, trace_text) -> None:
    assert traceability.problems(trace_text, cover) == []


def test_a_hand_edited_row_fails(cover, trace_text) -> None:
    _before, block, _after = traceability.split(trace_text)
    row = next(line for line in block.splitlines() if line.startswith("| [R4]"))
    edited = trace_text.replace(
        row, row.replace("| none |", "| `r4_by_hand` |", 1) if "| none |" in row else row + " hand note |"
    )
    assert edited != trace_text
    assert any("differs from the declarations" in p for p in traceability.problems(edited, cover))


def test_a_rule_without_test_or_gate_check_fails(cover, trace_text) -> None:
    bare = dict(cover, R4=traceability.Coverage())
    found = traceability.problems(trace_text, bare)
    assert "R4: no test declares it (@pytest.mark.rules)" in found
    assert "R4: no gate check declares it (GateRow.rules)" in found


def test_an_entry_naming_missing_code_fails(cover, trace_text, monkeypatch) -> None:
    broken = tuple(
        Rule(r.rule_id, r.title, r.spec + ("rate.no_such_function",), r.reference) if r.rule_id == "R7" else r
        for r in RULES
    )
    monkeypatch.setattr(traceability, "RULES", broken)
    found = traceability.problems(trace_text, cover)
    assert any(p.startswith("R7: rate.no_such_function") for p in found)


def test_an_unknown_rule_id_in_a_marker_fails(cover, trace_text) -> None:
    stray = traceability.TestRef("tests/test_x.py", "test_x", 1, ("R99",))
    found = traceability.problems(trace_text, dict(cover, R99=traceability.Coverage(tests=[stray])))
    assert "R99: not a rule of spec/rules.py, declared by tests/test_x.py::test_x" in found


def test_markers_are_read_from_decorators_not_names(tmp_path) -> None:
    (tmp_path / "tests").mkdir()
    (tmp_path / "gpu_tests").mkdir()
    (tmp_path / "tests" / "test_m.py").write_text(
        "import pytest\n\n@pytest.mark.rules('R2', 'R9')\ndef test_anything():\n    pass\n\n"
        "def test_r7_named_only():\n    pass\n"
    )
    refs = traceability.declared_tests(tmp_path)
    assert [(r.name, r.rules, r.line) for r in refs] == [("test_anything", ("R2", "R9"), 4)]


def test_a_drifted_snippet_fails() -> None:
    text = "```python\ndef ready_at_ns(state, user):\n    return math.floor(tat - burst_ns)\n```\n"
    assert traceability.snippet_problems(text) == [
        "docs/SPEC.md:1: snippet of ready_at_ns: 'return math.floor(tat - burst_ns)' is not in spec/'s "
        "ready_at_ns (in this order)"
    ]
    faithful = "```python\ndef ready_at_ns(state, user):\n    tat = state.tat_ns.get(user)\n```\n"
    assert traceability.snippet_problems(faithful) == []


def test_expand_rule_ranges() -> None:
    assert expand(["R1-R3", "I1-I18", "R9"]) == ["R1", "R2", "R3", "I1-I18", "R9"]


def test_table_is_keyed_by_symbol_a_line_inserted_at_the_top_of_a_file_changes_nothing(
    cover, tmp_path, monkeypatch
) -> None:
    # Issue 29, 3b: the table changes only when a rule's declarations do, never when code
    # moves inside a file. A line inserted at the top of reference/scheduler.py moves every
    # symbol there one line down (seen through inspect, as any reader of source lines sees
    # it), and one inserted at the top of a test file moves its tests.
    import inspect
    import shutil

    before = traceability.render(cover)
    source_lines = inspect.getsourcelines

    def one_line_lower(obj):
        lines, start = source_lines(obj)
        moved = (inspect.getsourcefile(obj) or "").endswith("reference/scheduler.py")
        return lines, start + 1 if moved else start

    monkeypatch.setattr(inspect, "getsourcelines", one_line_lower)
    for directory in traceability.TEST_DIRS:
        shutil.copytree(
            traceability.ROOT / directory, tmp_path / directory, ignore=shutil.ignore_patterns("__pycache__")
        )
    first = tmp_path / traceability.declared_tests()[0].path  # a file with declared tests
    first.write_text("\n" + first.read_text())
    assert any("reference/scheduler.py" in line for line in before.splitlines())
    assert traceability.render(traceability.gather(tmp_path)) == before
    assert "#L" not in before
