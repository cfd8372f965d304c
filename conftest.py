"""Fixtures shared by ``tests/`` and ``gpu_tests/`` (pytest loads this file for both).

- ``redis_server``: a ``vllm_output_rate.redis_server.RedisServer`` (a redis-server on a
  free loopback port: ``url``, ``kill()``, ``start()`` again on the same port), started
  for the test and killed after it. R23-R26, marker ``multi_engine``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from vllm_output_rate.redis_server import RedisServer


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A running ``RedisServer`` for one test (R23-R26)."""
    server = RedisServer()
    server.start()
    try:
        yield server
    finally:
        server.kill()
