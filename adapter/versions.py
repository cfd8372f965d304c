"""Which base-model profile (``spec/versions.py``) the installed vLLM gets.

The spec takes the vLLM version as data; this is the one place that reads it from vLLM
(``vllm.__version__``, e.g. ``0.32.0+cpu`` for the CPU build, ``0.33.0`` for the CUDA wheel)
and selects the profile. An unsupported version runs with the nearest older profile and a
warning (``installed_warning``), printed once to stderr and shown in the drift header.
"""

from __future__ import annotations

import functools
import sys

from vllm_output_rate.spec.versions import PROFILES, VllmVersionProfile, select_profile


def installed_version() -> str:
    """``vllm.__version__`` of the installed vLLM."""
    import vllm

    return vllm.__version__


@functools.cache
def _selected(version: str) -> tuple[VllmVersionProfile, str | None]:
    profile, warning = select_profile(version)
    if warning is not None:
        print(warning, file=sys.stderr)
    return profile, warning


def installed_profile() -> VllmVersionProfile:
    """The base-model profile of the installed vLLM (warns once if it is not supported)."""
    return _selected(installed_version())[0]


def installed_warning() -> str | None:
    """The unsupported-version warning of the installed vLLM, or None."""
    return _selected(installed_version())[1]


def profile_named(version: str | None) -> VllmVersionProfile:
    """The profile of a supported ``version`` (None: the installed vLLM's).

    Raises:
        ValueError: ``version`` is not a supported release.
    """
    if version is None:
        return installed_profile()
    if version not in PROFILES:
        raise ValueError(f"no base-model rows for vLLM {version}; supported: {', '.join(PROFILES)}")
    return PROFILES[version]
