"""Parity with the reference DFlash 2 (PyPI `dflash`, `DFlash2DraftModel`): one checkpoint, the same drafts.

The reference is the oracle, imported, never copied. Random tiny drafters (every weight, norms too, perturbed)
are saved once by dflax in the official layout and loaded both by `DFlash2DraftModel.from_pretrained`
(torch, float32) and by dflax. From the same target features, anchor and positions both must give
- the same final hidden states of the block (1e-4), for contexts shorter and longer than a sliding window of
  12 tokens (shorter than a 16-token block, so the window also cuts the block), after a draft cache filled
  in two pieces too, where dropping the window would change the result;
- the same selector path at temperature 0 (exactly) and the same candidates;
- at T > 0 the same path and q rows (1e-4) when both draw by inverse CDF from the same uniforms: the
  reference's `torch.multinomial` draw (`dflash.model._sample_probs`) is replaced in the test by that draw.
Three drafters: block 8 with every layer sliding and `is_causal: false` (the official kind), block 16 with
a sliding and a full layer, a 3-tap convolution and logit / embedding scalings, and block 8 without
`is_causal` (the reference then makes sliding layers causal).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from dflash import model as reference
from dflash.model import DFlash2DraftModel, Qwen3DFlashAttention
from safetensors.numpy import load_file, save_file
from transformers import Qwen3Config

from dflax.checkpoints.params import CheckpointError
from dflax.drafters.checkpoint import config_from_json, load_drafter_checkpoint
from dflax.drafters.dflash import DFlashConfig
from dflax.drafters.dflash2 import DFlash2Config, DFlash2Drafter, init_dflash2_params
from dflax.drafters.dflash2_checkpoint import (
    dflash2_config_from_json,
    dflash2_config_to_json,
    load_dflash2_checkpoint,
    save_dflash2_drafter,
)
from dflax.models.cache import KVCache, write_kv
from dflax.models.config import ModelConfig

ATOL = 1e-4
MASK_TOKEN_ID = 7
WINDOW = 12
FIXTURES = Path(__file__).parent / "official_configs"

# A tiny target: every axis a different size (width 48 = 3 groups of 16 = 6 of 8).
TARGET = ModelConfig(
    arch="qwen3",
    vocab_size=200,
    hidden_size=48,
    intermediate_size=72,
    num_layers=10,
    num_heads=4,
    num_kv_heads=2,
    head_dim=12,
    rms_norm_eps=1e-6,
    rope_theta=1e6,
    tie_word_embeddings=False,
    max_position_embeddings=4096,
)
SLIDE, FULL = "sliding_attention", "full_attention"
# name -> (block size, DFlash2Config fields)
DRAFTERS = {
    "b8-sliding": (
        8,
        dict(conv_kernel_size=2, conv_group_size=16, layer_types=(SLIDE, SLIDE), is_causal=False),
    ),
    "b16-mixed": (
        16,
        dict(
            conv_kernel_size=3,
            conv_group_size=8,
            layer_types=(SLIDE, FULL),
            is_causal=False,
            output_multiplier=0.7,
            final_logit_softcapping=3.0,
            input_embedding_scale=1.5,
        ),
    ),
    "b8-causal": (
        8,
        dict(conv_kernel_size=2, conv_group_size=16, layer_types=(SLIDE, SLIDE), is_causal=None),
    ),
}


def random_drafter(name: str, seed: int) -> tuple[DFlash2Config, dict]:
    """A drafter with every weight random: DFlash's layers, the convolutions, the selector."""
    block_size, fields = DRAFTERS[name]
    base = DFlashConfig.for_target(TARGET, num_layers=2, block_size=block_size, mask_token_id=MASK_TOKEN_ID)
    config = DFlash2Config(base=base, selector_rank=20, selector_top_k=6, sliding_window=WINDOW, **fields)
    params = init_dflash2_params(DFlash2Drafter(config), seed)
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    keys = jax.random.split(jax.random.key(seed + 1), len(flat))
    leaves = []
    for (path, x), key in zip(flat, keys):
        # codebooks large enough that the predecessor term reorders the candidates
        scale = 0.5 if "codebook" in jax.tree_util.keystr(path) else 0.2
        leaves.append(x + scale * jax.random.normal(key, x.shape, x.dtype))
    return config, jax.tree.unflatten(jax.tree.structure(params), leaves)


@pytest.fixture(scope="module")
def drafters(tmp_path_factory):
    """name -> (directory, dflax config, dflax params, reference model), each written and loaded once."""
    out = {}
    for seed, name in enumerate(DRAFTERS):
        path = tmp_path_factory.mktemp(name)
        config, params = random_drafter(name, seed)
        save_dflash2_drafter(path, config, params, TARGET.num_layers)
        loaded_config, loaded = load_dflash2_checkpoint(path, jnp.float32)
        assert loaded_config == config
        model, info = DFlash2DraftModel.from_pretrained(
            str(path), torch_dtype=torch.float32, output_loading_info=True
        )
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        out[name] = (path, config, loaded, model.eval())
    return out


class Inputs:
    """One drafting call: target features of the context, the anchor, the target's embedding and LM head."""

    def __init__(self, config: DFlash2Config, context_len: int, anchor: int, seed: int):
        rng = np.random.default_rng(seed)
        taps = len(config.target_layer_ids)
        # [1, context_len, taps * D]: target hidden states, a few large dims as real targets have
        self.features = rng.normal(size=(1, context_len, taps * TARGET.hidden_size)).astype(np.float32)
        self.features[..., :: TARGET.hidden_size] *= 30.0
        self.embedding = rng.normal(size=(TARGET.vocab_size, TARGET.hidden_size)).astype(np.float32)  # [V, D]
        self.lm_head = 0.3 * rng.normal(size=(TARGET.vocab_size, TARGET.hidden_size)).astype(np.float32)
        block = [anchor] + [config.mask_token_id] * (config.block_size - 1)
        self.block = self.embedding[block][None]  # [1, T, D]
        self.context_len, self.anchor = context_len, anchor


def reference_hidden(model, config: DFlash2Config, inputs: Inputs, split: int | None = None) -> np.ndarray:
    """The reference's [T, D] final hidden states (through its draft cache, cropped, when `split`)."""
    n, t = inputs.context_len, inputs.block.shape[1]
    positions = torch.arange(n + t)[None]
    features = torch.from_numpy(inputs.features)
    block = torch.from_numpy(inputs.block) * config.input_embedding_scale  # as dflash_generate scales it
    with torch.no_grad():
        if split is None:
            out = model(target_hidden=features, noise_embedding=block, position_ids=positions)
        else:  # the decode loop's way: an earlier call cached the first context tokens, then was cropped
            cache = reference._make_cache(model.config)  # sliding layers keep what their window needs
            model(
                target_hidden=features[:, :split],
                noise_embedding=block[:, :1].expand(-1, t, -1),
                position_ids=positions[:, : split + t],
                past_key_values=cache,
                use_cache=True,
            )
            reference._crop_to(cache, split)
            out = model(
                target_hidden=features[:, split:],
                noise_embedding=block,
                position_ids=positions[:, split:],
                past_key_values=cache,
                use_cache=True,
            )
    return out[0].numpy()


def dflax_hidden(config: DFlash2Config, params, inputs: Inputs, split: int | None = None) -> np.ndarray:
    """dflax's [T, D] final hidden states: the context projected into a draft cache (in two pieces when
    `split`; unused slots NaN, never read), then the block."""
    module = DFlash2Drafter(config)
    n, t = inputs.context_len, inputs.block.shape[1]
    nan = jnp.full((1, config.layers.num_kv_heads, n + 5, config.layers.head_dim), jnp.nan, jnp.float32)
    layers = range(config.layers.num_layers)
    cache = KVCache(
        k=tuple(nan for _ in layers), v=tuple(nan for _ in layers), lengths=jnp.zeros(1, jnp.int32)
    )
    for lo, hi in ((0, split), (split, n)) if split else ((0, n),):
        ks, vs = module.apply(
            params,
            jnp.asarray(inputs.features[:, lo:hi]),
            jnp.arange(lo, hi, dtype=jnp.int32)[None],
            method=DFlash2Drafter.context_kv,
        )
        cache = cache.replace(
            k=tuple(write_kv(buf, k, cache.lengths) for buf, k in zip(cache.k, ks)),
            v=tuple(write_kv(buf, v, cache.lengths) for buf, v in zip(cache.v, vs)),
            lengths=cache.lengths + (hi - lo),
        )
    positions = n + jnp.arange(t, dtype=jnp.int32)[None]
    return np.asarray(module.apply(params, jnp.asarray(inputs.block), positions, cache))[0]


@pytest.mark.parametrize("name", list(DRAFTERS))
@pytest.mark.parametrize(("context_len", "anchor"), [(1, 3), (9, 150), (30, 0)])
def test_block_matches_the_reference(drafters, name, context_len, anchor):
    _, config, params, model = drafters[name]
    inputs = Inputs(config, context_len, anchor, seed=context_len + config.block_size)
    theirs = reference_hidden(model, config, inputs)
    np.testing.assert_allclose(dflax_hidden(config, params, inputs), theirs, atol=ATOL, rtol=0)
    if context_len + config.block_size > WINDOW:  # the window must matter here: without it dflax parts
        unwindowed = dflax_hidden(dataclasses.replace(config, sliding_window=None), params, inputs)
        assert np.abs(unwindowed - theirs).max() > 1e-2


@pytest.mark.parametrize("name", ["b8-sliding", "b16-mixed"])
def test_block_after_a_cropped_draft_cache_matches_the_reference(drafters, name):
    """The reference's decode loop feeds the context in pieces through its draft cache: the window counts
    cache slots by position."""
    _, config, params, model = drafters[name]
    inputs = Inputs(config, context_len=23, anchor=11, seed=5)
    ours = dflax_hidden(config, params, inputs, split=17)
    np.testing.assert_allclose(ours, reference_hidden(model, config, inputs, split=17), atol=ATOL, rtol=0)


def test_rows_at_different_positions_draft_as_alone(drafters):
    """A batch whose rows sit at different positions (a short context and one past the window) gives each
    row what it gives alone: the cache lengths, the window and the selector's chain are per row."""
    _, config, params, _ = drafters["b16-mixed"]
    rows = [Inputs(config, 9, 150, seed=3), Inputs(config, 30, 0, seed=4)]
    longest, t = max(r.context_len for r in rows), config.block_size
    features = np.zeros((2, longest, rows[0].features.shape[-1]), np.float32)
    for b, row in enumerate(rows):
        features[b, : row.context_len] = row.features[0]
    module = DFlash2Drafter(config)
    positions = jnp.broadcast_to(jnp.arange(longest, dtype=jnp.int32), (2, longest))
    ks, vs = module.apply(params, jnp.asarray(features), positions, method=DFlash2Drafter.context_kv)
    lengths = jnp.asarray([r.context_len for r in rows], jnp.int32)
    cache = KVCache(
        k=tuple(jnp.swapaxes(k, 1, 2) for k in ks),
        v=tuple(jnp.swapaxes(v, 1, 2) for v in vs),
        lengths=lengths,
    )
    blocks = jnp.asarray(np.concatenate([r.block for r in rows]))
    block_positions = lengths[:, None] + jnp.arange(t, dtype=jnp.int32)
    hidden = np.asarray(module.apply(params, blocks, block_positions, cache))  # [2, T, D]
    for b, row in enumerate(rows):
        np.testing.assert_allclose(hidden[b], dflax_hidden(config, params, row), atol=1e-5, rtol=0)
    # the selector on both rows at once, with the same head: each row's chain from its own anchor
    head = jnp.asarray(rows[0].lm_head)
    anchors = jnp.asarray([r.anchor for r in rows], jnp.int32)
    uniforms = jnp.asarray(np.random.default_rng(0).random((2, t - 1)), jnp.float32)
    batched = propose_jit(module, params, hidden[:, 1:], hidden[:, 1:] @ head.T, anchors, 1.0, uniforms)
    for b in range(2):
        h = hidden[b : b + 1, 1:]  # [1, n, D]
        alone = propose_jit(module, params, h, h @ head.T, anchors[b : b + 1], 1.0, uniforms[b : b + 1])
        np.testing.assert_array_equal(np.asarray(batched[0][b]), np.asarray(alone[0][0]))
        np.testing.assert_allclose(np.asarray(batched[2][b]), np.asarray(alone[2][0]), atol=1e-6, rtol=0)


def by_token(candidates: np.ndarray, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Candidates [n, M] and q [n, M] with each row's candidates in token order (top-k orders differ)."""
    order = np.argsort(candidates, axis=-1)
    return np.take_along_axis(candidates, order, -1), np.take_along_axis(q, order, -1)


def reference_propose(model, hidden: np.ndarray, inputs: Inputs, temperature: float):
    """The reference's (path [n], candidates [n, M], q [n, M] or None) from draft hidden states [n, D]."""
    head = torch.nn.Linear(TARGET.hidden_size, TARGET.vocab_size, bias=False)
    head.weight.data = torch.from_numpy(inputs.lm_head)
    with torch.no_grad():
        path, candidates, q = model.propose(
            torch.from_numpy(hidden)[None], torch.tensor([inputs.anchor]), head, temperature
        )
    return path[0].numpy(), candidates[0].numpy(), None if q is None else q[0].numpy()


def dflax_propose(config, params, hidden: np.ndarray, inputs: Inputs, temperature: float, uniforms=None):
    """dflax's (path [n], candidates [n, M], q [n, M]) from draft hidden states [n, D]."""
    hidden = jnp.asarray(hidden)[None]
    raw_logits = hidden @ jnp.asarray(inputs.lm_head).T  # [1, n, V] through the target's LM head
    uniforms = jnp.zeros(hidden.shape[:2]) if uniforms is None else jnp.asarray(uniforms)[None]
    anchor = jnp.asarray([inputs.anchor], jnp.int32)
    out = propose_jit(DFlash2Drafter(config), params, hidden, raw_logits, anchor, temperature, uniforms)
    return tuple(np.asarray(a)[0] for a in out)


@jax.jit(static_argnums=0)
def propose_jit(module, params, hidden, raw_logits, anchor, temperature, uniforms):
    """`DFlash2Drafter.propose` compiled with a traced temperature, as a decode loop runs it."""
    return module.apply(
        params, hidden, raw_logits, anchor, temperature, uniforms, method=DFlash2Drafter.propose
    )


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_greedy_selection_matches_the_reference(drafters, name):
    _, config, params, model = drafters[name]
    inputs = Inputs(config, context_len=20, anchor=42, seed=11)
    hidden = reference_hidden(model, config, inputs)[1:]  # [n, D] the draft positions
    path, candidates, q = reference_propose(model, hidden, inputs, 0.0)
    ours = dflax_propose(config, params, hidden, inputs, 0.0)
    np.testing.assert_array_equal(ours[0], path)
    np.testing.assert_array_equal(by_token(ours[1], ours[2])[0], np.sort(candidates, axis=-1))
    np.testing.assert_array_equal(ours[2].sum(-1), 1.0)  # q at T = 0: one-hot on the chosen candidate
    np.testing.assert_array_equal(np.take_along_axis(ours[1], ours[2].argmax(-1)[:, None], -1)[:, 0], path)
    # the selector is not the logits' argmax: the predecessor term reorders candidates somewhere
    assert (path != (hidden @ inputs.lm_head.T).argmax(-1)).any()
    # end to end: dflax's own hidden states give the same drafts
    ours_end_to_end = dflax_propose(config, params, dflax_hidden(config, params, inputs)[1:], inputs, 0.0)
    np.testing.assert_array_equal(ours_end_to_end[0], path)


def patch_reference_draws(monkeypatch, uniforms: np.ndarray) -> list:
    """Makes the reference draw by inverse CDF over each q row in descending order from `uniforms` [n]
    (dflax's draw) instead of torch.multinomial; returns the list of rows it drew from."""
    draws = iter(torch.from_numpy(uniforms))
    seen = []

    def inverse_cdf(probs):  # [1, M] -> [1]
        seen.append(probs)
        u = next(draws)
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        cdf = sorted_probs.cumsum(-1)
        rank = (cdf <= u * cdf[:, -1:]).sum(-1).clamp(max=probs.shape[-1] - 1)
        return order.gather(-1, rank[:, None])[:, 0]

    monkeypatch.setattr(reference, "_sample_probs", inverse_cdf)
    return seen


@pytest.mark.parametrize("name", list(DRAFTERS))
@pytest.mark.parametrize("temperature", [0.7, 1.5])
def test_sampled_selection_matches_the_reference(drafters, monkeypatch, name, temperature):
    _, config, params, model = drafters[name]
    inputs = Inputs(config, context_len=20, anchor=42, seed=11)
    hidden = reference_hidden(model, config, inputs)[1:]  # [n, D]
    n = hidden.shape[0]
    uniforms = np.random.default_rng(int(temperature * 10) + config.block_size).random(n).astype(np.float32)
    seen = patch_reference_draws(monkeypatch, uniforms)
    path, candidates, q = reference_propose(model, hidden, inputs, temperature)
    assert len(seen) == n
    ours = dflax_propose(config, params, hidden, inputs, temperature, uniforms)
    np.testing.assert_array_equal(ours[0], path)
    ours_candidates, ours_q = by_token(ours[1], ours[2])
    theirs_candidates, theirs_q = by_token(candidates, q)
    np.testing.assert_array_equal(ours_candidates, theirs_candidates)
    np.testing.assert_allclose(ours_q, theirs_q, atol=ATOL, rtol=0)
    greedy = dflax_propose(config, params, hidden, inputs, 0.0)[0]
    assert (path != greedy).any()  # the draws did choose: not the greedy path


# ---------------------------------------------------------------------------------------------------------
# The checkpoint layout and the config's window and causality rules.
# ---------------------------------------------------------------------------------------------------------


def official(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())["config"]


@pytest.mark.parametrize(
    ("fixture", "block_size", "multiplier", "cap"),
    [("dflash2-qwen3.8-27b", 8, 1.0, None), ("dflash2-muse-glimmer-30b", 16, 0.19611613513818404, 20.0)],
)
def test_official_configs_read(fixture, block_size, multiplier, cap):
    data = official(fixture)
    config = dflash2_config_from_json(data)
    assert config.block_size == block_size
    assert (config.conv_kernel_size, config.conv_group_size) == (2, 16)
    assert (config.selector_rank, config.selector_top_k) == (256, 16)
    assert config.target_layer_ids == tuple(data["dflash_config"]["target_layer_ids"])
    assert config.mask_token_id == data["dflash_config"]["mask_token_id"]
    assert (config.output_multiplier, config.final_logit_softcapping) == (multiplier, cap)
    assert config.layers.rope_theta == data["rope_parameters"]["rope_theta"]
    for i in range(config.layers.num_layers):
        assert config.layer_window(i) == 2048
        assert not config.layer_causal(i)
    with pytest.raises(CheckpointError, match="DFlash 2"):  # the DFlash loader still refuses it
        config_from_json(data)


def tiny_json(**changes) -> dict:
    """A tiny DFlash 2 config.json dictionary (official keys), with top-level keys replaced or removed."""
    data = {**official("dflash2-qwen3.8-27b"), "hidden_size": 32, "intermediate_size": 40, "head_dim": 8}
    data.update(
        {"num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64, "num_hidden_layers": 3}
    )
    data["layer_types"] = [SLIDE] * 3
    data["dflash_config"] = {**data["dflash_config"], "mask_token_id": 5, "selector_top_k": 4}
    data.update(changes)
    return {k: v for k, v in data.items() if v is not None}


@pytest.mark.parametrize(
    "changes",
    [
        {},  # official: every layer sliding, is_causal false
        {"is_causal": None},  # absent: sliding layers causal
        {"is_causal": True},
        {"layer_types": [SLIDE, FULL, SLIDE]},
        {"layer_types": [SLIDE, FULL, SLIDE], "is_causal": None},
        {"use_sliding_window": False},  # the window is dropped, the layers keep their kind
        {"use_sliding_window": False, "is_causal": None},
        {"layer_types": None, "max_window_layers": 1},  # transformers fills layer_types from the index
        {"layer_types": None, "sliding_window": None},  # Qwen3Config's default window, 4096
    ],
)
def test_windows_and_causality_follow_the_reference(changes):
    data = tiny_json(**changes)
    config = dflash2_config_from_json(data)
    hf = Qwen3Config(**{k: v for k, v in data.items() if k != "architectures"})
    for i in range(config.layers.num_layers):
        attention = Qwen3DFlashAttention(hf, i)
        assert config.layer_window(i) == attention.sliding_window, (i, changes)
        assert config.layer_causal(i) == attention.is_causal, (i, changes)
    # what dflax writes reads back the same (the target's eos ids are not a drafter's to keep)
    written = dataclasses.replace(config.layers, eos_token_ids=())
    assert dflash2_config_from_json(dflash2_config_to_json(config, 64)) == dataclasses.replace(
        config, base=dataclasses.replace(config.base, layers=written)
    )


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"dflash_config": {"mask_token_id": 5}, "architectures": ["X"]}, "not a DFlash 2"),
        ({"model_type": "llama"}, "model_type"),
        ({"attention_sink_bias": True}, "attention_sink_bias"),
        ({"hidden_size": 40}, "conv_group_size 16 does not divide hidden_size 40"),
    ],
)
def test_configs_dflax_cannot_run_are_refused(changes, words):
    with pytest.raises(CheckpointError, match=words):
        dflash2_config_from_json(tiny_json(**changes))


def test_missing_and_extra_tensors_are_refused(drafters, tmp_path):
    path = drafters["b8-sliding"][0]
    tensors = load_file(str(path / "model.safetensors"))
    (tmp_path / "config.json").write_text((path / "config.json").read_text())

    def load_with(named):
        save_file(named, str(tmp_path / "model.safetensors"))
        return load_dflash2_checkpoint(tmp_path, jnp.float32)

    missing = {k: v for k, v in tensors.items() if k != "layers.1.mlp_conv.base_kernel"}
    with pytest.raises(CheckpointError, match=r"missing \['layers.1.mlp_conv.base_kernel'\]"):
        load_with(missing)
    with pytest.raises(CheckpointError, match="unexpected.*candidate_selector.extra"):
        load_with({**tensors, "candidate_selector.extra": np.zeros(3, np.float32)})
    # codebooks under `.weight` (the reference's in-memory names) are not the checkpoint layout
    renamed = {k + ".weight" if k.endswith("codebook") else k: v for k, v in tensors.items()}
    with pytest.raises(CheckpointError, match="predecessor_codebook"):
        load_with(renamed)
    with pytest.raises(CheckpointError, match="DFlash 2"):  # nor does the DFlash loader take it
        load_drafter_checkpoint(path, jnp.float32)
