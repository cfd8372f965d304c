"""R30-R32: identity bound to a gateway's header or an API key (reference/identity_middleware.py,
reference/keysfile.py, output_rate.identity, outrate keys add), in process."""

from __future__ import annotations

import asyncio
import json
import logging
from argparse import Namespace
from pathlib import Path
from typing import Any, ClassVar

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_output_rate.reference.config import parse_output_rate
from vllm_output_rate.reference.identity import ANONYMOUS_USER, USER_KEY, IdentitySettings, parse_identity
from vllm_output_rate.reference.identity_middleware import METRIC, IdentityMiddleware
from vllm_output_rate.reference.keysfile import KeysFileWatcher, add_key, key_hash, parse_keys_file
from vllm_output_rate.reference.limiter import OutputRateLimiter
from vllm_output_rate.reference.section import OutputRateConfigError

LOG = logging.getLogger("test.identity")


class _App:
    """The wrapped ASGI app: records the scope and body it was given, answers 200."""

    def __init__(self) -> None:
        self.calls: list[tuple[dict[str, Any], bytes]] = []

    async def __call__(self, scope, receive, send) -> None:
        body = b""
        if scope["type"] == "http":
            while True:
                message = await receive()
                body += message.get("body", b"")
                if not message.get("more_body"):
                    break
        self.calls.append((scope, body))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


def _call(
    middleware: IdentityMiddleware,
    headers: list[tuple[bytes, bytes]],
    body: bytes,
    method: str = "POST",
    path="/v1/completions",
):
    """Run one HTTP request through ``middleware``; returns (status, response body)."""
    chunks = [body[:7], body[7:]] if len(body) > 7 else [body]
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
    sent: list[dict[str, Any]] = []

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "headers": headers, "client": ("10.0.0.9", 5555)}
    asyncio.run(middleware(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def _keys(tmp_path: Path, users: dict[str, int]) -> tuple[KeysFileWatcher, dict[str, list[str]]]:
    """A keys file with ``users[u]`` new keys per user; the watcher and the raw keys."""
    path = str(tmp_path / "keys.json")
    raw = {user: [add_key(path, user) for _ in range(n)] for user, n in users.items()}
    watcher = KeysFileWatcher(path, LOG)
    watcher.load_initial()
    return watcher, raw


def _bearer(key: str) -> list[tuple[bytes, bytes]]:
    return [(b"authorization", f"Bearer {key}".encode())]


def _api_key(tmp_path, users, **kw) -> tuple[IdentityMiddleware, _App, dict[str, list[str]]]:
    keys, raw = _keys(tmp_path, users)
    app = _App()
    settings_ = IdentitySettings("api-key", keys_file=keys.path, **kw)
    return IdentityMiddleware(app, settings_, keys), app, raw


def _user_of(body: bytes) -> Any:
    return json.loads(body)["vllm_xargs"][USER_KEY]


def _refused(reason: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(METRIC + "_total", {"reason": reason}) or 0.0


@pytest.mark.rules("R30")
def test_r30_two_keys_of_one_user_share_one_budget(tmp_path):
    middleware, app, raw = _api_key(tmp_path, {"user-a": 2})
    for key in raw["user-a"]:
        assert _call(middleware, _bearer(key), b'{"prompt": "hi", "max_tokens": 4}')[0] == 200
    users = [_user_of(body) for _, body in app.calls]
    assert users == ["user-a", "user-a"]
    # One user id, so one GCRA: at 10 tok/s and a 100 ms burst, 2 tokens at t=0, whichever key.
    limiter = OutputRateLimiter(10)
    assert [limiter.try_take(users[0], 0), limiter.try_take(users[1], 0), limiter.try_take(users[0], 0)] == [
        True,
        True,
        False,
    ]


@pytest.mark.rules("R31")
def test_r31_key_of_a_claiming_b_is_refused_and_b_untouched(tmp_path, caplog):
    middleware, app, raw = _api_key(tmp_path, {"user-a": 1, "user-b": 1})
    before = _refused("body_claim")
    body = json.dumps({"prompt": "x", "vllm_xargs": {USER_KEY: "user-b"}}).encode()
    with caplog.at_level(logging.WARNING, logger="vllm.output_rate.identity"):
        status, answer = _call(middleware, _bearer(raw["user-a"][0]), body)
    assert status == 400
    error = json.loads(answer)["error"]
    assert error["param"] == f"vllm_xargs.{USER_KEY}" and f"vllm_xargs.{USER_KEY}" in error["message"]
    assert app.calls == []  # nothing reached vLLM: user-b was charged nothing
    assert _refused("body_claim") == before + 1
    assert "body_claim" in caplog.text and raw["user-a"][0] not in caplog.text
    # The tokens API's own field is a claim too.
    tokens_body = json.dumps({"token_ids": [1], "sampling_params": {"extra_args": {USER_KEY: "user-b"}}}).encode()
    status, answer = _call(middleware, _bearer(raw["user-a"][0]), tokens_body, path="/inference/v1/generate")
    assert status == 400 and json.loads(answer)["error"]["param"] == f"sampling_params.extra_args.{USER_KEY}"
    # user-b's own request still binds user-b.
    assert _call(middleware, _bearer(raw["user-b"][0]), b"{}")[0] == 200
    assert [_user_of(b) for _, b in app.calls] == ["user-b"]


@pytest.mark.rules("R31")
def test_r31_overwrite_replaces_the_claim_silently(tmp_path):
    middleware, app, raw = _api_key(tmp_path, {"user-a": 1}, on_claim="overwrite")
    body = {
        "token_ids": [1],
        "vllm_xargs": {USER_KEY: "user-b", "x": 1},
        "sampling_params": {"extra_args": {USER_KEY: "b"}},
    }
    assert _call(middleware, _bearer(raw["user-a"][0]), json.dumps(body).encode())[0] == 200
    forwarded = json.loads(app.calls[0][1])
    assert forwarded["vllm_xargs"] == {USER_KEY: "user-a", "x": 1}
    assert forwarded["sampling_params"]["extra_args"] == {USER_KEY: "user-a"}
    assert dict(app.calls[0][0]["headers"])[b"content-length"] == str(len(app.calls[0][1])).encode()


@pytest.mark.rules("R32")
def test_r32_no_identity_is_401_or_anonymous(tmp_path):
    middleware, app, _ = _api_key(tmp_path, {"user-a": 1})
    assert _call(middleware, [], b"{}")[0] == 401
    assert _call(middleware, _bearer("ork-not-a-key"), b"{}")[0] == 401
    assert _call(middleware, [(b"authorization", b"Basic abc")], b"{}")[0] == 401
    assert _call(middleware, [], b"", method="GET", path="/v1/models")[0] == 401  # as vLLM's --api-key
    assert _call(middleware, [], b"", method="GET", path="/health")[0] == 200
    assert app.calls and all(scope["path"] == "/health" for scope, _ in app.calls)
    (tmp_path / "anon").mkdir()
    anonymous, app2, _ = _api_key(tmp_path / "anon", {"u": 1}, on_missing="anonymous")
    assert _call(anonymous, [], b"{}")[0] == 200
    assert _call(anonymous, _bearer("ork-wrong"), b"{}")[0] == 401  # a wrong key is never downgraded
    assert [_user_of(b) for _, b in app2.calls] == [ANONYMOUS_USER]


@pytest.mark.rules("R30", "R32")
def test_r30_header_mode_binds_the_gateway_header():
    app = _App()
    middleware = IdentityMiddleware(app, parse_identity("header:X-User-Id"), None)
    assert _call(middleware, [(b"x-user-id", b"team-a")], b'{"prompt": "p"}')[0] == 200
    assert _user_of(app.calls[0][1]) == "team-a"
    assert _call(middleware, [], b"{}")[0] == 401
    assert _call(middleware, [(b"x-user-id", b"a"), (b"X-User-Id", b"b")], b"{}")[0] == 400  # given twice
    assert _call(middleware, [(b"x-user-id", b"a" * 257)], b"{}")[0] == 400
    assert _call(middleware, [(b"x-user-id", b"a")], b"[1]")[0] == 400  # not a JSON object
    assert _call(middleware, [(b"x-user-id", b"a")], b'{"vllm_xargs": 3}')[0] == 400


def test_body_mode_passes_everything_unchanged():
    app = _App()
    middleware = IdentityMiddleware(app, IdentitySettings(), None)
    body = json.dumps({"vllm_xargs": {USER_KEY: "anyone"}}).encode()
    assert _call(middleware, [], body)[0] == 200 and app.calls[0][1] == body


def test_websocket_is_closed_when_identity_is_bound():
    sent: list[dict[str, Any]] = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "websocket.connect"}

    app = _App()
    middleware = IdentityMiddleware(app, parse_identity("header:X-U"), None)
    asyncio.run(middleware({"type": "websocket", "path": "/v1/realtime", "headers": []}, receive, send))
    assert sent == [{"type": "websocket.close", "code": 1008}] and app.calls == []


HEADERS = st.lists(
    st.tuples(
        st.sampled_from([b"authorization", b"x-user-id", b"X-User-Id", b"content-type", b"x-other"]),
        st.one_of(st.binary(max_size=40), st.sampled_from([b"Bearer KEY_A", b"bearer KEY_B", b"Bearer ", b"u1"])),
    ),
    max_size=4,
)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
BODIES = st.one_of(
    st.binary(max_size=60),
    JSON_VALUES.map(lambda v: json.dumps(v).encode()),
    st.fixed_dictionaries(
        {},
        optional={
            "vllm_xargs": st.one_of(
                JSON_VALUES, st.dictionaries(st.sampled_from([USER_KEY, "k"]), JSON_VALUES, max_size=2)
            ),
            "sampling_params": st.one_of(JSON_VALUES, st.fixed_dictionaries({}, optional={"extra_args": JSON_VALUES})),
            "prompt": st.text(max_size=5),
        },
    ).map(lambda v: json.dumps(v).encode()),
)
MODES = st.sampled_from(
    [
        IdentitySettings("header", "x-user-id"),
        IdentitySettings("header", "x-user-id", on_claim="overwrite", on_missing="anonymous"),
        IdentitySettings("api-key", keys_file="k"),
        IdentitySettings("api-key", keys_file="k", on_claim="overwrite", on_missing="anonymous"),
    ]
)


class _FixedKeys:
    """Two keys, of two users (``user_of`` as ``KeysFileWatcher``)."""

    users: ClassVar[dict[str, str]] = {"KEY_A": "user-a", "KEY_B": "user-b"}

    def user_of(self, token: str) -> str | None:
        return self.users.get(token)


@pytest.mark.rules("R30", "R31", "R32")
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mode=MODES, headers=HEADERS, body=BODIES, method=st.sampled_from(["POST", "PUT", "GET"]))
def test_r30_middleware_passes_one_user_or_refuses_4xx(mode, headers, body, method):
    app = _App()
    status, _ = _call(
        IdentityMiddleware(app, mode, _FixedKeys()), headers, body, method=method, path="/v1/chat/completions"
    )
    if status != 200:
        assert 400 <= status < 500 and app.calls == []
        return
    assert len(app.calls) == 1
    if method == "GET":
        return  # a read carries no generation
    forwarded = app.calls[0][1]
    if not body.strip():
        assert forwarded == body
        return
    data = json.loads(forwarded)
    user = data["vllm_xargs"][USER_KEY]
    assert isinstance(user, str) and 0 < len(user) <= 256
    sampling = data.get("sampling_params")
    if isinstance(sampling, dict):
        assert sampling["extra_args"][USER_KEY] == user  # exactly one user id in the request
    if mode.mode == "api-key":
        tokens = [v.decode("latin-1").partition(" ")[2].strip() for k, v in headers if k.lower() == b"authorization"]
        assert user == _FixedKeys.users.get(tokens[0], ANONYMOUS_USER) if tokens else user == ANONYMOUS_USER


def test_keys_file_bad_entry_stops_start_up_naming_it_never_its_text(tmp_path):
    path = tmp_path / "keys.json"
    raw_key = "ork-THIS-IS-A-RAW-KEY"
    path.write_text(json.dumps({"user-a": [key_hash("k1")], "user-b": [key_hash("k2"), raw_key]}))
    section = {"default_tokens_per_s": 5, "identity": "api-key", "keys_file": str(path)}
    with pytest.raises(OutputRateConfigError) as err:
        parse_output_rate(section)
    message = str(err.value)
    assert "user 'user-b', entry 2" in message and str(path) in message and raw_key not in message
    cases = {
        "[1]": "must be a JSON object",
        '{"": ["sha256:' + "0" * 64 + '"]}': "not a valid user id",
        '{"u": []}': "non-empty list",
        '{"u": ["sha256:' + "0" * 64 + '"], "v": ["sha256:' + "0" * 64 + '"]}': "also listed under user 'u'",
        '{"u": ["x"], "u": ["y"]}': "given twice",
        "{": "not valid JSON",
    }
    for text, expected in cases.items():
        with pytest.raises(OutputRateConfigError, match=expected):
            parse_keys_file(text, "k.json")
    with pytest.raises(OutputRateConfigError, match="does not exist; create it with `outrate keys add"):
        parse_output_rate({**section, "keys_file": str(tmp_path / "missing.json")})


def test_keys_file_reload_off_the_step_keeps_keys_on_a_bad_file_and_never_logs_them(tmp_path, caplog):
    path = str(tmp_path / "keys.json")
    key_a = add_key(path, "user-a")
    now = [0]
    watcher = KeysFileWatcher(path, logging.getLogger("vllm.output_rate.test"), clock_ns=lambda: now[0])
    with caplog.at_level(logging.INFO):
        watcher.load_initial()
        key_b = add_key(path, "user-b")
        assert watcher.user_of(key_b) is None  # within the poll interval: not read yet
        now[0] += 1_000_000_000
        assert watcher.user_of(key_b) == "user-b" and watcher.user_of(key_a) == "user-a"
        Path(path).write_text('{"user-a": ["' + key_a + '"]}')  # a raw key pasted by mistake
        now[0] += 2_000_000_000
        assert watcher.user_of(key_b) == "user-b"  # bad file: the keys in force are kept
    assert "entry 1" in caplog.text
    for secret in (key_a, key_b, key_hash(key_a), key_hash(key_b)):
        assert secret not in caplog.text


def test_outrate_keys_add_prints_the_key_once_and_stores_its_hash(tmp_path):
    from vllm_output_rate.cli import main

    path = tmp_path / "keys.json"
    result = CliRunner().invoke(main, ["keys", "add", "user-a", "--keys-file", str(path)])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ork-")
    stored = json.loads(path.read_text())
    assert stored == {"user-a": [key_hash(lines[0])]} and lines[0] not in path.read_text()
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    bad = CliRunner().invoke(main, ["keys", "add", "", "--keys-file", str(path)])
    assert bad.exit_code == 2 and "USER must be a non-empty string" in bad.output


def test_identity_settings_refuse_bad_values():
    for args, expected in [
        (("header:",), "not an HTTP header name"),
        (("header:X User",), "not an HTTP header name"),
        (("api-key",), "needs keys_file"),
        (("body", "k.json"), "set identity to"),
        (("header:X", None, "drop"), "identity_on_claim must be one of"),
        ((None, None, None, "anonymous"), "applies only when identity"),
        (("apikey",), 'identity must be "body"'),
    ]:
        with pytest.raises(ValueError, match=expected):
            parse_identity(*args)


def test_plugin_installs_identity_only_when_bound_and_refuses_vllm_api_key(tmp_path, monkeypatch):
    from vllm_output_rate.reference import identity_middleware
    from vllm_output_rate.reference.plugin import identity_for_server

    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    monkeypatch.setattr(identity_middleware, "_ACTIVE", {"settings": None, "keys": None})
    path = str(tmp_path / "keys.json")
    add_key(path, "user-a")
    section = {"default_tokens_per_s": 5, "identity": "api-key", "keys_file": path}
    assert identity_for_server(
        Namespace(additional_config={"output_rate": {"default_tokens_per_s": 5}}, api_key=None)
    ) == (None, None)
    assert identity_for_server(Namespace(additional_config={"output_rate": {"identity": "api-key"}}, api_key=None)) == (
        None,
        None,
    )
    settings_, keys = identity_for_server(Namespace(additional_config={"output_rate": section}, api_key=None))
    assert settings_.mode == "api-key" and keys is not None and identity_middleware.active_settings() is settings_
    with pytest.raises(OutputRateConfigError, match="remove --api-key"):
        identity_for_server(Namespace(additional_config={"output_rate": section}, api_key=["k"]))


@pytest.mark.rules("R30")
def test_r30_front_end_refuses_a_request_without_user_while_identity_is_bound(monkeypatch):
    """An endpoint that builds its own SamplingParams (no vllm_xargs) cannot carry the bound
    user: the plugin's front-end check refuses it instead of charging ``__anonymous__``."""
    from types import SimpleNamespace

    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor

    from vllm_output_rate.reference import identity_middleware, plugin

    plugin.register()
    engine = SimpleNamespace(
        vllm_config=SimpleNamespace(additional_config={"output_rate": {"default_tokens_per_s": 5}})
    )
    monkeypatch.setattr(identity_middleware, "_ACTIVE", {"settings": parse_identity("header:X-U"), "keys": None})
    with pytest.raises(plugin.OutputRateRequestError, match="does not carry the user"):
        InputProcessor._validate_params(engine, SamplingParams(max_tokens=2), ("generate",))
    passed = []  # with the user bound (or identity not bound) our check lets it through
    for extra, settings_ in (({USER_KEY: "u"}, parse_identity("header:X-U")), (None, None)):
        monkeypatch.setattr(identity_middleware, "_ACTIVE", {"settings": settings_, "keys": None})
        try:
            InputProcessor._validate_params(engine, SamplingParams(max_tokens=2, extra_args=extra), ("generate",))
        except plugin.OutputRateRequestError:
            raise
        except Exception:  # vLLM's own checks on this bare engine object: past ours
            pass
        passed.append(extra)
    assert passed == [{USER_KEY: "u"}, None]


@pytest.mark.rules("R30")
def test_r30_middleware_named_by_flag_uses_the_plugins_settings_and_fails_closed_without(monkeypatch):
    from vllm_output_rate.reference import identity_middleware

    monkeypatch.setattr(identity_middleware, "_ACTIVE", {"settings": None, "keys": None})
    with pytest.raises(RuntimeError, match="no bound identity is configured"):
        IdentityMiddleware(_App())
    monkeypatch.setattr(identity_middleware, "_ACTIVE", {"settings": parse_identity("header:X-U"), "keys": None})
    app = _App()
    inner = IdentityMiddleware(app)  # --middleware: vLLM builds it with the app alone
    outer = IdentityMiddleware(inner, parse_identity("header:X-U"), None)  # the plugin's, outermost
    assert _call(inner, [], b"{}")[0] == 401
    assert _call(outer, [(b"x-u", b"alice")], b'{"vllm_xargs": {}}')[0] == 200
    assert [_user_of(body) for _, body in app.calls] == ["alice"]  # bound once, passed by the inner copy


def test_outrate_serve_stops_on_a_bad_keys_file_and_refuses_vllm_api_key_with_it(tmp_path):
    from vllm_output_rate.cli import main

    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"alice": ["ork-a-raw-key"]}))
    base = ["serve", "m", "--default-user-output-tokens-per-second", "5", "--identity", "api-key", "--print-command"]
    bad = CliRunner().invoke(main, [*base, "--keys-file", str(path)])
    assert bad.exit_code == 2 and "user 'alice', entry 1" in bad.output and "ork-a-raw-key" not in bad.output
    add_key(str(tmp_path / "good.json"), "alice")
    both = CliRunner().invoke(main, [*base, "--keys-file", str(tmp_path / "good.json"), "--api-key", "k"])
    assert both.exit_code == 2 and "drop --api-key" in both.output
    good = CliRunner().invoke(main, [*base, "--keys-file", str(tmp_path / "good.json")])
    assert good.exit_code == 0 and '"identity":"api-key"' in good.output and str(tmp_path / "good.json") in good.output
