"""Mode matrix, live (docs/MODES.md): tensor parallel with the feature on.

Tensor parallelism splits each layer over workers inside one engine; the engine still has
one scheduler, so the accounting is unchanged. This runs ``--tensor-parallel-size 2`` on
the tiny model (2 attention heads, one per worker; on CPU each worker is a process), with
one user throttled and one free: every request ends with all its tokens (P3), the trace
passes every check (window bound per user, GCRA replay, accounting), and the throttled
user's dispatches take at least the time its rate allows (R2). About 60 s on a 2-core CPU,
most of it the two workers' start-up.
"""

from __future__ import annotations

import os

import pytest

from vllm_output_rate.adapter.trace_check import check_trace

pytestmark = pytest.mark.live

SLOW_RATE = 20  # tokens/s
TOKENS = 30


@pytest.mark.rules("R2", "R11")
def test_modes_live_tensor_parallel_2_limits_one_user_and_serves_the_other(tiny_llm, sampling, tmp_path, monkeypatch):
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.fail(f"tensor parallel 2 needs two CPUs, this process may use {cpus}")
    # vLLM's CPU workers bind their OpenMP threads per NUMA node; with one node, one CPU each.
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", f"{cpus[0]}|{cpus[1]}")
    trace = tmp_path / "trace.jsonl"
    llm = tiny_llm(
        {"default_tokens_per_s": 100_000, "user_tokens_per_s": {"slow": SLOW_RATE}, "trace_path": str(trace)},
        tensor_parallel_size=2,
        distributed_executor_backend="mp",
    )
    try:
        prompts = [{"prompt_token_ids": [21 + i, 22, 23, 24]} for i in range(3)]
        params = [sampling("slow", TOKENS), sampling("slow", TOKENS), sampling("free", TOKENS)]
        outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        del llm
    assert [len(o.outputs[0].token_ids) for o in outputs] == [TOKENS] * 3  # P3, nothing cut
    report = check_trace(trace, partial=True)
    assert report.ok, report.summary()
    slow = report.runs[-1].users["slow"]
    assert slow.dispatches == 2 * TOKENS
    # R2 from idle: 60 grants at 20 tok/s need at least (60 - 1 - floor(0.1 x 20)) / 20 s.
    assert slow.span_s >= (2 * TOKENS - 1 - int(0.1 * SLOW_RATE)) / SLOW_RATE - 0.01, slow.span_s
    assert report.runs[-1].users["free"].dispatches == TOKENS
