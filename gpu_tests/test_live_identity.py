"""R30-R32 live: the k-ids attack against ``outrate serve`` in each identity mode.

The attack: one client opens K streams, each naming a made-up user in
``vllm_xargs.output_rate_user``, to get K buckets instead of one. Three servers (one per
mode), every user at ``RATE`` tokens/s:

- ``--identity api-key`` (claims refused, the default): the made-up ids are refused with
  400, and so is a claim of another user's id; the attacker's K streams under its one key
  run at one user's rate, and the victim, streaming meanwhile with its own key, keeps its
  rate. ``/metrics`` counts the refusals by reason.
- ``--identity body`` (R17, the default): the attack works; the aggregate rate over one
  user's is the multiplier the docs quote. A claim of the victim's id halves the victim.
- ``--identity header:X-User-Id --identity-on-claim overwrite`` (a gateway sets the
  header): the made-up ids are overwritten; the K streams run at one user's rate.

The measured rates are printed (``-s``) for docs/OPERATING.md. The servers start one at a
time (each when its test first needs it); about 2-4 min on 2 cores, most of it start-ups.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import live_server
import pytest
from live_server import rate_flags, scrape

from vllm_output_rate.reference.keysfile import add_key, key_hash

pytestmark = pytest.mark.live

RATE = 8  # tokens/s of every user
K = 4  # made-up ids of the attack
TOKENS = 16  # per stream
LOW, HIGH = 0.75, 1.3  # a measured rate within [LOW, HIGH] x the expected one


READY_TIMEOUT_S = 300  # a loaded 2-core machine: vLLM's start-up alone can take minutes


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("identity")


@pytest.fixture(scope="module")
def keys(root) -> dict[str, str]:
    """The api-key server's keys file (``root/keys.json``): one key each for attacker and victim."""
    return {user: add_key(str(root / "keys.json"), user) for user in ("attacker", "victim")}


def _server(root: Path, mode: str, flags: list[str]):
    """``outrate serve`` at RATE with ``flags``, in ``root/mode`` (log: ``serve.log``)."""
    (root / mode).mkdir()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(live_server, "READY_TIMEOUT_S", READY_TIMEOUT_S)
        with live_server.serving(root / mode, [*rate_flags(RATE), *flags], {"VLLM_LOGGING_LEVEL": "WARNING"}) as url:
            yield url


@pytest.fixture(scope="module")
def api_key_server(root, keys):
    yield from _server(root, "api-key", ["--identity", "api-key", "--keys-file", str(root / "keys.json")])


@pytest.fixture(scope="module")
def body_server(root):
    yield from _server(root, "body", [])


@pytest.fixture(scope="module")
def header_server(root):
    yield from _server(root, "header", ["--identity", "header:X-User-Id", "--identity-on-claim", "overwrite"])


async def _stream(
    client: httpx.AsyncClient, model: str, headers: dict[str, str], user: str | None
) -> tuple[int, list[float]]:
    """One streamed completion of TOKENS tokens; (HTTP status, arrival time of each token)."""
    body = {"model": model, "prompt": "hello", "max_tokens": TOKENS, "stream": True, "ignore_eos": True}
    body["return_token_ids"] = True  # count tokens exactly: a chunk may carry several, or text of none
    if user is not None:
        body["vllm_xargs"] = {"output_rate_user": user}
    times: list[float] = []
    async with client.stream("POST", "/v1/completions", json=body, headers=headers) as response:
        if response.status_code != 200:
            await response.aread()
            return response.status_code, times
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line[6:].strip() != "[DONE]":
                chunk = json.loads(line[6:])
                times += [time.monotonic()] * sum(len(c.get("token_ids") or ()) for c in chunk["choices"])
    return 200, times


def _rate(token_times: list[list[float]]) -> float:
    """Aggregate tokens/s of streams: (tokens - 1) / (last - first arrival)."""
    times = sorted(t for stream in token_times for t in stream)
    return (len(times) - 1) / (times[-1] - times[0])


async def _attack(base_url: str, groups: dict[str, list[tuple[dict[str, str], str | None]]]):
    """Run every group's streams at once; per group: (statuses, token times per stream)."""
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=httpx.Limits(max_connections=32)) as client:
        first_headers = next(iter(groups.values()))[0][0]
        model = (await client.get("/v1/models", headers=first_headers)).json()["data"][0]["id"]
        jobs = {name: [_stream(client, model, h, u) for h, u in streams] for name, streams in groups.items()}
        flat = await asyncio.gather(*(job for group in jobs.values() for job in group))
    out, i = {}, 0
    for name, streams in groups.items():
        part = flat[i : i + len(streams)]
        out[name] = ([s for s, _ in part], [t for s, t in part if s == 200])
        i += len(streams)
    return out


def _made_up(n: int) -> list[str]:
    return [f"made-up-{i}" for i in range(n)]


@pytest.mark.rules("R30", "R31")
def test_r30_r31_live_api_key_one_keys_ids_run_at_one_users_rate_and_a_claim_is_refused(api_key_server, keys, root):
    base = api_key_server
    attacker = {"Authorization": f"Bearer {keys['attacker']}"}
    victim = {"Authorization": f"Bearer {keys['victim']}"}
    claim = httpx.post(
        f"{base}/v1/completions",
        json={"prompt": "x", "max_tokens": 1, "vllm_xargs": {"output_rate_user": "victim"}},
        headers=attacker,
    )
    assert claim.status_code == 400 and "vllm_xargs.output_rate_user" in claim.json()["error"]["message"]
    assert httpx.post(f"{base}/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 401
    result = asyncio.run(
        _attack(
            base,
            {
                "victim": [(victim, None)],
                "made-up ids": [(attacker, user) for user in _made_up(K)],
                "claims of victim": [(attacker, "victim")] * 2,
                "attacker's streams": [(attacker, None)] * K,
            },
        )
    )
    assert result["made-up ids"][0] == [400] * K and result["claims of victim"][0] == [400] * 2
    assert result["attacker's streams"][0] == [200] * K and result["victim"][0] == [200]
    assert [len(t) for t in result["attacker's streams"][1] + result["victim"][1]] == [TOKENS] * (K + 1)
    aggregate, victim_rate = _rate(result["attacker's streams"][1]), _rate(result["victim"][1])
    print(f"\napi-key: attacker's {K} streams {aggregate:.2f} tok/s; victim {victim_rate:.2f} tok/s (limit {RATE})")
    assert LOW * RATE <= aggregate <= HIGH * RATE  # one user's rate, not K users'
    assert LOW * RATE <= victim_rate <= HIGH * RATE  # the victim's budget is untouched
    samples = scrape(base)
    refused = {
        dict(labels)["reason"]: v
        for (name, labels), v in samples.items()
        if name.startswith("vllm:output_rate_identity_refused")
    }
    assert refused.get("body_claim", 0) >= K + 3 and refused.get("missing", 0) >= 1
    text = (root / "api-key" / "serve.log").read_text(errors="replace")
    assert "refused POST /v1/completions" in text and "body_claim" in text  # refusals are logged...
    assert all(k not in text and key_hash(k) not in text for k in keys.values())  # ...never a key


@pytest.mark.rules("R30")
def test_r30_live_body_mode_the_k_ids_attack_multiplies_the_rate(body_server):
    result = asyncio.run(
        _attack(
            body_server,
            {
                "made-up ids": [({}, user) for user in _made_up(K)],
                "victim": [({}, "victim")],
                "claim of victim": [({}, "victim")],
            },
        )
    )
    assert all(status == 200 for group in result.values() for status in group[0])
    multiplier = _rate(result["made-up ids"][1]) / RATE
    victim_rate = _rate(result["victim"][1])
    print(
        f"\nbody: {K} made-up ids run at {multiplier:.2f} x one user's rate; the claimed victim gets {victim_rate:.2f} tok/s"
    )
    assert multiplier >= LOW * K  # the attack R30 stops: K buckets instead of one
    assert victim_rate <= HIGH * RATE / 2  # another client spent half the victim's budget


@pytest.mark.rules("R30", "R31", "R32")
def test_r30_live_header_mode_made_up_ids_are_overwritten_to_the_gateways_user(header_server):
    base = header_server
    assert httpx.post(f"{base}/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 401
    gateway = {"X-User-Id": "attacker"}
    result = asyncio.run(_attack(base, {"made-up ids": [(gateway, user) for user in _made_up(K)]}))
    assert result["made-up ids"][0] == [200] * K
    aggregate = _rate(result["made-up ids"][1])
    print(f"\nheader (overwrite): {K} made-up ids run at {aggregate:.2f} tok/s together (limit {RATE})")
    assert LOW * RATE <= aggregate <= HIGH * RATE
