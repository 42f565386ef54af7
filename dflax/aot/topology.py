"""TPU topologies for compiling ahead of time on a host without TPUs (libtpu's deviceless compile).

`jax.experimental.topologies.get_topology_desc` asks libtpu for the devices of a named slice ("v5e:2x2",
"v5p:2x2x1", "v6e:2x2"); arguments placed on one of them (`ShapeDtypeStruct(..., sharding=...)`) make
`jax.jit(f).lower(...).compile()` run the real TPU compiler, Mosaic included, with no chip attached.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Any

import jax
from jax.experimental import topologies
from jax.sharding import SingleDeviceSharding

DEFAULT_TOPOLOGY = "v5e:2x2"


class TpuCompilerUnavailableError(RuntimeError):
    """libtpu (the TPU compiler) is not installed or cannot start here."""


@functools.cache
def tpu_topology(name: str = DEFAULT_TOPOLOGY) -> Any:
    """The devices of a TPU slice, for compiling only (cached: libtpu starts once per process).

    Args:
      name: a TPU topology such as "v5e:2x2", "v5p:2x2x1" or "v6e:2x2".

    Returns:
      A jax TopologyDescription; its `.devices` are TPU devices that can be compiled for.

    Raises:
      TpuCompilerUnavailableError: when libtpu is missing or refuses to start, naming the fix.
    """
    if importlib.util.find_spec("libtpu") is None:
        raise TpuCompilerUnavailableError(
            "compiling for TPU needs libtpu: pip install 'dflax[tpu-aot]' (or pip install libtpu)"
        )
    # Any process that imports jax with libtpu installed may hold libtpu's lock file; compiling only
    # touches no chip, so sharing the library with such processes is safe.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        return topologies.get_topology_desc(topology_name=name, platform="tpu")
    except Exception as e:  # libtpu reports a bad name or a failed start as several exception types
        raise TpuCompilerUnavailableError(f"libtpu could not describe TPU topology {name!r}: {e}") from e


def on_device(tree: Any, device: jax.Device) -> Any:
    """Shape-and-dtype stand-ins of a pytree's arrays, placed on `device` (nothing is allocated).

    Args:
      tree: a pytree of arrays or ShapeDtypeStructs.
      device: where the compiled program will find them (e.g. `tpu_topology().devices[0]`).

    Returns:
      The same pytree of `jax.ShapeDtypeStruct`s carrying a SingleDeviceSharding on `device`.
    """
    sharding = SingleDeviceSharding(device)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)
