"""A warm start across architectures (`init_match` "shapes"): what agrees in name and shape is copied."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from dflax.drafters.checkpoint import save_drafter
from dflax.drafters.dflash import DFlashConfig, DFlashDrafter, init_drafter_params
from dflax.models.config import ModelConfig
from dflax.train.trainer import TrainConfig
from dflax.train.warm_start import warm_start_matching_params

TARGET = ModelConfig(
    arch="llama", vocab_size=96, hidden_size=24, intermediate_size=40, num_layers=6, num_heads=3,
    num_kv_heads=1, head_dim=8, tie_word_embeddings=False,
)  # fmt: skip


def test_llama_drafter_with_a_learned_mask_starts_a_qwen3_drafter_with_a_mask_token(tmp_path):
    taps = (1, 2, 4)
    parent = DFlashConfig.for_target(TARGET, 2, 8, taps, None, True, "llama")
    parent_params = init_drafter_params(DFlashDrafter(parent), seed=3)
    save_drafter(tmp_path, parent, parent_params, TARGET.num_layers)
    child = DFlashConfig.for_target(TARGET, 2, 8, taps, mask_token_id=5, layer_arch="qwen3")
    fresh = init_drafter_params(DFlashDrafter(child), seed=4)

    started, copied, kept = warm_start_matching_params(tmp_path, fresh)

    assert sorted(kept) == sorted(
        f"params/layers_{i}/self_attn/{n}_norm/weight" for i in range(2) for n in ("q", "k")
    )
    assert "params/mask_embedding" not in copied and len(copied) + len(kept) == len(jax.tree.leaves(fresh))
    np.testing.assert_array_equal(started["params"]["fc"]["weight"], parent_params["params"]["fc"]["weight"])
    np.testing.assert_array_equal(
        started["params"]["layers_1"]["self_attn"]["q_norm"]["weight"],
        fresh["params"]["layers_1"]["self_attn"]["q_norm"]["weight"],
    )


def test_unknown_init_match_is_named():
    with pytest.raises(ValueError, match="init_match 'names' unknown"):
        TrainConfig(init="drafter", init_from="shipped", init_match="names")
