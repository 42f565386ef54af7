"""The logical-axis rules on their own (one device): mesh specs, how heads split, which parameters split."""

from __future__ import annotations

import jax
import pytest
from jax.sharding import PartitionSpec as P

from dflax.sharding import HeadLayout, MeshShape, ShardingRules, make_mesh


@pytest.mark.parametrize(
    "heads, expected",
    [
        ((8, 8, 8), (True, True, 1, 1)),  # one query and one KV head per device
        ((32, 8, 4), (True, True, 8, 2)),  # Qwen3-8B on model=4
        ((9, 3, 3), (True, True, 3, 1)),  # SmolLM2 on model=3
        ((4, 2, 4), (True, False, 1, 1)),  # model > KV heads: KV replicated, one read each
        ((32, 8, 16), (True, False, 2, 1)),
        ((9, 3, 4), (False, False, 9, 3)),  # 4 does not divide 9 heads: attention whole
        ((12, 4, 6), (False, False, 12, 4)),  # 2 heads per device would straddle KV groups
        ((8, 2, 1), (False, False, 8, 2)),  # no model axis
    ],
)
def test_head_layout(heads, expected):
    layout = HeadLayout.of(*heads)
    assert (layout.heads_split, layout.kv_split, layout.heads_local, layout.kv_local) == expected


def test_replicated_kv_heads_are_the_ones_each_device_reads():
    layout = HeadLayout.of(32, 8, 16)  # 2 query heads per device, 4 query heads per KV head
    starts = [int(layout.kv_start(jax.numpy.int32(d), 32, 8)) for d in range(16)]
    assert starts == [d // 2 for d in range(16)]  # device d's query heads 2d, 2d + 1 read KV head d // 2


def test_mesh_shape_parse_and_errors():
    assert MeshShape.parse("data=2,model=4") == MeshShape(2, 4)
    assert MeshShape.parse("model=8") == MeshShape(1, 8)
    for bad in ("data=2,data=2", "rows=2", "data=0", "data=x", ""):
        with pytest.raises(ValueError, match="data=D,model=M|at least one device"):
            MeshShape.parse(bad)
    with pytest.raises(ValueError, match="needs 8 devices but 1 are available"):
        make_mesh("data=8")


def test_parameter_rules(tiny_checkpoint):
    import dflax

    target = dflax.load_target(str(tiny_checkpoint("qwen3")[0]))
    rules = ShardingRules(make_mesh("data=1"), frozenset({"batch", "heads", "vocab", "ffn"}))
    specs = jax.tree.map(lambda s: s.spec, rules.param_shardings(target.params))["params"]
    assert specs["embed_tokens"]["weight"] == P("model", None)
    assert specs["layers_0"]["self_attn"]["q_proj"]["weight"] == P("model", None)
    assert specs["layers_0"]["self_attn"]["k_proj"]["weight"] == P(None, None)  # kv_heads not split here
    assert specs["layers_0"]["self_attn"]["o_proj"]["weight"] == P(None, "model")
    assert specs["layers_0"]["mlp"]["down_proj"]["weight"] == P(None, "model")
    assert specs["layers_0"]["input_layernorm"]["weight"] == P()
