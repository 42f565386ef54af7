"""`dflax.divergence`: where a greedy output leaves the plain one, judged by the target's logits there."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import dflax
from dflax.divergence import first_difference, first_differences, sequence_logits


@pytest.fixture(scope="module")
def target(tiny_checkpoint):
    return dflax.load_target(str(tiny_checkpoint("qwen3")[0]))


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2, 3], [1, 2]) == 2  # one output is a prefix of the other


def test_sequence_logits_are_hf_logits_of_the_unpadded_sequence(target, tiny_checkpoint):
    """The forward is padded to a length bucket; the real positions' logits are HF's."""
    ids = [5, 17, 3, 99, 42, 7, 8]
    with torch.no_grad():
        expected = tiny_checkpoint("qwen3")[1](torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(sequence_logits(target, ids), expected, rtol=1e-4, atol=1e-4)


def test_first_differences_tell_a_near_tie_from_a_wrong_token(target):
    prompt = [5, 6, 7, 8]
    plain = []
    for _ in range(6):  # greedy, one forward per token
        plain.append(int(np.argmax(sequence_logits(target, prompt + plain)[-1])))
    logits = sequence_logits(target, prompt + plain[:3])[-1]
    order = np.argsort(-logits)
    assert order[0] == plain[3]
    second, far = plain[:3] + [int(order[1])], plain[:3] + [int(order[-1])]
    records = first_differences(target, [prompt] * 3, [plain] * 3, [plain, second, far])
    assert [r["prompt"] for r in records] == [1, 2]  # the identical output has no record
    tie, wrong = records
    assert tie["position"] == wrong["position"] == 3 and tie["reference_token"] == plain[3]
    assert tie["ranks"] == [0, 1] and tie["gap"] == pytest.approx(tie["top2_gap"]) and tie["gap"] > 0
    assert wrong["ranks"] == [0, len(logits) - 1] and wrong["gap"] > tie["gap"]
