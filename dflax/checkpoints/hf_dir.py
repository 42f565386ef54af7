"""Read a local HF checkpoint directory (config.json + *.safetensors) into a ModelConfig and tensors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from dflax.models.config import ModelConfig


def read_hf_dir(path: str | Path) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Loads an HF checkpoint directory.

    Args:
      path: a directory holding config.json and one or more .safetensors files.

    Returns:
      (config, HF-named tensors as numpy arrays; bfloat16 stays bfloat16 via ml_dtypes).

    Raises:
      FileNotFoundError: when config.json or the safetensors files are missing.
      UnsupportedArchitectureError: when the config names an architecture dflax cannot run.
    """
    from safetensors import safe_open

    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{path} has no config.json; an HF checkpoint directory needs one")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{path} has no *.safetensors files (PyTorch .bin checkpoints are not read; convert them with "
            "transformers' save_pretrained(safe_serialization=True))"
        )
    config = ModelConfig.from_hf(json.loads(config_file.read_text()))
    tensors = {}
    for file in files:
        with safe_open(str(file), framework="flax") as f:
            for name in f.keys():
                tensors[name] = np.asarray(f.get_tensor(name))
    return config, tensors
