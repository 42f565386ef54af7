"""DART's training objective (arXiv 2601.19278): prefix-shared mask blocks, KL to the target, 0.6^(t-1).

For a sequence x_0..x_{S-1} with target features f_i (the drafter's tapped layers), every position i
becomes the layer input u_i = fuse(f_i, embedding(x_{i+1})) and ONE causal forward over all of them gives
each position's depth-1 prediction (position a predicts x_{a+2}) and the keys/values every block shares.
Each of M anchors a per sequence adds its own block of d - 1 mask inputs at positions a + 1 .. a + d - 1;
block queries see the prefix keys of positions <= a and the block's earlier masks (causal), never another
block, so mask j predicts x_{a+2+j}. This is the decoding forward (`DartProposer.draft_logits` with the
drafter cache holding positions < a and position a pending), which the tests hold it equal to.

The loss at depth t = 1..d is KL(p_t || q_t): p_t the target's next-token distribution at position a + t
(its final hidden state, cached as one more tap, through its final norm and LM head, renormalised over the
draft vocabulary), q_t the drafter's; depth t weighs 0.6^(t-1), and depths whose token lies past the
sequence end carry no weight. Anchors lie in prompt_len - 1 <= a <= length - 3: the first one drafts
the response's second token, as at decoding's first step (the first comes from the target's prefill).

Glossary: N sequences, S padded length, M anchors per sequence, d depths, D width, V' draft vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dflax.drafters.dart import DartDrafter
from dflax.drafters.draft_vocab import vocab_index
from dflax.models.transformer import Transformer
from dflax.train import objective
from dflax.train.objective import BlockStats, block_stats, label_rank, target_next_token_log_probs

DEPTH_DECAY = 0.6  # the paper's per-depth loss decay


def depth_weights(num_draft: int, decay: float = DEPTH_DECAY) -> jax.Array:
    """[d] loss weight decay^(t - 1) of depth t = 1..d."""
    return decay ** jnp.arange(num_draft, dtype=jnp.float32)


def depth_weighted_kl(log_p: jax.Array, log_q: jax.Array, valid: jax.Array, decay: float) -> jax.Array:
    """sum_t w_t * KL(p_t || q_t) * valid / sum_t w_t * valid with w_t = decay^(t - 1).

    Args:
      log_p: [..., d, V'] the target's log-probabilities.
      log_q: [..., d, V'] the drafter's.
      valid: [..., d] bool, depths that count.
      decay: the depth decay.

    Returns:
      [] float32.
    """
    kl = jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)  # [..., d]
    w = depth_weights(log_p.shape[-2], decay) * valid
    return jnp.sum(w * kl) / jnp.maximum(jnp.sum(w), 1e-9)


def dart_hidden(module: DartDrafter, params, embed, features, tokens, anchors) -> jax.Array:
    """The drafter's hidden states of every anchor's d depths, in two forwards per batch.

    Args:
      module: the DART drafter.
      params: its parameters {"params": ...}.
      embed: [V, D] the target's embedding table.
      features: [N, S, K * D] target features of the drafter's tapped layers.
      tokens: [N, S] int32 sequences.
      anchors: [N, M] int32 anchor positions.

    Returns:
      [N, M, d, D]; depth t (index t - 1) predicts x_{a + 1 + t}.
    """
    n, s = tokens.shape
    d = module.config.num_draft
    next_tokens = jnp.pad(tokens[:, 1:], ((0, 0), (0, 1)))  # [N, S] x_{i+1}
    u = module.apply(params, features, jnp.take(embed, next_tokens, axis=0), method=DartDrafter.fuse)
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (n, s))
    k, v = module.apply(params, u, positions, method=DartDrafter.context_kv)  # [N, S, K, H]
    k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)  # [N, K, S, H], the cache's layout
    empty = k[:, :, :0]
    prefix = module.apply(
        params, u[:, None], positions[:, None], empty, empty, jnp.zeros((n, 1, s, 0), jnp.bool_)
    )[:, 0]  # [N, S, D]: causal over the whole sequence
    first = jnp.take_along_axis(prefix, anchors[..., None], axis=1)  # [N, M, D]
    m = anchors.shape[1]
    mask = module.apply(params, method=DartDrafter.mask_vector)
    blocks = jnp.broadcast_to(mask, (n, m, d - 1, mask.shape[0]))  # [N, M, d - 1, 2D]
    block_positions = anchors[..., None] + jnp.arange(1, d, dtype=jnp.int32)  # [N, M, d - 1]
    sees = jnp.arange(s)[None, None, None, :] <= anchors[:, :, None, None]  # [N, M, 1, S]
    sees = jnp.broadcast_to(sees, (n, m, d - 1, s))
    rest = module.apply(params, blocks, block_positions, k, v, sees)  # [N, M, d - 1, D]
    return jnp.concatenate([first[:, :, None], rest], axis=2)


def dart_loss(
    module: DartDrafter,
    target: Transformer,
    draft_vocab: np.ndarray | None,
    params,
    target_params,
    batch: dict,
    key: jax.Array,
    num_anchors: int,
    decay: float = DEPTH_DECAY,
) -> tuple[jax.Array, BlockStats]:
    """The depth-weighted KL of a batch.

    Args:
      module: the drafter (differentiated through `params`).
      target: the target module (frozen).
      draft_vocab: [V'] target ids of the drafter's LM head rows (None: all V).
      params: drafter parameters.
      target_params: target parameters (gradients stop here).
      batch: {"tokens" [N, S], "prompt_lens" [N], "lengths" [N], "features" [N, S, (K + 1) * D]}: the
        tapped layers' features, then the target's last layer's output.
      key: PRNG key of the anchors.
      num_anchors: M.
      decay: depth weight decay.

    Returns:
      (sum_t w_t * KL_t * valid / sum_t w_t * valid, the batch's BlockStats over the d depths: a depth's
      draft is right when the drafter's argmax equals the sequence's token there).
    """
    target_params = jax.lax.stop_gradient(target_params)
    tokens, lengths = batch["tokens"], batch["lengths"]
    d = module.config.num_draft
    hidden_size = target.config.hidden_size
    features = batch["features"].astype(jnp.float32)
    taps, final = features[..., :-hidden_size], features[..., -hidden_size:]
    n, s = tokens.shape
    keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(n))
    anchors, used = jax.vmap(
        lambda k, p, length: objective.sample_anchors(k, p - 1, length - 1, s, num_anchors)
    )(keys, batch["prompt_lens"], lengths)  # [N, M]
    embed = target_params["params"]["embed_tokens"]["weight"]
    hidden = dart_hidden(module, params, embed, taps, tokens, anchors)  # [N, M, d, D]
    log_q = jax.nn.log_softmax(module.apply(params, hidden, method=DartDrafter.logits), axis=-1)

    depth = jnp.arange(1, d + 1, dtype=jnp.int32)
    at = anchors[..., None] + depth  # [N, M, d] the position whose next token depth t drafts
    valid = used[..., None] & (at + 1 < lengths[:, None, None])  # [N, M, d]
    gather = jax.vmap(lambda seq, idx: jnp.take(seq, idx, axis=0, mode="clip"))
    vocab_ids = None if draft_vocab is None else jnp.asarray(draft_vocab)
    log_p = target_next_token_log_probs(target, target_params, gather(final, at), vocab_ids)  # [N, M, d, V']
    loss = depth_weighted_kl(log_p, log_q, valid, decay)

    labels = gather(tokens, at + 1)  # [N, M, d] target ids x_{a+1+t}
    if draft_vocab is not None:
        labels = jnp.take(jnp.asarray(vocab_index(draft_vocab, target.config.vocab_size)), labels)
    rank = label_rank(log_q, labels)  # [N, M, d]
    return loss, block_stats(rank.reshape(-1, d), valid.reshape(-1, d))
