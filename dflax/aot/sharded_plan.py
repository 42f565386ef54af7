"""`dflax plan --mesh`: compile generation sharded over N abstract TPU or GPU devices and report, per device,
the bytes of parameters, KV caches and temporaries and a roofline step time.

Parameter and cache bytes are read from the compiled executable: each input's shard shape under the input
sharding the compiler settled on. Temporaries are the compiler's memory_analysis. The roofline charges one
decode step one read of every parameter on the device and of the cache up to the prompt plus half the
budget, against the FLOPs of the block's tokens through those parameters; collectives are left out.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from dflax.aot.chips import Chip, chip_of
from dflax.aot.generation import STAGES, StepShape, compile_generation
from dflax.aot.gpu import gpu_topology
from dflax.aot.models import model_plan
from dflax.aot.plan import DTYPES
from dflax.aot.topology import tpu_topology
from dflax.sharding import MeshShape, make_mesh

# devices -> the v5e slice that has them (a slice of N chips compiles for N devices).
_V5E_SLICES = {1: "v5e:1x1", 4: "v5e:2x2", 8: "v5e:2x4", 16: "v5e:4x4"}


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """One compiled stage on one device of the mesh.

    Attributes:
      stage: prefill, decode_step or decode_loop.
      param_bytes: parameters (target and drafter) held by each device.
      cache_bytes: KV caches (target and drafter) held by each device.
      temp_bytes: the compiler's temporaries per device.
      peak_bytes: arguments + outputs - donated + temporaries, per device (memory_analysis).
      step_s: the roofline time of one decode step (see the module doc).
    """

    stage: str
    param_bytes: int
    cache_bytes: int
    temp_bytes: int
    peak_bytes: int
    step_s: float


def devices_for(platform: str, devices: int, topology: str | None, card: str) -> tuple[list, str | None]:
    """`devices` abstract devices of a TPU topology (default: the v5e slice of that size) or of GPU cards.

    Returns:
      (devices, the TPU topology name or None for GPUs).
    """
    if platform == "tpu":
        topology = topology or _V5E_SLICES.get(devices)
        if topology is None:
            raise ValueError(f"no default v5e slice has {devices} chips; pass --topology, e.g. v5p:2x2x2")
        found = tpu_topology(topology).devices
    elif platform == "cuda":
        found = gpu_topology(card, devices).devices
    else:
        raise ValueError(f"platform {platform!r} unknown; choose tpu or cuda")
    if len(found) < devices:
        raise ValueError(f"{topology or card} has {len(found)} devices, fewer than --devices {devices}")
    return list(found)[:devices], topology


def _per_device_bytes(shardings, infos, select) -> int:
    """Bytes each device holds of the inputs `select` picks (by shape)."""
    total = 0
    for sharding, info in zip(jax.tree.leaves(shardings), jax.tree.leaves(infos)):
        if select(info.shape):
            total += math.prod(sharding.shard_shape(info.shape)) * np.dtype(info.dtype).itemsize
    return total


def _held_bytes(compiled, lowered) -> tuple[int, int]:
    """(parameter bytes, cache bytes) per device, from the executable's input shardings."""
    (shardings, _), (infos, _) = compiled.input_shardings, lowered.args_info
    params = (shardings[0], shardings[-1]), (infos[0], infos[-1])  # target and drafter parameters
    caches = shardings[1:-1], infos[1:-1]  # the cache, or the state holding the caches
    everything = lambda shape: True  # noqa: E731
    is_cache = lambda shape: len(shape) == 4  # noqa: E731
    return _per_device_bytes(*params, everything), _per_device_bytes(*caches, is_cache)


def roofline_step_s(chip: Chip, param_bytes: int, cache_bytes: int, shape: StepShape, rows: int, block: int):
    """One decode step on one device: max(bytes read / bandwidth, FLOPs / peak)."""
    slots = shape.slots(block - 1)
    cache_read = cache_bytes * min(1.0, (shape.prompt_len + shape.max_new_tokens / 2) / slots)
    flops = 2.0 * (param_bytes / 2) * rows * block  # bf16 parameters: 2 bytes each
    return max((param_bytes + cache_read) / chip.bandwidth, flops / chip.bf16_flops)


def plan_sharded(
    model: str,
    *,
    mesh: str,
    platform: str = "tpu",
    devices: int | None = None,
    topology: str | None = None,
    card: str = "h100",
    drafter: str | None = None,
    shape: StepShape = StepShape(),
    dtype: str = "bfloat16",
    attention_backend: str = "pallas",
    stages: tuple[str, ...] = ("decode_step",),
) -> tuple[Chip, StepShape, list[StagePlan]]:
    """Compiles generation over a (data, model) mesh of abstract devices and reports each stage per device.

    Args:
      model: a preset of `dflax.aot.models.PRESETS`, a built-in target, an HF directory or a config.json.
      mesh: "data=D,model=M".
      platform: "tpu" or "cuda".
      devices: abstract devices to take (>= D * M; default D * M).
      topology: the TPU topology (default: the v5e slice of `devices` chips).
      card: the GPU card for platform "cuda" (see dflax.aot.gpu.GPUS).
      drafter: "none", "untrained", "shipped" or a drafter directory; None = the preset's.
      shape: batch (padded up to a multiple of D), prompt bucket, budget and block size.
      dtype: "bfloat16" or "float32".
      attention_backend: "pallas" (the platform's kernel, per device inside shard_map) or "reference".
      stages: any of STAGES.

    Returns:
      (the chip, the shape compiled, one StagePlan per stage).
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} unknown; choose one of {', '.join(DTYPES)}")
    unknown = set(stages) - set(STAGES)
    if unknown:
        raise ValueError(f"unknown stages {sorted(unknown)}; choose from {STAGES}")
    mesh_size = MeshShape.parse(mesh)
    devices = devices or mesh_size.devices
    found, topology = devices_for(platform, devices, topology, card)
    chip = chip_of(platform, topology, card)
    shape = dataclasses.replace(shape, batch=-(-shape.batch // mesh_size.data) * mesh_size.data)
    plan = model_plan(model, drafter)
    compiled = compile_generation(
        plan, shape, mesh=make_mesh(mesh_size, found), dtype=DTYPES[dtype],
        attention_backend=attention_backend, stages=stages,
    )  # fmt: skip
    block = shape.block_size if plan.drafter is not None else 1
    rows = shape.batch // mesh_size.data
    out = []
    for stage, done in compiled.items():
        memory = done.compiled.memory_analysis()
        param_bytes, cache_bytes = _held_bytes(done.compiled, done.lowered)
        peak = (memory.argument_size_in_bytes + memory.output_size_in_bytes - memory.alias_size_in_bytes
                + memory.temp_size_in_bytes)  # fmt: skip
        step = roofline_step_s(chip, param_bytes, cache_bytes, shape, rows, block)
        temp = int(memory.temp_size_in_bytes)
        out.append(StagePlan(stage, param_bytes, cache_bytes, temp, int(peak), step))
    return chip, shape, out


def sharded_table(model: str, mesh: str, chip: Chip, rows: list[StagePlan]) -> str:
    """A markdown table of per-device numbers, one row per stage."""
    header = (
        "| config | mesh | stage | params MiB/device | cache MiB/device | temp MiB | peak MiB | HBM MiB "
        "| roofline step ms |"
    )
    lines = [header, "|" + "---|" * header.count(" | ") + "---|"]
    mib = lambda n: f"{n / 2**20:,.1f}"  # noqa: E731
    for r in rows:
        cells = (model, mesh, r.stage, mib(r.param_bytes), mib(r.cache_bytes), mib(r.temp_bytes),
                 mib(r.peak_bytes), mib(chip.memory_bytes), f"{r.step_s * 1e3:.3g}")  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
