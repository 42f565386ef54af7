"""dflax: lossless speculative decoding with diffusion-style drafters, in JAX/Flax.

Public API:
  load_target(name_or_path, dtype=None, mesh=None) -> Target (mesh: "data=D,model=M" or make_mesh(...))
  load_drafter(path_or_name, target, ...)-> Drafter (DFlash)
  generate(target, prompts, drafter=None, ...) -> list[GenerationResult]
  SamplingParams, ModelConfig, Target, GenerationResult
"""

from dflax.decoding.sampling import SamplingParams
from dflax.drafters import Drafter, DraftSampling, load_drafter
from dflax.generation import GenerationResult, PromptTooLongError, generate
from dflax.models.config import ModelConfig, UnsupportedArchitectureError
from dflax.sharding import MeshShape, make_mesh
from dflax.target import Target, load_target

__all__ = [
    "DraftSampling",
    "Drafter",
    "load_drafter",
    "GenerationResult",
    "ModelConfig",
    "PromptTooLongError",
    "SamplingParams",
    "Target",
    "UnsupportedArchitectureError",
    "generate",
    "load_target",
    "make_mesh",
    "MeshShape",
]
