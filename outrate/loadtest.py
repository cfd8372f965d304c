"""``outrate measure``: per-user output rates of a running server, measured the article's way.

Opens concurrent streaming chat completions (``vllm_xargs: {"output_rate_user": USER}``,
``ignore_eos``, ``max_tokens`` tokens each) against an OpenAI-compatible vLLM server and
reports, per user:

- client-side rate = the user's tokens / (last token - first token) over all its streams,
  timestamps taken when each streamed chunk arrives (the article's method; HTTP
  buffering blurs it a little);
- engine-side rate, if the server runs with ``--enable-per-request-metrics``: the same
  span rebuilt from vLLM's per-request timings (queue, time to first token, first-to-last
  token, all taken by the engine core), each stream anchored at its send time;
- the GCRA lower bound on the span for a limit given with ``--limit USER=RATE``:
  N tokens need at least (N - 1)/rate - tau (R2 bound read backwards);
- ``completion_tokens`` of every stream;
- with ``--server-pid``, the CPU used by the engine-core (and worker) processes during the
  run, from psutil.

The core is ``run_measurement()`` (asyncio + httpx), reused by the live test; it can also
cancel chosen streams by closing their connection after some tokens (``cancel_after``).

Source: docs/SPEC.md R2, R16; docs/PERFORMANCE.md "Live engine (tiny model on CPU)".
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlsplit

import click

from vllm_output_rate.clitools import json_option, shown_default_option

BURST_S = 0.1
DEFAULT_PROMPT = "Tell me about rate limits."


@dataclass
class StreamResult:
    user: str
    index: int
    sent_s: float  # client monotonic clock
    token_times_s: list[float] = field(default_factory=list)  # arrival of each token
    completion_tokens: int | None = None
    finish_reason: str | None = None
    engine_metrics: dict[str, Any] | None = None
    error: str | None = None
    request_id: str | None = None  # the chunks' "id"; the engine's id is this plus "-" and 8 characters
    cancelled: bool = False  # the client closed the connection after ``cancel_after`` tokens
    connect_failed: bool = False  # nothing answered (``error`` says how)

    @property
    def engine_first_last_s(self) -> tuple[float, float] | None:
        """Engine-side first/last token times on the client clock, anchored at the send time."""
        m = self.engine_metrics or {}
        needed = ("queue_time_ms", "time_to_first_token_ms", "generation_time_ms")
        if any(m.get(k) is None for k in needed):
            return None
        first = self.sent_s + (m["queue_time_ms"] + m["time_to_first_token_ms"]) / 1000
        return first, first + m["generation_time_ms"] / 1000


@dataclass
class UserReport:
    user: str
    streams: int
    tokens: int
    completion_tokens: list[int | None]
    client_span_s: float | None
    client_rate: float | None
    send_to_last_s: float | None
    engine_span_s: float | None
    engine_rate: float | None
    limit: float | None
    min_span_s: float | None  # GCRA lower bound on the first-to-last span

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def gcra_min_span_s(tokens: int, rate: float, burst_s: float = BURST_S) -> float:
    """R2: N grants from one user need a first-to-last span of at least (N - 1)/rate - tau.

    From the window bound: grants in any window W <= floor((W + tau) x rate) + 1.
    """
    return max(0.0, (tokens - 1) / rate - burst_s)


SPAN_SLACK_S = 0.002  # engine metrics come in whole ms: a span this far below R2's is rounding


def span_notes(reports: list[UserReport]) -> list[str]:
    """Lines for ``outrate measure`` under its table, one per user whose measured span is
    below R2's minimum (``min_span_s``, seconds).

    A client span below it is no violation: the client sees each token after the server's
    streaming and the network, so the first token can come late and the last on time. An
    engine span more than ``SPAN_SLACK_S`` below it means more tokens than the limit allows
    (to be confirmed on the engine trace with ``outrate check-trace``).
    """
    notes = []
    for r in reports:
        if r.min_span_s is None:
            continue
        if r.engine_span_s is not None and r.engine_span_s < r.min_span_s - SPAN_SLACK_S:
            notes.append(
                f"{r.user}: engine span {r.engine_span_s:.3f} s is below R2's minimum {r.min_span_s:.3f} s: "
                "more tokens than the limit allows (confirm on the engine trace: outrate check-trace)"
            )
        if r.client_span_s is not None and r.client_span_s < r.min_span_s:
            notes.append(
                f"{r.user}: client span {r.client_span_s:.3f} s is below R2's minimum {r.min_span_s:.3f} s by "
                f"{r.min_span_s - r.client_span_s:.3f} s: no violation, the client sees tokens after streaming "
                "delays; R2 bounds the engine span"
            )
    return notes


async def _sse_data(response):
    """The ``data:`` payloads of a server-sent-event stream.

    Split on ``\\n`` only: generated text may hold U+2028, U+0085 and other characters that
    ``str.splitlines`` (and so ``httpx``'s ``aiter_lines``) would take for line breaks.
    """
    buffer = b""
    async for raw in response.aiter_bytes():
        buffer += raw
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            if line.startswith(b"data: "):
                yield line[6:].decode("utf-8")
    if buffer.startswith(b"data: "):
        yield buffer[6:].decode("utf-8")


async def _one_stream(
    client,
    url: str,
    model: str,
    user: str,
    index: int,
    tokens: int,
    prompt: str,
    t0: float,
    cancel_after: int | None = None,
) -> StreamResult:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,  # vLLM extra body
        "return_token_ids": True,  # count tokens exactly, whatever text they decode to
        "vllm_xargs": {"output_rate_user": user},
    }
    result = StreamResult(user, index, sent_s=time.monotonic() - t0)
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:300]}"
                return result
            async for data in _sse_data(response):
                if data.strip() == "[DONE]":
                    break
                now = time.monotonic() - t0
                chunk = json.loads(data)
                result.request_id = result.request_id or chunk.get("id")
                for choice in chunk.get("choices") or ():
                    ids = choice.get("token_ids")
                    n = len(ids) if ids else (1 if (choice.get("delta") or {}).get("content") else 0)
                    result.token_times_s.extend([now] * n)
                    if choice.get("finish_reason"):
                        result.finish_reason = choice["finish_reason"]
                if chunk.get("usage"):
                    result.completion_tokens = chunk["usage"].get("completion_tokens")
                if chunk.get("metrics"):
                    result.engine_metrics = chunk["metrics"]
                if cancel_after is not None and len(result.token_times_s) >= cancel_after:
                    result.cancelled = True
                    break  # leaving the stream context closes the connection: the server aborts
    except Exception as exc:  # reported per stream; the other streams go on
        result.error = f"{type(exc).__name__}: {exc}"
        result.connect_failed = _is_connect_error(exc)
    return result


def _is_connect_error(exc: BaseException) -> bool:
    """True if ``exc`` means that nothing answered (httpx's connect errors and timeouts)."""
    import httpx  # deferred: httpx costs ~0.3 s to import, kept off `outrate --help`

    return isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout, httpx.UnsupportedProtocol))


class ServerUnreachable(RuntimeError):
    """No server answers at the base URL (connection refused, unknown host, timeout), or
    what answers is not an OpenAI-compatible server; the message names the URL and what
    to do."""


def _unreachable(base_url: str, error: str) -> ServerUnreachable:
    """The ``ServerUnreachable`` for ``base_url`` after the connection error ``error``."""
    return ServerUnreachable(
        f"no server answers at {base_url} ({error}); start one with "
        "`outrate serve MODEL --default-user-output-tokens-per-second R ...` or fix --base-url"
    )


def check_base_url(base_url: str) -> str:
    """``base_url`` if it is an ``http://`` or ``https://`` URL with a host (and a valid
    port, if any), e.g. ``http://127.0.0.1:8000``.

    Raises:
        ValueError: naming the value and what a base URL looks like.
    """
    example = "give the server's address, e.g. http://127.0.0.1:8000"
    try:
        parts = urlsplit(base_url)
        parts.port  # noqa: B018 -- raises ValueError on a bad port
    except ValueError as exc:
        raise ValueError(f"{base_url!r} is not a URL ({exc}); {example}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{base_url!r} is not an http:// or https:// URL with a host; {example}")
    return base_url


async def _served_model(client, base_url: str) -> str:
    """The first model of the server's ``/v1/models``.

    Raises:
        ServerUnreachable: nothing answers, or the answer is not a model list.
    """
    import httpx  # deferred: httpx costs ~0.3 s to import, kept off `outrate --help`

    try:
        response = await client.get("/v1/models")
    except (httpx.TransportError, OSError) as exc:
        raise _unreachable(base_url, f"{type(exc).__name__}: {exc}") from None
    try:
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPStatusError, ValueError, KeyError, IndexError, TypeError):
        raise ServerUnreachable(
            f"the server at {base_url} answered GET /v1/models with HTTP {response.status_code} and no model "
            f"list ({response.text[:120]!r}); is --base-url an OpenAI-compatible vLLM server? (or give --model)"
        ) from None


async def _run(
    base_url: str,
    model: str | None,
    streams: list[tuple[str, int]],
    tokens: int,
    prompt: str,
    timeout_s: float,
    cancel_after: dict[tuple[str, int], int],
) -> tuple[str, list[StreamResult]]:
    import httpx  # deferred: httpx costs ~0.3 s to import, kept off `outrate --help`

    limits = httpx.Limits(max_connections=sum(n for _, n in streams) + 2)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits) as client:
        if model is None:
            model = await _served_model(client, base_url)
        t0 = time.monotonic()
        jobs = [
            _one_stream(client, "/v1/chat/completions", model, user, i, tokens, prompt, t0, cancel_after.get((user, i)))
            for user, n in streams
            for i in range(n)
        ]
        results = list(await asyncio.gather(*jobs))
        if results and all(r.connect_failed for r in results):
            raise _unreachable(base_url, results[0].error or "")
        return model, results


def run_measurement(
    base_url: str,
    streams: list[tuple[str, int]],
    tokens: int,
    model: str | None = None,
    limits: dict[str, float] | None = None,
    prompt: str = DEFAULT_PROMPT,
    timeout_s: float = 600.0,
    cancel_after: dict[tuple[str, int], int] | None = None,
) -> tuple[list[UserReport], list[StreamResult]]:
    """Run the streams concurrently; return one report per user and the raw stream results.

    ``cancel_after``: (user, stream index) -> close that stream's connection (a client
    cancel) once it has received this many tokens.

    Raises:
        ServerUnreachable: nothing answers at ``base_url`` (no stream could connect), or
            its ``/v1/models`` is no model list (``model`` None).
    """
    limits = limits or {}
    _, results = asyncio.run(_run(base_url, model, streams, tokens, prompt, timeout_s, cancel_after or {}))
    reports = []
    for user, n in streams:
        mine = [r for r in results if r.user == user]
        times = [t for r in mine for t in r.token_times_s]
        count = len(times)
        span = max(times) - min(times) if count >= 2 else None
        engine = [r.engine_first_last_s for r in mine]
        ends = [e for e in engine if e is not None]
        engine_span = None
        if engine and len(ends) == len(engine):
            engine_span = max(e[1] for e in ends) - min(e[0] for e in ends)
        limit = limits.get(user)
        reports.append(
            UserReport(
                user=user,
                streams=n,
                tokens=count,
                completion_tokens=[r.completion_tokens for r in mine],
                client_span_s=span,
                client_rate=count / span if span else None,
                send_to_last_s=max(times) - min(r.sent_s for r in mine) if times else None,
                engine_span_s=engine_span,
                engine_rate=count / engine_span if engine_span else None,
                limit=limit,
                min_span_s=gcra_min_span_s(count, limit) if limit and count else None,
            )
        )
    return reports, results


def engine_processes(server_pid: int) -> dict[str, Any]:
    """The engine-core and worker processes below ``server_pid`` (psutil), by role."""
    import psutil  # deferred: psutil adds ~50 ms, kept off `outrate --help`

    found: dict[str, Any] = {}
    for proc in psutil.Process(server_pid).children(recursive=True):
        try:
            title = " ".join(proc.cmdline()) or proc.name()
        except psutil.Error:
            continue
        if "EngineCore" in title:
            found.setdefault("engine_core", proc)
        elif "Worker" in title:
            found.setdefault("worker", proc)
    return found


def _cpu_s(proc) -> float:
    times = proc.cpu_times()
    return times.user + times.system


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def _parse_stream(text: str) -> tuple[str, int]:
    user, sep, n = text.rpartition(":")
    if not sep or not user or not n.isdigit() or int(n) < 1:
        raise click.BadParameter(f"expected USER:STREAMS, e.g. user-a:4, got {text!r}", param_hint="--stream")
    return user, int(n)


def _parse_limit(text: str) -> tuple[str, float]:
    user, sep, rate = text.rpartition("=")
    try:
        value = float(rate)
    except ValueError:
        value = -1.0
    if not sep or not user or not value > 0 or not math.isfinite(value):
        raise click.BadParameter(f"expected USER=TOKENS_PER_S, e.g. user-a=20, got {text!r}", param_hint="--limit")
    return user, value


@click.command("measure")
@click.option("--base-url", default="http://127.0.0.1:8000", show_default=True, help="The server's address.")
@click.option("--model", default=None, help="Served model name; default: the first of /v1/models.")
@click.option(
    "--stream",
    "streams",
    multiple=True,
    required=True,
    metavar="USER:N",
    help="N concurrent streams of USER (repeat per user), e.g. --stream user-a:4 --stream user-b:2.",
)
@shown_default_option("--tokens", click.IntRange(min=1), 200, "Output tokens per stream (ignore_eos).")
@click.option(
    "--limit",
    "limit_args",
    multiple=True,
    metavar="USER=RATE",
    help="The user's configured limit, to print the GCRA lower bound on its span.",
)
@click.option("--prompt", default=DEFAULT_PROMPT, show_default=True)
@click.option(
    "--server-pid",
    type=int,
    default=None,
    help="PID of the vLLM API server: report its engine-core/worker CPU use during the run.",
)
@json_option("the per-user reports and per-stream results")
def measure(base_url, model, streams, tokens, limit_args, prompt, server_pid, json_path) -> None:
    """Measure per-user output rates of a running server (streaming chat completions).

    Exit 0: every stream finished; 1: no server answers at --base-url, or a stream
    failed (each named on stderr); 2: bad arguments (a malformed --base-url included).
    """
    try:
        check_base_url(base_url)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--base-url") from None
    plan = [_parse_stream(s) for s in streams]
    limits = dict(_parse_limit(s) for s in limit_args)
    procs, cpu0 = {}, {}
    if server_pid is not None:
        procs = engine_processes(server_pid)
        cpu0 = {role: _cpu_s(p) for role, p in procs.items()}
    wall0 = time.monotonic()
    try:
        reports, results = run_measurement(base_url, plan, tokens, model, limits, prompt)
    except ServerUnreachable as exc:
        raise click.ClickException(str(exc)) from None
    wall_s = time.monotonic() - wall0
    cpu = {role: (_cpu_s(p) - cpu0[role]) / wall_s * 100 for role, p in procs.items()}

    click.echo(
        f"{'user':<12} {'streams':>7} {'tokens':>6} {'client span s':>13} {'client tok/s':>12} "
        f"{'engine span s':>13} {'engine tok/s':>12} {'limit':>6} {'min span s':>10}  completion_tokens"
    )
    for r in reports:
        click.echo(
            f"{r.user:<12} {r.streams:>7} {r.tokens:>6} {_fmt(r.client_span_s):>13} "
            f"{_fmt(r.client_rate):>12} {_fmt(r.engine_span_s):>13} {_fmt(r.engine_rate):>12} "
            f"{_fmt(r.limit, 'g'):>6} {_fmt(r.min_span_s):>10}  {r.completion_tokens}"
        )
    for note in span_notes(reports):
        click.echo(note)
    if all(r.engine_span_s is None for r in reports):
        click.echo("engine-side rates: n/a (start the server with --enable-per-request-metrics)")
    for res in results:
        if res.error:
            click.echo(f"stream {res.user}#{res.index}: {res.error}", err=True)
    click.echo(f"wall {wall_s:.2f} s" + "".join(f"; {role} CPU {pct:.1f}%" for role, pct in cpu.items()))
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(
            json.dumps(
                {
                    "base_url": base_url,
                    "tokens_per_stream": tokens,
                    "wall_s": wall_s,
                    "cpu_percent": cpu,
                    "users": [r.as_json() for r in reports],
                    "streams": [asdict(s) for s in results],
                },
                indent=2,
            )
        )
    if any(res.error for res in results):
        raise SystemExit(1)
