"""The tiny model directories: config-only (the gate) and servable (``outrate tiny-model``).

The servable one must let ``vllm serve DIR --load-format dummy`` answer chat completions:
a tokenizer whose 512 ids cover the model's whole vocabulary (every sampled id decodes),
bos/eos ids matching ``config.json``, and a chat template. Loaded here the way vLLM loads
it (transformers ``AutoTokenizer``), offline.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from vllm_output_rate.adapter.tinymodel import BOS_TOKEN_ID, EOS_TOKEN_ID, VOCAB_SIZE, default_model_dir
from vllm_output_rate.cli import main


def test_outrate_tiny_model_writes_a_servable_directory(tmp_path):
    from transformers import AutoTokenizer

    result = CliRunner().invoke(main, ["tiny-model", str(tmp_path / "m")])
    assert result.exit_code == 0, result.output
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "m"))
    assert len(tok) == config["vocab_size"] == VOCAB_SIZE
    assert (tok.bos_token_id, tok.eos_token_id) == (config["bos_token_id"], config["eos_token_id"])
    assert (tok.bos_token_id, tok.eos_token_id) == (BOS_TOKEN_ID, EOS_TOKEN_ID)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hello there"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<s>user: Hello there\nassistant:"
    ids = tok(text, add_special_tokens=False).input_ids
    assert ids[0] == BOS_TOKEN_ID and max(ids) < VOCAB_SIZE
    # Every id a random-weight model can sample decodes to text (special ones to nothing).
    assert isinstance(tok.decode(list(range(VOCAB_SIZE)), skip_special_tokens=True), str)


def test_tokenizer_is_deterministic(tmp_path):
    for name in ("a", "b"):
        CliRunner().invoke(main, ["tiny-model", str(tmp_path / name)])
    assert (tmp_path / "a" / "tokenizer.json").read_text() == (tmp_path / "b" / "tokenizer.json").read_text()


def test_gate_directory_stays_config_only():
    path = default_model_dir()
    assert (path / "config.json").exists()
    assert not (path / "tokenizer.json").exists()  # the gate runs with skip_tokenizer_init


@pytest.mark.parametrize("where", ["below-a-file", "proc"])
def test_a_directory_that_cannot_be_written_is_named_without_a_traceback(tmp_path, where):
    (tmp_path / "file").write_text("")
    directory = str(tmp_path / "file" / "m") if where == "below-a-file" else "/proc/outrate-nope"
    result = CliRunner().invoke(main, ["tiny-model", directory])
    assert result.exit_code == 2, result.output
    assert not isinstance(result.exception, OSError), result.exception
    last = " ".join(result.output.split())
    assert f"cannot write the tiny model into {directory}" in last and "DIRECTORY" in last, result.output
