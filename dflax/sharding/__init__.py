"""Sharding: a (data, model) device mesh and the logical-axis rules that place parameters, caches and batch
rows on it. The same jitted prefill and decode loop run on one device or many (see dflax.sharding.placement).
"""

from dflax.sharding.mesh import DATA, MESH_AXES, MODEL, MeshShape, make_mesh, mesh_shape
from dflax.sharding.rules import LOGICAL_TO_MESH, PARAM_RULES, HeadLayout, ShardingRules

__all__ = [
    "DATA",
    "MODEL",
    "MESH_AXES",
    "MeshShape",
    "make_mesh",
    "mesh_shape",
    "LOGICAL_TO_MESH",
    "PARAM_RULES",
    "HeadLayout",
    "ShardingRules",
]
