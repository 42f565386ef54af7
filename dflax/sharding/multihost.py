"""Several processes (hosts) driving one mesh: `jax.distributed.initialize` wiring and the two host-side
exchanges a batch generation needs.

Every process runs the same program on the same global batch (SPMD): each reads the whole prompt file and
builds the same host arrays, and `jax.device_put` hands each device its shard. A mesh then spans every
process's devices (`jax.devices()` lists them all), so `model` and `data` may cross hosts. Results come
back to every process (`to_host`), and each writes the rows it owns to its own output file; the ids done
by any process are shared before a run (`any_process`), so every process resumes with the same batches.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils


def initialize(coordinator: str, num_processes: int, process_id: int) -> None:
    """Joins the run of `num_processes` processes coordinated by process 0 at `coordinator` ("host:port").

    Must run before jax first touches a device. On CPUs the processes exchange data through gloo
    collectives (set here where the installed jax defaults to none).

    Raises:
      ValueError: for a malformed address or a process id outside 0 .. num_processes - 1, with the fix.
    """
    if not re.fullmatch(r"[^:\s]+:\d+", coordinator):
        raise ValueError(f"--coordinator {coordinator!r}: give host:port of process 0, e.g. 10.0.0.1:1234")
    if num_processes < 1 or not 0 <= process_id < num_processes:
        raise ValueError(
            f"--process-id {process_id} with --num-processes {num_processes}: give each of the "
            f"{num_processes} processes one id in 0 .. {num_processes - 1}"
        )
    if jax.config.jax_cpu_collectives_implementation in (None, "none"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes, process_id)


def to_host(x: jax.Array) -> np.ndarray:
    """The whole value of an array, also when other processes hold some of its shards."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def any_process(flags: Sequence[bool] | np.ndarray) -> np.ndarray:
    """Element-wise OR of a bool vector over all processes (each passes its own; same length everywhere)."""
    if jax.process_count() == 1:
        return np.asarray(flags, bool)
    gathered = multihost_utils.process_allgather(np.asarray(flags, np.int32))  # [processes, N]
    return np.asarray(gathered).reshape(jax.process_count(), -1).any(axis=0)
