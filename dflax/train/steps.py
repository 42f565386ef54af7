"""What a training run compiles: the optimizer, the losses, the jitted train and eval steps and the
target-feature forwards."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from dflax.drafters.dart import DartConfig, DartDrafter
from dflax.drafters.dflash import DFlashConfig, DFlashDrafter, DFlashProposer
from dflax.models.config import ModelConfig
from dflax.models.transformer import Transformer
from dflax.sharding.training import TrainingSharding
from dflax.train import dart_objective, objective
from dflax.train.config import TrainConfig


@struct.dataclass
class TrainState:
    """Everything a step changes (the checkpointed state).

    Attributes:
      params: drafter parameters {"params": ...}.
      opt_state: optax state.
      rng: [2] uint32 key data of the anchor PRNG.
      step: [] int32 steps done.
    """

    params: dict
    opt_state: optax.OptState
    rng: jax.Array
    step: jax.Array


def make_optimizer(config: TrainConfig, total_steps: int) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW on a linear-warmup + cosine schedule to 0."""
    warmup = max(1, round(config.warmup_frac * total_steps))
    schedule = optax.warmup_cosine_decay_schedule(0.0, config.lr, warmup, max(total_steps, warmup + 1))
    return optax.chain(
        optax.clip_by_global_norm(config.clip_norm),
        optax.adamw(schedule, weight_decay=config.weight_decay),
    )


def dflash_taps(drafter: DFlashConfig, target: ModelConfig, reads_target: bool) -> tuple[int, ...]:
    """The target layers a DFlash batch's features hold: the drafter's fused layers, then, when the loss
    reads the target's next-token distribution (`dflash_loss_fn`'s `reads_target` or a distilling recipe),
    the target's last layer."""
    return drafter.target_layer_ids + ((target.num_layers - 1,) if reads_target else ())


def dflash_loss_fn(
    proposer: DFlashProposer,
    config: TrainConfig,
    compute_dtype: str = "float32",
    reads_target: bool = False,
    tree_stats: bool = False,
) -> Callable:
    """DFlash's loss_fn(params, target_params, batch, key) -> (loss, BlockStats) for `make_steps`, its
    products at `compute_dtype` (see COMPUTE_DTYPES). The batch's features end with the target's last
    layer (its next-token distribution) when the recipe distills or `reads_target` is set; then the stats
    carry the acceptance at temperature 1 too. With `tree_stats` (validation) they carry what best-first
    draft trees accept."""
    weights = objective.position_weights(config.block_size, config.loss_gamma)  # [n]
    n = config.block_size - 1
    dtype = jnp.dtype(compute_dtype)

    hidden_size = proposer.target.config.hidden_size

    def loss_fn(params, target_params, batch, key):
        # bf16 compute: the products run on bf16 copies; gradients flow back to the float32 masters.
        params, target_params = jax.tree.map(lambda a: a.astype(dtype), (params, target_params))
        features = batch["features"].astype(dtype)  # [N, S, K * D], then the last layer's D to distill
        final = None
        if config.distill_weight or reads_target:
            features, final = features[..., :-hidden_size], features[..., -hidden_size:]
        blocks = objective.make_blocks(
            key,
            batch["tokens"],
            batch["prompt_lens"],
            batch["lengths"],
            config.anchors_per_seq,
            n,
            config.anchor_stride,
        )
        return objective.dflash_loss(
            proposer,
            params,
            target_params,
            features,
            blocks,
            weights,
            config.logits_chunk,
            config.attention_chunk,
            final,
            config.distill_weight,
            tree_stats,
        )

    return loss_fn


def dart_loss_fn(module: DartDrafter, target: Transformer, vocab, config: TrainConfig) -> Callable:
    """DART's loss_fn(params, target_params, batch, key) -> (loss, BlockStats) for `make_steps`."""

    def loss_fn(params, target_params, batch, key):
        return dart_objective.dart_loss(
            module,
            target,
            vocab,
            params,
            target_params,
            batch,
            key,
            config.anchors_per_seq,
            config.depth_decay,
        )

    return loss_fn


def make_steps(
    loss_fn: Callable,
    tx: optax.GradientTransformation,
    sharding: TrainingSharding | None = None,
    eval_loss_fn: Callable | None = None,
):
    """The jitted train step (state donated) and eval step of a loss (`dflash_loss_fn`, `dart_loss_fn`).

    `eval_loss_fn` (default: `loss_fn`) is what the eval step computes: a bf16-trained drafter is
    validated in float32, the precision it drafts at behind a float32 target.

    With `sharding` the step keeps the new state in its FSDP shards (`dflax.sharding.training`); its inputs
    must already be placed there (`TrainingSharding.place_state` / `place_batch`).

    Returns:
      train_step(state, target_params, batch) -> (state, metrics) and
      eval_step(params, target_params, batch, key) -> (loss, BlockStats).
    """

    def train_step(state: TrainState, target_params, batch):
        rng, key = jax.random.split(jax.random.wrap_key_data(state.rng))
        (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            state.params, target_params, batch, key
        )
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        state = TrainState(
            params=optax.apply_updates(state.params, updates),
            opt_state=opt_state,
            rng=jax.random.key_data(rng),
            step=state.step + 1,
        )
        if sharding is not None:
            state = sharding.constrain_state(state)
        return state, {"loss": loss, "grad_norm": optax.tree.norm(grads), "stats": stats}

    return jax.jit(train_step, donate_argnums=0), jax.jit(eval_loss_fn or loss_fn)


@dataclasses.dataclass(frozen=True)
class Programs:
    """What a run compiles: the drafter, the optimizer and the jitted steps.

    Attributes:
      module: the drafter module (float32 master weights, the differentiable reference attention).
      tx: the optimizer.
      sharding: where the state and batches live on the target's mesh (None: one device).
      train_step, eval_step: see `make_steps`.
      features: (target_params, tokens [rows, S], lengths [rows]) -> [L, K * D] bf16 target features of the
        rows' real tokens back to back (the prefill path at the recipe's feature_dtype; rows and L from
        the recipe).
      batch_features: (target_params, tokens [N, S], lengths [N]) -> [N, S, K * D] bf16 features of a
        batch laid out as the batch (feature_source "step"; the same forward as `features`).
      taps: the target layers cached as features (DART's, and DFlash's with distill_weight: the fused layers,
        then the target's last).
    """

    module: DFlashDrafter | DartDrafter
    tx: optax.GradientTransformation
    sharding: TrainingSharding | None
    train_step: Callable
    eval_step: Callable
    features: Callable
    batch_features: Callable
    taps: tuple[int, ...]


def _target_forward_at(target: Transformer, dtype: str, forward: Callable) -> Callable:
    """jit of (target_params, tokens, lengths) -> forward(target at `dtype`, its parameters cast to it,
    tokens, lengths) as bf16 (one of FEATURE_DTYPES)."""
    feature_target = target.clone(dtype=jnp.dtype(dtype))

    def features(params, tokens, lengths):
        params = jax.tree.map(lambda a: a.astype(feature_target.dtype), params)
        return forward(feature_target, params, tokens, lengths).astype(jnp.bfloat16)

    return jax.jit(features)


def feature_program(target: Transformer, taps: tuple[int, ...], pack_tokens: int, dtype: str) -> Callable:
    """The jitted (target_params, tokens [rows, S], lengths [rows]) -> [pack_tokens, K * D] bf16 features of
    the rows' real tokens back to back (`objective.target_features`), the target run at `dtype` (one of
    FEATURE_DTYPES; its parameters are cast to it)."""
    forward = functools.partial(objective.target_features, tap_layers=taps, pack_tokens=pack_tokens)
    return _target_forward_at(target, dtype, forward)


def batch_feature_program(target: Transformer, taps: tuple[int, ...], dtype: str) -> Callable:
    """The jitted (target_params, tokens [N, S], lengths [N]) -> [N, S, K * D] bf16 features of a batch,
    zero past each length (`objective.padded_target_features`), the target run at `dtype` as in
    `feature_program`."""
    forward = functools.partial(objective.padded_target_features, tap_layers=taps)
    return _target_forward_at(target, dtype, forward)


@functools.lru_cache(maxsize=4)
def programs_for(
    drafter: DFlashConfig | DartConfig,
    target: Transformer,
    config: TrainConfig,
    total_steps: int,
    draft_vocab: tuple[int, ...] | None,
    mesh: jax.sharding.Mesh | None = None,
) -> Programs:
    """The programs of a run, built once per (drafter, target module, recipe, schedule, draft vocabulary,
    mesh).

    Later `train` calls in the same process (a resume, a notebook) reuse the compiled steps.
    """
    tx = make_optimizer(config, total_steps)
    vocab = None if draft_vocab is None else np.asarray(draft_vocab, np.int32)
    if isinstance(drafter, DartConfig):
        module = DartDrafter(drafter, jnp.float32)
        loss_fn = eval_loss_fn = dart_loss_fn(module, target, vocab, config)
        taps = drafter.target_layer_ids + (target.config.num_layers - 1,)  # + the KL's target logits
    else:
        module = DFlashDrafter(drafter, jnp.float32, attention_backend="reference")
        proposer = DFlashProposer(module, target, config.block_size, draft_vocab=vocab)
        loss_fn = dflash_loss_fn(proposer, config, config.compute_dtype)
        eval_loss_fn = dflash_loss_fn(proposer, config, tree_stats=True)
        taps = dflash_taps(drafter, target.config, reads_target=bool(config.distill_weight))
    sharding = None if mesh is None else TrainingSharding.for_drafter(drafter.layers, mesh)
    train_step, eval_step = make_steps(loss_fn, tx, sharding, eval_loss_fn)
    features = feature_program(target, taps, config.feature_tokens, config.feature_dtype)
    batch_features = batch_feature_program(target, taps, config.feature_dtype)
    return Programs(module, tx, sharding, train_step, eval_step, features, batch_features, taps)
