"""Tiny random HF checkpoints, one per supported architecture, built and saved by the tests (no downloads).

Each checkpoint is a real transformers PyTorch model with all weights perturbed away from their init (so
norm conventions and biases are exercised), saved with save_pretrained (safetensors), plus a word-level
tokenizer over its vocabulary so the whole `dflax.load_target` path runs on it.
"""

from __future__ import annotations

from pathlib import Path

VOCAB = 256
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=None,
    pad_token_id=0,
)


def hf_config(name: str):
    """The transformers config of the tiny preset `name` (see TINY_ARCHS)."""
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen2Config, Qwen3Config

    if name == "llama":
        return LlamaConfig(**_COMMON, tie_word_embeddings=False, rope_theta=10000.0)
    if name == "llama3-scaled-rope":
        rope = dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
            rope_theta=500000.0,
        )
        return LlamaConfig(**_COMMON, tie_word_embeddings=True, attention_bias=True, rope_parameters=rope)
    if name == "smollm2-like":  # tied head, 3 query heads per kv head as in SmolLM2
        return LlamaConfig(
            **{**_COMMON, "hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 2},
            tie_word_embeddings=True,
            rope_theta=100000.0,
        )
    if name == "distinct-axes":  # query heads, KV heads, head dim, width and vocabulary all differ
        geometry = dict(hidden_size=42, intermediate_size=56, num_hidden_layers=6, num_attention_heads=6)
        return LlamaConfig(
            **{**_COMMON, **geometry, "num_key_value_heads": 3},
            head_dim=16,
            tie_word_embeddings=False,
            rope_theta=10000.0,
        )
    if name == "smollm2-heads":  # SmolLM2-135M's attention geometry (9 heads, 3 KV heads, head dim 64)
        geometry = dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=4)
        return LlamaConfig(**{**_COMMON, **geometry}, tie_word_embeddings=True, rope_theta=100000.0)
    if name == "qwen2":
        return Qwen2Config(**_COMMON, tie_word_embeddings=False, rope_theta=1000000.0)
    if name == "qwen3":
        return Qwen3Config(**_COMMON, head_dim=32, tie_word_embeddings=True, rope_theta=1000000.0)
    if name == "qwen3-8kv":  # 8 KV heads: heads, KV heads, FFN and vocabulary all split over 8 devices
        return Qwen3Config(
            **{**_COMMON, "num_attention_heads": 8, "num_key_value_heads": 8, "intermediate_size": 128},
            head_dim=16,
            tie_word_embeddings=False,
            rope_theta=1000000.0,
        )
    if name == "gemma3":
        return Gemma3TextConfig(
            **{**_COMMON, "num_hidden_layers": 4, "num_key_value_heads": 1},
            head_dim=32,
            query_pre_attn_scalar=24,
            sliding_window=8,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
            final_logit_softcapping=30.0,
            attn_logit_softcapping=50.0,
        )
    raise KeyError(name)


TINY_ARCHS = ("llama", "llama3-scaled-rope", "smollm2-like", "qwen2", "qwen3", "qwen3-8kv", "gemma3")


def build_hf_model(name: str, seed: int = 0):
    """A float32 transformers model of the preset with every weight perturbed (deterministic)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = hf_config(name)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


def save_word_tokenizer(path: Path) -> None:
    """A word-level tokenizer over tokens "w3".."w255" with specials, saved as transformers saves one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}"
    tok.save_pretrained(path)


def save_tiny_checkpoint(name: str, path: Path, seed: int = 0):
    """Saves the preset's model (safetensors + config.json) and tokenizer to `path`; returns the model."""
    model = build_hf_model(name, seed)
    model.save_pretrained(path, safe_serialization=True)
    save_word_tokenizer(path)
    return model


def full_sequence_logits(target, ids: list[int]):
    """dflax's float32 logits [T, V] for a whole sequence: one causal forward over an empty cache (in the
    target's dtype)."""
    from dflax.divergence import sequence_logits

    return sequence_logits(target, ids)
