"""The reference's one seam to vLLM internals that differ between releases (or may).

The scheduler (``reference/scheduler.py``), its configuration checks (``reference/engine_checks.py``)
and its plugin's engine-loop hooks (``reference/plugin.py``, ``core_wait.py``) read the installed release and
the engine core's internals only through here; the gate has its own seam,
``adapter/vllm_compat.py``. Each entry names the releases it covers.

- ``INSTALLED_PROFILE`` (0.32.0, 0.33.0, 0.34.0): the ``spec/versions.py`` profile of the
  installed vLLM (the V6/V8 differences near the hooks, the local prefill cadence).
- ``ENGINE_STEP`` (0.32.0-0.34.0: ``EngineCoreProc._process_engine_step``): the method after
  which the R16 wait runs; ``INPUT_HANDLER`` (0.32.0-0.34.0: ``_handle_client_request``):
  where every input from the front end is handled, before a step or (0.34.0, with a polling
  future) during one.
- ``deferred_inputs`` (0.34.0: ``EngineCoreProc._deferred_inputs``; earlier: none): inputs taken
  from the queue during a step, handled at the next loop.
- ``idle_callbacks`` (0.32.0-0.34.0: ``_idle_state_callbacks``) and ``batch_queue``
  (0.32.0-0.34.0): read by the wait to know whether the engine may block.
"""

from __future__ import annotations

import functools
from typing import Any

import vllm

from vllm_output_rate.spec.versions import VllmVersionProfile, select_profile

ENGINE_STEP = "_process_engine_step"
INPUT_HANDLER = "_handle_client_request"
INPUTS_HANDLED = "_output_rate_inputs_handled"
"""The counter the reference keeps on an engine core: inputs handled so far (``count_inputs``)."""


def _installed_profile() -> VllmVersionProfile:
    return select_profile(vllm.__version__)[0]


INSTALLED_PROFILE: VllmVersionProfile = _installed_profile()
"""What the installed vLLM does where supported releases differ (an unsupported release gets
the nearest older profile; the gate warns about it)."""


def deferred_inputs(core: Any) -> int:
    """Inputs ``core`` took from its queue during a step and handles at the next loop
    (0.34.0 ``_deferred_inputs``; 0 where the release has none)."""
    try:
        return len(getattr(core, "_deferred_inputs", ()) or ())
    except TypeError:
        return 1  # an unknown layout: never wait over it


def inputs_handled(core: Any) -> int:
    """How many inputs ``core`` has handled so far (the counter ``count_inputs`` keeps)."""
    return getattr(core, INPUTS_HANDLED, 0)


def count_inputs(handler: Any) -> Any:
    """Wrap ``EngineCoreProc._handle_client_request`` so each call counts one input on the core."""

    @functools.wraps(handler)
    def counting(self, *args: Any, **kwargs: Any) -> Any:
        setattr(self, INPUTS_HANDLED, inputs_handled(self) + 1)
        return handler(self, *args, **kwargs)

    return counting


def idle_callbacks(core: Any) -> Any:
    """The engine core's pending idle-state callbacks (0.32.0-0.34.0), or None."""
    return getattr(core, "_idle_state_callbacks", None)


def batch_queue(core: Any) -> Any:
    """The engine core's queue of batches in flight (async scheduling, pipeline), or None."""
    return getattr(core, "batch_queue", None)
