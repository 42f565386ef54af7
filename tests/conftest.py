"""Shared fixtures: tiny checkpoints are built once per session and reused by every test."""

from __future__ import annotations

import os

import pytest

# Tests run on the CPU in float32; keep XLA from grabbing every core for one op.
os.environ.setdefault("JAX_PLATFORMS", "cpu")


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """tiny_checkpoint(name) -> (path of a saved tiny HF checkpoint, the torch model)."""
    from tiny_checkpoints import save_tiny_checkpoint

    built = {}

    def get(name: str):
        if name not in built:
            path = tmp_path_factory.mktemp(name)
            built[name] = (path, save_tiny_checkpoint(name, path))
        return built[name]

    return get


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct target (float32), loaded once per session."""
    import dflax

    return dflax.load_target("smollm2-135m")
