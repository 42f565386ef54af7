"""`dflax train`: trains a DFlash drafter against a frozen target and exports it in the official layout.

The step is `state = step(state, target_params, batch)`, jitted once (sequences are padded to
`max_seq_len`, anchors per sequence are fixed) with the state donated. The loss is
`dflax.train.objective.dflash_loss`, which runs all anchors of a sequence in one drafter forward with the
layers and math of the decoding forward. Optimizer: AdamW, warmup (4%) + cosine schedule to 0, global-norm
clipping 1.0 (the paper's recipe). A run starts from random weights, the target's last layers, or an
exported drafter (warm start: `init` "drafter", `init_from` "shipped" or a directory).

Target features are precomputed once per sequence by the target's prefill forward and cached on disk
(`dflax.train.features`: `out_dir/features/{train,validation}.npy`, bf16, memory-mapped, filled resumably
before the first step). Measured on SmolLM2-135M (30 layers, d 576; 3-layer drafter, 5 target layers)
before all anchors shared one forward, 4 sequences x S tokens per step, 32 anchors each, B = 16, float32
on a shared 2-core CPU (best of 3):
                                         S = 384              S = 512
  target forward inside the step         11.6 s/step          10.3 s/step
  step on cached features                6.8 s + 13 ms read   4.2 s + 9 ms read
  filling the cache (once per batch)     3.9 s                6.2 s
Per batch of sequences over the recipe's 6 epochs that is 69 s vs 45 s (S = 384) and 62 s vs 31 s
(S = 512): caching is 1.5-2x faster and breaks even within the first epoch. The price is disk,
K * D * 2 bytes per real token (5.8 kB for SmolLM2: ~1.7 MB per 300-token sequence, ~30 GB for 17k).

The step's cost per anchor is the block's own work (B tokens through the drafter layers, B - 1 LM-head
rows), so anchors/s hardly moves with M; what grew with M was memory, while every anchor copied its
context. XLA's accounting of the compiled step (SmolLM2, the shipped recipe with M changed; per-anchor
copy -> one forward): S = 512, 4 sequences: scratch 1.2 -> 1.0 GB (M = 32), 4.5 -> 1.7 GB (M = 128),
13.5 -> 4.8 GB (M = 384), flops per anchor 1.5 -> 1.5 G (M = 32), 1.23 -> 1.09 G (M = 384); S = 2048, one
sequence: 7.0 -> 1.1 GB and 1.88 -> 1.40 G flops per anchor (M = 256), 13.9 -> 1.7 GB and 1.81 -> 1.21 G
(M = 512). Wall clock on the shared CPU (median of 5 steps, loaded by other jobs): 10.5 -> 13.1 anchors/s
(M = 32) and 12.0 -> 11.4 (M = 128), the same within the noise; 6.7 anchors/s at M = 384 after.

On a mesh (a target loaded with `load_target(..., mesh=)`, CLI `--mesh`) the same step trains with the
drafter's parameters and optimizer state FSDP-sharded and each batch split over `data`
(`dflax.sharding.training`); a checkpoint restores onto whatever mesh the resuming run uses.

Resuming is exact: the batch of step s is a pure function of (seed, s) (one permutation of the training
sequences per epoch), the anchors come from the PRNG key carried in the state, and orbax checkpoints hold
params, optimizer state, key and step. So a run interrupted (SIGTERM/SIGINT: saved at the next step
boundary) or killed (kill -9: it repeats the steps since its last checkpoint) and resumed ends in the same
state as an uninterrupted one. Each validation also rewrites `out_dir/TRAINING.json` and
`out_dir/validation.png` (`dflax.train.report`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from dflax.drafters.checkpoint import save_drafter
from dflax.drafters.dart import DartConfig, DartDrafter, init_dart_params
from dflax.drafters.dart_checkpoint import save_dart
from dflax.drafters.dflash import DFlashDrafter, init_drafter_params
from dflax.drafters.draft_vocab import frequent_tokens
from dflax.sharding.training import TrainingSharding
from dflax.target import Target, weights_fingerprint
from dflax.train import objective
from dflax.train.batches import PaddedSequences, batch_index, pad_sequences
from dflax.train.checkpointing import StopFlag, checkpoint_manager, order_meta, restore_state
from dflax.train.config import TrainConfig
from dflax.train.dart_ngram import response_ngram_tables
from dflax.train.features import DeviceFeatures, cache_features
from dflax.train.report import METRICS, PLOT, TRAINING_RECORD, record_warm_start, write_report
from dflax.train.steps import TrainState, programs_for
from dflax.train.target_init import init_from_target
from dflax.train.warm_start import (
    resolve_drafter_dir,
    warm_start_matching_params,
    warm_start_params,
    warm_start_vocab,
)


@dataclasses.dataclass
class TrainResult:
    """What `train` did.

    Attributes:
      step: steps done (== total_steps unless interrupted).
      total_steps: steps of the schedule.
      interrupted: the signal number that stopped the run early (None when it finished).
      params: the drafter's parameters.
      drafter_dir: the exported drafter (None when interrupted).
      log: the progress and validation records written to metrics.jsonl by this call.
    """

    step: int
    total_steps: int
    interrupted: int | None
    params: dict
    drafter_dir: Path | None
    log: list[dict]


def validation_pass(
    eval_step,
    params,
    target_params,
    val: PaddedSequences,
    features,
    batch_size: int,
    seed: int,
    place: Callable[[dict], dict] | None = None,
) -> dict:
    """Loss, per-position accuracy and greedy acceptance on held-out sequences (anchors fixed by `seed`),
    the acceptance at temperature 1 when the loss reads the target's distributions, and the tokens a
    best-first draft tree of N nodes commits per step (E[c] and E[c^2], N = 0 .. `TREE_NODES` of
    `dflax.train.tree_acceptance`: `val_tree_tau`, `val_tree_square`) when it simulates them; `place` puts
    each host batch where the step reads it (default: as it is)."""
    place = place or (lambda batch: batch)
    key = jax.random.key(seed + 1)
    losses, total = [], None
    index = np.arange(-(-len(val) // batch_size) * batch_size)
    index[index >= len(val)] = -1
    for b, rows in enumerate(index.reshape(-1, batch_size)):
        batch = place(val.take(rows, features))
        loss, stats = eval_step(params, target_params, batch, jax.random.fold_in(key, b))
        losses.append(loss)
        total = stats if total is None else total + stats
    acc, tau = objective.acceptance(total)
    entry = {
        "val_loss": float(np.mean(jax.device_get(losses))),
        "val_acc": np.round(np.asarray(objective.position_accuracy(total)), 4).tolist(),
        "val_accept": np.round(np.asarray(acc), 4).tolist(),
        "val_rank_accept": np.round(np.asarray(objective.rank_acceptance(total)), 4).tolist(),
        "val_tau": float(tau),
    }
    if float(total.whole):  # the loss simulated best-first trees (DFlash's validation)
        curve = np.round(np.asarray(objective.tree_commit_curve(total), np.float64), 4)
        entry["val_tree_tau"], entry["val_tree_square"] = curve[:, 0].tolist(), curve[:, 1].tolist()
    if np.any(np.asarray(total.overlap)):  # the loss read the target's distributions (distill_weight)
        sampled, sampled_tau = objective.sampled_acceptance(total)
        entry["val_accept_t1"] = np.round(np.asarray(sampled), 4).tolist()
        entry["val_tau_t1"] = float(sampled_tau)
    return entry


def _summary(pending: list[dict], tokens: int, seconds: float, step: int) -> dict:
    """One progress record from the metrics of the steps since the last one (fetched now)."""
    fetched = jax.device_get(pending)
    stats = fetched[0]["stats"]
    for m in fetched[1:]:
        stats = stats + m["stats"]
    return {
        "step": step,
        "loss": float(np.mean([m["loss"] for m in fetched])),
        "grad_norm": float(np.mean([m["grad_norm"] for m in fetched])),
        "acc": np.round(np.asarray(objective.position_accuracy(stats)), 4).tolist(),
        "tok_s": tokens / seconds,
        "anchors_s": float(stats.valid[0]) / seconds,  # blocks trained per second
        "seconds": round(seconds, 3),
    }


def _progress_text(record: dict, tau: float | None) -> str:
    acc = " ".join(f"{a:.2f}" for a in record["acc"][:4])
    text = f"loss {record['loss']:.3f}  acc@1-4 {acc}  {record['anchors_s']:.0f} anchors/s"
    return text + (f"  val tau {tau:.2f}" if tau is not None else "")


def _initial_state(
    module: DFlashDrafter | DartDrafter,
    tx: optax.GradientTransformation,
    config: TrainConfig,
    target: Target,
    parent: Path | None,
    console: Console,
) -> TrainState:
    """The step-0 state: fresh, from the target's layers, or from the exported drafter `parent`."""
    init = init_dart_params if isinstance(module, DartDrafter) else init_drafter_params
    params = init(module, config.seed)
    if config.init == "target":
        params = init_from_target(params, target.params, target.config, module.config)
    elif parent is not None and config.init_match == "shapes":
        params, copied, kept = warm_start_matching_params(parent, params)
        console.print(
            f"warm start from {parent}: {len(copied)} parameters copied, fresh: {', '.join(kept) or 'none'}"
        )
    elif parent is not None:
        params = warm_start_params(parent, module.config, params)
    return TrainState(
        params=params,
        opt_state=tx.init(params),
        rng=jax.random.key_data(jax.random.key(config.seed)),
        step=jnp.zeros((), jnp.int32),
    )


def train(
    config: TrainConfig,
    target: Target,
    train_sequences: Sequence[tuple[np.ndarray, int]],
    val_sequences: Sequence[tuple[np.ndarray, int]],
    out_dir: str | Path,
    *,
    resume: bool = True,
    console: Console | None = None,
    on_step: Callable[[int], None] | None = None,
) -> TrainResult:
    """Trains a DFlash drafter for `target` and exports it to `out_dir/drafter`.

    Args:
      config: the recipe.
      target: the loaded (frozen) target. Loaded on a mesh (`load_target(..., mesh=)`), the drafter trains
        there: parameters and optimizer state split over `data` as FSDP and over `model` like the target's
        layers, each step's sequences split over `data` (batch_size must divide by it); the losses and
        weights equal a one-device run's within float32 rounding, and checkpoints resume on any mesh.
      train_sequences: (ids [S] int32, prompt_len) pairs; the response follows the prompt.
      val_sequences: held-out pairs for validation (may be empty).
      out_dir: run directory: features/ (the cache), checkpoints/, metrics.jsonl, drafter/ (the export).
      resume: continue from the latest checkpoint in out_dir (else start over, deleting old checkpoints).
      console: where the progress bars go (default stderr).
      on_step: called with the step count after every step (before the stop check).

    Returns:
      The TrainResult; `interrupted` is set when a signal stopped the run (a checkpoint was saved).

    Raises:
      ValueError: for too few usable sequences, a batch_size the mesh's `data` axis does not divide, or a
        checkpoint of another run.
    """
    console = console or Console(stderr=True)
    out_dir = Path(out_dir)
    data = pad_sequences(train_sequences, config.max_seq_len)
    val = pad_sequences(val_sequences[: config.max_val_sequences], config.max_seq_len)
    if len(data) < config.batch_size:
        raise ValueError(
            f"{len(data)} usable training sequences (with a response inside max_seq_len="
            f"{config.max_seq_len}) for batch_size {config.batch_size}; add data or lower batch_size"
        )
    total_steps = config.steps or config.epochs * (len(data) // config.batch_size)
    console.print(
        f"{len(data)} training sequences ({len(train_sequences) - len(data)} without a response inside "
        f"max_seq_len={config.max_seq_len} dropped, {int((data.lengths == config.max_seq_len).sum())} "
        f"filling it), {len(val)} validation; "
        f"{total_steps} steps of {config.batch_size} sequences x {config.anchors_per_seq} blocks"
    )
    drafter_config = config.drafter_config(target)
    drafter_config.check_target(target.config)
    parent = resolve_drafter_dir(config.init_from, target.name) if config.init == "drafter" else None
    draft_vocab = None
    if config.draft_vocab_from == "warm_start":
        draft_vocab = warm_start_vocab(parent, config.draft_vocab_size)
        console.print(f"draft vocabulary: the {len(draft_vocab)} tokens of the drafter it starts from")
    elif config.draft_vocab_size:
        # What the drafter is trained to draft: the responses, as truncated to max_seq_len.
        responses = ((t[:n], p) for t, p, n in zip(data.tokens, data.prompt_lens, data.lengths))
        draft_vocab = frequent_tokens(responses, config.draft_vocab_size, target.config.vocab_size)
        console.print(f"draft vocabulary: the {len(draft_vocab)} most frequent response tokens")
    vocab_key = None if draft_vocab is None else tuple(draft_vocab.tolist())
    if target.mesh is not None:
        if isinstance(drafter_config, DartConfig):
            raise ValueError("DART trains on one device for now: leave out --mesh (DFlash trains on a mesh)")
        TrainingSharding.for_drafter(drafter_config.layers, target.mesh).check_batch(config.batch_size)
    programs = programs_for(drafter_config, target.module, config, total_steps, vocab_key, target.mesh)
    state = _initial_state(programs.module, programs.tx, config, target, parent, console)
    place_batch = (lambda batch: batch) if programs.sharding is None else programs.sharding.place_batch
    if programs.sharding is not None:
        state = programs.sharding.place_state(state)

    ckpt_dir = out_dir / "checkpoints"
    if not resume and ckpt_dir.exists():
        console.print(f"--no-resume: deleting {ckpt_dir}")
        shutil.rmtree(ckpt_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    manager = checkpoint_manager(ckpt_dir)
    meta = order_meta(config, len(data), total_steps)
    if manager.latest_step() is not None:
        onto = state if programs.sharding is None else programs.sharding.abstract_state(state)
        state = restore_state(manager, onto, meta)
        console.print(f"resuming {ckpt_dir} at step {int(state.step)} of {total_steps}")
    else:  # a fresh start: no report of an earlier run; a warm start keeps its parent's record now,
        # before anything ships over it
        for stale in (TRAINING_RECORD, PLOT):
            (out_dir / stale).unlink(missing_ok=True)
        record_warm_start(out_dir, config.init_from, parent)

    def save(step: int) -> None:
        if manager.latest_step() != step:
            args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
            manager.save(step, args=args)

    log, pending, tokens, tau = [], [], 0, None
    step = int(state.step)
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeRemainingColumn(),
        console=console,
    )

    def record(entry: dict) -> None:
        log.append(entry)
        log_file.write(json.dumps(entry) + "\n")
        log_file.flush()

    with StopFlag() as stop, progress, (out_dir / METRICS).open("a" if resume else "w") as log_file:
        if config.feature_source == "step":
            on_device = functools.partial(DeviceFeatures, programs.batch_features, target.params)
            features = on_device(data.tokens, data.lengths)
            val_features = on_device(val.tokens, val.lengths) if len(val) else None
        else:
            fill = functools.partial(
                cache_features,
                target=target,
                weights=weights_fingerprint(target),
                dtype=config.feature_dtype,
                taps=programs.taps,
                compute=programs.features,
                rows=config.feature_rows,
                pack_tokens=config.feature_tokens,
                progress=progress,
                should_stop=lambda: stop.signum is not None,
            )
            cache_dir = Path(config.feature_cache_dir) if config.feature_cache_dir else out_dir / "features"
            features = fill(cache_dir / "train.npy", data.tokens, data.lengths)
            val_features = fill(cache_dir / "validation.npy", val.tokens, val.lengths) if len(val) else None
        task = progress.add_task(
            "training", total=total_steps, completed=step, info="compiling ..." if step < total_steps else ""
        )
        t0 = time.perf_counter()
        while step < total_steps and stop.signum is None:
            index = batch_index(len(data), config.batch_size, config.seed, step)
            batch = data.take(index, features, data.width(index, config.length_bucket))
            tokens += int(batch["lengths"].sum())
            state, metrics = programs.train_step(state, target.params, place_batch(batch))
            step += 1
            pending.append(metrics)
            if step % config.log_every == 0 or step == total_steps:
                jax.block_until_ready(state)  # time whole steps: a step's metrics are ready before its update
                entry = _summary(pending, tokens, time.perf_counter() - t0, step)
                record(entry)
                progress.update(task, info=_progress_text(entry, tau))
                if not console.is_terminal:  # a log file (nohup) gets a line where a terminal gets the bar
                    console.print(f"step {step}/{total_steps}  {_progress_text(entry, tau)}")
                pending, tokens = [], 0
            if val_features is not None and (step % config.validate_every == 0 or step == total_steps):
                entry = validation_pass(
                    programs.eval_step,
                    state.params,
                    target.params,
                    val,
                    val_features,
                    config.batch_size,
                    config.seed,
                    place_batch,
                )
                tau = entry["val_tau"]
                record({"step": step, **entry})
                write_report(out_dir, config.to_dict(), total_steps)
            if step % config.checkpoint_every == 0:
                save(step)
            if not pending:
                t0 = time.perf_counter()
            progress.update(task, completed=step)
            if on_step is not None:
                on_step(step)
        save(step)

    manager.close()
    params = jax.device_get(state.params)
    if step < total_steps:
        console.print(f"stopped by signal {stop.signum} at step {step}; checkpoint saved, rerun to resume")
        return TrainResult(step, total_steps, stop.signum, params, None, log)
    drafter_dir = out_dir / "drafter"
    layers = target.config.num_layers
    if isinstance(drafter_config, DartConfig):
        responses = ((t[:n], p) for t, p, n in zip(data.tokens, data.prompt_lens, data.lengths))
        tables = response_ngram_tables(responses, config.ngram_min_count)
        save_dart(drafter_dir, drafter_config, params, layers, config.export_dtype, draft_vocab, tables)
    else:
        save_drafter(drafter_dir, drafter_config, params, layers, config.export_dtype, draft_vocab)
    for name in (TRAINING_RECORD, PLOT):  # the measured acceptance travels with the weights
        if (out_dir / name).is_file():
            shutil.copy(out_dir / name, drafter_dir / name)
        else:  # not an earlier export's
            (drafter_dir / name).unlink(missing_ok=True)
    console.print(f"drafter ({config.export_dtype}) written to {drafter_dir}")
    return TrainResult(step, total_steps, None, params, drafter_dir, log)
