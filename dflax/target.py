"""A loaded target: config, parameters, tokenizer and the module that runs them."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from dflax.checkpoints.gguf_file import one_parse_per_file, read_gguf
from dflax.checkpoints.hf_dir import read_hf_dir
from dflax.checkpoints.params import to_params
from dflax.checkpoints.registry import resolve
from dflax.checkpoints.tokenizer import Tokenizer
from dflax.models.attention import ATTENTION_BACKENDS
from dflax.models.config import ModelConfig
from dflax.models.transformer import Transformer
from dflax.sharding import ShardingRules, make_mesh
from dflax.sharding.placement import shard_params

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True, eq=False)
class Target:
    """A target model ready to generate.

    Attributes:
      name: what it was loaded from (a built-in name or a path).
      config: its architecture.
      params: {"params": ...} parameter tree.
      tokenizer: its tokenizer and chat template.
      module: the Flax module that runs it.
      cache_dtype: dtype of its KV cache (`default_cache_dtype` of the parameters' dtype, unless asked).
      mesh: the (data, model) device mesh its parameters are sharded over (None: one device).
    """

    name: str
    config: ModelConfig
    params: dict
    tokenizer: Tokenizer
    module: Transformer
    cache_dtype: jnp.dtype
    mesh: Mesh | None = None

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """Every token id that ends generation (tokenizer and config agree or are merged)."""
        return tuple(sorted(set(self.tokenizer.eos_ids) | set(self.config.eos_token_ids)))

    @property
    def dtype(self) -> jnp.dtype:
        """Parameter and activation dtype."""
        return self.module.dtype


def weights_fingerprint(target: Target) -> str:
    """A sha256 of the target's parameters (names, dtypes, shapes and bytes): what its forward computes with.

    Two loads of the same weights agree; another checkpoint, dtype or an edited tensor does not. Hashing
    reads every parameter once (about a second for SmolLM2-135M in float32).
    """
    digest = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_flatten_with_path(target.params)[0]:
        array = np.asarray(jax.device_get(leaf))
        digest.update(f"{jax.tree_util.keystr(path)}:{array.dtype}:{array.shape};".encode())
        digest.update(np.ascontiguousarray(array).view(np.uint8).data)
    return digest.hexdigest()


def default_dtype() -> str:
    """float32 on CPU; bfloat16 on TPU/GPU."""
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def default_cache_dtype(dtype: str) -> str:
    """The KV cache dtype for parameters of `dtype`: the same, except float32 for 16-bit ones on the CPU.

    XLA's CPU backend has no 16-bit dynamic slice or update: reading a chunk of a bf16 cache or writing a
    step's keys into it converts the whole buffer to float32 and back, so every step would cost in
    proportion to the cache's slots, empty ones included. A float32 cache holds the same values (keys
    and values are projected in `dtype` and widen exactly), at twice the memory.
    """
    return "float32" if jax.default_backend() == "cpu" and dtype in ("bfloat16", "float16") else dtype


def load_target(
    name_or_path: str | Path,
    dtype: str | None = None,
    attention_backend: str = "auto",
    cache_dtype: str | None = None,
    mesh: Mesh | str | None = None,
) -> Target:
    """Loads a target model and its tokenizer, offline.

    Args:
      name_or_path: "smollm2-135m", "gemma3-270m", a .gguf file or an HF checkpoint directory
        (config.json + *.safetensors + tokenizer.json) of a supported architecture.
      dtype: "float32", "bfloat16" or "float16"; None picks float32 on CPU and bfloat16 on TPU/GPU.
      attention_backend: "auto", "chunked", "reference", "pallas", "pallas_tpu", "pallas_gpu" or
        "pallas_interpret" (see `dflax.models.attention.AttentionConfig`).
      cache_dtype: KV cache dtype, one of the dtype names; None = `dtype`, except float32 for a 16-bit
        `dtype` on the CPU (`default_cache_dtype`). A bfloat16 cache under a float32 model halves the
        cache's memory (on TPU/GPU also its reads).
      mesh: shard over a device mesh: a `dflax.sharding.make_mesh` Mesh or "data=D,model=M" (the first
        D * M devices). Parameters split over `model` by `dflax.sharding.rules`, batch rows over `data`;
        generation then runs on the mesh and gives the one-device tokens. None: one device.

    Returns:
      The loaded Target.

    Raises:
      UnknownModelError: for a name that is not built in and not a local checkpoint.
      UnsupportedArchitectureError: for a checkpoint of an architecture dflax cannot run.
      CheckpointError: for tensors that do not fit the config.
    """
    dtype = dtype or default_dtype()
    cache_dtype = cache_dtype or default_cache_dtype(dtype)
    for name, value in (("dtype", dtype), ("cache_dtype", cache_dtype)):
        if value not in _DTYPES:
            raise ValueError(f"{name} {value!r} unknown; choose one of {', '.join(_DTYPES)}")
    if attention_backend not in ATTENTION_BACKENDS:  # before any weights are read
        raise ValueError(
            f"attention backend {attention_backend!r} unknown; choose one of {', '.join(ATTENTION_BACKENDS)}"
        )
    if isinstance(mesh, str):
        mesh = make_mesh(mesh)  # a bad mesh fails before any weights are read
    kind, path = resolve(name_or_path)
    if kind == "gguf":
        with one_parse_per_file():  # weights and tokenizer read one parse of the file
            config, tensors = read_gguf(path)
            tokenizer = Tokenizer.from_gguf(path)
    else:
        config, tensors = read_hf_dir(path)
        tokenizer = Tokenizer.from_hf_dir(path)
    jdtype = _DTYPES[dtype]
    module = Transformer(config, dtype=jdtype, attention_backend=attention_backend)
    if mesh is None:
        params = to_params(config, tensors, jdtype)
    else:  # from host memory straight into the shards: a target larger than one device still loads
        rules = ShardingRules.for_model(config, mesh)
        params = shard_params(to_params(config, tensors, jdtype, on_host=True), rules)
    return Target(str(name_or_path), config, params, tokenizer, module, _DTYPES[cache_dtype], mesh)
