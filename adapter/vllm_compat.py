"""The gate's one seam to vLLM internals that differ between releases (or may).

Everything in adapter/, outrate/ and tests/ that touches one of these internals goes through
this module; nothing else in the tree reads the fields in ``WRAPPED_FIELDS`` or branches on
the vLLM version (``tests/test_vllm_seam.py`` scans the sources). The reference scheduler and
its plugin have their own seam, ``reference/vllm_compat.py``. Each entry names the releases it
covers; a new release adds its case here (and its profile in ``spec/versions.py``).

Entries decide by what the installed vLLM has (a dataclass field, an attribute), never by
its version string, so an unsupported release runs wherever its API is one we know.

- ``scheduler_only_config`` (0.32.0, 0.33.0, 0.34.0): build a ``VllmConfig`` for an
  in-process scheduler on a CPU without triton-cpu. 0.34.0's CPU platform raises for that
  (0.32.0 and 0.33.0 only warn); docs/VLLM_VERSIONS.md says why skipping that one check is sound.
- ``model_runner_output`` (0.32.0, 0.33.0: ``req_id_to_index``; 0.34.0: none, vLLM indexes
  by ``req_ids``): a fabricated ``ModelRunnerOutput``.
- ``admitted_ids`` / ``resumed_ids`` (0.32.0, 0.33.0: ``CachedRequestData.resumed_req_ids``;
  0.34.0: a resumed request is re-sent in ``scheduled_new_reqs``): the requests a
  ``SchedulerOutput`` takes from waiting.
- ``prepare_engine_core`` (0.32.0; 0.33.0: ``reject_new_requests``; 0.34.0: also
  ``_deferred_inputs``): the attributes ``EngineCoreProc.__init__`` sets around its ZMQ
  handshake, for the gate's engine-wait world that builds the engine core without one.
- ``deferred_inputs`` (0.34.0: ``EngineCoreProc._deferred_inputs``; earlier: none): inputs an
  engine core took from its queue during a step and handles after it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections import deque
from collections.abc import Iterator
from typing import Any

SUPPORTED_RELEASES = ("0.32.0", "0.33.0", "0.34.0")
"""The releases every entry here covers (``spec.versions.SUPPORTED_VERSIONS`` is the source of truth
for the base model; ``tests/test_vllm_seam.py`` keeps the two equal)."""

WRAPPED_FIELDS = frozenset(
    {
        "req_id_to_index",  # ModelRunnerOutput, 0.32.0/0.33.0 only
        "resumed_req_ids",  # CachedRequestData, 0.32.0/0.33.0 only
        "_deferred_inputs",  # EngineCoreProc, 0.34.0
        "reject_new_requests",  # EngineCoreProc, 0.33.0+
        "HAS_TRITON",  # vllm.triton_utils, read by the CPU platform's config check
    }
)
"""vLLM names only this module (and ``reference/vllm_compat.py``) may read or set."""


# -- VllmConfig for an in-process scheduler (0.32.0, 0.33.0, 0.34.0) ---------------------------
@contextlib.contextmanager
def scheduler_only_config() -> Iterator[None]:
    """Inside this block, ``VllmConfig`` builds on a CPU without triton-cpu.

    vLLM's CPU platform (``CpuPlatform.check_and_update_config``) first checks that Triton
    is importable on x86: 0.32.0 and 0.33.0 log a warning, 0.34.0 raises ``RuntimeError``.
    Here, only while that method runs, ``vllm.triton_utils.HAS_TRITON`` reads True, so the
    check passes and every later line of the method (block size, async scheduling off,
    compilation settings, the worker class) runs as vLLM wrote it. The method reads the flag
    at that one place (0.34.0 ``vllm/platforms/cpu.py`` L239-243). Nothing here runs a
    kernel: the gate calls ``schedule()`` and ``update_from_output()`` with fabricated
    outputs. A no-op where Triton is importable or the platform is not the CPU one.
    Re-entrant; restores everything on exit.
    """
    import vllm.triton_utils as triton_utils  # deferred: vLLM costs ~7 s to import
    from vllm.platforms import current_platform  # deferred: vLLM costs ~7 s to import

    if triton_utils.HAS_TRITON or not current_platform.is_cpu():
        yield
        return
    platform_cls = type(current_platform)
    original = platform_cls.__dict__["check_and_update_config"]
    if getattr(original.__func__, "_outrate_scheduler_only", False):
        yield  # already inside an enclosing block
        return

    @functools.wraps(original.__func__)
    def check_and_update_config(cls, vllm_config):
        saved = triton_utils.HAS_TRITON
        triton_utils.HAS_TRITON = True
        try:
            return original.__func__(cls, vllm_config)
        finally:
            triton_utils.HAS_TRITON = saved

    check_and_update_config._outrate_scheduler_only = True  # type: ignore[attr-defined]
    platform_cls.check_and_update_config = classmethod(check_and_update_config)
    try:
        yield
    finally:
        platform_cls.check_and_update_config = original


# -- ModelRunnerOutput (0.32.0, 0.33.0: req_id_to_index; 0.34.0: none) -------------------------
@functools.cache
def _runner_output_fields() -> frozenset[str]:
    from vllm.v1.outputs import ModelRunnerOutput  # deferred: vLLM costs ~7 s to import

    return frozenset(f.name for f in dataclasses.fields(ModelRunnerOutput))


def model_runner_output(req_ids: list[str], sampled_token_ids: list[list[int]]) -> Any:
    """A fabricated ``ModelRunnerOutput``: ``sampled_token_ids[i]`` is what request
    ``req_ids[i]`` sampled (empty for a partial prefill chunk). 0.32.0/0.33.0 also take the
    index map ``req_id_to_index``; 0.34.0 indexes by position in ``req_ids``."""
    from vllm.v1.outputs import ModelRunnerOutput  # deferred: vLLM costs ~7 s to import

    extra: dict[str, Any] = {}
    if "req_id_to_index" in _runner_output_fields():
        extra["req_id_to_index"] = {r: i for i, r in enumerate(req_ids)}
    return ModelRunnerOutput(req_ids=list(req_ids), sampled_token_ids=sampled_token_ids, **extra)


# -- requests taken from waiting (0.32.0, 0.33.0: resumed_req_ids; 0.34.0: in new reqs) --------
def resumed_ids(scheduler_output: Any) -> list[str]:
    """Ids of preempted requests resumed in this step that are not in ``scheduled_new_reqs``
    (0.32.0/0.33.0: ``scheduled_cached_reqs.resumed_req_ids``; 0.34.0 re-sends them as new:
    always empty), sorted."""
    cached = scheduler_output.scheduled_cached_reqs
    return sorted(getattr(cached, "resumed_req_ids", ()) or ())


def admitted_ids(scheduler_output: Any) -> list[str]:
    """Ids a ``SchedulerOutput`` takes from waiting (new or resumed): the new requests in
    ``scheduled_new_reqs`` order, then the resumed ones (``resumed_ids``)."""
    new = [r.req_id for r in scheduler_output.scheduled_new_reqs]
    seen = set(new)
    return new + [r for r in resumed_ids(scheduler_output) if r not in seen]


# -- engine-core internals (0.32.0, 0.33.0, 0.34.0) ----------------------------------------------
def prepare_engine_core(engine: Any) -> None:
    """Set on an ``EngineCoreProc`` made with ``object.__new__`` the attributes its
    ``__init__`` sets around the ZMQ handshake that this release's loop reads:
    ``reject_new_requests`` (0.33.0+, pause/resume of new requests) and ``_deferred_inputs``
    (0.34.0, inputs taken during a step). Setting both on 0.32.0 is harmless (unread)."""
    engine.reject_new_requests = False
    engine._deferred_inputs = deque()


def deferred_inputs(engine: Any) -> int:
    """How many inputs ``engine`` took from its queue during a step and handles after it
    (0.34.0 ``_deferred_inputs``; 0 on releases without it)."""
    return len(getattr(engine, "_deferred_inputs", ()) or ())


def engine_core_handles_inputs_during_step() -> bool:
    """True if this release's ``EngineCore`` handles ADD/ABORT while a step runs, given a
    future that can poll (0.34.0: ``EngineCore._wait_for_output``)."""
    from vllm.v1.engine.core import EngineCore  # deferred: vLLM costs ~7 s to import

    return hasattr(EngineCore, "_wait_for_output")
