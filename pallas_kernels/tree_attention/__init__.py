"""Prefix + tree attention for speculative verification: jnp reference, chunked jnp (CPU), TPU and GPU
Pallas kernels.

`tree_attention` is the one entry point; `backend` picks the implementation.
"""

from pallas_kernels.tree_attention.chunked import tree_attention_chunked
from pallas_kernels.tree_attention.gpu import BlockSizes as GpuBlockSizes
from pallas_kernels.tree_attention.gpu import tree_attention_gpu
from pallas_kernels.tree_attention.ops import BACKENDS, resolve_backend, tree_attention
from pallas_kernels.tree_attention.reference import tree_attention_reference
from pallas_kernels.tree_attention.tpu import BlockSizes as TpuBlockSizes
from pallas_kernels.tree_attention.tpu import tree_attention_tpu

__all__ = [
    # Public op and its backends.
    "tree_attention",
    "BACKENDS",
    "resolve_backend",
    # Implementations (same signature as `tree_attention` minus `backend`).
    "tree_attention_reference",
    "tree_attention_chunked",
    "tree_attention_tpu",
    "tree_attention_gpu",
    # Tile sizes.
    "TpuBlockSizes",
    "GpuBlockSizes",
]
