"""`dflax make-data`, `train`, `validate`, `pipeline` and `export`: drafters made, checked and written."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from dflax.checkpoints.registry import DEFAULT_TARGET
from dflax.cli.app import app
from dflax.cli.common import TARGET_HELP, console, fail, load_target_or_fail, read_recipe


@app.command("make-data")
def make_data_command(
    config: Path = typer.Option(..., "--config", help="data recipe, e.g. configs/data/smollm2-sharegpt.json"),
    out: Path = typer.Option(..., "--out", help="data directory (shards + manifest.json); reruns resume"),
    limit: int = typer.Option(None, help="answer only the first N prompts of the split"),
    batch_size: int = typer.Option(None, help="prompts decoded together (default: the recipe's)"),
    split: str = typer.Option("train", help="train or validation"),
) -> None:
    """Make drafter training data: chat and code prompts answered by the target, in resumable shards."""
    from dflax.train.make_data import DataConfig, make_data

    recipe = read_recipe(DataConfig, config, f"--config {config}")
    loaded = load_target_or_fail(recipe.target, None)
    try:
        summary = make_data(
            recipe, out, split=split, limit=limit, batch_size=batch_size, target=loaded, console=console
        )
    except (ValueError, ImportError) as e:
        fail(str(e))
    seconds = max(summary.seconds, 1e-9)
    console.print(
        f"{out}: {summary.shards_written} shard(s) written, {summary.shards_kept} kept; "
        f"{summary.sequences} sequences, {summary.new_tokens} response tokens in {summary.seconds:.1f}s "
        f"({summary.sequences / seconds:.2f} seq/s, {summary.new_tokens / seconds:.1f} tokens/s, "
        "compilation included)"
    )


@app.command("train")
def train_command(
    config: Path = typer.Option(..., "--config", help="recipe, e.g. configs/train/dflash-smollm2.json"),
    data: Path = typer.Option(..., "--data", help="data directory made by `dflax make-data`"),
    out: Path = typer.Option(..., "--out", help="run directory: checkpoints/, metrics.jsonl, drafter/"),
    steps: int = typer.Option(None, help="total optimizer steps (default: the recipe's steps or epochs)"),
    resume: bool = typer.Option(True, "--resume/--no-resume", help="continue from the latest checkpoint"),
    init_from: str = typer.Option(
        None, help="warm start from an exported drafter, 'shipped' or a directory (sets init 'drafter')"
    ),
    lr: float = typer.Option(None, help="peak learning rate (default: the recipe's), e.g. for a sweep"),
    limit: int = typer.Option(
        None, min=1, help="train on the first N training answers (of a data directory that is still growing)"
    ),
    mesh: str = typer.Option(
        None,
        help="train on a device mesh, data=D,model=M: the drafter's parameters and optimizer state split "
        "over data (FSDP) and model, each step's sequences over data (batch_size a multiple of D), the "
        "target whole or split over model; checkpoints resume on any mesh",
    ),
) -> None:
    """Train a drafter (DFlash, DART or an adapted diffusion drafter, by the recipe's method) on
    target-generated data; SIGTERM/Ctrl-C saves a checkpoint to resume from."""

    from dflax.train.dataset import load_sequences
    from dflax.train.diffusion_recipe import DiffusionTrainConfig, is_diffusion_recipe
    from dflax.train.diffusion_trainer import train_diffusion
    from dflax.train.trainer import TrainConfig, train

    overrides = {"steps": steps} if steps is not None else {}
    if init_from is not None:
        overrides.update(init="drafter", init_from=init_from)
    if lr is not None:
        overrides["lr"] = lr
    if is_diffusion_recipe(config):  # method "diffusion": an adapted diffusion drafter (DiffuSpec)
        if init_from is not None:
            fail("--init-from is for DFlash recipes; a diffusion recipe starts from its source_layers")
        recipe = read_recipe(DiffusionTrainConfig, config, f"--config {config}", **overrides)
        train = train_diffusion
    else:
        recipe = read_recipe(TrainConfig, config, f"--config {config}", **overrides)
    try:
        train_seqs = load_sequences(data, "train", limit)
    except FileNotFoundError as e:
        fail(str(e))
    try:
        val_seqs = load_sequences(data, "validation")
    except FileNotFoundError:
        console.print(f"[yellow]{data} has no validation split: training without validation[/]")
        val_seqs = []
    loaded = load_target_or_fail(recipe.target, None, mesh)
    try:
        result = train(recipe, loaded, train_seqs, val_seqs, out, resume=resume, console=console)
    except (ValueError, FileNotFoundError) as e:
        fail(str(e))
    if result.interrupted is not None:
        raise typer.Exit(128 + result.interrupted)


@app.command("validate")
def validate_command(
    drafter: list[str] = typer.Option(
        ["shipped"],
        "--drafter",
        help="'shipped' or a drafter directory made by `dflax train`; repeat to compare",
    ),
    data: list[Path] = typer.Option(
        ..., "--data", help="data directory made by `dflax make-data` (its validation split); repeatable"
    ),
    limit: int = typer.Option(64, min=1, help="held-out answers per data directory (the first ones)"),
    feature_dtype: str = typer.Option("float32", help="precision of the target forward: float32 or bfloat16"),
    recipe: Path = typer.Option(
        None, help="the drafters' training recipe (default: each drafter's TRAINING.json)"
    ),
    cache: Path = typer.Option(
        None, help="keep the target features here for the next call (default: not kept)"
    ),
    json_out: Path = typer.Option(None, "--json", help="also write the rows (every position) as JSON here"),
    target: str = typer.Option(
        None,
        help=f"the drafters' target, {TARGET_HELP} (default: --recipe's, else the first drafter's "
        f"TRAINING.json's, else {DEFAULT_TARGET})",
    ),
) -> None:
    """Held-out loss, per-position accuracy and estimated tau of drafters on data directories' validation
    answers, with the same anchors for every drafter (no training step)."""
    from dflax.train.trainer import TrainConfig
    from dflax.train.validate import recorded_target, rows_table, validate_drafters

    config = read_recipe(TrainConfig, recipe, f"--recipe {recipe}") if recipe is not None else None
    if target is None:
        target = config.target if config is not None else recorded_target(drafter[0]) or DEFAULT_TARGET
    loaded = load_target_or_fail(target, None)
    try:
        rows = validate_drafters(
            drafter, data, loaded, limit=limit, feature_dtype=feature_dtype, recipe=config, console=console,
            cache_dir=cache,
        )  # fmt: skip
    except (ValueError, FileNotFoundError) as e:
        fail(str(e))
    print(rows_table(rows))
    if json_out is not None:
        json_out.write_text(json.dumps([row.to_dict() for row in rows], indent=2) + "\n")
        console.print(f"rows written to {json_out}")


@app.command("pipeline")
def pipeline_command(
    config: Path = typer.Argument(..., help="pipeline recipe, e.g. configs/pipeline/dflash-smollm2.json"),
    dtype: str = typer.Option(
        None, help="the target's dtype: float32, bfloat16 or float16 (default: float32 on CPU, else bf16)"
    ),
    attention_backend: str = typer.Option(
        "auto", help="the target's attention: auto, chunked, reference (plain jnp), pallas, ..."
    ),
) -> None:
    """Make data, train and ship a drafter in one command; rerun it to resume after an interruption."""
    from dflax.train.pipeline import PipelineConfig, run_pipeline

    recipe = read_recipe(PipelineConfig, config, str(config))
    try:
        result = run_pipeline(recipe, dtype=dtype, attention_backend=attention_backend, console=console)
    except (ValueError, FileNotFoundError, ImportError) as e:
        fail(str(e))
    if result.interrupted is not None:
        raise typer.Exit(128 + result.interrupted)


@app.command("export")
def export_command(
    drafter: str = typer.Option(
        ..., help="the drafter to export: a drafter directory, a shipped drafter's name, or 'shipped'"
    ),
    out: Path = typer.Option(..., help="directory to write (config.json + model.safetensors)"),
    format: str = typer.Option("official", help="official: the z-lab/dflash layout the reference loads"),
    target: str = typer.Option(DEFAULT_TARGET, help="whose shipped drafter 'shipped' means"),
) -> None:
    """Write a DFlash drafter in the official format (what `DFlashDraftModel.from_pretrained` loads)."""
    from dflax.drafters import SHIPPED
    from dflax.drafters.official import FORMATS, export_official
    from dflax.drafters.shipped import named_drafter_path, shipped_drafter_path

    if format not in FORMATS:
        fail(f"--format {format!r}: use one of {', '.join(FORMATS)}")
    source = shipped_drafter_path(target) if drafter == SHIPPED else named_drafter_path(drafter)
    try:
        written = export_official(source or drafter, out)
    except (ValueError, FileNotFoundError) as e:
        fail(str(e))
    console.print(f"wrote {written} in the {format} format")
