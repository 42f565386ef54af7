"""Bad input a user can cause gets one clear error that says what to do."""

from __future__ import annotations

import json

import numpy as np
import pytest

import dflax
from dflax.checkpoints.params import CheckpointError
from dflax.checkpoints.registry import UnknownModelError


@pytest.fixture(scope="module")
def target(tiny_checkpoint):
    return dflax.load_target(str(tiny_checkpoint("llama")[0]))


def test_unknown_model_lists_builtin_names():
    with pytest.raises(UnknownModelError, match="unknown model 'gpt-5'.*smollm2-135m, gemma3-270m"):
        dflax.load_target("gpt-5")


def test_prompt_longer_than_context(target):
    prompt = " ".join(f"w{3 + i % 250}" for i in range(600))  # the tiny context is 512 tokens
    with pytest.raises(dflax.PromptTooLongError, match="has 600 tokens.*allows 508.*truncate=True"):
        dflax.generate(target, [prompt], max_new_tokens=4)
    [result] = dflax.generate(target, [prompt], max_new_tokens=4, truncate=True)
    assert result.stats["prompt_tokens"] == 508 and len(result.tokens) == 4


def test_budget_larger_than_context(target):
    with pytest.raises(dflax.PromptTooLongError, match="leaves no room"):
        dflax.generate(target, ["w5"], max_new_tokens=512)


@pytest.mark.parametrize("max_new_tokens", [0, -3])
def test_non_positive_max_new_tokens(target, max_new_tokens):
    with pytest.raises(ValueError, match="max_new_tokens must be a positive integer"):
        dflax.generate(target, ["w5"], max_new_tokens=max_new_tokens)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -1.0}, "temperature must be >= 0"),
        ({"top_p": 0.0}, "top_p must be in"),
        ({"top_k": -2}, "top_k must be >= 0"),
    ],
)
def test_bad_sampling_settings(target, kwargs, message):
    with pytest.raises(ValueError, match=message):
        dflax.generate(target, ["w5"], **kwargs)


def test_prompt_of_wrong_type(target):
    with pytest.raises(TypeError, match="a prompt must be a string"):
        dflax.generate(target, [{"text": "w5"}])


def test_unsupported_architecture_in_hf_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(dflax.UnsupportedArchitectureError, match="model_type 'gpt2' is not supported.*llama"):
        dflax.load_target(str(tmp_path))


def test_unsupported_architecture_in_gguf(tmp_path):
    import gguf

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(dflax.UnsupportedArchitectureError, match="GGUF architecture 'gpt2' is not supported"):
        dflax.load_target(str(path))


def test_checkpoint_that_disagrees_with_its_config(tmp_path, tiny_checkpoint):
    source, _ = tiny_checkpoint("llama")
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((source / name).read_bytes())
    config = json.loads((source / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "intermediate_size": 128}))
    with pytest.raises(CheckpointError, match="mlp.*has shape.*config implies"):
        dflax.load_target(str(tmp_path))


def test_unknown_attention_backend_before_any_weights_are_read(tmp_path):
    with pytest.raises(ValueError, match="attention backend 'nope' unknown; choose one of reference"):
        dflax.load_target(str(tmp_path / "missing.gguf"), attention_backend="nope")


def test_unknown_dtype(tiny_checkpoint):
    with pytest.raises(ValueError, match="dtype 'int8' unknown"):
        dflax.load_target(str(tiny_checkpoint("llama")[0]), dtype="int8")
