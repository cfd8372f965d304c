"""Write a tiny Llama-style decoder directory that vLLM can load with dummy weights.

Nothing is fetched from a model hub: the project writes ``config.json`` itself (2 layers,
hidden 64, head_dim 32 -- the CPU attention kernel rejects head_dim 16 -- vocab 512).
Used in-process by the gate (``ModelConfig(skip_tokenizer_init=True)``) and live with
``load_format="dummy"``.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

VOCAB_SIZE = 512
EOS_TOKEN_ID = 2
BOS_TOKEN_ID = 1

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "bos_token_id": BOS_TOKEN_ID,
    "eos_token_id": EOS_TOKEN_ID,
}


def write_config(directory: Path) -> Path:
    """Write ``config.json`` (and ``generation_config.json``) into ``directory``; return it."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(CONFIG, indent=2))
    (directory / "generation_config.json").write_text(
        json.dumps({"bos_token_id": BOS_TOKEN_ID, "eos_token_id": EOS_TOKEN_ID})
    )
    return directory


def default_model_dir() -> Path:
    """A per-user cache directory holding the config-only tiny model (created on demand)."""
    base = Path(os.environ.get("OUTRATE_CACHE_DIR") or Path(tempfile.gettempdir()) / f"outrate-{os.getuid()}")
    path = base / "tiny-llama-config"
    if not (path / "config.json").exists():
        write_config(path)
    return path
