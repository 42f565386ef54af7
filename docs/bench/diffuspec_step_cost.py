"""The price of one DiffuSpec step on this CPU, before any draft is accepted.

SmolLM2-135M (fp32, batch 1, 64 new tokens) with a stand-in diffusion LM whose forward costs nearly nothing
(a per-slot bias plus a bump on the last token), so a step's time is the target's verify of K + 1 tokens
plus the lattice, CPS and ADL; its drafts are practically never accepted (tau 1). Prints ms per decode step
(best of 3) for plain decoding and for each window K with CPS on and off (ADL off: k = K).

    JAX_PLATFORMS=cpu python docs/bench/diffuspec_step_cost.py 30,16,8,4
"""

import dataclasses
import sys

import jax
import jax.numpy as jnp

import dflax
from dflax.decoding.sampling import SamplingParams
from dflax.drafters import diffuspec
from dflax.generation import generate_ids


@dataclasses.dataclass(frozen=True)
class BiasDiffusionLM:
    """logits[b, j] = bias[j] + 3 one_hot(last_token + j): a `DiffusionLM` with a free forward."""

    vocab_size: int
    mask_token_id: int = 0

    def init_state(self, batch, slots, dtype):
        return None

    def observe(self, params, state, tokens, positions, count):
        return None

    def window_logits(self, params, state, last_token, length, window):
        k = window.shape[1]
        bump = jax.nn.one_hot((last_token[:, None] + jnp.arange(k)) % self.vocab_size, self.vocab_size)
        return params[None, :k] + 3.0 * bump


def main(windows: list[int]) -> None:
    target = dflax.load_target("smollm2-135m")
    prompts = [target.tokenizer.encode("def fibonacci(n):\n    ")]
    model = BiasDiffusionLM(target.config.vocab_size)
    params = 0.5 * jax.random.normal(jax.random.key(0), (max(windows), target.config.vocab_size))
    runs = {"ar": None}
    for window in windows:
        for cps in (True, False):
            runs[f"K={window} cps={cps}"] = diffuspec(model, params, window=window, cps=cps, adl=False)
    for name, drafter in runs.items():

        def run(warmup, drafter=drafter):
            sampling = SamplingParams.make()
            return generate_ids(
                target, prompts, max_new_tokens=64, sampling=sampling, row_seeds=[0], batch_size=1,
                drafter=drafter, warmup=warmup,
            )[0]  # fmt: skip

        run(True)
        per_step = [(r.stats["decode_s"] / r.stats["steps"], r) for r in (run(False) for _ in range(3))]
        best, result = min(per_step, key=lambda x: x[0])
        print(f"{name}: {1000 * best:.1f} ms/step, tau {result.stats['tau']:.2f}", flush=True)


if __name__ == "__main__":
    main([int(w) for w in sys.argv[1].split(",")])
