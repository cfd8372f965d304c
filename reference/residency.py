"""The active cap and residency of the reference scheduler: who may be in a step's batch.

``Residency`` is the scheduler's collaborator for R12 (with the feature on,
``max_num_active_seqs`` means requests in a step's batch; throttled requests do not
count), R20 (``max_num_seqs_per_user``: resident requests one user may hold), R10's
waiting requests of a refused user, and V8's count of LoRA adapters against ``max_loras``
(the throttled requests keep their slot, R11). ``lora_id`` is the pure piece.

Source: docs/SPEC.md R10, R12, R13 (LoRA), R20, "vLLM versions" (V8).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from vllm_output_rate.reference.section import OutputRateConfig
from vllm_output_rate.reference.step_record import StepRecord


def lora_id(request: Any) -> int:
    """V8: the request's LoRA adapter id (0: the base model)."""
    lora = request.lora_request
    return lora.lora_int_id if lora is not None and lora.lora_int_id > 0 else 0


def active_cap_of(host: Any, cfg: OutputRateConfig) -> int:
    """R12: the active cap A (requests in a step's batch) of ``host`` under ``cfg``: the
    feature's ``max_num_active_seqs``, else vLLM's, else ``max_num_seqs``; at most that."""
    return min(
        cfg.max_num_active_seqs or host.scheduler_config.max_num_active_seqs or host.max_num_running_reqs,
        host.max_num_running_reqs,
    )


class Residency:
    """R12, R20, V8: the caps on one scheduler's (``host``) batch and residents.

    ``active_cap``: A (R12; the admission cap ``_RateLimitMixin.max_num_active_reqs``
    reads it with the step's throttled count); ``cap_binds``: A below ``max_num_seqs`` (only then is the set
    of running requests given tokens kept); ``per_user_cap``: R20's cap, None: no cap.
    """

    def __init__(self, host: Any, cfg: OutputRateConfig) -> None:
        self.host = host
        self.active_cap = active_cap_of(host, cfg)
        self.cap_binds = self.active_cap < host.max_num_running_reqs
        self.per_user_cap: int | None = cfg.max_num_seqs_per_user

    def below_cap(self, step: StepRecord, request: Any) -> bool:
        """R20: ``request``'s user holds fewer than ``max_num_seqs_per_user`` running requests.

        Counted over ``running`` at the first waiting request vLLM's waiting loop looks at in
        this step, then kept up to date with the requests the loop admits (vLLM only appends
        to ``running`` there; nothing is removed once the waiting loop runs). O(running) once
        per step, O(1) per waiting request.
        """
        running = self.host.running
        user_of = self.host._limits.user
        resident = step.resident
        if resident is None:
            resident = step.resident = Counter(map(user_of, running))
        else:
            for admitted in running[step.resident_seen :]:
                resident[user_of(admitted)] += 1
        step.resident_seen = len(running)
        cap = self.per_user_cap
        assert cap is not None, "called only with the R20 cap set"
        return resident[user_of(request)] < cap

    def refused_may_proceed(self, request: Any) -> bool:
        """R10: a refused user's waiting request proceeds only if it can prefill without
        sampling; otherwise it is skipped and later waiting requests are still admitted."""
        host = self.host
        if not host.scheduler_config.enable_chunked_prefill:
            return False
        if not host.vllm_profile.zero_token_waiting_stops_admission:
            # V8 (0.33): the 0 tokens the refusal gives it at the last cap skip just this request.
            return True
        # V8 (0.32): a waiting request given 0 tokens there would stop admission of every
        # later one, so one that can only sample is skipped here, before it is sized.
        num_computed_tokens = request.num_computed_tokens
        if num_computed_tokens == 0:
            # R10: a fresh admission starts at its prefix-cache hit, which vLLM caps at
            # num_tokens - 1 and so can leave only the sampling token: look it up as vLLM
            # is about to (a side-effect-free lookup).
            num_computed_tokens = host._get_local_prefix_cache_hit(request)[1]
        return num_computed_tokens < request.num_tokens - 1

    def counted_loras(self) -> set[int]:
        """V8 (+ R11): the adapters the waiting loop counts against ``max_loras`` (spec
        ``scheduler.counted_loras``): on vLLM 0.33 those of every running request; on 0.32
        those of the running requests scheduled or throttled in this step and of those
        admitted so far.

        That is every running request but one vLLM's running loop skips because it is done
        once the output in flight arrives (async): its placeholders already carry it to
        ``max_tokens`` (V3), or it has no room left below ``max_model_len`` (V4: given 0
        tokens); it is never scheduled again. Throttled requests count (R11: resident,
        they keep their adapter's slot); vLLM 0.32 alone counts only the scheduled ones.
        """
        host = self.host
        counted = set()
        every = host.vllm_profile.loras_counted_over_all_running  # V8 (0.33): every running request counts
        room_end = host.max_model_len - host.num_sampled_tokens_per_step
        for r in host.running:
            lora = lora_id(r)
            if every and lora:
                counted.add(lora)
                continue
            if not lora or r.num_computed_tokens >= room_end:
                continue  # V4: no room left, it finishes on its output in flight
            if r.num_output_placeholders > 0 and (
                r.num_computed_tokens + 2 - r.num_output_placeholders >= r.num_prompt_tokens + r.max_tokens
            ):
                continue  # V3: its placeholders already reach max_tokens
            counted.add(lora)
        return counted

    def lora_would_exceed(self, request: Any) -> bool:
        """V8, LoRA: admitting ``request`` would make the counted adapters exceed ``max_loras``.

        vLLM 0.32 counts only the LoRAs of running requests scheduled in this step, so a
        throttled request's LoRA (R11: resident but not scheduled) would not count, a new LoRA
        would be admitted beside it, and the step that serves both would exceed
        ``max_loras`` (vLLM's assertion). Counted here with the throttled ones
        (``counted_loras``); vLLM 0.33 counts every running request itself.
        """
        lora = lora_id(request)
        lora_config = self.host.lora_config
        if lora_config is None or not lora:
            return False
        counted = self.counted_loras()
        return lora not in counted and len(counted) >= lora_config.max_loras

    def takes_new_lora_slot(self, request: Any) -> bool:
        """R13, LoRA: ``request`` is on an adapter no counted request uses (spec ``rate.lora_gate``)."""
        lora = lora_id(request)
        return self.host.lora_config is not None and bool(lora) and lora not in self.counted_loras()
