"""LLaDA through `load_diffusion_lm`: OLMo-named tensors land on the dflax layers, and the window logits of a
mixed-length batch equal a float64 reference forward of each row alone (no shift), with untied and tied
read-outs; other OLMo variants are refused by name."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from diffusion_reference import llada_logits
from tiny_diffusion_checkpoints import LLADA_CONFIG, llada_tensors, write_checkpoint
from window_case import CONTEXT, expected_window_logits, run_window_case

from dflax.diffusion.loader import DiffusionCheckpointError, load_diffusion_lm


@pytest.mark.parametrize("tied", [False, True])
def test_llada_window_logits_equal_the_reference_forward(tmp_path, tied):
    config = {**LLADA_CONFIG, "weight_tying": tied}
    tensors = llada_tensors(config)
    drafter, params = load_diffusion_lm(write_checkpoint(tmp_path, config, tensors), context=CONTEXT)
    assert (drafter.name, drafter.mask_token_id, drafter.vocab_size) == ("llada", 45, 48)
    got, rows = run_window_case(drafter, params, token_range=40)
    want = expected_window_logits(rows, functools.partial(llada_logits, config, tensors))
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=2e-4)


def test_llada_without_a_mask_token_in_its_config_uses_the_released_one(tmp_path):
    config = {k: v for k, v in LLADA_CONFIG.items() if k != "mask_token_id"}
    drafter, _ = load_diffusion_lm(write_checkpoint(tmp_path, config, llada_tensors(config)))
    assert drafter.mask_token_id == 126336


@pytest.mark.parametrize(
    "change, named",
    [
        ({"block_type": "sequential"}, "block_type"),  # fused att_proj
        ({"layer_norm_type": "default"}, "layer_norm_type"),
        ({"attention_layer_norm": True}, "attention_layer_norm"),
        ({"scale_logits": True}, "scale_logits"),
    ],
)
def test_other_olmo_variants_are_refused_by_name(tmp_path, change, named):
    config = {**LLADA_CONFIG, **change}
    path = write_checkpoint(tmp_path, config, llada_tensors(LLADA_CONFIG))
    with pytest.raises(DiffusionCheckpointError, match=f"LLaDA variant not supported.*{named}"):
        load_diffusion_lm(path)
