"""Fixtures shared by ``tests/`` and ``gpu_tests/`` (pytest loads this file for both).

- ``redis_server``: a ``redis-server`` on a free loopback port, started for the test and
  killed after it (``RedisServer``: ``url``, ``kill()``, ``start()`` again on the same port).
  R23-R26, marker ``multi_engine``. ``redis-server`` comes from Debian's package
  (``apt-get install -y redis-server``; ``.ci/run`` installs it).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A redis-server on a loopback port, started and stopped by the tests.

    ``start()`` waits until it answers PING (AssertionError after about 4 s, or when the
    binary is missing); ``kill()`` stops it with SIGKILL (an outage, R25); ``start()``
    again brings it back on the same port with an empty data set.
    """

    def __init__(self) -> None:
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        binary = shutil.which("redis-server")
        assert binary, "redis-server is missing: `apt-get install -y redis-server` (.ci/run installs it)"
        self.proc = subprocess.Popen([binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis

        client = redis.Redis.from_url(self.url, socket_timeout=0.2)
        for _ in range(200):
            try:
                if client.ping():
                    return
            except redis.RedisError:
                time.sleep(0.02)
        raise AssertionError(f"redis-server did not answer on port {self.port}")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=5)
            self.proc = None


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A running ``RedisServer`` for one test (R23-R26)."""
    server = RedisServer()
    server.start()
    try:
        yield server
    finally:
        server.kill()
