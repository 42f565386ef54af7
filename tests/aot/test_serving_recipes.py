"""The serving recipes in configs/serving agree with themselves: the mesh fits the hardware's devices,
the batch splits over `data`, the `plan` and `generate` commands use the recipe's own settings, the cache
length is dflax's for that prompt bucket and budget, and the printed peak fits the chip's memory."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from dflax.aot.chips import chip_of
from dflax.runtime.shapes import cache_slots
from dflax.sharding import MeshShape

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "configs/serving").glob("*.json"))


class _Drafts:
    """What cache_slots reads of a proposer: the drafts per step (B - 1)."""

    def __init__(self, block_size: int):
        self.num_draft = block_size - 1


def _flags(command: str) -> dict:
    words = shlex.split(command)
    return {w: words[i + 1] for i, w in enumerate(words[:-1]) if w.startswith("--")}


def test_there_is_a_recipe_per_target_and_hardware():
    names = {p.stem for p in RECIPES}
    assert names == {f"{m}-{h}" for m in ("qwen3-8b", "llama-3.1-8b") for h in ("v5e-8", "v5p-8", "8xh100")}


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_recipe_is_consistent(path):
    recipe = json.loads(path.read_text())
    mesh = MeshShape.parse(recipe["mesh"])
    assert mesh.devices == recipe["devices"] and recipe["batch"] % mesh.data == 0
    assert (ROOT / recipe["target"] / "config.json").is_file()
    assert recipe["drafter"] == "untrained" or (ROOT / recipe["drafter"] / "config.json").is_file()
    slots = cache_slots(recipe["prompt_len"], recipe["max_new_tokens"], _Drafts(recipe["block_size"]))
    assert recipe["cache_length"] == slots

    plan = _flags(recipe["plan"])
    assert recipe["plan"].startswith("dflax plan ") and path.stem.startswith(plan["--model"] + "-")
    settings = ("mesh", "platform", "devices", "batch", "prompt_len", "max_new_tokens", "block_size")
    expected = {"--" + name.replace("_", "-"): str(recipe[name]) for name in settings}
    assert {k: plan.get(k) for k in expected} == expected
    generate = _flags(recipe["generate"])
    assert generate["--mesh"] == recipe["mesh"] and generate["--batch-size"] == str(recipe["batch"])
    assert generate["--dtype"] == recipe["dtype"] and generate["--block-size"] == str(recipe["block_size"])

    printed = recipe["plan_per_device_mib"]
    if printed is not None:
        chip = chip_of(recipe["platform"], plan.get("--topology", "v5e:2x4"), "h100")
        assert printed["peak"] * 2**20 < chip.memory_bytes
        assert printed["params"] + printed["cache"] <= printed["peak"]
