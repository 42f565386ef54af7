"""HF-named tensors -> the Flax parameter tree of `dflax.models.Transformer`, validated.

Parameter paths mirror HF names, so the map is: drop the `model.` prefix and turn `layers.N` into
`layers_N`. Every tensor is checked against the module's own parameter shapes, so a wrong or
incomplete checkpoint fails at load time with the offending names, not deep inside a forward.
"""

from __future__ import annotations

import re

import flax
import jax
import jax.numpy as jnp
import numpy as np

from dflax.models.cache import KVCache
from dflax.models.config import ModelConfig
from dflax.models.transformer import Transformer

# Prefixes under which HF wrappers keep the decoder (CausalLM, multimodal Gemma 3).
_PREFIXES = ("model.language_model.", "language_model.model.", "model.")


class CheckpointError(ValueError):
    """A checkpoint's tensors do not fit the model its config describes."""


def _flax_path(name: str) -> tuple[str, ...]:
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix) :]
            break
    name = re.sub(r"^layers\.(\d+)\.", r"layers_\1.", name)
    return tuple(name.split("."))


def param_shapes(params: dict) -> dict[tuple[str, ...], tuple[int, ...]]:
    """Flattened parameter paths -> shapes of a {"params": ...} tree (arrays or ShapeDtypeStructs)."""
    return {path: leaf.shape for path, leaf in flax.traverse_util.flatten_dict(params["params"]).items()}


def abstract_params(module: Transformer) -> dict:
    """The module's parameter tree as ShapeDtypeStructs, without allocating weights."""

    def init():
        cache = KVCache.init(module.config, 1, 1, module.dtype)
        return module.init(
            jax.random.key(0),
            jnp.zeros((1, 1), jnp.int32),
            jnp.zeros((1, 1), jnp.int32),
            cache,
            jnp.ones((1, 1, 1), bool),
            method=lambda m, *args: m.logits(m(*args)[0]),  # also creates the read-out's parameters
        )

    return jax.eval_shape(init)


def expected_param_shapes(config: ModelConfig) -> dict[tuple[str, ...], tuple[int, ...]]:
    """The module's parameter paths and shapes, computed without allocating weights."""
    return param_shapes(abstract_params(Transformer(config)))


def map_tensors(
    expected: dict[tuple[str, ...], tuple[int, ...]],
    tensors: dict[str, np.ndarray],
    dtype: jnp.dtype,
    what: str,
    ignore: tuple[tuple[str, ...], ...] = (),
    on_host: bool = False,
) -> dict:
    """Builds a parameter tree from HF-named tensors, checked against a module's parameter shapes.

    Args:
      expected: parameter path -> shape of the module being loaded.
      tensors: HF name -> array (e.g. `model.layers.0.self_attn.q_proj.weight`).
      dtype: parameter dtype.
      what: the model's name for error messages.
      ignore: parameter paths that may be present in a checkpoint and are dropped.
      on_host: keep the parameters as host numpy arrays (to be placed in shards on a mesh, never whole on
        one device) instead of device arrays.

    Returns:
      {"params": ...}.

    Raises:
      CheckpointError: on missing tensors, unexpected tensors or shape mismatches.
    """
    flat = {}
    unexpected = []
    for name, value in tensors.items():
        path = _flax_path(name)
        if path in ignore:
            continue
        if path not in expected:
            unexpected.append(name)
            continue
        if tuple(value.shape) != expected[path]:
            raise CheckpointError(
                f"tensor {name} has shape {tuple(value.shape)} but the config implies {expected[path]}; "
                "the checkpoint and its config.json disagree"
            )
        flat[path] = np.asarray(value, dtype=dtype) if on_host else jnp.asarray(value, dtype=dtype)
    missing = sorted(".".join(p) for p in expected if p not in flat)
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint does not match a {what}: missing {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}"
            f"{' ...' if len(unexpected) > 8 else ''}"
        )
    return {"params": flax.traverse_util.unflatten_dict(flat)}


def to_params(
    config: ModelConfig, tensors: dict[str, np.ndarray], dtype: jnp.dtype, on_host: bool = False
) -> dict:
    """Builds a target's parameter tree from HF-named tensors (see `map_tensors`)."""
    # Some exports save a tied head twice; the tied model reads the embedding instead.
    ignore = (("lm_head", "weight"),) if config.tie_word_embeddings else ()
    return map_tensors(expected_param_shapes(config), tensors, dtype, f"{config.arch} model", ignore, on_host)
