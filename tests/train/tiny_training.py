"""What the training tests share: the tiny recipe, the tiny target's greedy answers, a data directory."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

import dflax
from dflax.generation import encode_prompt
from dflax.train.dataset import write_shard
from dflax.train.trainer import TrainConfig

# A recipe the tiny target trains in seconds: 2 layers, B=8, 16 anchors of 64-token sequences.
TINY = TrainConfig(
    target="tiny",
    num_layers=2,
    block_size=8,
    anchors_per_seq=16,
    max_seq_len=64,
    batch_size=4,
    logits_chunk=16,
    lr=3e-3,
    warmup_frac=0.05,
    steps=300,
    checkpoint_every=100,
    validate_every=150,
    log_every=25,
    export_dtype="bfloat16",
)


def random_prompts(count: int, seed: int) -> list[str]:
    """`count` prompts of 4-11 random words."""
    rng = np.random.default_rng(seed)
    return [" ".join(f"w{t}" for t in rng.integers(3, 256, rng.integers(4, 12))) for _ in range(count)]


def greedy_sequences(target, prompts: list[str], new_tokens: int = 40) -> list[tuple[np.ndarray, int]]:
    """(ids, prompt_len) per prompt: the prompt + the target's greedy continuation of `new_tokens`."""
    results = dflax.generate(target, prompts, max_new_tokens=new_tokens, temperature=0.0, batch_size=16)
    seqs = []
    for prompt, result in zip(prompts, results):
        ids = encode_prompt(target, prompt)
        seqs.append((np.asarray(ids + result.tokens, np.int32), len(ids)))
    return seqs


def write_data_dir(path: Path, splits: dict[str, list[tuple[np.ndarray, int]]]) -> Path:
    """A data directory as `dflax make-data` leaves it: one shard per split and a manifest listing them."""
    path.mkdir()
    for split, seqs in splits.items():
        keys = [str(i) for i in range(len(seqs))]
        write_shard(path / f"{split}-00000.npz", [(ids.tolist(), p) for ids, p in seqs], keys)
    manifest = {"splits": {split: {"shards": [{"file": f"{split}-00000.npz"}]} for split in splits}}
    (path / "manifest.json").write_text(json.dumps(manifest))
    return path
