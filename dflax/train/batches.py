"""Training sequences padded to one length, and the sequences of each step."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from dflax.train.features import DeviceFeatures, FeatureCache


@dataclasses.dataclass(frozen=True)
class PaddedSequences:
    """Sequences padded to one length (host arrays).

    Attributes:
      tokens: [N, S] int32 (0 past each length).
      prompt_lens: [N] int32.
      lengths: [N] int32 real lengths (<= S).
    """

    tokens: np.ndarray
    prompt_lens: np.ndarray
    lengths: np.ndarray

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def width(self, index: np.ndarray, bucket: int) -> int:
        """W, the length a batch of rows `index` is cut to: S with bucket 0, else its longest sequence
        rounded up to a multiple of `bucket` (at most S)."""
        max_len = self.tokens.shape[1]
        if not bucket:
            return max_len
        longest = int(self.lengths[index[index >= 0]].max(initial=1))
        return min(max_len, -(-longest // bucket) * bucket)

    def take(
        self, index: np.ndarray, features: FeatureCache | DeviceFeatures, width: int | None = None
    ) -> dict:
        """The batch of rows `index` (-1 = an empty padding row) with its features (read from the cache,
        or computed on the device), `width` long (default S; at least the rows' longest sequence).

        Returns:
          {"tokens" [N, W], "prompt_lens" [N], "lengths" [N], "features" [N, W, K * D] bf16} arrays.
        """
        width = width or self.tokens.shape[1]
        empty = index < 0
        rows = np.where(empty, 0, index)
        return {
            "tokens": np.where(empty[:, None], 0, self.tokens[rows, :width]),
            "prompt_lens": self.prompt_lens[rows],
            "lengths": np.where(empty, 0, self.lengths[rows]).astype(np.int32),
            "features": features.batch(index, width),
        }


def pad_sequences(sequences: Sequence[tuple[np.ndarray, int]], max_len: int) -> PaddedSequences:
    """Truncates / pads (ids, prompt_len) pairs to `max_len`, dropping those with no anchor to train on.

    A sequence needs a response token with another after it (prompt_len <= max_len - 2 after truncation).
    """
    kept = [(np.asarray(ids, np.int32)[:max_len], int(p)) for ids, p in sequences]
    kept = [(ids, p) for ids, p in kept if p <= len(ids) - 2]
    tokens = np.zeros((len(kept), max_len), np.int32)
    for i, (ids, _) in enumerate(kept):
        tokens[i, : len(ids)] = ids
    return PaddedSequences(
        tokens=tokens,
        prompt_lens=np.asarray([p for _, p in kept], np.int32),
        lengths=np.asarray([len(ids) for ids, _ in kept], np.int32),
    )


def batch_index(num_seqs: int, batch_size: int, seed: int, step: int) -> np.ndarray:
    """The training sequences of step `step`: epoch e = step // (N // batch) reads permutation e in order."""
    per_epoch = num_seqs // batch_size
    epoch, i = divmod(step, per_epoch)
    order = np.random.default_rng([seed, epoch]).permutation(num_seqs)
    return order[i * batch_size : (i + 1) * batch_size]
