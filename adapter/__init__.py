"""The conformance gate: drives real vLLM schedulers in-process and judges them against the spec."""
