"""Two-level attention over a prefix shared by a group of rows plus each row's own cache (FlashForge-style).

`shared_prefix_attention` is the jnp path used in generation (any platform); `shared_prefix_reference` is
its float64 oracle; `GroupLayout` says which rows share which prefix.
"""

from pallas_kernels.shared_prefix.chunked import shared_prefix_attention
from pallas_kernels.shared_prefix.layout import GroupLayout
from pallas_kernels.shared_prefix.reference import shared_prefix_reference

__all__ = ["shared_prefix_attention", "shared_prefix_reference", "GroupLayout"]
