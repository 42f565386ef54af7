"""The on-disk training data: shards of token sequences plus a manifest, and their reader.

Layout of an output directory (written by `dflax.train.make_data`):
  manifest.json          target (with a fingerprint of its weights and chat template), generation
                         config, per split: shards, counts, whether complete
  {split}-{i:05d}.npz    one compressed shard: N sequences, each prompt ids (as the target saw them) +
                         response ids

Shard arrays (N sequences, L = total tokens of the shard):
  tokens      uint16 [L]    all sequences concatenated (int32 when an id does not fit 16 bits); read back
                            as int32
  offsets     int64 [N+1]   sequence i is tokens[offsets[i]:offsets[i+1]]
  prompt_lens int32 [N]     the response of sequence i starts at position prompt_lens[i]
  keys        str   [N]     the prompt ids (JSON), which make a shard's contents checkable on resume
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

MANIFEST = "manifest.json"
TMP_SUFFIX = ".tmp"
_UINT16_MAX = np.iinfo(np.uint16).max


def write_atomically(path: Path, write) -> None:
    """Writes via a temp file in the same directory, then renames: a crash never leaves a torn `path`.

    Args:
      path: the final file.
      write: called with a binary file object open on the temp file.
    """
    tmp = path.with_name(path.name + TMP_SUFFIX)
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_shard(path: Path, sequences: Sequence[tuple[list[int], int]], keys: Sequence[str]) -> None:
    """Writes one shard atomically.

    Args:
      path: the shard file (.npz).
      sequences: (token ids: prompt + response, prompt length) per sequence.
      keys: the prompt id (JSON) of each sequence.
    """
    lengths = [len(ids) for ids, _ in sequences]
    tokens = np.asarray([t for ids, _ in sequences for t in ids], np.int64)
    compact = np.uint16 if tokens.size == 0 or 0 <= tokens.min() <= tokens.max() <= _UINT16_MAX else np.int32
    arrays = {
        "tokens": tokens.astype(compact),
        "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        "prompt_lens": np.asarray([p for _, p in sequences], np.int32),
        "keys": np.asarray(list(keys), np.str_),
    }
    write_atomically(path, lambda f: np.savez_compressed(f, **arrays))


def read_shard(path: str | Path) -> dict[str, np.ndarray]:
    """The arrays of one shard (see the module docstring), with the tokens as int32."""
    with np.load(path) as data:
        arrays = {name: data[name] for name in data.files}
    if "tokens" in arrays:
        arrays["tokens"] = arrays["tokens"].astype(np.int32)
    return arrays


def shard_sequences(shard: dict[str, np.ndarray]) -> list[tuple[np.ndarray, int]]:
    """(ids int32 [T], prompt length) for each sequence of a shard read by `read_shard`."""
    offsets = shard["offsets"]
    return [
        (shard["tokens"][offsets[i] : offsets[i + 1]], int(shard["prompt_lens"][i]))
        for i in range(len(shard["prompt_lens"]))
    ]


def read_manifest(out_dir: str | Path) -> dict | None:
    """The manifest of a data directory (None when it has none yet)."""
    path = Path(out_dir) / MANIFEST
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else None


def iter_sequences(out_dir: str | Path, split: str) -> Iterator[tuple[np.ndarray, int]]:
    """Yields (ids int32 [T], prompt length) for every sequence of a split, shard by shard.

    Raises:
      FileNotFoundError: when the directory has no manifest or no data for the split.
    """
    manifest = read_manifest(out_dir)
    if manifest is None:
        raise FileNotFoundError(f"{out_dir}: no {MANIFEST}; make it with `dflax make-data`")
    splits = manifest.get("splits", {})
    if split not in splits:
        raise FileNotFoundError(f"{out_dir}: no {split!r} data (has: {', '.join(splits) or 'none'})")
    for shard in splits[split]["shards"]:
        yield from shard_sequences(read_shard(Path(out_dir) / shard["file"]))


def load_sequences(out_dir: str | Path, split: str, limit: int | None = None) -> list[tuple[np.ndarray, int]]:
    """The first `limit` sequences of a split (None: every one), (ids int32 [T], prompt length); the
    response is ids[prompt length:]. Shards past the limit are not read."""
    return list(itertools.islice(iter_sequences(out_dir, split), limit))
