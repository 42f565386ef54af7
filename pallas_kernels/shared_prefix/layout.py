"""Which rows share which prefix: the row <-> group maps the two-level attention gathers and scatters by."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@struct.dataclass
class GroupLayout:
    """Rows grouped under shared prefixes, padded to R rows per group.

    Attributes:
      members: [G, R] int32 row indices of each group's rows; B (one past the last row) marks a free place.
      row_slot: [B] int32 each row's place g * R + r in the flattened [G, R] layout; a row in no group
        points at any place (its prefix part is then garbage: only for padding rows whose output is unused).
      row_group: [B] int32 each row's group (0 for rows in no group).
    """

    members: jax.Array
    row_slot: jax.Array
    row_group: jax.Array

    @classmethod
    def of_groups(cls, groups: Sequence[Sequence[int]], batch: int, num_groups: int, group_rows: int):
        """The layout of `groups` (lists of row indices) in a static [num_groups, group_rows] shape.

        Raises:
          ValueError: when the groups do not fit the shape or a row is in two groups.
        """
        if len(groups) > num_groups or any(len(g) > group_rows for g in groups):
            raise ValueError(
                f"{len(groups)} groups of up to {max(map(len, groups), default=0)} rows do not fit "
                f"[{num_groups}, {group_rows}]; give a larger num_groups / group_rows"
            )
        members = np.full((num_groups, group_rows), batch, np.int32)
        row_slot = np.zeros((batch,), np.int32)
        row_group = np.zeros((batch,), np.int32)
        seen = set()
        for g, rows in enumerate(groups):
            for r, row in enumerate(rows):
                if row in seen or not 0 <= row < batch:
                    raise ValueError(f"row {row} is out of range or in two groups")
                seen.add(row)
                members[g, r], row_slot[row], row_group[row] = row, g * group_rows + r, g
        return cls(jnp.asarray(members), jnp.asarray(row_slot), jnp.asarray(row_group))

    @property
    def num_groups(self) -> int:
        """G."""
        return self.members.shape[0]

    @property
    def group_rows(self) -> int:
        """R, the places per group."""
        return self.members.shape[1]
