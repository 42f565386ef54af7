"""Parity with the reference DFlash (PyPI `dflash`, z-lab): the same checkpoint drafts the same block.

The reference is the oracle, imported, never copied. Random weights in the official layout (Qwen3 layers,
a mask token id, target_layer_ids) are saved once by dflax and loaded both by
`dflash.model.DFlashDraftModel.from_pretrained` and by dflax; from the same target features, anchor and
positions both must give the same final hidden states and draft logits (float32, 1e-4). Two target
geometries: Qwen3-like (head_dim apart from width / heads, rope base 1e6) and Llama-3.1-like (llama3 rope
scaling that acts at these head sizes).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from dflash.model import DFlashDraftModel, build_target_layer_ids
from transformers import DynamicCache

from dflax.drafters.checkpoint import load_drafter_checkpoint, save_drafter
from dflax.drafters.dflash import (
    DFlashConfig,
    DFlashDrafter,
    DFlashProposer,
    default_target_layer_ids,
    init_drafter_params,
)
from dflax.models.config import ModelConfig, RopeScaling

ATOL = 1e-4
MASK_TOKEN_ID = 7

# Tiny targets: every axis a different size (width, heads, KV heads, head_dim, FFN, layers, vocabulary).
TARGETS = {
    "qwen3-like": ModelConfig(
        arch="qwen3",
        vocab_size=300,
        hidden_size=40,
        intermediate_size=72,
        num_layers=10,
        num_heads=4,
        num_kv_heads=2,
        head_dim=12,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        tie_word_embeddings=False,
        max_position_embeddings=4096,
    ),
    "llama3.1-like": ModelConfig(
        arch="llama",
        vocab_size=320,
        hidden_size=48,
        intermediate_size=80,
        num_layers=12,
        num_heads=6,
        num_kv_heads=2,
        head_dim=8,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 64),
        tie_word_embeddings=False,
        max_position_embeddings=4096,
    ),
}


def random_drafter(target: ModelConfig, block_size: int, num_layers: int = 2, seed: int = 0):
    """An official-format drafter (Qwen3 layers, mask token) with every weight, norms too, random."""
    config = DFlashConfig.for_target(
        target, num_layers=num_layers, block_size=block_size, mask_token_id=MASK_TOKEN_ID
    )
    params = init_drafter_params(DFlashDrafter(config), seed)
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    leaves = [x + 0.2 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    return config, jax.tree.unflatten(tree, leaves)


@pytest.fixture(scope="module")
def saved_drafters(tmp_path_factory):
    """(target name, block size) -> the drafter's directory, written once."""
    out = {}
    for name, target in TARGETS.items():
        for block_size in (16, 8):
            path = tmp_path_factory.mktemp(f"{name}-b{block_size}")
            config, params = random_drafter(target, block_size)
            save_drafter(path, config, params, target.num_layers)
            out[name, block_size] = path
    return out


class Inputs:
    """One drafting call: target features of the context, the anchor token, the block's positions."""

    def __init__(self, target: ModelConfig, config: DFlashConfig, context_len: int, anchor: int, seed: int):
        rng = np.random.default_rng(seed)
        taps = len(config.target_layer_ids)
        # [1, context_len, taps * D]: target hidden states, a few large dims as real targets have
        self.features = rng.normal(size=(1, context_len, taps * target.hidden_size)).astype(np.float32)
        self.features[..., :: target.hidden_size] *= 30.0
        self.embedding = rng.normal(size=(target.vocab_size, target.hidden_size)).astype(np.float32)  # [V, D]
        self.lm_head = rng.normal(size=(target.vocab_size, target.hidden_size)).astype(np.float32)  # [V, D]
        block = [anchor] + [config.mask_token_id] * (config.block_size - 1)
        self.block = self.embedding[block][None]  # [1, B, D]
        self.context_len, self.anchor = context_len, anchor


def reference_hidden(path, inputs: Inputs, split: int | None = None) -> np.ndarray:
    """The reference drafter's [B, D] final hidden states (through its draft cache when `split`)."""
    model = DFlashDraftModel.from_pretrained(str(path), torch_dtype=torch.float32).eval()
    n, b = inputs.context_len, inputs.block.shape[1]
    positions = torch.arange(n + b)[None]
    features, block = torch.from_numpy(inputs.features), torch.from_numpy(inputs.block)
    with torch.no_grad():
        if split is None:
            out = model(target_hidden=features, noise_embedding=block, position_ids=positions)
        else:  # the decode loop's way: an earlier call cached the first context tokens, then was cropped
            cache = DynamicCache(config=model.config)
            early_block = block[:, :1].expand(-1, b, -1)
            model(
                target_hidden=features[:, :split],
                noise_embedding=early_block,
                position_ids=positions[:, : split + b],
                past_key_values=cache,
                use_cache=True,
            )
            cache.crop(split - cache.get_seq_length())  # drops the early block's entries
            out = model(
                target_hidden=features[:, split:],
                noise_embedding=block,
                position_ids=positions[:, split:],
                past_key_values=cache,
                use_cache=True,
            )
    return out[0].numpy()


def dflax_hidden(path, inputs: Inputs, split: int | None = None) -> np.ndarray:
    """dflax's [B, D] final hidden states, through the code decoding runs: the proposer observes the
    context features into its draft cache (in two steps when `split`), then drafts the block."""
    config, params, _ = load_drafter_checkpoint(path, jnp.float32)
    n, b = inputs.context_len, inputs.block.shape[1]
    proposer = DFlashProposer(DFlashDrafter(config), target=None, block_size=b)
    state = proposer.init_state(1, n + b, jnp.float32)
    taps = np.split(inputs.features, len(config.target_layer_ids), axis=-1)  # [1, n, D] each
    for lo, hi in ((0, split), (split, n)) if split else ((0, n),):
        state = proposer.observe(
            params,
            state,
            None,  # the tokens themselves are not read: their features are
            tuple(jnp.asarray(t[:, lo:hi]) for t in taps),
            jnp.arange(lo, hi, dtype=jnp.int32)[None],
            jnp.asarray([hi - lo], jnp.int32),
        )
    target_params = {"params": {"embed_tokens": {"weight": jnp.asarray(inputs.embedding)}}}
    anchor = jnp.asarray([inputs.anchor], jnp.int32)
    start = jnp.asarray([n], jnp.int32)
    return np.asarray(proposer.draft_hidden(params, target_params, anchor, start, state))[0]


def assert_same_draft(ours: np.ndarray, theirs: np.ndarray, inputs: Inputs):
    np.testing.assert_allclose(ours, theirs, atol=ATOL, rtol=0)
    # draft logits at the mask positions through the (shared) LM head
    head = inputs.lm_head.T  # [D, V]
    np.testing.assert_allclose(ours[1:] @ head, theirs[1:] @ head, atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("name", list(TARGETS))
@pytest.mark.parametrize("block_size", [16, 8])
@pytest.mark.parametrize(("context_len", "anchor"), [(1, 3), (9, 250), (40, 0)])
def test_block_matches_the_reference(saved_drafters, name, block_size, context_len, anchor):
    path = saved_drafters[name, block_size]
    config, _, _ = load_drafter_checkpoint(path, jnp.float32)
    inputs = Inputs(TARGETS[name], config, context_len, anchor, seed=context_len + block_size)
    assert_same_draft(dflax_hidden(path, inputs), reference_hidden(path, inputs), inputs)


@pytest.mark.parametrize("name", list(TARGETS))
def test_block_after_a_cropped_draft_cache_matches_the_reference(saved_drafters, name):
    """The reference's decode loop feeds the context in pieces through its draft cache."""
    path = saved_drafters[name, 8]
    config, _, _ = load_drafter_checkpoint(path, jnp.float32)
    inputs = Inputs(TARGETS[name], config, context_len=23, anchor=11, seed=5)
    ours = dflax_hidden(path, inputs, split=17)
    assert_same_draft(ours, reference_hidden(path, inputs, split=17), inputs)


def test_the_reference_reads_the_saved_config(saved_drafters):
    """What the reference takes from dflax's config.json: taps, block size, mask token, its layer sizes."""
    for (name, block_size), path in saved_drafters.items():
        model = DFlashDraftModel.from_pretrained(str(path), torch_dtype=torch.float32)
        target = TARGETS[name]
        assert model.block_size == block_size
        assert model.mask_token_id == MASK_TOKEN_ID
        assert list(model.target_layer_ids) == list(build_target_layer_ids(target.num_layers, 2))
        assert model.config.head_dim == target.head_dim


@pytest.mark.parametrize("num_target_layers", range(2, 65))
def test_default_taps_are_the_reference_spread(num_target_layers):
    for num_draft_layers in range(1, 9):
        assert list(default_target_layer_ids(num_target_layers, num_draft_layers)) == list(
            build_target_layer_ids(num_target_layers, num_draft_layers)
        ), (num_target_layers, num_draft_layers)


def test_drafter_configs_keep_their_recorded_taps():
    target = TARGETS["qwen3-like"]
    recorded = (1, 3, 5, 7, 8)
    config = DFlashConfig.for_target(target, num_layers=3, target_layer_ids=recorded)
    assert config.target_layer_ids == recorded
    assert DFlashConfig.for_target(target, num_layers=3).target_layer_ids == tuple(
        build_target_layer_ids(target.num_layers, 3)
    )
    assert dataclasses.replace(config, block_size=8).target_layer_ids == recorded
