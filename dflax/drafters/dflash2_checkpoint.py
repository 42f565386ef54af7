"""DFlash 2 drafter checkpoints in the official z-lab layout (`DFlash2DraftModel`), which dflax also writes.

A DFlash 2 directory holds:
- config.json: a Qwen3 config (model_type "qwen3", architectures ["DFlash2DraftModel"]) with `layer_types`,
  `sliding_window`, `use_sliding_window`, `is_causal` (false in the official drafters) and
  `num_target_layers`, plus `dflash_config: {block_size, target_layer_ids, mask_token_id, conv_kernel_size,
  conv_group_size, selector_rank, selector_top_k}` and optionally `output_multiplier`,
  `final_logit_softcapping`, `input_embedding_scale` (read from dflash_config first, then the top level, as
  the reference does);
- *.safetensors: DFlash's tensors (`layers.N.self_attn.*`, `layers.N.mlp.*`, the layer norms, `fc.weight`,
  `hidden_norm.weight`, `norm.weight`, see dflax.drafters.checkpoint) plus
  `layers.N.{attention_conv,mlp_conv}.base_kernel` [2, P, D], `layers.N.{attention_conv,mlp_conv}.
  kernel_projection.weight` [2 * P * G, D], `candidate_selector.{predecessor,successor}_codebook` [V, R] (no
  `.weight` suffix: the reference maps them onto its embeddings' weights when loading) and
  `candidate_selector.hidden_projection.weight` [R, D].
Which layers slide and which attend causally follows transformers' Qwen3Config and the reference's attention:
the window is `sliding_window` only when `use_sliding_window` is true; without `layer_types`, layers from
`max_window_layers` on slide; `is_causal` true/false applies to every layer, and absent makes the sliding
layers causal.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp

from dflax.checkpoints.params import CheckpointError, map_tensors, param_shapes
from dflax.drafters.checkpoint import DFLASH2_KEYS, MATH_KEYS, hf_tensor_name, layer_config_json
from dflax.drafters.dflash import DFlashConfig
from dflax.drafters.dflash2 import FULL, SLIDING, DFlash2Config, DFlash2Drafter, init_dflash2_params
from dflax.drafters.drafter_files import read_config_json, read_tensors, write_drafter_dir
from dflax.models.config import ModelConfig

ARCHITECTURE = "DFlash2DraftModel"
# Logit and embedding scalings DFlash 2 drafters implement (the rest of MATH_KEYS is refused).
_IMPLEMENTED = ("output_multiplier", "final_logit_softcapping", "input_embedding_scale")
# transformers' Qwen3Config defaults for the window keys a config.json may leave out.
_QWEN3_SLIDING_WINDOW = 4096
_QWEN3_MAX_WINDOW_LAYERS = 28


def is_dflash2_config(data: dict) -> bool:
    """Whether a drafter config.json dictionary describes a DFlash 2 drafter."""
    dflash = data.get("dflash_config") or {}
    return ARCHITECTURE in (data.get("architectures") or []) or any(dflash.get(k) for k in DFLASH2_KEYS)


def _layer_types(data: dict, window: int | None) -> tuple[str, ...]:
    """Per-layer attention kinds as transformers' Qwen3Config sets them."""
    if data.get("layer_types"):
        return tuple(data["layer_types"])
    first_sliding = data.get("max_window_layers", _QWEN3_MAX_WINDOW_LAYERS)
    return tuple(
        SLIDING if window is not None and i >= first_sliding else FULL
        for i in range(data["num_hidden_layers"])
    )


def dflash2_config_from_json(data: dict) -> DFlash2Config:
    """Reads an official (or dflax-written) DFlash 2 config.json dictionary.

    Raises:
      CheckpointError: when it is not a DFlash 2 config, lacks a DFlash 2 key, a mask token id or the taps,
        asks for drafter math dflax does not implement, or its values are inconsistent.
    """
    if not is_dflash2_config(data):
        raise CheckpointError(
            f"not a DFlash 2 drafter config (no architectures: {ARCHITECTURE}, "
            f"no {', '.join(DFLASH2_KEYS)}); load DFlash drafters with "
            "dflax.drafters.checkpoint.load_drafter_checkpoint"
        )
    dflash = data.get("dflash_config") or {}

    def value(name, default=None):
        return dflash.get(name, data.get(name, default))

    problems = [
        f"no {key}" for key in (*DFLASH2_KEYS, "mask_token_id", "target_layer_ids") if value(key) is None
    ]
    if data.get("model_type", "qwen3") != "qwen3":
        problems.append(f"model_type {data.get('model_type')!r} (DFlash 2 drafters are qwen3)")
    for key, neutral in MATH_KEYS.items():
        if key not in _IMPLEMENTED and not neutral(value(key)):
            problems.append(f"{key}={value(key)!r}, which dflax does not implement")
    if problems:
        raise CheckpointError("cannot load this DFlash 2 drafter config.json: " + "; ".join(problems))
    window = data.get("sliding_window", _QWEN3_SLIDING_WINDOW) if data.get("use_sliding_window") else None
    is_causal = data.get("is_causal")
    cap = value("final_logit_softcapping")
    multiplier, embedding_scale = value("output_multiplier"), value("input_embedding_scale")
    try:
        base = DFlashConfig(
            layers=ModelConfig.from_hf({**data, "model_type": "qwen3"}),
            block_size=int(value("block_size", 16)),
            target_layer_ids=tuple(int(i) for i in value("target_layer_ids")),
            mask_token_id=int(value("mask_token_id")),
        )
        return DFlash2Config(
            base=base,
            conv_kernel_size=int(value("conv_kernel_size")),
            conv_group_size=int(value("conv_group_size")),
            selector_rank=int(value("selector_rank")),
            selector_top_k=int(value("selector_top_k")),
            layer_types=_layer_types(data, window),
            sliding_window=None if window is None else int(window),
            is_causal=None if is_causal is None else bool(is_causal),
            output_multiplier=1.0 if multiplier is None else float(multiplier),
            final_logit_softcapping=None if cap is None or float(cap) <= 0 else float(cap),
            input_embedding_scale=1.0 if embedding_scale is None else float(embedding_scale),
        )
    except ValueError as err:  # UnsupportedArchitectureError and DFlash2Config's checks included
        raise CheckpointError(f"cannot load this DFlash 2 drafter config.json: {err}") from None


def dflash2_config_to_json(config: DFlash2Config, num_target_layers: int) -> dict:
    """The official config.json dictionary of a DFlash 2 drafter (what `DFlash2DraftModel` reads)."""
    scalings = {
        "output_multiplier": (config.output_multiplier, 1.0),
        "final_logit_softcapping": (config.final_logit_softcapping, None),
        "input_embedding_scale": (config.input_embedding_scale, 1.0),
    }
    scalings = {key: value for key, (value, neutral) in scalings.items() if value != neutral}
    return {
        "architectures": [ARCHITECTURE],
        **layer_config_json(config.layers),
        "hidden_act": "silu",
        "attention_bias": False,
        "num_target_layers": num_target_layers,
        "layer_types": list(config.layer_types),
        "sliding_window": config.sliding_window,
        "use_sliding_window": config.sliding_window is not None,
        "max_window_layers": config.layers.num_layers,
        **({} if config.is_causal is None else {"is_causal": config.is_causal}),
        "dflash_config": {
            "block_size": config.block_size,
            "target_layer_ids": list(config.target_layer_ids),
            "mask_token_id": config.mask_token_id,
            "conv_kernel_size": config.conv_kernel_size,
            "conv_group_size": config.conv_group_size,
            "selector_rank": config.selector_rank,
            "selector_top_k": config.selector_top_k,
            **scalings,
        },
    }


def save_dflash2_drafter(
    path: str | Path, config: DFlash2Config, params: dict, num_target_layers: int, dtype: str = "float32"
) -> None:
    """Writes config.json + model.safetensors in the official DFlash 2 layout (see the module docstring)."""
    write_drafter_dir(
        Path(path),
        params,
        hf_tensor_name,
        dflash2_config_to_json(config, num_target_layers),
        "dflax-dflash2",
        dtype,
        None,
        config.layers.vocab_size,
    )


def load_dflash2_checkpoint(path: str | Path, dtype: jnp.dtype) -> tuple[DFlash2Config, dict]:
    """Reads a DFlash 2 drafter directory: its config and parameters ({"params": ...}).

    Raises:
      FileNotFoundError: when config.json or the safetensors are missing.
      CheckpointError: for a config dflax cannot run, a draft vocabulary (DFlash 2 reads the whole
        vocabulary), or tensors missing, extra or of the wrong shape for the config.
    """
    path = Path(path)
    config = dflash2_config_from_json(read_config_json(path, "DFlash 2"))
    tensors, draft_vocab = read_tensors(path, config.layers.vocab_size)
    if draft_vocab is not None:
        raise CheckpointError(f"{path}: DFlash 2 drafters read out the whole vocabulary; found a draft_vocab")
    module = DFlash2Drafter(config, dtype)
    expected = param_shapes(jax.eval_shape(lambda: init_dflash2_params(module)))
    return config, map_tensors(expected, tensors, dtype, "DFlash 2 drafter")
