"""DART drafter directories: config.json + model.safetensors (EAGLE-3-style names), plus its n-gram counts.

- config.json: a Llama-style layer config (hidden_size, intermediate_size, num_attention_heads,
  num_key_value_heads, head_dim, rms_norm_eps, rope_theta, vocab_size = the target's, ...) with
  `architectures: ["DartDraftModel"]`, `num_target_layers` and `dart_config: {"target_layer_ids",
  "num_draft", "draft_vocab_size"}` (+ "feature_norm": true, a dflax option, when set);
- model.safetensors: `fc.weight` [D, K * D], `midlayer.{hidden_norm,input_layernorm,post_attention_layernorm}
  .weight`, `midlayer.self_attn.{q,k,v}_proj.weight` [out, 2D], `midlayer.self_attn.o_proj.weight`,
  `midlayer.mlp.{gate,up,down}_proj.weight`, `norm.weight`, `lm_head.weight` [V', D], `mask_embedding` [2D],
  and with a reduced vocabulary `draft_vocab` [V'] int32 (the target ids of lm_head's rows). The embedding
  is the target's and is not stored.
- ngram-3.npz, ngram-2.npz (optional): the beam's n-gram counts (dflax.drafters.ngram), longest order first.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dflax.checkpoints.params import CheckpointError, map_tensors, param_shapes
from dflax.drafters.dart import DartConfig, DartDrafter, init_dart_params
from dflax.drafters.drafter_files import read_config_json, read_tensors, write_drafter_dir
from dflax.drafters.ngram import NgramTable, load_ngram_table, save_ngram_table
from dflax.models.config import ModelConfig

ARCHITECTURE = "DartDraftModel"


def is_dart_dir(path: Path) -> bool:
    """Whether a directory holds a DART drafter (its config.json names DartDraftModel)."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    return ARCHITECTURE in (json.loads(config.read_text()).get("architectures") or [])


def config_to_json(config: DartConfig, num_target_layers: int) -> dict:
    """The config.json dictionary of a DART drafter."""
    layer = config.layer
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": layer.hidden_size,
        "intermediate_size": layer.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": layer.num_heads,
        "num_key_value_heads": layer.num_kv_heads,
        "head_dim": layer.head_dim,
        "rms_norm_eps": layer.rms_norm_eps,
        "rope_theta": layer.rope_theta,
        "vocab_size": layer.vocab_size,
        "max_position_embeddings": layer.max_position_embeddings,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "num_target_layers": num_target_layers,
        "dart_config": {
            "target_layer_ids": list(config.target_layer_ids),
            "num_draft": config.num_draft,
            "draft_vocab_size": config.draft_vocab_size,
            **({"feature_norm": True} if config.feature_norm else {}),
        },
    }


def config_from_json(data: dict) -> DartConfig:
    """Reads a DART config.json dictionary."""
    dart = data.get("dart_config")
    if not dart or "target_layer_ids" not in dart or "num_draft" not in dart:
        raise CheckpointError("DART config.json needs dart_config.target_layer_ids and dart_config.num_draft")
    layer = ModelConfig.from_hf({**data, "model_type": "llama", "num_hidden_layers": 1})
    return DartConfig(
        layer=layer,
        num_draft=int(dart["num_draft"]),
        target_layer_ids=tuple(int(i) for i in dart["target_layer_ids"]),
        draft_vocab_size=int(dart.get("draft_vocab_size", layer.vocab_size)),
        feature_norm=bool(dart.get("feature_norm", False)),
    )


def save_dart(
    path: str | Path,
    config: DartConfig,
    params: dict,
    num_target_layers: int,
    dtype: str = "float32",
    draft_vocab: np.ndarray | None = None,
    ngram: Sequence[NgramTable] = (),
) -> None:
    """Writes a DART drafter directory (see the module docstring)."""
    path = Path(path)
    write_drafter_dir(
        path,
        params,
        ".".join,
        config_to_json(config, num_target_layers),
        "dflax-dart",
        dtype,
        draft_vocab,
        config.layer.vocab_size,
    )
    for table in ngram:
        save_ngram_table(path / f"ngram-{table.order}.npz", table)


def load_dart_checkpoint(
    path: str | Path, dtype: jnp.dtype
) -> tuple[DartConfig, dict, np.ndarray | None, tuple[NgramTable, ...]]:
    """Reads a DART directory: config, parameters, draft vocabulary (None = whole) and n-gram tables.

    Raises:
      FileNotFoundError: when config.json or the safetensors are missing.
      CheckpointError: when tensors do not fit the config.
    """
    path = Path(path)
    config = config_from_json(read_config_json(path, "DART"))
    tensors, draft_vocab = read_tensors(path, config.layer.vocab_size)
    if draft_vocab is not None and len(draft_vocab) != config.draft_vocab_size:
        raise CheckpointError(
            f"{path}: draft_vocab holds {len(draft_vocab)} ids, config says {config.draft_vocab_size}"
        )
    module = DartDrafter(config, dtype)
    expected = param_shapes(jax.eval_shape(lambda: init_dart_params(module)))
    params = map_tensors(expected, tensors, dtype, "DART drafter")
    tables = sorted(path.glob("ngram-*.npz"), key=lambda p: -int(p.stem.split("-")[1]))
    return config, params, draft_vocab, tuple(load_ngram_table(t) for t in tables)
