"""The static-shape KV cache: an explicit pytree passed in, returned and donated under jit.

Rolling back is resetting `lengths`; slots at or beyond a row's length are stale and never read.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from dflax.models.config import ModelConfig


@struct.dataclass
class KVCache:
    """Per-layer keys and values with per-row valid lengths.

    Attributes:
      k: one [B, S, K, H] array per layer.
      v: one [B, S, K, H] array per layer.
      lengths: [B] int32, number of valid positions per row.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    lengths: jax.Array

    @classmethod
    def init(cls, config: ModelConfig, batch: int, max_len: int, dtype: jnp.dtype) -> KVCache:
        """An empty cache of `max_len` slots per row."""
        shape = (batch, max_len, config.num_kv_heads, config.head_dim)
        zeros = tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers))
        return cls(
            k=zeros,
            v=tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers)),
            lengths=jnp.zeros((batch,), jnp.int32),
        )

    @property
    def max_len(self) -> int:
        """Slots per row S."""
        return self.k[0].shape[1]


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
