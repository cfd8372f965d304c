"""A throwaway ``redis-server`` on a free loopback port, for the shared-budget tests and
``outrate bench`` (R23-R26). ``redis-server`` comes from Debian's package
(``apt-get install -y redis-server``; ``.ci/run`` installs it).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A redis-server on a loopback port, without persistence.

    ``start()`` waits until it answers PING; ``kill()`` stops it with SIGKILL (an outage,
    R25); ``start()`` again brings it back on the same port with an empty data set.
    ``url`` is its ``redis://127.0.0.1:PORT/0``.

    Raises (``start``):
        RuntimeError: ``redis-server`` is not on PATH, or it did not answer within about 4 s.
    """

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if not binary:
            raise RuntimeError("redis-server is missing: install it with `apt-get install -y redis-server`")
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        import redis  # deferred: redis is imported only when a server is started

        client = redis.Redis.from_url(self.url, socket_timeout=0.2)
        for _ in range(200):
            try:
                if client.ping():
                    return
            except redis.RedisError:
                time.sleep(0.02)
        self.kill()
        raise RuntimeError(f"redis-server did not answer on port {self.port}")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=5)
            self.proc = None
