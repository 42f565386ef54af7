"""A toy target whose continuations have exact probabilities, for chi-square tests of the decode loop.

A random 2-layer Llama over VOCAB = 6 tokens has 6 ** 4 continuations of 4 tokens after PROMPT; their exact
probabilities come from its logits and the float64 definition in `sampling_definition`, never from dflax's
sampling code. `sample_outcomes` draws NUM_ROWS continuations through prefill + decode_loop with any
`Proposer`, and `compare` scores them against an exact distribution (chi-square and total variation).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from scipy import stats

from dflax.decoding.decode import decode_loop, prefill
from dflax.decoding.sampling import SamplingParams
from dflax.models.cache import KVCache
from dflax.models.config import ModelConfig
from dflax.models.transformer import Transformer

VOCAB = 6
PROMPT = [1, 4, 2]
NUM_NEW = 4
NUM_ROWS = 32768
OUTCOMES = VOCAB**NUM_NEW
# Total variation bound as in test_acceptance: mean at most 0.5 * sqrt(K / N), exceeded by more than
# sqrt(ln(1e6) / (2 N)) with probability below 1e-6 (McDiarmid).
TV_BOUND = 0.5 * np.sqrt(OUTCOMES / NUM_ROWS) + np.sqrt(np.log(1e6) / (2 * NUM_ROWS))


@dataclasses.dataclass(frozen=True)
class ToyTarget:
    """A tiny random Llama over VOCAB tokens: its module, config and parameters."""

    config: ModelConfig
    module: Transformer
    params: dict


def make_toy() -> ToyTarget:
    """Weights perturbed from init so the next-token logits spread about 1.3 (top token ~0.65)."""
    config = ModelConfig(
        arch="llama",
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        tie_word_embeddings=False,
        max_position_embeddings=64,
    )
    module = Transformer(config)
    params = module.init(
        jax.random.key(0),
        jnp.zeros((1, 1), jnp.int32),
        jnp.zeros((1, 1), jnp.int32),
        KVCache.init(config, 1, 1, jnp.float32),
        jnp.ones((1, 1, 1), bool),
        method=lambda m, *args: m.logits(m(*args)[0]),
    )
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    noisy = [x + 0.3 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
    return ToyTarget(config, module, jax.tree.unflatten(tree, noisy))


def last_logits(toy: ToyTarget, sequences: list[list[int]]) -> np.ndarray:
    """[N, V] float64 logits after each of N equal-length sequences (one causal forward, empty cache)."""
    seqs = jnp.asarray(sequences, jnp.int32)
    n, t = seqs.shape
    positions = jnp.broadcast_to(jnp.arange(t), (n, t))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (n, t, t))
    cache = KVCache.init(toy.config, n, t, jnp.float32)
    hidden, _, _ = toy.module.apply(toy.params, seqs, positions, cache, mask)
    return np.asarray(toy.module.apply(toy.params, hidden[:, -1], method=Transformer.logits), np.float64)


def exact_joint(toy: ToyTarget, probs_of) -> np.ndarray:
    """[V ** NUM_NEW] probability of each continuation, with `probs_of` mapping logits [N, V] to probs."""
    joint = np.ones(1)
    for length in range(NUM_NEW):
        prefixes = [PROMPT + list(s) for s in itertools.product(range(VOCAB), repeat=length)]
        joint = (joint[:, None] * probs_of(last_logits(toy, prefixes))).reshape(-1)
    return joint


@functools.partial(jax.jit, static_argnums=(0, 1))
def _generate(module, proposer, params, sampling, row_keys, drafter_params=None):
    """NUM_ROWS continuations of PROMPT by prefill + decode_loop: tokens [N, NUM_NEW], accept_hist."""
    prompt = jnp.broadcast_to(jnp.asarray(PROMPT, jnp.int32), (NUM_ROWS, len(PROMPT)))
    slots = max(16, len(PROMPT) + NUM_NEW + proposer.num_draft + 1)  # room for a verify of every draft
    cache = KVCache.init(module.config, NUM_ROWS, slots, jnp.float32)
    state = prefill(
        module,
        params,
        prompt,
        jnp.full((NUM_ROWS,), len(PROMPT), jnp.int32),
        cache,
        jnp.full((NUM_ROWS,), NUM_NEW, jnp.int32),
        row_keys,
        jnp.asarray([-1], jnp.int32),  # no EOS
        sampling,
        drafter_params,
        max_tokens=NUM_NEW,
        proposer=proposer,
    )
    state = decode_loop(module, params, state, sampling, drafter_params, proposer)
    return state.tokens[:, :NUM_NEW], state.accept_hist


def sample_outcomes(
    toy: ToyTarget, proposer, settings: dict, drafter_params=None
) -> tuple[np.ndarray, np.ndarray]:
    """Counts [V ** NUM_NEW] of generated continuations, and the accept histogram summed over rows
    (`drafter_params`: the proposer's parameters, None for proposers without any)."""
    row_keys = jax.vmap(jax.random.key)(jnp.arange(NUM_ROWS, dtype=jnp.uint32))
    sampling = SamplingParams.make(**settings)
    tokens, hist = _generate(toy.module, proposer, toy.params, sampling, row_keys, drafter_params)
    index = (np.asarray(tokens) * VOCAB ** np.arange(NUM_NEW - 1, -1, -1)).sum(axis=1)
    return np.bincount(index, minlength=OUTCOMES).astype(np.float64), np.asarray(hist).sum(axis=0)


def compare(observed: np.ndarray, exact: np.ndarray) -> tuple[float, float]:
    """(chi-square p-value, 0 when an impossible continuation appears; total variation distance)."""
    n = observed.sum()
    total_variation = 0.5 * np.abs(observed / n - exact).sum()
    if observed[exact == 0].sum() > 0:
        return 0.0, float(total_variation)
    expected = n * exact
    common = expected >= 5  # pool the rare bins so the chi-square approximation holds
    observed = np.append(observed[common], observed[~common].sum())
    expected = np.append(expected[common], expected[~common].sum())
    observed, expected = observed[expected > 0], expected[expected > 0]
    expected *= observed.sum() / expected.sum()
    return float(stats.chisquare(observed, expected).pvalue), float(total_variation)
