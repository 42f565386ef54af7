"""`dflax export --format official`: the reference loads what it writes; what does not fit is named."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from dflash.model import DFlashDraftModel
from safetensors import safe_open
from typer.testing import CliRunner

from dflax.cli import app
from dflax.drafters.checkpoint import load_drafter_checkpoint, save_drafter
from dflax.drafters.dflash import DFlashConfig, DFlashDrafter, init_drafter_params
from dflax.drafters.official import NotOfficialFormatError, export_official
from dflax.models.config import ModelConfig

TARGET = ModelConfig(
    arch="llama", vocab_size=112, hidden_size=32, intermediate_size=56, num_layers=7, num_heads=4,
    num_kv_heads=2, head_dim=12, tie_word_embeddings=False,
)  # fmt: skip
OFFICIAL = DFlashConfig.for_target(TARGET, num_layers=2, block_size=8, mask_token_id=3)


def saved(path, config: DFlashConfig, dtype="float32", draft_vocab=None):
    params = init_drafter_params(DFlashDrafter(config), seed=2)
    save_drafter(path, config, params, TARGET.num_layers, dtype, draft_vocab)
    return path


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_export_is_loaded_unchanged_by_the_reference(tmp_path, dtype):
    out = export_official(saved(tmp_path / "src", OFFICIAL, dtype), tmp_path / "out")
    model = DFlashDraftModel.from_pretrained(str(out), torch_dtype=torch.float32)
    assert (model.block_size, model.mask_token_id) == (8, 3)
    assert list(model.target_layer_ids) == list(OFFICIAL.target_layer_ids)
    config, params, vocab = load_drafter_checkpoint(out, jnp.float32)
    assert config == OFFICIAL and vocab is None
    ours = params["params"]["layers_1"]["self_attn"]["q_proj"]["weight"]
    theirs = model.layers[1].self_attn.q_proj.weight.detach().numpy()
    np.testing.assert_array_equal(np.asarray(ours), theirs)  # both [out, in]
    with safe_open(str(out / "model.safetensors"), framework="numpy") as f:
        assert {f.get_slice(n).get_dtype() for n in f.keys()} == {"F32" if dtype == "float32" else "BF16"}


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (dict(layers=dataclasses.replace(OFFICIAL.layers, arch="llama")), "layer_kind 'qwen3'"),
        (dict(mask_token_id=None), "set mask_token_id"),
        (dict(feature_norm=True), "feature_norm false"),
        ("draft_vocab", "draft_vocab_size 0"),
    ],
)
def test_what_does_not_fit_is_named(tmp_path, change, named):
    if change == "draft_vocab":
        source = saved(tmp_path / "src", OFFICIAL, draft_vocab=np.arange(40, dtype=np.int32))
    else:
        source = saved(tmp_path / "src", dataclasses.replace(OFFICIAL, **change))
    with pytest.raises(NotOfficialFormatError, match=named):
        export_official(source, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_cli_names_the_shipped_drafters_options():
    result = CliRunner().invoke(app, ["export", "--drafter", "shipped", "--out", "/nonexistent/x"])
    assert result.exit_code != 0
    assert "layer_kind 'qwen3'" in result.output and "set mask_token_id" in result.output
