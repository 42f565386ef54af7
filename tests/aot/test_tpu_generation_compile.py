"""Whole generation programs compiled for TPU on this CPU with the Pallas attention backend in bf16:
prefill and the decode loop (draft -> verify -> accept -> commit in a while_loop) of SmolLM2-135M with its
shipped DFlash drafter, Gemma 3 270M with a DFlash drafter of the default shape, and Qwen3-8B with a
DFlash drafter of the official shape, from configs alone (no weights)."""

from __future__ import annotations

import re

import pytest

from dflax.aot.generation import StepShape, compile_generation
from dflax.aot.models import model_plan
from dflax.aot.report import CompiledNumbers

# preset -> the topology compiled for: Qwen3-8B's 16.4 GB of bf16 weights do not fit one v5e chip's
# 15.75 GiB (the compiler refuses it), so it compiles for one v6e chip (32 GiB).
MODELS = {"smollm2-135m": "v5e:2x2", "gemma3-270m": "v5e:2x2", "qwen3-8b": "v6e:2x2"}
# Two rows, a 1024-token prompt bucket (two chunks of new tokens in the prefill kernel), blocks of 16.
SHAPE = StepShape(batch=2, prompt_len=1024, max_new_tokens=64, block_size=16)


@pytest.mark.slow
@pytest.mark.parametrize("preset", list(MODELS))
def test_prefill_and_decode_loop_compile_with_the_pallas_kernel(tpu_device, preset):
    plan = model_plan(preset)
    compiled = compile_generation(plan, SHAPE, tpu_device(MODELS[preset]), stages=("prefill", "decode_loop"))
    num_layers = plan.target.num_layers
    layers = num_layers + plan.drafter.layers.num_layers
    for stage, done in compiled.items():
        # Every attention layer calls the public op, which runs the Mosaic kernel (the reference path would
        # leave no tpu_custom_call); the layers share one lowered copy of the op.
        text = done.lowered.as_text()
        calls = len(re.findall(r"call @tree_attention(_\d+)?\b", text))  # one function per layer kind
        wanted = num_layers if stage == "prefill" else layers
        assert "tpu_custom_call" in text and calls >= wanted, (stage, calls)
        # Embedding lookups gather the bf16 table itself: the CPU's uint16 view of it
        # (pallas_kernels/bits_slicing.py) is a table-sized copy on TPU (1.24 GB for Qwen3-8B).
        table_bits = f"tensor<{plan.target.vocab_size}x{plan.target.hidden_size}xui16>"
        assert table_bits not in text, (stage, table_bits)
    prefill = CompiledNumbers.of(compiled["prefill"].compiled)
    loop = CompiledNumbers.of(compiled["decode_loop"].compiled)
    cfg = plan.target
    cache = 2 * cfg.num_layers * SHAPE.batch * SHAPE.slots(15) * cfg.num_kv_heads * cfg.head_dim * 2
    # Parameters (bf16) and the cache are the programs' arguments ...
    assert prefill.argument_bytes >= 2 * _param_count(plan) + cache, prefill
    # ... and the decode loop updates its donated state in place (a lost donation doubles the cache).
    assert loop.alias_bytes >= cache, loop
    # Scratch stays far below a weight copy: 111 / 125 / 67 MB for the three (Qwen3-8B held 1.3 GB while
    # its embedding table was gathered through a uint16 view).
    assert loop.temp_bytes < cache + 2**28, loop


def _param_count(plan) -> int:
    cfg = plan.target
    attention = cfg.hidden_size * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    attention += cfg.num_heads * cfg.head_dim * cfg.hidden_size
    mlp = 3 * cfg.hidden_size * cfg.intermediate_size
    embeddings = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    return cfg.num_layers * (attention + mlp) + embeddings
