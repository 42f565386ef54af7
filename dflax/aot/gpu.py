"""NVIDIA GPUs to compile for on a host without one (the CUDA PJRT plugin's deviceless compile).

`get_topology_desc(platform="cuda", target_config=...)` takes a `GpuTargetConfigProto` in text form that
describes the card; XLA then compiles as for that card, Triton -> PTX -> ptxas included. Needs the
gpu-aot extra (jax-cuda12-plugin, jax-cuda12-pjrt, nvidia-cuda-nvcc-cu12) and JAX_PLATFORMS=cpu, since the
plugin otherwise tries to start CUDA. No autotuning happens without the card, and cost_analysis is None.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
from typing import Any

from jax.experimental import topologies


class GpuCompilerUnavailableError(RuntimeError):
    """The CUDA plugin (the GPU compiler) is not installed or cannot start here."""


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    """What XLA needs to know about a card (public datasheet values)."""

    description: str
    major: int
    minor: int
    core_count: int
    fpus_per_core: int
    shared_memory_per_core: int
    shared_memory_per_block_optin: int
    memory_bandwidth: int  # bytes/s
    l2_cache_size: int
    clock_rate_ghz: float
    device_memory_size: int

    def target_config(self) -> str:
        """The GpuTargetConfigProto text of this card."""
        return f"""
gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {self.shared_memory_per_core}
  threads_per_core_limit: 2048
  core_count: {self.core_count}
  fpus_per_core: {self.fpus_per_core}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {self.memory_bandwidth}
  l2_cache_size: {self.l2_cache_size}
  clock_rate_ghz: {self.clock_rate_ghz}
  device_memory_size: {self.device_memory_size}
  shared_memory_per_block_optin: {self.shared_memory_per_block_optin}
  cuda_compute_capability {{ major: {self.major} minor: {self.minor} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
device_description_str: "{self.description}"
"""


GPUS = {
    "h100": GpuSpec(
        "NVIDIA H100 80GB HBM3",
        9,
        0,
        132,
        128,
        233472,
        232448,
        3_352_320_000_000,
        50 * 2**20,
        1.98,
        80 * 2**30,
    ),
    "a100": GpuSpec(
        "NVIDIA A100-SXM4-80GB",
        8,
        0,
        108,
        64,
        167936,
        166912,
        2_039_000_000_000,
        40 * 2**20,
        1.41,
        80 * 2**30,
    ),
}


@functools.cache
def gpu_topology(card: str = "h100", devices: int = 1) -> Any:
    """`devices` GPUs of a named card (see GPUS) on one host, for compiling only.

    Raises:
      GpuCompilerUnavailableError: when the CUDA plugin is missing or refuses to start, naming the fix.
    """
    if card not in GPUS:
        raise ValueError(f"unknown card {card!r}; choose one of {', '.join(GPUS)}")
    if importlib.util.find_spec("jax_cuda12_plugin") is None:
        raise GpuCompilerUnavailableError(
            "compiling for GPU needs the CUDA plugin: pip install 'dflax[gpu-aot]', and JAX_PLATFORMS=cpu"
        )
    try:
        return topologies.get_topology_desc(
            platform="cuda", topology=f"1x1x{devices}", target_config=GPUS[card].target_config()
        )
    except Exception as e:  # the plugin reports a failed start as several exception types
        raise GpuCompilerUnavailableError(f"the CUDA plugin could not describe a {card}: {e}") from e
