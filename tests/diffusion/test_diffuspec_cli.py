"""`--method diffuspec` on `dflax generate` and `dflax bench`, through the `--drafter DIR` loader hook.

A test loader (a random `TableDiffusionLM` read from a directory holding `table-dlm.npy`) stands in for
the real diffusion LM loaders: generate's output equals plain decoding's, and bench runs every --window /
--cps combination under its own name, each token-identical to ar. Without a matching loader, and for bad
options, each command fails with one clear error.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from diffusion_lms import TableDiffusionLM
from typer.testing import CliRunner

from dflax.cli import app
from dflax.drafters import diffuspec_loader

runner = CliRunner()
PROMPTS = [{"id": "a", "prompt": "w5 w6 w7 w5 w6"}, {"id": "b", "prompt": "w9 w10"}]


@pytest.fixture(scope="module")
def target_dir(tiny_checkpoint):
    return tiny_checkpoint("llama")[0]


@pytest.fixture()
def table_loader(monkeypatch, tmp_path):
    """Registers a loader of `table-dlm.npy` directories and returns such a directory."""
    model = TableDiffusionLM(256, window=30)
    directory = tmp_path / "table-dlm"
    directory.mkdir()
    np.save(directory / "table-dlm.npy", np.asarray(model.make_params(0, 3.0)))

    def load(path, target):
        return model, jnp.asarray(np.load(path / "table-dlm.npy"))

    loaders = [(lambda path: (path / "table-dlm.npy").is_file(), load)]
    monkeypatch.setattr(diffuspec_loader, "LOADERS", loaders)
    return directory


def prompts_file(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return path


def generate(target_dir, tmp_path, name, *extra):
    out = tmp_path / f"{name}.jsonl"
    args = ["generate", "--target", str(target_dir), "--prompts", str(prompts_file(tmp_path))]
    result = runner.invoke(app, [*args, "--out", str(out), "--max-new-tokens", "8", *extra])
    assert result.exit_code == 0, result.output
    return {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}


def test_generate_and_bench_diffuspec_through_the_loader_hook(target_dir, tmp_path, table_loader):
    plain = generate(target_dir, tmp_path, "ar")
    spec = generate(
        target_dir, tmp_path, "diffuspec", "--method", "diffuspec", "--drafter", str(table_loader)
    )
    assert {k: r["tokens"] for k, r in spec.items()} == {k: r["tokens"] for k, r in plain.items()}
    assert all(len(r["stats"]["accept_hist"]) == 30 + 2 for r in spec.values())

    report = tmp_path / "bench.json"
    args = ["bench", "--target", str(target_dir), "--prompts", str(prompts_file(tmp_path))]
    args += ["--method", "ar,diffuspec", "--drafter", str(table_loader), "--window", "4,2:6"]
    args += ["--cps", "on,off", "--refine-steps", "2", "--max-new-tokens", "6", "--json", str(report)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    by_method = {r["method"]: r for r in json.loads(report.read_text())["results"]}
    names = {"diffuspec-w4", "diffuspec-w4-nocps", "diffuspec-w2:6", "diffuspec-w2:6-nocps"}
    assert set(by_method) == {"ar"} | names
    for name in names:
        r = by_method[name]
        assert r["lossless_match"] == 1.0 and r["tau"] >= 1.0, r
        assert r["refine_steps"] == 2 and r["cps"] == ("nocps" not in name)
        assert len(r["accept_hist"]) == (4 if "w4" in name else 6) + 2


@pytest.mark.parametrize(
    "args, message",
    [
        (["--method", "diffuspec", "w5"], "dflax ships no diffusion drafter for target"),
        (["--window", "8", "w5"], "apply to --method diffuspec"),
        (["--method", "diffuspec", "--drafter", "DIR", "--window", "0", "w5"], "--window '0': give auto"),
        (["--method", "diffuspec", "--drafter", "DIR", "--block-size", "4", "w5"], "drop --block-size"),
    ],
)
def test_bad_diffuspec_options(target_dir, tmp_path, table_loader, args, message):
    args = [str(table_loader) if a == "DIR" else a for a in args]
    result = runner.invoke(app, ["generate", "--target", str(target_dir), *args])
    assert result.exit_code == 2 and message in " ".join(result.output.split()), result.output


def test_a_directory_no_loader_reads_is_one_clear_error(target_dir, tmp_path):
    result = runner.invoke(
        app,
        ["generate", "--target", str(target_dir), "--method", "diffuspec", "--drafter", str(tmp_path), "w5"],
    )
    assert result.exit_code == 2
    assert "no diffusion LM loader matched" in " ".join(result.output.split()), result.output


def test_a_dream_checkpoint_drafts_through_the_cli_and_a_narrower_one_is_refused(target_dir, tmp_path):
    """The registered loaders: a Dream directory as wide as the target's vocabulary decodes losslessly;
    one narrower than the tokens the target emits is one clear error before drafting."""
    from tiny_diffusion_checkpoints import DREAM_CONFIG, dream_tensors, write_checkpoint

    wide = {**DREAM_CONFIG, "vocab_size": 256, "mask_token_id": 255, "pad_token_id": 254}
    dream = write_checkpoint(tmp_path / "dream", wide, dream_tensors(wide))
    plain = generate(target_dir, tmp_path, "ar")
    spec = generate(target_dir, tmp_path, "dream", "--method", "diffuspec", "--drafter", str(dream))
    assert {k: r["tokens"] for k, r in spec.items()} == {k: r["tokens"] for k, r in plain.items()}

    narrow = write_checkpoint(tmp_path / "narrow", DREAM_CONFIG, dream_tensors(DREAM_CONFIG))
    args = ["generate", "--target", str(target_dir), "--method", "diffuspec", "--drafter", str(narrow), "w5"]
    result = runner.invoke(app, args)
    assert result.exit_code == 2 and "must share the target's tokenizer" in " ".join(result.output.split())
