"""The executable specification of per-user output-rate limiting (pure Python, no vLLM).

Read beside docs/SPEC.md. Nothing here imports vLLM or any other part of the project.

| module | what |
|---|---|
| ``limiter`` | the GCRA limiter, R1-R6, exact rationals |
| ``events`` | the event alphabet shared with the adapter and a model checker |
| ``state`` | configuration, request and scheduler state, observations (frozen dataclasses) |
| ``scheduler`` | ``step(state, event) -> (state, observation)``: one vLLM 0.32 scheduling step, V1-V12 |
| ``rate`` | the rate-limit layer of a step, R6-R16 and R19-R21 (R18: absent with the feature off) |
| ``invariants`` | I1-I19, checked after every spec step by the gate (docs/SPEC.md "Invariants") |
| ``versions`` | what differs between the supported vLLM releases near the hooks (docs/SPEC.md "vLLM versions") |
| ``properties`` | the R2 window bound and R7/R9 accounting, used by the invariants, the gate and the trace checker |
| ``rules`` | the rule registry (id, title, spec and reference code), source of docs/TRACEABILITY.md |

Prefix caching is not modelled: the gate turns it off, so every admission starts at 0
computed tokens (see ``spec/state.py`` for the whole modelled configuration class).
"""
