"""R30-R32: the gate's ``identity/bind`` row: the reference front end's identity middleware
(``reference/identity_middleware.py``) against the spec's decision (``spec/identity.py``)
on every abstract case.

Each case (mode x ``on_claim`` x ``on_missing`` x credential x body) is made concrete
(headers, a JSON body; a claim both in ``vllm_xargs`` and in the tokens API's
``sampling_params.extra_args``), sent through the ASGI middleware, and its outcome
(passed and charged to whom, or refused with which status and reason) compared with
``spec.identity.bound_outcome``. Pure Python: no vLLM, no candidate, no option.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from collections.abc import Callable, Iterator
from typing import Any

from vllm_output_rate.adapter.gate_result import CheckResult
from vllm_output_rate.reference.identity import IdentitySettings, validate_extra_args
from vllm_output_rate.reference.identity_middleware import IdentityMiddleware
from vllm_output_rate.spec import identity as spec

IDENTITY_RULES = ("R30", "R31", "R32")
USER = "user-1"
KEY = "KEY-OF-USER-1"
CLAIMED = "someone-else"
MODES = ("body", "header", "api-key")
BODIES = {
    spec.EMPTY: [b""],
    spec.NOT_OBJECT: [b"[1]", b"not json"],
    spec.BAD_HOLDER: [b'{"vllm_xargs": 1}', b'{"sampling_params": {"extra_args": "x"}}'],
    spec.PLAIN: [b'{"prompt": "p", "vllm_xargs": {"k": 1}}', b'{"token_ids": [1], "sampling_params": {}}'],
    spec.CLAIM: [
        json.dumps({"vllm_xargs": {"output_rate_user": CLAIMED}}).encode(),
        json.dumps({"sampling_params": {"extra_args": {"output_rate_user": CLAIMED}}}).encode(),
    ],
}


class _Keys:
    def user_of(self, token: str) -> str | None:
        return USER if token == KEY else None


def _credential_headers(mode: str, credential: str) -> list[tuple[bytes, bytes]] | None:
    """The request headers of an abstract credential (None: no such case in ``mode``)."""
    if mode == "body":
        return [] if credential == spec.ABSENT else None
    if mode == "header":
        return {
            spec.ABSENT: [],
            spec.MALFORMED: [(b"x-user-id", b"a"), (b"x-user-id", b"b")],
            USER: [(b"x-user-id", USER.encode())],
        }.get(credential)
    return {
        spec.ABSENT: [],
        spec.MALFORMED: [(b"authorization", b"Basic abc")],
        spec.UNKNOWN: [(b"authorization", b"Bearer WRONG")],
        USER: [(b"authorization", f"Bearer {KEY}".encode())],
    }[credential]


def cases() -> Iterator[tuple[str, str, str, str, str, list[tuple[bytes, bytes]], bytes]]:
    """Every concrete case: (mode, on_claim, on_missing, credential, body kind, headers, body)."""
    for mode, on_claim, on_missing in itertools.product(MODES, ("refuse", "overwrite"), ("refuse", "anonymous")):
        if mode == "body" and (on_claim, on_missing) != ("refuse", "refuse"):
            continue  # the options do not apply to "body" (refused at start-up)
        for credential in (*spec.CREDENTIALS, USER):
            headers = _credential_headers(mode, credential)
            if headers is None:
                continue
            for kind, bodies in BODIES.items():
                for body in bodies:
                    yield mode, on_claim, on_missing, credential, kind, headers, body


def reference_outcome(
    mode: str, on_claim: str, on_missing: str, headers: list[tuple[bytes, bytes]], body: bytes
) -> spec.Outcome:
    """What the reference middleware does with one request, as a ``spec.Outcome``."""
    settings = IdentitySettings(
        mode, "x-user-id" if mode == "header" else None, "k" if mode == "api-key" else None, on_claim, on_missing
    )
    forwarded: list[bytes] = []
    sent: list[dict[str, Any]] = []
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def app(scope, receive, send) -> None:
        forwarded.append((await receive())["body"])

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/completions",
        "headers": headers,
        "client": ("127.0.0.1", 1),
    }
    asyncio.run(IdentityMiddleware(app, settings, _Keys())(scope, receive, send))
    if not forwarded:
        error = json.loads(b"".join(m.get("body", b"") for m in sent))["error"]
        return spec.Outcome(False, status=sent[0]["status"], reason=error["reason"])
    if not forwarded[0].strip():
        return spec.Outcome(True, None)
    try:
        data = json.loads(forwarded[0])
    except ValueError:
        data = None  # "body" mode passes it unchanged (vLLM refuses it later)
    users = set()
    for holder in _holders(data):
        users.add(validate_extra_args(holder))
    users = users or {validate_extra_args(None)}
    return spec.Outcome(True, users.pop() if len(users) == 1 else f"{len(users)} users")


def _holders(data: Any) -> list[dict[str, Any]]:
    """The objects of a forwarded body that name the user to the engine (``vllm_xargs``,
    the tokens API's ``sampling_params.extra_args``), where present and objects."""
    if not isinstance(data, dict):
        return []
    sampling = data.get("sampling_params")
    holders = [data.get("vllm_xargs"), sampling.get("extra_args") if isinstance(sampling, dict) else None]
    return [h for h in holders if isinstance(h, dict) and "output_rate_user" in h] or [
        h for h in holders[:1] if isinstance(h, dict)
    ]


def check_identity(tick: Callable[[], None]) -> Any:
    """R30-R32: every case of ``cases`` agrees with ``spec.identity.bound_outcome``."""
    result = CheckResult("identity/bind", list(IDENTITY_RULES), part="spec health")
    quiet = logging.getLogger("vllm.output_rate.identity")
    was, quiet.disabled = quiet.disabled, True  # the refusals it provokes are not the gate's output
    try:
        _compare_all(result, tick)
    finally:
        quiet.disabled = was
    return result


def _compare_all(result: Any, tick: Callable[[], None]) -> None:
    """Compare every case into ``result`` (the first disagreement is its failure)."""
    for mode, on_claim, on_missing, credential, kind, headers, body in cases():
        tick()
        result.examples += 1
        claimed = CLAIMED if kind == spec.CLAIM else None
        expected = spec.bound_outcome(mode, on_claim, on_missing, credential, kind, claimed)
        got = reference_outcome(mode, on_claim, on_missing, headers, body)
        if got != expected and result.result != "fail":
            result.result = "fail"
            result.failure = f"{mode} {on_claim}/{on_missing}, credential {credential}, body {body[:60]!r}: reference {got}, spec {expected}"


def identity_cases() -> int:
    """The ``identity/bind`` row's progress budget: one tick per case."""
    return sum(1 for _ in cases())
