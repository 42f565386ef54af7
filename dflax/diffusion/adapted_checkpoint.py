"""The directory of an adapted diffusion drafter: what `dflax train` exports and dflax ships.

A directory holds:
- config.json: {"architectures": ["AdaptedDiffusionDrafter"], "model_type" (the target's layer kind),
  the layer shapes (hidden_size, intermediate_size, num_hidden_layers, heads, head_dim, rms_norm_eps,
  rope_theta, vocab_size, ...), "source_layers" (the target layers it was initialised from),
  "mask_token_id", "window" (K trained)};
- model.safetensors: `layers.N.self_attn.{q,k,v,o}_proj.weight`, `layers.N.mlp.{gate,up,down}_proj.weight`,
  `layers.N.{input,post_attention}_layernorm.weight`, `norm.weight`, `mask_embedding`. The embedding and
  the LM head are the target's and are not stored;
- TRAINING.json (written by the trainer): how it was made.
"""

from __future__ import annotations

import json
from pathlib import Path

import flax
import jax
import jax.numpy as jnp
import numpy as np

from dflax.checkpoints.params import CheckpointError, map_tensors, param_shapes
from dflax.diffusion.adapted_drafter import (
    AdaptedConfig,
    AdaptedDrafter,
    AdaptedLayers,
    init_adapted_params,
    shared_params,
)
from dflax.drafters.checkpoint import hf_tensor_name, layer_config_json
from dflax.models.config import ModelConfig

ARCHITECTURE = "AdaptedDiffusionDrafter"
CONFIG = "config.json"
WEIGHTS = "model.safetensors"


def config_to_json(config: AdaptedConfig) -> dict:
    """The config.json dictionary of a drafter."""
    return {
        "architectures": [ARCHITECTURE],
        **layer_config_json(config.layers),
        "hidden_act": config.layers.hidden_act,
        "attention_bias": config.layers.attention_bias,
        "source_layers": list(config.source_layers),
        "mask_token_id": config.mask_token_id,
        "window": config.window,
    }


def config_from_json(data: dict) -> AdaptedConfig:
    """Reads a drafter's config.json dictionary."""
    missing = [k for k in ("source_layers", "mask_token_id", "window") if k not in data]
    if missing:
        raise CheckpointError(f"adapted drafter config.json lacks {missing}")
    layers = ModelConfig.from_hf(data)
    return AdaptedConfig(
        layers, tuple(int(i) for i in data["source_layers"]), int(data["mask_token_id"]), int(data["window"])
    )


def is_adapted_drafter_dir(path: str | Path) -> bool:
    """Whether `path` is an adapted diffusion drafter directory (its config.json names the architecture)."""
    config = Path(path) / CONFIG
    if not config.is_file():
        return False
    try:
        return ARCHITECTURE in json.loads(config.read_text(encoding="utf-8")).get("architectures", [])
    except (json.JSONDecodeError, AttributeError):
        return False


def save_adapted_drafter(
    path: str | Path, config: AdaptedConfig, params: dict, dtype: str = "bfloat16"
) -> None:
    """Writes config.json + model.safetensors of the drafter's own parameters {"params": ...}."""
    from safetensors.numpy import save_file

    np_dtype = {"float32": np.float32, "bfloat16": jnp.bfloat16}[dtype]
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    flat = flax.traverse_util.flatten_dict(params["params"])
    tensors = {hf_tensor_name(p): np.asarray(jax.device_get(v)).astype(np_dtype) for p, v in flat.items()}
    save_file(tensors, str(path / WEIGHTS), metadata={"format": "dflax-adapted-diffusion"})
    (path / CONFIG).write_text(json.dumps(config_to_json(config), indent=2) + "\n")


def load_adapted_drafter(
    path: str | Path, target, dtype: jnp.dtype | None = None
) -> tuple[AdaptedDrafter, dict]:
    """A drafter directory, bound to `target` (a `dflax.target.Target`) whose embedding and LM head it shares.

    Args:
      path: the drafter directory.
      target: the loaded target it was adapted from.
      dtype: parameter dtype (default: the target's).

    Returns:
      (the `DiffusionLM`, its parameters {"drafter", "embedding", "readout"}).

    Raises:
      FileNotFoundError: when the directory is not an adapted drafter's.
      CheckpointError: when its tensors do not fit its config.
      ValueError: when it was not made for `target`.
    """
    from safetensors import safe_open

    path = Path(path)
    if not is_adapted_drafter_dir(path):
        raise FileNotFoundError(
            f"{path} is not an adapted diffusion drafter directory (no config.json naming {ARCHITECTURE})"
        )
    config = config_from_json(json.loads((path / CONFIG).read_text(encoding="utf-8")))
    config.check_target(target.config)
    if not (path / WEIGHTS).is_file():
        raise FileNotFoundError(f"{path} has no {WEIGHTS}")
    with safe_open(str(path / WEIGHTS), framework="flax") as f:
        tensors = {name: np.asarray(f.get_tensor(name)) for name in f.keys()}
    dtype = dtype or target.dtype
    module = AdaptedLayers(config, dtype)
    expected = param_shapes(jax.eval_shape(lambda: init_adapted_params(module)))
    own = map_tensors(expected, tensors, dtype, "adapted diffusion drafter")
    return AdaptedDrafter(module), {"drafter": own, **shared_params(target.config, target.params)}
