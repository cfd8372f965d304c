"""Probing a candidate's engine modes (``adapter/modes.py``, docs/SPEC.md "Modes a patch
refuses"): ``probe`` builds the candidate once per engine mode the rows use, with the
feature on, and runs ``PROBE_STEPS`` steps of two users' requests in that mode (``n>1``:
children of one parallel-sampling request, added as vLLM's front end adds them); a refused
mode is probed again with the feature off, a crash again on stock vLLM. The result is the
candidate's mode matrix (``modes.ModeStatus`` per mode).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from vllm_output_rate.adapter.engine_shape import EngineShape
from vllm_output_rate.adapter.harness import NON_EOS_TOKEN_ID, STOCK_ASYNC_SCHEDULER, STOCK_SCHEDULER, Harness
from vllm_output_rate.adapter.modes import CRASHED, MODES, REFUSED, SUPPORTED, UNAVAILABLE, ModeStatus
from vllm_output_rate.adapter.tinymodel import EOS_TOKEN_ID

PROBE_STEPS = 4
PROBE_RATES = {"default_tokens_per_s": 10, "user_tokens_per_s": {"probe-b": 20}}  # integer rates: every style
# A candidate's bug, not a statement of scope, when raised while it is built.
PROGRAMMING_ERRORS = (
    AssertionError,
    AttributeError,
    TypeError,
    NameError,
    KeyError,
    IndexError,
    ZeroDivisionError,
    RecursionError,
)


def _text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _clean(exc: BaseException) -> bool:
    """A refusal: an ``Exception`` that is no programming error and says something."""
    return isinstance(exc, Exception) and not isinstance(exc, PROGRAMMING_ERRORS) and bool(str(exc).strip())


def _base_shape(feature_on: bool = True):
    return EngineShape(max_num_seqs=4, num_blocks=256, output_rate=dict(PROBE_RATES) if feature_on else None)


def _smoke(harness: Any, mode: str) -> None:
    """Two users' requests (one more on adapter 1 in ``lora``, priorities 0 and 1 in
    ``priority``), then ``PROBE_STEPS`` steps."""
    harness.add_request("probe-a0", "probe-a", prompt_len=20, max_tokens=3, priority=0)
    harness.add_request("probe-b0", "probe-b", prompt_len=20, max_tokens=3, priority=int(mode == "priority"))
    if mode == "lora":
        harness.add_request("probe-l0", "probe-a", prompt_len=20, max_tokens=3, lora=1)
    _steps(harness)


def _steps(harness: Any) -> None:
    """``PROBE_STEPS`` steps, then the in-flight output delivered (async)."""
    for _ in range(PROBE_STEPS):
        harness.step()
    harness.drain()


def _add_children(harness: Any, parent_id: str, user: str, n: int) -> None:
    """Add ``n`` children of one parallel-sampling request the way vLLM's front end does
    (``vllm.v1.engine.parallel_sampling.ParentRequest``: one ``SamplingParams`` copied once
    with ``n=1``, shared by every child), with ``Harness.add_request``'s prompt and EOS."""
    from vllm import SamplingParams  # deferred: vLLM costs ~7 s to import
    from vllm.v1.request import Request  # deferred: vLLM costs ~7 s to import

    parent = SamplingParams(n=n, max_tokens=3, extra_args={"output_rate_user": user})
    parent.update_from_generation_config({}, eos_token_id=EOS_TOKEN_ID)
    shared = copy.copy(parent)
    shared.n = 1
    for index in range(n):
        rid = f"{index}_{parent_id}"
        request = Request(
            request_id=rid,
            prompt_token_ids=[NON_EOS_TOKEN_ID + 1 + i for i in range(8)],
            sampling_params=shared,
            pooling_params=None,
            arrival_time=float(index),
            block_hasher=harness._hasher,
        )
        harness.users[rid] = user
        harness.num_outputs[rid] = 0
        harness._eos_index[rid] = None
        harness.scheduler.add_request(request)


def _attempt(cls: str, shape: Any, style: Any, mode: str) -> tuple[str, str]:
    """Build ``cls`` on ``shape`` and run the smoke steps: ``(status, message)``."""
    try:
        harness = Harness(cls, shape, style=style)
    except Exception as exc:  # construction: the candidate's statement of scope, or its bug
        return (REFUSED if _clean(exc) else CRASHED), _text(exc)
    try:
        if mode == "n>1":
            try:
                _add_children(harness, "probe-n", "probe-b", 2)
            except Exception as exc:  # the children refused as they are added: the front end's refusal
                return (REFUSED if _clean(exc) else CRASHED), _text(exc)
            harness.add_request("probe-a0", "probe-a", prompt_len=20, max_tokens=3)
            _steps(harness)
        else:
            _smoke(harness, mode)
    except Exception as exc:  # after construction: a crash
        return CRASHED, _text(exc)
    return SUPPORTED, ""


def probe_mode(options: Any, mode: str) -> ModeStatus:
    """The mode matrix row of ``mode`` for the run ``options`` (``gate_row.GateOptions``):
    the candidate (the async class for ``async``, else the sync class) built with the
    feature on in that mode, its smoke steps run (module docstring)."""
    is_async = mode == "async"
    cls = options.async_scheduler_cls if is_async else options.scheduler_cls
    required = mode in options.require_modes
    if cls is None:
        return ModeStatus(mode, UNAVAILABLE, "no --async-scheduler-cls given", required=required)
    shape = MODES[mode].shape(_base_shape())
    status, message = _attempt(cls, shape, options.style, mode)
    row = ModeStatus(mode, status, message, required=required)
    if status == REFUSED:
        off_status, off_message = _attempt(cls, replace(shape, output_rate=None), options.style, mode)
        row.feature_off = off_message if off_status != SUPPORTED else None
    if status == CRASHED:  # counted only if stock vLLM runs the same probe
        stock = STOCK_ASYNC_SCHEDULER if is_async else STOCK_SCHEDULER
        stock_status, stock_message = _attempt(stock, replace(shape, output_rate=None), None, mode)
        if stock_status != SUPPORTED:
            row.status, row.message = UNAVAILABLE, f"stock vLLM fails the same probe too ({stock_message})"
    return row


def probe(options: Any, modes: Iterable[str]) -> dict[str, ModeStatus]:
    """The candidate's mode matrix: ``probe_mode`` for every mode in ``modes`` and every
    mode the run requires (``options.require_modes``), in ``MODES`` order."""
    wanted = set(modes) | set(options.require_modes)
    return {name: probe_mode(options, name) for name in MODES if name in wanted}
