"""The rule registry: every rule's id, title and the spec functions that implement it.

One entry per rule of docs/SPEC.md ("The limiter", "The scheduler rules"). What covers a
rule is declared where it lives, by rule id: a test by ``@pytest.mark.rules("R7", ...)``,
a gate check by its ``GateRow.rules`` (``adapter/registry.py``, ``proofs/gate_checks.py``),
a mutant by its ``Mutant.rule`` (``adapter/mutation.catalogue``), a proof by its
``rules`` (``proofs/z3_limiter.PROPERTIES``, ``proofs/crosshair_limiter.PROPERTIES``).
``vllm_output_rate.traceability`` gathers them into docs/TRACEABILITY.md's table
(``make traceability``); ``tests/test_traceability.py`` fails when the committed table is
out of date, a rule has no test or no gate check, or an entry names nothing.

Adding a rule: one ``Rule`` here, its section in docs/SPEC.md, then the markers and
``rules`` of what covers it; ``make traceability`` writes the table.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Rule:
    """One rule: ``rule_id`` (``R7``), ``title`` (its SPEC.md heading), ``section`` (the
    SPEC.md anchor), ``spec``: functions of ``vllm_output_rate.spec`` as ``module.name``
    (``rate.samples``, ``state.EngineConfig.rate_limited``); ``reference``: the code of
    ``vllm_output_rate.reference`` that implements it, named the same way (strings only:
    the spec imports nothing above it)."""

    rule_id: str
    title: str
    spec: tuple[str, ...]
    reference: tuple[str, ...] = ()

    @property
    def section(self) -> str:
        """The GitHub anchor of the rule's heading in docs/SPEC.md (or docs/EXTENSIONS.md, R19 and up)."""
        text = f"{self.rule_id}: {self.title}".lower()
        return "".join(c for c in text.replace(" ", "-") if c.isalnum() or c in "-_")


MIXIN = "scheduler._RateLimitMixin."  # the reference scheduler's rate-limit layer


def _mixin(*names: str) -> tuple[str, ...]:
    """Reference entries of ``_RateLimitMixin`` methods, by method name."""
    return tuple(MIXIN + n for n in names)


RULES: tuple[Rule, ...] = (
    Rule(
        "R1",
        "one TAT per user",
        ("limiter.LimiterState", "limiter.emission_interval_ns", "limiter.tat_of", "state.EngineConfig.rate_of"),
        ("limiter.OutputRateLimiter", "limiter.OutputRateLimiter.rate_of", "config.parse_output_rate"),
    ),
    Rule(
        "R2",
        "try_take",
        (
            "limiter.allows",
            "limiter.try_take",
            "limiter.idle_burst_grants",
            "limiter.window_bound_tokens",
            "properties.R2Window",
        ),
        (
            "limiter.OutputRateLimiter.try_take",
            "limiter.OutputRateLimiter.allows",
            "limiter.OutputRateLimiter.grants_at",
            "limiter.OutputRateLimiter.take_many",
            "limiter.OutputRateLimiter.take_counts",
        )
        + _mixin("_survey_users", "_commit_grants")
        + ("charging.Charging.survey", "charging.Charging.grants_left", "charging.Charging.commit"),
    ),
    Rule("R3", "exact arithmetic", ("limiter.emission_interval_ns",), ("scales.parse_rate", "scales._Scale")),
    Rule("R4", "refund", ("limiter.refund",), ("limiter.OutputRateLimiter.refund",)),
    Rule("R5", "ready_at", ("limiter.ready_at_ns",), ("limiter.OutputRateLimiter.ready_at_ns",)),
    Rule(
        "R6",
        "cleanup of idle users",
        ("limiter.cleanup_idle_users", "rate.end_cycle"),
        ("limiter.OutputRateLimiter.cleanup_idle_users",) + _mixin("schedule"),
    ),
    Rule(
        "R7",
        "charge on dispatch",
        (
            "rate.samples",
            "rate.try_charge",
            "rate.charge_if_sampling",
            "rate.decide_running",
            "rate.decide_waiting",
            "properties.accounting_error",
        ),
        _mixin("_reserve_prefill_lookahead", "_samples"),
    ),
    Rule(
        "R8",
        "over-charge, never under-charge",
        ("scheduler.deliver", "rate.end_cycle"),
        _mixin("_settle") + ("charging.Charging.settle",),
    ),
    Rule(
        "R9",
        "single refund point",
        ("rate.end_cycle", "scheduler.sampling_dispatches", "properties.accounting_error"),
        _mixin("_settle") + ("charging.Charging.settle", "step_record.StepRecord"),
    ),
    Rule(
        "R10",
        "throttled prefill",
        ("rate.prefill_room", "rate.decide_running", "rate.waiting_gate", "rate.decide_waiting"),
        _mixin("_reserve_prefill_lookahead", "_handle_blocked_waiting_request")
        + ("charging.Charging.refuse", "residency.Residency.refused_may_proceed"),
    ),
    Rule(
        "R11",
        "skip, keep resident",
        ("rate.begin_cycle", "rate.start_turns", "rate.decide_running", "properties.first_cut"),
        _mixin("_reserve_prefill_lookahead", "_move_throttled_last") + ("victims.Victims.move_throttled_last",),
    ),
    Rule(
        "R12",
        "skip-not-count",
        ("rate.decide_running", "rate.admission_cap", "state.EngineConfig.active_cap"),
        _mixin("max_num_active_reqs", "_reserve_prefill_lookahead"),
    ),
    Rule(
        "R13",
        "preferred victims",
        ("rate.preferred_victim", "scheduler.choose_victim", "rate.free_lora_slot", "rate.lora_gate"),
        _mixin("_move_throttled_last", "_free_lora_slot")
        + (
            "victims.Victims.move_throttled_last",
            "victims.Victims.restore_order",
            "victims.Victims.allocate_slots",
            "victims.Victims.free_lora_slot",
            "residency.Residency.takes_new_lora_slot",
        ),
    ),
    Rule(
        "R14",
        "rotation",
        ("rate.turn_order", "rate.start_turns", "rate.begin_cycle"),
        ("turns.Turns.take", "turns.Turns.turn_order", "victims.Victims.move_throttled_last")
        + _mixin("_turn_order", "_move_throttled_last", "_reserve_prefill_lookahead"),
    ),
    Rule(
        "R15",
        "last served",
        ("rate.last_served", "rate.next_last_served", "rate.end_cycle"),
        _mixin("_settle", "_record_last_served", "schedule")
        + ("charging.Charging.settle", "turns.Turns.record_last_served"),
    ),
    Rule(
        "R16",
        "waiting for budget never blocks the engine",
        ("rate.begin_cycle", "rate.end_cycle"),
        (
            "core_wait.engine_wait_timeout_ns",
            "core_wait.wait_for_input",
            "core_wait.BACKGROUND_RECHECK_NS",
            "core_wait.background_blocked",
        )
        + _mixin("schedule", "_observe", "next_ready_ns")
        + ("engine_wait.EngineWait.step_done", "engine_wait.wait_hint_ns"),
    ),
    Rule(
        "R17",
        "identity",
        ("events.AddRequest", "events.ANONYMOUS_USER"),
        ("identity.validate_extra_args", "limits.user_of", "limits.resolve_user", "limits.UserLimits.remember")
        + ("plugin._install_identity_check",)
        + _mixin("_resolve_user", "add_request"),
    ),
    Rule(
        "R18",
        "feature off",
        ("state.EngineConfig.rate_limited", "scheduler.schedule"),
        ("config.parse_output_rate", "hooks.feature_on") + _mixin("schedule", "max_num_active_reqs", "__init__"),
    ),
    Rule(
        "R19",
        "not binding = stock",
        ("rate.limit_binds", "state.EngineConfig.base_config"),
        ("turns.Turns.take", "turns.Turns.hold") + _mixin("_move_throttled_last"),
    ),
    Rule(
        "R20",
        "fair residency",
        ("rate.residency_gate", "rate.resident_count", "rate.limit_binds", "invariants.i19_residency_cap"),
        _mixin("_handle_blocked_waiting_request", "_below_residency_cap")
        + ("residency.Residency.below_cap",)
        + ("engine_checks.check_residency_cap", "config.parse_output_rate"),
    ),
    Rule(
        "R21",
        "rate change without a restart",
        (
            "limiter.rescaled_tat_ns",
            "limiter.change_rates",
            "limiter.piecewise_window_bound_tokens",
            "rate.apply_rate_change",
            "events.ChangeRates",
            "state.EngineConfig.with_rates",
        ),
        (
            "limiter.OutputRateLimiter.change_rates",
            "ratesfile.RatesFileWatcher",
            "ratesfile.parse_rates_file",
            "config.parse_output_rate",
        )
        + _mixin("update_output_rates", "_apply_pending_rates")
        + ("limits.UserLimits.apply_pending_rates",),
    ),
)

BY_ID: dict[str, Rule] = {rule.rule_id: rule for rule in RULES}


def expand(rule_ids: tuple[str, ...] | list[str]) -> list[str]:
    """Rule ids of a declaration, ranges expanded (``R1-R6``); ids outside R* are kept as given."""
    out: list[str] = []
    for rid in rule_ids:
        if "-" in rid and rid.startswith("R"):
            lo, hi = rid.split("-")
            out += [f"R{i}" for i in range(int(lo[1:]), int(hi.lstrip("R")) + 1)]
        else:
            out.append(rid)
    return out


# R23-R26: the multi-engine shared budget (docs/SPEC.md, "Multi-engine shared budget"):
# one budget per user across engines, leased from a shared GCRA in a store.
SHARED_BUDGET_RULES: tuple[Rule, ...] = (
    Rule(
        "R23",
        "lease is an atomic advance of the shared TAT",
        (
            "shared_budget.lease",
            "shared_budget.return_unused",
            "shared_budget.store_grants_at",
            "shared_budget.StoreState",
            "shared_budget.Lease",
        ),
        (
            "shared_budget.LEASE_LUA",
            "shared_budget.RETURN_LUA",
            "shared_budget.user_key",
            "shared_budget.SharedBudgetLimiter.emission_ns",
        ),
    ),
    Rule(
        "R24",
        "cross-engine window bound",
        (
            "shared_budget.shared_window_bound_tokens",
            "shared_budget.shared_ledger_burst_ns",
            "shared_budget.holding_cap",
            "shared_budget.lease_size",
            "shared_budget.wants_lease",
            "shared_budget.spend",
            "shared_budget.work_conservation_floor",
        ),
        (
            "shared_budget.SharedBudgetLimiter.grants_at",
            "shared_budget.SharedBudgetLimiter.take_counts",
            "shared_budget.SharedBudgetLimiter.refill_once",
            "shared_budget.SharedBudgetLimiter.lease_grants",
            "config.check_shared_budget_url",
        ),
    ),
    Rule(
        "R25",
        "store slow or down: fail closed",
        ("shared_budget.wants_lease", "shared_budget.Holding.spendable", "shared_budget.STORE_TIMEOUT_NS"),
        (
            "shared_budget.SharedBudgetLimiter._do_lease",
            "shared_budget.SharedBudgetLimiter._store_state",
            "shared_budget.SharedBudgetLimiter.ready_at_ns",
        ),
    ),
    Rule(
        "R26",
        "engine crash: no double spend, bounded loss",
        ("shared_budget.crash", "shared_budget.expire", "shared_budget.crash_delay_bound_ns", "shared_budget.Holding"),
        (
            "shared_budget.SharedBudgetLimiter._do_return",
            "shared_budget.SharedBudgetLimiter._expire_unconfirmed",
            "shared_budget.SharedBudgetLimiter.refill_once",
        ),
    ),
)
# R30-R32: identity an operator can trust (docs/SPEC.md, "Bound identity"): the user comes
# from a gateway's header or an API key, never from the client's body.
IDENTITY_RULES: tuple[Rule, ...] = (
    Rule(
        "R30",
        "bound identity",
        ("identity.bound_outcome", "identity.Outcome"),
        (
            "identity.parse_identity",
            "identity_middleware.IdentityMiddleware",
            "identity_middleware.resolve_user",
            "identity_middleware.bind_body",
            "keysfile.KeysFileWatcher",
            "keysfile.parse_keys_file",
            "plugin.identity_for_server",
            "plugin._install_identity_check",
        ),
    ),
    Rule(
        "R31",
        "a body that names its user",
        ("identity.bound_outcome",),
        ("identity_middleware.bind_body",),
    ),
    Rule(
        "R32",
        "no identity",
        ("identity.bound_outcome",),
        ("identity_middleware.resolve_user",),
    ),
)
RULES = RULES + SHARED_BUDGET_RULES + IDENTITY_RULES
BY_ID = {rule.rule_id: rule for rule in RULES}

# R27-R29: rate tables of real size (docs/SPEC.md, "Rate tables"): plans and prefix
# patterns, unlimited users, per-plan shadow.
RATE_TABLE_RULES: tuple[Rule, ...] = (
    Rule(
        "R27",
        "most specific table entry wins",
        ("tables.resolve", "tables.TableEntry"),
        (
            "ratetable.parse_table",
            "ratetable.RateTable.lookup",
            "ratetable.RateTable.prepare",
            "ratesfile.RatesFileWatcher.poll",
            "limiter.OutputRateLimiter.install",
            "scales.PreparedTable",
            "metrics.MetricsRecorder.label",
        ),
    ),
    Rule(
        "R28",
        "unlimited",
        ("tables.UNLIMITED", "limiter.try_take", "limiter.refund", "limiter.change_rates"),
        (
            "scales.UNLIMITED",
            "limiter.OutputRateLimiter.grants_at",
            "limiter.OutputRateLimiter.take_counts",
            "limiter.OutputRateLimiter.refund",
            "limiter.OutputRateLimiter.install",
        ),
    ),
    Rule(
        "R29",
        "per-plan shadow",
        ("tables.enforced_rate", "tables.shadow_rate"),
        ("ratetable.Entry.enforced_rate", "shadow.ShadowAccounting.step")
        + ("limits.UserLimits.plan_shadow_for",)
        + _mixin("_apply_pending_rates"),
    ),
)
RULES = RULES + RATE_TABLE_RULES
BY_ID = {rule.rule_id: rule for rule in RULES}
