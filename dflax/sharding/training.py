"""Drafter training on a (data, model) mesh: the drafter's parameters and optimizer state sharded over
`data` as FSDP (and over `model` like the target's layers), batches split by row over `data`.

The train step is the single-device one. Its inputs arrive as NamedSharding arrays, jit's propagation
(GSPMD) partitions the computation (gathering each FSDP-split weight where it is used and reduce-scattering
its gradient), and one sharding constraint on the new state keeps parameters and optimizer moments split
rather than wherever propagation would leave them. The frozen target keeps the placement `load_target(...,
mesh=)` gave it: whole on every device, or split over `model`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax
import jax
from jax.sharding import Mesh, NamedSharding

from dflax.models.config import ModelConfig
from dflax.sharding.mesh import mesh_shape
from dflax.sharding.rules import ShardingRules


@dataclasses.dataclass(frozen=True)
class TrainingSharding:
    """Where a drafter's training state and batches live on a mesh.

    Attributes:
      rules: the logical-axis rules of the drafter's layers on the mesh.
    """

    rules: ShardingRules

    @classmethod
    def for_drafter(cls, layers: ModelConfig, mesh: Mesh) -> TrainingSharding:
        """The placement for a drafter whose decoder layers have config `layers`."""
        return cls(ShardingRules.for_model(layers, mesh))

    @property
    def mesh(self) -> Mesh:
        """The (data, model) mesh."""
        return self.rules.mesh

    def check_batch(self, batch_size: int) -> None:
        """Raises ValueError, with the fix, when sequences per step do not split evenly over `data`."""
        data = mesh_shape(self.mesh).data
        if batch_size % data:
            raise ValueError(
                f"training batch_size {batch_size} does not split over the mesh's data={data} devices; "
                f"use a batch_size that is a multiple of {data} or a smaller data axis"
            )

    def state_shardings(self, state: Any) -> Any:
        """NamedShardings for a TrainState-like pytree (arrays or ShapeDtypeStructs): `params` by the FSDP
        rules, every optimizer leaf that mirrors a parameter (Adam's moments) like that parameter, the rest
        (step counts, the PRNG key) whole on every device."""
        params = self.rules.fsdp_shardings(state.params)
        by_path = flax.traverse_util.flatten_dict(params["params"])
        replicated = self.rules.replicated()

        def leaf_sharding(path, leaf) -> NamedSharding:
            names = [getattr(k, "key", None) for k in path]
            if "params" in names:
                found = by_path.get(tuple(names[names.index("params") + 1 :]))
                if found is not None and len(found.spec) <= len(leaf.shape):
                    return found
            return replicated

        return jax.tree_util.tree_map_with_path(leaf_sharding, state)

    def place_state(self, state: Any) -> Any:
        """The state moved into its shards."""
        return jax.device_put(state, self.state_shardings(state))

    def constrain_state(self, state: Any) -> Any:
        """Inside jit: the state held to its shardings."""
        return jax.lax.with_sharding_constraint(state, self.state_shardings(state))

    def place_batch(self, batch: dict) -> dict:
        """A batch of host arrays ([N, ...] each) split by row over `data`."""
        return jax.device_put(batch, self.rules.rows())

    def abstract_state(self, state: Any) -> Any:
        """ShapeDtypeStructs carrying the state's shardings (what orbax restores a checkpoint onto)."""
        shardings = self.state_shardings(state)
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)
