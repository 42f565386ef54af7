"""`dflax bench --method official` and `dflax.reference.compare` on a tiny target: the reference DFlash runs
beside dflax with the same drafter, and refuses what it cannot run with one clear error."""

from __future__ import annotations

import json

import pytest

import dflax
from dflax.bench import run_bench
from dflax.drafters import load_drafter
from dflax.drafters.checkpoint import save_drafter
from dflax.drafters.dflash import DFlashConfig, DFlashDrafter, init_drafter_params
from dflax.reference import compare


@pytest.fixture(scope="module")
def setup(tiny_checkpoint, tmp_path_factory):
    """(tiny target directory, an official-format drafter directory for it, a JSONL prompt file)."""
    path, _ = tiny_checkpoint("qwen3")
    target = dflax.load_target(str(path))
    out = tmp_path_factory.mktemp("reference")
    config = DFlashConfig.for_target(target.config, num_layers=2, block_size=4, mask_token_id=3)
    params = init_drafter_params(DFlashDrafter(config), seed=0)
    save_drafter(out / "drafter", config, params, target.config.num_layers)
    prompts = out / "p.jsonl"
    prompts.write_text(
        "".join(json.dumps({"id": i, "prompt": f"w{5 + i} w{9 + i} w7 w{20 + i}"}) + "\n" for i in range(3))
    )
    return path, out / "drafter", prompts


def test_official_rows_beside_dflax(setup):
    path, drafter, prompts = setup
    report = run_bench(
        prompts=str(prompts),
        target=str(path),
        methods=["ar", "dflash", "official"],
        limit=3,
        max_new_tokens=10,
        temperature=0.0,
        batch_size=1,
        seed=0,
        drafter=str(drafter),
        block_sizes=[4],
    )
    rows = {r["method"]: r for r in report["results"]}
    official = rows["official"]
    assert official["lossless_match"] == 1.0 and official["block_size"] == 4
    assert official["tau"] == pytest.approx(rows["dflash"]["tau"])  # the same drafts, the same steps
    assert official["tokens_per_s"] > 0 and "projected_speedup" not in official


def test_official_needs_batch_1_and_an_official_drafter(setup, tmp_path):
    path, drafter, prompts = setup
    target = dflax.load_target(str(path))
    learned_mask = DFlashConfig.for_target(target.config, num_layers=1, block_size=4)
    params = init_drafter_params(DFlashDrafter(learned_mask), seed=0)
    save_drafter(tmp_path, learned_mask, params, target.config.num_layers)
    common = dict(prompts=str(prompts), target=str(path), limit=1, max_new_tokens=4, temperature=0.0, seed=0)
    with pytest.raises(ValueError, match="one prompt at a time"):
        run_bench(methods=["official"], batch_size=2, drafter=str(drafter), **common)
    with pytest.raises(ValueError, match="learned mask embedding"):
        run_bench(methods=["official"], batch_size=1, drafter=str(tmp_path), **common)


def test_compare_agrees_step_by_step(setup):
    path, drafter, _ = setup
    target = dflax.load_target(str(path))
    spec = load_drafter(str(drafter), target)
    ids = [[5, 9, 7, 20], [6, 10, 7], [30, 31, 32, 33, 34, 35]]
    for a in compare(target, spec, ids, max_new_tokens=12):
        assert a.same_tokens and a.same_commits and a.compared_steps >= 1, a
