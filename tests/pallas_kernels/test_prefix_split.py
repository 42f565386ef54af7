"""The jnp level 1 split over the prefix length (FlashDecoding-style, merged by log-sum-exp) against the
float64 oracle.

Parts that hold none of a group's valid slots (a 12-slot prefix split in 6 parts of 8), a group without a
prefix, and NaN in unread prefix slots all occur in the decode case.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from test_shared_prefix_attention import CASES, TOL, make_case, run_reference

from pallas_kernels.shared_prefix import GroupLayout, shared_prefix_attention


@pytest.mark.parametrize("splits", [2, 3, 6])
@pytest.mark.parametrize("case", [CASES[1], CASES[2]], ids=["decode-ragged-groups", "verify-chain"])
def test_split_prefix_equals_per_row_attention(case, splits):
    groups, prefix_lens, cache_lens, t, heads, kv_heads, mask = case
    inputs = make_case(6, groups, prefix_lens, cache_lens, t, heads, kv_heads, mask)  # 48 prefix slots
    layout = GroupLayout.of_groups(groups, len(cache_lens), num_groups=len(groups), group_rows=4)
    args = {k: jnp.asarray(v) for k, v in inputs.items()}
    got = shared_prefix_attention(
        args["q"], args["prefix_k"], args["prefix_v"], args["prefix_len"], layout, args["k_cache"],
        args["v_cache"], args["cache_len"], args["k_new"], args["v_new"], args["new_mask"],
        sm_scale=0.3, causal=True, prefix_splits=splits,
    )  # fmt: skip
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(np.asarray(got), run_reference(inputs, np.asarray(layout.row_group)), **TOL)


def test_a_split_must_divide_the_prefix():
    groups, prefix_lens, cache_lens, t, heads, kv_heads, mask = CASES[0]
    case = make_case(6, groups, prefix_lens, cache_lens, t, heads, kv_heads, mask)
    args = {k: jnp.asarray(v) for k, v in case.items()}
    layout = GroupLayout.of_groups(groups, len(cache_lens), num_groups=1, group_rows=4)
    with pytest.raises(ValueError, match="must divide the prefix slots 48"):
        shared_prefix_attention(
            args["q"], args["prefix_k"], args["prefix_v"], args["prefix_len"], layout, args["k_cache"],
            args["v_cache"], args["cache_len"], args["k_new"], args["v_new"], args["new_mask"],
            sm_scale=0.3, prefix_splits=5,
        )  # fmt: skip
