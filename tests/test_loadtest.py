"""``outrate measure``: the GCRA span bound, the SSE reader, and the operator's errors when
no server (or no OpenAI-compatible one) answers at ``--base-url`` (loopback only)."""

from __future__ import annotations

import asyncio
import http.server
import math
import socket
import threading

import pytest
from click.testing import CliRunner

from vllm_output_rate.cli import main
from vllm_output_rate.loadtest import UserReport, _sse_data, gcra_min_span_s, span_notes


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


def _free_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _measure(*args: str):
    return CliRunner().invoke(main, ["measure", *args])


@pytest.mark.parametrize("model", [(), ("--model", "m")])
def test_no_server_at_the_base_url_is_one_line_naming_it(model):
    # Without --model the first request is GET /v1/models; with it every stream fails to connect.
    url = f"http://127.0.0.1:{_free_port()}"
    result = _measure("--base-url", url, "--stream", "user-a:2", *model)
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    last = result.output.strip().splitlines()[-1]
    assert f"no server answers at {url}" in last and "outrate serve" in last and "--base-url" in last, result.output


@pytest.mark.parametrize("url", ["notaurl", "ftp://127.0.0.1:8000", "http://", "http://127.0.0.1:abc"])
def test_malformed_base_url_is_a_usage_error(url):
    result = _measure("--base-url", url, "--stream", "user-a:2")
    assert result.exit_code == 2, result.output
    last = result.output.strip().splitlines()[-1]
    assert "--base-url" in last and repr(url) in last and "http://127.0.0.1:8000" in last, result.output


def test_a_server_without_a_model_list_is_named(tmp_path):
    # Something answers, but not an OpenAI-compatible server: GET /v1/models is a 404.
    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_error(404)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), NotFound)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        result = _measure("--base-url", url, "--stream", "user-a:1")
    finally:
        server.shutdown()
        server.server_close()
    assert result.exit_code == 1, result.output
    last = result.output.strip().splitlines()[-1]
    assert f"the server at {url} answered GET /v1/models with HTTP 404" in last and "--model" in last, result.output


def _report(client_span_s, engine_span_s, min_span_s=19.85):
    return UserReport("user-a", 4, 40, [10] * 4, client_span_s, None, None, engine_span_s, None, 2.0, min_span_s)


@pytest.mark.rules("R2")
def test_r2_measure_explains_a_client_span_below_the_minimum_and_flags_an_engine_span_below_it():
    # Seen live: client span 19.84 s beside R2's minimum 19.85 s, engine span 19.85 s, no note.
    (note,) = span_notes([_report(19.84, 19.85)])
    assert note.startswith("user-a: client span 19.840 s is below R2's minimum 19.850 s by 0.010 s: no violation")
    (note,) = span_notes([_report(19.9, 19.5)])
    assert "engine span 19.500 s is below R2's minimum 19.850 s: more tokens than the limit allows" in note
    assert span_notes([_report(19.9, 19.849)]) == []  # within the whole-ms rounding of engine metrics
    assert span_notes([_report(5.0, 5.0, min_span_s=None)]) == []  # no limit given for the user
