"""Per-user engine-side rates over more than 10 s: 20 tok/s (1 and 4 streams) and 100 tok/s.

One ``vllm.LLM`` engine (the reference scheduler, the project's tiny model with dummy
weights) with ``output_rate.trace_path`` set. Three users decode concurrently:

- "a1": 20 tok/s, 1 stream x 240 tokens;
- "a4": 20 tok/s, 4 streams x 60 tokens;
- "b": 100 tok/s, 2 streams x 600 tokens,

so every user's first-to-last dispatch span is about 11.9 s (N tokens from idle need
(N - 1 - floor(0.1 x rate)) / rate s). Checked: the engine trace passes every check of
``adapter.trace_check`` (window bound and GCRA replay per user, accounting, no lost or
duplicated token against the client's counts), every stream has exactly its token count,
and each user's engine rate (sampling dispatches / first-to-last dispatch span, engine
clock) lies near its limit; ``-s`` prints the table.

The article measured, client-side on an RTX 4090 with 200 tokens per stream,
20.1-20.2 tok/s for a 20 tok/s user with 1 and with 4 streams, and ~102 tok/s for a
concurrent 100 tok/s user. The engine-side rates here read a little above the limit for
the same reason (the 100 ms burst grants floor(0.1 x rate) + 1 tokens at once from idle):
about 20.25 and 100.9 tok/s at these token counts.

The tiny model decodes ~1,400 tok/s on 2 CPU cores, ten times the 140 tok/s asked here.
About 45 s on a 2-core CPU (engine start-up ~30 s, decoding ~12 s); on a GPU unchanged.
"""

from __future__ import annotations

import time

import pytest

from vllm_output_rate.adapter.trace_check import check_trace

pytestmark = pytest.mark.live

# user -> (limit tok/s, streams, tokens per stream, (low, high) bounds on engine rate / limit)
# High side: rigorous. GCRA admits at most floor((S + tau) x rate) + 1 dispatches in a
# span S (the checker proves it over every window, exactly), so N / S can reach at most
# N / ((N - 1 - floor(0.1 x rate)) / rate): 20.25 tok/s (1.013 x) for 240 tokens at 20,
# 100.93 (1.009 x) for 1200 at 100. 1.02 and 1.05 are above those ceilings.
# Low side: not a theorem but a resume/progress check. The limiter loses budget only when
# a user with a stream waiting is not looked at for more than tau = 100 ms (engine steps
# here take ~3 ms), so on an idle machine the rates sit at or above the limit. The
# tolerance (5 % for 20 tok/s, 10 % for 100 tok/s, which needs 100 grant-carrying steps
# a second next to the other users) absorbs scheduling hiccups of a shared 2-core machine.
USERS = {
    "a1": (20, 1, 240, (0.95, 1.02)),
    "a4": (20, 4, 60, (0.95, 1.02)),
    "b": (100, 2, 600, (0.90, 1.05)),
}
MIN_SPAN_S = 10.0


@pytest.fixture(scope="module")
def engine(tiny_llm, tmp_path_factory):
    trace = tmp_path_factory.mktemp("rates") / "trace.jsonl"
    llm = tiny_llm(
        {
            "default_tokens_per_s": 1000,
            "trace_path": str(trace),
            "user_tokens_per_s": {user: spec[0] for user, spec in USERS.items()},
        },
        max_model_len=1024,
    )  # 5 prompt + 600 output tokens
    yield llm, trace
    del llm


@pytest.mark.rules("R2")
def test_r2_live_rates_20_and_100_tok_s_over_10_s(engine, sampling):
    llm, trace = engine
    prompts, params, expected = [], [], []
    for user, (_, streams, tokens, _) in USERS.items():
        for _ in range(streams):
            prompts.append({"prompt_token_ids": [11 + len(prompts), 12, 13, 14, 15]})
            params.append(sampling(user, tokens))
            expected.append(tokens)
    started = time.monotonic()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall_s = time.monotonic() - started

    counts = [len(o.outputs[0].token_ids) for o in outputs]
    assert counts == expected  # P3: paused, never cut
    report = check_trace(trace, completions={o.request_id: n for o, n in zip(outputs, counts)})
    assert report.ok, report.summary()
    (run,) = report.runs
    print(f"\nwall {wall_s:.2f} s, {run.steps} engine steps")
    print(f"{'user':<5} {'limit':>6} {'streams':>7} {'dispatches':>10} {'span s':>7} {'engine tok/s':>12}")
    for user, (limit, streams, _tokens, _) in USERS.items():
        u = run.users[user]
        print(f"{user:<5} {limit:>6} {streams:>7} {u.dispatches:>10} {u.span_s:>7.2f} {u.engine_rate:>12.2f}")
    for user, (limit, streams, tokens, (low, high)) in USERS.items():
        u = run.users[user]
        assert u.dispatches == streams * tokens, (user, u.dispatches)
        assert u.span_s >= MIN_SPAN_S, (user, u.span_s)
        assert low * limit <= u.engine_rate <= high * limit, (user, u.engine_rate, limit)
