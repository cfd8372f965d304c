"""What the vLLM plugins' hooks (``reference/plugin.py``, ``core_wait.py``, ``worker_park.py``,
``metrics.py``'s stat logger) share.

``feature_on``: whether a ``VllmConfig`` turns the output-rate feature on (R18: an
``output_rate`` section with a default rate); every hook does nothing otherwise.
``OUR_WRAPPERS``: the wrappers installed over vLLM functions, so that a second install is
a no-op. Imports nothing of vLLM.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

# The wrappers the plugin installed over vLLM functions (so that a second install is a no-op).
OUR_WRAPPERS: weakref.WeakSet[Callable[..., Any]] = weakref.WeakSet()


def feature_on(vllm_config) -> bool:
    """R18: ``vllm_config`` has an ``output_rate`` section with a default rate (the feature is on)."""
    additional = getattr(vllm_config, "additional_config", None)
    section = additional.get("output_rate") if isinstance(additional, dict) else None
    return isinstance(section, dict) and section.get("default_tokens_per_s") is not None
