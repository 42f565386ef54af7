"""`dflax plan --mesh`: generation compiled sharded over 8 abstract TPU (or GPU) devices, with bytes per
device read from the compiled executable. Qwen3-8B with its DFlash drafter fits a v5e chip per device."""

from __future__ import annotations

import importlib.util
import math

import pytest
from typer.testing import CliRunner

from dflax.aot.generation import StepShape
from dflax.aot.models import model_plan
from dflax.aot.sharded_plan import plan_sharded
from dflax.checkpoints.params import abstract_params
from dflax.cli import app
from dflax.drafters.dflash import DFlashDrafter, init_drafter_params
from dflax.models.transformer import Transformer

runner = CliRunner()


def whole_param_bytes(plan) -> int:
    """bf16 bytes of the target's and the drafter's parameters, unsharded."""
    import jax

    target = abstract_params(Transformer(plan.target, attention_backend="reference"))
    module = DFlashDrafter(plan.drafter, attention_backend="reference")
    drafter = jax.eval_shape(lambda: init_drafter_params(module))
    return 2 * sum(math.prod(x.shape) for x in jax.tree.leaves((target, drafter)))


def _table_rows(output: str, model: str) -> list[list[str]]:
    lines = [line for line in output.splitlines() if line.startswith(f"| {model}")]
    return [[c.strip() for c in line.split("|")[1:-1]] for line in lines]


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_plan_mesh_prints_bytes_per_device(tpu_device, tiny_checkpoint, platform):
    if platform == "cuda" and importlib.util.find_spec("jax_cuda12_plugin") is None:
        pytest.skip("the CUDA compiler is not installed (pip install 'dflax[gpu-aot]')")
    tpu_device("v5e:2x2")
    path = str(tiny_checkpoint("qwen3-8kv")[0])
    args = ["plan", "--model", path, "--drafter", "untrained", "--mesh", "data=2,model=4"]
    args += ["--platform", platform, "--devices", "8", "--batch", "3", "--prompt-len", "16"]
    args += ["--max-new-tokens", "8", "--block-size", "4"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    rows = _table_rows(result.stdout, path)
    assert [r[2] for r in rows] == ["decode_step"], result.stdout
    params_mib, cache_mib, temp_mib, peak_mib = (float(c.replace(",", "")) for c in rows[0][3:7])
    whole = whole_param_bytes(model_plan(path, "untrained")) / 2**20
    # The large matrices are split four ways over `model` (norms stay whole): about a quarter each.
    assert whole / 4 <= params_mib < whole / 3, (params_mib, whole)
    # The table rounds each figure to 0.1 MiB, so the sum of two may exceed the peak by up to 0.1.
    assert cache_mib > 0 and temp_mib >= 0 and peak_mib >= params_mib + cache_mib - 0.1
    assert "batch 4" in " ".join(result.output.split())  # 3 rows padded to a multiple of data=2


@pytest.mark.slow
def test_qwen3_8b_with_its_drafter_fits_v5e_chips_on_8_devices(tpu_device):
    """16.4 GB of bf16 target weights and the 5-layer drafter, split over 4-way tensor parallel and 2-way
    data parallel on a v5e:2x4 slice: each chip holds a quarter of the weights, under its 16 GiB."""
    tpu_device("v5e:2x2")
    chip, shape, (step,) = plan_sharded(
        "qwen3-8b", mesh="data=2,model=4", platform="tpu", devices=8,
        shape=StepShape(batch=2, prompt_len=1024, max_new_tokens=256, block_size=16),
    )  # fmt: skip
    assert chip.name == "TPU v5e" and step.stage == "decode_step"
    whole = whole_param_bytes(model_plan("qwen3-8b"))
    assert whole / 4 <= step.param_bytes < whole / 3.5, (step, whole)
    assert step.peak_bytes < 15.75 * 2**30, step  # the v5e's usable HBM
    assert step.cache_bytes > 0 and step.step_s > 0
    print(step)
