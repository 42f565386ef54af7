"""The decode loop against the reference's (`dflash.model.dflash_generate`), on SmolLM2 with the shipped
official-format drafter: at T=0, batch 1, the same tokens and the same tokens committed at every step.

The reference runs in a child process (dflax.reference_baseline), dflax one jitted decode step at a time
(dflax.reference.step_commits). Steps are compared while the reference drafts a whole block; within the
last B tokens of the budget it drafts a shorter one (see dflax.reference.Agreement).
"""

from __future__ import annotations

import pytest

import dflax
from dflax.drafters import load_drafter
from dflax.generation import encode_prompt
from dflax.prompts import load_prompts
from dflax.reference import compare, full_block_steps

PROMPTS = 8
MAX_NEW_TOKENS = 64

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def agreements():
    target = dflax.load_target("smollm2-135m")
    drafter = load_drafter("smollm2-135m-official", target)
    records, _ = load_prompts("humaneval")
    ids = [encode_prompt(target, r.prompt) for r in records[:PROMPTS]]
    return compare(target, drafter, ids, MAX_NEW_TOKENS)


def test_same_tokens_and_commits_at_every_step(agreements):
    for i, a in enumerate(agreements):
        assert a.same_tokens, (i, a)
        assert a.same_commits, (i, a)
        assert a.compared_steps >= 5, (i, a)  # most of the budget is compared
    assert sum(a.reference_tau for a in agreements) / len(agreements) > 1.5  # a drafter that drafts


def test_full_block_steps_stop_where_the_budget_shortens_the_block():
    # budget 10, B = 4: steps start after 1, 3, 6 and 9 tokens; the fourth verifies 10 + 1 - 9 = 2 < 4
    assert full_block_steps([2, 3, 3, 1], 10, 4) == 3
    assert full_block_steps([1] * 9, 10, 4) == 7
    assert full_block_steps([], 10, 4) == 0
