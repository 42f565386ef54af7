"""Logical-axis rules, in one place: which parameter and cache dimensions are split over which mesh axis.

Arrays name their dimensions by logical axis (`batch`, `heads`, `kv_heads`, `ffn`, `vocab`, `features`);
`LOGICAL_TO_MESH` maps those to the mesh's `data` and `model` axes, and `HeadLayout` decides, per model,
which of them really split: an axis whose size does not divide by the mesh axis stays whole (replicated).
Query heads split over `model` when every device gets whole heads; KV heads split only when `model`
divides them, and are otherwise replicated (each device keeps every KV head and its attention reads the
ones its query heads need), as serving engines do when the tensor-parallel degree exceeds the KV heads.

Training adds FSDP (`ShardingRules.fsdp_shardings`): every matrix of the trained drafter (and its optimizer
moments) also splits its largest dimension not already on `model` over `data`, so each `data` device holds
1 / D of those matrices and their optimizer state; jit gathers a layer's weights where they are used.

Parameter paths are the Flax paths of `dflax.models.Transformer` and `dflax.drafters.DFlashDrafter`, which
mirror HF names: `layers_3/self_attn/q_proj/weight` is [N * H, D] (weights are stored [out, in]).
"""

from __future__ import annotations

import dataclasses
import re

import flax
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dflax.models.config import ModelConfig
from dflax.sharding.mesh import DATA, MODEL, mesh_shape

LOGICAL_TO_MESH = {
    "batch": DATA,  # batch rows
    "heads": MODEL,  # query heads (q_proj rows, o_proj columns)
    "kv_heads": MODEL,  # key/value heads (k_proj / v_proj rows, the KV cache's K axis)
    "ffn": MODEL,  # FFN hidden units (gate/up rows, down columns)
    "vocab": MODEL,  # vocabulary (embedding and LM-head rows, logits)
    "features": MODEL,  # a DFlash drafter's fused target features (fc columns)
}

# Flax parameter path (joined by "/") -> logical axes of its dimensions. Anything unmatched (norms, output
# biases, a learned mask embedding) is replicated.
PARAM_RULES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    (r"(^|/)embed_tokens/weight$", ("vocab", None)),
    (r"(^|/)lm_head/weight$", ("vocab", None)),
    (r"self_attn/q_proj/weight$", ("heads", None)),
    (r"self_attn/q_proj/bias$", ("heads",)),
    (r"self_attn/[kv]_proj/weight$", ("kv_heads", None)),
    (r"self_attn/[kv]_proj/bias$", ("kv_heads",)),
    (r"self_attn/o_proj/weight$", (None, "heads")),
    (r"mlp/(gate|up)_proj/weight$", ("ffn", None)),
    (r"mlp/down_proj/weight$", (None, "ffn")),
    (r"^fc/weight$", (None, "features")),
)


@dataclasses.dataclass(frozen=True)
class HeadLayout:
    """How attention heads split over `model` devices.

    Attributes:
      heads_split: each device holds num_heads / model query heads (whole heads, contiguous).
      kv_split: each device holds num_kv_heads / model KV heads; when False and heads_split, KV heads are
        replicated and each device reads `kv_local` of them starting at kv_start(device).
      kv_local: KV heads each device's attention reads.
      heads_local: query heads each device's attention computes.
    """

    heads_split: bool
    kv_split: bool
    heads_local: int
    kv_local: int

    @classmethod
    def of(cls, num_heads: int, num_kv_heads: int, model: int) -> HeadLayout:
        """The layout of N query / K KV heads over `model` devices."""
        group = num_heads // num_kv_heads  # query heads per KV head
        if model > 1 and num_kv_heads % model == 0:
            return cls(True, True, num_heads // model, num_kv_heads // model)
        per_device = num_heads // model
        aligned = num_heads % model == 0 and (per_device % group == 0 or group % per_device == 0)
        if model > 1 and aligned:
            return cls(True, False, per_device, max(1, per_device // group))
        return cls(False, False, num_heads, num_kv_heads)

    def kv_start(self, device: jax.Array, num_heads: int, num_kv_heads: int) -> jax.Array:
        """The first KV head that `model` device `device` reads (replicated KV heads)."""
        return device * self.heads_local // (num_heads // num_kv_heads)


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """The logical axes that split for one model on one mesh, and the shardings they imply.

    Attributes:
      mesh: the (data, model) mesh.
      split: logical axes that are split over their mesh axis for this model.
    """

    mesh: Mesh
    split: frozenset[str]

    @classmethod
    def for_model(cls, config: ModelConfig, mesh: Mesh) -> ShardingRules:
        """The rules of a target (or a drafter's layers) on `mesh`: an axis splits only where it divides."""
        model = mesh_shape(mesh).model
        layout = HeadLayout.of(config.num_heads, config.num_kv_heads, model)
        sizes = {"ffn": config.intermediate_size, "vocab": config.vocab_size, "features": config.hidden_size}
        split = {"batch"} | {name for name, size in sizes.items() if model > 1 and size % model == 0}
        split |= {"heads"} if layout.heads_split else set()
        split |= {"kv_heads"} if layout.kv_split else set()
        return cls(mesh, frozenset(split))

    def spec(self, logical: tuple[str | None, ...]) -> PartitionSpec:
        """The PartitionSpec of dimensions named by logical axes (None or an unsplit axis: whole)."""
        return PartitionSpec(*(LOGICAL_TO_MESH[a] if a in self.split else None for a in logical))

    def sharding(self, logical: tuple[str | None, ...]) -> NamedSharding:
        """The NamedSharding of dimensions named by logical axes."""
        return NamedSharding(self.mesh, self.spec(logical))

    def replicated(self) -> NamedSharding:
        """Whole on every device."""
        return NamedSharding(self.mesh, PartitionSpec())

    def rows(self) -> NamedSharding:
        """Split by batch row (the leading dimension)."""
        return self.sharding(("batch",))

    def param_shardings(self, params: dict) -> dict:
        """NamedShardings for a {"params": ...} tree (arrays or ShapeDtypeStructs), by PARAM_RULES."""
        flat = flax.traverse_util.flatten_dict(params["params"])
        out = {}
        for path, leaf in flat.items():
            name = "/".join(path)
            logical = next((axes for pattern, axes in PARAM_RULES if re.search(pattern, name)), ())
            if len(logical) not in (0, len(leaf.shape)):
                raise ValueError(f"sharding rule of {name} names {len(logical)} axes of a {leaf.shape} array")
            out[path] = self.sharding(logical) if logical else self.replicated()
        return {"params": flax.traverse_util.unflatten_dict(out)}

    def fsdp_shardings(self, params: dict) -> dict:
        """NamedShardings for a trained {"params": ...} tree: `param_shardings`, and in every matrix (2 or
        more dimensions) the largest dimension not on `model` that `data` divides also split over `data`
        (FSDP; the first such dimension on a tie). Vectors (norms, biases) stay whole on every device."""
        data = mesh_shape(self.mesh).data
        flat = flax.traverse_util.flatten_dict(params["params"])
        tensor_parallel = flax.traverse_util.flatten_dict(self.param_shardings(params)["params"])
        out = {}
        for path, leaf in flat.items():
            spec = list(tensor_parallel[path].spec)
            spec += [None] * (len(leaf.shape) - len(spec))
            free = [d for d, axis in enumerate(spec) if axis is None and leaf.shape[d] % data == 0]
            if data > 1 and len(leaf.shape) >= 2 and free:
                spec[max(free, key=lambda d: (leaf.shape[d], -d))] = DATA
            out[path] = NamedSharding(self.mesh, PartitionSpec(*spec))
        return {"params": flax.traverse_util.unflatten_dict(out)}

    def cache_sharding(self, num_kv_heads: int) -> NamedSharding:
        """The sharding of one head-major [B, K, S, H] KV-cache buffer of K = num_kv_heads heads: split by
        row, and by KV head where `model` divides them (the same test as `HeadLayout.kv_split`)."""
        model = mesh_shape(self.mesh).model
        kv_split = model > 1 and num_kv_heads % model == 0
        return NamedSharding(self.mesh, PartitionSpec(DATA, MODEL if kv_split else None, None, None))

    def state_shardings(self, state, replicated_fields: tuple[str, ...] = ("eos_ids",)):
        """NamedShardings for a decode-loop state pytree: 4-d buffers are KV caches, `replicated_fields`
        and scalars are whole, every other array is split by row."""

        def leaf_sharding(path, leaf):
            names = {getattr(k, "name", None) for k in path}
            if len(leaf.shape) == 0 or names & set(replicated_fields):
                return self.replicated()
            return self.cache_sharding(leaf.shape[1]) if len(leaf.shape) == 4 else self.rows()

        return jax.tree_util.tree_map_with_path(leaf_sharding, state)
