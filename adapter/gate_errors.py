"""Telling the candidate's errors from the gate's own: ``reraise_gate_error`` lets an error
raised in the gate's code (adapter/, spec/) end the run instead of being reported as the
candidate's failure, and ``exception_text`` names an exception of the class under test
(a bare ``assert`` by the line that raised it).
"""

from __future__ import annotations

import traceback


def exception_text(exc: BaseException) -> str:
    """``Type: message`` of an exception of the class under test (or of vLLM inside it); a
    bare ``assert`` (no message) is named by the line that raised it, e.g. ``AssertionError
    at vllm/v1/core/sched/scheduler.py:897: assert len(scheduled_loras) <=
    self.lora_config.max_loras``."""
    text = str(exc).strip()
    if text:
        return f"{type(exc).__name__}: {text}"
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return type(exc).__name__
    last = frames[-1]
    where = last.filename.rpartition("site-packages/")[2] if "site-packages/" in last.filename else last.filename
    return f"{type(exc).__name__} at {where}:{last.lineno}: {last.line}"


def reraise_gate_error(exc: Exception) -> None:
    """Re-raise ``exc`` if it was raised by the gate's own code (adapter/, spec/), not by the
    class under test, vLLM, or the candidate's configuration: a gate bug must never be
    reported as the candidate's failure."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = frames and any(
        part in frames[-1].filename
        for part in ("/adapter/", "/spec/", "vllm_output_rate/adapter", "vllm_output_rate/spec")
    )
    if ours and "configstyle" not in frames[-1].filename:  # a style that cannot express the scenario is a finding
        raise exc
