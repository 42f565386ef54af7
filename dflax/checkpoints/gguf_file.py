"""Read a GGUF file (llama.cpp format) into a ModelConfig and HF-named float tensors.

Quantized tensors are dequantized with the `gguf` package. llama.cpp's converter stores llama q/k rows
permuted for interleaved RoPE; they are un-permuted here to the HF (rotate-half) layout. Gemma 3 norm
weights are stored with the +1 already added; they are turned back into HF offsets (w - 1).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from pathlib import Path

import numpy as np

from dflax.models.config import ModelConfig, UnsupportedArchitectureError
from dflax.paths import cache_dir, source_hash

_GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3"}

# GGUF tensor suffix -> HF module path inside a layer.
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LLAMA_LAYER_NAMES = {**_LAYER_NAMES, "ffn_norm": "post_attention_layernorm"}
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

# Gemma 3 facts the GGUF metadata does not carry (HF Gemma3TextConfig defaults).
_GEMMA3_LOCAL_ROPE_THETA = 10000.0
_GEMMA3_SLIDING_PATTERN = 6

# The code whose output the cache holds: this conversion and ModelConfig's (de)serialisation.
_CONVERSION_MODULES = (__name__, "dflax.models.config")


# (path, size, mtime) -> parsed reader, inside `one_parse_per_file` only (None outside it).
_shared_readers: dict[tuple[str, int, int], object] | None = None


@contextlib.contextmanager
def one_parse_per_file():
    """Within this block `open_gguf` parses each GGUF once; the readers are dropped when it ends.

    Parsing a GGUF's metadata costs seconds of Python (Gemma 3's 262k-token vocabulary: ~15 s on a 2-core
    EPYC), and a first load reads one file for its weights and its tokenizer. A parsed Gemma 3 reader holds
    ~700 MB of resident memory, so readers are shared for one load, not kept for the process.
    """
    global _shared_readers
    outermost = _shared_readers is None
    if outermost:
        _shared_readers = {}
    try:
        yield
    finally:
        if outermost:
            _shared_readers = None


def open_gguf(path: str | Path):
    """A `gguf.GGUFReader` of `path`: parsed now, or the one parsed earlier in `one_parse_per_file` while the
    file is unchanged."""
    import gguf

    path = Path(path).expanduser().resolve()
    if _shared_readers is None:
        return gguf.GGUFReader(str(path))
    stat = path.stat()
    key = (str(path), stat.st_size, stat.st_mtime_ns)  # an edited file is parsed again
    if key not in _shared_readers:
        _shared_readers[key] = gguf.GGUFReader(str(path))
    return _shared_readers[key]


def _field(reader, key, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def read_config(reader) -> ModelConfig:
    """The ModelConfig described by a GGUF file's metadata."""
    gguf_arch = _field(reader, "general.architecture")
    arch = _GGUF_ARCH.get(gguf_arch)
    if arch is None:
        raise UnsupportedArchitectureError(
            f"GGUF architecture {gguf_arch!r} is not supported; dflax runs {', '.join(sorted(_GGUF_ARCH))}"
        )

    def meta(key, default=None):
        return _field(reader, f"{gguf_arch}.{key}", default)

    num_layers = int(meta("block_count"))
    num_heads = int(meta("attention.head_count"))
    hidden = int(meta("embedding_length"))
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    layer_types = ()
    if arch == "gemma3":
        layer_types = tuple(
            "full_attention" if (i + 1) % _GEMMA3_SLIDING_PATTERN == 0 else "sliding_attention"
            for i in range(num_layers)
        )
    return ModelConfig(
        arch=arch,
        vocab_size=int(embd.shape[1]),
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(meta("attention.head_count_kv", num_heads)),
        head_dim=int(meta("attention.key_length", hidden // num_heads)),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        local_rope_theta=_GEMMA3_LOCAL_ROPE_THETA,
        sliding_window=int(meta("attention.sliding_window")) if arch == "gemma3" else None,
        layer_types=layer_types,
        tie_word_embeddings=not any(t.name == "output.weight" for t in reader.tensors),
        max_position_embeddings=int(meta("context_length", 8192)),
        query_pre_attn_scalar=float(meta("attention.key_length", hidden // num_heads))
        if arch == "gemma3"
        else None,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
    )


def _unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's q/k row permutation (interleaved pairs -> rotate-half halves)."""
    out_dim = weight.shape[0]
    rest = weight.shape[1:]
    w = weight.reshape(num_heads, out_dim // num_heads // 2, 2, *rest)
    return w.swapaxes(1, 2).reshape(weight.shape)


def _hf_name(tensor_name: str, arch: str) -> str | None:
    parts = tensor_name.split(".")
    if parts[0] == "blk":
        table = _GEMMA_LAYER_NAMES if arch == "gemma3" else _LLAMA_LAYER_NAMES
        module = table.get(parts[2])
        return None if module is None else f"model.layers.{parts[1]}.{module}.{parts[3]}"
    module = _GLOBAL_NAMES.get(parts[0])
    return None if module is None else f"{module}.{parts[1]}"


def _dequantize_gguf(path: Path) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Parses and dequantizes a GGUF checkpoint (slow: seconds; see `read_gguf` for the cached path).

    Args:
      path: a .gguf file of a supported architecture.

    Returns:
      (config, HF-named float32 tensors).

    Raises:
      UnsupportedArchitectureError: for an architecture dflax cannot run.
      ValueError: for a tensor name dflax does not know (a variant of the architecture).
    """
    import gguf

    reader = open_gguf(path)
    config = read_config(reader)
    tensors = {}
    for tensor in reader.tensors:
        if tensor.name == "rope_freqs.weight":
            raise UnsupportedArchitectureError(
                f"{path}: GGUF with rope_freqs (Llama 3.1 RoPE scaling) is not supported; "
                "load the HF safetensors checkpoint directory instead"
            )
        name = _hf_name(tensor.name, config.arch)
        if name is None:
            raise ValueError(f"{path}: unknown tensor {tensor.name!r} for architecture {config.arch}")
        value = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        value = value.reshape(tuple(int(d) for d in reversed(tensor.shape)))
        if config.arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_heads if "q_proj" in name else config.num_kv_heads
            value = _unpermute_rope_rows(value, heads)
        if config.arch == "gemma3" and name.endswith("norm.weight"):
            value = value - 1.0
        tensors[name] = value
    return config, tensors


def _cache_entry(path: Path) -> Path:
    stat = path.stat()
    key = hashlib.sha256(
        f"{source_hash(*_CONVERSION_MODULES)}:{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()
    ).hexdigest()[:16]
    return cache_dir() / "gguf" / f"{path.stem}-{key}"


def _cached_config(entry: Path) -> ModelConfig:
    return ModelConfig.from_dict(json.loads((entry / "config.json").read_text()))


def read_gguf_config(path: str | Path) -> ModelConfig:
    """A GGUF checkpoint's ModelConfig, from `read_gguf`'s cache entry when there is one.

    Raises:
      UnsupportedArchitectureError: for an architecture dflax cannot run.
    """
    entry = _cache_entry(Path(path))
    if (entry / "config.json").is_file():
        return _cached_config(entry)
    return read_config(open_gguf(path))


def read_gguf(path: str | Path) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Loads a GGUF checkpoint, dequantized once and then read from dflax's cache.

    Parsing a GGUF and dequantizing it takes seconds; the float32 result is saved as safetensors under
    the cache directory (keyed by the file's path, size and mtime and by the source of the converting code)
    and later loads read that instead.

    Args:
      path: a .gguf file of a supported architecture.

    Returns:
      (config, HF-named float32 tensors).

    Raises:
      UnsupportedArchitectureError: for an architecture dflax cannot run.
      ValueError: for a tensor name dflax does not know (a variant of the architecture).
    """
    from safetensors.numpy import load_file, save_file

    path = Path(path)
    entry = _cache_entry(path)
    if (entry / "model.safetensors").is_file():
        return _cached_config(entry), load_file(str(entry / "model.safetensors"))
    config, tensors = _dequantize_gguf(path)
    entry.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=entry.parent) as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config.to_dict()))
        save_file(tensors, str(Path(tmp) / "model.safetensors"))
        try:
            os.replace(tmp, entry)
        except OSError:  # another process filled the entry first
            pass
        else:
            os.mkdir(tmp)  # TemporaryDirectory cleans up the path it created
    return config, tensors
