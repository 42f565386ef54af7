"""Drafter training data: ShareGPT recovery and splitting, make_data shards, resume, and the reader."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np
import pytest
from typer.testing import CliRunner

import dflax
from dflax.cli import app
from dflax.generation import encode_prompt
from dflax.prompts import PromptRecord, mtbench_prompts, mtbench_second_turns
from dflax.train import code_prompts
from dflax.train import make_data as make_data_module
from dflax.train.code_prompts import definition_prompts, load_code_prompts
from dflax.train.dataset import load_sequences, read_manifest, read_shard, write_shard
from dflax.train.make_data import DataConfig, make_data, row_seed, target_fingerprint
from dflax.train.sharegpt import (
    benchmark_texts,
    build_followup_prompts,
    build_prompts,
    iter_records,
    normalize,
    split_of,
)

RECIPE = Path(__file__).parents[2] / "configs/data/smollm2-sharegpt.json"
MIXED_RECIPE = Path(__file__).parents[2] / "configs/data/smollm2-135m.json"


def conversation(rid, *turns):
    return {"id": rid, "conversations": [{"from": who, "value": text} for who, text in turns]}


MTBENCH_FIRST = mtbench_prompts()[0].prompt[0]["content"]
RECORDS = [
    conversation("a_0", ("human", "Tell me  a joke."), ("gpt", "No."), ("human", "Another one")),
    conversation("b_1", ("gpt", "...continued"), ("human", "  Summarise\nthat. ")),
    conversation("c_0", ("human", "Tell me a joke. "), ("gpt", "Again no.")),  # a duplicate once normalised
    conversation("d_0", ("human", "   "), ("gpt", "?")),  # empty first turn
    conversation("e_0", ("gpt", "only the model speaks")),
    conversation("f_0", ("human", "Please answer:\n" + MTBENCH_FIRST.replace(" ", "  "))),  # benchmark
    conversation("g_0", ("system", "be brief"), ("user", "What is JAX?")),
]


def truncated_json(records):
    full = json.dumps(records, indent=2)
    cut = json.dumps(records + [conversation("torn", ("human", "this record is cut off"))], indent=2)
    return cut[: len(full) + 60]  # every complete record, then the start of a torn one


def test_sharegpt_recovery_dedupe_benchmarks_and_split():
    text = truncated_json(RECORDS)
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)
    assert [r["id"] for r in iter_records(text)] == [r["id"] for r in RECORDS]

    prompts = build_prompts(iter_records(text), 0.0, benchmark_texts())
    assert prompts.counts == {
        "records": 7, "with_user_turn": 5, "unique": 4, "benchmark": 1, "train": 3, "validation": 0,
    }  # fmt: skip
    assert [(r.id, r.prompt) for r in prompts.train] == [
        ("a_0", [{"role": "user", "content": "Tell me  a joke."}]),
        ("b_1", [{"role": "user", "content": "Summarise\nthat."}]),
        ("g_0", [{"role": "user", "content": "What is JAX?"}]),
    ]


def test_sharegpt_followups_are_exchanges_then_a_user_turn_without_benchmarks():
    records = RECORDS + [
        conversation(
            "h_0", ("human", "Name a fruit."), ("gpt", "Apple."), ("human", "Another?"), ("gpt", "Pear."),
            ("human", "A third?"),
        ),  # two follow-ups
        conversation("i_0", ("human", "Hi"), ("gpt", "  "), ("human", "Hello?")),  # empty assistant turn
        conversation("j_0", ("human", "Hi"), ("gpt", "Hey."), ("gpt", "Still there?"), ("human", "Yes")),
        conversation("k_0", ("human", "Write."), ("gpt", "Done."), ("human", mtbench_second_turns()[3])),
        conversation("l_0", ("human", "Tell me a joke."), ("gpt", "No."), ("human", " Another  one ")),  # a_0
    ]  # fmt: skip
    prompts = build_followup_prompts(records, 0.0, benchmark_texts(all_turns=True))
    assert prompts.counts == {
        "records": 12, "with_user_turn": 5, "unique": 4, "benchmark": 1, "train": 3, "validation": 0,
    }  # fmt: skip
    assert [(r.id, r.prompt) for r in prompts.train] == [
        ("a_0:2", [
            {"role": "user", "content": "Tell me  a joke."}, {"role": "assistant", "content": "No."},
            {"role": "user", "content": "Another one"},
        ]),
        ("h_0:2", [
            {"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "Apple."},
            {"role": "user", "content": "Another?"},
        ]),
        ("h_0:4", [
            {"role": "user", "content": "Another?"}, {"role": "assistant", "content": "Pear."},
            {"role": "user", "content": "A third?"},
        ]),
    ]  # fmt: skip
    # MT-Bench second turns are benchmark text for follow-ups only: first turns keep their old exclusions
    assert len(benchmark_texts(all_turns=True)) == len(benchmark_texts()) + len(mtbench_second_turns())

    # a conversation's follow-ups fall in the split of its first turn
    turns = [(("human", f"question {i}"), ("gpt", "ok"), ("human", "why?")) for i in range(300)]
    many = [conversation(f"r{i}", *exchange) for i, exchange in enumerate(turns)]
    first, followups = build_prompts(many, 0.2, []), build_followup_prompts(many, 0.2, [])
    for name in ("train", "validation"):
        assert [r.id + ":2" for r in first.split(name)] == [r.id for r in followups.split(name)]
    assert followups.validation and followups.train


def test_split_is_deterministic_disjoint_and_near_the_fraction():
    records = [conversation(f"r{i}", ("human", f"question number {i}")) for i in range(2000)]
    first = build_prompts(records, 0.1, [])
    again = build_prompts(reversed(records), 0.1, [])
    train, valid = {r.id for r in first.train}, {r.id for r in first.validation}
    assert not train & valid and len(train | valid) == 2000
    assert {r.id for r in again.validation} == valid
    assert 150 <= len(valid) <= 250, len(valid)
    assert all(split_of(normalize(f"question number {i}"), 0.1) == "validation" for i in map(_index, valid))
    assert split_of("question  number 3\n", 0.1) == split_of("question number 3", 0.1)


MODULE_SOURCE = '''
import os


def documented(a, b=1):
    """Adds two numbers and returns their sum."""
    return a + b


def undocumented(x):
    return x


class Box:
    @property
    def size(self):
        """The number of items held in the box."""
        return 3

    def short(self):
        """Too short."""


class Crate(Box):
    """A box that stacks: holds other boxes."""

    def __len__(self):
        return 0
'''


def test_stdlib_prompts_are_documented_functions_cut_after_the_docstring(tmp_path):
    prompts = dict(definition_prompts(MODULE_SOURCE))
    assert prompts == {
        "documented": 'def documented(a, b=1):\n    """Adds two numbers and returns their sum."""\n',
        "Box.size": 'def size(self):\n    """The number of items held in the box."""\n',
    }
    classes = dict(definition_prompts(MODULE_SOURCE, "stdlib-classes"))
    assert classes == {"Crate": 'class Crate(Box):\n    """A box that stacks: holds other boxes."""\n'}
    with pytest.raises(ValueError, match="prompt set 'methods' unknown"):
        list(definition_prompts(MODULE_SOURCE, "methods"))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(MODULE_SOURCE)
    (tmp_path / "pkg" / "copy.py").write_text(MODULE_SOURCE)  # the same functions again: deduplicated
    (tmp_path / "test").mkdir()
    (tmp_path / "test" / "mod.py").write_text(MODULE_SOURCE.replace("two", "three"))  # tests are skipped
    splits = load_code_prompts(0.0, root=tmp_path)
    assert [r.id for r in splits["train"]] == ["stdlib:pkg/copy.py:documented", "stdlib:pkg/copy.py:Box.size"]
    assert splits["validation"] == []
    classes = load_code_prompts(0.0, "stdlib-classes", root=tmp_path)
    assert [r.id for r in classes["train"]] == ["stdlib-classes:pkg/copy.py:Crate"]


def test_package_prompts_read_each_listed_package_and_record_its_version(tmp_path, monkeypatch):
    """The "packages" set reads the folders of PACKAGE_MODULES (tests skipped, duplicates dropped), ids
    relative to the folder holding them; the recipe records the packages' versions; a missing package is
    one clear error."""
    assert code_prompts.PACKAGE_MODULES[:3] == ("sympy", "mpmath", "networkx")
    (tmp_path / "sympy").mkdir()
    (tmp_path / "sympy" / "core.py").write_text(MODULE_SOURCE)
    (tmp_path / "numpy" / "tests").mkdir(parents=True)
    (tmp_path / "numpy" / "tests" / "mod.py").write_text(MODULE_SOURCE.replace("two", "three"))
    (tmp_path / "numpy" / "lib.py").write_text(MODULE_SOURCE)  # sympy's functions again: deduplicated
    (tmp_path / "unlisted").mkdir()
    (tmp_path / "unlisted" / "mod.py").write_text(MODULE_SOURCE.replace("two", "four"))
    splits = load_code_prompts(0.0, "packages", root=tmp_path)
    ids = [r.id for r in splits["train"]]
    assert ids == ["packages:sympy/core.py:documented", "packages:sympy/core.py:Box.size"]
    settings = DataConfig(sources=("packages",)).generation_settings()
    assert settings["package_versions"]["numpy"] == np.__version__ and "stdlib_version" not in settings
    monkeypatch.setattr(code_prompts, "PACKAGE_MODULES", ("numpy", "no_such_package_here"))
    with pytest.raises(ValueError, match="'no_such_package_here' package, which is not installed"):
        load_code_prompts(0.0, "packages")


def test_shards_are_compressed_uint16_and_read_back_as_int32(tmp_path):
    sequences = [(list(range(300)) * 4, 10), ([7, 8, 9], 1)]
    write_shard(tmp_path / "a.npz", sequences, ["0", "1"])
    with np.load(tmp_path / "a.npz") as raw:
        assert raw["tokens"].dtype == np.uint16
    assert (tmp_path / "a.npz").stat().st_size < 1200 * 2  # compressed below the raw uint16 bytes
    shard = read_shard(tmp_path / "a.npz")
    assert shard["tokens"].dtype == np.int32 and shard["tokens"].tolist() == sequences[0][0] + [7, 8, 9]
    write_shard(tmp_path / "b.npz", [([70_000, 1], 1)], ["0"])  # an id beyond 16 bits keeps int32
    with np.load(tmp_path / "b.npz") as raw:
        assert raw["tokens"].dtype == np.int32 and raw["tokens"].tolist() == [70_000, 1]


def _index(rid: str) -> int:
    return int(rid[1:])


@pytest.fixture(scope="module")
def tiny_target(tiny_checkpoint):
    return dflax.load_target(str(tiny_checkpoint("llama")[0]))


def tiny_config(target, **overrides):
    values = dict(target=target.name, max_prompt_tokens=12, max_new_tokens=6, shard_size=4, batch_size=2)
    return DataConfig(**{**values, **overrides})


def tiny_prompt(i: int, words: int) -> PromptRecord:
    text = " ".join(f"w{3 + (i * 7 + j) % 250}" for j in range(words))
    return PromptRecord(f"p{i}", [{"role": "user", "content": text}])


# Ten prompts that fit max_prompt_tokens=12 (the template adds "user:") and one that does not.
TINY_PROMPTS = [tiny_prompt(i, 1 + i) for i in range(10)] + [tiny_prompt(10, 20)]


class CountingGenerate:
    def __init__(self):
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return dflax.generate(*args, **kwargs)


@pytest.fixture
def counting(monkeypatch):
    counter = CountingGenerate()
    monkeypatch.setattr(make_data_module, "generate", counter)
    return counter


def run(target, out, **kwargs):
    config = kwargs.pop("config", tiny_config(target))
    return make_data(config, out, target=target, prompts=TINY_PROMPTS, **kwargs)


def test_make_data_writes_what_the_target_generates(tmp_path, tiny_target, counting):
    config = tiny_config(tiny_target)
    summary = run(tiny_target, tmp_path, config=config)
    assert (summary.shards_written, summary.shards_kept, summary.sequences, counting.calls) == (3, 0, 10, 3)

    manifest = read_manifest(tmp_path)
    entry = manifest["splits"]["train"]
    assert manifest["target"] == tiny_target.name and manifest["config"]["temperature"] == 0.2
    assert [s["file"] for s in entry["shards"]] == ["train-00000.npz", "train-00001.npz", "train-00002.npz"]
    assert (entry["planned"], entry["too_long"], entry["sequences"], entry["complete"]) == (10, 1, 10, True)

    sequences = load_sequences(tmp_path, "train")
    assert len(sequences) == 10 and entry["response_tokens"] == summary.new_tokens
    by_prompt = {}
    for ids, prompt_len in sequences:
        assert ids.dtype == np.int32 and 1 <= len(ids) - prompt_len <= config.max_new_tokens
        by_prompt[tuple(ids[:prompt_len].tolist())] = ids[prompt_len:].tolist()
    # The same prompts batched differently (file order, not shards sorted by length) give the same tokens.
    records = TINY_PROMPTS[:10]
    direct = dflax.generate(
        tiny_target, [r.prompt for r in records], max_new_tokens=6, temperature=0.2, top_p=0.9,
        row_seeds=[row_seed(config.seed, r.id) for r in records], batch_size=2,
    )  # fmt: skip
    for record, result in zip(records, direct):
        assert by_prompt[tuple(encode_prompt(tiny_target, record.prompt))] == result.tokens, record.id


def test_rerun_resumes_and_interrupted_shard_is_redone(tmp_path, tiny_target, counting):
    run(tiny_target, tmp_path)
    before = load_sequences(tmp_path, "train")
    mtimes = {p.name: p.stat().st_mtime_ns for p in tmp_path.glob("*.npz")}

    calls = counting.calls
    summary = run(tiny_target, tmp_path, batch_size=3)  # batch size may change on a resume
    assert (summary.shards_written, summary.shards_kept, counting.calls) == (0, 3, calls)
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.glob("*.npz")} == mtimes

    # A crash while writing shard 1: its temp file is left, the final file never appeared.
    (tmp_path / "train-00001.npz").unlink()
    (tmp_path / "train-00001.npz.tmp").write_bytes(b"PK\x03\x04 half a zip")
    summary = run(tiny_target, tmp_path)
    assert (summary.shards_written, summary.shards_kept, counting.calls) == (1, 2, calls + 1)
    assert not list(tmp_path.glob("*.tmp"))
    after = load_sequences(tmp_path, "train")
    assert [(a.tolist(), p) for a, p in after] == [(a.tolist(), p) for a, p in before]


def test_limit_then_full_keeps_the_full_shards(tmp_path, tiny_target):
    run(tiny_target, tmp_path / "limited", limit=6)
    assert [s["sequences"] for s in read_manifest(tmp_path / "limited")["splits"]["train"]["shards"]] == [
        4,
        2,
    ]
    summary = run(tiny_target, tmp_path / "limited")
    assert (summary.shards_written, summary.shards_kept) == (2, 1)  # the partial shard is redone
    run(tiny_target, tmp_path / "full")
    limited, full = (load_sequences(tmp_path / d, "train") for d in ("limited", "full"))
    assert [(a.tolist(), p) for a, p in limited] == [(a.tolist(), p) for a, p in full]


def test_a_smaller_limit_after_a_larger_run_changes_nothing(tmp_path, tiny_target, counting):
    # A pipeline stage that trains on the first answers of a directory a larger run made: neither its
    # partial last shard nor the manifest may shrink what is there.
    run(tiny_target, tmp_path)
    before = load_sequences(tmp_path, "train")
    manifest = (tmp_path / "manifest.json").read_bytes()
    mtimes = {p.name: p.stat().st_mtime_ns for p in tmp_path.glob("*.npz")}
    calls = counting.calls
    for limit in (6, 3, 10):
        summary = run(tiny_target, tmp_path, limit=limit)
        assert (summary.shards_written, summary.shards_kept) == (0, -(-limit // 4))
    assert counting.calls == calls and (tmp_path / "manifest.json").read_bytes() == manifest
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.glob("*.npz")} == mtimes
    assert [(a.tolist(), p) for a, p in load_sequences(tmp_path, "train")] == [
        (a.tolist(), p) for a, p in before
    ]


def test_answers_made_under_other_source_versions_are_kept_not_added_to(tmp_path, tiny_target, counting):
    """A fresh machine with another Python or other package versions may plan other code prompts: a stage
    that asks for answers already made trains on them as they are; more answers are refused."""
    run(tiny_target, tmp_path, limit=6)
    manifest = read_manifest(tmp_path)
    manifest["generation"]["package_versions"] = {"numpy": "0.1"}  # made under other versions
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    before, calls = (tmp_path / "manifest.json").read_bytes(), counting.calls
    for limit in (6, 3):
        summary = run(tiny_target, tmp_path, limit=limit)
        assert (summary.shards_written, summary.shards_kept) == (0, -(-limit // 4))
    assert counting.calls == calls and (tmp_path / "manifest.json").read_bytes() == before
    for limit in (7, None):
        with pytest.raises(ValueError, match=r"other versions of its prompt sources \(package_versions: "):
            run(tiny_target, tmp_path, limit=limit)
    with pytest.raises(ValueError, match=r"other settings \(max_new_tokens: 6, package_versions: "):
        run(tiny_target, tmp_path, config=tiny_config(tiny_target, max_new_tokens=5), limit=3)


def test_other_settings_or_target_refuse_to_mix(tmp_path, tiny_target):
    run(tiny_target, tmp_path, limit=2)
    fingerprint = read_manifest(tmp_path)["fingerprint"]
    assert fingerprint == target_fingerprint(tiny_target) and len(fingerprint["weights_sha256"]) == 16
    with pytest.raises(ValueError, match="max_new_tokens: 6"):
        run(tiny_target, tmp_path, config=tiny_config(tiny_target, max_new_tokens=5))
    params = jax.tree_util.tree_map(lambda x: x * 1.001, tiny_target.params)
    other = dataclasses.replace(tiny_target, params=params)  # the same model with other weights
    with pytest.raises(ValueError, match="weights_sha256"):
        run(other, tmp_path)
    with pytest.raises(ValueError, match="exceeds the target's 512-token context"):
        run(tiny_target, tmp_path / "new", config=tiny_config(tiny_target, max_prompt_tokens=510))


def test_recipe_file_and_its_validation(tmp_path):
    config = DataConfig.from_json(RECIPE)
    assert (config.target, config.temperature, config.top_p, config.max_new_tokens) == (
        "smollm2-135m", 0.2, 0.9, 256,
    )  # fmt: skip
    (tmp_path / "bad.json").write_text(json.dumps({"max_new_token": 5}))
    with pytest.raises(ValueError, match="unknown keys \\['max_new_token'\\]"):
        DataConfig.from_json(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="top_p must be in"):
        DataConfig(top_p=0.0)
    mixed = DataConfig.from_json(MIXED_RECIPE)
    assert mixed.sources == ("sharegpt", "stdlib") and mixed.temperature == 0.0
    assert mixed.generation_settings()["sources"] == ["sharegpt", "stdlib"]  # as the manifest stores it
    with pytest.raises(ValueError, match="sources must be"):
        DataConfig(sources=["sharegpt", "wiki"])
    assert DataConfig(sources=["sharegpt-followups"]).sources == ("sharegpt-followups",)


def test_cli_make_data_on_sharegpt(tmp_path, tiny_target):
    recipe = tmp_path / "recipe.json"
    recipe.write_text(json.dumps({"target": tiny_target.name, "max_prompt_tokens": 256, "max_new_tokens": 4}))
    out = tmp_path / "data"
    args = ["make-data", "--config", str(recipe), "--out", str(out), "--limit", "3", "--split", "validation"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "1 shard(s) written, 0 kept; 3 sequences" in " ".join(result.output.split())
    assert len(load_sequences(out, "validation")) == 3
    with pytest.raises(FileNotFoundError, match="no 'train' data"):
        load_sequences(out, "train")


COMMITTED = sorted(path.parent for path in (RECIPE.parents[2] / "data").glob("*/manifest.json"))


@pytest.mark.parametrize("data_dir", COMMITTED, ids=lambda p: p.name)
def test_committed_data_matches_its_recipe_and_shards(data_dir):
    """Each committed data directory was made by the recipe of its name (configs/data/<name>.json), so
    `make-data` with that recipe resumes it, and its manifest counts what its shards hold."""
    recipe = RECIPE.parent / f"{data_dir.name}.json"
    assert recipe.exists(), f"{data_dir} has no recipe {recipe}"
    manifest = read_manifest(data_dir)
    settings = DataConfig.from_json(recipe).generation_settings()
    versions = ("stdlib_version", "package_versions")  # another machine's may differ (they are kept)
    made = {k: v for k, v in manifest["generation"].items() if k not in versions}
    assert made == {k: v for k, v in settings.items() if k not in versions}
    for split, entry in manifest["splits"].items():
        listed = sum(shard["sequences"] for shard in entry["shards"])
        if entry["complete"]:
            assert listed == entry["sequences"] == entry["planned"]
        sequences = load_sequences(data_dir, split)
        assert len(sequences) == listed
        responses = sum(len(ids) - prompt_len for ids, prompt_len in sequences)
        assert responses == sum(shard["response_tokens"] for shard in entry["shards"])
