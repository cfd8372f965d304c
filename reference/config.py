"""``additional_config["output_rate"]``: parsing and start-up validation.

Keys (all optional; an empty or missing section means the feature is off, R18):

=============================== ===================================================
``default_tokens_per_s``        rate of every user not listed below; turns it on
``user_tokens_per_s``           ``{"user-a": 100, ...}`` per-user overrides
``max_num_active_seqs``         active cap A (R12); default: vLLM's
                                ``max_num_active_seqs``, else ``max_num_seqs``
``burst_ms``                    burst tolerance tau (R1), default 100
``max_num_seqs_per_user``       R20: resident (running) requests one user may hold,
                                1..``max_num_seqs``; default: no cap (the article's
                                behaviour, docs/SPEC.md Decision R20)
``trace_path``                  file to which the reference scheduler appends one
                                JSON line per ``schedule()`` (the engine-side event
                                trace, ``adapter/trace_check.py``); default: off
``rates_file``                  R21: a JSON file ``{"default_tokens_per_s": ...,
                                "user_tokens_per_s": {...}}`` watched at the start
                                of each ``schedule()``; a change replaces the rate
                                table without a restart (reference/ratesfile.py).
                                Default: off
``shared_budget_url``           R23-R26: ``redis://host:port/db`` (or ``rediss://``,
                                ``unix://``, ``valkey://``): one budget per user
                                across every engine using the same store
                                (reference/shared_budget.py). Default: off
``shadow``                      ``true``: shadow mode (docs/SPEC.md, Decision
                                "Shadow mode"): the limiter counts and reports what
                                it would throttle, and throttles nothing; the
                                schedule is the base class's, step for step.
                                Default ``false``
``identity``                    R30-R32: where the user comes from: ``"body"``
                                (default, R17), ``"header:NAME"`` (a gateway's
                                header) or ``"api-key"`` (the bearer token's user
                                in ``keys_file``); ``identity_on_claim``
                                (``"refuse"``/``"overwrite"``) and
                                ``identity_on_missing`` (``"refuse"``/
                                ``"anonymous"``). reference/identity_middleware.py
=============================== ===================================================

Source: docs/SPEC.md "Configuration" (keys, flags and the start-up checks).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import replace
from fractions import Fraction
from typing import Any

from vllm_output_rate.reference.identity import IdentitySettings, parse_identity
from vllm_output_rate.reference.keysfile import KeysFileWatcher
from vllm_output_rate.reference.ratesfile import RatesFileWatcher
from vllm_output_rate.reference.scales import parse_rate
from vllm_output_rate.reference.section import (
    KNOWN_KEYS,
    SECTION,
    OutputRateConfig,
    OutputRateConfigError,
    _shown_user,
    _suggest_keys,
    check_override_user,
)
from vllm_output_rate.spec.limiter import BURST_NS


def _parse_rates(section: Mapping[str, Any]) -> tuple[Fraction, dict[str, Fraction]]:
    """The default rate and the per-user overrides (tokens/s, exact) of an output_rate section.

    Raises:
        OutputRateConfigError: no default, overrides not an object, a bad user id or rate
            (naming it).
    """
    overrides = section.get("user_tokens_per_s")
    if overrides is None:
        overrides = {}
    if not isinstance(overrides, Mapping):
        raise OutputRateConfigError(f"user_tokens_per_s must be a JSON object of user -> tokens/s, got {overrides!r}")
    default = section.get("default_tokens_per_s")
    if default is None:
        raise OutputRateConfigError(
            "output_rate is configured without default_tokens_per_s "
            "(--default-user-output-tokens-per-second): set a default rate to turn the feature on, "
            "or remove the output_rate section"
        )
    try:
        default_rate = parse_rate(default, "default_tokens_per_s")
        user_rates: dict[str, Fraction] = {}
        for user, rate in overrides.items():
            check_override_user(user)
            user_rates[user] = parse_rate(rate, f"user_tokens_per_s[{_shown_user(user)}]")
    except ValueError as exc:
        raise OutputRateConfigError(str(exc)) from None
    return default_rate, user_rates


def _check_section_shape(section: Any) -> None:
    """R18: a given ``output_rate`` section (not None) is a non-empty JSON object of
    ``KNOWN_KEYS`` only.

    Raises:
        OutputRateConfigError: an empty section (the feature meant on, no rate), not an
            object, or unknown keys (naming them, with the nearest known key).
    """
    if section == {}:
        # An explicit, empty section given to a class that implements it: the operator meant
        # to turn the feature on and gave no rate (R18: "off" is no section at all).
        raise OutputRateConfigError(
            'additional_config["output_rate"] is empty: set default_tokens_per_s '
            "(--default-user-output-tokens-per-second) to turn the feature on, or remove the output_rate "
            "section to turn it off"
        )
    if not isinstance(section, Mapping):
        raise OutputRateConfigError(f'additional_config["output_rate"] must be a JSON object, got {section!r}')
    unknown = sorted(set(section) - set(KNOWN_KEYS), key=str)
    if unknown:
        raise OutputRateConfigError(
            f'unknown key(s) in additional_config["output_rate"]: {_suggest_keys(unknown, KNOWN_KEYS)}; '
            f"known keys: {', '.join(KNOWN_KEYS)}"
        )


def parse_output_rate(section: Any) -> OutputRateConfig:
    """Parse and validate ``additional_config["output_rate"]``.

    ``None`` (no section) is the feature off (R18).

    Raises:
        OutputRateConfigError: an empty section, unknown keys, bad rates (naming the user and
            value), overrides without a default, a bad active cap or burst.
    """
    if section is None:
        return OutputRateConfig()
    _check_section_shape(section)
    default_rate, user_rates = _parse_rates(section)
    active = section.get("max_num_active_seqs")
    if active is not None and (isinstance(active, bool) or not isinstance(active, int) or active < 1):
        raise OutputRateConfigError(f"max_num_active_seqs must be an integer >= 1, got {active!r}")
    burst_ms = section.get("burst_ms", BURST_NS // 1_000_000)
    if isinstance(burst_ms, bool) or not isinstance(burst_ms, int) or burst_ms < 1:
        raise OutputRateConfigError(
            f"burst_ms must be an integer number of milliseconds >= 1, got {burst_ms!r}; "
            "set --burst-ms / output_rate.burst_ms to e.g. 100 (the default), or remove it"
        )
    trace_path = section.get("trace_path")
    if trace_path is not None and (not isinstance(trace_path, str) or not trace_path.strip()):
        raise OutputRateConfigError(
            f"trace_path must be a non-empty string naming the file the engine-side event trace is "
            f'appended to, e.g. "/tmp/outrate-trace.jsonl", got {trace_path!r}; remove it to turn tracing off'
        )
    if trace_path is not None:
        _check_trace_path(trace_path)
    shadow = section.get("shadow", False)
    if not isinstance(shadow, bool):
        raise OutputRateConfigError(
            f"shadow must be true or false (a JSON boolean: true counts and reports what would be throttled "
            f"and throttles nothing), got {shadow!r}"
        )
    per_user = section.get("max_num_seqs_per_user")
    if per_user is not None and (isinstance(per_user, bool) or not isinstance(per_user, int) or per_user < 1):
        raise OutputRateConfigError(
            f"max_num_seqs_per_user (--max-num-seqs-per-user) must be an integer >= 1 (resident requests one "
            f"user may hold), got {per_user!r}; remove it for no per-user cap"
        )
    config = OutputRateConfig(default_rate, user_rates, active, burst_ms * 1_000_000, trace_path, shadow=shadow)
    config = replace(config, max_num_seqs_per_user=per_user) if per_user is not None else config
    rates_file = section.get("rates_file")
    if rates_file is not None:
        config = _with_rates_file(config, rates_file)
    url = section.get("shared_budget_url")
    if url is not None:
        config = replace(config, shared_budget_url=check_shared_budget_url(url))
        if config.rate_table is not None and not config.rate_table.is_flat:
            raise OutputRateConfigError(
                f"rates file {rates_file}: plans, patterns and unlimited users (R27-R29) are not supported with "
                "shared_budget_url (the store keeps one rate per user); write default_tokens_per_s and "
                "user_tokens_per_s only, or remove shared_budget_url"
            )
    return _with_identity(config, section)


IDENTITY_KEYS = ("identity", "keys_file", "identity_on_claim", "identity_on_missing")


def _with_identity(config: OutputRateConfig, section: Mapping[str, Any]) -> OutputRateConfig:
    """``config`` with the section's identity settings (R30-R32), if it gives any."""
    if all(section.get(key) is None for key in IDENTITY_KEYS):
        return config
    return replace(config, identity=parse_identity_section(section))


def parse_identity_section(section: Mapping[str, Any]) -> IdentitySettings:
    """R30-R32: the identity settings of an ``output_rate`` section; with ``"api-key"`` the
    keys file is read and checked now (reference/keysfile.py).

    Raises:
        OutputRateConfigError: a bad identity value, or a missing or bad keys file,
            naming the key or the entry and what to change.
    """
    try:
        settings = parse_identity(*(section.get(key) for key in IDENTITY_KEYS))
    except ValueError as exc:
        raise OutputRateConfigError(str(exc)) from None
    if settings.keys_file is not None:
        KeysFileWatcher(settings.keys_file, logging.getLogger("vllm.output_rate")).load_initial()
    return settings


SHARED_BUDGET_SCHEMES = ("redis://", "rediss://", "unix://", "valkey://")


def check_shared_budget_url(url: Any) -> str:
    """R23-R26: ``shared_budget_url``, the store all engines share each user's budget
    through (docs/SPEC.md, "Multi-engine shared budget").

    Raises:
        OutputRateConfigError: not a string with one of ``SHARED_BUDGET_SCHEMES`` and a host
            or socket path, naming the value.
    """
    if not isinstance(url, str) or not url.startswith(SHARED_BUDGET_SCHEMES) or len(url.split("://", 1)[1]) == 0:
        raise OutputRateConfigError(
            f"shared_budget_url must be the URL of the Redis or Valkey server the engines share budgets through, "
            f'e.g. "redis://127.0.0.1:6379/0" (schemes: {", ".join(SHARED_BUDGET_SCHEMES)}), got {url!r}; '
            "remove it for a budget per engine"
        )
    return url


def _check_trace_path(trace_path: str) -> None:
    """Refuse a ``trace_path`` the engine could not append to, before vLLM starts.

    Missing parent directories are created when the trace opens (``reference/trace.py``);
    refused here: the path is a directory, a parent component is an existing non-directory,
    or the nearest existing parent is not writable.

    Raises:
        OutputRateConfigError: naming the path, the offending component and what to change.
    """
    path = os.path.abspath(trace_path)
    fix = "choose another --trace-path / output_rate.trace_path, or remove it to turn tracing off"
    if os.path.isdir(path):
        raise OutputRateConfigError(f"trace_path {trace_path!r} is a directory, not a file: {fix}")
    parent = os.path.dirname(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise OutputRateConfigError(
            f"trace_path {trace_path!r}: {parent!r} exists and is not a directory, so the trace file cannot be "
            f"created below it; {fix}"
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputRateConfigError(f"trace_path {trace_path!r}: directory {parent!r} is not writable; {fix}")


def _with_rates_file(config: OutputRateConfig, rates_file: Any) -> OutputRateConfig:
    """R21: ``rates_file`` validated; an existing file's table replaces the section's rates
    (``rate_table``, R27-R29; a bad file stops start-up, naming it and what to change; a
    missing one is watched)."""
    if not isinstance(rates_file, str) or not rates_file.strip():
        raise OutputRateConfigError(
            f"rates_file must be a non-empty string naming a JSON file of rates (watched for changes, R21), e.g. "
            f'"/etc/outrate/rates.json", got {rates_file!r}; remove it to change limits only by a restart'
        )
    table = RatesFileWatcher(rates_file).load_initial()
    config = replace(config, rates_file=rates_file)
    if table is None:
        return config
    # R28: an unlimited default keeps the section's rate as the "feature on" mark (R18); the table decides.
    default = table.default_rate if table.default_rate is not None else config.default_rate
    return replace(config, default_rate=default, user_rates=table.user_rates, rate_table=table)


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
    # deferred: vllm_compat imports vLLM (seconds) to read its version; config is also read without vLLM
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
