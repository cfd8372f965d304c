"""Tests of the article-style fixture (tests/fixtures/article_style): an
independent implementation of the article's per-user output-rate limit,
driven in-process with real vLLM 0.32.0 schedulers, fabricated model
outputs and a fake clock."""

from __future__ import annotations

import importlib
import itertools
import json
import queue
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
)
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.request import FinishReason, Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from vllm_output_rate.adapter.vllm_compat import model_runner_output

# The fixture is imported from tests/fixtures (put on the path here; the environment is
# offline from tests/conftest.py on).
_FIXTURES = str(Path(__file__).resolve().parent / "fixtures")
if _FIXTURES not in sys.path:
    sys.path.insert(0, _FIXTURES)
hook = importlib.import_module("article_style.hook")
_article_limiter = importlib.import_module("article_style.limiter")
_BURST_NS, OutputRateLimiter = _article_limiter._BURST_NS, _article_limiter.OutputRateLimiter

# Bound by the module fixture below: importing article_style.scheduler
# installs the CLI flags into vLLM's EngineArgs, which is undone when this
# module's tests are over so other test modules see stock vLLM.
ArticleScheduler = ArticleAsyncScheduler = None


@pytest.fixture(scope="module", autouse=True)
def _article_style_installed():
    global ArticleScheduler, ArticleAsyncScheduler
    from article_style import engine, flags
    from article_style.scheduler import ArticleAsyncScheduler as _async
    from article_style.scheduler import ArticleScheduler as _sync

    flags.install()  # again, in case an earlier module uninstalled it
    ArticleScheduler, ArticleAsyncScheduler = _sync, _async
    yield
    flags.uninstall()
    engine.uninstall()


BLOCK = 16
MS = 1_000_000
S = 1_000_000_000
MAX_MODEL_LEN = 1024

init_none_hash(sha256)
_HASHER = get_request_block_hasher(BLOCK, sha256)


# ---------------------------------------------------------------- harness
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("tiny_model")
    exe = Path(sys.executable).with_name("outrate")
    subprocess.run([str(exe), "tiny-model", str(d)], check=True, capture_output=True)
    return str(d)


class FakeClock:
    def __init__(self) -> None:
        self.ns = 1_000 * S

    def advance(self, ns: int) -> None:
        self.ns += ns


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    c = FakeClock()
    monkeypatch.setattr(time, "monotonic_ns", lambda: c.ns)
    monkeypatch.setattr(time, "monotonic", lambda: c.ns / 1e9)
    return c


def make_config(
    model_dir: str,
    *,
    max_num_seqs: int = 16,
    max_active: int | None = None,
    chunked: bool = True,
    policy: str = "fcfs",
    batched_tokens: int = 1024,
    num_blocks: int = 400,
) -> VllmConfig:
    mc = ModelConfig(
        model=model_dir,
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
    )
    sc = SchedulerConfig(
        max_model_len=MAX_MODEL_LEN,
        is_encoder_decoder=False,
        max_num_seqs=max_num_seqs,
        max_num_active_seqs=max_active,
        max_num_batched_tokens=batched_tokens,
        enable_chunked_prefill=chunked,
        policy=policy,
    )
    cc = CacheConfig(block_size=BLOCK)
    vc = VllmConfig(model_config=mc, scheduler_config=sc, cache_config=cc)
    vc.cache_config.num_gpu_blocks = num_blocks
    return vc


def build(cls, vc: VllmConfig):
    num_blocks = vc.cache_config.num_gpu_blocks
    kv = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer.0"],
                FullAttentionSpec(
                    block_size=BLOCK,
                    num_kv_heads=1,
                    head_size=32,
                    dtype=torch.float32,
                ),
            )
        ],
    )
    return cls(
        vllm_config=vc,
        kv_cache_config=kv,
        structured_output_manager=StructuredOutputManager(vc),
        block_size=BLOCK,
    )


class Sim:
    """Drives a scheduler step by step with fabricated model outputs: one
    sampled token per scheduled request that is not a partial prefill
    chunk.  In async mode one step stays in flight (schedule N+1 before
    update_from_output of N)."""

    def __init__(self, sched, clock: FakeClock | None, step_ns: int = 10 * MS):
        self.s = sched
        self.clock = clock
        self.step_ns = step_ns
        self.is_async = isinstance(sched, AsyncScheduler)
        self.inflight = None
        self.tokens: dict[str, list[int]] = {}  # req id -> dispatch times (ns)
        self.finish: dict[str, FinishReason] = {}
        self.user_of: dict[str, str | None] = {}
        self.steps: list[tuple] = []  # per-step log for identity checks
        self.rng = random.Random(0)
        self._dispatch_time: dict[int, int] = {}

    def now(self) -> int:
        return self.clock.ns if self.clock else 0

    def add(self, rid, user=None, prompt_len=20, max_tokens=50, priority=0, arrival=None):
        extra = {"output_rate_user": user} if user is not None else None
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra)
        prompt = [self.rng.randrange(1, 500) for _ in range(prompt_len)]
        req = Request(
            rid,
            prompt,
            sp,
            None,
            arrival_time=arrival if arrival is not None else float(len(self.user_of)),
            priority=priority,
            block_hasher=_HASHER,
        )
        self.user_of[rid] = user
        self.tokens[rid] = []
        self.s.add_request(req)

    def _collect(self, out, mro):
        engine_outputs = self.s.update_from_output(out, mro)
        t = self._dispatch_time.pop(id(out))
        for eco in engine_outputs.values():
            for o in eco.outputs:
                self.tokens[o.request_id].extend([t] * len(o.new_token_ids))
                if o.finish_reason is not None:
                    self.finish[o.request_id] = o.finish_reason

    def step(self) -> dict[str, int]:
        out = self.s.schedule()
        ids = list(out.num_scheduled_tokens)
        sampled = [[] if self.s.requests[r].is_prefill_chunk else [self.rng.randrange(1, 500)] for r in ids]
        mro = model_runner_output(ids, sampled)
        self._dispatch_time[id(out)] = self.now()
        self.steps.append(
            (
                tuple(sorted(out.num_scheduled_tokens.items())),
                tuple(sorted(out.preempted_req_ids or ())),
                tuple(sorted(out.finished_req_ids)),
            )
        )
        if self.is_async:
            prev, self.inflight = self.inflight, (out, mro)
            if prev is not None:
                self._collect(*prev)
        else:
            self._collect(out, mro)
        if self.clock:
            self.clock.advance(self.step_ns)
        return dict(out.num_scheduled_tokens)

    def drain(self):
        if self.inflight is not None:
            prev, self.inflight = self.inflight, None
            self._collect(*prev)

    def run(self, n: int):
        for _ in range(n):
            self.step()
        return self

    def run_until_done(self, limit: int = 20_000):
        for _ in range(limit):
            if not self.s.has_requests() and self.inflight is None:
                return self
            if not self.s.has_requests():
                self.drain()
                continue
            self.step()
        raise AssertionError("workload did not finish")

    def user_times(self, user) -> list[int]:
        return sorted(t for rid, ts in self.tokens.items() if self.user_of[rid] == user for t in ts)


def count_in(times, start, end):
    return sum(1 for t in times if start <= t < end)


def assert_gcra_bound(times, limit):
    """Any window of W s holds at most (W + 0.1) * limit + 1 outputs."""
    for i in range(len(times)):
        for j in range(i, len(times)):
            w = (times[j] - times[i]) / S
            n = j - i + 1
            assert n <= (w + _BURST_NS / S) * limit + 1 + 1e-9, (n, w, limit)


def three_streams_of_a_and_b(sim: Sim, a_tokens: int, b_tokens: int, steps: int) -> tuple[int, list[int], list[int]]:
    """Users a and b send three streams each (a0-a2 of ``a_tokens`` max tokens, b0-b2 of
    ``b_tokens``), then ``sim`` runs ``steps`` steps. Returns (fake time in ns before the
    first step, a's dispatch times, b's dispatch times)."""
    t0 = sim.clock.ns
    for i in range(3):
        sim.add(f"a{i}", "a", max_tokens=a_tokens)
        sim.add(f"b{i}", "b", max_tokens=b_tokens)
    sim.run(steps)
    return t0, sim.user_times("a"), sim.user_times("b")


def with_rates(vc, default, users=None, max_active="unset"):
    rates = {"default_tokens_per_s": default, "user_tokens_per_s": users or {}}
    if max_active != "unset":
        rates["max_num_active_seqs"] = max_active
    hook.configure(vc, rates)
    return vc


# ---------------------------------------------------------------- limiter
def test_limiter_gcra_integer_math():
    rates = {"a": 10, "b": 3}
    lim = OutputRateLimiter(rates.__getitem__)
    t0 = 5 * S
    # limit 10: interval 100 ms, burst 100 ms -> two releases at t0.
    assert lim.try_take("a", t0)
    assert lim.try_take("a", t0)
    assert not lim.try_take("a", t0)
    assert lim.ready_at_ns("a") == t0 + 100 * MS
    assert not lim.try_take("a", t0 + 100 * MS - 1)
    assert lim.try_take("a", t0 + 100 * MS)
    lim.refund("a")  # back to the state before the last take
    assert lim.ready_at_ns("a") == t0 + 100 * MS
    # limit 3: interval 1/3 s is not a whole ns; ready time rounds up and the
    # long-run spacing has no drift (integer state scaled by the rate).
    t = t0
    taken = []
    while len(taken) < 31:
        if lim.try_take("b", t):
            taken.append(t)
        else:
            t = lim.ready_at_ns("b")
    # interval 333.3 ms > burst: no second token at t0; the next one is due
    # when the lead (333.3 ms) has shrunk to the burst (100 ms)
    assert taken[0] == t0
    assert taken[1] == t0 + (S // 3 + 1) - 100 * MS
    span = taken[-1] - taken[1]
    assert abs(span - 29 * S // 3) <= 1
    # cleanup forgets only users whose TAT is behind now; semantics unchanged
    lim.cleanup_idle_users(t + 10 * S)
    assert lim.ready_at_ns("b") is None and lim.ready_at_ns("a") is None


# ------------------------------------------------------------ rate limits
def test_one_user_rate_is_limit_and_evenly_paced(model_dir, clock):
    s = build(ArticleScheduler, with_rates(make_config(model_dir), 20))
    sim = Sim(s, clock)
    t0 = clock.ns
    for i in range(4):
        sim.add(f"a{i}", "a", prompt_len=40, max_tokens=500)
    sim.run(300)  # 3 simulated seconds, 10 ms steps
    times = sim.user_times("a")
    # burst at t0: leads 0, 50, 100 ms are <= 100 ms -> 3 tokens, then 1/50 ms
    assert count_in(times, t0, t0 + 1) == 3
    assert len(times) == 3 + 2990 // 50 == 62
    gaps = {b - a for a, b in itertools.pairwise(times[2:])}
    assert gaps == {50 * MS}
    for k in range(1, 3):
        assert count_in(times, t0 + k * S, t0 + (k + 1) * S) == 20
    assert_gcra_bound(times, 20)
    # the four streams take turns (rotation): equal shares within one token
    per_stream = [len(sim.tokens[f"a{i}"]) for i in range(4)]
    assert max(per_stream) - min(per_stream) <= 1, per_stream


def test_two_users_different_limits(model_dir, clock):
    vc = with_rates(make_config(model_dir), 10, {"b": 50})
    sim = Sim(build(ArticleScheduler, vc), clock)
    t0, a, b = three_streams_of_a_and_b(sim, 500, 500, 400)
    for k in (1, 2, 3):
        assert count_in(a, t0 + k * S, t0 + (k + 1) * S) == 10
        assert count_in(b, t0 + k * S, t0 + (k + 1) * S) == 50
    assert len(a) <= 4.1 * 10 + 1 and len(b) <= 4.1 * 50 + 1
    assert len(a) >= 40 and len(b) >= 200
    assert_gcra_bound(a, 10)
    assert_gcra_bound(b, 50)


def test_streams_of_one_user_share_one_budget(model_dir, clock):
    vc = with_rates(make_config(model_dir), 25)
    sim = Sim(build(ArticleScheduler, vc), clock)
    sim.add("solo", "x", max_tokens=500)
    for i in range(6):
        sim.add(f"m{i}", "y", max_tokens=500)
    sim.run(200)
    x, y = sim.user_times("x"), sim.user_times("y")
    assert len(x) == len(y) == 4 + 1990 // 40  # 25 tok/s each, not 25 per stream
    shares = [len(sim.tokens[f"m{i}"]) for i in range(6)]
    assert max(shares) - min(shares) <= 1, shares


def test_anonymous_requests_share_a_bucket_and_ids_are_exact(model_dir, clock):
    vc = with_rates(make_config(model_dir), 10, {"User-A": 40})
    sim = Sim(build(ArticleScheduler, vc), clock)
    sim.add("n0", None, max_tokens=500)
    sim.add("n1", None, max_tokens=500)
    sim.add("exact", "User-A", max_tokens=500)
    sim.add("lower", "user-a", max_tokens=500)  # a different user: default rate
    sim.run(200)
    anon = len(sim.tokens["n0"]) + len(sim.tokens["n1"])
    assert anon == 2 + 1990 // 100
    assert len(sim.tokens["exact"]) == 5 + 1990 // 25
    assert len(sim.tokens["lower"]) == 2 + 1990 // 100


@pytest.mark.parametrize("chunked", [True, False])
def test_paused_not_cut_every_request_gets_max_tokens(model_dir, clock, chunked):
    vc = with_rates(make_config(model_dir, max_num_seqs=6, chunked=chunked), 40, {"c": 200})
    sim = Sim(build(ArticleScheduler, vc), clock)
    t0 = clock.ns
    want = {}
    for u in ("a", "b", "c"):
        for i in range(3):
            rid = f"{u}{i}"
            want[rid] = 15 + 7 * i
            sim.add(rid, u, prompt_len=10 + 13 * i, max_tokens=want[rid])
    sim.run_until_done()
    for rid, n in want.items():
        assert len(sim.tokens[rid]) == n, rid
        assert sim.finish[rid] == FinishReason.LENGTH
    # user a: 15+22+29 = 66 tokens at 40 tok/s need > 1.5 s
    a = sim.user_times("a")
    assert a[-1] - t0 >= (66 - 1 - 4) * S // 40
    assert_gcra_bound(a, 40)


def test_throttled_requests_do_not_count_toward_active_cap(model_dir, clock):
    def scenario(cls, configure):
        vc = make_config(model_dir, max_num_seqs=8, max_active=2)
        if configure:
            with_rates(vc, 5, {"b": 1000})
        sim = Sim(build(cls, vc), clock)
        sim.add("a0", "a", max_tokens=40)
        sim.add("a1", "a", max_tokens=40)
        sim.run(3)
        sim.add("b0", "b", max_tokens=20)
        sim.add("b1", "b", max_tokens=20)
        per_step = [len(sim.step()) for _ in range(30)]
        return sim, per_step

    sim, per_step = scenario(ArticleScheduler, True)
    # b is admitted although a's two requests are resident, and finishes
    for rid in ("b0", "b1"):
        assert len(sim.tokens[rid]) == 20
        assert sim.finish[rid] == FinishReason.LENGTH
    assert "a0" not in sim.finish and "a1" not in sim.finish
    # never more than max_num_active_seqs requests in one step's batch,
    # although four are resident while a's streams are throttled
    assert max(per_step) == 2
    # a is still limited: 5 tok/s gives tokens at t0, t0+100 ms, t0+300 ms
    assert len(sim.tokens["a0"]) + len(sim.tokens["a1"]) == 3
    running, _ = sim.s.get_request_counts()
    assert running == 2  # a's streams stayed resident after b finished

    # stock vLLM with the same caps (no limit): b waits for a slot
    stock, _ = scenario(Scheduler, False)
    assert len(stock.tokens["b0"]) < 20


def test_throttled_request_is_preferred_preemption_victim(model_dir, clock):
    def scenario(cls, policy, rates):
        # 8 blocks, one is vLLM's null block: three 2-block prompts fit; when
        # b1 and b2 both grow past 32 tokens only one free block is left.
        vc = make_config(model_dir, num_blocks=8, policy=policy)
        if rates:
            with_rates(vc, 1000, {"a": 1})
        sim = Sim(build(cls, vc), clock)
        sim.add("a", "a", prompt_len=30, max_tokens=30)
        sim.add("b1", "b", prompt_len=31, max_tokens=30)
        sim.add("b2", "b", prompt_len=31, max_tokens=30)
        first = None
        for _ in range(300):
            if not sim.s.has_requests():
                break
            sim.step()
            if first is None and sim.steps[-1][1]:
                first = sim.steps[-1][1]
        return sim, first

    for policy in ("fcfs", "priority"):
        _stock, stock_victims = scenario(Scheduler, policy, False)
        assert stock_victims == ("b2",)  # stock picks the last / latest request
        ours, victims = scenario(ArticleScheduler, policy, True)
        assert victims == ("a",), policy  # a is throttled (1 tok/s)
        ours.run_until_done()
        for rid in ("a", "b1", "b2"):
            assert len(ours.tokens[rid]) == 30


def test_charge_of_a_request_preempted_in_its_step_is_refunded(model_dir, clock):
    # 4 usable blocks.  L (1 tok/s, low priority) is due its 2nd token at
    # t0 + 900 ms (TAT t0 + 1 s minus the 100 ms burst).  In that very step H
    # (high priority, 3 blocks) needs a new block, so L -- already charged
    # and scheduled earlier in the loop -- is preempted and its charge must
    # be refunded: when L is re-admitted (after H finished) it samples at
    # once instead of waiting for t0 + 1.9 s.
    vc = with_rates(make_config(model_dir, num_blocks=5, policy="priority"), 1, {"h": 1000})
    sim = Sim(build(ArticleScheduler, vc), clock)
    t0 = clock.ns
    sim.add("L", "u", prompt_len=10, max_tokens=3, priority=1, arrival=0.0)
    sim.run(88)
    sim.add("H", "h", prompt_len=47, max_tokens=5, priority=0, arrival=1.0)
    sim.run(2)
    assert sim.step() == {"H": 1} and sim.steps[-1][1] == ("L",)
    sim.run_until_done()
    assert [(t - t0) // MS for t in sim.tokens["L"]] == [0, 930, 1900]
    assert len(sim.tokens["H"]) == 5


def test_priority_victim_preference_only_within_same_priority(model_dir, clock):
    vc = with_rates(make_config(model_dir, num_blocks=8, policy="priority"), 1000, {"a": 1})
    sim = Sim(build(ArticleScheduler, vc), clock)
    sim.add("a", "a", prompt_len=30, max_tokens=30, priority=0)
    sim.add("b1", "b", prompt_len=31, max_tokens=30, priority=0)
    sim.add("b2", "b", prompt_len=31, max_tokens=30, priority=1)  # lowest prio
    victims = None
    for _ in range(100):
        sim.step()
        if sim.steps[-1][1]:
            victims = sim.steps[-1][1]
            break
    assert victims == ("b2",)


# --------------------------------------------------------- feature off
def _random_workload(sim, seed):
    rng = random.Random(seed)
    for i in range(14):
        sim.add(
            f"r{i}",
            rng.choice(["a", "b", None]),
            prompt_len=rng.randrange(5, 90),
            max_tokens=rng.randrange(3, 40),
            priority=rng.randrange(0, 3),
            arrival=float(i),
        )


@pytest.mark.parametrize(
    "mode,kw",
    [
        ("sync", {"num_blocks": 30, "max_num_seqs": 6, "max_active": 4}),
        ("sync", {"num_blocks": 25, "policy": "priority", "batched_tokens": 64}),
        ("async", {"num_blocks": 30, "max_num_seqs": 5}),
        ("sync", {"num_blocks": 60, "chunked": False}),
    ],
)
def test_feature_off_schedules_are_identical_to_stock(model_dir, clock, mode, kw):
    if mode == "sync":
        stock_cls, our_cls = Scheduler, ArticleScheduler
    else:
        stock_cls, our_cls = AsyncScheduler, ArticleAsyncScheduler
    logs = []
    for cls in (stock_cls, our_cls):
        vc = make_config(model_dir, **kw)
        # per-user overrides alone do not turn the feature on
        with_rates(vc, None, {"a": 1})
        sim = Sim(build(cls, vc), clock)
        _random_workload(sim, seed=7)
        for k in range(400):
            if not sim.s.has_requests() and sim.inflight is None:
                break
            if k == 30:
                sim.s.finish_requests("r3", RequestStatus.FINISHED_ABORTED)
            if not sim.s.has_requests():
                sim.drain()
            else:
                sim.step()
        logs.append((sim.steps, {r: len(t) for r, t in sim.tokens.items()}))
    assert logs[0] == logs[1]


# ------------------------------------------------------- configuration
def rate_flags(default: int, users: dict[str, int]) -> list[str]:
    """The article's two engine flags: the default rate (tok/s) and the per-user rates
    (tok/s, as the JSON object the flag takes)."""
    return [
        "--default-user-output-tokens-per-second",
        str(default),
        "--user-output-tokens-per-second",
        json.dumps(users),
    ]


def test_flags_path_configures_the_scheduler(model_dir, clock):
    from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(
        [
            "--model",
            model_dir,
            "--skip-tokenizer-init",
            "--dtype",
            "float32",
            "--max-num-seqs",
            "8",
            "--max-num-active-seqs",
            "4",
            "--max-model-len",
            str(MAX_MODEL_LEN),
            *rate_flags(10, {"a": 5}),
        ]
    )
    vc = EngineArgs.from_cli_args(args).create_engine_config()
    sc = vc.scheduler_config
    assert sc.default_user_output_tokens_per_second == 10
    assert sc.user_output_tokens_per_second == {"a": 5}
    assert sc.max_num_active_seqs == 4
    assert sc.scheduler_cls in (
        "article_style.scheduler.ArticleScheduler",
        "article_style.scheduler.ArticleAsyncScheduler",
    )
    vc.cache_config.num_gpu_blocks = 200
    sim = Sim(build(ArticleScheduler, vc), clock)
    t0 = clock.ns
    sim.add("a0", "a", max_tokens=500)
    sim.add("a1", "a", max_tokens=500)
    sim.add("z0", "z", max_tokens=500)
    sim.run(200)
    assert count_in(sim.user_times("a"), t0 + S, t0 + 2 * S) == 5
    assert count_in(sim.user_times("z"), t0 + S, t0 + 2 * S) == 10

    # vllm serve's parser has them too and from_cli_args keeps them
    aparser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    aargs = aparser.parse_args(["--model", model_dir, *rate_flags(7, {"u": 3})])
    ea = AsyncEngineArgs.from_cli_args(aargs)
    assert ea.default_user_output_tokens_per_second == 7
    assert ea.user_output_tokens_per_second == {"u": 3}
    # bad values are rejected by the parser
    for bad in (
        ["--default-user-output-tokens-per-second", "2.5"],
        ["--user-output-tokens-per-second", "[1]"],
        ["--user-output-tokens-per-second", '{"u": 0}'],
    ):
        with pytest.raises(SystemExit):
            parser.parse_args(["--model", model_dir, *bad])
    # without the flags: nothing is configured, feature off
    plain = EngineArgs.from_cli_args(
        parser.parse_args(["--model", model_dir, "--skip-tokenizer-init", "--max-model-len", str(MAX_MODEL_LEN)])
    ).create_engine_config()
    assert getattr(plain.scheduler_config, "default_user_output_tokens_per_second", None) is None
    assert plain.scheduler_config.scheduler_cls is None


def test_flags_install_is_idempotent_and_reversible(model_dir):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from article_style import flags

    flags.install()
    flags.install()
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    assert (
        parser.parse_args(
            ["--model", model_dir, "--default-user-output-tokens-per-second", "3"]
        ).default_user_output_tokens_per_second
        == 3
    )
    flags.uninstall()
    try:
        with pytest.raises(SystemExit):
            EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(
                ["--model", model_dir, "--default-user-output-tokens-per-second", "3"]
            )
    finally:
        flags.install()


def test_hook_path_configures_the_scheduler(model_dir, clock):
    vc = make_config(model_dir, max_num_seqs=8)
    hook.configure(
        vc,
        {"default_tokens_per_s": 20, "user_tokens_per_s": {"slow": 4.0}, "max_num_active_seqs": 3},
    )
    sc = vc.scheduler_config
    assert (sc.default_user_output_tokens_per_second, sc.user_output_tokens_per_second, sc.max_num_active_seqs) == (
        20,
        {"slow": 4},
        3,
    )
    sim = Sim(build(ArticleScheduler, vc), clock)
    t0 = clock.ns
    for i in range(3):
        sim.add(f"s{i}", "slow", max_tokens=500)
    sim.add("f0", "fast", max_tokens=500)
    sizes = [len(sim.step()) for _ in range(300)]
    assert max(sizes) <= 3
    assert count_in(sim.user_times("slow"), t0 + S, t0 + 3 * S) == 8
    assert count_in(sim.user_times("fast"), t0 + S, t0 + 3 * S) == 40
    with pytest.raises(ValueError):
        hook.configure(make_config(model_dir), {"default_tokens_per_s": 1.5})
    with pytest.raises(ValueError):
        hook.configure(make_config(model_dir), {"default_tokens_per_s": 0})


# --------------------------------------------------------------- async
def test_async_scheduler_limits_too(model_dir, clock):
    vc = make_config(model_dir)
    vc.scheduler_config.async_scheduling = True
    with_rates(vc, 20, {"b": 50})
    sim = Sim(build(ArticleAsyncScheduler, vc), clock)
    t0, a, b = three_streams_of_a_and_b(sim, 45, 120, 250)
    assert count_in(a, t0 + S, t0 + 2 * S) == 20
    assert count_in(b, t0 + S, t0 + 2 * S) == 50
    assert_gcra_bound(a, 20)
    assert_gcra_bound(b, 50)
    # pause, not cut, with one step in flight
    sim.run_until_done()
    for i in range(3):
        assert len(sim.tokens[f"a{i}"]) == 45
        assert len(sim.tokens[f"b{i}"]) == 120


# ----------------------------------------------------------- engine wait
def test_wait_seconds_and_engine_idle_wait(model_dir, clock):
    vc = with_rates(make_config(model_dir), 10)
    s = build(ArticleScheduler, vc)
    sim = Sim(s, None)  # clock advanced by hand
    assert s.get_output_rate_wait_seconds() is None
    sim.add("a0", "a", max_tokens=50)
    sim.add("a1", "a", max_tokens=50)
    sim.add("a2", "a", max_tokens=50)
    sim.step()  # two burst tokens, third stream rejected: ready 100 ms later
    assert s.get_output_rate_wait_seconds() == pytest.approx(0.05)
    clock.advance(70 * MS)
    assert s.get_output_rate_wait_seconds() == pytest.approx(0.03)
    assert sim.step() == {}
    assert s.get_output_rate_wait_seconds() == pytest.approx(0.03)
    clock.advance(30 * MS)
    assert len(sim.step()) == 1

    # the engine-loop wrapper waits on the input queue when nothing executed
    from vllm.v1.engine.core import EngineCoreProc

    from article_style import engine

    engine.install()
    engine.install()  # idempotent
    handled = []
    stub = SimpleNamespace(
        step_fn=lambda: ({}, False),
        output_queue=queue.Queue(),
        post_step=lambda executed: None,
        scheduler=SimpleNamespace(has_requests=lambda: False, get_output_rate_wait_seconds=lambda: 0.04),
        input_queue=queue.Queue(),
        _handle_client_request=lambda *r: handled.append(r),
    )
    real = time.perf_counter
    t = real()
    assert EngineCoreProc._process_engine_step(stub) is False
    assert 0.035 <= real() - t < 0.5 and handled == []
    # a new request wakes it at once
    threading.Timer(0.005, lambda: stub.input_queue.put(("ADD", "req"))).start()
    t = real()
    EngineCoreProc._process_engine_step(stub)
    assert real() - t < 0.035 and handled == [("ADD", "req")]
    # executed steps never wait
    stub.step_fn = lambda: ({}, True)
    t = real()
    assert EngineCoreProc._process_engine_step(stub) is True
    assert real() - t < 0.02
