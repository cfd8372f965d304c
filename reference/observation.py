"""Observation and metrics of the reference scheduler: what each step is seen to have done.

``StepObserver`` is the scheduler's collaborator for everything that reads a step and
never decides one: the white-box observation (docs/OBSERVATION.md, built from the step's
``StepRecord`` when first read), the engine-side event trace (``reference/trace.py``), the
/metrics snapshot (``reference/metrics.py``) and shadow mode (Decision "Shadow mode",
``reference/shadow.py``: the base class's schedule, then what would have been throttled).

Source: docs/SPEC.md "Decisions" (shadow mode), docs/OBSERVATION.md.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler

from vllm_output_rate.reference.metrics import MetricsRecorder
from vllm_output_rate.reference.oplog import ThrottleLog, log_limits
from vllm_output_rate.reference.residency import active_cap_of
from vllm_output_rate.reference.shadow import ShadowAccounting
from vllm_output_rate.reference.step_record import StepRecord
from vllm_output_rate.reference.trace import TraceWriter, rank_trace_path


class StepObserver:
    """The observation, trace, metrics and shadow accounting of one scheduler (``host``).

    ``trace``: the event trace (None unless ``trace_path``); ``metrics``: the /metrics
    recorder (None unless the front end set its directory); ``shadow``: the shadow
    accounting (shadow mode only); ``cache``: the last step's observation dict, once built.
    """

    def __init__(self, host: Any) -> None:
        self.host = host
        self.trace: TraceWriter | None = None
        self.metrics: MetricsRecorder | None = None
        self.shadow: ShadowAccounting | None = None
        self.cache: dict[str, Any] | None = None

    def open_metrics(self) -> None:
        """The /metrics snapshot, written once at start-up so the limits and the shadow flag
        show before the first request; None unless the front end set its directory."""
        host = self.host
        self.metrics = MetricsRecorder.from_env(host.output_rate_config)
        if self.metrics is not None:
            self.metrics.write(host.clock_ns())

    def open_trace(self, trace_path: str, **header: Any) -> None:
        """Open this engine's event trace (per data-parallel rank): its header names the
        class, the scheduling mode, the rates (tokens/s) and tau (ns) (``header``: more
        keys, e.g. ``shadow``)."""
        host = self.host
        cfg = host.output_rate_config
        self.trace = TraceWriter(
            rank_trace_path(trace_path, host.vllm_config),
            {
                "scheduler": type(host).__name__,
                "async_scheduling": isinstance(host, AsyncScheduler),
                "default_tokens_per_s": str(cfg.default_rate),
                "user_tokens_per_s": {u: str(r) for u, r in cfg.user_rates.items()},
                "burst_ns": cfg.burst_ns,
                **header,
            },
        )

    def start_shadow(self) -> None:
        """Shadow mode: a ``ShadowAccounting`` replays each step's sampling dispatches after
        vLLM's own ``schedule()``; the operator log, the metrics and the trace as with the
        feature on, marked shadow."""
        host = self.host
        cfg = host.output_rate_config
        self.shadow = ShadowAccounting(cfg, host._resolve_user)
        log_limits(type(host).__name__, cfg, active_cap_of(host, cfg), host.max_num_running_reqs)  # operator log
        host._engine_wait.throttle_log = ThrottleLog(self.shadow.limiter.rate_of, shadow=True)
        self.open_metrics()
        if cfg.trace_path is not None:
            self.open_trace(cfg.trace_path, shadow=True)

    def shadow_step(self, now_ns: int, scheduler_output: Any) -> None:
        """Shadow mode, after the base class's ``schedule()``: replay the step's sampling
        dispatches through the shadow limiter at ``now_ns`` (R16); the would-be throttled
        requests go to the operator log, the metrics and the trace."""
        host, shadow = self.host, self.shadow
        assert shadow is not None, "shadow mode is set up by start_shadow"
        would = shadow.step(now_ns, scheduler_output, host.requests)
        host._engine_wait.log_step(now_ns, would, shadow.users)  # operator log: would-be throttled
        if self.metrics is not None:  # /metrics: every dispatch granted, would-be throttles counted
            self.metrics.step(now_ns, shadow.step_dispatches, would, shadow.users.get, (), shadow.limiter)
        if self.trace is not None:
            self.trace_shadow_step(now_ns, scheduler_output, would)

    def trace_shadow_step(self, now_ns: int, scheduler_output: Any, would: list[str]) -> None:
        """One shadow-mode trace line: ``charges`` are the shadow limiter's grants, and
        ``would_throttle`` lists the dispatches an enforcing scheduler would have refused."""
        host, shadow, trace = self.host, self.shadow, self.trace
        assert shadow is not None and trace is not None, "called by shadow_step with the trace on"
        granted, would_set = set(shadow.last_granted), set(would)
        requests: dict[str, dict[str, Any]] = {}
        for rid, tokens in scheduler_output.num_scheduled_tokens.items():
            request = host.requests.get(rid)
            sampled = request is not None and not request.is_prefill_chunk
            requests[rid] = {
                "user": shadow.user(rid, host.requests),
                "tokens": tokens,
                "sampled": sampled,
                "charged": rid in granted,
                "refunded": False,
                "throttled": False,
                "would_throttle": rid in would_set,
            }
        trace.write_step(
            shadow.steps - 1,
            now_ns,
            requests,
            shadow.last_granted,
            [],
            sorted(scheduler_output.preempted_req_ids),
            len(host.running),
            len(host.waiting),
            len(shadow.limiter),
            extra={"would_throttle": would, **_stated(trace.new_user_rates(requests, shadow.limiter.rate_of))},
        )

    def step_done(self, step: StepRecord, scheduler_output: Any, would: Any) -> None:
        """The feature on, after the step: the /metrics snapshot (granted, throttled and R29's
        would-be throttled, refunded; at most once per second) and the trace line."""
        host = self.host
        self.cache = None  # the observation dict is built only when read
        if self.metrics is not None:
            cache = host._limits.users
            refunded = step.refunded
            self.metrics.step(
                step.now_ns,
                step.taken,
                step.throttled.union(would) if would else step.throttled,  # R29: would-be throttles too
                cache.get,
                map(cache.get, refunded) if refunded else (),
                host.rate_limiter,
            )
        if self.trace is not None:
            self.trace_step(step, scheduler_output)

    def trace_step(self, step: StepRecord, scheduler_output: Any) -> None:
        """One trace line from this step's own data (charges, refunds, throttled, batch)."""
        host = self.host
        trace, limiter, limits = self.trace, host.rate_limiter, host._limits
        assert trace is not None and limiter is not None, "called by schedule() with the trace on"
        scheduled = scheduler_output.num_scheduled_tokens
        charged = [r.request_id for r in step.charged]
        refunded = step.refunded
        charged_set, refunded_set, throttled = set(charged), set(refunded), step.throttled
        requests: dict[str, dict[str, Any]] = {}
        for rid in [*scheduled, *charged, *sorted(throttled)]:
            if rid in requests:
                continue
            request = host.requests.get(rid)
            tokens = scheduled.get(rid, 0)
            user = limits.users.get(rid)
            if user is None and request is not None:
                user = limits.user(request)
            requests[rid] = {
                "user": user,
                "tokens": tokens,
                "sampled": tokens > 0 and request is not None and not request.is_prefill_chunk,
                "charged": rid in charged_set,
                "refunded": rid in refunded_set,
                "throttled": rid in throttled,
            }
        trace.write_step(
            host._steps - 1,
            step.now_ns,
            requests,
            charged,
            refunded,
            sorted(scheduler_output.preempted_req_ids),
            len(host.running),
            len(host.waiting),
            len(limiter),
            extra=_stated(trace.new_user_rates(requests, limiter.rate_of)),
        )

    def freed(self, request: Any) -> None:
        """A request left the scheduler: shadow mode forgets its user; the trace notes it."""
        if self.shadow is not None and self.host.rate_limiter is None:
            self.shadow.freed(request.request_id)
        if self.trace is not None:
            self.trace.note_freed(request.request_id, request.status.name, request.num_output_tokens)

    def rates_changed(self, now_ns: int, table: Any, limiter: Any) -> None:
        """R21: the metrics' limit gauges get the table's labels (bounded series) and the
        trace notes the change at ``now_ns`` with ``limiter``'s users."""
        if self.metrics is not None:
            self.metrics.rates_changed(table)
        if self.trace is not None:
            self.trace.rates_changed(now_ns, table, limiter.users())

    def note_if_idle(self) -> None:
        """No request left (after outputs or a finish): mark the trace idle and write the
        metrics snapshot (exact counters while idle), each only if it is on."""
        host = self.host
        if host.requests:
            return
        if self.trace is not None:
            self.trace.idle(host.clock_ns())
        metrics, shadow = self.metrics, self.shadow
        if metrics is not None:
            limiter = host.rate_limiter if host.rate_limiter is not None or shadow is None else shadow.limiter
            metrics.write(host.clock_ns(), limiter)

    def last_step_observation(self) -> dict[str, Any] | None:
        """The white-box observation of the last ``schedule()`` (docs/OBSERVATION.md).

        Built on first read after a step, from the step's record and the limiter state
        (``update_from_output`` never touches the limiter, so it is the state the step left).
        """
        host = self.host
        observed = host._engine_wait.observed
        limiter = host.rate_limiter
        if limiter is None or observed is None:
            return None
        if self.cache is None:
            self.cache = {
                "now_ns": observed.now_ns,
                "charged": [r.request_id for r in observed.charged],
                "refunded": observed.refunded,
                "throttled": sorted(observed.throttled),
                "wait_hint_ns": observed.wait_hint_ns,
                "tat_ns": {u: limiter.tat_ns(u) for u in limiter.users()},
            }
        return self.cache

    def close(self) -> None:
        """Engine shutdown: close the trace."""
        if self.trace is not None:
            self.trace.close()


def _stated(user_rates: dict[str, str]) -> dict[str, Any]:
    """A step line's ``user_rates`` key (``TraceWriter.new_user_rates``), only when it states one."""
    return {"user_rates": user_rates} if user_rates else {}
