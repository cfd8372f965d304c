"""The executable specification of per-user output-rate limiting (pure Python, no vLLM).

Read beside docs/SPEC.md. Nothing here imports vLLM or any other part of the project.
"""
