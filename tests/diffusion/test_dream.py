"""Dream through `load_diffusion_lm`: the window logits of a mixed-length batch equal a float64 reference
forward of each row alone, Dream's one-position logit shift included; sharded checkpoints load the same."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from diffusion_reference import dream_logits
from tiny_diffusion_checkpoints import DREAM_CONFIG, dream_tensors, write_checkpoint
from window_case import CONTEXT, expected_window_logits, run_window_case

from dflax.diffusion.loader import load_diffusion_lm


def test_dream_window_logits_equal_the_reference_forward_with_the_shift(tmp_path):
    tensors = dream_tensors(DREAM_CONFIG)
    drafter, params = load_diffusion_lm(write_checkpoint(tmp_path, DREAM_CONFIG, tensors), context=CONTEXT)
    assert (drafter.name, drafter.mask_token_id, drafter.vocab_size) == ("dream", 47, 48)
    got, rows = run_window_case(drafter, params, token_range=46)
    want = expected_window_logits(rows, functools.partial(dream_logits, DREAM_CONFIG, tensors))
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=2e-4)
    # The check tells the shift apart: each slot's own hidden state gives other logits.
    unshifted = expected_window_logits(
        rows, functools.partial(dream_logits, DREAM_CONFIG, tensors, shifted=False)
    )
    assert np.abs(got - unshifted).max() > 0.1


@pytest.mark.slow  # interpret mode: about 8 s on a 2-core CPU
def test_dream_window_logits_through_the_pallas_kernel_equal_the_reference(tmp_path):
    """The TPU/GPU path: the Pallas attention kernel (interpret mode) with the bidirectional mask."""
    tensors = dream_tensors(DREAM_CONFIG)
    path = write_checkpoint(tmp_path, DREAM_CONFIG, tensors)
    drafter, params = load_diffusion_lm(path, context=16, attention_backend="pallas_interpret")
    got, rows = run_window_case(drafter, params, token_range=46)
    want = expected_window_logits(rows, functools.partial(dream_logits, DREAM_CONFIG, tensors))
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=2e-4)


def test_a_sharded_dream_checkpoint_loads_the_same_parameters(tmp_path):
    tensors = dream_tensors(DREAM_CONFIG, seed=1)
    _, whole = load_diffusion_lm(write_checkpoint(tmp_path / "one", DREAM_CONFIG, tensors))
    _, sharded = load_diffusion_lm(write_checkpoint(tmp_path / "three", DREAM_CONFIG, tensors, shards=3))
    jax.tree_util.tree_map(np.testing.assert_array_equal, whole, sharded)
