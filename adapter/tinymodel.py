"""Write a tiny Llama-style decoder directory that vLLM can load with dummy weights.

Nothing is fetched from a model hub: the project writes the directory itself.

- ``config.json`` (2 layers, hidden 64, head_dim 32 -- the CPU attention kernel rejects
  head_dim 16 -- vocab 512), ``generation_config.json``. This config-only directory is
  what the in-process gate uses (``ModelConfig(skip_tokenizer_init=True)``), see
  ``default_model_dir()``.
- With ``tokenizer=True`` (``outrate tiny-model DIR``) also a tokenizer, so that
  ``vllm serve DIR --load-format dummy`` serves ``/v1/chat/completions``: a byte-level BPE
  trained here, with the ``tokenizers`` library, on the short built-in text below, to
  exactly 512 ids (so every id the random-weight model samples decodes), special tokens
  ``<unk>``=0, ``<s>``=1 (bos), ``</s>``=2 (eos), ``<pad>``=3 matching ``config.json``; and
  ``tokenizer_config.json`` with a plain Jinja chat template.
- ``write_lora(DIR, seed)`` (``outrate tiny-model DIR --lora l1``): a tiny LoRA adapter for
  that model in PEFT's format (``adapter_config.json`` + ``adapter_model.safetensors``),
  rank 4 on every attention projection of both layers, weights drawn from a seeded
  generator (the same seed writes the same bytes), used by the live LoRA suite
  (``vllm --enable-lora``).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

VOCAB_SIZE = 512
EOS_TOKEN_ID = 2
BOS_TOKEN_ID = 1
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")  # ids 0, 1, 2, 3 in this order

CONFIG: dict[str, Any] = {  # config.json of the tiny model (JSON values)
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

# One line per message: "role: content", then "assistant:" when a reply is wanted.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)

# The BPE training text (written for this project). Its only job is to give the trainer
# enough distinct words for 512 - 4 - 256 = 252 merges; the model's weights are random.
TRAINING_TEXT = """\
A shared inference engine serves many users at once. When one user opens a dozen streams,
the scheduler hands that user most of the decode slots, and every other user waits longer
for the first token and receives fewer tokens per second. A gateway in front of the engine
can count requests or total tokens, but it never sees which request receives a sampled token
in a given step, and it learns the token counts only after the work is done.
The limit therefore lives inside the scheduler. Before it decides for whom the model computes
in a step, it asks a small limiter whether the owner of each request still has budget.
Each user owns one bucket that refills at a steady rate, measured in output tokens per second.
Prompt tokens are free; only sampled tokens are charged. All streams of one user share the
same bucket, and the tokens are spread evenly over time instead of arriving in bursts at the
start of every second. When the bucket is empty, the request pauses: it keeps its memory
blocks, its history and its slot, and it resumes as soon as budget returns. Nothing is cut
short and no error is raised. Meanwhile the other users proceed exactly as before.
The limiter follows the generic cell rate algorithm. It remembers one theoretical arrival
time per user, compares it with the clock, and grants a token when the lead stays within a
burst tolerance of one hundred milliseconds. Arithmetic is exact, with integers scaled by the
rate, so no rounding can drift. A charge made for a step that never ran is refunded once,
at a single point at the end of scheduling. Quick brown foxes jump over lazy dogs; zebras,
yaks and vixens quietly wander the jagged hills while owls hum, and pixies fly back home.
Numbers such as 0 1 2 3 4 5 6 7 8 9 10 20 50 100 500 1000 appear in logs and reports too.
"""


def write_config(directory: Path, tokenizer: bool = True) -> Path:
    """Write the tiny model into ``directory``; return it.

    Args:
        directory: created if missing; existing files of the same names are replaced.
        tokenizer: also write the tokenizer files (needed by ``vllm serve``); the gate's
            config-only directory passes False.
    """
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(CONFIG, indent=2))
    (directory / "generation_config.json").write_text(
        json.dumps({"bos_token_id": BOS_TOKEN_ID, "eos_token_id": EOS_TOKEN_ID})
    )
    if tokenizer:
        write_tokenizer(directory)
    return directory


def build_tokenizer():
    """The byte-level BPE of the tiny model (a ``tokenizers.Tokenizer``), 512 ids exactly."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([TRAINING_TEXT], trainer=trainer)
    # Every id the model can sample must decode, and the special ids must match config.json.
    assert tok.get_vocab_size() == VOCAB_SIZE, f"tokenizer has {tok.get_vocab_size()} ids, want {VOCAB_SIZE}"
    assert tok.token_to_id("<s>") == BOS_TOKEN_ID, tok.token_to_id("<s>")
    assert tok.token_to_id("</s>") == EOS_TOKEN_ID, tok.token_to_id("</s>")
    return tok


def write_tokenizer(directory: Path) -> None:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``."""
    build_tokenizer().save(str(directory / "tokenizer.json"))
    special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
    (directory / "special_tokens_map.json").write_text(json.dumps(special, indent=2))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "model_max_length": CONFIG["max_position_embeddings"],
                "add_bos_token": False,  # the chat template writes it
                "add_eos_token": False,
                "clean_up_tokenization_spaces": False,
                "chat_template": CHAT_TEMPLATE,
                **special,
            },
            indent=2,
        )
    )


# LoRA adapters (PEFT format). Rank and alpha are small; every attention projection of both
# layers is targeted (vLLM packs q/k/v into qkv_proj and applies the three A/B pairs).
LORA_RANK = 4
LORA_ALPHA = 8
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
LORA_WEIGHT_STD = 0.5  # large enough that each adapter changes the greedy tokens of the dummy-weight model


def lora_module_shapes() -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each LoRA-targeted projection of the tiny model."""
    hidden, head_dim = CONFIG["hidden_size"], CONFIG["head_dim"]
    q_out = CONFIG["num_attention_heads"] * head_dim
    kv_out = CONFIG["num_key_value_heads"] * head_dim
    return {
        "q_proj": (q_out, hidden),
        "k_proj": (kv_out, hidden),
        "v_proj": (kv_out, hidden),
        "o_proj": (hidden, q_out),
    }


def write_lora(directory: Path, seed: int) -> Path:
    """Write a tiny LoRA adapter for the tiny model into ``directory``; return it.

    PEFT format: ``adapter_config.json`` (``peft_type`` LORA, rank ``LORA_RANK``, alpha
    ``LORA_ALPHA``, ``LORA_TARGET_MODULES``, no bias) and ``adapter_model.safetensors``
    with, per layer and targeted projection, ``lora_A.weight`` of shape (rank, in_features)
    and ``lora_B.weight`` of shape (out_features, rank), float32, normal with std
    ``LORA_WEIGHT_STD`` from a ``torch.Generator`` seeded with ``seed`` (deterministic: the
    same seed gives the same tensors). Both factors are non-zero, so the adapter changes
    the model's output.

    Raises:
        ValueError: ``seed`` is negative (``torch.Generator.manual_seed`` takes 0 <= seed < 2**64).
    """
    import torch  # deferred: torch costs seconds to import; only LoRA tests write adapters
    from safetensors.torch import save_file  # deferred: imports torch

    if seed < 0:
        raise ValueError(f"LoRA seed {seed} must be >= 0")
    directory.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(CONFIG["num_hidden_layers"]):
        for module, (out_features, in_features) in lora_module_shapes().items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (
                torch.randn(LORA_RANK, in_features, generator=generator) * LORA_WEIGHT_STD
            )
            tensors[f"{prefix}.lora_B.weight"] = (
                torch.randn(out_features, LORA_RANK, generator=generator) * LORA_WEIGHT_STD
            )
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "task_type": "CAUSAL_LM",
                "base_model_name_or_path": "tiny-llama",
                "r": LORA_RANK,
                "lora_alpha": LORA_ALPHA,
                "lora_dropout": 0.0,
                "target_modules": list(LORA_TARGET_MODULES),
                "bias": "none",
                "fan_in_fan_out": False,
                "modules_to_save": None,
            },
            indent=2,
        )
    )
    return directory


def default_model_dir() -> Path:
    """A per-user cache directory holding the config-only tiny model (created on demand)."""
    return _cached_model_dir("tiny-llama-config", "config.json", tokenizer=False)


def servable_model_dir() -> Path:
    """A per-user cache directory holding the servable tiny model (config + tokenizer)."""
    return _cached_model_dir("tiny-llama-servable", "tokenizer_config.json", tokenizer=True)


def _cached_model_dir(name: str, marker: str, tokenizer: bool) -> Path:
    """``name`` under the per-user cache (``OUTRATE_CACHE_DIR``, else the temp folder),
    written by ``write_config`` unless its file ``marker`` is already there."""
    base = Path(os.environ.get("OUTRATE_CACHE_DIR") or Path(tempfile.gettempdir()) / f"outrate-{os.getuid()}")
    path = base / name
    if not (path / marker).exists():
        write_config(path, tokenizer=tokenizer)
    return path
