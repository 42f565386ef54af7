"""The target-feature cache of a training run: one memory-mapped bf16 .npy per split, filled once.

The drafter's context features (the target's hidden states after its tapped layers, concatenated) do not
change while the drafter trains, so each sequence's are computed by one frozen target forward and read
back every epoch (see `dflax.train.trainer` for the measurement behind this choice). bf16 values are
stored as uint16 bits so the file is a plain .npy; a `.json` beside it records what it holds and how
many sequences are done, so an interrupted fill resumes and a cache of other data is rebuilt.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
from rich.progress import Progress

from dflax.target import Target
from dflax.train.dataset import write_atomically


def features_key(tokens: np.ndarray, target: Target, taps: tuple[int, ...]) -> str:
    """Identifies a cache's contents: the padded sequences [N, S], the target, its dtype and tapped layers."""
    digest = hashlib.sha256(np.ascontiguousarray(tokens).tobytes())
    digest.update(json.dumps([target.name, list(taps), np.dtype(target.dtype).name]).encode())
    return digest.hexdigest()


def _write_json(path: Path, data: dict) -> None:
    write_atomically(path, lambda f: f.write(json.dumps(data).encode()))


def cache_features(
    path: Path,
    tokens: np.ndarray,
    *,
    target: Target,
    taps: tuple[int, ...],
    compute: Callable,
    batch_size: int,
    progress: Progress,
    should_stop: Callable[[], bool],
) -> np.ndarray | None:
    """The target features of padded sequences, computed once into `path`.

    Args:
      path: the .npy file (its record is `path` with suffix .json).
      tokens: [N, S] int32 padded sequences (features are causal: padding never reaches real tokens).
      target: the target whose parameters `compute` runs.
      taps: the tapped layers (K of them).
      compute: (target_params, tokens [batch_size, S]) -> [batch_size, S, K * D] bf16 features.
      batch_size: sequences per forward.
      progress: where the fill shows its progress.
      should_stop: polled between batches; True ends the fill early (it resumes next time).

    Returns:
      [N, S, K * D] uint16 (bf16 bits) read-only memmap, or None when the fill was stopped.
    """
    num_seqs = tokens.shape[0]
    record_path = path.with_suffix(".json")
    key = features_key(tokens, target, taps)
    record = json.loads(record_path.read_text()) if record_path.exists() else {}
    shape = (num_seqs, tokens.shape[1], len(taps) * target.config.hidden_size)
    if record.get("key") != key or not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        np.lib.format.open_memmap(path, "w+", np.uint16, shape)
        record = {"key": key, "done": 0}
        _write_json(record_path, record)
    done = record["done"]
    if done < num_seqs:
        features = np.load(path, mmap_mode="r+")
        size = f"{path.name}, {np.prod(shape) * 2 / 1e9:.2f} GB"
        task = progress.add_task("caching target features", total=num_seqs, completed=done, info=size)
        while done < num_seqs and not should_stop():
            count = min(batch_size, num_seqs - done)
            rows = np.minimum(
                np.arange(done, done + batch_size), num_seqs - 1
            )  # the last batch repeats a row
            features[done : done + count] = np.asarray(compute(target.params, tokens[rows]))[:count].view(
                np.uint16
            )
            features.flush()
            done += count
            _write_json(record_path, {"key": key, "done": done})
            progress.update(task, completed=done)
        del features
        progress.remove_task(task)
    return np.load(path, mmap_mode="r") if done == num_seqs else None
