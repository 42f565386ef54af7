"""`load_diffusion_lm` / `is_diffusion_lm_dir` on good and bad directories (one clear error each), and the
vocabulary check between a diffusion drafter and its target."""

from __future__ import annotations

import functools

import pytest
from tiny_diffusion_checkpoints import (
    DREAM_CONFIG,
    LLADA_CONFIG,
    dream_tensors,
    llada_tensors,
    write_checkpoint,
)

from dflax.diffusion.loader import DiffusionCheckpointError, is_diffusion_lm_dir, load_diffusion_lm
from dflax.diffusion.vocabulary import VocabularyMismatchError, check_vocabulary


def test_dream_and_llada_directories_are_recognized_and_others_are_not(tmp_path):
    assert is_diffusion_lm_dir(write_checkpoint(tmp_path / "dream", DREAM_CONFIG, {}))
    assert is_diffusion_lm_dir(write_checkpoint(tmp_path / "llada", LLADA_CONFIG, {}))
    assert not is_diffusion_lm_dir(write_checkpoint(tmp_path / "qwen", {"model_type": "qwen2"}, {}))
    assert not is_diffusion_lm_dir(tmp_path / "absent")
    assert not is_diffusion_lm_dir(tmp_path / "qwen" / "config.json")


def _without(tensors: dict, name: str) -> dict:
    return {k: v for k, v in tensors.items() if k != name}


def test_bad_directories_fail_with_one_clear_error(tmp_path):
    dream = dream_tensors(DREAM_CONFIG)
    (tmp_path / "empty").mkdir()
    (tmp_path / "garbled").mkdir()
    (tmp_path / "garbled" / "config.json").write_text("{not json")
    sharded = write_checkpoint(tmp_path / "sharded", DREAM_CONFIG, dream, shards=2)
    next(sharded.glob("model-00002-*.safetensors")).unlink()
    no_weights = write_checkpoint(tmp_path / "no_weights", DREAM_CONFIG, dream)
    (no_weights / "model.safetensors").unlink()
    dream_dir = functools.partial(write_checkpoint, tensors=dream)
    cases = {
        tmp_path / "absent": "is not a directory",
        tmp_path / "empty": "has no config.json",
        tmp_path / "garbled": "is not valid JSON",
        dream_dir(tmp_path / "qwen", {**DREAM_CONFIG, "model_type": "qwen2"}): "model_type 'qwen2'",
        no_weights: r"no \*.safetensors",
        sharded: "lists shards that are not there",
        write_checkpoint(tmp_path / "short", DREAM_CONFIG, _without(dream, "lm_head.weight")): "missing.*lm_",
        dream_dir(tmp_path / "wide", {**DREAM_CONFIG, "hidden_size": 128}): "has shape",
        dream_dir(tmp_path / "window", {**DREAM_CONFIG, "use_sliding_window": True}): "sliding",
        write_checkpoint(
            tmp_path / "llada", _without(LLADA_CONFIG, "d_model"), llada_tensors(LLADA_CONFIG)
        ): "config.json lacks 'd_model'",
    }
    for path, message in cases.items():
        with pytest.raises(DiffusionCheckpointError, match=message):
            load_diffusion_lm(path)


def test_the_drafter_must_read_every_token_the_target_emits():
    check_vocabulary(152064, 152064)  # Dream-7B for Qwen2.5-7B
    check_vocabulary(152064, 151936)  # Dream-7B for Qwen2.5-0.5B: a narrower padded table
    check_vocabulary(151936, 152064, target_tokens=151665)  # the target emits only its tokenizer's ids
    with pytest.raises(VocabularyMismatchError, match="126464 ids but the target emits up to 151665"):
        check_vocabulary(126464, 152064, target_tokens=151665)  # LLaDA's vocabulary for a Qwen2.5 target
