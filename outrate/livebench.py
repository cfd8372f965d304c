"""The "live" section of ``outrate bench``: a real vLLM engine on this machine (CPU or GPU).

Run by ``outrate bench`` in child processes (``python -m vllm_output_rate.livebench
CONFIG_JSON``, one JSON object on the last line of stdout), so that every measurement gets
fresh engine-core processes and its own environment (``VLLM_PLUGINS=""`` for the run
without the engine-wait plugin). The model is the project's tiny decoder
(``tinymodel.default_model_dir()``, dummy weights, no tokenizer), as in
``gpu_tests/test_live_engine.py``.

- ``throughput``: three engines in one process, started side by side -- feature off
  (stock vLLM ``Scheduler``), feature on but never binding (``RateLimitedScheduler``,
  ``default_tokens_per_s = 10**9``), and the same with the worker idle fix off
  (``VLLM_OUTPUT_RATE_WORKER_PARK=0``). After one warm-up batch each, ``rounds`` rounds: a
  round runs the same batch (``streams`` prompts x ``tokens`` output tokens, ``ignore_eos``)
  through ``LLM.generate`` on each engine, the first engine rotating between rounds. A
  batch's rate is its output tokens / the wall time of its ``generate`` call (prefill,
  every decode step, the front end). While one engine runs its batch, the other engines'
  processes are suspended (SIGSTOP, psutil): on vLLM's CPU backend an idle engine's worker
  can busy-poll a core, which on a 2-core machine would otherwise take a share of the
  running engine's cores that varies from round to round. Reported: medians over rounds
  and the medians of the per-round ratios on / off and fix on / fix off.
- ``throttled``: one engine, feature on, every user limited to ``rate`` tokens/s so that
  almost all of the run is spent with every request throttled; ``users`` x
  ``streams_per_user`` streams of ``tokens`` tokens. Reported: the CPU time (psutil: user
  + system) of the engine-core process, of its worker(s) and of both over the wall time
  of the ``generate`` call, in percent of one core; the same over 2 s with no requests
  (stock idle); voluntary context switches per second (wake-ups). ``outrate bench`` runs it
  with the plugin as shipped (the engine core waits until the earliest user is ready, R16;
  the worker parks after each empty step), with ``VLLM_OUTPUT_RATE_WORKER_PARK=0`` (the
  worker keeps vLLM's 1 s spin) and with ``VLLM_PLUGINS=""`` (vLLM's own 1 ms idle loop).
- ``ping_round_trips`` (in this process): vLLM's shm ``MessageQueue`` to a reader process
  that parks after every read, with lossless or vLLM's pings, or spins: lost pings and
  round trips (docs/PERFORMANCE.md "Idle cost").

Source: docs/SPEC.md R16; docs/PERFORMANCE.md "Live engine (tiny model on CPU)".
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from vllm_output_rate.adapter.tinymodel import default_model_dir
from vllm_output_rate.loadtest import engine_processes
from vllm_output_rate.reference import worker_park
from vllm_output_rate.reference.worker_park import WORKER_PARK_ENV

REFERENCE_SCHEDULER = "vllm_output_rate.reference.scheduler.RateLimitedScheduler"
FREE_RATE = 10**9


def _engine(output_rate: dict[str, Any] | None, max_num_seqs: int):
    from vllm import LLM  # deferred: vLLM costs ~7 s to import; only the live bench child needs it

    kwargs: dict[str, Any] = {}
    if output_rate is not None:
        kwargs = {"scheduler_cls": REFERENCE_SCHEDULER, "additional_config": {"output_rate": output_rate}}
    return LLM(
        model=str(default_model_dir()),
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=512,
        max_num_seqs=max_num_seqs,
        enforce_eager=True,
        enable_prefix_caching=False,
        async_scheduling=False,  # the same (sync) scheduler loop for both classes
        gpu_memory_utilization=0.2,  # on CPU: the share of RAM vLLM checks at start
        kv_cache_memory_bytes=128 * 2**20,
        seed=0,
        **kwargs,
    )


def _batch(streams: int, tokens: int, users: list[str]):
    from vllm import SamplingParams  # deferred: vLLM costs ~7 s to import; only the live bench child needs it

    prompts = [{"prompt_token_ids": [11 + (i % 200), 12, 13, 14 + (i % 7)]} for i in range(streams)]
    params = [
        SamplingParams(
            max_tokens=tokens, ignore_eos=True, detokenize=False, extra_args={"output_rate_user": users[i % len(users)]}
        )
        for i in range(streams)
    ]
    return prompts, params


def _generate(llm, prompts, params, expected_tokens: int) -> float:
    """Run the batch; return its wall time in seconds (checks every stream's length)."""
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    if produced != expected_tokens:
        raise RuntimeError(f"batch produced {produced} tokens, expected {expected_tokens}")
    return elapsed


def _engine_processes() -> dict[str, Any]:
    """This process's engine-core and worker processes (psutil), by role."""
    found = engine_processes(os.getpid())
    if "engine_core" not in found:
        raise RuntimeError("no engine-core process found (is VLLM_ENABLE_V1_MULTIPROCESSING off?)")
    return found


def _cpu_s(procs: dict[str, Any]) -> dict[str, float]:
    out = {}
    for role, proc in procs.items():
        times = proc.cpu_times()
        out[role] = times.user + times.system
    return out


def _switches(procs: dict[str, Any]) -> dict[str, int]:
    return {role: proc.num_ctx_switches().voluntary for role, proc in procs.items()}


def _pause(procs: list[Any]) -> None:
    """Suspend (SIGSTOP) an idle engine's processes so they do not compete for the cores."""
    for proc in procs:
        proc.suspend()


def _resume(procs: list[Any]) -> None:
    for proc in procs:
        proc.resume()


def run_throughput(cfg: dict[str, Any]) -> dict[str, Any]:
    streams, tokens, rounds = cfg["streams"], cfg["tokens"], cfg["rounds"]
    import psutil  # deferred: psutil adds ~50 ms, kept off `outrate --help`

    def started(build):
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        llm = build()
        return llm, [p for p in psutil.Process().children(recursive=True) if p.pid not in before]

    off, off_procs = started(lambda: _engine(None, max_num_seqs=streams))
    on, on_procs = started(lambda: _engine({"default_tokens_per_s": FREE_RATE}, max_num_seqs=streams))
    # R16, worker side: the same engine with the worker-idle fix off (its processes read the
    # variable when they start), to show what the fix costs while decoding.
    os.environ[WORKER_PARK_ENV] = "0"
    try:
        spin, spin_procs = started(lambda: _engine({"default_tokens_per_s": FREE_RATE}, max_num_seqs=streams))
    finally:
        del os.environ[WORKER_PARK_ENV]
    engines = {"off": (off, off_procs), "on": (on, on_procs), "on_spin": (spin, spin_procs)}

    def engine_cpu_s(procs) -> float:
        return sum(t.user + t.system for t in (p.cpu_times() for p in procs))

    prompts, params = _batch(streams, tokens, [f"u{i}" for i in range(max(1, streams // 4))])
    total = streams * tokens
    for llm, _procs in engines.values():  # warm-up: first-call costs are not results
        _generate(llm, prompts, params, total)
    rates: dict[str, list[float]] = {name: [] for name in engines}
    cpu_us: dict[str, list[float]] = {name: [] for name in engines}
    names = list(engines)
    for k in range(rounds):
        order = names[k % len(names) :] + names[: k % len(names)]  # each engine first in turn
        for name in order:
            llm, procs = engines[name]
            idle = [p for other, (_llm, ps) in engines.items() if other != name for p in ps]
            _pause(idle)  # an idle engine's worker busy-polls a core (vLLM CPU backend)
            try:
                cpu0 = engine_cpu_s(procs)
                rates[name].append(total / _generate(llm, prompts, params, total))
                cpu_us[name].append((engine_cpu_s(procs) - cpu0) / total * 1e6)
            finally:
                _resume(idle)
        _progress()
    return _throughput_summary(rates, cpu_us, rounds, streams, tokens)


def _median_ratio(numerators: list[float], denominators: list[float]) -> float | None:
    """Median of the per-round ratios over the rounds whose denominator is above 0 (an
    engine whose processes' CPU time did not move in a short round measures 0 µs per
    token); None when no round has one."""
    ratios = [a / b for a, b in zip(numerators, denominators, strict=True) if b > 0]
    return statistics.median(ratios) if ratios else None


def _throughput_summary(
    rates: dict[str, list[float]], cpu_us: dict[str, list[float]], rounds: int, streams: int, tokens: int
) -> dict[str, Any]:
    """The throughput part's result from the per-round tokens/s and engine CPU µs per token
    of the three engines (off, on, on with the worker-idle fix off)."""
    ratios = [a / b for a, b in zip(rates["on"], rates["off"])]
    fix_ratios = [a / b for a, b in zip(rates["on"], rates["on_spin"])]
    return {
        "tokens_per_s_off": statistics.median(rates["off"]),
        "tokens_per_s_on": statistics.median(rates["on"]),
        "tokens_per_s_on_worker_spin": statistics.median(rates["on_spin"]),
        "ratio": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        # The spread of single rounds, to judge what the median can resolve.
        "ratio_quartiles": statistics.quantiles(ratios, n=4)[::2] if len(ratios) >= 2 else [ratios[0]] * 2,
        # R16, worker side: feature on with the worker-idle fix / without it, per round.
        "worker_fix_ratio": statistics.median(fix_ratios),
        "worker_fix_ratio_min": min(fix_ratios),
        "worker_fix_ratio_max": max(fix_ratios),
        # CPU time of the engine's processes (engine core + workers) per output token: less
        # sensitive than wall time to other jobs on a shared machine.
        "engine_cpu_us_per_token_off": statistics.median(cpu_us["off"]),
        "engine_cpu_us_per_token_on": statistics.median(cpu_us["on"]),
        "engine_cpu_us_per_token_on_worker_spin": statistics.median(cpu_us["on_spin"]),
        "engine_cpu_ratio": _median_ratio(cpu_us["on"], cpu_us["off"]),
        "worker_fix_cpu_ratio": _median_ratio(cpu_us["on"], cpu_us["on_spin"]),
        "rounds": rounds,
        "streams": streams,
        "tokens_per_stream": tokens,
        "tokens_per_s_off_rounds": rates["off"],
        "tokens_per_s_on_rounds": rates["on"],
        "tokens_per_s_on_worker_spin_rounds": rates["on_spin"],
    }


def run_throttled(cfg: dict[str, Any]) -> dict[str, Any]:
    import psutil  # deferred: psutil adds ~50 ms, kept off `outrate --help`

    users = [f"slow{i}" for i in range(cfg["users"])]
    rate = cfg["rate"]
    llm = _engine({"default_tokens_per_s": rate}, max_num_seqs=cfg["users"] * cfg["streams_per_user"])
    procs = _engine_processes()
    streams = cfg["users"] * cfg["streams_per_user"]
    prompts, params = _batch(streams, cfg["tokens"], users)
    total = streams * cfg["tokens"]
    warm_prompts, warm_params = _batch(1, cfg["tokens"], ["warm-up"])  # its own bucket
    _generate(llm, warm_prompts, warm_params, cfg["tokens"])
    procs["front_end"] = psutil.Process()
    # Stock idle baseline: no requests, after vLLM's 1 s reader spin window has run out
    # (the engine core blocks on its input queue, the worker parks on its notify socket).
    time.sleep(cfg.get("idle_settle_s", 1.5))
    idle_s = cfg.get("idle_s", 2.0)
    idle0 = _cpu_s(procs)
    time.sleep(idle_s)
    idle1 = _cpu_s(procs)
    switches0 = _switches(procs)
    wall = _generate(llm, prompts, params, total)
    busy1 = _cpu_s(procs)
    switches1 = _switches(procs)
    per_user = cfg["streams_per_user"] * cfg["tokens"]
    return {
        "engine_cpu_percent": 100 * (busy1["engine_core"] - idle1["engine_core"]) / wall,
        # Issue 15 item 6: the engine core plus its worker(s), the cost of an all-throttled engine.
        "engine_and_workers_cpu_percent": 100 * sum(busy1[r] - idle1[r] for r in procs if r != "front_end") / wall,
        "cpu_percent": {role: 100 * (busy1[role] - idle1[role]) / wall for role in procs},
        "idle_cpu_percent": {role: 100 * (idle1[role] - idle0[role]) / idle_s for role in procs},
        "wall_s": wall,
        # R2 read backwards: a user's N tokens need at least (N - 1)/rate - tau seconds.
        "min_wall_s": max(0.0, (per_user - 1) / rate - 0.1),
        "users": cfg["users"],
        "streams_per_user": cfg["streams_per_user"],
        "tokens_per_stream": cfg["tokens"],
        "rate": rate,
        "plugins": os.environ.get("VLLM_PLUGINS"),
        "worker_park": os.environ.get(WORKER_PARK_ENV),
        # Wake-ups: voluntary context switches per second of each process while throttled.
        "wakeups_per_s": {role: (switches1[role] - switches0[role]) / wall for role in procs},
    }


def _ping_reader(handle, answers, messages: int, timeout_s: float, park: bool) -> None:
    """Child process of ``ping_round_trips``: vLLM's reader of the queue ``handle``; after
    every read it parks (``worker_park.park_reader``, as the worker after an empty step) or keeps
    vLLM's spin window; answers each message with whether its read waited ``timeout_s`` s
    (vLLM's reader polls at most that long before re-checking the buffer)."""
    # deferred: vLLM costs ~7 s to import; only the live bench needs it
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    reader = MessageQueue.create_from_handle(handle, 0)
    response = MessageQueue(1, 1)
    answers.put(response.export_handle())
    reader.wait_until_ready()
    response.wait_until_ready()
    for _ in range(messages):
        started = time.monotonic()
        # A dropped ping leaves vLLM's poll to time out after timeout_s (then its flag
        # re-check finds the message): a read that long means the ping was lost.
        while True:
            try:
                reader.dequeue(timeout=timeout_s)
                break
            except TimeoutError:  # nothing sent yet: wait again
                continue
        lost = time.monotonic() - started >= timeout_s
        if park:
            worker_park.park_reader(reader)
        response.enqueue(lost)


def ping_round_trips(
    lossless: bool, park: bool = True, steps: int = 300, timeout_s: float = 2.0, seed: int = 0
) -> dict[str, Any]:
    """R16, worker side: vLLM's shm ``MessageQueue`` between this process and a reader process.

    The engine core's pattern: per step an ``execute_model`` then a ``sample_tokens``
    message, each sent after the reader's answer to the previous one, then a gap of 0-2 ms
    (seeded). The reader parks after every read (``park``) or keeps vLLM's 1 s spin window;
    ``lossless`` applies ``worker_park.make_pings_lossless`` to the writer. Returns ``lost`` (reads
    that waited ``timeout_s`` s: their wake-up ping was dropped), ``messages`` and the
    median / 99th percentile round trip (send to answer) in microseconds.
    """
    # deferred: vLLM costs ~7 s to import; only the live bench needs it
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    context = multiprocessing.get_context("fork")
    writer = MessageQueue(1, 1)
    answers = context.Queue()
    child = context.Process(
        target=_ping_reader, args=(writer.export_handle(), answers, 2 * steps, timeout_s, park), daemon=True
    )
    child.start()
    try:
        response = MessageQueue.create_from_handle(answers.get(timeout=60), 0)
        writer.wait_until_ready()
        response.wait_until_ready()
        if lossless and not worker_park.make_pings_lossless(writer):
            raise RuntimeError("the writer has no notify socket to make lossless")
        rnd = random.Random(seed)
        lost = 0
        trips: list[float] = []
        for i in range(steps):
            for method in ("execute_model", "sample_tokens"):
                started = time.perf_counter()
                writer.enqueue((method, i))
                lost += bool(response.dequeue(timeout=30))
                trips.append(time.perf_counter() - started)
            time.sleep(rnd.choice([0.0, 0.0002, 0.0005, 0.001, 0.002]))
    finally:
        child.kill()
        child.join(10)
    trips.sort()
    return {
        "lost": lost,
        "messages": len(trips),
        "round_trip_us_p50": 1e6 * trips[len(trips) // 2],
        "round_trip_us_p99": 1e6 * trips[min(len(trips) - 1, int(0.99 * len(trips)))],
        "lossless": lossless,
        "park": park,
    }


def _progress() -> None:
    print("progress", flush=True)


def main(argv: list[str]) -> None:
    cfg = json.loads(argv[0])
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    try:
        result = run_throughput(cfg) if cfg["part"] == "throughput" else run_throttled(cfg)
        print("RESULT " + json.dumps(result), flush=True)
    finally:
        _stop_engines()
    os._exit(0)  # skip the slow interpreter teardown


def _stop_engines() -> None:
    """End the engine-core and worker processes this process started (by pid)."""
    import psutil  # deferred: psutil adds ~50 ms, kept off `outrate --help`

    children = psutil.Process().children(recursive=True)
    for proc in children:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    _, alive = psutil.wait_procs(children, timeout=5)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()


def run_child(
    cfg: dict[str, Any], env_overrides: dict[str, str] | None = None, tick=lambda: None, timeout_s: float = 900.0
) -> dict[str, Any]:
    """Run one part in a child process; return its result (RuntimeError with its stderr tail).

    The child runs in its own session; whatever of it is left after the result or after
    ``timeout_s`` (its engine processes included) is ended through that process group.
    """
    env = dict(os.environ)
    env.update(env_overrides or {})
    found: list[dict[str, Any]] = []
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "vllm_output_rate.livebench", json.dumps(cfg)],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=env,
            start_new_session=True,
        )

        def read() -> None:
            assert proc.stdout is not None
            # Stop at RESULT: the engine processes hold the pipe open until they end.
            for line in proc.stdout:
                if line.startswith("progress"):
                    tick()
                elif line.startswith("RESULT "):
                    found.append(json.loads(line[len("RESULT ") :]))
                    return

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(timeout_s)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30 if found else 1)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # the group this call started (no-op if all ended)
        proc.wait()
        err.seek(0)
        stderr = err.read()
    result = found[0] if found else None
    if result is None:
        raise RuntimeError(f"live bench part {cfg['part']!r} failed (exit {proc.returncode}):\n{stderr[-3000:]}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
