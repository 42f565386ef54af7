"""The target-feature cache of a training run: one memory-mapped bf16 .npy per split, filled once.

The drafter's context features (the target's hidden states after its tapped layers, concatenated) do not
change while the drafter trains, so each sequence's are computed by one frozen target forward and read
back every epoch (see `dflax.train.trainer` for the measurement behind this choice). The forward is the
target's prefill (an empty cache, the sequences' real tokens packed back to back:
`objective.target_features`), which returns exactly what is stored: only real tokens, back to back
([T, K * D] for T tokens in all), as uint16 bits of bf16 so the file is a plain .npy. A `.json` beside it
records what it holds (a digest of each sequence, the tapped layers, a fingerprint of the target's
weights and the precision of its forward) and how many sequences are done, so an interrupted fill
resumes, a cache of other weights or precision is rebuilt, and a cache whose first sequences are the new
data's first sequences keeps them: data grows by appending shards, so a retrain on more data computes only
the new sequences' features.

On an accelerator the target's forward costs little next to the drafter's step, and a cache of a large
data set would not fit on its disk (5.8 kB a token for SmolLM2: 75 GB for the 13M tokens committed under
data/): `DeviceFeatures` computes each batch's features on the device instead (the recipe's
`feature_source` "step").
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
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


@dataclasses.dataclass(frozen=True)
class DeviceFeatures:
    """Features computed by the target on the device for each batch, in place of a `FeatureCache`.

    Attributes:
      compute: (target_params, tokens [B, S], lengths [B]) -> [B, S, K * D] bf16 features of the rows,
        zero past each length (`objective.padded_target_features` at the recipe's precision, jitted).
      params: the target's parameters.
      tokens: [N, S_max] int32 padded sequences.
      lengths: [N] int32 their real lengths.
    """

    compute: Callable
    params: Any
    tokens: np.ndarray
    lengths: np.ndarray

    def batch(self, rows: np.ndarray, max_len: int) -> jax.Array:
        """Features of sequences `rows` (-1 = an all-zero padding row) cut to `max_len`, as
        `FeatureCache.batch` returns them: [B, S, K * D] bf16, on the device."""
        empty = rows < 0
        index = np.where(empty, 0, rows)
        tokens = np.where(empty[:, None], 0, self.tokens[index, :max_len])
        lengths = np.where(empty, 0, np.minimum(self.lengths[index], max_len)).astype(np.int32)
        return self.compute(self.params, tokens, lengths)


def sequence_digests(tokens: np.ndarray, lengths: np.ndarray) -> list[str]:
    """One short digest per sequence of its real tokens (a different length is a different digest).

    Args:
      tokens: [N, S] padded sequences.
      lengths: [N] their real lengths.
    """
    tokens = np.asarray(tokens, np.int32)
    return [hashlib.sha256(row[:n].tobytes()).hexdigest()[:16] for row, n in zip(tokens, lengths)]


def reusable_prefix(record: dict, source: dict, digests: list[str]) -> int:
    """How many of a cache's finished sequences hold the features the new data wants: the leading
    sequences whose digests match, when the weights and taps (`source`) are the same; 0 otherwise."""
    if record.get("source") != source:
        return 0
    old = record.get("sequences", [])[: record.get("done", 0)]
    same = 0
    while same < min(len(old), len(digests)) and old[same] == digests[same]:
        same += 1
    return same


def fitting_rows(lengths: np.ndarray, start: int, rows: int, pack_tokens: int) -> int:
    """How many sequences from `start` on one forward takes: at most `rows`, at most `pack_tokens` tokens
    (at least one; a sequence is never longer than the pack)."""
    total = np.cumsum(lengths[start : start + rows])
    return max(1, int(np.searchsorted(total, pack_tokens, side="right")))


def _write_json(path: Path, data: dict) -> None:
    write_atomically(path, lambda f: f.write(json.dumps(data).encode()))


def _resize(path: Path, shape: tuple[int, int], keep_rows: int) -> None:
    """Makes `path` a uint16 .npy of `shape` whose first `keep_rows` rows are the old file's."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not keep_rows:
        np.lib.format.open_memmap(path, "w+", np.uint16, shape)
        return
    tmp = path.with_name(path.name + ".resized.npy")
    old = np.load(path, mmap_mode="r")
    new = np.lib.format.open_memmap(tmp, "w+", np.uint16, shape)
    for start in range(0, keep_rows, 1 << 16):  # in slices: the file can be many GB
        new[start : min(start + (1 << 16), keep_rows)] = old[start : min(start + (1 << 16), keep_rows)]
    new.flush()
    del old, new
    tmp.replace(path)


def cache_features(
    path: Path,
    tokens: np.ndarray,
    lengths: np.ndarray,
    *,
    target: Target,
    weights: str,
    dtype: str,
    taps: tuple[int, ...],
    compute: Callable,
    rows: int,
    pack_tokens: int,
    progress: Progress,
    should_stop: Callable[[], bool],
) -> FeatureCache | None:
    """The target features of padded sequences, computed once into `path`.

    Args:
      path: the .npy file (its record is `path` with suffix .json).
      tokens: [N, S] int32 padded sequences.
      lengths: [N] their real lengths (each <= pack_tokens).
      target: the target whose parameters `compute` runs.
      weights: the fingerprint of those parameters (`dflax.target.weights_fingerprint`).
      dtype: the precision `compute` runs the target at (a cache of another precision is rebuilt).
      taps: the tapped layers (K of them).
      compute: (target_params, tokens [rows, S], lengths [rows]) -> [pack_tokens, K * D] bf16 features of
        the rows' real tokens back to back (rows of length 0 are unused).
      rows: sequences per forward (at most).
      pack_tokens: real tokens per forward (at most).
      progress: where the fill shows its progress.
      should_stop: polled between batches; True ends the fill early (it resumes next time).

    Returns:
      The FeatureCache, or None when the fill was stopped.
    """
    num_seqs = tokens.shape[0]
    offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    record_path = path.with_suffix(".json")
    source = {"weights": weights, "dtype": dtype, "taps": list(taps)}
    digests = sequence_digests(tokens, lengths)
    record = json.loads(record_path.read_text()) if record_path.exists() else {}
    shape = (int(offsets[-1]), len(taps) * target.config.hidden_size)
    if record.get("source") != source or record.get("sequences") != digests or not path.exists():
        keep = reusable_prefix(record, source, digests) if path.exists() else 0
        _resize(path, shape, keep_rows=int(offsets[keep]))
        record = {"source": source, "sequences": digests, "done": keep}
        _write_json(record_path, record)
    done = record["done"]
    if done < num_seqs:
        features = np.load(path, mmap_mode="r+")
        size = f"{path.name}, {np.prod(shape) * 2 / 1e9:.2f} GB"
        task = progress.add_task("caching target features", total=num_seqs, completed=done, info=size)
        start, t0 = done, time.perf_counter()
        while done < num_seqs and not should_stop():
            count = fitting_rows(lengths, done, rows, pack_tokens)
            batch_tokens = np.zeros((rows, tokens.shape[1]), np.int32)
            batch_lengths = np.zeros((rows,), np.int32)  # rows past `count` are unused
            batch_tokens[:count] = tokens[done : done + count]
            batch_lengths[:count] = lengths[done : done + count]
            out = np.asarray(compute(target.params, batch_tokens, batch_lengths)).view(np.uint16)  # [L, KD]
            real = int(offsets[done + count] - offsets[done])
            features[offsets[done] : offsets[done + count]] = out[:real]
            features.flush()
            done += count
            _write_json(record_path, {**record, "done": done})
            progress.update(task, completed=done)
            if not progress.console.is_terminal and done * 20 // num_seqs > (done - count) * 20 // num_seqs:
                rate = (done - start) / (time.perf_counter() - t0) * 60
                progress.console.print(
                    f"caching target features: {done}/{num_seqs} sequences ({size}), {rate:.0f} sequences/min"
                )
        del features
        progress.remove_task(task)
    return FeatureCache(np.load(path, mmap_mode="r"), offsets) if done == num_seqs else None
