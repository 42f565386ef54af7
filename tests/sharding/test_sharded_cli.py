"""`dflax generate --mesh` end to end: a sharded run (8 fake CPU devices, in its own process) writes the
same results file as a one-device run, token for token; a bad mesh is one clear error."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from eight_devices import fake_devices_env
from typer.testing import CliRunner

from dflax.cli import app
from dflax.train.dataset import write_shard
from dflax.train.trainer import TrainConfig

PROMPTS = [
    {"id": "a", "prompt": "w5 w6 w7"},
    {"id": "b", "prompt": "w9 w10 w11 w12 w13 w14 w15 w16 w17"},
    {"id": "c", "messages": [{"role": "user", "content": "w20 w21"}]},
]


def _tokens(path: Path) -> dict:
    return {r["id"]: r["tokens"] for r in map(json.loads, path.read_text().splitlines())}


def _run_on_8_devices(*args: str, status: int = 0) -> subprocess.CompletedProcess:
    """`python -m dflax ARGS` in a process that sees 8 fake CPU devices, expected to exit with `status`."""
    env = fake_devices_env(8)
    done = subprocess.run([sys.executable, "-m", "dflax", *args], capture_output=True, text=True, env=env)
    assert done.returncode == status, done.stderr[-3000:]
    return done


def test_generate_on_a_mesh_writes_the_one_device_results(tmp_path, tiny_checkpoint):
    target = str(tiny_checkpoint("qwen3-8kv")[0])
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    args = ["generate", "--target", target, "--prompts", str(prompts), "--max-new-tokens", "6"]
    args += ["--batch-size", "3", "--temperature", "1.0", "--seed", "3", "--method", "dflash"]
    args += ["--drafter", "untrained", "--block-size", "4"]
    result = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "one.jsonl")])
    assert result.exit_code == 0, result.output

    done = _run_on_8_devices(*args, "--out", str(tmp_path / "mesh.jsonl"), "--mesh", "data=2,model=4")
    assert "on mesh data=2,model=4" in " ".join(done.stderr.split())
    assert _tokens(tmp_path / "mesh.jsonl") == _tokens(tmp_path / "one.jsonl")


def test_bench_on_a_mesh(tmp_path, tiny_checkpoint):
    """bench --mesh runs plain and DFlash decoding sharded; DFlash equals plain decoding at T=0."""
    prompts, report = tmp_path / "p.jsonl", tmp_path / "bench.json"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    target = str(tiny_checkpoint("qwen3-8kv")[0])
    _run_on_8_devices("bench", "--target", target, "--prompts", str(prompts), "--method", "ar,dflash",
                      "--drafter", "untrained", "--block-size", "4", "--max-new-tokens", "5",
                      "--batch-size", "3", "--mesh", "data=2,model=2", "--json", str(report))  # fmt: skip
    data = json.loads(report.read_text())
    assert data["mesh"] == "data=2,model=2"
    for r in data["results"]:
        assert r["lossless_match"] == 1.0 and r["new_tokens"] > 0 and r["tokens_per_s"] > 0, r


def test_bad_mesh_is_one_clear_error(tiny_checkpoint):
    target = str(tiny_checkpoint("qwen3-8kv")[0])
    for mesh, message in (("data=2,model=4", "needs 8 devices but 1 are available"),
                          ("rows=2", "write it as data=D,model=M")):  # fmt: skip
        result = CliRunner().invoke(app, ["generate", "--target", target, "--mesh", mesh, "w5 w6"])
        assert result.exit_code == 2 and message in " ".join(result.output.split()), result.output


def test_train_on_a_mesh_refuses_an_uneven_batch(tmp_path, tiny_checkpoint):
    """train --mesh trains on the mesh (the sharded steps themselves are test_sharded_training's); a batch
    that data=8 does not divide is one clear error, before anything compiles."""
    rng = np.random.default_rng(0)
    seqs = [(rng.integers(3, 256, 24).tolist(), 6) for _ in range(8)]
    data = tmp_path / "data"
    data.mkdir()
    write_shard(data / "train-00000.npz", seqs, [str(i) for i in range(len(seqs))])
    manifest = {"splits": {"train": {"shards": [{"file": "train-00000.npz"}]}}}
    (data / "manifest.json").write_text(json.dumps(manifest))
    recipe = TrainConfig(target=str(tiny_checkpoint("qwen3-8kv")[0]), num_layers=1, block_size=8,
                         anchors_per_seq=4, max_seq_len=24, batch_size=4, steps=1)  # fmt: skip
    (tmp_path / "recipe.json").write_text(json.dumps(recipe.to_dict()))
    args = ["train", "--config", str(tmp_path / "recipe.json"), "--data", str(data), "--out", str(tmp_path)]
    done = _run_on_8_devices(*args, "--mesh", "data=8", status=2)
    message = " ".join(done.stderr.split())
    assert "batch_size 4 does not split over the mesh's data=8 devices" in message, message
