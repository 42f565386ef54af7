"""The target-feature cache of a training run: one memory-mapped bf16 .npy per split, filled once.

The drafter's context features (the target's hidden states after its tapped layers, concatenated) do not
change while the drafter trains, so each sequence's are computed by one frozen target forward and read
back every epoch (see `dflax.train.trainer` for the measurement behind this choice). Only real tokens are
stored, back to back ([T, K * D] for T tokens in all), as uint16 bits of bf16 so the file is a plain .npy.
A `.json` beside it records what it holds and how many sequences are done, so an interrupted fill resumes
and a cache of other data is rebuilt.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from rich.progress import Progress

from dflax.target import Target
from dflax.train.dataset import write_atomically


@dataclasses.dataclass(frozen=True)
class FeatureCache:
    """Cached features of N sequences.

    Attributes:
      features: [T, K * D] uint16 (bf16 bits) read-only memmap; sequence i is rows offsets[i]:offsets[i + 1].
      offsets: [N + 1] int64.
    """

    features: np.ndarray
    offsets: np.ndarray

    def batch(self, rows: np.ndarray, max_len: int) -> np.ndarray:
        """Features of sequences `rows` padded to `max_len`.

        Args:
          rows: [B] sequence numbers; -1 is a padding row (all zero).
          max_len: S.

        Returns:
          [B, S, K * D] bf16, zero past each sequence's end.
        """
        out = np.zeros((len(rows), max_len, self.features.shape[1]), np.uint16)
        for i, r in enumerate(rows):
            if r >= 0:
                start, end = self.offsets[r], self.offsets[r + 1]
                out[i, : end - start] = self.features[start:end]
        return out.view(jnp.bfloat16)


def features_key(tokens: np.ndarray, lengths: np.ndarray, target: Target, taps: tuple[int, ...]) -> str:
    """Identifies a cache's contents: the sequences, the target, its dtype and its tapped layers."""
    digest = hashlib.sha256(np.ascontiguousarray(tokens).tobytes())
    digest.update(np.ascontiguousarray(lengths).tobytes())
    digest.update(json.dumps([target.name, list(taps), np.dtype(target.dtype).name]).encode())
    return digest.hexdigest()


def _write_json(path: Path, data: dict) -> None:
    write_atomically(path, lambda f: f.write(json.dumps(data).encode()))


def cache_features(
    path: Path,
    tokens: np.ndarray,
    lengths: np.ndarray,
    *,
    target: Target,
    taps: tuple[int, ...],
    compute: Callable,
    batch_size: int,
    progress: Progress,
    should_stop: Callable[[], bool],
) -> FeatureCache | None:
    """The target features of padded sequences, computed once into `path`.

    Args:
      path: the .npy file (its record is `path` with suffix .json).
      tokens: [N, S] int32 padded sequences (features are causal: padding never reaches real tokens).
      lengths: [N] their real lengths.
      target: the target whose parameters `compute` runs.
      taps: the tapped layers (K of them).
      compute: (target_params, tokens [batch_size, S]) -> [batch_size, S, K * D] bf16 features.
      batch_size: sequences per forward.
      progress: where the fill shows its progress.
      should_stop: polled between batches; True ends the fill early (it resumes next time).

    Returns:
      The FeatureCache, or None when the fill was stopped.
    """
    num_seqs = tokens.shape[0]
    offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    record_path = path.with_suffix(".json")
    key = features_key(tokens, lengths, target, taps)
    record = json.loads(record_path.read_text()) if record_path.exists() else {}
    shape = (int(offsets[-1]), len(taps) * target.config.hidden_size)
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
            out = np.asarray(compute(target.params, tokens[rows])).view(np.uint16)  # [batch, S, K * D]
            real = [out[i, : lengths[done + i]] for i in range(count)]
            features[offsets[done] : offsets[done + count]] = np.concatenate(real)
            features.flush()
            done += count
            _write_json(record_path, {"key": key, "done": done})
            progress.update(task, completed=done)
        del features
        progress.remove_task(task)
    return FeatureCache(np.load(path, mmap_mode="r"), offsets) if done == num_seqs else None
