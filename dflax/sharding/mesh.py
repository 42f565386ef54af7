"""The device mesh of a sharded run: `data` splits batch rows, `model` splits heads, FFN and vocabulary.

A mesh is written `data=D,model=M` on the command line; D * M devices are taken in order from
`jax.devices()` (or from the devices given, e.g. a TPU topology's abstract devices for compiling ahead of
time). Both axes are `Auto`: jit's sharding propagation (GSPMD) places everything the inputs do not fix.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

DATA, MODEL = "data", "model"
MESH_AXES = (DATA, MODEL)


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """How many devices each mesh axis has.

    Attributes:
      data: devices along `data` (batch rows are split D ways; a batch is padded to a multiple of D).
      model: devices along `model` (tensor parallel: attention heads, KV heads, FFN, vocabulary).
    """

    data: int = 1
    model: int = 1

    def __post_init__(self):
        if self.data < 1 or self.model < 1:
            raise ValueError(
                f"mesh axes need at least one device each, got data={self.data}, model={self.model}"
            )

    @property
    def devices(self) -> int:
        """D * M, the devices the mesh spans."""
        return self.data * self.model

    @classmethod
    def parse(cls, text: str) -> MeshShape:
        """Reads "data=D,model=M" (either part may be left out: it is then 1).

        Raises:
          ValueError: naming the expected form, for anything else.
        """
        sizes = {}
        for part in (p.strip() for p in text.split(",") if p.strip()):
            match = re.fullmatch(r"(data|model)=(\d+)", part)
            if match is None or match.group(1) in sizes:
                raise ValueError(
                    f"mesh {text!r}: write it as data=D,model=M with positive integers, e.g. data=2,model=4"
                )
            sizes[match.group(1)] = int(match.group(2))
        if not sizes:
            raise ValueError(f"mesh {text!r}: write it as data=D,model=M, e.g. data=2,model=4")
        return cls(**sizes)

    def __str__(self) -> str:
        return f"data={self.data},model={self.model}"


def make_mesh(shape: MeshShape | str, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (data, model) mesh over the first D * M of `devices` (default: `jax.devices()`).

    Raises:
      ValueError: when there are fewer devices than the mesh needs, with the fix.
    """
    shape = MeshShape.parse(shape) if isinstance(shape, str) else shape
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) < shape.devices:
        raise ValueError(
            f"mesh {shape} needs {shape.devices} devices but {len(devices)} are available; use a smaller "
            "mesh (a CPU fakes N devices with XLA_FLAGS=--xla_force_host_platform_device_count=N)"
        )
    grid = np.asarray(devices[: shape.devices], dtype=object).reshape(shape.data, shape.model)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto, AxisType.Auto))


def mesh_shape(mesh: Mesh) -> MeshShape:
    """The MeshShape of a dflax mesh.

    Raises:
      ValueError: for a mesh without the `data` and `model` axes.
    """
    if tuple(mesh.axis_names) != MESH_AXES:
        raise ValueError(
            f"dflax needs a mesh with axes {MESH_AXES}, got {tuple(mesh.axis_names)}; use make_mesh"
        )
    return MeshShape(mesh.shape[DATA], mesh.shape[MODEL])
