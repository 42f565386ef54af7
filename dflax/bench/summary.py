"""A bench result row from its batches: tokens/s, tau, the median round, the roofline projection."""

from __future__ import annotations

import statistics
from typing import Any

import jax
import numpy as np

from dflax.planning import projection
from dflax.target import Target


def summarize(method: str, batch_size: int, per_batch: list[dict[str, Any]]) -> dict[str, Any]:
    decode_s = sum(b["decode_s"] for b in per_batch)
    decode_tokens = sum(b["decode_tokens"] for b in per_batch)
    steps = sum(b["steps"] for b in per_batch)
    loop_steps = sum(b.get("loop_steps", 0) for b in per_batch)
    return {
        "method": method,
        "batch_size": batch_size,
        "new_tokens": decode_tokens + sum(b["rows"] for b in per_batch),
        "decode_tokens": decode_tokens,
        "tokens_per_s": decode_tokens / decode_s if decode_s else 0.0,
        "median_batch_tokens_per_s": statistics.median(
            b["decode_tokens"] / b["decode_s"] for b in per_batch if b["decode_s"] > 0
        ),
        "decode_s": decode_s,
        "prefill_s": sum(b["prefill_s"] for b in per_batch),
        "wall_tokens_per_s": (decode_tokens + sum(b["rows"] for b in per_batch))
        / (decode_s + sum(b["prefill_s"] for b in per_batch)),
        "median_prefill_s": statistics.median(b["prefill_s"] for b in per_batch),
        "prefill_tokens_per_s": sum(b["prompt_tokens"] for b in per_batch)
        / sum(b["prefill_s"] for b in per_batch),
        "step_s": decode_s / loop_steps if loop_steps else None,  # one decode-loop iteration (dflax)
        "tau": sum(b["committed"] for b in per_batch) / steps if steps else 1.0,
        "accept_hist": np.sum([b["accept_hist"] for b in per_batch], axis=0).tolist()
        if "accept_hist" in per_batch[0]
        else None,
        **{
            k: per_batch[0][k]
            for k in (
                "block_size",
                "tree_budget",
                "auto_predicted",
                "auto_predicted_trees",
                "auto_probe",
                "refills",
            )
            if k in per_batch[0]
        },
        **{
            k: sum(b[k] for b in per_batch)  # summed over batches
            for k in ("kv_cache_bytes", "prefix_kv_bytes")
            if k in per_batch[0]
        },
    }


def median_round(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """One method's result over rounds: the round of median decode tokens/s (the lower one of the middle
    two for an even count), with every round's tokens/s in run order under `round_tokens_per_s`."""
    if len(summaries) == 1:
        return summaries[0]
    ranked = sorted(summaries, key=lambda s: s["tokens_per_s"])
    return {**ranked[(len(ranked) - 1) // 2], "round_tokens_per_s": [s["tokens_per_s"] for s in summaries]}


def weights_read(params) -> int:
    """Parameters one forward reads: every leaf, less an embedding that is only gathered (untied head)."""
    sizes = {
        jax.tree_util.keystr(p): leaf.size for p, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
    }
    if any("lm_head" in name for name in sizes):
        return sum(v for name, v in sizes.items() if "embed_tokens" not in name)
    return sum(sizes.values())


def add_projection(results: list[dict], target: Target, drafter, n_prompts: int, dart=None) -> None:
    """Adds each speculative result's projected speedup on accelerators (see dflax.planning.projection): a
    step verifies the block (or the tree's nodes and root) and runs the DFlash or DART drafter (lookup runs
    none)."""
    target_params = weights_read(target.params)
    drafter_params = 0
    if drafter is not None:
        vocab = drafter.proposer.draft_vocab
        head_rows = len(vocab) if vocab is not None else target.config.vocab_size
        drafter_params = weights_read(drafter.params) + head_rows * target.config.hidden_size
    dart_params = weights_read(dart.params.drafter) if dart is not None else 0  # its own LM head included
    for r in results:
        if r.get("block_size") and r["method"] != "official":  # dflax's own steps only
            rows = min(r["batch_size"], n_prompts)
            verified = r["tree_budget"] + 1 if r.get("tree_budget") else r["block_size"]
            read = {"dflash": drafter_params, "dart": dart_params}.get(r["method"].split("-")[0], 0)
            r["projected_speedup"] = {
                key: projection.projected_speedup(chip, target_params, read, r["tau"], verified, rows)
                for key, chip in projection.ACCELERATORS.items()
            }
