"""Compiles dflax's generation programs for a device without running them: prefill, one decode step and
the whole decode loop, exactly as `dflax.generation` jits them, from configs alone (no weights).

Parameters, caches and the loop state are `jax.ShapeDtypeStruct`s placed on the target device, so the
compile sees the real shapes and dtypes and allocates nothing.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from dflax.aot.models import ModelPlan
from dflax.aot.topology import on_device
from dflax.checkpoints.params import abstract_params
from dflax.decoding.cache import KVCache
from dflax.decoding.decode import decode_loop, decode_step, prefill
from dflax.decoding.sampling import SamplingParams
from dflax.drafters.dflash import DFlashDrafter, DFlashProposer, DraftSampling, init_drafter_params
from dflax.models.transformer import Transformer

STAGES = ("prefill", "decode_step", "decode_loop")


class CompiledStage(NamedTuple):
    """One stage as lowered (StableHLO, with the Pallas kernels' custom calls) and as compiled for the
    device (memory_analysis, cost_analysis). Read the program from `lowered`: with libtpu newer than
    jaxlib, `compiled.as_text()` can fail to parse the TPU compiler's HLO."""

    lowered: jax.stages.Lowered
    compiled: jax.stages.Compiled


_KERNEL_SETTING = {"tpu": "pallas_tpu", "gpu": "pallas_gpu", "cuda": "pallas_gpu", "rocm": "pallas_gpu"}


@dataclasses.dataclass(frozen=True)
class StepShape:
    """The static shapes a generation call compiles for (`dflax.generation` buckets prompts the same way).

    Attributes:
      batch: rows decoded together.
      prompt_len: the prompt bucket P (prefill processes B x P tokens).
      max_new_tokens: new-token budget M per row.
      block_size: tokens verified per step with a drafter (the anchor + block_size - 1 drafts).
    """

    batch: int = 1
    prompt_len: int = 1024
    max_new_tokens: int = 256
    block_size: int = 16

    def __post_init__(self):
        for name in ("batch", "prompt_len", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)}")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (the anchor plus a draft), got {self.block_size}")

    def slots(self, num_draft: int) -> int:
        """Cache slots S: prompt, budget and one verify block of headroom, rounded up to 64 as generation."""
        return -(-(self.prompt_len + self.max_new_tokens + num_draft + 1) // 64) * 64


def kernel_setting(attention_backend: str, platform: str) -> str:
    """ "pallas" -> the Pallas kernel of the platform compiled for ("pallas_tpu" / "pallas_gpu"); other
    settings pass through."""
    if attention_backend != "pallas":
        return attention_backend
    if platform not in _KERNEL_SETTING:
        raise ValueError(f"attention_backend='pallas' has no kernel for platform {platform!r}")
    return _KERNEL_SETTING[platform]


def _target_params(module: Transformer) -> dict:
    """The target's parameter tree as ShapeDtypeStructs (traced with the reference attention)."""
    return abstract_params(module.clone(attention_backend="reference"))


def compile_generation(
    plan: ModelPlan,
    shape: StepShape,
    device: jax.Device,
    *,
    dtype: jnp.dtype = jnp.bfloat16,
    attention_backend: str = "pallas",
    stages: tuple[str, ...] = STAGES,
) -> dict[str, CompiledStage]:
    """Compiles the prefill, one decode step and the decode loop of a target (+ drafter) for `device`.

    Args:
      plan: the target and drafter configs (see `dflax.aot.models.model_plan`).
      shape: batch, prompt bucket, budget and block size.
      device: the device compiled for, e.g. `tpu_topology("v5e:2x2").devices[0]`.
      dtype: parameter, cache and activation dtype.
      attention_backend: a `dflax.models.attention` setting; "pallas" means the kernel of device's platform.
      stages: which of STAGES to compile.

    Returns:
      stage name -> the stage lowered and compiled.
    """
    unknown = set(stages) - set(STAGES)
    if unknown:
        raise ValueError(f"unknown stages {sorted(unknown)}; choose from {STAGES}")
    backend = kernel_setting(attention_backend, device.platform)
    target = Transformer(plan.target, dtype=dtype, attention_backend=backend)
    proposer, drafter_params = None, None
    if plan.drafter is not None:
        drafter = DFlashDrafter(plan.drafter, dtype, backend)
        drafter_params = jax.eval_shape(
            lambda: init_drafter_params(drafter.clone(attention_backend="reference"))
        )
        proposer = DFlashProposer(drafter, target, shape.block_size, DraftSampling(), plan.draft_vocab)
    b, p = shape.batch, shape.prompt_len
    num_draft = proposer.num_draft if proposer else 0
    eos = max(1, len(plan.target.eos_token_ids))
    args = on_device(
        (
            _target_params(target),
            jax.ShapeDtypeStruct((b, p), jnp.int32),  # prompt tokens [B, P]
            jax.ShapeDtypeStruct((b,), jnp.int32),  # prompt lengths [B]
            jax.eval_shape(lambda: KVCache.init(plan.target, b, shape.slots(num_draft), dtype)),
            jax.ShapeDtypeStruct((b,), jnp.int32),  # budgets [B]
            jax.eval_shape(lambda: jax.vmap(jax.random.key)(jnp.zeros((b,), jnp.uint32))),  # row keys [B]
            jax.ShapeDtypeStruct((eos,), jnp.int32),  # eos ids [E]
            jax.eval_shape(SamplingParams.make),
            drafter_params,
        ),
        device,
    )
    params, sampling, drafter_args = args[0], args[7], args[8]
    prefill_fn = jax.jit(
        functools.partial(prefill, target, proposer=proposer, max_tokens=shape.max_new_tokens),
        donate_argnames=("cache",),
    )
    out = {}
    if "prefill" in stages:
        lowered = prefill_fn.lower(*args)
        out["prefill"] = CompiledStage(lowered, lowered.compile())
    state = on_device(jax.eval_shape(prefill_fn, *args), device)
    for stage, fn in (("decode_step", decode_step), ("decode_loop", decode_loop)):
        if stage in stages:
            jitted = jax.jit(functools.partial(fn, target, proposer=proposer), donate_argnames=("state",))
            lowered = jitted.lower(params, state, sampling, drafter_args)
            out[stage] = CompiledStage(lowered, lowered.compile())
    return out
