"""Start-up validation of the engine configuration (feature on only).

``check_engine_supported`` refuses, in one message naming each mode with the reason and
what to change, a ``VllmConfig`` the output-rate accounting does not cover
(``unsupported_modes``: speculative decoding, DP without a shared budget, PP, model kinds,
connectors, sleep mode, admission orders vLLM applies inside its scheduler), after the
section's caps against ``max_num_seqs`` (``check_active_cap``; R20 ``check_residency_cap``).
The section itself is parsed by ``reference/config.py``.

Source: docs/SPEC.md "Configuration" (the start-up checks) and docs/MODES.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm_output_rate.reference.section import SECTION, OutputRateConfigError

# Start-up validation of the engine configuration (feature on only).
#
# Each entry: (what is unsupported, why the accounting does not cover it, what to change).
# The checks read ``VllmConfig`` attributes only (duck-typed, no vLLM import here), so the
# same function runs in the scheduler's constructor (authoritative, engine-core process)
# and in the front end before the engine starts (``plugin.py``, fails faster).
UNSUPPORTED_WHY = {
    "speculative decoding": "a step can emit several tokens per request but is charged once",
    "data parallel > 1": (
        "every data-parallel rank has its own scheduler and would grant its own budget "
        "unless the ranks share it through a store (R23-R26)"
    ),
    "pipeline parallel > 1": "several batches are in flight per scheduler; not covered by the accounting",
    "multimodal model": "encoder inputs and their scheduling are not covered by the accounting",
    "encoder-decoder model": "encoder inputs and their scheduling are not covered by the accounting",
    "hybrid (mamba) model": "state-space layers cannot pause a request at an arbitrary position",
    "attention-free model": "state-space layers cannot pause a request at an arbitrary position",
    "diffusion model": "a step emits a whole canvas of tokens, not one token per request",
    "pooling model": "pooling runs produce no output tokens to limit",
    "KV offload": "the offload connector moves KV blocks of paused requests behind the scheduler's back",
    "KV connector": "remote KV loads and deferred frees change when a request can run",
    "EC connector": "encoder-cache transfers are not covered by the accounting",
    "aux output connector": "auxiliary outputs are delivered per step, not per charged token",
    "local prefill cadence": (
        "vLLM 0.33 (and 0.32's data-parallel engine core) holds prefill until prefill_schedule_interval executed steps have passed "
        "while any decode is resident; a throttled user's paused decodes leave steps empty, "
        "so every other user's prefill waits for the throttled user's next grant "
        "(docs/MODES.md)"
    ),
    "cache-aware admission": (
        "vLLM 0.34 reorders the first waiting requests by cached prefix under FCFS with prefix caching; that "
        "order is not modelled (it can move a refused whole prompt, R10, and change R20's admission order)"
    ),
    "sleep mode": (
        "sleep and wake-up pause the engine and discard or offload the KV cache of paused requests, "
        "which the accounting does not cover and no test here exercises (docs/MODES.md)"
    ),
}


def unsupported_modes(vllm_config: Any) -> list[tuple[str, str]]:
    """The unsupported modes enabled in ``vllm_config``: ``[(mode, what to change)]``.

    Reads: ``speculative_config``, ``parallel_config.{data,pipeline}_parallel_size``,
    ``model_config.{is_multimodal_model, is_encoder_decoder, is_hybrid, is_attention_free,
    is_diffusion, runner_type}``, ``diffusion_config``, ``cache_config.kv_offloading_size``,
    ``kv_transfer_config``, ``ec_transfer_config``, ``aux_output_config.enabled``,
    ``model_config.enable_sleep_mode``, ``scheduler_config.prefill_schedule_interval`` (only
    where the installed vLLM applies it inside the scheduler: ``local_prefill_cadence`` of
    ``spec.versions``, 0.33), ``scheduler_config.cache_aware_admission_window`` (0.34).
    """
    found: list[tuple[str, str]] = []
    if getattr(vllm_config, "speculative_config", None) is not None:
        found.append(("speculative decoding", "remove --speculative-config"))
    parallel = getattr(vllm_config, "parallel_config", None)
    dp = getattr(parallel, "data_parallel_size", 1)
    found += _parallel_modes(vllm_config, parallel, dp)
    model = getattr(vllm_config, "model_config", None)
    if model is not None:
        found += _model_modes(vllm_config, model)
    found += _connector_modes(vllm_config)
    if getattr(model, "enable_sleep_mode", False):
        found.append(("sleep mode", "remove --enable-sleep-mode"))
    found += _scheduler_orders(getattr(vllm_config, "scheduler_config", None), dp)
    return found


def _parallel_modes(vllm_config: Any, parallel: Any, dp: int) -> list[tuple[str, str]]:
    """Data parallel > 1 without a shared budget (R23-R26), pipeline parallel > 1."""
    found: list[tuple[str, str]] = []
    additional = getattr(vllm_config, "additional_config", None)
    section = additional.get(SECTION) if isinstance(additional, Mapping) else None
    shared = isinstance(section, Mapping) and section.get("shared_budget_url") is not None
    if dp > 1 and not shared:  # R23-R26: with a shared store every rank leases from one budget per user
        found.append(
            (
                "data parallel > 1",
                f"give --shared-budget-url (output_rate.shared_budget_url, a Redis or Valkey URL) so "
                f"the ranks share each user's budget, or set --data-parallel-size 1 (got {dp})",
            )
        )
    pp = getattr(parallel, "pipeline_parallel_size", 1)
    if pp > 1:
        found.append(
            ("pipeline parallel > 1", f"set --pipeline-parallel-size 1 (got {pp}); tensor parallel is supported")
        )
    return found


def _model_modes(vllm_config: Any, model: Any) -> list[tuple[str, str]]:
    """The model kinds of ``model`` (vLLM's ``model_config``) the accounting does not cover:
    multimodal, encoder-decoder, hybrid, attention-free, diffusion, pooling."""
    found: list[tuple[str, str]] = []
    flags = (
        ("is_multimodal_model", "multimodal model"),
        ("is_encoder_decoder", "encoder-decoder model"),
        ("is_hybrid", "hybrid (mamba) model"),
        ("is_attention_free", "attention-free model"),
    )
    for attr, mode in flags:
        if getattr(model, attr, False):
            found.append((mode, "serve a text-only decoder-only attention model (--model)"))
    if getattr(model, "is_diffusion", False) or getattr(vllm_config, "diffusion_config", None) is not None:
        found.append(("diffusion model", "serve an autoregressive text model (--model)"))
    if getattr(model, "runner_type", "generate") == "pooling":
        found.append(("pooling model", "use --runner generate with a generative model"))
    return found


def _connector_modes(vllm_config: Any) -> list[tuple[str, str]]:
    """KV offload or a KV connector, an EC connector, the aux output connector."""
    found: list[tuple[str, str]] = []
    offload_gib = getattr(getattr(vllm_config, "cache_config", None), "kv_offloading_size", None)
    if offload_gib is not None:
        # vLLM turns --kv-offloading-size into a kv_transfer_config: report it once, as offload.
        found.append(("KV offload", f"remove --kv-offloading-size (got {offload_gib})"))
    elif getattr(vllm_config, "kv_transfer_config", None) is not None:
        connector = getattr(vllm_config.kv_transfer_config, "kv_connector", None)
        found.append(("KV connector", f"remove --kv-transfer-config (connector {connector!r})"))
    if getattr(vllm_config, "ec_transfer_config", None) is not None:
        connector = getattr(vllm_config.ec_transfer_config, "ec_connector", None)
        found.append(("EC connector", f"remove --ec-transfer-config (connector {connector!r})"))
    if getattr(getattr(vllm_config, "aux_output_config", None), "enabled", False):
        found.append(("aux output connector", "remove --enable-return-routed-experts"))
    return found


def _scheduler_orders(scheduler_config: Any, dp: int) -> list[tuple[str, str]]:
    """The admission orders of ``scheduler_config`` the accounting does not cover:
    ``cache_aware_admission_window`` > 0 (0.34.0+; absent before, the default 0) and
    ``prefill_schedule_interval`` > 1 where it applies (``_local_prefill_cadence``, or DP)."""
    found: list[tuple[str, str]] = []
    window = getattr(scheduler_config, "cache_aware_admission_window", 0)
    if isinstance(window, int) and window > 0:
        found.append(("cache-aware admission", f"set --cache-aware-admission-window 0 (got {window})"))
    interval = getattr(scheduler_config, "prefill_schedule_interval", 1)
    if interval > 1 and (dp > 1 or _local_prefill_cadence()):
        # P4 (other users proceed): measured on 0.33, interval 4, one user at 1 tok/s resident:
        # another user's first prefill waited 2.9 s, against 1 ms on stock vLLM. On 0.32 the
        # data-parallel engine core applies the same cadence (accepted with a shared budget).
        found.append(("local prefill cadence", f"set --prefill-schedule-interval 1 (got {interval})"))
    return found


def _local_prefill_cadence() -> bool:
    """The installed vLLM applies ``prefill_schedule_interval`` inside the scheduler (0.33+)."""
    # deferred: vllm_compat imports vLLM (seconds) to read its version; only this check needs it
    from vllm_output_rate.reference.vllm_compat import INSTALLED_PROFILE

    return INSTALLED_PROFILE.local_prefill_cadence


def check_engine_supported(vllm_config: Any) -> None:
    """Refuse, at start-up, an engine configuration the output-rate accounting does not cover.

    Call only with the feature on (R18: feature off means no checks at all). First
    checks the section against the engine (``check_active_cap``).

    Raises:
        OutputRateConfigError: ``output_rate.max_num_active_seqs`` above ``max_num_seqs``;
            or one message listing every unsupported mode found, each with the reason and
            what to change.
    """
    check_active_cap(vllm_config)
    check_residency_cap(vllm_config)
    found = unsupported_modes(vllm_config)
    if not found:
        return
    lines = [f"  - {mode}: {UNSUPPORTED_WHY[mode]}; {fix}" for mode, fix in found]
    raise OutputRateConfigError(
        "per-user output-rate limiting (additional_config['output_rate'], "
        "--default-user-output-tokens-per-second) does not support this engine configuration:\n"
        + "\n".join(lines)
        + "\nChange the settings above, or turn the feature off by removing the output_rate section."
    )


def check_active_cap(vllm_config: Any) -> None:
    """Configuration: refuse ``output_rate.max_num_active_seqs`` above vLLM's ``max_num_seqs``.

    A cap above the resident requests can never bind; it is almost surely a typo (vLLM
    refuses the same for its own ``--max-num-active-seqs``). Duck-typed like
    ``unsupported_modes``: nothing is checked when either value is not visible.

    Raises:
        OutputRateConfigError: naming both values and what to change.
    """
    _refuse_above_max_num_seqs(vllm_config, "max_num_active_seqs", lower="max_num_active_seqs")


def check_residency_cap(vllm_config: Any) -> None:
    """R20: refuse ``output_rate.max_num_seqs_per_user`` above vLLM's ``max_num_seqs``.

    A per-user cap above the resident requests can never bind: almost surely a typo.
    Duck-typed like ``check_active_cap``.

    Raises:
        OutputRateConfigError: naming both values and what to change.
    """
    _refuse_above_max_num_seqs(vllm_config, "max_num_seqs_per_user", lower="--max-num-seqs-per-user")


def _refuse_above_max_num_seqs(vllm_config: Any, key: str, lower: str) -> None:
    """Refuse ``additional_config["output_rate"][key]`` above ``scheduler_config.max_num_seqs``
    of ``vllm_config``; nothing is checked where either is not a visible int (duck-typed).
    ``lower``: how the operator names the setting to lower (a key or a CLI flag).

    Raises:
        OutputRateConfigError: naming both values and what to change.
    """
    additional = getattr(vllm_config, "additional_config", None)
    section = additional.get(SECTION) if isinstance(additional, Mapping) else None
    value = section.get(key) if isinstance(section, Mapping) else None
    max_num_seqs = getattr(getattr(vllm_config, "scheduler_config", None), "max_num_seqs", None)
    if isinstance(value, int) and isinstance(max_num_seqs, int) and value > max_num_seqs:
        raise OutputRateConfigError(
            f'additional_config["{SECTION}"]["{key}"] ({value}) must be <= --max-num-seqs ({max_num_seqs}): '
            f"lower {lower} or raise --max-num-seqs"
        )
