"""Packed prompts: the real tokens of a right-padded batch, back to back, so per-token work skips padding.

A batch of chat prompts is padded to its longest prompt (then to a bucket): 64 MT-Bench prompts hold
7,045 tokens in a [64, 512] bucket, so a prefill that runs every slot through the projections and the MLP
does 4.7 times the useful work. Everything in a transformer layer except attention works token by token,
so those parts run on the packed tokens [L] and only attention sees the padded [B, T] layout (where the
cache lives and rows stay apart): the layer unpacks q/k/v before attention and packs its output after.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class Packing:
    """Where each of L packed tokens sits in a right-padded [batch, length] layout.

    Attributes:
      index: [L] int32 flat position b * length + t of each packed token; batch * length (one past the
        end) for the unused tail of the pack.
      segment_ids: [L] int32 row b of each packed token; -1 for the unused tail.
      batch: B of the padded layout (static).
      length: T of the padded layout (static).
    """

    index: jax.Array
    segment_ids: jax.Array
    batch: int = struct.field(pytree_node=False)
    length: int = struct.field(pytree_node=False)

    @classmethod
    def of_lengths(cls, lengths: jax.Array, length: int, size: int) -> Packing:
        """The packing of rows holding lengths [B] real tokens each (sum(lengths) <= size) into `size`."""
        lengths = lengths.astype(jnp.int32)
        ends = jnp.cumsum(lengths)  # [B]
        j = jnp.arange(size, dtype=jnp.int32)  # [L]
        row = jnp.minimum(jnp.searchsorted(ends, j, side="right"), lengths.shape[0] - 1).astype(jnp.int32)
        col = j - (ends - lengths)[row]
        used = j < ends[-1]
        index = jnp.where(used, row * length + col, lengths.shape[0] * length)
        return cls(index=index, segment_ids=jnp.where(used, row, -1), batch=lengths.shape[0], length=length)

    @property
    def size(self) -> int:
        """L, the packed tokens (real ones first, then an unused tail)."""
        return self.index.shape[0]

    def pack(self, x: jax.Array) -> jax.Array:
        """[B, T, ...] -> [L, ...]; the unused tail is zero."""
        flat = x.reshape(self.batch * self.length, *x.shape[2:])
        return jnp.take(flat, self.index, axis=0, mode="fill", fill_value=0)

    def unpack(self, x: jax.Array) -> jax.Array:
        """[L, ...] -> [B, T, ...]; padding positions are zero."""
        flat = jnp.zeros((self.batch * self.length, *x.shape[1:]), x.dtype)
        flat = flat.at[self.index].set(x, mode="drop")
        return flat.reshape(self.batch, self.length, *x.shape[1:])
