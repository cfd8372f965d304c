"""``outrate measure`` helpers: the GCRA span bound and the SSE reader (no server)."""

from __future__ import annotations

import asyncio
import math

import pytest

from vllm_output_rate.loadtest import _sse_data, gcra_min_span_s


@pytest.mark.rules("R2")
def test_r2_min_span_matches_the_article_numbers():
    # 4 x 200 tokens at 20 tok/s: 3 grants at once (floor(0.1 x 20) + 1), then one per 50 ms.
    assert math.isclose(gcra_min_span_s(800, 20), 39.85)
    assert math.isclose(gcra_min_span_s(400, 100), 3.89)
    assert gcra_min_span_s(1, 20) == 0.0


class _Response:
    def __init__(self, chunks):
        self._chunks = chunks

    async def aiter_bytes(self):
        for chunk in self._chunks:
            yield chunk


@pytest.mark.parametrize("split", [1, 7, 1000])
def test_sse_reader_splits_on_newline_only(split):
    # U+2028 and U+0085 are line breaks for str.splitlines (httpx aiter_lines), not for SSE.
    payload = '{"choices":[{"delta":{"content":"a\u2028b\u0085c"}}]}'
    body = f"data: {payload}\n\ndata: [DONE]\n\n".encode()
    chunks = [body[i : i + split] for i in range(0, len(body), split)]

    async def collect():
        return [d async for d in _sse_data(_Response(chunks))]

    assert asyncio.run(collect()) == [payload, "[DONE]"]
