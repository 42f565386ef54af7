"""`dflax plan`: compile a configuration's generation programs for a TPU topology and report the compiler's
memory and cost numbers, without a TPU."""

from __future__ import annotations

import jax.numpy as jnp

from dflax.aot.generation import STAGES, StepShape, compile_generation
from dflax.aot.models import model_plan
from dflax.aot.report import CompiledNumbers
from dflax.aot.topology import tpu_topology

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


def plan(
    model: str,
    *,
    drafter: str | None = None,
    topology: str = "v5e:2x2",
    shape: StepShape = StepShape(),
    dtype: str = "bfloat16",
    attention_backend: str = "pallas",
    stages: tuple[str, ...] = STAGES,
) -> list[tuple[str, str, CompiledNumbers]]:
    """Compiles generation for one device of a TPU topology and returns its numbers per stage.

    Args:
      model: a preset of `dflax.aot.models.PRESETS`, a built-in target, an HF directory or a config.json.
      drafter: "none", "untrained", "shipped" or a drafter directory; None = the preset's (else "none").
      topology: TPU topology name, e.g. "v5e:2x2", "v5p:2x2x1", "v6e:2x2".
      shape: batch, prompt bucket, new-token budget and block size.
      dtype: "bfloat16" or "float32".
      attention_backend: "pallas" (the TPU kernel) or "reference".
      stages: any of STAGES.

    Returns:
      (model, stage, numbers) rows.

    Raises:
      TpuCompilerUnavailableError: without libtpu.
      ValueError / FileNotFoundError: for a bad model, drafter or option.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} unknown; choose one of {', '.join(DTYPES)}")
    device = tpu_topology(topology).devices[0]
    compiled = compile_generation(
        model_plan(model, drafter),
        shape,
        device,
        dtype=DTYPES[dtype],
        attention_backend=attention_backend,
        stages=stages,
    )
    return [(model, stage, CompiledNumbers.of(done.compiled)) for stage, done in compiled.items()]
