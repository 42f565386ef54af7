"""The files every drafter directory shares: config.json, model.safetensors and the optional draft vocabulary.

DFlash (`dflax.drafters.checkpoint`) and DART (`dflax.drafters.dart_checkpoint`) directories differ only in
their config dictionaries and tensor names; reading and writing the files is done here once.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import flax
import jax
import jax.numpy as jnp
import numpy as np

from dflax.checkpoints.params import CheckpointError
from dflax.drafters.draft_vocab import check_draft_vocab

DRAFT_VOCAB = "draft_vocab"


def read_config_json(path: Path, kind: str) -> dict:
    """The config.json dictionary of a drafter directory.

    Raises:
      FileNotFoundError: when the directory has no config.json.
    """
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a {kind} drafter directory (no config.json)")
    return json.loads((path / "config.json").read_text())


def read_tensors(path: Path, vocab_size: int) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
    """All tensors of a drafter directory's *.safetensors, and its draft vocabulary apart (None = whole).

    Raises:
      FileNotFoundError: when there are no *.safetensors files.
      CheckpointError: when the draft vocabulary is not a valid list of token ids below `vocab_size`.
    """
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors weights")
    tensors = {}
    for file in files:
        with safe_open(str(file), framework="flax") as f:
            tensors.update({name: np.asarray(f.get_tensor(name)) for name in f.keys()})
    draft_vocab = tensors.pop(DRAFT_VOCAB, None)
    if draft_vocab is not None:
        try:
            draft_vocab = check_draft_vocab(draft_vocab, vocab_size)
        except ValueError as err:
            raise CheckpointError(f"{path}: tensor {DRAFT_VOCAB!r}: {err}") from None
    return tensors, draft_vocab


def write_drafter_dir(
    path: Path,
    params: dict,
    tensor_name: Callable[[tuple[str, ...]], str],
    config_json: dict,
    file_format: str,
    dtype: str,
    draft_vocab: np.ndarray | None,
    vocab_size: int,
) -> None:
    """Writes model.safetensors (each parameter under `tensor_name(path)`, cast to `dtype`, float32 or
    bfloat16, plus the draft vocabulary when given) and config.json."""
    from safetensors.numpy import save_file

    np_dtype = {"float32": np.float32, "bfloat16": jnp.bfloat16}[dtype]
    path.mkdir(parents=True, exist_ok=True)
    flat = flax.traverse_util.flatten_dict(params["params"])
    tensors = {tensor_name(p): np.asarray(jax.device_get(v)).astype(np_dtype) for p, v in flat.items()}
    if draft_vocab is not None:
        tensors[DRAFT_VOCAB] = check_draft_vocab(draft_vocab, vocab_size)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": file_format})
    (path / "config.json").write_text(json.dumps(config_json, indent=2) + "\n")
