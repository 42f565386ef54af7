"""Worker of the sharded-training test, run in its own process with 8 fake CPU devices.

It trains one tiny DFlash drafter four ways on the same sequences and prints one JSON object:
  unsharded: steps 1-2 (stopped by SIGTERM, checkpointed), then resumed to step 4;
  sharded: steps 1-2 on `first_mesh` (checkpointed there), then resumed from that checkpoint on
    `second_mesh` to step 4;
the per-step losses and the parameters after steps 2 and 4 of both, and how the compiled train step of each
mesh receives the drafter's parameters and Adam moments (shard shapes read from the executable).

Usage: python sharded_training_run.py '{"target": DIR, "out": DIR, "first_mesh": ..., "second_mesh": ...}'
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import jax
import numpy as np
from rich.console import Console

import dflax
from dflax.train.batches import batch_index, pad_sequences
from dflax.train.config import TrainConfig
from dflax.train.steps import programs_for
from dflax.train.trainer import _initial_state, train

QUIET = Console(quiet=True)
CONFIG = TrainConfig(
    target="tiny",
    num_layers=2,
    block_size=4,
    gamma=4.0,
    anchors_per_seq=4,
    max_seq_len=32,
    batch_size=8,
    logits_chunk=16,
    lr=3e-3,
    warmup_frac=0.25,
    steps=4,
    checkpoint_every=100,
    validate_every=100,
    log_every=1,
)
STOP_AT = 2


def sequences() -> list[tuple[np.ndarray, int]]:
    """24 random (ids, prompt_len) sequences of 16-32 tokens."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(24):
        ids = rng.integers(3, 256, rng.integers(16, 33)).astype(np.int32)
        out.append((ids, int(rng.integers(4, 10))))
    return out


def stop_at(step: int) -> None:
    if step == STOP_AT:
        os.kill(os.getpid(), signal.SIGTERM)


def flat(params) -> dict:
    """Parameter path -> nested lists (host values)."""
    leaves = jax.tree_util.tree_flatten_with_path(jax.device_get(params))[0]
    return {"/".join(str(k.key) for k in path[1:]): np.asarray(v).tolist() for path, v in leaves}


def losses(run: Path) -> dict:
    """step -> training loss, from the run's metrics.jsonl."""
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return {str(e["step"]): e["loss"] for e in map(json.loads, lines) if "loss" in e}


def compiled_state_shards(target, seqs) -> dict:
    """Maps "params:<path>" and "mu:<path>" to [shard shape, full shape] as the compiled train step of the
    target's mesh receives them (the executable's input shardings)."""
    dflash = CONFIG.drafter_config(target)
    programs = programs_for(dflash, target.module, CONFIG, CONFIG.steps, None, target.mesh)
    initial = _initial_state(programs.module, programs.tx, CONFIG, target, None, QUIET)
    state = programs.sharding.place_state(initial)
    data = pad_sequences(seqs, CONFIG.max_seq_len)
    width = len(dflash.target_layer_ids) * target.config.hidden_size
    batch = data.take(batch_index(len(data), CONFIG.batch_size, CONFIG.seed, 0), _NoFeatures(width))
    compiled = programs.train_step.lower(state, target.params, programs.sharding.place_batch(batch)).compile()
    state_in = compiled.input_shardings[0][0]
    out = {}
    adam = state.opt_state[1][0]  # chain(clip, adamw): adamw's first part is scale_by_adam
    adam_in = state_in.opt_state[1][0]
    for name, tree, shardings in (("params", state.params, state_in.params), ("mu", adam.mu, adam_in.mu)):
        leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
        for (path, leaf), sharding in zip(leaves, jax.tree.leaves(shardings)):
            key = name + ":" + "/".join(str(k.key) for k in path[1:])
            out[key] = [list(sharding.shard_shape(leaf.shape)), list(leaf.shape)]
    return out


class _NoFeatures:
    """Zero features for lowering the step (only shapes matter)."""

    def __init__(self, width: int):
        self.width = width

    def batch(self, rows, max_len):
        return np.zeros((len(rows), max_len, self.width), dtype=jax.numpy.bfloat16)


def two_legs(target_first, target_second, seqs, run: Path) -> dict:
    """Steps 1-2 with the first target (stopped by SIGTERM), steps 3-4 resumed with the second."""
    part = train(CONFIG, target_first, seqs[:16], seqs[16:], run, console=QUIET, on_step=stop_at)
    assert part.step == STOP_AT and part.interrupted == signal.SIGTERM, part
    done = train(CONFIG, target_second, seqs[:16], seqs[16:], run, console=QUIET)
    assert done.step == CONFIG.steps and done.interrupted is None
    assert done.log[0]["step"] == STOP_AT + 1  # resumed from the checkpoint, not started over
    return {"params_2": flat(part.params), "params_4": flat(done.params), "losses": losses(run)}


def main(spec: dict) -> dict:
    out, seqs = Path(spec["out"]), sequences()
    single = dflax.load_target(spec["target"])
    first = dflax.load_target(spec["target"], mesh=spec["first_mesh"])
    second = dflax.load_target(spec["target"], mesh=spec["second_mesh"])
    return {
        "devices": jax.device_count(),
        "unsharded": two_legs(single, single, seqs, out / "unsharded"),
        "sharded": two_legs(first, second, seqs, out / "sharded"),
        "shards": {
            spec["first_mesh"]: compiled_state_shards(first, seqs),
            spec["second_mesh"]: compiled_state_shards(second, seqs),
        },
    }


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
