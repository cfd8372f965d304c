"""R30-R32: the ASGI middleware that binds each request's user to a gateway's header or
to its API key (``output_rate.identity``), before vLLM parses the request.

The plugin installs it (``plugin._install_identity_middleware``) as the outermost
middleware of vLLM's OpenAI server when the feature is on and ``identity`` is not
``"body"``; ``--middleware vllm_output_rate.reference.identity_middleware.IdentityMiddleware``
names the same class (the second copy then passes requests through; named without the
plugin's configuration it refuses to start, ``NOT_CONFIGURED``). Pure ASGI: no vLLM
import, no Starlette import.

Per HTTP request (``identity`` not ``"body"``):

- ``GET``/``HEAD``/``OPTIONS`` carry no generation: passed unchanged, except that with
  ``"api-key"`` a request under vLLM's guarded prefixes (``/v1``, ``/v2``, ``/inference``,
  ``/cohere``) needs a valid key (401), as vLLM's own ``--api-key`` requires.
- Every other method: the user is found (R30) -- header NAME's value (given once, a valid
  user id, R17), or the user whose key hash matches ``Authorization: Bearer KEY``
  (``reference/keysfile.py``). No identity: 401 (R32), or ``__anonymous__`` with
  ``identity_on_missing: "anonymous"``; an unknown key is always 401. The body, if any,
  must be a JSON object: ``vllm_xargs.output_rate_user`` (and, for the tokens API,
  ``sampling_params.extra_args.output_rate_user``) already present is a claim: 400 naming
  the field (R31), or replaced with ``identity_on_claim: "overwrite"``. The user is then
  written into ``vllm_xargs`` (and ``sampling_params.extra_args`` when present), the body
  re-serialised (so vLLM parses exactly what was checked) and ``content-length`` set.
- WebSocket connections are closed (policy violation): no identity can be bound there.

Every refusal is counted in ``vllm:output_rate_identity_refused_total{reason}`` and logged
at WARNING with the reason, method, path and client address -- never a key, a header
value or the body (at most one line per reason per second; the rest are counted in the
next line). The plugin's front-end check refuses, in the same server, a request that
reaches the engine without a user (an endpoint that does not carry ``vllm_xargs``).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import REGISTRY, Counter

from vllm_output_rate.reference.identity import (
    ANONYMOUS_USER,
    IDENTITY_API_KEY,
    USER_KEY,
    IdentitySettings,
    is_user_id,
)

logger = logging.getLogger("vllm.output_rate.identity")
UNGOVERNED_METHODS = ("GET", "HEAD", "OPTIONS")
GUARDED_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")  # those vLLM's --api-key guards
CLAIM_FIELDS = (f"vllm_xargs.{USER_KEY}", f"sampling_params.extra_args.{USER_KEY}")
METRIC = "vllm:output_rate_identity_refused"  # exposed as ..._total{reason}
REASONS = ("missing", "unknown_key", "bad_credentials", "bad_user_id", "body_claim", "bad_body", "websocket")
LOG_INTERVAL_NS = 1_000_000_000

# Set by ``configure`` in the API-server process; the plugin's front-end check reads it.
_ACTIVE: dict[str, Any] = {"settings": None, "keys": None}


@dataclass(frozen=True)
class Refusal:
    """A refused request: HTTP ``status``, metric ``reason`` (one of ``REASONS``), the
    client-facing ``message`` and the request ``param`` at fault (or None)."""

    status: int
    reason: str
    message: str
    param: str | None = None


class _Refusals:
    """The refusal counter (prometheus-client, default registry, created once per process)
    and the rate-limited refusal log."""

    def __init__(self) -> None:
        self._counter: Any = None
        self._last_log_ns: dict[str, int] = {}
        self._unlogged: dict[str, int] = {}

    def counter(self) -> Any:
        if self._counter is None:
            existing = getattr(REGISTRY, "_names_to_collectors", {}).get(METRIC + "_total")
            self._counter = existing or Counter(
                METRIC, "Requests refused by the output-rate identity check", ["reason"]
            )
        return self._counter

    def record(self, refusal: Refusal, method: str, path: str, client: Any) -> None:
        self.counter().labels(reason=refusal.reason).inc()
        now = time.monotonic_ns()
        last = self._last_log_ns.get(refusal.reason)
        if last is not None and now - last < LOG_INTERVAL_NS:
            self._unlogged[refusal.reason] = self._unlogged.get(refusal.reason, 0) + 1
            return
        self._last_log_ns[refusal.reason] = now
        more = self._unlogged.pop(refusal.reason, 0)
        host = client[0] if isinstance(client, (list, tuple)) and client else "?"
        logger.warning(
            "output-rate: refused %s %s from %s: %s (HTTP %d)%s",
            method,
            path[:200],
            host,
            refusal.reason,
            refusal.status,
            f"; {more} more refused for this reason since the last line" if more else "",
        )


REFUSALS = _Refusals()


def configure(settings: IdentitySettings | None, keys: Any = None) -> None:
    """Set this process's identity settings and keys (``KeysFileWatcher``) for the
    middleware instances built without arguments (``--middleware``) and the plugin's check."""
    _ACTIVE["settings"] = settings
    _ACTIVE["keys"] = keys


def active_settings() -> IdentitySettings | None:
    """The settings ``configure`` set in this process (None: not configured)."""
    return _ACTIVE["settings"]


def _header_values(headers: list[tuple[bytes, bytes]], name: bytes) -> list[str]:
    return [value.decode("latin-1") for key, value in headers if key.lower() == name]


def _from_header(settings: IdentitySettings, headers: list[tuple[bytes, bytes]]) -> str | Refusal | None:
    assert settings.header is not None
    values = _header_values(headers, settings.header.encode("latin-1"))
    if not values:
        return None
    if len(values) > 1 or not is_user_id(values[0]):
        return Refusal(
            400,
            "bad_user_id",
            f"header {settings.header} must be given once with a non-empty user id of at most 256 characters",
        )
    return values[0]


def _from_key(keys: Any, headers: list[tuple[bytes, bytes]]) -> str | Refusal | None:
    values = _header_values(headers, b"authorization")
    if not values:
        return None
    scheme, _, token = values[0].partition(" ")
    token = token.strip()
    if len(values) > 1 or scheme.lower() != "bearer" or not token:
        return Refusal(401, "bad_credentials", "the Authorization header must be given once as 'Bearer KEY'")
    user = keys.user_of(token) if keys is not None else None
    if user is None:
        return Refusal(401, "unknown_key", "invalid API key")
    return user


def resolve_user(settings: IdentitySettings, keys: Any, headers: list[tuple[bytes, bytes]]) -> str | Refusal:
    """R30/R32: the user of a request with these ASGI ``headers``, or why it is refused.

    ``keys``: an object with ``user_of(token) -> str | None`` (``KeysFileWatcher``).
    """
    found = _from_key(keys, headers) if settings.mode == IDENTITY_API_KEY else _from_header(settings, headers)
    if found is not None:
        return found
    if settings.on_missing == "anonymous":
        return ANONYMOUS_USER
    what = (
        "an API key (Authorization: Bearer KEY)" if settings.mode == IDENTITY_API_KEY else f"header {settings.header}"
    )
    return Refusal(401, "missing", f"no identity: this server takes the user from {what}")


def _claim_holders(body: dict[str, Any]) -> list[tuple[str, Any]]:
    """The (field, object) pairs of ``body`` that may hold ``output_rate_user``."""
    holders: list[tuple[str, Any]] = [(CLAIM_FIELDS[0], body.get("vllm_xargs"))]
    sampling = body.get("sampling_params")
    if isinstance(sampling, dict):
        holders.append((CLAIM_FIELDS[1], sampling.get("extra_args")))
    return holders


def bind_body(settings: IdentitySettings, user: str, raw: bytes) -> bytes | Refusal:
    """R30/R31: ``raw`` (a request body) re-serialised with ``user`` as its one
    ``output_rate_user``, or why it is refused (not a JSON object; ``vllm_xargs`` or
    ``sampling_params.extra_args`` not an object; a user already named, unless
    ``on_claim`` is ``"overwrite"``). An empty body is returned as is."""
    if not raw.strip():
        return raw
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        body = None
    if not isinstance(body, dict):
        return Refusal(400, "bad_body", "the request body must be a JSON object")
    for field, holder in _claim_holders(body):
        if holder is not None and not isinstance(holder, dict):
            return Refusal(400, "bad_body", f"{field.rsplit('.', 1)[0]} must be a JSON object", field)
        if isinstance(holder, dict) and USER_KEY in holder and settings.on_claim != "overwrite":
            return Refusal(
                400,
                "body_claim",
                f"{field} must not be given: this server binds the user to the "
                + ("API key" if settings.mode == IDENTITY_API_KEY else f"header {settings.header}"),
                field,
            )
    body["vllm_xargs"] = {**(body.get("vllm_xargs") or {}), USER_KEY: user}
    sampling = body.get("sampling_params")
    if isinstance(sampling, dict):
        sampling["extra_args"] = {**(sampling.get("extra_args") or {}), USER_KEY: user}
    return json.dumps(body, ensure_ascii=False, allow_nan=True).encode("utf-8")


def _error_body(refusal: Refusal) -> bytes:
    kind = "BadRequestError" if refusal.status == 400 else "AuthenticationError"
    error = {
        "message": refusal.message,
        "type": kind,
        "param": refusal.param,
        "code": refusal.status,
        "reason": refusal.reason,
    }
    return json.dumps({"error": error}).encode()


Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


NOT_CONFIGURED = (
    "IdentityMiddleware is named by --middleware, but no bound identity is configured in this "
    'process: set output_rate.identity ("header:NAME" or "api-key", --identity) with the feature on, '
    "and keep the output_rate plugin loaded (VLLM_PLUGINS must not filter it out); or drop --middleware"
)


class IdentityMiddleware:
    """R30-R32: the identity-binding ASGI middleware (module docstring).

    Args:
        app: the ASGI application it wraps.
        settings: the identity settings; None: those ``configure`` set in this process
            (``--middleware``).
        keys: the ``KeysFileWatcher`` (``"api-key"``); None: the configured one.

    Raises:
        RuntimeError: no settings given and none configured (``NOT_CONFIGURED``): fails
            closed, so a ``--middleware`` without the plugin's configuration never passes
            requests as if identity were bound.
    """

    def __init__(self, app: Any, settings: IdentitySettings | None = None, keys: Any = None) -> None:
        self.app = app
        self.settings = settings if settings is not None else active_settings()
        self.keys = keys if keys is not None else _ACTIVE["keys"]
        if self.settings is None:
            # Named by --middleware, but nothing configured this process: failing open here
            # would let every client name its user while the operator believes otherwise.
            raise RuntimeError(NOT_CONFIGURED)

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        settings = self.settings
        if settings is None or not settings.bound or scope.get("output_rate_identity_checked"):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await self._refuse_websocket(scope, send)
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope = {**scope, "output_rate_identity_checked": True}
        method = scope.get("method", "GET")
        headers = list(scope.get("headers", []))
        if method in UNGOVERNED_METHODS:
            refusal = self._guarded_read_refusal(scope, headers)
            if refusal is not None:
                await self._refuse(scope, send, refusal)
                return
            await self.app(scope, receive, send)
            return
        user = resolve_user(settings, self.keys, headers)
        if isinstance(user, Refusal):
            await self._refuse(scope, send, user)
            return
        raw, disconnected = await _read_body(receive)
        if disconnected:
            return
        bound = bind_body(settings, user, raw)
        if isinstance(bound, Refusal):
            await self._refuse(scope, send, bound)
            return
        headers = [(k, v) for k, v in headers if k.lower() not in (b"content-length", b"transfer-encoding")]
        headers.append((b"content-length", str(len(bound)).encode()))
        await self.app({**scope, "headers": headers}, _replay(bound, receive), send)

    def _guarded_read_refusal(self, scope: dict[str, Any], headers: list[tuple[bytes, bytes]]) -> Refusal | None:
        """api-key: a read under vLLM's guarded prefixes needs a valid key (as ``--api-key``)."""
        if self.settings is None or self.settings.mode != IDENTITY_API_KEY or scope.get("method") == "OPTIONS":
            return None
        path = scope.get("path", "").removeprefix(scope.get("root_path", ""))
        if not path.startswith(GUARDED_PREFIXES):
            return None
        user = resolve_user(self.settings, self.keys, headers)
        return user if isinstance(user, Refusal) else None

    async def _refuse(self, scope: dict[str, Any], send: Send, refusal: Refusal) -> None:
        REFUSALS.record(refusal, scope.get("method", "?"), scope.get("path", "?"), scope.get("client"))
        body = _error_body(refusal)
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if refusal.status == 401 and self.settings is not None and self.settings.mode == IDENTITY_API_KEY:
            headers.append((b"www-authenticate", b"Bearer"))
        await send({"type": "http.response.start", "status": refusal.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _refuse_websocket(self, scope: dict[str, Any], send: Send) -> None:
        refusal = Refusal(403, "websocket", "WebSocket endpoints cannot carry a bound identity")
        REFUSALS.record(refusal, "WEBSOCKET", scope.get("path", "?"), scope.get("client"))
        await send({"type": "websocket.close", "code": 1008})


async def _read_body(receive: Receive) -> tuple[bytes, bool]:
    """The whole request body, and whether the client disconnected first."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b"", True
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks), False


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that yields ``body`` once, then defers to ``receive`` (disconnects)."""
    sent = False

    async def replay() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
