"""vllm-output-rate: per-user output-token rate limiting in the vLLM V1 scheduler.

Subpackages (each a top-level folder of the repository):

- ``vllm_output_rate.spec``: the executable specification (pure Python, no vLLM).
- ``vllm_output_rate.reference``: the reference implementation inside stock vLLM 0.32.0.
- ``vllm_output_rate.adapter``: the conformance gate's driver of real vLLM schedulers.
- ``vllm_output_rate.proofs``: proofs and model checking over the spec.
"""

__version__ = "0.1.0"
