"""DFlash drafter checkpoints in the official z-lab/dflash layout (which dflax also writes).

A drafter directory holds:
- config.json: a Qwen3-style config (model_type "qwen3"; dflax also writes "llama" for drafters whose layers
  have no q/k norms, see DRAFTER_LAYER_ARCHS) (hidden_size, intermediate_size, num_hidden_layers,
  num_attention_heads, num_key_value_heads, head_dim, rms_norm_eps, rope_theta, vocab_size, ...) plus
  `block_size`, `num_target_layers` and `dflash_config: {"target_layer_ids": [...], "mask_token_id": id}`;
- model.safetensors: `layers.N.self_attn.{q,k,v,o}_proj.weight`, `layers.N.self_attn.{q,k}_norm.weight`
  (Qwen3-style layers only),
  `layers.N.mlp.{gate,up,down}_proj.weight`, `layers.N.{input,post_attention}_layernorm.weight`,
  `fc.weight`, `hidden_norm.weight`, `norm.weight`. The embedding and LM head are the target's and are
  not stored.
dflax extensions: a drafter with a learned mask stores `mask_embedding` [hidden] and
`dflash_config.mask_token_id: null`; a drafter with a pruned vocabulary (dflax.drafters.draft_vocab) stores
its token ids as the int32 tensor `draft_vocab` [V']. Weights are saved as float32 or bfloat16 (`dtype`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dflax.checkpoints.params import CheckpointError, map_tensors, param_shapes
from dflax.drafters.dflash import DRAFTER_LAYER_ARCHS, DFlashConfig, DFlashDrafter, init_drafter_params
from dflax.drafters.drafter_files import read_config_json, read_tensors, write_drafter_dir
from dflax.models.config import ModelConfig


def layer_config_json(layers: ModelConfig) -> dict:
    """The HF config.json fields of a drafter's decoder layers (what `ModelConfig.from_hf` reads back)."""
    return {
        "model_type": layers.arch,
        "hidden_size": layers.hidden_size,
        "intermediate_size": layers.intermediate_size,
        "num_hidden_layers": layers.num_layers,
        "num_attention_heads": layers.num_heads,
        "num_key_value_heads": layers.num_kv_heads,
        "head_dim": layers.head_dim,
        "rms_norm_eps": layers.rms_norm_eps,
        "rope_theta": layers.rope_theta,
        "vocab_size": layers.vocab_size,
        "max_position_embeddings": layers.max_position_embeddings,
        "tie_word_embeddings": layers.tie_word_embeddings,
        **({"rope_scaling": dataclasses.asdict(layers.rope_scaling)} if layers.rope_scaling else {}),
    }


def config_to_json(config: DFlashConfig, num_target_layers: int) -> dict:
    """The official config.json dictionary of a drafter."""
    return {
        "architectures": ["DFlashDraftModel"],
        **layer_config_json(config.layers),
        "hidden_act": "silu",
        "attention_bias": False,
        "block_size": config.block_size,
        "num_target_layers": num_target_layers,
        "dflash_config": {
            "target_layer_ids": list(config.target_layer_ids),
            "mask_token_id": config.mask_token_id,
            **({"feature_norm": True} if config.feature_norm else {}),
        },
    }


# dflash_config keys that only DFlash 2 drafters (DFlash2DraftModel) carry: the candidate selector and the
# grouped dynamic convolutions around each sublayer.
DFLASH2_KEYS = ("selector_rank", "selector_top_k", "conv_kernel_size", "conv_group_size")


def _is_neutral_scale(value) -> bool:
    return value is None or float(value) == 1.0


def _is_neutral_softcap(value) -> bool:
    return value is None or float(value) <= 0  # the reference applies a soft cap only when it is > 0


def _is_false(value) -> bool:
    return not value


# Config keys that change the drafter's math, which dflax does not implement, with the test for the value at
# which they are a no-op. The reference reads each from dflash_config first, then from the top level.
MATH_KEYS = {
    "input_embedding_scale": _is_neutral_scale,  # scales the target embeddings of the block
    "output_multiplier": _is_neutral_scale,  # scales the draft logits
    "final_logit_softcapping": _is_neutral_softcap,  # tanh soft cap on the draft logits
    "use_swa": _is_false,  # sliding-window drafter attention (vLLM spelling)
    "attention_sink_bias": _is_false,  # a learned per-head attention sink
    "attention_value_scale": _is_neutral_scale,
    "partial_rotary_factor": _is_neutral_scale,  # RoPE on part of each head
}


def check_supported(data: dict) -> None:
    """Raises CheckpointError, naming the keys, when a drafter config.json asks for math dflax lacks.

    Refused: DFlash 2 drafters (architecture DFlash2DraftModel, or the candidate-selector / convolution keys
    in dflash_config); keys in MATH_KEYS away from their neutral value; drafter layers with sliding-window
    or causal attention (`layer_types` with "sliding_attention", `is_causal: true`), where dflax drafts a
    block with bidirectional attention over the whole context.
    """
    dflash = data.get("dflash_config") or {}
    dflash2_keys = [k for k in DFLASH2_KEYS if dflash.get(k)]
    if "DFlash2DraftModel" in (data.get("architectures") or []) or dflash2_keys:
        found = ", ".join(dflash2_keys) or "architectures: DFlash2DraftModel"
        raise CheckpointError(
            f"this is a DFlash 2 drafter (candidate selector, grouped dynamic convolutions; {found}); "
            "dflax loads DFlash drafters only for now"
        )
    bad = []
    for key, neutral in MATH_KEYS.items():
        value = dflash.get(key, data.get(key))
        if not neutral(value):
            bad.append(f"{key}={value!r}")
    sliding = [i for i, kind in enumerate(data.get("layer_types") or ()) if kind == "sliding_attention"]
    if sliding:
        window = data.get("sliding_window")
        bad.append(f"layer_types: sliding_attention at layers {sliding} (sliding_window={window})")
    if data.get("is_causal"):
        bad.append("is_causal=True")
    if bad:
        raise CheckpointError(
            "drafter config.json asks for drafter math that dflax does not implement: "
            + "; ".join(bad)
            + ". dflax runs the plain DFlash drafter: bidirectional attention over the block and the whole "
            "context, full RoPE, no attention sinks, unscaled embeddings and logits"
        )


def config_from_json(data: dict) -> DFlashConfig:
    """Reads an official (or dflax-written) drafter config.json dictionary.

    Values in `dflash_config` take precedence over top-level ones, as in the reference implementation.

    Raises:
      CheckpointError: for a config dflax cannot run (see `check_supported`), an unknown layer kind, or no
        target_layer_ids.
    """
    check_supported(data)
    dflash = data.get("dflash_config") or {}
    layer_ids = dflash.get("target_layer_ids", data.get("target_layer_ids"))
    if layer_ids is None:
        raise CheckpointError("drafter config.json has no dflash_config.target_layer_ids")
    arch = data.get("model_type", "qwen3")
    if arch not in DRAFTER_LAYER_ARCHS:
        raise CheckpointError(
            f"drafter config.json has model_type {arch!r}; "
            f"DFlash drafter layers are one of {DRAFTER_LAYER_ARCHS}"
        )
    layers = ModelConfig.from_hf({**data, "model_type": arch})
    return DFlashConfig(
        layers=layers,
        block_size=int(dflash.get("block_size", data.get("block_size", 16))),
        target_layer_ids=tuple(int(i) for i in layer_ids),
        mask_token_id=dflash.get("mask_token_id", data.get("mask_token_id")),
        feature_norm=bool(dflash.get("feature_norm", False)),
    )


def hf_tensor_name(path: tuple[str, ...]) -> str:
    """The checkpoint name of a flattened parameter path: ("layers_3", "mlp", ...) -> "layers.3.mlp..."."""
    head, *rest = path
    if head.startswith("layers_"):
        head = "layers." + head.removeprefix("layers_")
    return ".".join([head, *rest])


def save_drafter(
    path: str | Path,
    config: DFlashConfig,
    params: dict,
    num_target_layers: int,
    dtype: str = "float32",
    draft_vocab: np.ndarray | None = None,
) -> None:
    """Writes config.json + model.safetensors in the official layout (see the module docstring)."""
    write_drafter_dir(
        Path(path),
        params,
        hf_tensor_name,
        config_to_json(config, num_target_layers),
        "dflax-dflash",
        dtype,
        draft_vocab,
        config.layers.vocab_size,
    )


def load_drafter_checkpoint(
    path: str | Path, dtype: jnp.dtype
) -> tuple[DFlashConfig, dict, np.ndarray | None]:
    """Reads a drafter directory: its config, parameters and draft vocabulary (None = the whole one).

    Raises:
      FileNotFoundError: when config.json or the safetensors are missing.
      CheckpointError: when tensors do not fit the config.
    """
    path = Path(path)
    config = config_from_json(read_config_json(path, "DFlash"))
    tensors, draft_vocab = read_tensors(path, config.layers.vocab_size)
    module = DFlashDrafter(config, dtype)
    expected = param_shapes(jax.eval_shape(lambda: init_drafter_params(module)))
    return config, map_tensors(expected, tensors, dtype, "DFlash drafter"), draft_vocab
