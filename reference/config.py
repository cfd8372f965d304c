"""``additional_config["output_rate"]``: parsing and start-up validation.

Keys (all optional; an empty or missing section means the feature is off, R18):

=============================== ===================================================
``default_tokens_per_s``        rate of every user not listed below; turns it on
``user_tokens_per_s``           ``{"user-a": 100, ...}`` per-user overrides
``max_num_active_seqs``         active cap A (R12); default: vLLM's
                                ``max_num_active_seqs``, else ``max_num_seqs``
``burst_ms``                    burst tolerance tau (R1), default 100
``trace_path``                  file to which the reference scheduler appends one
                                JSON line per ``schedule()`` (the engine-side event
                                trace, ``adapter/trace_check.py``); default: off
=============================== ===================================================

Source: semantics.md "Configuration"; seed article, start-up flags.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Mapping

from vllm_output_rate.reference.limiter import BURST_NS, parse_rate

KNOWN_KEYS = ("default_tokens_per_s", "user_tokens_per_s", "max_num_active_seqs", "burst_ms", "trace_path")


class OutputRateConfigError(ValueError):
    """A bad ``output_rate`` configuration; the message says what to change."""


@dataclass(frozen=True)
class OutputRateConfig:
    """Validated feature configuration. ``default_rate`` None means the feature is off."""

    default_rate: Fraction | None = None
    user_rates: Mapping[str, Fraction] = field(default_factory=dict)
    max_num_active_seqs: int | None = None
    burst_ns: int = BURST_NS
    trace_path: str | None = None

    @property
    def enabled(self) -> bool:
        return self.default_rate is not None


def parse_output_rate(section: Any) -> OutputRateConfig:
    """Parse and validate ``additional_config["output_rate"]``.

    Raises:
        OutputRateConfigError: unknown keys, bad rates (naming the user and value),
            overrides without a default, a bad active cap or burst.
    """
    if section is None or section == {}:
        return OutputRateConfig()
    if not isinstance(section, Mapping):
        raise OutputRateConfigError(
            f'additional_config["output_rate"] must be a JSON object, got {section!r}'
        )
    unknown = sorted(set(section) - set(KNOWN_KEYS))
    if unknown:
        raise OutputRateConfigError(
            f'unknown key(s) {unknown} in additional_config["output_rate"]; known keys: {list(KNOWN_KEYS)}'
        )
    overrides = section.get("user_tokens_per_s")
    if overrides is None:
        overrides = {}
    if not isinstance(overrides, Mapping):
        raise OutputRateConfigError(
            f"user_tokens_per_s must be a JSON object of user -> tokens/s, got {overrides!r}"
        )
    default = section.get("default_tokens_per_s")
    if default is None:
        raise OutputRateConfigError(
            "output_rate is configured without default_tokens_per_s "
            "(--default-user-output-tokens-per-second): set a default rate to turn the feature on, "
            "or remove the output_rate section"
        )
    try:
        default_rate = parse_rate(default, "default_tokens_per_s")
        user_rates = {}
        for user, rate in overrides.items():
            if not isinstance(user, str) or not user:
                raise ValueError(f"user ids in user_tokens_per_s must be non-empty strings, got {user!r}")
            user_rates[user] = parse_rate(rate, f"user_tokens_per_s[{user!r}]")
    except ValueError as exc:
        raise OutputRateConfigError(str(exc)) from None
    active = section.get("max_num_active_seqs")
    if active is not None and (isinstance(active, bool) or not isinstance(active, int) or active < 1):
        raise OutputRateConfigError(f"max_num_active_seqs must be an integer >= 1, got {active!r}")
    burst_ms = section.get("burst_ms", BURST_NS // 1_000_000)
    if isinstance(burst_ms, bool) or not isinstance(burst_ms, int) or burst_ms < 1:
        raise OutputRateConfigError(f"burst_ms must be an integer number of milliseconds >= 1, got {burst_ms!r}")
    trace_path = section.get("trace_path")
    if trace_path is not None and (not isinstance(trace_path, str) or not trace_path.strip()):
        raise OutputRateConfigError(
            f"trace_path must be a non-empty string naming the file the engine-side event trace is "
            f"appended to, e.g. \"/tmp/outrate-trace.jsonl\", got {trace_path!r}; remove it to turn tracing off"
        )
    return OutputRateConfig(default_rate, user_rates, active, burst_ms * 1_000_000, trace_path)


# Start-up validation of the engine configuration (feature on only).
#
# Each entry: (what is unsupported, why the accounting does not cover it, what to change).
# The checks read ``VllmConfig`` attributes only (duck-typed, no vLLM import here), so the
# same function runs in the scheduler's constructor (authoritative, engine-core process)
# and in the front end before the engine starts (``plugin.py``, fails faster).
UNSUPPORTED_WHY = {
    "speculative decoding": "a step can emit several tokens per request but is charged once",
    "data parallel > 1": "every data-parallel rank has its own scheduler and would grant its own budget",
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
}


def unsupported_modes(vllm_config: Any) -> list[tuple[str, str]]:
    """The unsupported modes enabled in ``vllm_config``: ``[(mode, what to change)]``.

    Reads: ``speculative_config``, ``parallel_config.{data,pipeline}_parallel_size``,
    ``model_config.{is_multimodal_model, is_encoder_decoder, is_hybrid, is_attention_free,
    is_diffusion, runner_type}``, ``diffusion_config``, ``cache_config.kv_offloading_size``,
    ``kv_transfer_config``, ``ec_transfer_config``, ``aux_output_config.enabled``.
    """
    found: list[tuple[str, str]] = []
    if getattr(vllm_config, "speculative_config", None) is not None:
        found.append(("speculative decoding", "remove --speculative-config"))
    parallel = getattr(vllm_config, "parallel_config", None)
    dp = getattr(parallel, "data_parallel_size", 1)
    if dp > 1:
        found.append(("data parallel > 1", f"set --data-parallel-size 1 (got {dp}); run one engine per budget"))
    pp = getattr(parallel, "pipeline_parallel_size", 1)
    if pp > 1:
        found.append(("pipeline parallel > 1",
                      f"set --pipeline-parallel-size 1 (got {pp}); tensor parallel is supported"))
    model = getattr(vllm_config, "model_config", None)
    if model is not None:
        flags = (
            ("is_multimodal_model", "multimodal model"),
            ("is_encoder_decoder", "encoder-decoder model"),
            ("is_hybrid", "hybrid (mamba) model"),
            ("is_attention_free", "attention-free model"),
        )
        for attr, mode in flags:
            if getattr(model, attr, False):
                found.append((mode, "serve a text-only decoder-only attention model"))
        if getattr(model, "is_diffusion", False) or getattr(vllm_config, "diffusion_config", None) is not None:
            found.append(("diffusion model", "serve an autoregressive text model"))
        if getattr(model, "runner_type", "generate") == "pooling":
            found.append(("pooling model", "use --runner generate with a generative model"))
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


def check_engine_supported(vllm_config: Any) -> None:
    """Refuse, at start-up, an engine configuration the output-rate accounting does not cover.

    Call only with the feature on (R18: feature off means no checks at all).

    Raises:
        OutputRateConfigError: one message listing every unsupported mode found, each with
            the reason and what to change.
    """
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
