"""Pallas kernels of dflax, one folder per op: a jnp reference, a TPU (Mosaic) and a GPU (Triton) kernel."""

from pallas_kernels.tree_attention import (
    GpuBlockSizes,
    TpuBlockSizes,
    tree_attention,
    tree_attention_reference,
)

__all__ = ["tree_attention", "tree_attention_reference", "TpuBlockSizes", "GpuBlockSizes"]
