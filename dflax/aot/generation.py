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
from jax.sharding import Mesh

from dflax.aot.models import ModelPlan
from dflax.aot.topology import on_device
from dflax.checkpoints.params import abstract_params
from dflax.decoding.decode import decode_loop, decode_step, prefill
from dflax.decoding.sampling import SamplingParams
from dflax.drafters.dflash import DFlashDrafter, DFlashProposer, DraftSampling, init_drafter_params
from dflax.models.cache import KVCache
from dflax.models.transformer import Transformer
from dflax.sharding import ShardingRules, mesh_shape
from dflax.sharding.programs import sharded_prefill, sharded_state_step

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
    device: jax.Device | None = None,
    *,
    mesh: Mesh | None = None,
    dtype: jnp.dtype = jnp.bfloat16,
    attention_backend: str = "pallas",
    stages: tuple[str, ...] = STAGES,
) -> dict[str, CompiledStage]:
    """Compiles the prefill, one decode step and the decode loop of a target (+ drafter) for `device`, or
    sharded over `mesh` as `dflax.generation` runs a target loaded on a mesh.

    Args:
      plan: the target and drafter configs (see `dflax.aot.models.model_plan`).
      shape: batch, prompt bucket, budget and block size (the batch must divide over the mesh's `data`).
      device: the device compiled for, e.g. `tpu_topology("v5e:2x2").devices[0]`.
      mesh: instead of `device`, a (data, model) mesh of devices to compile for (`dflax.sharding.make_mesh`
        over a topology's devices); parameters, caches and rows are placed by `dflax.sharding.rules`.
      dtype: parameter, cache and activation dtype.
      attention_backend: a `dflax.models.attention` setting; "pallas" means the kernel of device's platform.
      stages: which of STAGES to compile.

    Returns:
      stage name -> the stage lowered and compiled.
    """
    unknown = set(stages) - set(STAGES)
    if unknown:
        raise ValueError(f"unknown stages {sorted(unknown)}; choose from {STAGES}")
    if (device is None) == (mesh is None):
        raise ValueError("compile for one device or for a mesh: give exactly one of device and mesh")
    if mesh is not None:
        return _compile_on_mesh(plan, shape, mesh, dtype, attention_backend, stages)
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


def _placed(tree, shardings):
    """ShapeDtypeStructs of a pytree's arrays carrying the matching shardings, or one sharding for all
    (nothing is allocated)."""
    if isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings), tree)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def _compile_on_mesh(plan, shape, mesh, dtype, attention_backend, stages) -> dict[str, CompiledStage]:
    """`compile_generation` over a mesh: the sharded programs of dflax.sharding.placement."""
    data = mesh_shape(mesh).data
    if shape.batch % data:
        raise ValueError(f"batch {shape.batch} does not split over data={data}; use a multiple of {data}")
    backend = kernel_setting(attention_backend, mesh.devices.flat[0].platform)
    target = Transformer(plan.target, dtype=dtype, attention_backend=backend)
    rules = ShardingRules.for_model(plan.target, mesh)
    proposer, drafter_params = None, None
    if plan.drafter is not None:
        drafter = DFlashDrafter(plan.drafter, dtype, backend)
        drafter_params = jax.eval_shape(
            lambda: init_drafter_params(drafter.clone(attention_backend="reference"))
        )
        drafter_params = _placed(
            drafter_params, ShardingRules.for_model(plan.drafter.layers, mesh).param_shardings(drafter_params)
        )
        proposer = DFlashProposer(drafter, target, shape.block_size, DraftSampling(), plan.draft_vocab)
    b, p = shape.batch, shape.prompt_len
    num_draft = proposer.num_draft if proposer else 0
    eos = max(1, len(plan.target.eos_token_ids))
    params = _target_params(target)
    cache = jax.eval_shape(lambda: KVCache.init(plan.target, b, shape.slots(num_draft), dtype))
    rows = rules.rows()
    sampling = _placed(jax.eval_shape(SamplingParams.make), rules.replicated())
    args = (
        _placed(params, rules.param_shardings(params)),
        jax.ShapeDtypeStruct((b, p), jnp.int32, sharding=rows),  # prompt tokens [B, P]
        jax.ShapeDtypeStruct((b,), jnp.int32, sharding=rows),  # prompt lengths [B]
        _placed(cache, rules.state_shardings(cache)),
        jax.ShapeDtypeStruct((b,), jnp.int32, sharding=rows),  # budgets [B]
        _placed(jax.eval_shape(lambda: jax.vmap(jax.random.key)(jnp.zeros((b,), jnp.uint32))), rows),
        jax.ShapeDtypeStruct((eos,), jnp.int32, sharding=rules.replicated()),  # eos ids [E]
        sampling,
        drafter_params,
    )
    prefill_fn = sharded_prefill(target, rules, proposer, max_tokens=shape.max_new_tokens)
    out = {}
    if "prefill" in stages:
        lowered = prefill_fn.lower(*args)
        out["prefill"] = CompiledStage(lowered, lowered.compile())
    with jax.set_mesh(mesh):
        state = jax.eval_shape(prefill_fn.jitted, *args)
    state = _placed(state, rules.state_shardings(state))
    for stage, fn in (("decode_step", decode_step), ("decode_loop", decode_loop)):
        if stage in stages:
            lowered = sharded_state_step(fn, target, rules, proposer).lower(args[0], state, sampling, args[8])
            out[stage] = CompiledStage(lowered, lowered.compile())
    return out
