"""Load a Dream or LLaDA checkpoint directory (config.json + *.safetensors) as a `DiffusionLM`.

`is_diffusion_lm_dir` tells a CLI whether a `--drafter` directory is one (by config.json's `model_type`),
`load_diffusion_lm` reads it. Every way a directory can fail (not a directory, no config.json, another
model type, an unsupported variant, missing shards, tensors that do not fit the config) raises one
`DiffusionCheckpointError` that names the directory and what to do.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from dflax.checkpoints.params import CheckpointError, expected_param_shapes, map_tensors
from dflax.diffusion import dream, llada
from dflax.diffusion.bidirectional import DEFAULT_CONTEXT, BidirectionalDiffusionLM, BidirectionalTransformer
from dflax.models.config import UnsupportedArchitectureError

_INDEX = "model.safetensors.index.json"


class DiffusionCheckpointError(ValueError):
    """A directory is not a Dream or LLaDA checkpoint dflax can load."""


def _read_config(path: Path) -> dict[str, Any]:
    """config.json of a checkpoint directory."""
    if not path.is_dir():
        raise DiffusionCheckpointError(
            f"{path} is not a directory; pass a Dream or LLaDA checkpoint directory"
        )
    config_file = path / "config.json"
    if not config_file.is_file():
        raise DiffusionCheckpointError(
            f"{path} has no config.json; a Dream or LLaDA checkpoint directory holds config.json and "
            "*.safetensors as the Hugging Face hub stores them"
        )
    try:
        return json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        raise DiffusionCheckpointError(f"{config_file} is not valid JSON: {err}") from None


def is_diffusion_lm_dir(path: str | Path) -> bool:
    """Whether `path` is a directory whose config.json names Dream or LLaDA (weights are not checked)."""
    try:
        hf = _read_config(Path(path).expanduser())
    except DiffusionCheckpointError:
        return False
    return dream.is_dream_config(hf) or llada.is_llada_config(hf)


def _read_tensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of the directory's safetensors files, checked against its shard index if it has one."""
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if (path / _INDEX).is_file():
        listed = set(json.loads((path / _INDEX).read_text()).get("weight_map", {}).values())
        missing = sorted(listed - {f.name for f in files})
        if missing:
            raise DiffusionCheckpointError(
                f"{path}: {_INDEX} lists shards that are not there: {missing[:4]}; download them all"
            )
    if not files:
        raise DiffusionCheckpointError(
            f"{path} has no *.safetensors files (PyTorch .bin weights are not read; save the model with "
            "transformers' save_pretrained(safe_serialization=True))"
        )
    tensors = {}
    for file in files:
        with safe_open(str(file), framework="flax") as f:
            for name in f.keys():
                tensors[name] = np.asarray(f.get_tensor(name))
    return tensors


def load_diffusion_lm(
    path: str | Path,
    dtype: str | jnp.dtype = "float32",
    context: int = DEFAULT_CONTEXT,
    attention_backend: str = "auto",
) -> tuple[BidirectionalDiffusionLM, dict]:
    """Loads a Dream or LLaDA checkpoint directory.

    Args:
      path: a local directory with config.json (model_type "Dream" or "llada") and *.safetensors (one file
        or shards, with or without model.safetensors.index.json).
      dtype: parameter and activation dtype ("float32", "bfloat16", "float16" or a jnp dtype).
      context: C, the committed tokens each `window_logits` forward re-reads (static).
      attention_backend: see `dflax.models.attention.AttentionConfig.backend`.

    Returns:
      (the model as a `dflax.diffusion.protocol.DiffusionLM`, its parameters {"params": ...}).

    Raises:
      DiffusionCheckpointError: for anything but a loadable Dream or LLaDA directory (the message says why).
    """
    path = Path(path).expanduser()
    hf = _read_config(path)
    try:
        if dream.is_dream_config(hf):
            (config, mask), rename, shift = dream.dream_model_config(hf), dream.dream_tensor_names, True
        elif llada.is_llada_config(hf):
            (config, mask), rename, shift = llada.llada_model_config(hf), llada.llada_tensor_names, False
        else:
            raise DiffusionCheckpointError(
                f"{path}: config.json has model_type {hf.get('model_type')!r}; a diffusion drafter must be a "
                "Dream (model_type 'Dream') or LLaDA (model_type 'llada') checkpoint"
            )
        tensors = rename(_read_tensors(path))
        jdtype = jnp.dtype(dtype)
        name = "Dream" if shift else "LLaDA"
        params = map_tensors(expected_param_shapes(config), tensors, jdtype, f"{name} model")
    except (UnsupportedArchitectureError, CheckpointError, KeyError) as err:
        detail = f"config.json lacks {err}" if isinstance(err, KeyError) else str(err)
        raise DiffusionCheckpointError(f"{path}: {detail}") from None
    module = BidirectionalTransformer(config, dtype=jdtype, attention_backend=attention_backend)
    return BidirectionalDiffusionLM(module, mask, shift, context, name.lower()), params
