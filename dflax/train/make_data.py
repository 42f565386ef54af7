"""Training data for drafters: prompts answered by the target itself, written in resumable shards.

A drafter learns to predict the target, so its training responses are the target's own (DFlash trains on
regenerated responses). Prompts come from the recipe's sources (ShareGPT first turns and follow-up turns as
chat prompts, documented standard-library functions as code completions). They are shuffled with the
config's seed, prompts longer than `max_prompt_tokens` are skipped, and the kept ones are cut into shards of
`shard_size`. Each prompt's sampling seed comes from the config seed and its id, so a shard holds the same
sequences however the run was batched, interrupted or resumed. A shard is written to a temp file and
renamed, and counts as done on a rerun only when it holds exactly the prompts planned for it. The manifest
records a fingerprint of the target's weights and chat template, so data made by another target is refused
rather than mixed in.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
import zipfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from dflax.checkpoints.registry import DEFAULT_TARGET
from dflax.generation import encode_prompt, generate
from dflax.prompts import PromptRecord, result_key, row_seed
from dflax.target import Target, load_target, weights_fingerprint
from dflax.train.code_prompts import (
    CODE_PROMPT_SETS,
    STDLIB_PROMPT_SETS,
    load_code_prompts,
    package_versions,
    stdlib_version,
)
from dflax.train.dataset import (
    MANIFEST,
    TMP_SUFFIX,
    read_manifest,
    read_shard,
    write_atomically,
    write_shard,
)
from dflax.train.recipe import read_recipe
from dflax.train.sharegpt import SPLITS, load_sharegpt, load_sharegpt_followups

# Prompt sets: ShareGPT first turns and follow-up turns (chat), documented standard-library functions and
# classes and documented functions of installed packages (code).
PROMPT_SOURCES = ("sharegpt", "sharegpt-followups", *CODE_PROMPT_SETS)

# Settings that do not change the generated sequences, so a rerun may change them freely.
_RUN_ONLY = ("batch_size", "refill_every")
# Settings that name the versions of the code a prompt source reads. Other versions may plan other prompts,
# so they add no answers to a directory, but the answers already made there stay what a stage trains on.
_SOURCE_VERSIONS = ("stdlib_version", "package_versions")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """How the training data is made (recipes live in configs/data/*.json).

    Attributes:
      target: built-in name, .gguf file or HF checkpoint directory of the target.
      validation_fraction: share of prompts (by text hash) held out for validation.
      max_prompt_tokens: prompts longer than this (chat template included) are skipped.
      max_new_tokens: response budget per prompt.
      temperature, top_p, top_k: the target's sampling settings (SmolLM2 recommends 0.2 / 0.9).
      shard_size: sequences per shard file (the unit of resume).
      batch_size: prompts decoded together (does not change the output).
      refill_every: decode steps between refills of finished rows (continuous batching; 0 = static
        batches); does not change the output.
      seed: shuffles the prompts and seeds each prompt's sampling.
      sources: prompt sets, shuffled together: "sharegpt" (chat: first turns), "sharegpt-followups" (chat:
        a later turn after one exchange), "stdlib" (code completion of documented functions),
        "stdlib-classes" (of documented classes) and "packages" (of documented functions of installed
        packages: numpy, sympy, networkx, ...).
    """

    target: str = DEFAULT_TARGET
    validation_fraction: float = 0.02
    max_prompt_tokens: int = 512
    max_new_tokens: int = 256
    temperature: float = 0.2
    top_p: float = 0.9
    top_k: int = 0
    shard_size: int = 256
    batch_size: int = 8
    seed: int = 0
    sources: tuple[str, ...] = ("sharegpt",)
    refill_every: int = 16

    def __post_init__(self):
        object.__setattr__(self, "sources", tuple(self.sources))
        unknown = [s for s in self.sources if s not in PROMPT_SOURCES]
        if unknown or not self.sources:
            raise ValueError(
                f"sources must be a non-empty list of {', '.join(PROMPT_SOURCES)}; got {unknown}"
            )
        if not 0.0 <= self.validation_fraction < 1.0:
            raise ValueError(f"validation_fraction must be in [0, 1), got {self.validation_fraction}")
        for name in ("max_prompt_tokens", "max_new_tokens", "shard_size", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)}")
        if self.refill_every < 0:
            raise ValueError(f"refill_every must be >= 0 (0 = static batches), got {self.refill_every}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")

    @classmethod
    def from_json(cls, path: str | Path) -> DataConfig:
        """Reads a recipe file; unknown keys are an error naming the known ones."""
        return read_recipe(cls, path)

    def generation_settings(self) -> dict:
        """The settings that determine the sequences (a data directory is made under one of these), as
        JSON values."""
        settings = {k: v for k, v in dataclasses.asdict(self).items() if k not in _RUN_ONLY}
        if set(STDLIB_PROMPT_SETS) & set(self.sources):
            settings["stdlib_version"] = stdlib_version()  # the stdlib's source fixes the prompt set
        if "packages" in self.sources:
            settings["package_versions"] = package_versions()  # as the packages' sources fix theirs
        return json.loads(json.dumps(settings))


def load_prompts(config: DataConfig, split: str) -> list[PromptRecord]:
    """The prompts of a split from every source of the recipe, source after source."""
    prompts: list[PromptRecord] = []
    for source in config.sources:
        if source == "sharegpt":
            prompts += load_sharegpt(config.validation_fraction).split(split)
        elif source == "sharegpt-followups":
            prompts += load_sharegpt_followups(config.validation_fraction).split(split)
        else:
            prompts += load_code_prompts(config.validation_fraction, prompt_set=source)[split]
    return prompts


def target_fingerprint(target: Target) -> dict[str, str]:
    """Short sha256 digests of a target's weights (`dflax.target.weights_fingerprint`) and of its chat
    template: what the generated sequences depend on besides the recipe."""
    template = target.tokenizer.chat_template or ""
    return {
        "weights_sha256": weights_fingerprint(target)[:16],
        "chat_template_sha256": hashlib.sha256(template.encode("utf-8")).hexdigest()[:16],
    }


@dataclasses.dataclass(frozen=True)
class RunSummary:
    """What one make_data call did: sequences and response tokens it generated, shards written/kept."""

    sequences: int
    new_tokens: int
    seconds: float
    shards_written: int
    shards_kept: int


def plan_prompts(
    target: Target, prompts: Sequence[PromptRecord], config: DataConfig, limit: int | None
) -> tuple[list[tuple[PromptRecord, list[int]]], int]:
    """The prompts to answer, in seeded-shuffle order, with their token ids.

    Returns:
      ([(prompt, prompt ids)] of at most `limit`, number skipped for exceeding max_prompt_tokens). A
      larger limit extends a smaller one's plan, so its full shards are kept on a rerun.
    """
    order = np.random.default_rng(config.seed).permutation(len(prompts))
    planned, too_long = [], 0
    for i in order:
        if limit is not None and len(planned) >= limit:
            break
        ids = encode_prompt(target, prompts[i].prompt)
        if len(ids) > config.max_prompt_tokens:
            too_long += 1
            continue
        planned.append((prompts[i], ids))
    return planned, too_long


def _finished_shard(path: Path, keys: list[str] | None) -> dict[str, np.ndarray] | None:
    """The shard's arrays if the file exists, reads, and holds exactly the planned prompts (any, with
    keys None); else None."""
    try:
        shard = read_shard(path)
    except (OSError, ValueError, zipfile.BadZipFile):
        return None
    if "keys" not in shard or (keys is not None and shard["keys"].tolist() != keys):
        return None
    return shard


def _shards_holding(
    out_dir: Path, entry: dict | None, count: int, keys: list[str] | None = None
) -> int | None:
    """How many of the split's listed (finished) shards it takes to hold its first `count` answers, which
    must be the answers to `keys` in order when `keys` is given; None if they do not hold them all."""
    held, shards = [], 0
    for shard in (entry or {}).get("shards", []):
        if len(held) >= count:
            break
        arrays = _finished_shard(out_dir / shard["file"], None)
        if arrays is None:
            return None
        held.extend(arrays["keys"].tolist())
        shards += 1
    if len(held) < count or (keys is not None and held[:count] != keys):
        return None
    return shards


def _changed_settings(manifest: dict | None, config: DataConfig, fingerprint: dict) -> dict[str, object]:
    """{setting: its recorded value} for each generation setting or fingerprint that this run's differs
    from."""
    if manifest is None:
        return {}
    old = {**manifest["generation"], **manifest.get("fingerprint", {})}
    new = {**config.generation_settings(), **fingerprint}
    return {k: old.get(k) for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)}


def _refuse(changed: dict[str, object], out_dir: Path) -> None:
    listed = ", ".join(f"{k}: {old!r}" for k, old in changed.items())
    if set(changed) <= set(_SOURCE_VERSIONS):
        raise ValueError(
            f"{out_dir} was made from other versions of its prompt sources ({listed}): they may plan other "
            "prompts, so no answers are added to it; install those versions, or use a new --out directory"
        )
    raise ValueError(
        f"{out_dir} was made with other settings ({listed}); use the same config to resume, or a new --out "
        "directory"
    )


def _write_manifest(out_dir: Path, manifest: dict) -> None:
    text = json.dumps(manifest, indent=2) + "\n"
    write_atomically(out_dir / MANIFEST, lambda f: f.write(text.encode("utf-8")))


def _progress(console: Console | None) -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[seq_s]:.2f} seq/s  {task.fields[tok_s]:.1f} tok/s"),
        TimeElapsedColumn(),
        console=console,
        disable=console is None,
    )


def make_data(
    config: DataConfig,
    out_dir: str | Path,
    *,
    split: str = "train",
    limit: int | None = None,
    batch_size: int | None = None,
    target: Target | None = None,
    prompts: Sequence[PromptRecord] | None = None,
    console: Console | None = None,
) -> RunSummary:
    """Answers a split's prompts with the target and writes shards + manifest to out_dir; resumes.

    Args:
      config: the recipe.
      out_dir: the data directory (created; a rerun with the same config skips finished shards).
      split: "train" or "validation".
      limit: answer only the first N planned prompts; when a larger run already made them, nothing is
        written (not the shards, not the manifest), even under other versions of the prompt sources
        (another Python's standard library, other package versions), which add no answers otherwise.
      batch_size: overrides config.batch_size (output does not depend on it).
      target: the loaded config.target (loaded here when None).
      prompts: the split's prompts (default: the recipe's sources' prompts of `split`).
      console: where to show progress (None = quiet).

    Returns:
      A summary of this call's work.

    Raises:
      ValueError: for a bad split or limit, settings that do not fit the target's context, or an out_dir
        made with other generation settings, source versions (unless `limit` answers are made) or target.
    """
    if split not in SPLITS:
        raise ValueError(f"split {split!r} unknown; choose one of {', '.join(SPLITS)}")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be a positive integer, got {limit}")
    config = dataclasses.replace(config, batch_size=batch_size or config.batch_size)
    out_dir = Path(out_dir)
    manifest = read_manifest(out_dir)
    target = target or load_target(config.target)
    fingerprint = target_fingerprint(target)
    changed = _changed_settings(manifest, config, fingerprint)
    previous = manifest["splits"].get(split) if manifest else None
    if changed:
        held = _shards_holding(out_dir, previous, limit) if limit is not None else None
        if held is None or not set(changed) <= set(_SOURCE_VERSIONS):
            _refuse(changed, out_dir)
        if console is not None:
            kept = f"{split}: the first {limit} answers are already made ({held} shards), kept"
            console.print(f"{kept} (made under another {' and '.join(changed)})")
        return RunSummary(0, 0, 0.0, 0, held)
    context = target.config.max_position_embeddings
    if config.max_prompt_tokens + config.max_new_tokens > context:
        raise ValueError(
            f"max_prompt_tokens + max_new_tokens = {config.max_prompt_tokens + config.max_new_tokens} "
            f"exceeds the target's {context}-token context; lower one of them"
        )
    if prompts is None:
        prompts = load_prompts(config, split)
    planned, too_long = plan_prompts(target, prompts, config, limit)
    keys = [result_key(record.id) for record, _ in planned]
    if limit is not None and (held := _shards_holding(out_dir, previous, len(keys), keys)):
        # A larger run made these answers already: a smaller plan would rewrite its last shard with fewer
        # answers and drop the shards after it from the manifest, so the directory is left as it is.
        if console is not None:
            console.print(f"{split}: the first {len(keys)} answers are already made ({held} shards), kept")
        return RunSummary(0, 0, 0.0, 0, held)

    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob(f"*{TMP_SUFFIX}"):
        stale.unlink()  # left by an interrupted run; never a finished file
    manifest = manifest or {"target": target.name, "generation": config.generation_settings(), "splits": {}}
    manifest["fingerprint"] = fingerprint
    manifest["config"] = json.loads(json.dumps(dataclasses.asdict(config)))
    entry = {"limit": limit, "planned": len(planned), "too_long": too_long, "shards": [], "complete": False}
    manifest["splits"][split] = entry

    done = {"sequences": 0, "tokens": 0, "written": 0, "kept": 0}
    t0 = time.perf_counter()
    with _progress(console) as progress:
        task = progress.add_task(f"make-data {split}", total=len(planned), seq_s=0.0, tok_s=0.0)

        def rates() -> dict[str, float]:
            elapsed = max(time.perf_counter() - t0, 1e-9)
            return {"seq_s": done["sequences"] / elapsed, "tok_s": done["tokens"] / elapsed}

        def on_result(_, result):
            done["sequences"] += 1
            done["tokens"] += len(result.tokens)
            progress.update(task, advance=1, **rates())

        for index, start in enumerate(range(0, len(planned), config.shard_size)):
            shard = planned[start : start + config.shard_size]
            path = out_dir / f"{split}-{index:05d}.npz"
            shard_keys = keys[start : start + config.shard_size]
            arrays = _finished_shard(path, shard_keys)
            if arrays is None:
                write_shard(path, _answer(target, shard, config, on_result), shard_keys)
                arrays = read_shard(path)
                done["written"] += 1
                r = rates()
                note = f"written; {r['seq_s']:.2f} seq/s, {r['tok_s']:.1f} tok/s so far"
            else:
                done["kept"] += 1
                progress.advance(task, len(shard))
                note = "already done, kept"
            entry["shards"].append(_shard_entry(path, arrays))
            _write_manifest(out_dir, manifest)
            if console is not None:  # a line per shard also reaches a log file, where the bar does not
                console.print(f"{path.name}: {len(shard)} sequences {note}")
    entry["complete"] = True
    entry["sequences"] = sum(s["sequences"] for s in entry["shards"])
    entry["response_tokens"] = sum(s["response_tokens"] for s in entry["shards"])
    _write_manifest(out_dir, manifest)
    return RunSummary(
        done["sequences"], done["tokens"], time.perf_counter() - t0, done["written"], done["kept"]
    )


def _answer(
    target: Target, shard: list[tuple[PromptRecord, list[int]]], config: DataConfig, on_result
) -> list[tuple[list[int], int]]:
    """(prompt ids + response ids, prompt length) for each prompt of a shard, in shard order."""
    # Decoding prompts of similar length together keeps the prompt-length buckets tight.
    order = sorted(range(len(shard)), key=lambda i: len(shard[i][1]))
    results = generate(
        target,
        [shard[i][0].prompt for i in order],
        max_new_tokens=config.max_new_tokens,
        temperature=config.temperature,
        top_k=config.top_k,
        top_p=config.top_p,
        batch_size=config.batch_size,
        row_seeds=[row_seed(config.seed, shard[i][0].id) for i in order],
        on_result=on_result,
        refill_every=config.refill_every or None,
    )
    sequences: list = [None] * len(shard)
    for i, result in zip(order, results):
        ids = shard[i][1]
        sequences[i] = (ids + result.tokens, len(ids))
    return sequences


def _shard_entry(path: Path, shard: dict[str, np.ndarray]) -> dict:
    prompt_tokens = int(shard["prompt_lens"].sum())
    return {
        "file": path.name,
        "sequences": len(shard["prompt_lens"]),
        "prompt_tokens": prompt_tokens,
        "response_tokens": len(shard["tokens"]) - prompt_tokens,
    }
