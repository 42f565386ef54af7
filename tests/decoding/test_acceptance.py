"""Tests for the acceptance rules: exact unit cases, and losslessness checked against an exact distribution.

The statistical tests run whole speculative steps on a toy trigram "target" over a tiny vocabulary, whose
distribution over the first NUM_GENERATED tokens is enumerated exactly, with a deliberately poor block
drafter. A chi-square test compares the empirical joint distribution with the exact one; the same test is
shown to reject deliberately wrong rules, so passing it means something.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sampling_definition import target_probs
from scipy import stats

from dflax.decoding.acceptance import accept_block, accept_delta, commit_tokens
from dflax.decoding.sampling import SamplingParams, sample, target_log_probs

VOCAB = 6
DRAFT_LEN = 3
NUM_GENERATED = 3
PROMPT = (1, 4)
NUM_SAMPLES = 200_000
# Every speculative step commits at least one token, so this many steps always produce NUM_GENERATED.
NUM_STEPS = NUM_GENERATED
# Total variation between the empirical and exact distributions over K = V ** 3 outcomes: its mean is at
# most 0.5 * sqrt(K / N) (Cauchy-Schwarz over the per-outcome standard deviations), and by McDiarmid it
# exceeds its mean by more than sqrt(ln(1e6) / (2 N)) with probability below 1e-6.
TV_BOUND = 0.5 * np.sqrt(VOCAB**NUM_GENERATED / NUM_SAMPLES) + np.sqrt(np.log(1e6) / (2 * NUM_SAMPLES))

# Toy target: next-token logits indexed by the previous two tokens, [V, V, V].
TARGET_TABLE = 2.0 * np.random.default_rng(0).standard_normal((VOCAB, VOCAB, VOCAB)).astype(np.float32)


def _make_draft_table(noise_scale: float) -> np.ndarray:
    """A poor block drafter: per-position logits for DRAFT_LEN tokens from the last two committed tokens.

    Position i holds the target's logits along the target's greedy path from that context plus noise, so
    q is far from p yet every acceptance length (0..T) occurs often. Returns [V, V, T, V].
    """
    prev2, prev1 = np.meshgrid(np.arange(VOCAB), np.arange(VOCAB), indexing="ij")  # [V, V] each
    positions = []
    for _ in range(DRAFT_LEN):
        positions.append(TARGET_TABLE[prev2, prev1])  # [V, V, V]
        prev2, prev1 = prev1, positions[-1].argmax(axis=-1)
    noise = noise_scale * np.random.default_rng(1).standard_normal((VOCAB, VOCAB, DRAFT_LEN, VOCAB))
    return (np.stack(positions, axis=2) + noise).astype(np.float32)


DRAFT_TABLE = _make_draft_table(noise_scale=1.0)
DRAFTER_PARAMS = SamplingParams.make(temperature=1.0)

TARGET_SETTINGS = {
    "t1": dict(temperature=1.0),
    "t0.7-top_p0.9": dict(temperature=0.7, top_p=0.9),
}


# ----------------------------------------------------------------------------------------------------------
# Exact unit cases.


def _one_hot_logits(tokens: np.ndarray) -> jax.Array:
    """[B, T + 1] target tokens -> [B, T + 1, V] logits whose argmax is those tokens."""
    return 5.0 * jax.nn.one_hot(jnp.asarray(tokens), VOCAB)


def greedy_oracle(drafts: np.ndarray, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Greedy verification written out: accept drafts while they equal the target's argmax, then commit the
    argmax at the first mismatch (or the bonus). Returns num_accepted [B] and tokens [B, T + 1]."""
    drafts, target = np.asarray(drafts), np.asarray(logits).argmax(axis=-1)
    b, t = drafts.shape
    num_accepted, tokens = np.zeros(b, np.int64), np.zeros((b, t + 1), np.int64)
    for row in range(b):
        n = 0
        while n < t and drafts[row, n] == target[row, n]:
            n += 1
        num_accepted[row] = n
        tokens[row, :n], tokens[row, n] = drafts[row, :n], target[row, n]
    return num_accepted, tokens


def sample_drafts(key, draft_logits, params):
    """Drafts [B, T] drawn independently per position from the drafter's q, with that log q [B, T, V]."""
    log_q = target_log_probs(draft_logits, params)
    return jax.random.categorical(key, log_q, axis=-1).astype(jnp.int32), log_q


def test_accept_delta_at_temperature_zero_per_row():
    target = np.array([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]])  # [B, T + 1]
    drafts = np.array(
        [
            [1, 2, 3],  # all accepted: bonus token at T
            [1, 5, 3],  # mismatch at 1: the target's token replaces the draft
            [0, 2, 3],  # mismatch at 0; later matches must not count
            [1, 2, 0],  # mismatch at the last draft
        ]
    )
    greedy = SamplingParams.make(temperature=0.0)
    result = jax.jit(accept_delta)(jax.random.key(0), jnp.asarray(drafts), _one_hot_logits(target), greedy)
    np.testing.assert_array_equal(greedy_oracle(drafts, _one_hot_logits(target))[0], [3, 1, 0, 2])
    np.testing.assert_array_equal(result.num_accepted, [3, 1, 0, 2])
    np.testing.assert_array_equal(result.tokens, [[1, 2, 3, 4], [1, 2, 0, 0], [1, 0, 0, 0], [1, 2, 3, 0]])
    assert result.num_accepted.dtype == jnp.int32 and result.tokens.dtype == jnp.int32


def _random_block(seed: int, batch: int, draft_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Random target logits [B, T + 1, V] and drafts [B, T] that match the argmax about 70% of the time."""
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((batch, draft_len + 1, VOCAB)).astype(np.float32)
    argmax = logits[:, :-1].argmax(axis=-1)
    drafts = np.where(rng.random(argmax.shape) < 0.7, argmax, rng.integers(0, VOCAB, argmax.shape))
    return drafts.astype(np.int32), logits


def test_accept_delta_at_temperature_zero_is_greedy():
    drafts, logits = _random_block(0, batch=512, draft_len=5)
    params = SamplingParams.make(temperature=0.0, top_p=0.9)
    num_accepted, tokens = greedy_oracle(drafts, logits)
    delta = jax.jit(accept_delta)(jax.random.key(1), drafts, logits, params)
    np.testing.assert_array_equal(delta.num_accepted, num_accepted)
    np.testing.assert_array_equal(delta.tokens, tokens)
    assert 0 < np.mean(num_accepted) < 5  # the batch mixes early, late and full acceptance


def test_accept_block_at_temperature_zero_is_greedy():
    _, logits = _random_block(2, batch=512, draft_len=5)
    # Drafts sampled from a q that is the target's own softmax: often but not always the argmax.
    drafts, log_q = jax.jit(sample_drafts)(jax.random.key(3), logits[:, :-1], DRAFTER_PARAMS)
    params = SamplingParams.make(temperature=0.0)
    num_accepted, tokens = greedy_oracle(drafts, logits)
    block = jax.jit(accept_block)(jax.random.key(4), drafts, log_q, logits, params)
    np.testing.assert_array_equal(block.num_accepted, num_accepted)
    np.testing.assert_array_equal(block.tokens, tokens)


def test_accept_block_accepts_everything_when_q_equals_p():
    _, logits = _random_block(5, batch=512, draft_len=5)
    params = SamplingParams.make(temperature=0.8, top_p=0.9)
    drafts, log_q = jax.jit(sample_drafts)(jax.random.key(6), logits[:, :-1], params)
    result = jax.jit(accept_block)(jax.random.key(7), drafts, log_q, logits, params)
    np.testing.assert_array_equal(result.num_accepted, 5)
    np.testing.assert_array_equal(result.tokens[:, :5], drafts)


# ----------------------------------------------------------------------------------------------------------
# Losslessness on a toy target with an exactly known distribution.


def _exact_joint(settings: dict) -> np.ndarray:
    """[V ** NUM_GENERATED] the target's exact probability of each continuation of PROMPT (float64, by the
    definition in sampling_definition, not by the code under test)."""
    p = target_probs(TARGET_TABLE, **settings)  # [V, V, V]
    a, b = PROMPT
    return np.einsum("i,ij,ijk->ijk", p[a, b], p[b], p).reshape(-1)


def _draft_argmax(key, draft_logits):
    """Deterministic drafts (argmax of the drafter's marginals), with the drafter's soft q alongside."""
    del key
    return jnp.argmax(draft_logits, axis=-1).astype(jnp.int32), jax.nn.log_softmax(draft_logits, axis=-1)


def _draft_sampled(key, draft_logits):
    """Drafts sampled from the drafter's q, with that q."""
    return sample_drafts(key, draft_logits, DRAFTER_PARAMS)


def _delta(key, drafts, draft_log_probs, target_logits, params):
    del draft_log_probs
    return accept_delta(key, drafts, target_logits, params)


def _token_by_token(key, drafts, draft_log_probs, target_logits, params):
    """Token-by-token speculative sampling (Leviathan et al. 2023), written from its definition: keep d_i
    with probability min(1, p_i(d_i) / q_i(d_i)) while every earlier draft was kept; at the first
    rejection emit a sample of normalise(max(0, p_i - q_i)); after T kept drafts a bonus sample of p_T.
    The rule `accept_block` must never fall behind."""
    key_accept, key_next = jax.random.split(key)
    p = jnp.exp(target_log_probs(target_logits, params))  # [B, T + 1, V]
    q = jnp.pad(jnp.exp(draft_log_probs), ((0, 0), (0, 1), (0, 0)))  # [B, T + 1, V]
    p_draft = jnp.take_along_axis(p[:, :-1], drafts[..., None], axis=-1)[..., 0]  # [B, T]
    q_draft = jnp.take_along_axis(q[:, :-1], drafts[..., None], axis=-1)[..., 0]  # [B, T]
    kept = jax.random.uniform(key_accept, drafts.shape) * q_draft < p_draft
    num_accepted = jnp.sum(jnp.cumprod(kept, axis=1), axis=1)
    residual = jnp.maximum(p - q, 0.0)  # [B, T + 1, V]
    chosen = jnp.take_along_axis(residual, num_accepted[:, None, None], axis=1)[:, 0]  # [B, V]
    next_token = jax.random.categorical(key_next, jnp.log(chosen))
    return commit_tokens(drafts, num_accepted, jnp.broadcast_to(next_token[:, None], p.shape[:2]))


def _generate(rule, drafter, key, params: SamplingParams, prompt: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Runs NUM_STEPS speculative steps from the prompt for NUM_SAMPLES independent rows (the batch).

    The prompt is an argument, not a constant, so XLA does not constant-fold the first step.

    Returns:
      [N, NUM_GENERATED] the first generated tokens, and [NUM_STEPS, N] accepted drafts per step.
    """
    target_table, draft_table = jnp.asarray(TARGET_TABLE), jnp.asarray(DRAFT_TABLE)
    rows = jnp.arange(NUM_SAMPLES)
    buffer = jnp.zeros((NUM_SAMPLES, len(PROMPT) + NUM_STEPS * (DRAFT_LEN + 1)), jnp.int32)
    buffer = buffer.at[:, : len(PROMPT)].set(prompt)
    length = jnp.full((NUM_SAMPLES,), len(PROMPT))
    num_accepted = []
    for _ in range(NUM_STEPS):
        key, key_draft, key_accept = jax.random.split(key, 3)
        context = buffer[rows, length - 2], buffer[rows, length - 1]  # last two committed tokens, [N] each
        drafts, draft_log_probs = drafter(key_draft, draft_table[context])  # [N, T], [N, T, V]
        block = jnp.concatenate([jnp.stack(context, axis=1), drafts], axis=1)  # [N, T + 2]
        target_logits = target_table[block[:, :-1], block[:, 1:]]  # [N, T + 1, V]
        result = rule(key_accept, drafts, draft_log_probs, target_logits, params)
        buffer = jax.vmap(jax.lax.dynamic_update_slice)(buffer, result.tokens, length[:, None])
        length = length + result.num_accepted + 1
        num_accepted.append(result.num_accepted)
    return buffer[:, len(PROMPT) : len(PROMPT) + NUM_GENERATED], jnp.stack(num_accepted)


_COMPARISONS = {}  # (rule, drafter, settings) -> _compare_with_exact's result, shared by the tests below


def _compare_with_exact(rule, drafter, settings: dict, seed: int = 0) -> tuple[float, float, np.ndarray]:
    """Generates NUM_SAMPLES continuations and compares them with the exact joint distribution.

    Returns:
      The chi-square p-value (0 if an impossible sequence appears), the total variation distance,
      and the histogram of accepted drafts over all steps.
    """
    key = (rule, drafter, tuple(sorted(settings.items())), seed)
    if key not in _COMPARISONS:
        _COMPARISONS[key] = _compare_with_exact_uncached(rule, drafter, settings, seed)
    return _COMPARISONS[key]


def _compare_with_exact_uncached(rule, drafter, settings: dict, seed: int) -> tuple[float, float, np.ndarray]:
    params = SamplingParams.make(**settings)
    generated, num_accepted = jax.jit(_generate, static_argnums=(0, 1))(
        rule, drafter, jax.random.key(seed), params, jnp.asarray(PROMPT)
    )
    generated = np.asarray(generated)
    index = (generated * VOCAB ** np.arange(NUM_GENERATED - 1, -1, -1)).sum(axis=1)
    observed = np.bincount(index, minlength=VOCAB**NUM_GENERATED).astype(np.float64)
    exact = _exact_joint(settings)
    total_variation = 0.5 * np.abs(observed / NUM_SAMPLES - exact).sum()
    accepted_histogram = np.bincount(np.asarray(num_accepted).reshape(-1), minlength=DRAFT_LEN + 1)
    if observed[exact == 0].sum() > 0:
        return 0.0, total_variation, accepted_histogram
    expected = NUM_SAMPLES * exact
    # Pool the bins too rare for the chi-square approximation into one bin, dropped if it is empty.
    common = expected >= 5
    observed = np.append(observed[common], observed[~common].sum())
    expected = np.append(expected[common], expected[~common].sum())
    observed, expected = observed[expected > 0], expected[expected > 0]
    expected *= observed.sum() / expected.sum()  # remove float rounding so scipy's sum check passes
    p_value = stats.chisquare(observed, expected).pvalue
    return float(p_value), float(total_variation), accepted_histogram


@pytest.mark.parametrize("settings", TARGET_SETTINGS.values(), ids=TARGET_SETTINGS.keys())
@pytest.mark.parametrize(
    "rule, drafter",
    [(_delta, _draft_argmax), (accept_block, _draft_sampled), (_token_by_token, _draft_sampled)],
    ids=["delta", "block", "token-by-token"],
)
def test_rule_is_lossless(rule, drafter, settings):
    p_value, total_variation, accepted = _compare_with_exact(rule, drafter, settings)
    message = f"p={p_value:.3g} TV={total_variation:.4f} (bound {TV_BOUND:.4f}) accepted={accepted}"
    assert p_value > 1e-3 and total_variation < TV_BOUND, message
    # Every acceptance length occurs often, so the test exercises every branch of the rule.
    assert accepted.min() > accepted.sum() // 100, f"accepted histogram {accepted}"


def _mean_and_error(histogram: np.ndarray) -> tuple[float, float]:
    """Mean of the accepted-drafts histogram and its standard error."""
    k = np.arange(len(histogram))
    n = histogram.sum()
    mean = (k * histogram).sum() / n
    return mean, np.sqrt(((k - mean) ** 2 * histogram).sum() / n / n)


@pytest.mark.parametrize("settings", TARGET_SETTINGS.values(), ids=TARGET_SETTINGS.keys())
def test_block_verification_keeps_more_drafts_than_token_by_token(settings):
    block, block_error = _mean_and_error(_compare_with_exact(accept_block, _draft_sampled, settings)[2])
    token, token_error = _mean_and_error(_compare_with_exact(_token_by_token, _draft_sampled, settings)[2])
    # Same output distribution, more drafts kept per step: by far more than the sampling error here.
    assert block > token + 5 * np.hypot(block_error, token_error), f"block {block:.4f}, token {token:.4f}"


# ----------------------------------------------------------------------------------------------------------
# Deliberately WRONG rules: the same check must reject each of them.


def _wrong_ratio_residual_is_p(key, drafts, draft_log_probs, target_logits, params):
    """WRONG: speculative sampling that samples p instead of normalise(max(0, p - q)) after a rejection."""
    key_accept, key_next = jax.random.split(key)
    p = jnp.exp(target_log_probs(target_logits, params))  # [B, T + 1, V]
    p_draft = jnp.take_along_axis(p[:, :-1], drafts[..., None], axis=-1)[..., 0]  # [B, T]
    q_draft = jnp.take_along_axis(jnp.exp(draft_log_probs), drafts[..., None], axis=-1)[..., 0]  # [B, T]
    accept = jax.random.uniform(key_accept, drafts.shape) * q_draft < p_draft
    num_accepted = jnp.sum(jnp.cumprod(accept, axis=1), axis=1)
    return commit_tokens(drafts, num_accepted, sample(key_next, target_logits, params))


def _wrong_block(stop_is_weight: bool = False, unweighted_residual: bool = False):
    """WRONG block verification: the stopping chance h_j replaced by the weight w_j, or the residual
    max(0, w_j p_j - q_j) by max(0, p_j - q_j)."""

    def rule(key, drafts, draft_log_probs, target_logits, params):
        key_accept, key_next = jax.random.split(key)
        p = jnp.exp(target_log_probs(target_logits, params))  # [B, T + 1, V]
        q = jnp.pad(jnp.exp(draft_log_probs), ((0, 0), (0, 1), (0, 0)))  # [B, T + 1, V]
        ratio = jnp.take_along_axis(p[:, :-1] / q[:, :-1], drafts[..., None], axis=-1)[..., 0]  # [B, T]
        w = [jnp.ones(drafts.shape[:1])]
        for i in range(drafts.shape[1]):
            w.append(jnp.minimum(1.0, w[-1] * ratio[:, i]))
        w = jnp.stack(w, axis=1)  # [B, T + 1]
        residual = jnp.maximum((1.0 if unweighted_residual else w[..., None]) * p - q, 0.0)
        mass = residual.sum(-1)
        stop = w if stop_is_weight else jnp.where(mass > 0, mass / (mass + 1.0 - w), 0.0)
        hit = jax.random.uniform(key_accept, drafts.shape) < stop[:, 1:]
        num_accepted = jnp.max(jnp.where(hit, jnp.arange(1, drafts.shape[1] + 1), 0), axis=1)
        chosen = jnp.take_along_axis(residual, num_accepted[:, None, None], axis=1)[:, 0]  # [B, V]
        next_token = jax.random.categorical(key_next, jnp.log(chosen))
        return commit_tokens(drafts, num_accepted, jnp.broadcast_to(next_token[:, None], p.shape[:2]))

    return rule


def _wrong_delta_resamples(key, drafts, draft_log_probs, target_logits, params):
    """WRONG: the delta rule that, at the first mismatch, emits a fresh sample instead of the rejecting y."""
    del draft_log_probs
    key_match, key_next = jax.random.split(key)
    y = sample(key_match, target_logits, params)  # [B, T + 1]
    num_accepted = jnp.sum(jnp.cumprod(drafts == y[:, :-1], axis=1), axis=1)
    return commit_tokens(drafts, num_accepted, sample(key_next, target_logits, params))


WRONG_RULES = {
    # Block verification fed argmax drafts with the drafter's soft q: not what the drafts were drawn from.
    "block-on-deterministic-drafts": (accept_block, _draft_argmax),
    "block-stop-is-weight": (_wrong_block(stop_is_weight=True), _draft_sampled),
    "block-unweighted-residual": (_wrong_block(unweighted_residual=True), _draft_sampled),
    "ratio-residual-is-p": (_wrong_ratio_residual_is_p, _draft_sampled),
    "delta-resamples-at-mismatch": (_wrong_delta_resamples, _draft_argmax),
}


@pytest.mark.parametrize("settings", TARGET_SETTINGS.values(), ids=TARGET_SETTINGS.keys())
@pytest.mark.parametrize("rule, drafter", WRONG_RULES.values(), ids=WRONG_RULES.keys())
def test_wrong_rule_is_caught(rule, drafter, settings):
    p_value, total_variation, _ = _compare_with_exact(rule, drafter, settings)
    message = f"wrong rule passed: p={p_value:.3g} TV={total_variation:.4f} (bound {TV_BOUND:.4f})"
    # test_rule_is_lossless fails a rule on either criterion; each wrong rule fails at least one of them
    # decisively (a p-value far below its 1e-3 threshold, or a distance above the bound), most both. A
    # subtle one (block-stop-is-weight at T=0.7, top-p 0.9: TV 0.018) is caught by the chi-square alone.
    assert p_value < 1e-6 or total_variation > TV_BOUND, message
