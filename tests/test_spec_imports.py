"""The spec and the limiter differential module stay free of vLLM (and the spec of the rest).

Each import runs in a fresh interpreter (``sys.executable -c ...``) so that modules loaded
by pytest or by other tests cannot hide or fake a dependency.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.check

FORBIDDEN_FOR_SPEC = (
    "vllm_output_rate.reference",
    "vllm_output_rate.adapter",
    "vllm_output_rate.proofs",
)


def loaded_modules(*modules: str) -> list[str]:
    """Names in ``sys.modules`` of a fresh interpreter after importing ``modules``."""
    code = "import json, sys\n" + "".join(f"import {m}\n" for m in modules) + "print(json.dumps(sorted(sys.modules)))\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def is_vllm(name: str) -> bool:
    """True for the ``vllm`` package and its submodules (not ``vllm_output_rate``)."""
    return name == "vllm" or name.startswith("vllm.")


def is_under(name: str, packages: tuple[str, ...]) -> bool:
    """True if ``name`` is one of ``packages`` or a submodule of one."""
    return any(name == p or name.startswith(p + ".") for p in packages)


def test_predicates() -> None:
    assert is_vllm("vllm") and is_vllm("vllm.v1.core.sched.scheduler")
    assert not is_vllm("vllm_output_rate") and not is_vllm("vllm_output_rate.spec")
    assert not is_vllm("__editable___vllm_output_rate_0_1_0_finder")
    assert is_under("vllm_output_rate.reference.limiter", FORBIDDEN_FOR_SPEC)
    assert is_under("vllm_output_rate.adapter", FORBIDDEN_FOR_SPEC)
    assert not is_under("vllm_output_rate.referencex", FORBIDDEN_FOR_SPEC)
    assert not is_under("vllm_output_rate.spec.limiter", FORBIDDEN_FOR_SPEC)


@pytest.mark.parametrize(
    "module", ["vllm_output_rate.spec", "vllm_output_rate.spec.limiter", "vllm_output_rate.spec.versions"]
)
def test_spec_imports_no_vllm_and_nothing_else_of_the_project(module: str) -> None:
    mods = loaded_modules(module)
    assert module in mods  # the import really happened
    assert [m for m in mods if is_vllm(m)] == []
    assert [m for m in mods if is_under(m, FORBIDDEN_FOR_SPEC)] == []


def test_limiter_diff_imports_no_vllm() -> None:
    mods = loaded_modules("vllm_output_rate.adapter.limiter_diff")
    assert "vllm_output_rate.adapter.limiter_diff" in mods
    assert [m for m in mods if is_vllm(m)] == []


def test_detector_sees_project_imports() -> None:
    """Positive control: a module that imports the reference limiter shows up as such."""
    mods = loaded_modules("vllm_output_rate.adapter.limiter_diff")
    assert "vllm_output_rate.reference.limiter" in mods
    assert [m for m in mods if is_under(m, FORBIDDEN_FOR_SPEC)] != []
