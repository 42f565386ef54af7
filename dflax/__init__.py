"""dflax: lossless speculative decoding with diffusion-style drafters, in JAX/Flax.

Public API:
  load_target(name_or_path, dtype=None, mesh=None) -> Target (mesh: "data=D,model=M" or make_mesh(...))
  load_drafter(path_or_name, target, ...)-> Drafter (DFlash), or DartDrafterBound for a DART directory
  load_dart(path_or_name, target, ...)   -> DartDrafterBound (DART; "untrained" for a random one)
  prompt_lookup(block_size=...)          -> LookupDrafter (training-free prompt lookup)
  generate(target, prompts, drafter=None, tree_budget=None, ...) -> list[GenerationResult]
  SamplingParams, ModelConfig, Target, GenerationResult
  enable_compilation_cache()             -> keep compiled programs on disk across runs
"""

from dflax.decoding.sampling import SamplingParams
from dflax.drafters import (
    DartDrafterBound,
    Drafter,
    DraftSampling,
    LookupDrafter,
    load_dart,
    load_drafter,
    prompt_lookup,
)
from dflax.generation import PromptTooLongError, generate
from dflax.models.config import ModelConfig, UnsupportedArchitectureError
from dflax.paths import enable_compilation_cache
from dflax.runtime.results import GenerationResult
from dflax.sharding import MeshShape, make_mesh
from dflax.target import Target, load_target

__all__ = [
    "DartDrafterBound",
    "DraftSampling",
    "Drafter",
    "load_dart",
    "load_drafter",
    "LookupDrafter",
    "prompt_lookup",
    "GenerationResult",
    "ModelConfig",
    "PromptTooLongError",
    "SamplingParams",
    "Target",
    "UnsupportedArchitectureError",
    "enable_compilation_cache",
    "generate",
    "load_target",
    "make_mesh",
    "MeshShape",
]
