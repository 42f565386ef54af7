"""Model configuration: one frozen dataclass for every supported target architecture.

Supported: the llama family (Llama 2/3, SmolLM2, Qwen2 with q/k/v biases, Qwen3 with q/k-norm) and Gemma 3
(sliding-window/global layer pattern, local/global RoPE bases, q/k-norm, pre+post norms, scaled embeddings).
"""

from __future__ import annotations

import dataclasses
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")

# HF `model_type` / `architectures` names -> dflax architecture.
_HF_MODEL_TYPES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",
}


class UnsupportedArchitectureError(ValueError):
    """A checkpoint names an architecture dflax cannot run."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style RoPE frequency scaling (`rope_type: llama3`) or linear position scaling."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.rope_type not in ("llama3", "linear"):
            raise UnsupportedArchitectureError(
                f"rope_scaling type {self.rope_type!r} is not supported; dflax supports 'llama3' and 'linear'"
            )


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture hyperparameters of a decoder-only target.

    Attributes mirror HF transformers' config names where one exists. `layer_types` holds one entry per
    layer, "full_attention" or "sliding_attention"; sliding layers use `sliding_window` and
    `local_rope_theta`.
    """

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    local_rope_theta: float = 10000.0
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    max_position_embeddings: int = 8192
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedArchitectureError(
                f"architecture {self.arch!r} is not supported; "
                f"dflax supports {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if not self.layer_types:
            object.__setattr__(self, "layer_types", ("full_attention",) * self.num_layers)
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        bad = set(self.layer_types) - {"full_attention", "sliding_attention"}
        if bad:
            raise UnsupportedArchitectureError(f"unsupported layer types {sorted(bad)}")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ValueError("sliding_attention layers need a positive sliding_window")

    # Derived properties: one place for each architecture difference.
    @property
    def is_gemma(self) -> bool:
        """Gemma norms use (1 + w), embeddings are scaled by sqrt(d), layers have pre+post norms."""
        return self.arch == "gemma3"

    @property
    def qk_norm(self) -> bool:
        """Whether attention normalizes q and k per head before RoPE."""
        return self.arch in ("qwen3", "gemma3")

    @property
    def qkv_bias(self) -> bool:
        """Whether q/k/v projections carry biases (Qwen2 always, Llama when attention_bias is set)."""
        return self.arch == "qwen2" or self.attention_bias

    @property
    def o_proj_bias(self) -> bool:
        """Whether the attention output projection carries a bias (attention_bias, except Qwen2)."""
        return self.attention_bias and self.arch != "qwen2"

    @property
    def hidden_act(self) -> str:
        """The gate activation of the MLP."""
        return "gelu_tanh" if self.is_gemma else "silu"

    @property
    def attn_scale(self) -> float:
        """Softmax scale of attention logits."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dictionary (inverse of `from_dict`)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Rebuilds a config saved with `to_dict`."""
        d = dict(d)
        if d.get("rope_scaling"):
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        d["layer_types"] = tuple(d.get("layer_types", ()))
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        return cls(**d)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Builds a config from an HF `config.json` dictionary.

        Raises:
          UnsupportedArchitectureError: when the model type is not one dflax runs.
        """
        if "text_config" in hf:  # multimodal wrappers (e.g. Gemma3ForConditionalGeneration)
            hf = {
                **hf["text_config"],
                "model_type": hf["text_config"].get("model_type", hf.get("model_type")),
            }
        model_type = hf.get("model_type", "")
        arch = _HF_MODEL_TYPES.get(model_type)
        if arch is None:
            raise UnsupportedArchitectureError(
                f"model_type {model_type!r} is not supported; dflax runs {', '.join(sorted(_HF_MODEL_TYPES))}"
            )
        # Gemma 3 configs carry attn_logit_softcapping, but transformers' Gemma 3 never applies it; nor do we.
        if hf.get("mlp_bias"):
            raise UnsupportedArchitectureError("mlp_bias=True is not supported")
        if arch == "qwen2" and hf.get("use_sliding_window"):
            raise UnsupportedArchitectureError("Qwen2 with use_sliding_window=True is not supported")
        num_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        rope_params = hf.get("rope_parameters") or {}
        if "rope_type" in rope_params or "rope_theta" in rope_params:  # transformers >= 5 single dict
            rope_params = {"full_attention": rope_params}
        full_rope = rope_params.get("full_attention", {})
        local_rope = rope_params.get("sliding_attention", {})
        scaling = hf.get("rope_scaling") or (
            full_rope if full_rope.get("rope_type") not in (None, "default") else None
        )
        rope_scaling = None
        if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
            rope_scaling = RopeScaling(
                rope_type=scaling.get("rope_type", scaling.get("type")),
                factor=float(scaling["factor"]),
                low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
                high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
                original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 8192)),
            )
        layer_types = tuple(hf.get("layer_types") or ())
        if arch == "gemma3" and not layer_types:
            pattern = hf.get("sliding_window_pattern", 6)
            layer_types = tuple(
                "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                for i in range(hf["num_hidden_layers"])
            )
        if arch != "gemma3":
            layer_types = ()  # llama-family sliding windows are rejected above
        return cls(
            arch=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6 if arch == "gemma3" else 1e-5),
            rope_theta=float(hf.get("rope_theta") or full_rope.get("rope_theta") or 10000.0),
            rope_scaling=rope_scaling,
            local_rope_theta=float(hf.get("rope_local_base_freq") or local_rope.get("rope_theta") or 10000.0),
            sliding_window=hf.get("sliding_window") if arch == "gemma3" else None,
            layer_types=layer_types,
            tie_word_embeddings=hf.get("tie_word_embeddings", True),
            attention_bias=bool(hf.get("attention_bias", False)),
            max_position_embeddings=hf.get("max_position_embeddings", 8192),
            query_pre_attn_scalar=hf.get("query_pre_attn_scalar") if arch == "gemma3" else None,
            final_logit_softcapping=hf.get("final_logit_softcapping"),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
