"""Mode matrix, live (docs/MODES.md): per-request features on a rate-limited engine.

One ``vllm.LLM`` engine (the reference scheduler, the servable tiny model: config,
tokenizer, dummy weights) with ``output_rate.trace_path`` set. Each test uses its own
user, limited so that its requests are throttled while the feature is in use:

- ``n > 1``: one request with ``n = 3`` is three engine requests (vLLM fans them out in the
  front end); they share their user's budget (P2), every completion has its tokens, and
  the trace passes every check (window bound per user, GCRA replay, accounting);
- ``logprobs`` and ``prompt_logprobs``: a second request of a refused user advances its
  prefill to n-1 (R10) and samples later; every output token has its logprobs and every
  prompt token (but the first) its prompt logprob;
- structured output (``StructuredOutputsParams(choice=...)``): throttled between grammar-
  constrained tokens, each completion is one of the choices and ends with ``stop``.

Random weights give random tokens: the checks are on counts, structure and the grammar.
About 40 s on a 2-core CPU, most of it engine start-up.
"""

from __future__ import annotations

import pytest

from vllm_output_rate.adapter.tinymodel import servable_model_dir
from vllm_output_rate.adapter.trace_check import check_trace

pytestmark = pytest.mark.live

RATES = {"n3": 50, "lp": 5, "so": 5}
CHOICES = ["alpha", "beta"]


@pytest.fixture(scope="module")
def engine(tiny_llm, tmp_path_factory):
    trace = tmp_path_factory.mktemp("modes") / "trace.jsonl"
    llm = tiny_llm(
        {"default_tokens_per_s": 1000, "trace_path": str(trace), "user_tokens_per_s": RATES},
        model=str(servable_model_dir()),
        skip_tokenizer_init=False,
    )
    yield llm, trace
    del llm


def test_modes_live_n_greater_than_1_children_share_the_users_budget(engine, sampling):
    llm, trace = engine
    params = sampling("n3", 10)
    params.n = 3  # (``sampling``'s own ``n`` is max_tokens)
    (out,) = llm.generate([{"prompt_token_ids": [21, 22, 23, 24]}], [params], use_tqdm=False)
    assert [len(c.token_ids) for c in out.outputs] == [10, 10, 10]  # P3 for every child
    report = check_trace(trace, partial=True)
    assert report.ok, report.summary()
    user = report.runs[-1].users["n3"]
    assert user.dispatches == 30
    # One budget for the three children (P2): 30 grants at 50 tok/s from idle need at least
    # (30 - 1 - floor(0.1 x 50)) / 50 = 0.48 s; three separate budgets would need a third.
    assert user.span_s >= 0.47, user.span_s


def test_modes_live_logprobs_and_prompt_logprobs_with_a_throttled_prefill(engine, sampling, request_steps):
    llm, trace = engine
    prompt = list(range(30, 50))
    params = [sampling("lp", 3, logprobs=2, prompt_logprobs=1) for _ in range(2)]
    outs = llm.generate([{"prompt_token_ids": prompt}] * 2, params, use_tqdm=False)
    for out in outs:
        completion = out.outputs[0]
        assert len(completion.token_ids) == 3 and len(completion.logprobs) == 3
        assert all(len(entry) >= 1 for entry in completion.logprobs)
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        assert all(entry for entry in out.prompt_logprobs[1:])
    # 5 tok/s: one grant from idle, so the second request's prefill was refused at its
    # final chunk and advanced to n-1 first (R10): a prefill chunk without sampling.
    chunks = sum(request_steps(trace, out.request_id)["chunks"] for out in outs)
    assert chunks >= 1
    assert check_trace(trace, partial=True).ok


def test_modes_live_structured_output_choice_for_a_throttled_user(engine, sampling):
    from vllm.sampling_params import StructuredOutputsParams

    llm, trace = engine
    params = [
        sampling(
            "so", 16, ignore_eos=False, detokenize=True, structured_outputs=StructuredOutputsParams(choice=CHOICES)
        )
        for _ in range(2)
    ]
    outs = llm.generate([{"prompt_token_ids": [60, 61, 62]}] * 2, params, use_tqdm=False)
    for out in outs:
        completion = out.outputs[0]
        assert completion.text in CHOICES, completion.text
        assert completion.finish_reason == "stop"
    report = check_trace(trace, partial=True)
    assert report.ok, report.summary()
    assert report.runs[-1].users["so"].dispatches >= 2
