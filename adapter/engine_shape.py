"""The engine configuration of one harness (``EngineShape``, vLLM's names) and the vLLM
objects built from it: ``build_vllm_config`` (a CPU-only ``VllmConfig`` for the project's
tiny local model, the rates in ``additional_config["output_rate"]``) and
``build_kv_cache_config`` (exactly ``num_blocks`` KV blocks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_output_rate.adapter.tinymodel import default_model_dir
from vllm_output_rate.adapter.vllm_compat import scheduler_only_config
from vllm_output_rate.spec.state import EngineConfig

# A shape's defaults are the spec's (spec/state.py): a default harness shape is the engine of
# a default spec configuration.
_SPEC_DEFAULTS = EngineConfig()


@dataclass(frozen=True)
class EngineShape:
    """The engine configuration of one scenario (vLLM's names).

    ``output_rate`` is ``additional_config["output_rate"]`` (None: feature off); how it
    reaches the scheduler depends on the ``adapter.configstyle.ConfigStyle`` in use.
    ``enable_prefix_caching``: off by default, since the spec does not model prefix caching.
    ``max_loras``: vLLM's ``--max-loras`` with ``--enable-lora`` (None: LoRA off); requests
    then name an adapter id (``Harness.add_request(lora=...)``), whose files are never read
    in-process (the scheduler only counts adapter ids).
    """

    max_num_seqs: int = _SPEC_DEFAULTS.max_num_seqs
    max_num_active_seqs: int | None = _SPEC_DEFAULTS.max_num_active_seqs
    max_num_batched_tokens: int = _SPEC_DEFAULTS.max_num_batched_tokens
    chunked_prefill: bool = _SPEC_DEFAULTS.chunked_prefill
    block_size: int = _SPEC_DEFAULTS.block_size
    num_blocks: int = _SPEC_DEFAULTS.num_blocks
    policy: str = _SPEC_DEFAULTS.policy
    async_scheduling: bool = _SPEC_DEFAULTS.async_scheduling
    max_model_len: int = _SPEC_DEFAULTS.max_model_len
    output_rate: dict[str, Any] | None = None
    enable_prefix_caching: bool = False
    max_loras: int | None = _SPEC_DEFAULTS.max_loras


def build_vllm_config(shape: EngineShape):
    """A ``VllmConfig`` for the tiny local model with ``shape``'s scheduler settings.

    The rates go to ``additional_config["output_rate"]`` (the reference's configuration;
    ``adapter.configstyle.AdditionalConfigStyle``). vLLM's CPU platform forces
    ``scheduler_config.async_scheduling`` to False here; the harness still drives async
    mode when ``shape.async_scheduling`` is set. Built inside
    ``vllm_compat.scheduler_only_config`` (no triton-cpu needed: no kernel runs here).
    """
    from vllm.config import (  # deferred: vLLM costs ~7 s to import
        CacheConfig,
        LoRAConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    model_config = ModelConfig(
        model=str(default_model_dir()),
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=shape.max_model_len,
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=shape.max_num_seqs,
        max_num_batched_tokens=shape.max_num_batched_tokens,
        max_num_active_seqs=shape.max_num_active_seqs,
        enable_chunked_prefill=shape.chunked_prefill,
        policy=shape.policy,
        max_model_len=shape.max_model_len,
        is_encoder_decoder=False,
        async_scheduling=shape.async_scheduling,
    )
    # Prefix caching is not modelled by the spec: the gate's shapes leave it off.
    cache_config = CacheConfig(block_size=shape.block_size, enable_prefix_caching=shape.enable_prefix_caching)
    additional = {"output_rate": shape.output_rate} if shape.output_rate is not None else {}
    with scheduler_only_config():
        config = VllmConfig(
            model_config=model_config,
            scheduler_config=scheduler_config,
            cache_config=cache_config,
            additional_config=additional,
            lora_config=LoRAConfig(max_loras=shape.max_loras) if shape.max_loras is not None else None,
        )
    config.cache_config.num_gpu_blocks = shape.num_blocks
    return config


def build_kv_cache_config(shape: EngineShape):
    """A ``KVCacheConfig`` with exactly ``shape.num_blocks`` blocks of ``block_size``."""
    import torch  # deferred: torch costs seconds to import
    from vllm.v1.kv_cache_interface import (  # deferred: vLLM costs ~7 s to import
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
    )

    spec = FullAttentionSpec(block_size=shape.block_size, num_kv_heads=2, head_size=32, dtype=torch.float32)
    return KVCacheConfig(
        num_blocks=shape.num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)],
    )
