"""Ahead-of-time compilation for TPUs (and GPUs) on a machine without them (deviceless compiles).

The TPU compiler, Mosaic included, runs on this host: kernels and whole generation programs are compiled
for a named TPU topology from shapes alone, and the compiler reports their memory and cost.
"""

from dflax.aot.generation import STAGES, CompiledStage, StepShape, compile_generation
from dflax.aot.models import PRESETS, ModelPlan, model_plan
from dflax.aot.plan import plan
from dflax.aot.report import CompiledNumbers, markdown_table
from dflax.aot.sharded_plan import StagePlan, plan_sharded, sharded_table
from dflax.aot.topology import TpuCompilerUnavailableError, on_device, tpu_topology

__all__ = [
    # Topologies and abstract inputs.
    "tpu_topology",
    "on_device",
    "TpuCompilerUnavailableError",
    # What to compile.
    "PRESETS",
    "ModelPlan",
    "model_plan",
    "StepShape",
    "STAGES",
    # Compiling and reporting.
    "compile_generation",
    "CompiledStage",
    "plan",
    "CompiledNumbers",
    "markdown_table",
    # Sharded over a mesh of abstract devices (`dflax plan --mesh`).
    "plan_sharded",
    "StagePlan",
    "sharded_table",
]
