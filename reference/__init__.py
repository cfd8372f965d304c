"""The reference implementation inside stock vLLM 0.32.0 (scheduler classes, limiter, config).

Import ``vllm_output_rate.reference.scheduler`` for the scheduler classes (this imports vLLM);
``vllm_output_rate.reference.limiter`` is pure Python.
"""
