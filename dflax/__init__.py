"""dflax: lossless speculative decoding with diffusion-style drafters, in JAX/Flax.

Public API:
  load_target(name_or_path, dtype=None)  -> Target
  generate(target, prompts, ...)         -> list[GenerationResult]
  SamplingParams, ModelConfig, Target, GenerationResult
"""

from dflax.generation import GenerationResult, PromptTooLongError, generate
from dflax.models.config import ModelConfig, UnsupportedArchitectureError
from dflax.spec.sampling import SamplingParams
from dflax.target import Target, load_target

__all__ = [
    "GenerationResult",
    "ModelConfig",
    "PromptTooLongError",
    "SamplingParams",
    "Target",
    "UnsupportedArchitectureError",
    "generate",
    "load_target",
]
