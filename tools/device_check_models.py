"""The model stages of tools/device_check.py: greedy (device bf16 vs CPU fp32), bench, and step times of a
random-weight 8B target next to the chip's roofline; and the tiny random target that --dry-run runs them on.

Everything is loaded, decoded and benched by dflax's own functions (`load_target`, `generate`,
`divergence.first_differences`, `bench.run_bench`, `cost_curve.verify_times`); this module only picks the
sizes, writes the tiny target, and prices the steps against the chip's published figures.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from device_check import Recorder, Settings

REPO = Path(__file__).resolve().parents[1]

# Raw completions and chats, short enough to share one prompt bucket.
PROMPTS: tuple[Any, ...] = (
    "def fibonacci(n):",
    [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
    "The three primary colours are",
    [{"role": "user", "content": "Write a haiku about JAX."}],
    'def is_prime(n: int) -> bool:\n    """Return True if n is a prime number."""\n',
    [{"role": "user", "content": "Name three rivers in Europe."}],
    "import numpy as np\n\ndef softmax(x):",
    [{"role": "user", "content": "Explain in two sentences what a KV cache is."}],
)

# ----------------------------------------------------------------------------------------------------------
# Chips: published figures for the roofline
# ----------------------------------------------------------------------------------------------------------

# Substrings of `jax.Device.device_kind` (lower case) -> a chip key, the first match wins.
_DEVICE_KINDS = (
    ("h200", "h200"),
    ("h100 pcie", "h100-pcie"),
    ("h100", "h100"),
    ("a100", "a100"),
    ("tpu v5 lite", "v5e"),
    ("tpu v5e", "v5e"),
    ("tpu v5", "v5p"),
    ("tpu v6", "v6e"),
    ("tpu v4", "v4"),
)


def chips() -> dict:
    """dflax.aot.chips' table plus datasheet figures it lacks (H200 SXM, H100 PCIe, TPU v4)."""
    from dflax.aot.chips import CHIPS, Chip

    return {
        **CHIPS,
        "h200": Chip("H200 SXM", 141 * 10**9, 4.8e12, 989e12),
        "h100-pcie": Chip("H100 PCIe", 80 * 2**30, 2.0e12, 756e12),
        "v4": Chip("TPU v4", 32 * 2**30, 1.2e12, 275e12),
    }


def chip_for(device_kind: str, override: str | None):
    """(key, Chip) of a device kind, or of `override` (a key of `chips()`); (None, None) when unknown.

    Raises:
      ValueError: for an override that is not a known chip.
    """
    table = chips()
    if override is not None:
        if override not in table:
            raise ValueError(f"--chip {override!r} unknown; choose one of {', '.join(table)}")
        return override, table[override]
    kind = device_kind.lower()
    key = next((k for sub, k in _DEVICE_KINDS if sub in kind), None)
    return (key, table[key]) if key else (None, None)


def device_memory_bytes(device) -> int | None:
    """The device's memory limit in bytes, or None where the backend keeps no statistics (the CPU)."""
    try:
        stats = device.memory_stats()
    except Exception:  # the CPU backend and some plugins have none
        return None
    return (stats or {}).get("bytes_limit")


def chip_record(device_kind: str, override: str | None) -> dict:
    """The chip's figures as JSON, or why there are none."""
    key, chip = chip_for(device_kind, override)
    if chip is None:
        return {"key": None, "reason": f"no published figures for device kind {device_kind!r}; pass --chip"}
    return {
        "key": key,
        "forced_by_flag": override is not None,
        **dataclasses.asdict(chip),
        "source": "dflax.aot.chips, or device_check's own datasheet rows for h200 / h100-pcie / v4",
    }


# ----------------------------------------------------------------------------------------------------------
# The tiny random target of --dry-run (an HF checkpoint directory: every loader path runs on it)
# ----------------------------------------------------------------------------------------------------------

_TINY_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _hf_name(path: tuple[str, ...]) -> str:
    """A Flax parameter path -> its HF tensor name (the inverse of `dflax.checkpoints.params`' map)."""
    name = ".".join(path)
    if path[0].startswith("layers_"):
        name = name.replace("layers_", "layers.", 1)
    return name if path[0] == "lm_head" else "model." + name


def ensure_tiny_target(path: Path) -> Path:
    """Writes (once) a 4-layer random Llama with a byte-level tokenizer as an HF checkpoint directory."""
    if (path / "model.safetensors").is_file():
        return path
    import flax
    import numpy as np
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from dflax.checkpoints.params import abstract_params
    from dflax.models.config import ModelConfig
    from dflax.models.transformer import Transformer

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(_TINY_SPECIALS))
    hf_config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 320,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 1024,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "eos_token_id": tokenizer.token_to_id("<|im_end|>"),
    }
    module = Transformer(ModelConfig.from_hf(hf_config), attention_backend="reference")
    shapes = flax.traverse_util.flatten_dict(abstract_params(module)["params"])
    rng = np.random.default_rng(0)
    tensors = {
        _hf_name(p): np.ones(x.shape, np.float32)
        if len(x.shape) == 1
        else 0.1 * rng.standard_normal(x.shape).astype(np.float32)
        for p, x in shapes.items()
    }
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / "model.safetensors"))
    tokenizer.save(str(tmp / "tokenizer.json"))
    (tmp / "config.json").write_text(json.dumps(hf_config, indent=1))
    special = {"eos_token": "<|im_end|>", "chat_template": _TINY_CHAT_TEMPLATE}
    (tmp / "tokenizer_config.json").write_text(json.dumps(special))
    tmp.rename(path)
    return path


def target_spec(s: Settings) -> str:
    """The target to load: --target, or the tiny random one in --dry-run (written on first use)."""
    return str(ensure_tiny_target(Path(s.target))) if s.dry_run else s.target


# ----------------------------------------------------------------------------------------------------------
# Stage: greedy (device bf16, then CPU fp32 in a process of its own)
# ----------------------------------------------------------------------------------------------------------


def stage_greedy_device(s: Settings, rec: Recorder) -> None:
    """Greedy tokens of the bf16 target on the device, the prompts in one batch."""
    import dflax
    from dflax.generation import encode_prompt

    t0 = time.perf_counter()
    target = dflax.load_target(target_spec(s), dtype="bfloat16")
    rec.update(target=s.target, device_dtype="bfloat16", device_load_s=time.perf_counter() - t0)
    prompts = list(PROMPTS[: s.greedy_prompts])
    t0 = time.perf_counter()
    results = dflax.generate(
        target, prompts, max_new_tokens=s.greedy_tokens, temperature=0.0, batch_size=len(prompts)
    )
    rec.update(
        max_new_tokens=s.greedy_tokens,
        batch_size=len(prompts),
        device_generate_s=time.perf_counter() - t0,
        prompts=[
            {"prompt": p, "prompt_ids": encode_prompt(target, p), "device_tokens": r.tokens}
            for p, r in zip(prompts, results)
        ],
    )


def smallest_top2_gap(target, prompt_ids: list[int], tokens: list[int]) -> dict:
    """The smallest distance of the target's two best logits over the positions that chose `tokens` after
    the prompt (one forward): how near a tie the output came, where another computation could part."""
    import numpy as np

    from dflax.divergence import sequence_logits

    logits = sequence_logits(target, prompt_ids + tokens)[len(prompt_ids) - 1 : -1].astype(np.float64)
    best = np.sort(logits, axis=-1)[:, -2:]
    gaps = best[:, 1] - best[:, 0]
    return {"min_top2_gap": float(gaps.min()), "min_top2_gap_position": int(gaps.argmin())}


def stage_greedy_cpu(s: Settings, rec: Recorder, device_file: Path) -> None:
    """fp32 greedy tokens on the CPU, compared with the device's; the CPU target judges each first
    difference (its logits' top-2 gap there: a near-tie explains a difference) and, for every prompt, the
    nearest tie along its own output."""
    import dflax
    from dflax.divergence import first_differences

    prompts = json.loads(device_file.read_text())["prompts"]
    t0 = time.perf_counter()
    target = dflax.load_target(target_spec(s), dtype="float32")
    results = dflax.generate(
        target, [p["prompt"] for p in prompts], max_new_tokens=s.greedy_tokens, temperature=0.0,
        batch_size=len(prompts),
    )  # fmt: skip
    rec["cpu_generate_s"] = time.perf_counter() - t0
    cpu_tokens = [r.tokens for r in results]
    prompt_ids = [p["prompt_ids"] for p in prompts]
    device_tokens = [p["device_tokens"] for p in prompts]
    differences = {d["prompt"]: d for d in first_differences(target, prompt_ids, cpu_tokens, device_tokens)}
    merged = []
    for i, (p, cpu) in enumerate(zip(prompts, cpu_tokens)):
        d = differences.get(i)
        merged.append(
            {
                **p,
                "cpu_tokens": cpu,
                "identical": d is None,
                "first_difference": None if d is None else d["position"],
                "top2_gap": None if d is None else d["top2_gap"],
                "gap": None if d is None else d["gap"],
                "ranks": None if d is None else d["ranks"],
                **smallest_top2_gap(target, p["prompt_ids"], cpu),
            }
        )
    rec.update(
        reference="CPU float32 (JAX_PLATFORMS=cpu)",
        prompts=merged,
        identical=sum(m["identical"] for m in merged),
        n_prompts=len(merged),
    )


# ----------------------------------------------------------------------------------------------------------
# Stage: bench
# ----------------------------------------------------------------------------------------------------------


def bench_prompt_file(s: Settings, count: int, path: Path) -> dict:
    """Writes `count` prompts of one prompt bucket (more than half of --bench-prompt-bucket tokens, at most
    all of it) to a JSONL file, so every batch compiles one prompt shape; says where they came from."""
    from dflax.checkpoints.registry import resolve
    from dflax.checkpoints.tokenizer import Tokenizer
    from dflax.prompts import PromptRecord, load_prompts

    source, note = s.bench_prompts, None
    if source == "inline":
        records = [PromptRecord(f"inline-{i}", p) for i, p in enumerate(PROMPTS)]
    else:
        try:
            records = load_prompts(source)[0]
        except (ImportError, FileNotFoundError) as error:
            source, note = "inline", f"{s.bench_prompts} unavailable ({error}); used the inline prompts"
            records = [PromptRecord(f"inline-{i}", p) for i, p in enumerate(PROMPTS)]
    tokenizer = Tokenizer.load(resolve(target_spec(s))[1])
    size = lambda p: len(tokenizer.encode(p) if isinstance(p, str) else tokenizer.encode_chat(p))  # noqa: E731
    lengths = [size(r.prompt) for r in records]
    top = s.bench_prompt_bucket
    chosen = [r for r, n in zip(records, lengths) if top // 2 < n <= top]
    chosen += [r for r, n in zip(records, lengths) if n <= top // 2]
    if not chosen:
        raise ValueError(f"no prompt of {source} fits {top} tokens; raise --bench-prompt-bucket")
    repeated = len(chosen) < count
    chosen = [chosen[i % len(chosen)] for i in range(count)]
    with path.open("w", encoding="utf-8") as f:
        for i, r in enumerate(chosen):
            key = "prompt" if isinstance(r.prompt, str) else "messages"
            f.write(json.dumps({"id": f"{r.id}#{i}" if repeated else r.id, key: r.prompt}) + "\n")
    ids = [r.id for r in chosen]
    return {"source": source, "note": note, "bucket_tokens": top, "ids": ids, "repeated": repeated}


def stage_bench(s: Settings, rec: Recorder) -> None:
    """`run_bench` (ar, dflash) once per batch size, saved after each."""
    from dflax.bench import run_bench

    counts = {b: max(b, s.bench_min_prompts) for b in s.bench_batch_sizes}
    path = s.workdir / "bench_prompts.jsonl"
    rec.update(
        prompts=bench_prompt_file(s, max(counts.values()), path),
        max_new_tokens=s.bench_tokens,
        block_size=s.bench_block_size,
        drafter="untrained" if s.dry_run else "shipped",
        runs={},
        rows=[],
    )
    rec.save()
    for b, count in counts.items():
        t0 = time.perf_counter()
        report = run_bench(
            prompts=str(path),
            target=target_spec(s),
            methods=["ar", "dflash"],
            limit=count,
            max_new_tokens=s.bench_tokens,
            temperature=0.0,
            batch_size=b,
            seed=0,
            drafter="untrained" if s.dry_run else None,
            block_sizes=[s.bench_block_size],
        )
        rec["runs"][str(b)] = {**report, "run_s": time.perf_counter() - t0}
        rec["rows"].extend(report["results"])
        rec.save()


# ----------------------------------------------------------------------------------------------------------
# Stage: steps (random-weight Qwen3-8B-shaped target, roofline beside)
# ----------------------------------------------------------------------------------------------------------

_TINY_QWEN3 = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
)
MEMORY_USE = 0.7  # at most this share of device memory for the weights (TPU v5e: 16 GiB < 16.4 GB); the
# rest holds the cache, activations and the random init's temporaries


def _param_bytes(abstract) -> dict[str, int]:
    """Bytes per top-level parameter group ("layers_0", "embed_tokens", ...) at 2 bytes a parameter."""
    import jax

    return {name: 2 * sum(x.size for x in jax.tree.leaves(tree)) for name, tree in abstract["params"].items()}


def step_roofline(config, abstract, tokens: int, context: int, chip) -> dict:
    """Roofline time of one bf16 target forward over `tokens` tokens after `context` cached ones (batch 1):
    max((weights read + KV read and written) / HBM bandwidth, (2 x matmul params + attention) FLOPs / peak).
    An untied embedding is gathered, not read whole; a tied one is read as the LM head."""
    groups = _param_bytes(abstract)
    weight_bytes = sum(v for k, v in groups.items() if config.tie_word_embeddings or k != "embed_tokens")
    kv_bytes = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 2 * (context + tokens)
    attention_flops = 4 * config.num_layers * config.num_heads * config.head_dim * tokens * (context + tokens)
    flops = weight_bytes * tokens + attention_flops  # 2 FLOPs per parameter per token = bytes / 2 * 2
    out = {"weight_bytes": weight_bytes, "kv_bytes": kv_bytes, "flops": flops}
    if chip is not None:
        memory_s, compute_s = (weight_bytes + kv_bytes) / chip.bandwidth, flops / chip.bf16_flops
        out.update(memory_s=memory_s, compute_s=compute_s, roofline_s=max(memory_s, compute_s))
    return out


def random_params(abstract, seed: int = 0) -> dict:
    """bf16 parameters of the abstract tree's shapes, made on the device: N(0, 0.02) matrices, unit norms."""
    import jax
    import jax.numpy as jnp

    leaves, tree = jax.tree.flatten(abstract)

    def make():
        keys = jax.random.split(jax.random.key(seed), len(leaves))
        return jax.tree.unflatten(
            tree,
            [
                jnp.ones(x.shape, jnp.bfloat16)
                if len(x.shape) == 1
                else 0.02 * jax.random.normal(k, x.shape, jnp.bfloat16)
                for x, k in zip(leaves, keys)
            ],
        )

    return jax.block_until_ready(jax.jit(make)())


def tree_verify_s(target, nodes: int, context: int, slots: int, reps: int) -> float:
    """Median seconds of one target forward (logits included) over a root and `nodes` tree nodes (node i's
    parent (i - 1) // 2, a binary tree of depth log2(nodes)) under their ancestor mask, as the decode loop
    verifies a draft tree, into a donated cache (the tree counterpart of
    `dflax.planning.cost_curve.verify_times`)."""
    import jax
    import jax.numpy as jnp

    from dflax.decoding.tree import ancestor_mask, depths
    from dflax.models.cache import KVCache
    from dflax.models.transformer import Transformer

    module = target.module
    mask = ancestor_mask(jnp.asarray([[-1] + [(i - 1) // 2 for i in range(1, nodes + 1)]], jnp.int32))

    @functools.partial(jax.jit, donate_argnums=(1,))
    def verify(params, cache, tokens):
        positions = cache.lengths[:, None] + depths(mask)
        hidden, cache, _ = module.apply(params, tokens, positions, cache, mask)
        return module.apply(params, hidden, method=Transformer.logits), cache

    cache = KVCache.init(target.config, 1, slots, target.cache_dtype)
    cache = cache.replace(lengths=jnp.full((1,), context, jnp.int32))
    tokens = jnp.full((1, nodes + 1), 5, jnp.int32)
    times = []
    for _ in range(reps + 1):  # the first call compiles
        t0 = time.perf_counter()
        logits, cache = verify(target.params, cache, tokens)  # lengths stay: the same context
        jax.block_until_ready(logits)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def stage_steps(s: Settings, rec: Recorder) -> None:
    """Step times of the random-weight target next to the chip's roofline, saved after each."""
    import jax
    import jax.numpy as jnp

    from dflax.aot.models import target_config
    from dflax.checkpoints.params import abstract_params
    from dflax.models.config import ModelConfig
    from dflax.models.transformer import Transformer
    from dflax.planning.cost_curve import verify_times
    from dflax.target import Target, default_cache_dtype

    if s.dry_run:
        config = ModelConfig(arch="qwen3", tie_word_embeddings=False, **_TINY_QWEN3)
    else:
        in_repo = REPO / s.steps_model
        config = target_config(str(in_repo) if in_repo.exists() else s.steps_model)
    abstract = abstract_params(Transformer(config, jnp.bfloat16, attention_backend="reference"))
    groups = _param_bytes(abstract)
    full_layers, layer_bytes = config.num_layers, groups["layers_0"]
    memory = device_memory_bytes(jax.devices()[0])
    fits = memory is None or sum(groups.values()) <= MEMORY_USE * memory
    if not fits:  # fewer layers of the same shape; the roofline below is for the layers timed
        rest = sum(v for k, v in groups.items() if not k.startswith("layers_"))
        layers = int((MEMORY_USE * memory - rest) // layer_bytes)
        if layers < 1:
            raise ValueError(f"not one layer of {s.steps_model} fits {memory} bytes of device memory")
        config = dataclasses.replace(config, num_layers=layers, layer_types=config.layer_types[:layers])
        abstract = abstract_params(Transformer(config, jnp.bfloat16, attention_backend="reference"))
    _, chip = chip_for(jax.devices()[0].device_kind, s.chip)
    rec.update(
        model=s.steps_model,
        random_weights=True,
        dtype="bfloat16",
        layers_timed=config.num_layers,
        layers_full=full_layers,
        weight_bytes_full=sum(groups.values()),
        context=s.steps_context,
        reps=s.steps_reps,
        rows=1,
        chip=chip_record(jax.devices()[0].device_kind, s.chip),
        roofline="max((weights read + KV read/written) / HBM bandwidth, FLOPs / dense bf16 peak); batch 1",
        steps={},
    )
    t0 = time.perf_counter()
    params = random_params(abstract)
    module = Transformer(config, jnp.bfloat16, attention_backend="auto")
    cache_dtype = jnp.dtype(default_cache_dtype("bfloat16"))
    target = Target(f"{s.steps_model} (random bf16)", config, params, None, module, cache_dtype)
    rec["init_s"] = time.perf_counter() - t0
    rec.save()
    slots = -(-(s.steps_context + 33 + 64) // 64) * 64
    timers = {
        "plain_1": (1, lambda: verify_times(target, (1,), 1, s.steps_context, slots, s.steps_reps)[1]),
        "verify_16": (16, lambda: verify_times(target, (16,), 1, s.steps_context, slots, s.steps_reps)[16]),
        "tree_32": (33, lambda: tree_verify_s(target, 32, s.steps_context, slots, s.steps_reps)),
    }
    for name, (tokens, timer) in timers.items():
        t0 = time.perf_counter()
        median = timer()
        roofline = step_roofline(config, abstract, tokens, s.steps_context, chip)
        entry = {"tokens": tokens, "median_s": median, **roofline}
        if "roofline_s" in entry:
            entry["measured_over_roofline"] = median / entry["roofline_s"]
        rec["steps"][name] = {**entry, "stage_s": time.perf_counter() - t0}
        rec.save()
