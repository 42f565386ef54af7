"""`dflax train`: trains a DFlash drafter against a frozen target and exports it in the official layout.

The step is `state = step(state, target_params, batch)`, jitted once (sequences are padded to
`max_seq_len`, anchors per sequence are fixed) with the state donated. The loss is
`dflax.train.objective.dflash_loss`, which runs all anchors of a sequence in one drafter forward with the
layers and math of the decoding forward. Optimizer: AdamW, warmup (4%) + cosine schedule to 0, global-norm
clipping 1.0 (the paper's recipe). A run starts from random weights, the target's last layers, or an
exported drafter (warm start: `init` "drafter", `init_from` "shipped" or a directory).

Target features are precomputed once per sequence by the target's prefill forward and cached on disk
(`dflax.train.features`: `out_dir/features/{train,validation}.npy`, bf16, memory-mapped, filled resumably
before the first step). Measured on SmolLM2-135M (30 layers, d 576; 3-layer drafter, 5 target layers)
before all anchors shared one forward, 4 sequences x S tokens per step, 32 anchors each, B = 16, float32
on a shared 2-core CPU (best of 3):
                                         S = 384              S = 512
  target forward inside the step         11.6 s/step          10.3 s/step
  step on cached features                6.8 s + 13 ms read   4.2 s + 9 ms read
  filling the cache (once per batch)     3.9 s                6.2 s
Per batch of sequences over the recipe's 6 epochs that is 69 s vs 45 s (S = 384) and 62 s vs 31 s
(S = 512): caching is 1.5-2x faster and breaks even within the first epoch. The price is disk,
K * D * 2 bytes per real token (5.8 kB for SmolLM2: ~1.7 MB per 300-token sequence, ~30 GB for 17k).

The step's cost per anchor is the block's own work (B tokens through the drafter layers, B - 1 LM-head
rows), so anchors/s hardly moves with M; what grew with M was memory, while every anchor copied its
context. XLA's accounting of the compiled step (SmolLM2, the shipped recipe with M changed; per-anchor
copy -> one forward): S = 512, 4 sequences: scratch 1.2 -> 1.0 GB (M = 32), 4.5 -> 1.7 GB (M = 128),
13.5 -> 4.8 GB (M = 384), flops per anchor 1.5 -> 1.5 G (M = 32), 1.23 -> 1.09 G (M = 384); S = 2048, one
sequence: 7.0 -> 1.1 GB and 1.88 -> 1.40 G flops per anchor (M = 256), 13.9 -> 1.7 GB and 1.81 -> 1.21 G
(M = 512). Wall clock on the shared CPU (median of 5 steps, loaded by other jobs): 10.5 -> 13.1 anchors/s
(M = 32) and 12.0 -> 11.4 (M = 128), the same within the noise; 6.7 anchors/s at M = 384 after.

On a mesh (a target loaded with `load_target(..., mesh=)`, CLI `--mesh`) the same step trains with the
drafter's parameters and optimizer state FSDP-sharded and each batch split over `data`
(`dflax.sharding.training`); a checkpoint restores onto whatever mesh the resuming run uses.

Resuming is exact: the batch of step s is a pure function of (seed, s) (one permutation of the training
sequences per epoch), the anchors come from the PRNG key carried in the state, and orbax checkpoints hold
params, optimizer state, key and step. So a run interrupted (SIGTERM/SIGINT: saved at the next step
boundary) or killed (kill -9: it repeats the steps since its last checkpoint) and resumed ends in the same
state as an uninterrupted one. Each validation also rewrites `out_dir/TRAINING.json` and
`out_dir/validation.png` (`dflax.train.report`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil
import signal
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import struct
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from dflax.drafters.checkpoint import save_drafter
from dflax.drafters.dart import DartConfig, DartDrafter, init_dart_params
from dflax.drafters.dart_checkpoint import save_dart
from dflax.drafters.dflash import (
    DRAFTER_LAYER_ARCHS,
    DFlashConfig,
    DFlashDrafter,
    DFlashProposer,
    init_drafter_params,
)
from dflax.drafters.draft_vocab import frequent_tokens
from dflax.models.config import ModelConfig
from dflax.models.transformer import Transformer
from dflax.sharding.training import TrainingSharding
from dflax.target import Target, weights_fingerprint
from dflax.train import dart_objective, objective
from dflax.train.dart_ngram import response_ngram_tables
from dflax.train.features import DeviceFeatures, FeatureCache, cache_features
from dflax.train.recipe import RunSettings, read_recipe
from dflax.train.report import METRICS, PLOT, TRAINING_RECORD, record_warm_start, write_report
from dflax.train.target_init import init_from_target
from dflax.train.warm_start import (
    resolve_drafter_dir,
    warm_start_matching_params,
    warm_start_params,
    warm_start_vocab,
)

# What a checkpoint must share with the run it resumes: the start, the data order and the anchors.
_ORDER_FIELDS = (
    "seed",
    "init",
    "init_from",
    "init_match",
    "layer_kind",
    "batch_size",
    "max_seq_len",
    "anchors_per_seq",
    "anchor_stride",
    "block_size",
    "draft_vocab_size",
    "length_bucket",
)

# How a run's drafter starts: random weights, the target's last layers (dflax.train.target_init), or an
# exported drafter (dflax.train.warm_start).
INITS = ("random", "target", "drafter")
# How init "drafter" reads its parent: "architecture" (the same architecture, every parameter) or "shapes"
# (any DFlash drafter of the target's width: the parameters whose names and shapes agree).
INIT_MATCHES = ("architecture", "shapes")
DRAFT_VOCAB_SOURCES = ("data", "warm_start")  # see TrainConfig.draft_vocab_from

# What a recipe trains: a DFlash drafter (block diffusion, dflax.drafters.dflash) or a DART drafter
# (one causal layer with parallel logits, dflax.drafters.dart; trained by dflax.train.dart_objective).
METHODS = ("dflash", "dart")

# The drafter's decoder-layer kind: "qwen3" (q/k-norm, the official layout) or "target" (the target's own
# kind, so layers copied by init "target" behave as in the target: no q/k-norm for a Llama target).
LAYER_KINDS = ("qwen3", "target")

# The precision of a DFlash step's products: "float32", or "bfloat16" (float32 master weights and optimizer,
# the forward and backward products on bf16 copies with float32 accumulation, norms, softmax and loss in
# float32). On this project's AMX CPU a B=8, 64-anchor step of 4 x 512 tokens takes 1.85 s in float32 and
# 1.27 s in bf16.
COMPUTE_DTYPES = ("float32", "bfloat16")

# The precision of the frozen target forward that fills the feature cache: "float32" (the target as
# loaded), or "bfloat16" (the target's bf16 forward, as `--dtype bfloat16` decodes; bf16 weights are what
# SmolLM2 and Gemma ship, so a float32 load holds exactly their values). The cache stores bf16 either way.
FEATURE_DTYPES = ("float32", "bfloat16")

# Where a DFlash step's target features come from: "cache" (computed once into a memory-mapped file on
# disk and read back every epoch: the CPU's choice, measured above) or "step" (the target's prefill
# forward of each batch on the device, no disk: an accelerator's, where that forward is cheap next to the
# drafter's step and a cache of all the data would not fit on disk; `dflax.train.features.DeviceFeatures`).
FEATURE_SOURCES = ("cache", "step")


@dataclasses.dataclass(frozen=True)
class TrainConfig(RunSettings):
    """A drafter training recipe (configs/train/*.json holds these fields and those of RunSettings).

    Attributes:
      method: "dflash" or "dart" (DART: num_layers 1, init "random", block_size = d + 1, the loss is the
        depth-weighted KL of dflax.train.dart_objective; gamma, mask_token_id, layer_kind are DFlash's).
      num_layers: drafter decoder layers.
      block_size: B, the anchor + B - 1 drafted positions (DART: the last token + d drafted depths).
      gamma: decay of the loss weights exp(-(k - 1) / gamma); None = the paper's value for B.
      target_layer_ids: target layers fused as features; None = the published spread.
      mask_token_id: a target token used as the mask; None = a learned mask embedding.
      feature_norm: RMS-normalize each tapped layer's features before the drafter's fc (see DFlashConfig).
      layer_kind: "qwen3" (q/k-norm, the official layout) or "target" (the target's own layer kind, so
        layers copied by init "target" compute as in the target; Llama and Qwen3 targets).
      init: "random", "target" to start from the target's last layers (see dflax.train.target_init), or
        "drafter" to start from the exported drafter `init_from` (warm start, see dflax.train.warm_start).
      init_from: with init "drafter": "shipped" (the drafter dflax ships for the target) or a drafter
        directory.
      init_match: with init "drafter": "architecture" (the parent has the recipe's architecture) or
        "shapes" (copy the parent's parameters whose names and shapes agree; see INIT_MATCHES).
      draft_vocab_size: V', the drafter reads out only the V' most frequent tokens of the training
        responses (dflax.drafters.draft_vocab); 0 = the target's whole vocabulary.
      draft_vocab_from: where a pruned vocabulary comes from: "data" (this run's responses) or
        "warm_start" (the drafter `init_from` drafts, which must have V' tokens): a run that continues on
        a slice of the data keeps the vocabulary its parent chose from more of it.
      anchors_per_seq: M anchors (blocks) per sequence per step, all in one drafter forward (R =
        batch_size * M block rows per step).
      anchor_stride: 0 = M random distinct response positions; s >= 1 = every s-th response position
        from a random offset (1 = every position), at most M.
      feature_cache_dir: where the target-feature cache lives; None = `out_dir/features`. Runs on the
        same sequences and target may share one (a cache of other data is rebuilt, not misread).
      feature_source: "cache" (the on-disk feature cache) or "step" (each batch's features computed on
        the device; see FEATURE_SOURCES).
      depth_decay: DART's loss weight decay^(t - 1) of depth t.
      ngram_min_count: DART's exported n-gram counts (orders 3 and 2 of the training responses) keep the
        n-grams seen at least this often.
      compute_dtype: DFlash's step precision, "float32" or "bfloat16" (see COMPUTE_DTYPES).
      feature_dtype: the precision of the target forward that computes the cached features, "float32"
        or "bfloat16" (see FEATURE_DTYPES).
      length_bucket: 0 = every training batch is max_seq_len long; b > 0 = a batch is cut to its longest
        sequence rounded up to a multiple of b (one compiled step per length), so short batches skip the
        context work of empty positions.
      distill_weight: DFlash's lambda in [0, 1]: each drafted position's loss is (1 - lambda) * the
        cross-entropy to the target's token + lambda * KL(target's next-token distribution || drafter's)
        (`objective.dflash_loss`); > 0 caches the target's last layer as one more feature.
    """

    method: str = "dflash"
    num_layers: int = 3
    block_size: int = 16
    gamma: float | None = None
    target_layer_ids: tuple[int, ...] | None = None
    mask_token_id: int | None = None
    feature_norm: bool = False
    layer_kind: str = "qwen3"
    init: str = "random"
    init_from: str | None = None
    init_match: str = "architecture"
    draft_vocab_size: int = 0
    draft_vocab_from: str = "data"
    anchors_per_seq: int = 32
    anchor_stride: int = 0
    feature_cache_dir: str | None = None
    feature_source: str = "cache"
    depth_decay: float = dart_objective.DEPTH_DECAY
    ngram_min_count: int = 2
    compute_dtype: str = "float32"
    feature_dtype: str = "float32"
    length_bucket: int = 0
    distill_weight: float = 0.0

    def __post_init__(self):
        if self.target_layer_ids is not None:
            object.__setattr__(self, "target_layer_ids", tuple(self.target_layer_ids))
        self.check_run_settings()
        for name in ("num_layers", "anchors_per_seq"):
            if getattr(self, name) < 1:
                raise ValueError(f"training config: {name} must be >= 1, got {getattr(self, name)}")
        if self.block_size < 2:
            raise ValueError(f"training config: block_size must be >= 2, got {self.block_size}")
        if self.max_seq_len < self.block_size:
            raise ValueError(
                f"training config: max_seq_len {self.max_seq_len} is shorter than a block "
                f"({self.block_size}); raise max_seq_len"
            )
        if self.draft_vocab_size < 0:
            raise ValueError(
                "training config: draft_vocab_size must be >= 0 (0 = the whole vocabulary), "
                f"got {self.draft_vocab_size}"
            )
        if self.init not in INITS:
            raise ValueError(f"training config: init {self.init!r} unknown; use one of {', '.join(INITS)}")
        if self.draft_vocab_from not in DRAFT_VOCAB_SOURCES:
            raise ValueError(
                f"training config: draft_vocab_from {self.draft_vocab_from!r} unknown; use one of "
                f"{', '.join(DRAFT_VOCAB_SOURCES)}"
            )
        if self.draft_vocab_from == "warm_start" and (self.init != "drafter" or not self.draft_vocab_size):
            raise ValueError(
                "training config: draft_vocab_from 'warm_start' keeps the pruned vocabulary of the drafter "
                "it starts from: it needs init 'drafter' and draft_vocab_size > 0"
            )
        if (self.init == "drafter") != (self.init_from is not None):
            raise ValueError(
                "training config: init 'drafter' needs init_from ('shipped' or a drafter directory), and "
                f"init_from is only read with init 'drafter' (got init {self.init!r}, init_from "
                f"{self.init_from!r})"
            )
        if self.init_match not in INIT_MATCHES:
            raise ValueError(
                f"training config: init_match {self.init_match!r} unknown; "
                f"use one of {', '.join(INIT_MATCHES)}"
            )
        if self.layer_kind not in LAYER_KINDS:
            raise ValueError(
                f"training config: layer_kind {self.layer_kind!r} unknown; "
                f"use one of {', '.join(LAYER_KINDS)}"
            )
        if self.length_bucket < 0:
            raise ValueError(f"training config: length_bucket must be >= 0, got {self.length_bucket}")
        if self.anchor_stride < 0:
            raise ValueError(f"training config: anchor_stride must be >= 0, got {self.anchor_stride}")
        if self.method not in METHODS:
            raise ValueError(
                f"training config: method {self.method!r} unknown; use one of {', '.join(METHODS)}"
            )
        for name, choices in (
            ("compute_dtype", COMPUTE_DTYPES),
            ("feature_dtype", FEATURE_DTYPES),
            ("feature_source", FEATURE_SOURCES),
        ):
            if getattr(self, name) not in choices:
                raise ValueError(
                    f"training config: {name} {getattr(self, name)!r} unknown; "
                    f"use one of {', '.join(choices)}"
                )
        if not 0.0 <= self.distill_weight <= 1.0:
            raise ValueError(f"training config: distill_weight must be in [0, 1], got {self.distill_weight}")
        if self.method == "dart":
            if self.distill_weight:
                raise ValueError("training config: DART's loss is a KL already; leave distill_weight 0")
            if self.compute_dtype != "float32":
                raise ValueError("training config: DART trains in float32; set compute_dtype 'float32'")
            if self.num_layers != 1 or self.init != "random":
                raise ValueError(
                    "training config: a DART drafter has one layer and starts from random weights: set "
                    f"num_layers 1 and init 'random' (got num_layers {self.num_layers}, init {self.init!r})"
                )
            if not 0.0 < self.depth_decay <= 1.0:
                raise ValueError(f"training config: depth_decay must be in (0, 1], got {self.depth_decay}")
            return
        objective.position_weights(self.block_size, self.loss_gamma)  # validates gamma

    @property
    def loss_gamma(self) -> float:
        """gamma of the position weights (the paper's for B when not set)."""
        return self.gamma if self.gamma is not None else objective.default_gamma(self.block_size)

    @classmethod
    def from_json(cls, path: str | Path) -> TrainConfig:
        """Reads a recipe file; unknown keys are an error naming the known ones."""
        return read_recipe(cls, path)

    def to_dict(self) -> dict:
        """JSON-ready fields."""
        data = dataclasses.asdict(self)
        if self.target_layer_ids is not None:
            data["target_layer_ids"] = list(self.target_layer_ids)
        return data

    def drafter_config(self, target: Target) -> DFlashConfig | DartConfig:
        """The drafter architecture this recipe trains for `target`."""
        if self.method == "dart":
            return DartConfig.for_target(
                target.config,
                self.block_size - 1,
                self.target_layer_ids,
                self.draft_vocab_size or None,
                self.feature_norm,
            )
        layer_arch = self.layer_kind
        if layer_arch == "target":
            layer_arch = target.config.arch
            if layer_arch not in DRAFTER_LAYER_ARCHS or target.config.attention_bias:
                raise ValueError(
                    f"training config: layer_kind 'target' needs a target with drafter-style layers "
                    f"({', '.join(DRAFTER_LAYER_ARCHS)} without attention bias), not {layer_arch!r}; "
                    "use layer_kind 'qwen3'"
                )
        return DFlashConfig.for_target(
            target.config,
            self.num_layers,
            self.block_size,
            self.target_layer_ids,
            self.mask_token_id,
            self.feature_norm,
            layer_arch,
        )

    @property
    def feature_rows(self) -> int:
        """Sequences per target-feature forward (at most; see `feature_tokens`): 2 x batch_size, or more
        where answers of 128 tokens on average would fill the pack (8 rows left 13% of the shipped
        recipe's pack tokens unused)."""
        return max(2 * self.batch_size, self.feature_tokens // 128)

    @property
    def feature_tokens(self) -> int:
        """Real tokens packed into one target-feature forward (at most)."""
        return self.batch_size * self.max_seq_len


@dataclasses.dataclass(frozen=True)
class PaddedSequences:
    """Sequences padded to one length (host arrays).

    Attributes:
      tokens: [N, S] int32 (0 past each length).
      prompt_lens: [N] int32.
      lengths: [N] int32 real lengths (<= S).
    """

    tokens: np.ndarray
    prompt_lens: np.ndarray
    lengths: np.ndarray

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def width(self, index: np.ndarray, bucket: int) -> int:
        """W, the length a batch of rows `index` is cut to: S with bucket 0, else its longest sequence
        rounded up to a multiple of `bucket` (at most S)."""
        max_len = self.tokens.shape[1]
        if not bucket:
            return max_len
        longest = int(self.lengths[index[index >= 0]].max(initial=1))
        return min(max_len, -(-longest // bucket) * bucket)

    def take(
        self, index: np.ndarray, features: FeatureCache | DeviceFeatures, width: int | None = None
    ) -> dict:
        """The batch of rows `index` (-1 = an empty padding row) with its features (read from the cache,
        or computed on the device), `width` long (default S; at least the rows' longest sequence).

        Returns:
          {"tokens" [N, W], "prompt_lens" [N], "lengths" [N], "features" [N, W, K * D] bf16} arrays.
        """
        width = width or self.tokens.shape[1]
        empty = index < 0
        rows = np.where(empty, 0, index)
        return {
            "tokens": np.where(empty[:, None], 0, self.tokens[rows, :width]),
            "prompt_lens": self.prompt_lens[rows],
            "lengths": np.where(empty, 0, self.lengths[rows]).astype(np.int32),
            "features": features.batch(index, width),
        }


def pad_sequences(sequences: Sequence[tuple[np.ndarray, int]], max_len: int) -> PaddedSequences:
    """Truncates / pads (ids, prompt_len) pairs to `max_len`, dropping those with no anchor to train on.

    A sequence needs a response token with another after it (prompt_len <= max_len - 2 after truncation).
    """
    kept = [(np.asarray(ids, np.int32)[:max_len], int(p)) for ids, p in sequences]
    kept = [(ids, p) for ids, p in kept if p <= len(ids) - 2]
    tokens = np.zeros((len(kept), max_len), np.int32)
    for i, (ids, _) in enumerate(kept):
        tokens[i, : len(ids)] = ids
    return PaddedSequences(
        tokens=tokens,
        prompt_lens=np.asarray([p for _, p in kept], np.int32),
        lengths=np.asarray([len(ids) for ids, _ in kept], np.int32),
    )


def batch_index(num_seqs: int, batch_size: int, seed: int, step: int) -> np.ndarray:
    """The training sequences of step `step`: epoch e = step // (N // batch) reads permutation e in order."""
    per_epoch = num_seqs // batch_size
    epoch, i = divmod(step, per_epoch)
    order = np.random.default_rng([seed, epoch]).permutation(num_seqs)
    return order[i * batch_size : (i + 1) * batch_size]


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


@dataclasses.dataclass
class TrainResult:
    """What `train` did.

    Attributes:
      step: steps done (== total_steps unless interrupted).
      total_steps: steps of the schedule.
      interrupted: the signal number that stopped the run early (None when it finished).
      params: the drafter's parameters.
      drafter_dir: the exported drafter (None when interrupted).
      log: the progress and validation records written to metrics.jsonl by this call.
    """

    step: int
    total_steps: int
    interrupted: int | None
    params: dict
    drafter_dir: Path | None
    log: list[dict]


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
class _Programs:
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
def _programs(
    drafter: DFlashConfig | DartConfig,
    target: Transformer,
    config: TrainConfig,
    total_steps: int,
    draft_vocab: tuple[int, ...] | None,
    mesh: jax.sharding.Mesh | None = None,
) -> _Programs:
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
    return _Programs(module, tx, sharding, train_step, eval_step, features, batch_features, taps)


class _StopFlag:
    """Turns SIGTERM/SIGINT into a request to stop at the next step boundary (main thread only).

    A second signal while the first is pending aborts at once (KeyboardInterrupt), without saving.
    """

    def __init__(self):
        self.signum: int | None = None
        self._previous = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.signum is not None:
            raise KeyboardInterrupt(f"signal {signum} while stopping: aborted without saving")
        self.signum = signum

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _checkpoint_manager(path: Path, max_to_keep: int = 2) -> ocp.CheckpointManager:
    # Synchronous saves: the next step donates the state's buffers.
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, enable_async_checkpointing=False)
    return ocp.CheckpointManager(path.absolute(), options=options)


def _order_meta(config: TrainConfig, num_train: int, total_steps: int) -> dict:
    meta = {name: getattr(config, name) for name in _ORDER_FIELDS}
    return {**meta, "num_train": num_train, "total_steps": total_steps}


def _restore(manager: ocp.CheckpointManager, state: TrainState, meta: dict) -> TrainState:
    """The latest checkpoint, after checking it belongs to this run (same data order and schedule).

    `state` gives the structure and where each array goes (arrays, or ShapeDtypeStructs with shardings):
    a checkpoint saved on one mesh restores onto another, each device reading only its own shards.
    """
    step = manager.latest_step()
    restored = manager.restore(
        step, args=ocp.args.Composite(state=ocp.args.StandardRestore(state), meta=ocp.args.JsonRestore())
    )
    diff = {k: (restored.meta.get(k), v) for k, v in meta.items() if restored.meta.get(k) != v}
    if diff:
        raise ValueError(
            f"the checkpoint at step {step} belongs to another run ({{name: (checkpoint, now)}} = {diff}); "
            "use the same config/data/--steps, or --no-resume to start over"
        )
    return restored.state


def validation_pass(
    eval_step,
    params,
    target_params,
    val: PaddedSequences,
    features,
    batch_size: int,
    seed: int,
    place: Callable[[dict], dict] | None = None,
) -> dict:
    """Loss, per-position accuracy and greedy acceptance on held-out sequences (anchors fixed by `seed`),
    the acceptance at temperature 1 when the loss reads the target's distributions, and the tokens a
    best-first draft tree of N nodes commits per step (E[c] and E[c^2], N = 0 .. `TREE_NODES` of
    `dflax.train.tree_acceptance`: `val_tree_tau`, `val_tree_square`) when it simulates them; `place` puts
    each host batch where the step reads it (default: as it is)."""
    place = place or (lambda batch: batch)
    key = jax.random.key(seed + 1)
    losses, total = [], None
    index = np.arange(-(-len(val) // batch_size) * batch_size)
    index[index >= len(val)] = -1
    for b, rows in enumerate(index.reshape(-1, batch_size)):
        batch = place(val.take(rows, features))
        loss, stats = eval_step(params, target_params, batch, jax.random.fold_in(key, b))
        losses.append(loss)
        total = stats if total is None else total + stats
    acc, tau = objective.acceptance(total)
    entry = {
        "val_loss": float(np.mean(jax.device_get(losses))),
        "val_acc": np.round(np.asarray(objective.position_accuracy(total)), 4).tolist(),
        "val_accept": np.round(np.asarray(acc), 4).tolist(),
        "val_rank_accept": np.round(np.asarray(objective.rank_acceptance(total)), 4).tolist(),
        "val_tau": float(tau),
    }
    if float(total.whole):  # the loss simulated best-first trees (DFlash's validation)
        curve = np.round(np.asarray(objective.tree_commit_curve(total), np.float64), 4)
        entry["val_tree_tau"], entry["val_tree_square"] = curve[:, 0].tolist(), curve[:, 1].tolist()
    if np.any(np.asarray(total.overlap)):  # the loss read the target's distributions (distill_weight)
        sampled, sampled_tau = objective.sampled_acceptance(total)
        entry["val_accept_t1"] = np.round(np.asarray(sampled), 4).tolist()
        entry["val_tau_t1"] = float(sampled_tau)
    return entry


def _summary(pending: list[dict], tokens: int, seconds: float, step: int) -> dict:
    """One progress record from the metrics of the steps since the last one (fetched now)."""
    fetched = jax.device_get(pending)
    stats = fetched[0]["stats"]
    for m in fetched[1:]:
        stats = stats + m["stats"]
    return {
        "step": step,
        "loss": float(np.mean([m["loss"] for m in fetched])),
        "grad_norm": float(np.mean([m["grad_norm"] for m in fetched])),
        "acc": np.round(np.asarray(objective.position_accuracy(stats)), 4).tolist(),
        "tok_s": tokens / seconds,
        "anchors_s": float(stats.valid[0]) / seconds,  # blocks trained per second
        "seconds": round(seconds, 3),
    }


def _progress_text(record: dict, tau: float | None) -> str:
    acc = " ".join(f"{a:.2f}" for a in record["acc"][:4])
    text = f"loss {record['loss']:.3f}  acc@1-4 {acc}  {record['anchors_s']:.0f} anchors/s"
    return text + (f"  val tau {tau:.2f}" if tau is not None else "")


def _initial_state(
    module: DFlashDrafter | DartDrafter,
    tx: optax.GradientTransformation,
    config: TrainConfig,
    target: Target,
    parent: Path | None,
    console: Console,
) -> TrainState:
    """The step-0 state: fresh, from the target's layers, or from the exported drafter `parent`."""
    init = init_dart_params if isinstance(module, DartDrafter) else init_drafter_params
    params = init(module, config.seed)
    if config.init == "target":
        params = init_from_target(params, target.params, target.config, module.config)
    elif parent is not None and config.init_match == "shapes":
        params, copied, kept = warm_start_matching_params(parent, params)
        console.print(
            f"warm start from {parent}: {len(copied)} parameters copied, fresh: {', '.join(kept) or 'none'}"
        )
    elif parent is not None:
        params = warm_start_params(parent, module.config, params)
    return TrainState(
        params=params,
        opt_state=tx.init(params),
        rng=jax.random.key_data(jax.random.key(config.seed)),
        step=jnp.zeros((), jnp.int32),
    )


def train(
    config: TrainConfig,
    target: Target,
    train_sequences: Sequence[tuple[np.ndarray, int]],
    val_sequences: Sequence[tuple[np.ndarray, int]],
    out_dir: str | Path,
    *,
    resume: bool = True,
    console: Console | None = None,
    on_step: Callable[[int], None] | None = None,
) -> TrainResult:
    """Trains a DFlash drafter for `target` and exports it to `out_dir/drafter`.

    Args:
      config: the recipe.
      target: the loaded (frozen) target. Loaded on a mesh (`load_target(..., mesh=)`), the drafter trains
        there: parameters and optimizer state split over `data` as FSDP and over `model` like the target's
        layers, each step's sequences split over `data` (batch_size must divide by it); the losses and
        weights equal a one-device run's within float32 rounding, and checkpoints resume on any mesh.
      train_sequences: (ids [S] int32, prompt_len) pairs; the response follows the prompt.
      val_sequences: held-out pairs for validation (may be empty).
      out_dir: run directory: features/ (the cache), checkpoints/, metrics.jsonl, drafter/ (the export).
      resume: continue from the latest checkpoint in out_dir (else start over, deleting old checkpoints).
      console: where the progress bars go (default stderr).
      on_step: called with the step count after every step (before the stop check).

    Returns:
      The TrainResult; `interrupted` is set when a signal stopped the run (a checkpoint was saved).

    Raises:
      ValueError: for too few usable sequences, a batch_size the mesh's `data` axis does not divide, or a
        checkpoint of another run.
    """
    console = console or Console(stderr=True)
    out_dir = Path(out_dir)
    data = pad_sequences(train_sequences, config.max_seq_len)
    val = pad_sequences(val_sequences[: config.max_val_sequences], config.max_seq_len)
    if len(data) < config.batch_size:
        raise ValueError(
            f"{len(data)} usable training sequences (with a response inside max_seq_len="
            f"{config.max_seq_len}) for batch_size {config.batch_size}; add data or lower batch_size"
        )
    total_steps = config.steps or config.epochs * (len(data) // config.batch_size)
    console.print(
        f"{len(data)} training sequences ({len(train_sequences) - len(data)} without a response inside "
        f"max_seq_len={config.max_seq_len} dropped, {int((data.lengths == config.max_seq_len).sum())} "
        f"filling it), {len(val)} validation; "
        f"{total_steps} steps of {config.batch_size} sequences x {config.anchors_per_seq} blocks"
    )
    drafter_config = config.drafter_config(target)
    drafter_config.check_target(target.config)
    parent = resolve_drafter_dir(config.init_from, target.name) if config.init == "drafter" else None
    draft_vocab = None
    if config.draft_vocab_from == "warm_start":
        draft_vocab = warm_start_vocab(parent, config.draft_vocab_size)
        console.print(f"draft vocabulary: the {len(draft_vocab)} tokens of the drafter it starts from")
    elif config.draft_vocab_size:
        # What the drafter is trained to draft: the responses, as truncated to max_seq_len.
        responses = ((t[:n], p) for t, p, n in zip(data.tokens, data.prompt_lens, data.lengths))
        draft_vocab = frequent_tokens(responses, config.draft_vocab_size, target.config.vocab_size)
        console.print(f"draft vocabulary: the {len(draft_vocab)} most frequent response tokens")
    vocab_key = None if draft_vocab is None else tuple(draft_vocab.tolist())
    if target.mesh is not None:
        if isinstance(drafter_config, DartConfig):
            raise ValueError("DART trains on one device for now: leave out --mesh (DFlash trains on a mesh)")
        TrainingSharding.for_drafter(drafter_config.layers, target.mesh).check_batch(config.batch_size)
    programs = _programs(drafter_config, target.module, config, total_steps, vocab_key, target.mesh)
    state = _initial_state(programs.module, programs.tx, config, target, parent, console)
    place_batch = (lambda batch: batch) if programs.sharding is None else programs.sharding.place_batch
    if programs.sharding is not None:
        state = programs.sharding.place_state(state)

    ckpt_dir = out_dir / "checkpoints"
    if not resume and ckpt_dir.exists():
        console.print(f"--no-resume: deleting {ckpt_dir}")
        shutil.rmtree(ckpt_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    manager = _checkpoint_manager(ckpt_dir)
    meta = _order_meta(config, len(data), total_steps)
    if manager.latest_step() is not None:
        onto = state if programs.sharding is None else programs.sharding.abstract_state(state)
        state = _restore(manager, onto, meta)
        console.print(f"resuming {ckpt_dir} at step {int(state.step)} of {total_steps}")
    else:  # a fresh start: no report of an earlier run; a warm start keeps its parent's record now,
        # before anything ships over it
        for stale in (TRAINING_RECORD, PLOT):
            (out_dir / stale).unlink(missing_ok=True)
        record_warm_start(out_dir, config.init_from, parent)

    def save(step: int) -> None:
        if manager.latest_step() != step:
            args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
            manager.save(step, args=args)

    log, pending, tokens, tau = [], [], 0, None
    step = int(state.step)
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeRemainingColumn(),
        console=console,
    )

    def record(entry: dict) -> None:
        log.append(entry)
        log_file.write(json.dumps(entry) + "\n")
        log_file.flush()

    with _StopFlag() as stop, progress, (out_dir / METRICS).open("a" if resume else "w") as log_file:
        if config.feature_source == "step":
            on_device = functools.partial(DeviceFeatures, programs.batch_features, target.params)
            features = on_device(data.tokens, data.lengths)
            val_features = on_device(val.tokens, val.lengths) if len(val) else None
        else:
            fill = functools.partial(
                cache_features,
                target=target,
                weights=weights_fingerprint(target),
                dtype=config.feature_dtype,
                taps=programs.taps,
                compute=programs.features,
                rows=config.feature_rows,
                pack_tokens=config.feature_tokens,
                progress=progress,
                should_stop=lambda: stop.signum is not None,
            )
            cache_dir = Path(config.feature_cache_dir) if config.feature_cache_dir else out_dir / "features"
            features = fill(cache_dir / "train.npy", data.tokens, data.lengths)
            val_features = fill(cache_dir / "validation.npy", val.tokens, val.lengths) if len(val) else None
        task = progress.add_task(
            "training", total=total_steps, completed=step, info="compiling ..." if step < total_steps else ""
        )
        t0 = time.perf_counter()
        while step < total_steps and stop.signum is None:
            index = batch_index(len(data), config.batch_size, config.seed, step)
            batch = data.take(index, features, data.width(index, config.length_bucket))
            tokens += int(batch["lengths"].sum())
            state, metrics = programs.train_step(state, target.params, place_batch(batch))
            step += 1
            pending.append(metrics)
            if step % config.log_every == 0 or step == total_steps:
                jax.block_until_ready(state)  # time whole steps: a step's metrics are ready before its update
                entry = _summary(pending, tokens, time.perf_counter() - t0, step)
                record(entry)
                progress.update(task, info=_progress_text(entry, tau))
                if not console.is_terminal:  # a log file (nohup) gets a line where a terminal gets the bar
                    console.print(f"step {step}/{total_steps}  {_progress_text(entry, tau)}")
                pending, tokens = [], 0
            if val_features is not None and (step % config.validate_every == 0 or step == total_steps):
                entry = validation_pass(
                    programs.eval_step,
                    state.params,
                    target.params,
                    val,
                    val_features,
                    config.batch_size,
                    config.seed,
                    place_batch,
                )
                tau = entry["val_tau"]
                record({"step": step, **entry})
                write_report(out_dir, config.to_dict(), total_steps)
            if step % config.checkpoint_every == 0:
                save(step)
            if not pending:
                t0 = time.perf_counter()
            progress.update(task, completed=step)
            if on_step is not None:
                on_step(step)
        save(step)

    manager.close()
    params = jax.device_get(state.params)
    if step < total_steps:
        console.print(f"stopped by signal {stop.signum} at step {step}; checkpoint saved, rerun to resume")
        return TrainResult(step, total_steps, stop.signum, params, None, log)
    drafter_dir = out_dir / "drafter"
    layers = target.config.num_layers
    if isinstance(drafter_config, DartConfig):
        responses = ((t[:n], p) for t, p, n in zip(data.tokens, data.prompt_lens, data.lengths))
        tables = response_ngram_tables(responses, config.ngram_min_count)
        save_dart(drafter_dir, drafter_config, params, layers, config.export_dtype, draft_vocab, tables)
    else:
        save_drafter(drafter_dir, drafter_config, params, layers, config.export_dtype, draft_vocab)
    for name in (TRAINING_RECORD, PLOT):  # the measured acceptance travels with the weights
        if (out_dir / name).is_file():
            shutil.copy(out_dir / name, drafter_dir / name)
        else:  # not an earlier export's
            (drafter_dir / name).unlink(missing_ok=True)
    console.print(f"drafter ({config.export_dtype}) written to {drafter_dir}")
    return TrainResult(step, total_steps, None, params, drafter_dir, log)
