"""Gate reports for CI: JSON, JUnit XML (junit-xml) and a Markdown manifest (tabulate).

The Markdown manifest follows the shape of a verification-guided project's harness table:
one row per check with its component, kind, property, rules, budget, measured rate and
result; one row per mutant.
"""

from __future__ import annotations

from pathlib import Path

from junit_xml import TestCase, TestSuite, to_xml_report_string
from tabulate import tabulate

# check name prefix -> (component, kind, property)
MANIFEST = {
    "limiter-differential": (
        "spec/limiter.py vs reference/limiter.py",
        "differential (Hypothesis)",
        "same grants, TATs, ready times, cleanups for every operation sequence",
    ),
    "rate-limit": (
        "real vLLM scheduler class",
        "differential vs spec limiter (Hypothesis)",
        "every sampling dispatch granted by the spec limiter; paused only when refused; "
        "window bound; rotation; pause, not truncate",
    ),
    "invariants": (
        "real vLLM scheduler class",
        "invariants under pressure (Hypothesis)",
        "charges - refunds = dispatches; refunds once, of this step; throttled never "
        "scheduled; active cap; TAT = spec replay; wait hint",
    ),
    "base-fidelity": (
        "spec/ step model vs stock vLLM",
        "differential (Hypothesis)",
        "spec predicts stock vLLM step for step with the limit off",
    ),
    "proofs": (
        "spec/limiter.py, reference/limiter.py",
        "proof (Z3, unbounded integers)",
        "window bound, idle burst, integer scaling = spec, ready_at exact, refund and cleanup change nothing",
    ),
    "model-check": (
        "spec/ step model",
        "explicit-state model checking",
        "every invariant in every reachable state of the quick scopes; liveness",
    ),
    "white-box": (
        "spec/ step model vs scheduler class",
        "differential (Hypothesis)",
        "every observation field equal after every step",
    ),
}


def _mode_lines(modes: list[dict]) -> list[str]:
    """One line per row of the candidate's mode matrix: mode, status, message."""
    lines = []
    for m in modes:
        off = (
            f"; with the feature OFF too: {m['refused_with_feature_off']} (R18)"
            if m["refused_with_feature_off"]
            else ""
        )
        required = " (required)" if m["required"] else ""
        lines.append(
            f"{m['mode']} ({m['what']}): {m['status']}{required}" + (f": {m['message']}" if m["message"] else "") + off
        )
    return lines


def _describe(name: str) -> tuple[str, str, str]:
    return MANIFEST.get(name.split("/")[0], ("", "", ""))


def junit(path: Path, header: str, checks: list[dict], mutants: list[dict]) -> None:
    """One testcase per check and per mutant (a surviving mutant is a failure)."""
    cases = []
    for c in checks:
        case = TestCase(c["name"], classname="outrate.conform", elapsed_sec=c["seconds"])
        if c["result"] in ("not judged", "not applicable"):  # no verdict of its own (a refused mode: not in scope)
            case.add_skipped_info(c.get("failure") or c["result"])
        elif c["result"] == "warning":  # a project rule at should: reported, never a failure (adapter/origins.py)
            case.stdout = f"WARNING ({c.get('origin')}): {c.get('failure')}\n" + "\n".join(
                c.get("counterexample") or []
            )
        elif c["result"] != "pass":
            case.add_failure_info(c.get("failure") or "failed", "\n".join(c.get("counterexample") or []))
        if c.get("modes"):  # the candidate's mode matrix (adapter/modes.py)
            case.stdout = "\n".join(_mode_lines(c["modes"]))
        cases.append(case)
    for m in mutants:
        case = TestCase(m["mutant"], classname=f"outrate.mutants.{m['rule']}", elapsed_sec=m["seconds"])
        if m.get("not_judged"):
            case.add_skipped_info(m["not_judged"])
        elif not m["killed"]:
            short = m.get("coverage_shortfall")
            case.add_failure_info(
                f"mutant breaking {m['rule']} survived the gate"
                + (f" (its checks passed; coverage short: {short})" if short else "")
            )
        cases.append(case)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_xml_report_string([TestSuite(header, cases)]))


def markdown(path: Path, header: str, checks: list[dict], mutants: list[dict], budget: dict) -> None:
    """The gate manifest: check, component, kind, property, rules, budget, examples/s, result."""
    rows = []
    for c in checks:
        component, kind, prop = _describe(c["name"])
        rate = f"{c['examples'] / c['seconds']:.1f}" if c["seconds"] else "-"
        rows.append([c["name"], component, kind, prop, " ".join(c["rules"]), c["examples"], rate, c["result"].upper()])
    text = [
        f"# Gate manifest\n\n{header}\n",
        tabulate(
            rows,
            headers=[
                "check",
                "component",
                "kind",
                "property",
                "rules",
                "budget (examples)",
                "measured examples/s",
                "result",
            ],
            tablefmt="github",
        ),
    ]
    modes = next((c["modes"] for c in checks if c.get("modes")), None)
    if modes:
        text += ["\n\n## Candidate mode matrix\n", "\n".join(f"- {line}" for line in _mode_lines(modes))]
    warned = [c for c in checks if c["result"] == "warning"]
    if warned:
        text += ["\n\n## Warnings (this project's rules, not the article's: fatal at level exact)\n"]
        text += [f"- {c['name']}: {c.get('failure')}" for c in warned]
    if mutants:
        mrows = [
            [
                m["mutant"],
                m["rule"],
                "yes" if m["killed"] else (m.get("not_judged") or "NO"),
                m.get("killed_by") or "-",
                f"{m['seconds']:.1f}",
                m["counterexample_events"],
            ]
            for m in mutants
        ]
        text += [
            "\n\n## Mutants\n",
            tabulate(
                mrows,
                headers=[
                    "mutant",
                    "rule",
                    "killed",
                    "counterexample names",
                    "seconds to kill",
                    "counterexample events",
                ],
                tablefmt="github",
            ),
        ]
    text.append(f"\n\nBudget per check (profile): {budget}\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(text))
