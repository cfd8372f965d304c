"""The report of ``outrate bench``: the machine, the tables of each benchmark and the plot."""

from __future__ import annotations

import os
import platform
import statistics
from pathlib import Path
from typing import Any

from rich.table import Table

from vllm_output_rate.bench.common import (
    LIVE_CPU_TARGET_PERCENT,
    LIVE_RATIO_TARGET,
    NOT_BINDING_TARGET,
    THROTTLED_VS_ARTICLE_TARGET,
)
from vllm_output_rate.bench.scheduler import SchedulerRow


# -- environment, tables, plot ------------------------------------------------------------
def machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cores": os.cpu_count(),
        "cpu": cpu,
        "python": platform.python_version(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def _scheduler_table(rows: list[SchedulerRow], clock: str) -> Table:
    instances = rows[0].instances if rows else 1
    table = Table(
        title=f"scheduler step: schedule() + update_from_output(), {clock} µs per step (median of rounds; "
        f"each kind the median of {instances} scheduler{'s' if instances > 1 else ''})"
    )
    for col in (
        "mode",
        "running",
        "throttled",
        "stock µs",
        "reference µs",
        "ratio",
        "ratio range",
        "stock / stock (control)",
        "article-style µs",
        "article-style ratio",
        "reference / article-style",
        "per request over stock µs",
        "try_take floor µs",
    ):
        table.add_column(col, justify="left" if col == "mode" else "right")
    for r in rows:
        style = "green" if r.ratio <= NOT_BINDING_TARGET else ("yellow" if r.ratio <= 1.10 else "red")
        versus = "-"
        if r.reference_article_ratio is not None:
            versus = f"{r.reference_article_ratio:.3f}"
            if r.throttled_fraction > 0:
                good = r.reference_article_ratio <= THROTTLED_VS_ARTICLE_TARGET
                versus = f"[{'green' if good else 'red'}]{versus}[/]"
        table.add_row(
            r.mode,
            str(r.running),
            f"{r.throttled_fraction:.0%} ({r.throttled_requests})",
            f"{r.stock_us:,.0f}",
            f"{r.reference_us:,.0f}",
            f"[{style}]{r.ratio:.3f}[/]",
            f"{r.ratio_min:.2f}-{r.ratio_max:.2f}",
            "-" if r.control_ratio is None else f"{r.control_ratio:.3f}",
            "-" if r.article_us is None else f"{r.article_us:,.0f}",
            "-" if r.article_ratio is None else f"{r.article_ratio:.3f}",
            versus,
            f"{r.per_request_over_stock_us:+.2f}",
            "-" if r.try_take_floor_us is None else f"{r.try_take_floor_us:.3f}",
        )
    return table


def _shared_table(shared: dict[str, Any], clock: str) -> Table:
    """R23-R26: the shared-budget reference against the single-engine reference, per row."""
    table = Table(
        title=f"shared budget (Redis, R23-R26) vs single-engine reference: schedule() + "
        f"update_from_output(), {clock} µs per step (median of rounds); store round trips"
    )
    for col in (
        "running",
        "users x rate",
        "single µs",
        "shared µs",
        "ratio",
        "ratio range",
        "round trips/s",
        "round trips/token",
        "tokens/s single",
        "tokens/s shared",
    ):
        table.add_column(col, justify="right")
    for r in shared["rows"]:
        rate = "not binding" if r["rate_tokens_per_s"] >= 10**9 else f"{r['rate_tokens_per_s']:g} tok/s"
        style = "green" if r["ratio"] <= 1.05 else ("yellow" if r["ratio"] <= 1.15 else "red")
        table.add_row(
            str(r["running"]),
            f"{r['users']} x {rate}",
            f"{r['single_us']:,.0f}",
            f"{r['shared_us']:,.0f}",
            f"[{style}]{r['ratio']:.3f}[/]",
            f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f}",
            f"{r['round_trips_per_s']:,.0f}",
            f"{r['round_trips_per_token']:.4f}",
            f"{r['single_tokens_per_s']:,.0f}",
            f"{r['tokens_per_s']:,.0f}",
        )
    return table


def _met(ok: bool) -> str:
    """A target's result cell: green "met" or red "missed"."""
    return "[green]met[/]" if ok else "[red]missed[/]"


def _limiter_table(lim: dict[str, Any]) -> Table:
    table = Table(title=f"OutputRateLimiter, {lim['users']} users, median of {lim['batches']} batches")
    table.add_column("operation")
    table.add_column("ops/s", justify="right")
    table.add_column("ns/op", justify="right")
    table.add_column("target >= 1e6/s")
    for name, key in (
        ("try_take (granted)", "try_take_per_s"),
        ("try_take (refused)", "try_take_refused_per_s"),
        ("refund", "refund_per_s"),
    ):
        rate = lim[key]
        table.add_row(
            name,
            f"{rate:,.0f}",
            f"{1e9 / rate:.0f}",
            _met(rate >= lim["target_per_s"]),
        )
    return table


def _live_table(live: dict[str, Any]) -> Table:
    t = live["throughput"]
    table = Table(
        title=f"live engine (tiny model): {t['streams']} streams x {t['tokens_per_stream']} tokens, "
        f"median of {t['rounds']} interleaved rounds; engine-core CPU with every user throttled"
    )
    for col in ("measure", "value", "target", "result"):
        table.add_column(col, justify="left" if col in ("measure", "target") else "right")
    table.add_row("tokens/s, feature off", f"{live['tokens_per_s_off']:,.0f}", "", "")
    table.add_row("tokens/s, on, not binding", f"{live['tokens_per_s_on']:,.0f}", "", "")
    table.add_row(
        "ratio on / off (median of per-round ratios; min-max)",
        f"{live['ratio']:.3f} ({t['ratio_min']:.2f}-{t['ratio_max']:.2f})",
        f">= {LIVE_RATIO_TARGET}",
        _met(live["ratio"] >= LIVE_RATIO_TARGET),
    )
    if "ratio_quartiles" in t:
        q1, q3 = t["ratio_quartiles"]
        table.add_row("per-round ratio, quartiles", f"{q1:.3f}-{q3:.3f}", "", "")
    table.add_row("ratio of the median tokens/s", f"{live['tokens_per_s_on'] / live['tokens_per_s_off']:.3f}", "", "")
    if "worker_fix_ratio" in t:
        table.add_row(
            "worker idle fix while decoding: tokens/s fix on / off (median of per-round ratios; min-max)",
            f"{t['worker_fix_ratio']:.3f} ({t['worker_fix_ratio_min']:.2f}-{t['worker_fix_ratio_max']:.2f})",
            "~1",
            "",
        )
        table.add_row(
            "worker idle fix while decoding: engine CPU per token, fix on / off",
            "-" if t["worker_fix_cpu_ratio"] is None else f"{t['worker_fix_cpu_ratio']:.3f}",
            "~1",
            "",
        )
    cpu_rows = [("engine CPU % throttled, wait plugin", 'engine CPU % throttled, VLLM_PLUGINS=""', "engine_cpu")]
    if live.get("engine_worker_cpu_throttled_with_wait") is not None:
        cpu_rows.append(
            (
                "engine core + worker CPU % throttled, plugin",
                'engine core + worker CPU % throttled, VLLM_PLUGINS=""',
                "engine_worker_cpu",
            )
        )
    for with_wait, without_wait, key in cpu_rows:
        percent = live[f"{key}_throttled_with_wait"]
        table.add_row(
            with_wait, f"{percent:.1f}", f"< {LIVE_CPU_TARGET_PERCENT:g}", _met(percent < LIVE_CPU_TARGET_PERCENT)
        )
        table.add_row(without_wait, f"{live[f'{key}_throttled_without_wait']:.1f}", "", "")
    return table


def _idle_table(live: dict[str, Any]) -> Table:
    """Idle cost (R16; issue 15 item 6): the throttled runs and the ping run side by side."""
    table = Table(
        title="every user throttled: CPU in percent of one core over the run's wall time "
        "(engine core / worker / both), and the R2 minimum wall time"
    )
    for col in ("set-up", "engine core", "worker", "both", "worker wake-ups/s", "wall s (min)", "stock idle (both)"):
        table.add_column(col, justify="left" if col == "set-up" else "right")
    names = {
        "with_wait": "plugin: R16 wait + worker idle fix",
        "wait_worker_spins": "R16 wait, worker spins (VLLM_OUTPUT_RATE_WORKER_PARK=0)",
        "without_wait": 'no plugin (VLLM_PLUGINS="")',
    }
    for key, label in names.items():
        run = live.get(f"throttled_{key}")
        if run is None:
            continue
        cpu, idle = run["cpu_percent"], run["idle_cpu_percent"]
        table.add_row(
            label,
            f"{cpu['engine_core']:.1f}",
            f"{cpu.get('worker', 0.0):.1f}",
            f"{run['engine_and_workers_cpu_percent']:.1f}",
            f"{run.get('wakeups_per_s', {}).get('worker', float('nan')):.0f}",
            f"{run['wall_s']:.2f} ({run['min_wall_s']:.2f})",
            f"{sum(v for role, v in idle.items() if role != 'front_end'):.1f}",
        )
    pings = live.get("pings")
    if pings:
        labels = {
            "lossless_park": "pings: worker parks, lossless pings (plugin)",
            "vllm_park": "pings: worker parks, vLLM's pings (SNDHWM 1)",
            "vllm_spin": "pings: vLLM's 1 s spin",
        }
        for key, label in labels.items():
            r = pings[key]
            table.add_row(
                label,
                "",
                "",
                "",
                "",
                f"lost {r['lost']} of {r['messages']}",
                f"round trip p50 {r['round_trip_us_p50']:.0f} µs, p99 {r['round_trip_us_p99']:.0f} µs",
            )
    return table


def _gate_table(gate: dict[str, Any]) -> Table:
    table = Table(title="gate throughput")
    for col in ("check", "what", "scenarios", "steps", "seconds", "rate"):
        table.add_column(col, justify="left" if col in ("check", "what") else "right")
    for r in gate["rows"]:
        if "states_per_s" in r:
            rate = f"{r['states_per_s']:,.0f} states/s"
        else:
            rate = f"{r['scenarios_per_s']:,.1f} scenarios/s, {r['steps_per_s']:,.0f} steps/s"
        table.add_row(
            r["check"],
            r["what"],
            str(r.get("scenarios", "-")),
            str(r.get("steps", r.get("states", "-"))),
            f"{r['seconds']:.1f}",
            rate,
        )
    for name, _why in gate["skipped"].items():
        table.add_row(name, "skipped: not available (reason below)", "-", "-", "-", "-")
    return table


def profile_tables(prof: dict[str, Any], profile_n: int, steps: int) -> list[Table]:
    """``--profile``: the functions by self time, and the project's by cumulative time."""
    fraction = prof.get("throttled_fraction", 0.0)
    calls = "schedule() + update_from_output()" if prof.get("calls", "schedule") != "schedule" else "schedule()"
    head = (
        f"cProfile: {prof.get('scheduler', 'RateLimitedScheduler')} {calls} at {profile_n} running, "
        f"{f'{fraction:.0%} throttled' if fraction else 'limit not binding'}, {steps} steps, "
        f"{prof['total_us_per_step']:,.0f} µs/step under the profiler"
    )
    tables = []
    for title, key in (
        (f"{head}; by self time", "top_self"),
        ("this checkout's functions (the scheduler's own code) by cumulative time", "project_cumulative"),
    ):
        table = Table(title=title)
        for col in ("function", "calls/step", "self %", "cum %", "self µs/step", "cum µs/step"):
            table.add_column(col, justify="left" if col == "function" else "right")
        for r in prof[key]:
            table.add_row(
                r["function"],
                f"{r['calls_per_step']:.0f}",
                f"{100 * r['self_share']:.1f}",
                f"{100 * r['cum_share']:.1f}",
                f"{r['self_us_per_step']:.0f}",
                f"{r['cum_us_per_step']:.0f}",
            )
        tables.append(table)
    return tables


def write_plot(rows: list[SchedulerRow], path: Path, title: str) -> None:
    """Per-step cost against running requests (log-log), the ratio to stock, and (when the
    article-style peer was timed) reference / article-style with requests throttled."""
    import matplotlib  # deferred: matplotlib takes 1-2 s to import; only the plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # deferred: matplotlib takes 1-2 s to import; only the plot needs it

    fig, (ax_cost, ax_ratio, ax_peer) = plt.subplots(1, 3, figsize=(17, 4.8))
    colors = {0.0: "tab:blue", 0.5: "tab:orange", 0.9: "tab:red"}
    for mode, dash in (("sync", "-"), ("async", "--")):
        mine = [r for r in rows if r.mode == mode]
        if not mine:
            continue
        sizes = sorted({r.running for r in mine})
        stock = [statistics.median([r.stock_us for r in mine if r.running == n]) for n in sizes]
        ax_cost.plot(sizes, stock, dash, color="black", marker="o", label=f"stock vLLM ({mode})")
        for fraction in sorted({r.throttled_fraction for r in mine}):
            sel = sorted((r for r in mine if r.throttled_fraction == fraction), key=lambda r: r.running)
            label = f"reference, {fraction:.0%} throttled ({mode})"
            for ax, field in ((ax_cost, "reference_us"), (ax_ratio, "ratio")):
                ax.plot(
                    [r.running for r in sel],
                    [getattr(r, field) for r in sel],
                    dash,
                    color=colors.get(fraction, "tab:green"),
                    marker="s",
                    label=label,
                )
    for ax in (ax_cost, ax_ratio):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("running requests")
        ax.grid(True, which="both", alpha=0.3)
    ax_cost.set_yscale("log")
    ax_cost.set_ylabel("µs per step (schedule + update_from_output)")
    ax_cost.set_title("per-step cost")
    ax_ratio.axhline(1.0, color="black", linewidth=0.8)
    ax_ratio.axhline(NOT_BINDING_TARGET, color="grey", linewidth=0.8, linestyle=":")
    ax_ratio.annotate(
        f"{NOT_BINDING_TARGET} (target, limit not binding)",
        (ax_ratio.get_xlim()[0], NOT_BINDING_TARGET),
        xytext=(4, 3),
        textcoords="offset points",
        fontsize=7,
        color="grey",
    )
    ax_ratio.set_ylabel("reference / stock")
    ax_ratio.set_title("ratio to stock vLLM")
    _plot_versus_article(ax_peer, rows, colors)
    ax_cost.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_versus_article(ax: Any, rows: list[SchedulerRow], colors: dict[float, str]) -> None:
    """reference / article-style against running requests, per throttled fraction and mode."""
    for mode, dash in (("sync", "-"), ("async", "--")):
        for fraction in sorted({r.throttled_fraction for r in rows if r.throttled_fraction > 0}):
            sel = sorted(
                (
                    r
                    for r in rows
                    if r.mode == mode and r.throttled_fraction == fraction and r.reference_article_ratio is not None
                ),
                key=lambda r: r.running,
            )
            if sel:
                ax.plot(
                    [r.running for r in sel],
                    [r.reference_article_ratio for r in sel],
                    dash,
                    color=colors.get(fraction, "tab:green"),
                    marker="s",
                    label=f"{fraction:.0%} throttled ({mode})",
                )
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.axhline(THROTTLED_VS_ARTICLE_TARGET, color="grey", linewidth=0.8, linestyle=":")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("running requests")
    ax.grid(True, which="both", alpha=0.3)
    ax.set_ylabel("reference / article-style")
    ax.set_title(f"throttled: against the article-style peer (target <= {THROTTLED_VS_ARTICLE_TARGET})")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
