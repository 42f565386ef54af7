"""Dream (Dream-org/Dream-v0-Base-7B, -Instruct-7B): a Qwen2 network trained as a masked diffusion LM.

Its config.json is Qwen2's (`hidden_size`, `num_attention_heads`, ... with `model_type: "Dream"`) plus
`mask_token_id`, and its tensors carry Qwen2's names (`model.layers.N.self_attn.q_proj.weight`, q/k/v with
biases, `lm_head.weight`), so it loads as a dflax qwen2 config onto the `Transformer` parameter tree as is.
Where Dream's config class differs from Qwen2's defaults, Dream's wins: RMSNorm epsilon 1e-6, untied
embeddings, head_dim = hidden_size / num_attention_heads, mask token 151666. Attention is bidirectional and
the logits are shifted by one position (see dflax.diffusion.bidirectional).
"""

from __future__ import annotations

from typing import Any

from dflax.models.config import ModelConfig

MODEL_TYPE = "dream"  # config.json spells it "Dream"; compared case-insensitively
DEFAULT_MASK_TOKEN_ID = 151666  # <|mask|> in Dream's tokenizer (DreamConfig's default)
# DreamConfig's defaults where they differ from what dflax assumes for a Qwen2 config.
_DREAM_DEFAULTS = {"rms_norm_eps": 1e-6, "tie_word_embeddings": False}


def is_dream_config(hf: dict[str, Any]) -> bool:
    """Whether an HF config.json dictionary describes a Dream checkpoint."""
    return str(hf.get("model_type", "")).lower() == MODEL_TYPE


def dream_model_config(hf: dict[str, Any]) -> tuple[ModelConfig, int]:
    """(the dflax qwen2 config of Dream's network, its mask token id) from Dream's config.json dictionary.

    Raises:
      UnsupportedArchitectureError: for a variant dflax cannot run (sliding-window attention, MLP biases).
    """
    qwen2 = {**_DREAM_DEFAULTS, **hf, "model_type": "qwen2"}
    qwen2.pop("head_dim", None)  # Dream's attention always splits hidden_size evenly over the heads
    config = ModelConfig.from_hf(qwen2)
    mask = hf.get("mask_token_id")
    return config, DEFAULT_MASK_TOKEN_ID if mask is None else int(mask)


def dream_tensor_names(tensors: dict) -> dict:
    """Dream's tensors under the names the dflax loader maps (already Qwen2's: unchanged)."""
    return tensors
