"""Drive a real vLLM V1 scheduler in-process: fake clock, fabricated model outputs.

``Harness`` builds any scheduler class (by dotted path) on a CPU-only ``VllmConfig`` for
the project's tiny local model, adds requests tagged with ``extra_args["output_rate_user"]``,
runs steps (``schedule()`` then ``update_from_output()`` with one fabricated token per
sampling request; in async mode one step stays in flight), and returns a ``StepTrace`` per
step built only from what vLLM itself exposes (``SchedulerOutput`` and
``EngineCoreOutputs``).

Clock injection. The gate owns time. Every ``schedule()`` call runs with the fake clock
installed in two ways: (1) a scheduler that exposes ``clock_ns`` (the reference does, see
docs/OBSERVATION.md) gets ``scheduler.clock_ns = harness.clock.now_ns``; (2) for any other
class, ``time.monotonic_ns``, ``time.monotonic``, ``time.perf_counter`` and ``time.time``
are patched for the duration of the call, so a third-party scheduler reading any of them
sees the fake time.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from vllm_output_rate.adapter.candidate_import import import_named_module
from vllm_output_rate.adapter.configstyle import AdditionalConfigStyle
from vllm_output_rate.adapter.engine_shape import EngineShape, build_kv_cache_config
from vllm_output_rate.adapter.modes import check_not_refused
from vllm_output_rate.adapter.tinymodel import EOS_TOKEN_ID
from vllm_output_rate.adapter.vllm_compat import admitted_ids, model_runner_output

REFERENCE_SCHEDULER = "vllm_output_rate.reference.scheduler.RateLimitedScheduler"
REFERENCE_ASYNC_SCHEDULER = "vllm_output_rate.reference.scheduler.RateLimitedAsyncScheduler"
STOCK_SCHEDULER = "vllm.v1.core.sched.scheduler.Scheduler"
STOCK_ASYNC_SCHEDULER = "vllm.v1.core.sched.async_scheduler.AsyncScheduler"
NON_EOS_TOKEN_ID = 7  # any token id that is not EOS
MAX_STEPS = 100_000  # bound on one harness's life (TigerBeetle style)


class FakeClock:
    """A monotonic clock in integer ns that only moves when told to."""

    def __init__(self, start_ns: int = 0) -> None:
        assert start_ns >= 0
        self._now_ns = start_ns

    def now_ns(self) -> int:
        return self._now_ns

    def advance(self, delta_ns: int) -> None:
        """Move time forward by ``delta_ns`` >= 0."""
        assert delta_ns >= 0, f"the clock never goes back, got delta {delta_ns}"
        self._now_ns += delta_ns


@contextlib.contextmanager
def patched_time(clock: FakeClock) -> Iterator[None]:
    """Make the ``time`` module's clocks read ``clock`` (for schedulers without ``clock_ns``)."""
    saved = (time.monotonic_ns, time.monotonic, time.perf_counter, time.time)
    time.monotonic_ns = clock.now_ns
    time.monotonic = lambda: clock.now_ns() / 1e9
    time.perf_counter = time.monotonic
    time.time = time.monotonic
    try:
        yield
    finally:
        time.monotonic_ns, time.monotonic, time.perf_counter, time.time = saved


@dataclass
class StepTrace:
    """What one step did, as vLLM exposes it.

    ``scheduled``: request id -> num_scheduled_tokens, in ``SchedulerOutput`` order.
    ``sampled``: ids dispatched in a step in which they sample (R7 "sampling dispatch").
    ``finished``: request id -> (finish reason, number of output tokens) for requests whose
    final output arrived in this step's ``update_from_output``.
    ``chunk_start``: request id -> ``num_computed_tokens`` where its scheduled chunk starts,
    as ``SchedulerOutput`` gives it (``NewRequestData`` / ``CachedRequestData``): a prefix-cache
    hit shows as a first chunk starting above 0.
    ``white``: the scheduler's own observation of the step, if it exposes one.
    """

    step: int
    now_ns: int
    scheduled: dict[str, int]
    sampled: list[str]
    preempted: list[str]
    finished: dict[str, tuple[str, int]] = field(default_factory=dict)
    admitted: list[str] = field(default_factory=list)  # new or resumed from waiting this step
    num_running: int = 0  # len(scheduler.running) after schedule()
    chunk_start: dict[str, int] = field(default_factory=dict)
    white: dict[str, Any] | None = None


def _chunk_starts(so: Any) -> dict[str, int]:
    """Request id -> ``num_computed_tokens`` at the start of its chunk in ``so``."""
    starts = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
    cached = so.scheduled_cached_reqs
    starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=False))
    return starts


def load_class(dotted: str) -> type:
    """Import ``pkg.module.ClassName``.

    Raises:
        ValueError: the path has no dot, uses ``:``, or does not name a class.
        ModuleNotFoundError: ``pkg.module`` (or a package above it) is not on the import path.
        CandidateImportError: ``pkg.module`` raised while it was imported (an ``ImportError``
            naming the module and the exception; ``candidate_import.import_named_module``).
    """
    if ":" in dotted or "." not in dotted:
        raise ValueError(f"scheduler class must be a dotted path pkg.module.ClassName, got {dotted!r}")
    module_name, _, cls_name = dotted.rpartition(".")
    module = import_named_module(module_name)
    cls = getattr(module, cls_name, None)
    if not isinstance(cls, type):
        raise ValueError(f"{dotted!r} does not name a class in module {module_name!r}")
    return cls


_HASH_READY = False


def _block_hasher(block_size: int):
    global _HASH_READY
    from vllm.utils.hashing import sha256  # deferred: vLLM costs ~7 s to import
    from vllm.v1.core.kv_cache_utils import (  # deferred: vLLM costs ~7 s to import
        get_request_block_hasher,
        init_none_hash,
    )

    if not _HASH_READY:
        init_none_hash(sha256)
        _HASH_READY = True
    return get_request_block_hasher(block_size, sha256)


def _json_rate(rate: Fraction) -> int | float:
    """A rate as the JSON number that is read back as exactly ``rate`` (R3)."""
    rate = Fraction(rate)
    if rate.denominator == 1:
        return int(rate)
    value = float(rate)
    if Fraction(repr(value)) != rate:
        raise ValueError(f"rate {rate} has no exact short decimal form")
    return value


class Harness:
    """One real scheduler under the gate's control.

    Args:
        scheduler_cls: dotted path of the class under test.
        shape: engine configuration.
        clock: the fake clock (a new one at 0 ns if omitted).
        style: how the rates reach the class (``adapter.configstyle.ConfigStyle``); default
            ``AdditionalConfigStyle`` (``additional_config["output_rate"]``).
    Raises:
        ValueError: bad class path; a shape the style cannot express; whatever the class
            raises for the config.
        adapter.modes.ModeRefused: the shape uses a mode refused in the running gate.
    """

    def __init__(
        self, scheduler_cls: str, shape: EngineShape, clock: FakeClock | None = None, style: Any = None
    ) -> None:
        from vllm.v1.structured_output import StructuredOutputManager  # deferred: vLLM costs ~7 s to import

        check_not_refused(shape)  # a mode the candidate refused at start-up: no scenario (adapter/modes.py)
        self.shape = shape
        self.clock = clock or FakeClock()
        self.cls_path = scheduler_cls
        self.style = style if style is not None else AdditionalConfigStyle()
        cls = load_class(scheduler_cls)
        vllm_config = self.style.build_vllm_config(shape)
        with patched_time(self.clock):
            self.scheduler = cls(
                vllm_config=vllm_config,
                kv_cache_config=build_kv_cache_config(shape),
                structured_output_manager=StructuredOutputManager(vllm_config),
                block_size=shape.block_size,
                log_stats=False,
            )
        if hasattr(self.scheduler, "clock_ns"):
            self.scheduler.clock_ns = self.clock.now_ns
        self._hasher = _block_hasher(shape.block_size)
        self._eos_index: dict[str, int | None] = {}
        self.users: dict[str, str] = {}  # request id -> R17 user, as the gate sees it
        self.num_outputs: dict[str, int] = {}
        self.finished: dict[str, tuple[str, int]] = {}
        self._in_flight: tuple[Any, Any] | None = None  # async: (SchedulerOutput, ModelRunnerOutput) in flight
        self._out_index: dict[str, int] = {}  # request id -> next output index to fabricate
        self.step_index = 0

    # -- events ---------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        user: Any = None,
        prompt_len: int = 4,
        max_tokens: int = 16,
        eos_index: int | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        lora: int = 0,
        sampling_params: Any = None,
    ) -> None:
        """Add a request; ``user`` None means no ``output_rate_user`` (anonymous).

        ``eos_index``: the 0-based output index at which the fabricated model emits EOS.
        ``lora``: the LoRA adapter id (``LoRARequest.lora_int_id``; 0: the base model).
        ``sampling_params``: a ``SamplingParams`` used as given instead of one built from
        ``user`` and ``max_tokens`` (n > 1: vLLM's children share one,
        ``adapter/scenario_run.parallel_children``).
        """
        from vllm import SamplingParams  # deferred: vLLM costs ~7 s to import
        from vllm.lora.request import LoRARequest  # deferred: vLLM costs ~7 s to import
        from vllm.v1.request import Request  # deferred: vLLM costs ~7 s to import

        params = sampling_params
        if params is None:
            extra = None if user is None else {"output_rate_user": user}
            params = SamplingParams(max_tokens=max_tokens, extra_args=extra)
            params.update_from_generation_config({}, eos_token_id=EOS_TOKEN_ID)
        request = Request(
            request_id=request_id,
            prompt_token_ids=[NON_EOS_TOKEN_ID + 1 + (i % 50) for i in range(prompt_len)],
            sampling_params=params,
            pooling_params=None,
            arrival_time=arrival_time if arrival_time is not None else float(len(self._eos_index)),
            priority=priority,
            block_hasher=self._hasher,
            lora_request=LoRARequest(f"lora{lora}", lora, f"/lora-{lora}-never-read") if lora else None,
        )
        self._eos_index[request_id] = eos_index
        self.users[request_id] = user if isinstance(user, str) else "__anonymous__"
        self.num_outputs[request_id] = 0
        self.scheduler.add_request(request)

    def abort(self, request_id: str) -> None:
        """Abort a request as the API server does on a client disconnect."""
        from vllm.v1.request import RequestStatus  # deferred: vLLM costs ~7 s to import

        self.scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)
        if request_id not in self.finished and request_id in self.num_outputs:
            self.finished[request_id] = ("abort", self.num_outputs[request_id])

    def advance(self, delta_ns: int) -> None:
        self.clock.advance(delta_ns)

    def change_rates(self, default_rate: Fraction, user_rates: Iterable[tuple[str, Fraction]]) -> None:
        """R21: replace the candidate's rate table through its rates file
        (``output_rate.rates_file`` of the shape), written atomically (a temporary file
        renamed over it); the candidate picks it up at the start of its next ``schedule()``.

        Raises:
            ValueError: the shape has no ``rates_file``, or a rate has no exact decimal form.
        """
        path = (self.shape.output_rate or {}).get("rates_file")
        if not path:
            raise ValueError("change_rates needs output_rate.rates_file in the engine shape (R21)")
        table = {
            "default_tokens_per_s": _json_rate(default_rate),
            "user_tokens_per_s": {u: _json_rate(r) for u, r in user_rates},
        }
        temporary = f"{path}.{self.step_index}.tmp"
        with open(temporary, "w", encoding="utf-8") as handle:
            json.dump(table, handle)
        os.replace(temporary, path)

    # -- steps ----------------------------------------------------------------
    def _schedule(self):
        with patched_time(self.clock):
            return self.scheduler.schedule()

    def _sampling_ids(self, so) -> list[str]:
        """Ids in ``so`` whose scheduled tokens reach their sampling position."""
        sampled = []
        for req_id in so.num_scheduled_tokens:
            request = self.scheduler.requests.get(req_id)
            if request is not None and not request.is_prefill_chunk:
                sampled.append(req_id)
        return sampled

    def _model_output(self, so, sampled: list[str]):
        req_ids = list(so.num_scheduled_tokens)
        tokens: list[list[int]] = []
        sampled_set = set(sampled)
        for req_id in req_ids:
            if req_id not in sampled_set:
                tokens.append([])
                continue
            index = self._out_index.get(req_id, self.num_outputs.get(req_id, 0))
            eos = self._eos_index.get(req_id)
            tokens.append([EOS_TOKEN_ID if eos is not None and index == eos else NON_EOS_TOKEN_ID])
            self._out_index[req_id] = index + 1
        return model_runner_output(req_ids, tokens)

    def _update(self, so, mro, trace: StepTrace) -> None:
        with patched_time(self.clock):
            outputs = self.scheduler.update_from_output(so, mro)
        for eco in outputs.values():
            for out in eco.outputs:
                self.num_outputs[out.request_id] = self.num_outputs.get(out.request_id, 0) + len(out.new_token_ids)
                if out.finish_reason is not None and out.request_id not in self.finished:
                    reason = str(out.finish_reason)
                    self.finished[out.request_id] = (reason, self.num_outputs[out.request_id])
                    trace.finished[out.request_id] = self.finished[out.request_id]

    def step(self) -> StepTrace:
        """Run one scheduling step; in async mode deliver the previous step's output after.

        Returns the trace of the step just scheduled (its ``finished`` holds what the
        delivered output finished).
        """
        assert self.step_index < MAX_STEPS, "harness step bound reached"
        so = self._schedule()
        sampled = self._sampling_ids(so)
        mro = self._model_output(so, sampled)
        trace = StepTrace(
            step=self.step_index,
            now_ns=self.clock.now_ns(),
            scheduled=dict(so.num_scheduled_tokens),
            sampled=sampled,
            preempted=sorted(so.preempted_req_ids),
            admitted=admitted_ids(so),
            num_running=len(self.scheduler.running),
            chunk_start=_chunk_starts(so),
        )
        observe = getattr(self.scheduler, "last_step_observation", None)
        if observe is not None:
            trace.white = observe
        self.step_index += 1
        if self.shape.async_scheduling:
            previous, self._in_flight = self._in_flight, (so, mro)
            if previous is not None:
                self._update(previous[0], previous[1], trace)
        else:
            self._update(so, mro, trace)
        return trace

    def drain(self) -> StepTrace | None:
        """Async mode: deliver the in-flight output without scheduling a new step."""
        if self._in_flight is None:
            return None
        so, mro = self._in_flight
        self._in_flight = None
        trace = StepTrace(step=self.step_index, now_ns=self.clock.now_ns(), scheduled={}, sampled=[], preempted=[])
        self._update(so, mro, trace)
        return trace
