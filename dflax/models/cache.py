"""The static-shape KV cache: an explicit pytree passed in, returned and donated under jit.

Rolling back is resetting `lengths`; slots at or beyond a row's length are stale and never read.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from dflax.models.config import ModelConfig
from pallas_kernels.shared_prefix import GroupLayout


@struct.dataclass
class SharedPrefix:
    """Prompt prefixes stored once per group of rows (see dflax.decoding.shared_prefix).

    Attributes:
      k: one [G, K, L, H] array per layer: each group's prefix keys, head-major (positions 0 .. L - 1).
      v: one [G, K, L, H] array per layer.
      lengths: [G] int32 valid prefix length per group (slots from there on are never read).
      layout: which rows belong to which group.
      row_offsets: [B] int32 each row's prefix length: its own cache slot j holds position row_offsets + j.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    lengths: jax.Array
    layout: GroupLayout
    row_offsets: jax.Array

    def layer(self, i: int) -> SharedPrefix:
        """The prefix of layer i alone (k and v hold one array each)."""
        return self.replace(k=(self.k[i],), v=(self.v[i],))


@struct.dataclass
class KVCache:
    """Per-layer keys and values with per-row valid lengths.

    Attributes:
      k: one [B, K, S, H] array per layer, head-major (each KV head's slots contiguous, as the kernels
        read them).
      v: one [B, K, S, H] array per layer.
      lengths: [B] int32, number of valid positions per row (the row's own slots).
      shared: prefixes shared by groups of rows, in front of each row's own slots (None: no sharing).
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    lengths: jax.Array
    shared: SharedPrefix | None = None

    @classmethod
    def init(cls, config: ModelConfig, batch: int, max_len: int, dtype: jnp.dtype) -> KVCache:
        """An empty cache of `max_len` slots per row."""
        shape = (batch, config.num_kv_heads, max_len, config.head_dim)
        zeros = tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers))
        return cls(
            k=zeros,
            v=tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers)),
            lengths=jnp.zeros((batch,), jnp.int32),
        )

    @property
    def max_len(self) -> int:
        """Slots per row S."""
        return self.k[0].shape[2]

    @property
    def dtype(self) -> jnp.dtype:
        """dtype its keys and values are stored in (`Target.cache_dtype`)."""
        return self.k[0].dtype

    @property
    def positions(self) -> jax.Array:
        """[B] int32 the absolute position of each row's next token (its shared prefix included)."""
        return self.lengths if self.shared is None else self.shared.row_offsets + self.lengths


def write_rows(buffer: jax.Array, new: jax.Array, starts: jax.Array) -> jax.Array:
    """Writes each row's new entries at its own offset.

    Args:
      buffer: [B, S, ...] cache buffer.
      new: [B, T, ...] entries to write at slots [starts[b], starts[b] + T).
      starts: [B] int32 offsets; the caller guarantees starts + T <= S (the cache is sized with headroom).

    Returns:
      [B, S, ...] updated buffer.
    """
    return jax.vmap(lambda buf, upd, s: jax.lax.dynamic_update_slice_in_dim(buf, upd, s, axis=0))(
        buffer, new.astype(buffer.dtype), starts
    )


def write_kv(buffer: jax.Array, new: jax.Array, starts: jax.Array) -> jax.Array:
    """Writes each row's new keys (or values) at its own offset of a head-major cache buffer.

    Args:
      buffer: [B, K, S, H] cache buffer.
      new: [B, T, K, H] entries (as attention projects them) to write at slots [starts[b], starts[b] + T).
      starts: [B] int32 offsets; the caller guarantees starts + T <= S.

    Returns:
      [B, K, S, H] updated buffer.
    """
    new = jnp.swapaxes(new, 1, 2).astype(buffer.dtype)  # [B, K, T, H]
    return jax.vmap(lambda buf, upd, s: jax.lax.dynamic_update_slice_in_dim(buf, upd, s, axis=1))(
        buffer, new, starts
    )
