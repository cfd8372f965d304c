"""R19 live: the feature on but not binding gives stock vLLM's token timeline (issue 13 item 1).

The issue's rotation-stall shape on a real ``vllm.LLM`` engine (tiny model, dummy weights):
token budget 16 (the issue's block 16 is refused by the CPU attention kernel, which wants a
multiple of 32: KV blocks are ample either way); users V and W at 10^6 tok/s (far above need: no limit ever
binds); V's R2 and W's X decode, then V sends R3 with a 100-token prompt. Before R19, R14
put R3 at the front of ``running`` and X got ``[1, 0, 0, 0, 0, 0, 1, 1, 1, 1]`` tokens over
the next 10 steps; stock vLLM gives it 1 every step. Here the per-step token counts of
every request over the steps after R3 arrives (``LLMEngine.step`` outputs, one engine step
each) are recorded on stock vLLM's ``Scheduler`` and on the reference with the feature on,
and must be equal; X gets a token every step in both. The reference's engine-side trace
(``output_rate.trace_path``) confirms that nothing was throttled or refunded. About 50 s.
"""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.live

BUDGET = 16
STEPS = 10
RATE = 1_000_000
STOCK = "vllm.v1.core.sched.scheduler.Scheduler"


def _timeline(llm, sampling) -> dict[str, list[int]]:
    """Per-step new tokens of R2, X and R3 over the ``STEPS`` steps after R3 arrives."""
    engine = llm.llm_engine
    engine.add_request("R2", {"prompt_token_ids": [11, 12, 13, 14]}, sampling("V", 64))
    engine.add_request("X", {"prompt_token_ids": [21, 22, 23, 24]}, sampling("W", 64))
    seen: dict[str, int] = {}

    def step() -> dict[str, int]:
        got = {}
        for out in engine.step():
            n = len(out.outputs[0].token_ids) if out.outputs else 0
            got[out.request_id] = n - seen.get(out.request_id, 0)
            seen[out.request_id] = n
        return got

    for _ in range(50):  # both prefilled and decoding
        step()
        if seen.get("R2", 0) >= 2 and seen.get("X", 0) >= 2:
            break
    assert seen.get("R2", 0) >= 2 and seen.get("X", 0) >= 2, seen
    engine.add_request("R3", {"prompt_token_ids": [31 + i % 50 for i in range(100)]}, sampling("V", 4))
    timeline: dict[str, list[int]] = {"R2": [], "X": [], "R3": []}
    for _ in range(STEPS):
        got = step()
        for rid in timeline:
            timeline[rid].append(got.get(rid, 0))
    engine.abort_request(["R2", "X", "R3"])
    return timeline


@pytest.mark.rules("R19")
def test_r19_live_not_binding_token_timeline_equals_stock(tiny_llm, sampling, tmp_path, monkeypatch):
    # The engine core in this process: a request added between two ``step()`` calls reaches
    # the scheduler before the next step on both engines (over the engine-core socket its
    # arrival could fall one step apart, which would compare timing, not scheduling).
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    trace = tmp_path / "trace.jsonl"
    engine_args = {"max_num_batched_tokens": BUDGET, "enable_chunked_prefill": True}
    stock = tiny_llm(None, scheduler_cls=STOCK, **engine_args)
    try:
        want = _timeline(stock, sampling)
    finally:
        del stock
    feature = tiny_llm({"default_tokens_per_s": RATE, "trace_path": str(trace)}, **engine_args)
    try:
        got = _timeline(feature, sampling)
    finally:
        del feature
    print(f"\nstock: {want}\nfeature on, not binding: {got}")
    assert want["X"] == [1] * STEPS, want  # stock vLLM: X a token every step
    assert got == want
    records = [json.loads(line) for line in trace.read_text().splitlines() if line.strip()]
    steps = [r for r in records if "requests" in r]
    assert steps, "the trace holds no step"
    assert not any(info["throttled"] or info["refunded"] for r in steps for info in r["requests"].values())
