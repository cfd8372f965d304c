"""``outrate soak``: a long randomized live run, checked online from the engine-side trace.

Runs ``vllm.LLM``'s engine in-process (engine core in its own process, reference scheduler,
the project's tiny model with dummy weights, or ``--model``) with ``output_rate.trace_path``
set, and drives a seeded random load: ``--users`` users with random limits arrive over the
first third of the run, each keeps up to ``--streams`` streams going with random prompt and
output lengths, and some streams are cancelled mid-way (client abort). Periodically and at
the end the online checker (``adapter.trace_check.TraceFollower``: each check reads only
what the engine appended since the previous one) verifies the trace; the process RSS
(this process and the engine core) and the limiter size (users holding a TAT, from the
trace) are watched. Prints a summary table and writes a PNG of cumulative sampling
dispatches per user over time against each user's R2 bound line.

Exit status 1 if the checker finds a violation or a stream fails.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

RATES = (10, 20, 50, 100)
CHECK_EVERY_S = 15.0


def _rss_mb() -> dict[str, float]:
    import psutil  # deferred: psutil adds ~50 ms, kept off `outrate --help`

    me = psutil.Process()
    rss = {"driver": me.memory_info().rss / 2**20}
    for child in me.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            rss[f"child-{child.pid}"] = child.memory_info().rss / 2**20
    return rss


def _plot(report, path: Path, burst_ns: int) -> None:
    import matplotlib  # deferred: matplotlib takes 1-2 s to import; only the plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # deferred: matplotlib takes 1-2 s to import; only the plot needs it

    fig, ax = plt.subplots(figsize=(9, 5.5))
    run = report.runs[-1]
    t0 = run.first_ns or 0
    for user in sorted(run.users.values(), key=lambda u: u.user):
        xs = [(t - t0) / 1e9 for t in user.dispatch_ns]
        limit = "unlimited" if user.rate is None else f"{float(user.rate):g} tok/s"
        (line,) = ax.step(xs, range(1, len(xs) + 1), where="post", label=f"{user.user} ({limit})")
        if xs and user.rate is not None:  # an unlimited user (R28) has no bound to draw
            # R2 bound from the user's first dispatch: floor((t - t_first + tau) x rate) + 1.
            end = xs[-1]
            grid = [xs[0] + end * k / 200 for k in range(201) if xs[0] + end * k / 200 <= end]
            ax.plot(
                grid,
                [math.floor((g - xs[0] + burst_ns / 1e9) * float(user.rate)) + 1 for g in grid],
                linestyle="--",
                color=line.get_color(),
                linewidth=0.8,
            )
    ax.set_xlabel("engine time since first dispatch (s)")
    ax.set_ylabel("cumulative sampling dispatches")
    ax.set_title("outrate soak: tokens per user (solid) vs R2 bound from first token (dashed)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@click.command("soak")
@click.option("--minutes", type=click.FloatRange(min=0.05), default=5.0, show_default=True)
@click.option("--users", type=click.IntRange(min=1, max=1000), default=4, show_default=True)
@click.option(
    "--streams", type=click.IntRange(min=1, max=64), default=2, show_default=True, help="Concurrent streams per user."
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--cancel-prob", type=click.FloatRange(0, 1), default=0.15, show_default=True)
@click.option("--model", default=None, help="Model directory; default: the project's tiny model (dummy weights).")
@click.option("--async-scheduling", "async_mode", is_flag=True, help="Use RateLimitedAsyncScheduler.")
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("reports/soak"),
    show_default=True,
    help="Trace, JSON summary and PNG go here.",
)
def soak(minutes, users, streams, seed, cancel_prob, model, async_mode, out_dir) -> None:
    """Randomized live load with cancels and arriving users, checked online from the engine trace."""
    # deferred: adapter.trace_check and its checker cost ~40 ms, kept off `outrate --help`
    from vllm_output_rate.adapter.trace_check import TraceFollower

    console = Console()
    rnd = random.Random(seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    trace = out_dir / "trace.jsonl"
    trace.unlink(missing_ok=True)
    names = [f"user{i}" for i in range(users)]
    limits = {u: rnd.choice(RATES) for u in names}
    arrive_s = {u: (0.0 if i == 0 else rnd.uniform(0, minutes * 20)) for i, u in enumerate(names)}
    llm = _soak_llm(model, users * streams, async_mode, limits, trace)
    engine = llm.llm_engine
    follower = TraceFollower(trace)
    rss_start = _rss_mb()
    started = time.monotonic()
    load = _Load(
        rnd,
        names,
        streams,
        cancel_prob,
        {u: [None] * streams for u in names},
        {(u, k): started + arrive_s[u] + rnd.uniform(0, 1) for u in names for k in range(streams)},
    )
    checks, rss_max = _drive(load, engine, follower, console, started, started + minutes * 60, dict(rss_start))
    wall_s = time.monotonic() - started
    rss_end = _rss_mb()
    del llm, engine
    report = follower.finish(completions=load.completions, cancelled=load.cancelled)
    run = report.runs[-1]
    rss = {"start": rss_start, "max": rss_max, "end": rss_end}
    _print_soak(
        console,
        report,
        f"outrate soak: {minutes:g} min, {users} users x {streams} streams, seed {seed}, "
        f"{'async' if async_mode else 'sync'}",
        names,
        limits,
        load,
        wall_s,
        rss,
    )
    png = out_dir / "soak.png"
    _plot(report, png, int(run.header.get("burst_ns", 100_000_000)))
    settings = {
        "minutes": minutes,
        "users": users,
        "streams": streams,
        "seed": seed,
        "async": async_mode,
        "limits": limits,
    }
    (out_dir / "soak.json").write_text(
        json.dumps(_soak_document(settings, report, load, wall_s, checks, rss), indent=2)
    )
    console.print(f"wrote {png} and {out_dir / 'soak.json'}")
    if report.violations:
        raise SystemExit(1)


def _print_soak(
    console: Any,
    report: Any,
    title: str,
    names: list[str],
    limits: dict[str, int],
    load: _Load,
    wall_s: float,
    rss: dict[str, dict[str, float]],
) -> None:
    """The soak's table (``title``; one row per user), its trace totals, the RSS per process
    (MB at start/max/end) and the online checker's verdict."""
    run = report.runs[-1]
    console.print(_soak_table(title, run, names, limits, load))
    console.print(
        f"trace: {run.steps} steps, max limiter users {run.max_limiter_users}, "
        f"max running {run.max_running}; wall {wall_s:.1f} s"
    )
    console.print(
        "RSS MB start/max/end: "
        + ", ".join(
            f"{k} {rss['start'].get(k, 0):.0f}/{rss['max'].get(k, 0):.0f}/{rss['end'].get(k, 0):.0f}"
            for k in rss["start"]
        )
    )
    console.print(report.summary() if report.violations else "online checker: 0 violations")


def _soak_document(
    settings: dict[str, Any], report: Any, load: _Load, wall_s: float, checks: Any, rss: dict[str, dict[str, float]]
) -> dict[str, Any]:
    """soak.json: the run's ``settings``, wall seconds, trace totals, streams done and
    cancelled, the checker's violations, RSS (MB) and each user's dispatches and rate."""
    run = report.runs[-1]
    return {
        **settings,
        "wall_s": wall_s,
        "steps": run.steps,
        "max_limiter_users": run.max_limiter_users,
        "streams_done": len(load.completions),
        "cancelled": len(load.cancelled),
        "violations": [str(v) for v in report.violations],
        "checks": checks,
        "rss_mb": rss,
        "per_user": {u: {"dispatches": s.dispatches, "engine_rate": s.engine_rate} for u, s in run.users.items()},
    }


def _soak_llm(model: str | None, seats: int, async_mode: bool, limits: dict[str, int], trace: Path) -> Any:
    """The in-process ``vllm.LLM`` of the soak: the reference scheduler, the tiny model (dummy
    weights) unless ``model``, up to ``seats`` (users x streams, 8..64) resident requests."""
    from vllm import LLM  # deferred: vLLM costs ~7 s to import; only a soak run needs it

    # deferred: adapter.tinymodel loads tokenizers (~50 ms), kept off `outrate --help`
    from vllm_output_rate.adapter.tinymodel import default_model_dir

    cls = "RateLimitedAsyncScheduler" if async_mode else "RateLimitedScheduler"
    return LLM(
        model=model or str(default_model_dir()),
        load_format="dummy" if model is None else "auto",
        skip_tokenizer_init=model is None,
        dtype="float32" if model is None else "auto",
        max_model_len=512,
        max_num_seqs=max(8, min(64, seats)),
        enforce_eager=True,
        enable_prefix_caching=False,
        gpu_memory_utilization=0.2 if model is None else 0.8,
        kv_cache_memory_bytes=(128 * 2**20) if model is None else None,
        async_scheduling=async_mode,
        scheduler_cls=f"vllm_output_rate.reference.scheduler.{cls}",
        additional_config={
            "output_rate": {"default_tokens_per_s": 100, "user_tokens_per_s": limits, "trace_path": str(trace)}
        },
    )


@dataclass
class _Load:
    """The soak's seeded load: per (user, stream) slot the request it runs (or None) and when
    the next one starts; cancels due, tokens so far, finished or cancelled streams' tokens."""

    rnd: random.Random
    names: list[str]
    streams: int
    cancel_prob: float
    slots: dict[str, list[str | None]]  # request id or None
    next_start: dict[tuple[str, int], float]
    cancel_at: dict[str, float] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    completions: dict[str, int] = field(default_factory=dict)
    cancelled: set[str] = field(default_factory=set)
    counter: int = 0

    def active(self) -> bool:
        return any(r is not None for s in self.slots.values() for r in s)

    def start_and_cancel(self, engine: Any, now: float, deadline: float) -> None:
        """Start a request in every free slot whose start time has come (before ``deadline``),
        with random prompt and output lengths; abort the requests whose cancel time has come."""
        from vllm import SamplingParams  # deferred: vLLM costs ~7 s to import; only a soak run needs it

        rnd = self.rnd
        for u in self.names:
            for k in range(self.streams):
                rid = self.slots[u][k]
                if rid is None and now < deadline and now >= self.next_start[(u, k)]:
                    rid = f"{u}-s{k}-r{self.counter}"
                    self.counter += 1
                    prompt = [rnd.randint(10, 500) for _ in range(rnd.randint(4, 64))]
                    params = SamplingParams(
                        max_tokens=rnd.randint(8, 120),
                        ignore_eos=rnd.random() < 0.7,
                        detokenize=False,
                        extra_args={"output_rate_user": u},
                    )
                    engine.add_request(rid, {"prompt_token_ids": prompt}, params)
                    self.slots[u][k], self.tokens[rid] = rid, 0
                    if rnd.random() < self.cancel_prob:
                        self.cancel_at[rid] = now + rnd.uniform(0.2, 3.0)
                elif rid is not None and rid in self.cancel_at and now >= self.cancel_at[rid]:
                    engine.abort_request([rid])
                    self.cancelled.add(rid)
                    self.completions[rid] = self.tokens[rid]
                    del self.cancel_at[rid]
                    self.slots[u][k] = None
                    self.next_start[(u, k)] = now + rnd.uniform(0, 2)

    def collect(self, outputs: Any) -> None:
        """Count the tokens of one ``engine.step()``'s outputs; free the slots of finished streams."""
        for out in outputs:
            if out.request_id in self.cancelled:
                continue
            self.tokens[out.request_id] = len(out.outputs[0].token_ids)
            if out.finished:
                self.completions[out.request_id] = self.tokens[out.request_id]
                self.cancel_at.pop(out.request_id, None)
                u, k = out.request_id.split("-s")[0], int(out.request_id.split("-s")[1].split("-")[0])
                self.slots[u][k] = None
                self.next_start[(u, k)] = time.monotonic() + self.rnd.uniform(0, 2)


def _drive(
    load: _Load, engine: Any, follower: Any, console: Any, started: float, deadline: float, rss_max: dict[str, float]
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Run the load until ``deadline`` and every stream has ended, stepping the engine and
    checking the trace every ``CHECK_EVERY_S`` s; returns the checks and the peak RSS (MB)."""
    checks: list[dict[str, Any]] = []
    next_check = started + CHECK_EVERY_S
    while True:
        now = time.monotonic()
        if now >= deadline and not load.active():
            break
        load.start_and_cancel(engine, now, deadline)
        if engine.has_unfinished_requests():
            load.collect(engine.step())
        else:
            time.sleep(0.01)
        if time.monotonic() >= next_check:
            partial = follower.poll()
            rss = _rss_mb()
            rss_max = {k: max(v, rss_max.get(k, 0.0)) for k, v in rss.items()}
            checks.append(
                {
                    "t_s": round(time.monotonic() - started, 1),
                    "violations": len(partial.violations),
                    "rss_mb": {k: round(v, 1) for k, v in rss.items()},
                }
            )
            console.print(
                f"[{checks[-1]['t_s']:>7.1f} s] check: {len(partial.violations)} violation(s); "
                f"{len(load.completions)} streams done; RSS " + ", ".join(f"{k} {v:.0f} MB" for k, v in rss.items())
            )
            next_check = time.monotonic() + CHECK_EVERY_S
    return checks, rss_max


def _soak_table(title: str, run: Any, names: list[str], limits: dict[str, int], load: _Load) -> Any:
    """Per user: limit, streams done and cancelled, dispatches, engine rate and its share of the limit."""
    table = Table(title=title)
    for col in ("user", "limit tok/s", "streams done", "cancelled", "dispatches", "engine tok/s", "busy share"):
        table.add_column(col, justify="right")
    for u in names:
        s = run.users.get(u)
        mine = [r for r in load.completions if r.startswith(u + "-")]
        rate = s.engine_rate if s else None
        table.add_row(
            u,
            str(limits[u]),
            str(len(mine)),
            str(sum(r in load.cancelled for r in mine)),
            str(s.dispatches if s else 0),
            "-" if rate is None else f"{rate:.2f}",
            "-" if rate is None else f"{rate / limits[u]:.2f}",
        )
    return table
