"""Checkpoints of a training run: the orbax manager, what a checkpoint must share with the run that
resumes it, and stopping at a step boundary on SIGTERM/SIGINT."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import orbax.checkpoint as ocp

from dflax.train.config import TrainConfig
from dflax.train.steps import TrainState

# What a checkpoint must share with the run it resumes: the start, the data order and the anchors.
ORDER_FIELDS = (
    "seed",
    "init",
    "init_from",
    "init_match",
    "layer_kind",
    "batch_size",
    "max_seq_len",
    "anchors_per_seq",
    "anchor_stride",
    "block_size",
    "draft_vocab_size",
    "length_bucket",
)


class StopFlag:
    """Turns SIGTERM/SIGINT into a request to stop at the next step boundary (main thread only).

    A second signal while the first is pending aborts at once (KeyboardInterrupt), without saving.
    """

    def __init__(self):
        self.signum: int | None = None
        self._previous = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.signum is not None:
            raise KeyboardInterrupt(f"signal {signum} while stopping: aborted without saving")
        self.signum = signum

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def checkpoint_manager(path: Path, max_to_keep: int = 2) -> ocp.CheckpointManager:
    # Synchronous saves: the next step donates the state's buffers.
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, enable_async_checkpointing=False)
    return ocp.CheckpointManager(path.absolute(), options=options)


def order_meta(config: TrainConfig, num_train: int, total_steps: int) -> dict:
    meta = {name: getattr(config, name) for name in ORDER_FIELDS}
    return {**meta, "num_train": num_train, "total_steps": total_steps}


def restore_state(manager: ocp.CheckpointManager, state: TrainState, meta: dict) -> TrainState:
    """The latest checkpoint, after checking it belongs to this run (same data order and schedule).

    `state` gives the structure and where each array goes (arrays, or ShapeDtypeStructs with shardings):
    a checkpoint saved on one mesh restores onto another, each device reading only its own shards.
    """
    step = manager.latest_step()
    restored = manager.restore(
        step, args=ocp.args.Composite(state=ocp.args.StandardRestore(state), meta=ocp.args.JsonRestore())
    )
    diff = {k: (restored.meta.get(k), v) for k, v in meta.items() if restored.meta.get(k) != v}
    if diff:
        raise ValueError(
            f"the checkpoint at step {step} belongs to another run ({{name: (checkpoint, now)}} = {diff}); "
            "use the same config/data/--steps, or --no-resume to start over"
        )
    return restored.state
