"""The ``vllm.general_plugins`` entry point of vllm-output-rate.

vLLM calls ``register()`` once in every process (API server, engine core, workers) before
it builds anything. When the output-rate feature is configured, it makes the front end
refuse a request whose ``output_rate_user`` is invalid (R17) with a ``ValueError`` that
names the value -- the OpenAI server answers HTTP 400 to that request alone, and nothing
reaches the engine core. Correctness never depends on this plugin: the scheduler itself
never raises on a bad identity (see ``RateLimitedScheduler.add_request``).

Source: semantics.md R17; seed article, identity section.
"""

from __future__ import annotations

import functools

_REGISTERED = False


def _feature_on(vllm_config) -> bool:
    additional = getattr(vllm_config, "additional_config", None)
    section = additional.get("output_rate") if isinstance(additional, dict) else None
    return isinstance(section, dict) and section.get("default_tokens_per_s") is not None


def register() -> None:
    """Install the front-end identity check (idempotent; vLLM may call it many times)."""
    global _REGISTERED
    if _REGISTERED:
        return
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor

    from vllm_output_rate.reference.identity import validate_extra_args

    original = InputProcessor._validate_params

    @functools.wraps(original)
    def _validate_params(self, params, supported_tasks):
        if isinstance(params, SamplingParams) and _feature_on(self.vllm_config):
            validate_extra_args(params.extra_args)  # R17: raises ValueError naming the value
        return original(self, params, supported_tasks)

    InputProcessor._validate_params = _validate_params
    _REGISTERED = True
