"""Starts a DFlash drafter from its target's last layers instead of random weights.

A drafter trained from random weights on this project's CPU budget spends its first hundreds of steps
learning token statistics its target already knows (measured on SmolLM2-135M, 80 steps of the shipped
recipe: validation loss 7.24 from random weights, 6.06 from the target's layers). This initialisation
copies, for a drafter of L layers and a target of N:

- drafter layer i <- target layer N - L + i (attention and MLP projections, both layer norms, and the
  q/k norms of a Qwen3 target; a Llama target has none, so the drafter's keep their unit weights);
- fc <- a selection of the last tapped layer's features (identity on that slice, zero elsewhere), so the
  context starts as that layer's output hidden states;
- hidden_norm <- the input norm of the target layer those hidden states feed (last tap + 1): a copied
  layer then projects the context exactly as the target does;
- norm (the final norm before the shared LM head) <- the target's final norm.

The mask embedding stays random. Only targets whose decoder layer matches the drafter's (Llama / Qwen3
style: no biases, SiLU MLP, plain RMSNorm) can be copied; others get a clear error.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dflax.drafters.dflash import DFlashConfig
from dflax.models.config import ModelConfig

# Target architectures whose decoder layer has the drafter's parameters (up to q/k norms).
COPYABLE_ARCHS = ("llama", "qwen3")

_LAYER_PARTS = (
    ("input_layernorm",),
    ("post_attention_layernorm",),
    ("self_attn", "q_proj"),
    ("self_attn", "k_proj"),
    ("self_attn", "v_proj"),
    ("self_attn", "o_proj"),
    ("mlp", "gate_proj"),
    ("mlp", "up_proj"),
    ("mlp", "down_proj"),
)


def check_copyable(target: ModelConfig, drafter: DFlashConfig) -> None:
    """Raises ValueError with the fix when `drafter` cannot start from `target`'s layers."""
    if target.arch not in COPYABLE_ARCHS or target.attention_bias:
        raise ValueError(
            f"init 'target' copies decoder layers, but a {target.arch!r} target's layers differ from the "
            f"drafter's (copyable: {', '.join(COPYABLE_ARCHS)} without attention bias); use init 'random'"
        )
    if drafter.layers.num_layers > target.num_layers:
        raise ValueError(
            f"init 'target' needs at most {target.num_layers} drafter layers (the target's), "
            f"got {drafter.layers.num_layers}"
        )


def _copy(tree: dict, path: tuple[str, ...], value: jax.Array) -> dict:
    """`tree` with tree[path]["weight"] replaced by `value` in that weight's dtype (a functional update)."""
    head, *rest = path
    if rest:
        return {**tree, head: _copy(tree[head], tuple(rest), value)}
    return {**tree, head: {**tree[head], "weight": jnp.asarray(value, tree[head]["weight"].dtype)}}


def _weight(tree: dict, path: tuple[str, ...]) -> jax.Array:
    """tree[path]["weight"]."""
    for name in path:
        tree = tree[name]
    return tree["weight"]


def init_from_target(params: dict, target_params: dict, target: ModelConfig, drafter: DFlashConfig) -> dict:
    """Drafter parameters started from the target's last layers (see the module docstring).

    Args:
      params: freshly initialised drafter parameters {"params": ...} (supplies the mask embedding and
        the q/k norms).
      target_params: the target's parameters {"params": ...}.
      target: the target's config.
      drafter: the drafter's config.

    Returns:
      New drafter parameters {"params": ...} with the same tree structure, shapes and dtypes, in
      buffers of their own.

    Raises:
      ValueError: when the target's layers cannot be copied (see `check_copyable`).
    """
    check_copyable(target, drafter)
    source = target_params["params"]
    out = params["params"]
    first = target.num_layers - drafter.layers.num_layers
    parts = _LAYER_PARTS + ((("self_attn", "q_norm"), ("self_attn", "k_norm")) if target.qk_norm else ())
    for i in range(drafter.layers.num_layers):
        for part in parts:
            out = _copy(out, (f"layers_{i}", *part), _weight(source[f"layers_{first + i}"], part))

    d = target.hidden_size
    taps = len(drafter.target_layer_ids)
    fc = jnp.zeros((d, taps * d)).at[:, (taps - 1) * d :].set(jnp.eye(d))  # [out D, in K * D]
    out = _copy(out, ("fc",), fc)
    fed = min(drafter.target_layer_ids[-1] + 1, target.num_layers - 1)
    out = _copy(out, ("hidden_norm",), _weight(source, (f"layers_{fed}", "input_layernorm")))
    out = _copy(out, ("norm",), _weight(source, ("norm",)))
    # Own buffers: a training step donates its parameters, which must not alias the target's or each other.
    return jax.tree.map(lambda x: jnp.array(x, copy=True), {"params": out})
