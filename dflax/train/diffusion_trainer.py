"""`dflax train` for `method: "diffusion"`: adapts a diffusion drafter from its target and exports it.

The drafter (dflax.diffusion.adapted_drafter) starts from the recipe's `source_layers` of the target and
its final norm; the shared embedding and LM head stay frozen. Each step samples M windows per sequence
and trains the masked-slot loss of `dflax.train.diffusion_objective` with AdamW (warmup + cosine, clipped),
through the DFlash trainer's step (`make_steps`), checkpoints (orbax; SIGTERM/SIGINT save at the next step
boundary, a rerun resumes exactly: batches are a function of (seed, step), windows of the state's key)
and data order.

Validation masks every slot of every window (DiffuSpec's one-step draft) at fixed anchors and records the
top-1 accuracy per slot next to two chance baselines: the most frequent training response token
predicted everywhere (unigram) and the drafter before training (the copied layers, step 0). Each
validation rewrites `out_dir/TRAINING.json`; the end exports `out_dir/drafter` (config.json,
model.safetensors, TRAINING.json).
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from dflax.diffusion.adapted_checkpoint import save_adapted_drafter
from dflax.diffusion.adapted_drafter import (
    AdaptedConfig,
    AdaptedDrafter,
    AdaptedLayers,
    init_adapted_params,
    shared_params,
)
from dflax.target import Target
from dflax.train import objective
from dflax.train.batches import batch_index, pad_sequences
from dflax.train.checkpointing import StopFlag, checkpoint_manager, restore_state
from dflax.train.diffusion_objective import diffusion_loss, make_windows
from dflax.train.diffusion_recipe import DiffusionTrainConfig
from dflax.train.steps import TrainState, make_optimizer, make_steps
from dflax.train.trainer import TrainResult

METRICS = "metrics.jsonl"
REPORT = "TRAINING.json"
_ORDER_FIELDS = ("seed", "source_layers", "batch_size", "max_seq_len", "windows_per_seq", "window")


def initial_params(drafter: AdaptedDrafter, target: Target, seed: int) -> dict:
    """The drafter's own parameters {"params": ...} started from its source layers of the target, the
    target's final norm and (mask embedding) the mean row of the target's embedding; in own buffers."""
    params = init_adapted_params(drafter.module, seed)["params"]
    source = target.params["params"]
    own = lambda x: jnp.array(x, jnp.float32, copy=True)  # noqa: E731  buffers a donating step may reuse
    copied = {f"layers_{i}": jax.tree.map(own, source[f"layers_{s}"])
              for i, s in enumerate(drafter.module.config.source_layers)}  # fmt: skip
    mean_row = jnp.mean(source["embed_tokens"]["weight"].astype(jnp.float32), axis=0)  # [D]
    params = {**params, **copied, "norm": jax.tree.map(own, source["norm"]), "mask_embedding": mean_row}
    return {"params": params}


def loss_fns(drafter: AdaptedDrafter, config: DiffusionTrainConfig):
    """(train loss_fn for `make_steps`, eval_fn) of a recipe.

    loss_fn(params, shared, batch, key) -> (loss, BlockStats) over the recipe's masking;
    eval_fn(params, shared, batch, key, unigram) -> (loss, BlockStats, unigram BlockStats) over all-masked
    windows, the unigram baseline predicting token `unigram` at every slot.
    """
    weights = objective.position_weights(config.window + 1, config.gamma)  # [K]

    def windows_of(batch, key, all_masked_frac):
        return make_windows(
            key, batch["tokens"], batch["prompt_lens"], batch["lengths"], config.windows_per_seq,
            config.window, drafter.mask_token_id, all_masked_frac,
        )  # fmt: skip

    def loss_on(params, shared, batch, windows):
        return diffusion_loss(
            drafter, {"drafter": params, **shared}, batch["tokens"], batch["lengths"], windows, weights,
            config.logits_chunk, config.attention_chunk,
        )  # fmt: skip

    def loss_fn(params, shared, batch, key):
        return loss_on(params, shared, batch, windows_of(batch, key, config.all_masked_frac))

    def eval_fn(params, shared, batch, key, unigram):
        windows = windows_of(batch, key, 1.0)
        loss, stats = loss_on(params, shared, batch, windows)
        return loss, stats, objective.block_stats(windows.labels == unigram, windows.scored)

    return loss_fn, jax.jit(eval_fn)


def most_frequent_token(data, exclude: int) -> int:
    """The most frequent response token of padded training sequences (not `exclude`): the unigram guess."""
    counts = np.zeros(int(data.tokens.max()) + 1, np.int64)
    for ids, p, n in zip(data.tokens, data.prompt_lens, data.lengths):
        np.add.at(counts, ids[p:n], 1)
    if exclude < counts.size:
        counts[exclude] = 0
    return int(np.argmax(counts))


def validate(eval_fn, params, shared, val, batch_size: int, seed: int, unigram: int) -> dict:
    """Loss and per-slot top-1 accuracy of all-masked windows at fixed anchors, with the unigram's."""
    key = jax.random.key(seed + 1)
    losses, total, base = [], None, None
    index = np.arange(-(-len(val) // batch_size) * batch_size)
    index[index >= len(val)] = -1
    for b, rows in enumerate(index.reshape(-1, batch_size)):
        loss, stats, uni = eval_fn(params, shared, take(val, rows), jax.random.fold_in(key, b), unigram)
        losses.append(loss)
        total = stats if total is None else total + stats
        base = uni if base is None else base + uni
    acc, tau = objective.acceptance(total)
    rounded = lambda x: np.round(np.asarray(x), 4).tolist()  # noqa: E731
    return {
        "val_loss": float(np.mean(jax.device_get(losses))),
        "val_acc": rounded(objective.position_accuracy(total)),
        "val_accept": rounded(acc),
        "val_tau": float(tau),
        "unigram_acc": rounded(objective.position_accuracy(base)),
        "val_windows": int(total.valid[0]),
    }


def take(data, index: np.ndarray) -> dict:
    """The batch of rows `index` (-1 = an empty row): {"tokens" [N, S], "prompt_lens" [N], "lengths" [N]}."""
    empty = index < 0
    rows = np.where(empty, 0, index)
    return {
        "tokens": np.where(empty[:, None], 0, data.tokens[rows]),
        "prompt_lens": data.prompt_lens[rows],
        "lengths": np.where(empty, 0, data.lengths[rows]).astype(np.int32),
    }


def write_report(out_dir: Path, config: DiffusionTrainConfig, data: dict, total_steps: int) -> dict:
    """TRAINING.json from metrics.jsonl: recipe, data, steps, wall time, losses, validations, baselines."""
    records = [json.loads(line) for line in (out_dir / METRICS).read_text().splitlines() if line.strip()]
    train = [r for r in records if "loss" in r]
    vals = [r for r in records if "val_acc" in r]
    init = next((r for r in vals if r["step"] == 0), None)
    trained = [r for r in vals if r["step"] > 0]
    report = {
        "method": "diffusion (adapted from the target: masked-token objective, shifted logits)",
        "recipe": config.to_dict(),
        "data": data,
        "steps": max((r["step"] for r in records), default=0),
        "total_steps": total_steps,
        "train_wall_s": round(sum(r["seconds"] for r in train), 1),
        "losses": [[r["step"], round(r["loss"], 4)] for r in train],
        "chance": {
            "unigram_acc": init["unigram_acc"] if init else None,
            "init_acc": init["val_acc"] if init else None,
            "init_loss": init["val_loss"] if init else None,
        },
        "validation": trained,
        "final_validation": trained[-1] if trained else None,
    }
    (out_dir / REPORT).write_text(json.dumps(report, indent=2) + "\n")
    return report


def train_diffusion(
    config: DiffusionTrainConfig,
    target: Target,
    train_sequences: Sequence[tuple[np.ndarray, int]],
    val_sequences: Sequence[tuple[np.ndarray, int]],
    out_dir: str | Path,
    *,
    resume: bool = True,
    console: Console | None = None,
) -> TrainResult:
    """Adapts a diffusion drafter from `target` and exports it to `out_dir/drafter`.

    Args:
      config: the recipe.
      target: the loaded (frozen) target.
      train_sequences, val_sequences: (ids [T] int32, prompt_len) pairs; the response follows the prompt.
      out_dir: run directory: checkpoints/, metrics.jsonl, TRAINING.json, drafter/.
      resume: continue from the latest checkpoint (else start over).
      console: where progress goes (default stderr).

    Returns:
      The TrainResult (`interrupted` set when a signal stopped the run after saving a checkpoint).
    """
    console = console or Console(stderr=True)
    out_dir = Path(out_dir)
    if target.mesh is not None:
        raise ValueError("diffusion drafters train on one device: leave out --mesh")
    data = pad_sequences(train_sequences, config.max_seq_len)
    val = pad_sequences(val_sequences[: config.max_val_sequences], config.max_seq_len)
    if len(data) < config.batch_size:
        raise ValueError(
            f"{len(data)} usable training sequences for batch_size {config.batch_size}; add data"
        )
    total_steps = config.steps or config.epochs * (len(data) // config.batch_size)
    drafter_config = AdaptedConfig.for_target(target.config, config.source_layers, config.mask_token_id,
                                              config.window)  # fmt: skip
    drafter = AdaptedDrafter(AdaptedLayers(drafter_config, jnp.float32, attention_backend="reference"))
    shared = shared_params(target.config, target.params)
    unigram = most_frequent_token(data, config.mask_token_id)
    response_tokens = lambda d: int((d.lengths - d.prompt_lens).clip(0).sum())  # noqa: E731
    data_info = {
        "train": {"sequences": len(data), "response_tokens": response_tokens(data)},
        "validation": {"sequences": len(val), "response_tokens": response_tokens(val)},
        "unigram_token": unigram,
    }
    console.print(
        f"{len(data)} training sequences, {len(val)} validation; {total_steps} steps of "
        f"{config.batch_size} sequences x {config.windows_per_seq} windows of {config.window}"
    )
    tx = make_optimizer(config, total_steps)
    loss_fn, eval_fn = loss_fns(drafter, config)
    train_step, _ = make_steps(loss_fn, tx)
    params = initial_params(drafter, target, config.seed)
    state = TrainState(params, tx.init(params), jax.random.key_data(jax.random.key(config.seed)),
                       jnp.zeros((), jnp.int32))  # fmt: skip

    ckpt_dir = out_dir / "checkpoints"
    if not resume and ckpt_dir.exists():
        shutil.rmtree(ckpt_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    manager = checkpoint_manager(ckpt_dir)
    meta = {
        **{k: getattr(config, k) for k in _ORDER_FIELDS},
        "num_train": len(data),
        "total_steps": total_steps,
    }
    meta["source_layers"] = list(config.source_layers)
    if manager.latest_step() is not None:
        state = restore_state(manager, state, meta)
        console.print(f"resuming {ckpt_dir} at step {int(state.step)} of {total_steps}")
    elif (out_dir / METRICS).exists():
        (out_dir / METRICS).unlink()  # a fresh run: no records of an abandoned one

    def save(step: int) -> None:
        if manager.latest_step() != step:
            args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
            manager.save(step, args=args)

    step = int(state.step)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
    columns += (TextColumn("{task.fields[info]}"), TimeRemainingColumn())
    progress = Progress(*columns, console=console)
    with StopFlag() as stop, progress, (out_dir / METRICS).open("a") as log_file:

        def record(entry: dict) -> None:
            log_file.write(json.dumps(entry) + "\n")
            log_file.flush()

        def run_validation(at: int) -> None:
            if len(val):
                entry = validate(eval_fn, state.params, shared, val, config.batch_size, config.seed, unigram)
                record({"step": at, **entry})
                write_report(out_dir, config, data_info, total_steps)
                acc = " ".join(f"{a:.2f}" for a in entry["val_acc"][:4])
                console.print(
                    f"step {at}: val loss {entry['val_loss']:.3f}, acc@1-4 {acc}, tau {entry['val_tau']:.2f}"
                )

        if step == 0:
            run_validation(0)  # the untrained drafter: one of the chance baselines
        task = progress.add_task("training", total=total_steps, completed=step, info="compiling ...")
        pending, t0 = [], time.perf_counter()
        while step < total_steps and stop.signum is None:
            batch = take(data, batch_index(len(data), config.batch_size, config.seed, step))
            state, metrics = train_step(state, shared, batch)
            step += 1
            pending.append(metrics)
            if step % config.log_every == 0 or step == total_steps:
                fetched = jax.device_get(pending)
                seconds = time.perf_counter() - t0
                stats = fetched[0]["stats"]
                for m in fetched[1:]:
                    stats = stats + m["stats"]
                loss = float(np.mean([m["loss"] for m in fetched]))
                acc = np.round(np.asarray(objective.position_accuracy(stats)), 4).tolist()
                record({"step": step, "loss": loss, "acc": acc, "seconds": round(seconds, 3)})
                info = f"loss {loss:.3f} acc@1 {acc[0]:.2f} {len(fetched) / seconds:.3f} steps/s"
                progress.update(task, info=info)
                pending, t0 = [], time.perf_counter()
            if step % config.validate_every == 0 or step == total_steps:
                run_validation(step)
                t0 = time.perf_counter() if not pending else t0
            if step % config.checkpoint_every == 0:
                save(step)
            progress.update(task, completed=step)
        save(step)
    manager.close()
    params = jax.device_get(state.params)
    if step < total_steps:
        console.print(f"stopped by signal {stop.signum} at step {step}; checkpoint saved, rerun to resume")
        return TrainResult(step, total_steps, stop.signum, params, None, [])
    drafter_dir = out_dir / "drafter"
    save_adapted_drafter(drafter_dir, drafter_config, params, config.export_dtype)
    if (out_dir / REPORT).exists():
        shutil.copy(out_dir / REPORT, drafter_dir / REPORT)
    console.print(f"drafter ({config.export_dtype}) written to {drafter_dir}")
    return TrainResult(step, total_steps, None, params, drafter_dir, [])
