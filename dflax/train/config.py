"""The drafter training recipe (`TrainConfig`) and the values its fields take."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from dflax.drafters.dart import DartConfig
from dflax.drafters.dflash import DRAFTER_LAYER_ARCHS, DFlashConfig
from dflax.target import Target
from dflax.train import dart_objective, objective
from dflax.train.recipe import RunSettings, read_recipe

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
