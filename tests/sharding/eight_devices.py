"""Shared by the sharding tests: run a worker script in a process with 8 fake CPU devices, and read how
a compiled program split a parameter.

jax fixes its device count when it starts, so each worker runs in its own process started with
XLA_FLAGS=--xla_force_host_platform_device_count=8; the rest of the suite keeps one device.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def fake_devices_env(count: int) -> dict:
    """This process's environment for a subprocess that sees `count` fake CPU devices: the device count is
    added to the XLA flags already set (conftest's), and dflax and the test helpers are importable."""
    env = dict(os.environ)
    env.update(
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=(env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={count}").strip(),
        PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE.parent), env.get("PYTHONPATH", "")]),
    )
    return env


def run_on_8_devices(worker: str, spec: dict, timeout: int) -> dict:
    """Runs `worker` (a script beside this file) with the JSON `spec` and returns its last stdout line as
    JSON, after checking it ran on 8 devices."""
    env = fake_devices_env(8)
    done = subprocess.run(
        [sys.executable, str(HERE / worker), json.dumps(spec)],
        capture_output=True, text=True, env=env, timeout=timeout,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["devices"] == 8, report["devices"]
    return report


def split_dims(shards: dict, name: str) -> list[int]:
    """How many ways each dimension of a parameter is split in the compiled program ({name: [shard
    shape, full shape]})."""
    shard, full = shards[name]
    return [f // s for s, f in zip(shard, full)]
