"""The scheduler part of ``outrate bench`` runs every scheduler in a process of its own.

Why, measured (docs/PERFORMANCE.md, "How the bench measures"):

- vLLM's ``Scheduler.schedule`` calls the scheduler's hook (``_reserve_prefill_lookahead``,
  once per running request per step) from a call site that CPython 3.11+ specializes for
  the function it last called (PEP 659). Stock vLLM, the reference and the article-style
  peer each bring their own hook function, so in one process that call site switches
  between functions every round, slowing whichever kind it is not specialized for. An
  engine core runs one scheduler class.
- One scheduler can read a few percent slower or faster than another of the same class in
  every round, as can a process; several processes per kind average that out.

Each ``KindProcess`` is a fresh interpreter (multiprocessing's ``spawn``: nothing of the
bench's own heap is inherited) that imports vLLM and the schedulers, freezes that start-up
heap out of the garbage collector as vLLM's engine core does
(``vllm.utils.gc_utils.freeze_gc_heap``), and then serves requests over a pipe: ``build``
makes and warms up its scheduler for one configuration, ``run`` steps it and returns
the CPU seconds spent in vLLM's calls in each step, ``throttled`` reads its throttled requests,
``describe`` says what it holds, ``drop`` frees it. A process holds one scheduler at a
time; the bench starts ``Plan.instances`` processes per kind and gives them the kinds
anew before every round (``SchedulerKinds``). The rounds stay interleaved:
one process steps while the others wait on their pipes.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import multiprocessing
import os
from collections.abc import Callable
from typing import Any

from vllm_output_rate.bench.common import TINY_RATE_INTEGER
from vllm_output_rate.bench.driver import _Driver, article_style


class KindProcess:
    """One scheduler (a ``_Driver``) of one kind in a child process (spawn), driven over a pipe.

    ``kind``: a name for messages (``stock``, ``reference``, ...). Every call blocks until
    the child answers.
    """

    def __init__(self, kind: str) -> None:
        context = multiprocessing.get_context("spawn")
        self.kind = kind
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(child,), name=f"outrate-bench-{kind}", daemon=True)
        self._process.start()
        child.close()

    def call(self, op: str, *args: Any) -> Any:
        """Run ``op`` (``build``, ``run``, ``throttled``, ``describe``, ``drop``) in the child; its result.

        Raises:
            RuntimeError: the operation raised in the child (its message, naming the
                kind), or the child is gone.
        """
        try:
            self.send(op, *args)
        except OSError as exc:
            raise RuntimeError(f"the {self.kind} scheduler's process ended ({exc!r})") from exc
        return self.result()

    def send(self, op: str, *args: Any) -> None:
        """Start ``op`` in the child without waiting (``result()`` collects it)."""
        self._conn.send((op, args))

    def result(self) -> Any:
        """The answer to the last ``send``; raises as ``call`` does."""
        try:
            status, value = self._conn.recv()
        except (EOFError, OSError) as exc:
            raise RuntimeError(f"the {self.kind} scheduler's process ended ({exc!r})") from exc
        if status != "ok":
            raise RuntimeError(f"{self.kind} scheduler: {value}")
        return value

    def close(self) -> None:
        """Stop the child (waits up to 10 s, then terminates it)."""
        with contextlib.suppress(OSError):
            self._conn.send(("stop", ()))
        self._process.join(timeout=10)
        if self._process.is_alive():
            self._process.terminate()
            self._process.join(timeout=5)
        self._conn.close()


_BUILDS = itertools.count(1)  # the process's schedulers, numbered as built (``describe``)


def _build(drivers: list[Any], options: dict[str, Any]) -> int:
    """The process's scheduler: a ``_Driver`` of ``options`` (its arguments; ``article=True``:
    the article-style peer's class and config style) in place of the last one, warmed up;
    its planned throttled requests."""
    drivers.clear()
    gc.collect()
    options = dict(options)
    if options.pop("article", False):
        peer = article_style(options["async_mode"])
        if peer is None:
            raise RuntimeError("the article-style peer (tests/fixtures/article_style) is not in this checkout")
        options.update(cls_path=peer[0], style=peer[1], tiny_rate=TINY_RATE_INTEGER)
    try:
        driver = _Driver(**options)
    except Exception as exc:
        raise RuntimeError(f"cannot build {options['cls_path']} ({type(exc).__name__}: {exc})") from exc
    driver.warm_up()
    driver.build_number = next(_BUILDS)
    drivers.append(driver)
    gc.collect()
    return driver.expected_throttled


def _run(drivers: list[Any], steps: int, rewarm: int = 0) -> list[float]:
    """The CPU seconds of each of ``steps`` steps of the scheduler (``_Driver.step``), after
    ``rewarm`` untimed ones that bring back the caches the other processes' rounds took."""
    step = drivers[0].step
    for _ in range(rewarm):
        step()
    return [step() for _ in range(steps)]


def _throttled(drivers: list[Any]) -> int:
    return drivers[0].throttled_now()


def _describe(drivers: list[Any]) -> list[dict[str, Any]]:
    """The scheduler held (none or one): its class name, whether the limit is on, its
    request ids, which of the process's schedulers it is (1: the first built), and this
    process's id (what the tests check)."""
    return [
        {
            "class": type(d.scheduler).__name__,
            "limited": getattr(d.scheduler, "rate_limiter", None) is not None,
            "requests": sorted(d.scheduler.requests),
            "build": d.build_number,
            "pid": os.getpid(),
        }
        for d in drivers
    ]


def _drop(drivers: list[Any]) -> None:
    drivers.clear()
    gc.collect()


_OPS: dict[str, Callable[..., Any]] = {
    "build": _build,
    "run": _run,
    "throttled": _throttled,
    "describe": _describe,
    "drop": _drop,
}


def _serve(conn: Any) -> None:
    """The child's loop: one answer, ``("ok", value)`` or ``("error", message)``, per request."""
    # Start-up: import what the scheduler needs, then leave it out of every collection, as
    # vLLM's engine core freezes its start-up heap (vllm.utils.gc_utils.freeze_gc_heap).
    import vllm  # noqa: F401  # deferred: the child's start-up; vLLM costs seconds to import

    import vllm_output_rate.adapter.harness  # deferred: the child's start-up
    import vllm_output_rate.reference.scheduler  # noqa: F401  # deferred: the child's start-up

    # vLLM's config warnings about the bench's engine shapes are not results (as in the bench).
    logging.getLogger("vllm").setLevel(logging.ERROR)
    gc.collect()
    gc.freeze()
    drivers: list[Any] = []  # the scheduler held: none or one
    while True:
        try:
            op, args = conn.recv()
        except (EOFError, OSError):
            break
        if op == "stop":
            break
        try:
            value = _OPS[op](drivers, *args)
        except Exception as exc:  # reported to the bench, which raises it there
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
        else:
            conn.send(("ok", value))
    conn.close()
