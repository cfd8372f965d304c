"""Check that the installed environment runs vLLM 0.32.0 on this machine; exit 1 if not.

Run by ``make`` after installing: imports the scheduler the way the gate does and fails with
a message that names the broken piece (the install pitfalls of the CPU build).
"""

from __future__ import annotations

import importlib.metadata as md
import subprocess
import sys
from pathlib import Path


def main() -> int:
    problems = []
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
        import vllm
        from vllm.v1.core.sched.scheduler import Scheduler  # noqa: F401

        if not vllm.__version__.startswith("0.32."):
            problems.append(f"vLLM {vllm.__version__} is installed; this project targets 0.32.x")
    except Exception as exc:  # report any import failure with its cause
        problems.append(f"importing the vLLM scheduler failed: {exc!r}")
    command = Path(sys.prefix) / "bin" / "vllm"
    if not command.exists():
        problems.append(f"the 'vllm' command is missing from {command.parent}")
    else:
        run = subprocess.run([str(command), "--version"], capture_output=True, text=True, timeout=300)
        if run.returncode != 0:
            problems.append(f"'vllm --version' failed: {run.stderr.strip()[-400:]}")
    if problems:
        print("environment check FAILED:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    print(f"environment ok: vllm {version}, python {sys.version.split()[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
