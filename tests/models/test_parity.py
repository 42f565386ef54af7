"""Numerical parity with HF transformers' PyTorch implementations.

Tiny random checkpoints of every supported architecture (built in the test, no downloads) must give the
same float32 logits (within 1e-4) and the same 32 greedy tokens; the real SmolLM2 and Gemma 3 GGUFs must
match transformers' own GGUF loading.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_checkpoints import TINY_ARCHS, full_sequence_logits

import dflax
from dflax.decoding.sampling import SamplingParams
from dflax.runtime.static_batches import generate_ids

LOGIT_ATOL = 1e-4


def hf_greedy(model, ids: list[int], steps: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=steps, min_new_tokens=steps, do_sample=False, pad_token_id=0
        )
    return out[0, len(ids) :].tolist()


def dflax_greedy(target, prompts: list[list[int]], steps: int, batch_size: int) -> list[list[int]]:
    results = generate_ids(
        target,
        prompts,
        max_new_tokens=steps,
        sampling=SamplingParams.make(),
        row_seeds=list(range(len(prompts))),
        batch_size=batch_size,
    )
    return [r.tokens for r in results]


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_logits_and_greedy_match_transformers(arch, tiny_checkpoint):
    path, hf_model = tiny_checkpoint(arch)
    target = dflax.load_target(str(path))
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 256, size=24).tolist()  # longer than Gemma's sliding window of 8
    with torch.no_grad():
        expected = hf_model(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(full_sequence_logits(target, ids), expected, atol=LOGIT_ATOL, rtol=0)

    prompt = ids[:7]
    assert dflax_greedy(target, [prompt], 32, 1)[0] == hf_greedy(hf_model, prompt, 32)


def test_ragged_batch_equals_each_prompt_alone(tiny_checkpoint):
    path, _ = tiny_checkpoint("gemma3")
    target = dflax.load_target(str(path))
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 256, size=n).tolist() for n in (3, 17, 9, 1, 30)]
    batched = dflax_greedy(target, prompts, 20, batch_size=8)
    for prompt, got in zip(prompts, batched):
        assert got == dflax_greedy(target, [prompt], 20, batch_size=1)[0]


@pytest.mark.slow
def test_smollm2_gguf_matches_transformers(smollm2):
    from transformers import AutoModelForCausalLM

    from dflax.checkpoints.model_files import smollm2_gguf_path

    path = smollm2_gguf_path()
    hf_model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    tok = smollm2.tokenizer
    prompts = [
        tok.encode('def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'),
        tok.encode_chat([{"role": "user", "content": "Name three colours of the rainbow."}]),
    ]
    for ids in prompts:
        with torch.no_grad():
            expected = hf_model(torch.tensor([ids])).logits[0].numpy()
        got = full_sequence_logits(smollm2, ids)
        # Logits reach ~35 in magnitude; fp32 summation order differs between XLA and PyTorch.
        np.testing.assert_allclose(got, expected, atol=5e-4, rtol=1e-5)
    for ids, got in zip(prompts, dflax_greedy(smollm2, prompts, 32, batch_size=2)):
        assert got == hf_greedy(hf_model, ids, 32)[: len(got)]


@pytest.mark.slow
def test_gemma3_gguf_matches_transformers():
    from transformers import AutoModelForCausalLM

    from dflax.checkpoints.model_files import gemma3_270m_gguf_path

    target = dflax.load_target("gemma3-270m")
    path = gemma3_270m_gguf_path()
    hf_model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    ids = target.tokenizer.encode("The three primary colours are")
    with torch.no_grad():
        expected = hf_model(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(full_sequence_logits(target, ids), expected, atol=5e-4, rtol=1e-5)
    got = dflax_greedy(target, [ids], 16, batch_size=1)[0]
    assert got == hf_greedy(hf_model, ids, 16)[: len(got)]
