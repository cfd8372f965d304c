"""The one seam per side to vLLM's internals (adapter/vllm_compat.py, reference/vllm_compat.py).

- No code outside the seams names a field the seams wrap (AST scan of every Python file of
  the product and the tests): attribute reads and writes, keyword arguments, and the name
  as a string (``getattr(x, "resumed_req_ids")``).
- Only the seams (and the few places listed with their reason) read ``vllm.__version__`` or
  call ``select_profile``: nothing else branches on the vLLM release.
- The seams cover the supported releases, and ``scheduler_only_config`` builds a config on
  this machine with everything the CPU platform sets after the Triton check, and restores
  the flag.
"""

from __future__ import annotations

import ast
from pathlib import Path

from vllm_output_rate.adapter import vllm_compat
from vllm_output_rate.adapter.engine_shape import EngineShape, build_vllm_config

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("adapter", "outrate", "reference", "proofs", "spec", "tests", "gpu_tests")
SEAMS = {"adapter/vllm_compat.py", "reference/vllm_compat.py"}
# Files that read the installed release without branching on it, or that are the version
# module's own machinery: the reason for each.
VERSION_READERS = {
    "adapter/versions.py": "the gate's base-model profile of the installed release (spec/versions.py data)",
    "outrate/envcheck.py": "checks the installed release is the one make asked for",
    "outrate/cli_conform.py": "prints and records the release in report headers",
    "outrate/cli_replay.py": "prints the release in replay notes",
    "outrate/bench/command.py": "records the release in the benchmark report",
    "adapter/counterexample.py": "records the release in a saved counterexample",
    "tests/test_versions.py": "tests the version profiles themselves",
    "tests/test_bench.py": "checks the benchmark report records the release",
    "tests/test_lora_slots_gate.py": "names the release in an assertion message",
}
PROFILE_SELECTORS = {"adapter/versions.py", "tests/test_versions.py"}


def _python_files() -> list[Path]:
    files = []
    for folder in SCANNED:
        files += sorted((ROOT / folder).rglob("*.py"))
    return files


def _findings(path: Path) -> list[tuple[int, str]]:
    """(line, what) for every wrapped-field use and release read in one file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        name = None
        if isinstance(node, ast.Attribute):
            name = node.attr
            if name == "__version__" and isinstance(node.value, ast.Name) and node.value.id == "vllm":
                name = "vllm.__version__"
        elif isinstance(node, ast.keyword):
            name = node.arg
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            name = node.value
        elif isinstance(node, ast.Name):
            name = node.id
        if name in vllm_compat.WRAPPED_FIELDS or name in ("vllm.__version__", "select_profile"):
            found.append((getattr(node, "lineno", 0), name))
    return found


def _offences() -> list[str]:
    offences = []
    for path in _python_files():
        rel = path.relative_to(ROOT).as_posix()
        if rel in SEAMS or rel == "tests/test_vllm_seam.py" or rel == "spec/versions.py":
            continue
        for line, name in _findings(path):
            if name == "vllm.__version__" and rel in VERSION_READERS:
                continue
            if name == "select_profile" and rel in PROFILE_SELECTORS:
                continue
            offences.append(f"{rel}:{line}: {name}")
    return offences


def test_nothing_outside_the_seams_reads_a_wrapped_field_or_branches_on_the_release():
    offences = _offences()
    assert offences == [], (
        "go through adapter/vllm_compat.py or reference/vllm_compat.py (docs/VLLM_VERSIONS.md):\n  "
        + "\n  ".join(offences)
    )


def test_the_scan_sees_a_wrapped_field_read_outside_the_seam(tmp_path):
    # The scan itself can fail: a file reading resumed_req_ids, req_id_to_index= or the
    # release is found, line by line.
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import vllm\n"
        "ids = so.scheduled_cached_reqs.resumed_req_ids\n"
        "out = ModelRunnerOutput(req_ids=[], req_id_to_index={})\n"
        "late = getattr(core, '_deferred_inputs', ())\n"
        "if vllm.__version__ >= '0.34':\n    pass\n"
    )
    assert _findings(bad) == [
        (2, "resumed_req_ids"),
        (3, "req_id_to_index"),
        (4, "_deferred_inputs"),
        (5, "vllm.__version__"),
    ]


def test_the_seams_cover_the_supported_releases():
    from vllm_output_rate.spec.versions import SUPPORTED_VERSIONS

    assert vllm_compat.SUPPORTED_RELEASES == SUPPORTED_VERSIONS
    for seam in SEAMS:
        text = (ROOT / seam).read_text(encoding="utf-8")
        assert all(release in text for release in SUPPORTED_VERSIONS), seam


def test_scheduler_only_config_runs_the_rest_of_the_platform_check_and_restores_the_flag():
    import vllm.triton_utils as triton_utils
    from vllm.platforms import current_platform

    before = triton_utils.HAS_TRITON
    method = type(current_platform).__dict__["check_and_update_config"]
    config = build_vllm_config(EngineShape(async_scheduling=True, num_blocks=12))
    assert before == triton_utils.HAS_TRITON
    assert type(current_platform).__dict__["check_and_update_config"] is method
    assert config.cache_config.num_gpu_blocks == 12
    if current_platform.is_cpu():  # the CPU platform turns async scheduling off after the check
        assert config.scheduler_config.async_scheduling is False


def test_model_runner_output_is_read_back_by_update_from_output():
    # The fabricated output's tokens reach the request through vLLM's own update_from_output,
    # on whichever form this release's ModelRunnerOutput takes.
    from vllm_output_rate.adapter.harness import STOCK_SCHEDULER, Harness

    harness = Harness(STOCK_SCHEDULER, EngineShape())
    harness.add_request("r0", prompt_len=4, max_tokens=3)
    traces = [harness.step() for _ in range(3)]
    assert traces[0].admitted == ["r0"]
    assert harness.finished == {"r0": ("length", 3)}
