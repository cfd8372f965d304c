"""Which base-model profile (``spec/versions.py``) the installed vLLM gets.

The spec takes the vLLM version as data; this is the gate's one place that reads it from
vLLM (``vllm.__version__``; a local part such as ``+cpu`` is ignored) and selects the profile.
An unsupported version runs with the nearest older profile and a warning
(``installed_warning``), which each command prints once: ``outrate conform`` first of all,
``outrate drift`` in its header.
"""

from __future__ import annotations

import functools

from vllm_output_rate.spec.versions import PROFILES, VllmVersionProfile, select_profile


def installed_version() -> str:
    """``vllm.__version__`` of the installed vLLM."""
    import vllm  # deferred: vLLM costs ~7 s to import

    return vllm.__version__


@functools.cache
def profile_and_warning(version: str) -> tuple[VllmVersionProfile, str | None]:
    """The base-model profile a vLLM ``version`` runs with, and the unsupported-release
    warning (None if ``version`` is a supported release)."""
    return select_profile(version)


def installed_profile() -> VllmVersionProfile:
    """The base-model profile of the installed vLLM (``installed_warning`` if it is not supported)."""
    return profile_and_warning(installed_version())[0]


def installed_warning() -> str | None:
    """The unsupported-version warning of the installed vLLM, or None."""
    return profile_and_warning(installed_version())[1]


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
