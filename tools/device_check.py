"""One device check for a short accelerator lease: every number a first GPU or TPU should give, in one JSON.

    python tools/device_check.py --out device_check.json      # on the GPU / TPU machine, at most ~8 min
    python tools/device_check.py --dry-run --out /tmp/dc.json  # tiny sizes on the CPU, under a minute

Stages (each in its own process, under its own time budget; one that overruns is killed, recorded as
"timeout" with whatever it had saved, and the next one starts):
  env      device kind, jax / jaxlib versions, device memory, the chip's published roofline figures.
  kernels  the Pallas kernels (`pallas_kernels`: tree attention, the shared-prefix tile kernel) compiled for
           the device (interpret mode only in --dry-run) against their jnp / float64 references at a few
           shapes: max abs error, pass / fail, and the kernel's median time.
  greedy   SmolLM2 bf16 greedy decoding on the device against fp32 greedy decoding on the CPU (a second
           process with JAX_PLATFORMS=cpu): identical or not per prompt and, at the first difference, the
           CPU fp32 target's top-2 logit gap there (`dflax.divergence.first_differences`).
  bench    `dflax.bench.run_bench` (what `dflax bench` runs), methods ar and dflash, at each batch size.
  steps    a random-weight Qwen3-8B-shaped bf16 target: a 1-token step, a 16-token verify and a 32-node
           tree verify (target forwards with logits, `dflax.planning.cost_curve.verify_times`), next to the
           roofline of the chip (bytes / HBM bandwidth, FLOPs / dense bf16 peak, figures of
           `dflax.aot.chips`).

The JSON is rewritten after every stage, so a killed run still leaves the stages it finished.
See tools/README.md for running it on a bare GPU machine and for what to commit afterwards.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from device_check_models import PROMPTS, chip_record, device_memory_bytes

REPO = Path(__file__).resolve().parents[1]
SCHEMA = "dflax-device-check/1"
STAGES = ("env", "kernels", "greedy", "bench", "steps")
# Seconds per stage; they add up to 470 of the default 480 s total, so on time every stage gets its own.
BUDGET_S = {"env": 20, "kernels": 60, "greedy": 90, "bench": 170, "steps": 130}
TOTAL_BUDGET_S = 480
# Each stage's processes, each with its extra environment (greedy's CPU reference sees no accelerator).
PROCESSES = {
    "env": (("env", {}),),
    "kernels": (("kernels", {}),),
    "greedy": (("greedy_device", {}), ("greedy_cpu", {"JAX_PLATFORMS": "cpu"})),
    "bench": (("bench", {}),),
    "steps": (("steps", {}),),
}


@dataclasses.dataclass(frozen=True)
class Settings:
    """What each stage runs: the device sizes, or the tiny ones of --dry-run."""

    dry_run: bool
    workdir: Path
    chip: str | None
    target: str
    greedy_prompts: int
    greedy_tokens: int
    bench_prompts: str
    bench_batch_sizes: tuple[int, ...]
    bench_min_prompts: int
    bench_tokens: int
    bench_block_size: int
    bench_prompt_bucket: int
    steps_model: str
    steps_context: int
    steps_reps: int
    kernel_reps: int


def settings_from(args: argparse.Namespace, workdir: Path) -> Settings:
    """The settings of a run: the command line's, with --dry-run's tiny sizes in place of the device's."""
    dry = args.dry_run
    return Settings(
        dry_run=dry,
        workdir=workdir,
        chip=args.chip,
        target=str(workdir / "tiny-target") if dry else args.target,  # --dry-run writes it on first use
        greedy_prompts=2 if dry else args.greedy_prompts,
        greedy_tokens=4 if dry else args.greedy_tokens,
        bench_prompts="inline" if dry else args.bench_prompts,
        bench_batch_sizes=(2,) if dry else args.bench_batch_sizes,
        bench_min_prompts=2 if dry else args.bench_min_prompts,
        bench_tokens=4 if dry else args.bench_tokens,
        bench_block_size=3 if dry else args.bench_block_size,
        bench_prompt_bucket=64 if dry else args.bench_prompt_bucket,
        steps_model="tiny" if dry else args.steps_model,
        steps_context=32 if dry else args.steps_context,
        steps_reps=2 if dry else args.steps_reps,
        kernel_reps=1 if dry else 5,
    )


# ----------------------------------------------------------------------------------------------------------
# Stage: env
# ----------------------------------------------------------------------------------------------------------


def stage_env(s: Settings, rec: Recorder) -> None:
    """Device kind, versions, device memory, the chip's figures and, on NVIDIA machines, nvidia-smi."""
    import jax
    import jaxlib

    device = jax.devices()[0]
    rec.update(
        backend=jax.default_backend(),
        device_kind=device.device_kind,
        device_count=jax.device_count(),
        devices=[d.device_kind for d in jax.devices()],
        memory_bytes=device_memory_bytes(device),
        jax=jax.__version__,
        jaxlib=jaxlib.__version__,
        python=platform.python_version(),
        cpu_count=os.cpu_count(),
        chip=chip_record(device.device_kind, s.chip),
    )
    if shutil.which("nvidia-smi"):
        query = "--query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem,driver_version,power.limit"
        out = subprocess.run(
            ["nvidia-smi", query, "--format=csv"], capture_output=True, text=True, timeout=15
        )
        rec["nvidia_smi"] = out.stdout.strip() or out.stderr.strip()


# ----------------------------------------------------------------------------------------------------------
# Running stages in processes of their own, under budgets
# ----------------------------------------------------------------------------------------------------------


def _plain(x):
    """`x` with numpy scalars and arrays as Python numbers and lists, other objects as strings, and
    non-finite floats as None (strict JSON has no NaN)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if x is None or isinstance(x, (str, int, bool)):
        return x
    if hasattr(x, "tolist"):
        return _plain(x.tolist())
    return str(x)


def write_json(path: Path, data: dict) -> None:
    """Writes `data` atomically as strict JSON."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(_plain(data), indent=1, allow_nan=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)


class Recorder(dict):
    """A stage's results, saved to its file on `save()` (the parent reads what was saved if it kills it)."""

    def __init__(self, path: Path):
        super().__init__()
        self.path = path

    def save(self) -> None:
        """Writes the results so far."""
        write_json(self.path, self)


def run_process(name: str, s: Settings, out: Path, input_file: Path | None) -> int:
    """Runs one process of a stage here, saving its results to `out`; 1 (the traceback saved) on failure."""
    import device_check_kernels as kernels
    import device_check_models as models

    funcs = {
        "env": stage_env,
        "kernels": kernels.stage_kernels,
        "greedy_device": models.stage_greedy_device,
        "greedy_cpu": functools.partial(models.stage_greedy_cpu, device_file=input_file),
        "bench": models.stage_bench,
        "steps": models.stage_steps,
    }
    rec = Recorder(out)
    try:
        funcs[name](s, rec)
    except Exception:
        rec["error"] = traceback.format_exc()[-4000:]
        rec.save()
        return 1
    rec.save()
    return 0


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")[-chars:]
    except OSError:
        return ""


def run_stage(stage: str, budget_s: float, argv: list[str], s: Settings, log_dir: Path) -> dict:
    """Runs a stage's processes one after another within `budget_s` in all.

    A process still running at the deadline is killed with its process group (the compilers and helpers it
    started too).

    Returns:
      The stage's entry: status ("ok", "failed" or "timeout"), elapsed_s, budget_s, the results its
      processes saved, and for a stage that did not finish, the process and the tail of its log.
    """
    start = time.perf_counter()
    entry: dict[str, Any] = {"budget_s": budget_s}
    previous = None
    for name, extra_env in PROCESSES[stage]:
        out = s.workdir / f"{name}.json"
        out.unlink(missing_ok=True)
        log = log_dir / f"device_check.{name}.log"
        cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--stage", name, "--stage-out", str(out)]
        if previous is not None:
            cmd += ["--stage-input", str(previous)]
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            **extra_env,
            **({"JAX_PLATFORMS": "cpu"} if s.dry_run else {}),
        }
        left = budget_s - (time.perf_counter() - start)
        status = "timeout"
        if left > 0:
            with log.open("w") as log_file:
                proc = subprocess.Popen(
                    cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True
                )
                try:
                    status = "ok" if proc.wait(timeout=left) == 0 else "failed"
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        if out.is_file():
            entry.update(json.loads(out.read_text()))
        if status != "ok":
            entry.update(status=status, process=name, log_tail=_tail(log))
            break
        previous = out
    entry.setdefault("status", "ok")
    entry["elapsed_s"] = time.perf_counter() - start
    return entry


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
        )
    except OSError:
        return None
    return out.stdout.strip() or None


def parse_budgets(text: str | None) -> dict[str, float]:
    """ "kernels=90,bench=200" -> seconds per stage, the others at BUDGET_S.

    Raises:
      ValueError: for an unknown stage or a value that is not a number.
    """
    budgets = dict(BUDGET_S)
    for item in filter(None, (text or "").split(",")):
        stage, _, value = item.partition("=")
        if stage not in BUDGET_S:
            raise ValueError(f"--budgets: unknown stage {stage!r}; stages are {', '.join(STAGES)}")
        try:
            budgets[stage] = float(value)
        except ValueError:
            raise ValueError(f"--budgets: {item!r} needs seconds, e.g. {stage}=60") from None
    return budgets


def _without_option(argv: list[str], option: str) -> list[str]:
    """argv less `option` and its value (`--opt value` or `--opt=value`)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == option:
            skip = True
        elif not a.startswith(option + "="):
            out.append(a)
    return out


def run_all(args: argparse.Namespace, argv: list[str]) -> int:
    """Runs the chosen stages under their budgets and the total one, writing the JSON after each.

    Returns:
      0 when every stage finished ("ok"), else 1 (the JSON says which did not and why).
    """
    stages = [x.strip() for x in args.stages.split(",") if x.strip()]
    unknown = sorted(set(stages) - set(STAGES))
    if unknown:
        raise SystemExit(f"--stages: unknown {unknown}; choose from {', '.join(STAGES)}")
    try:
        budgets = parse_budgets(args.budgets)
    except ValueError as error:
        raise SystemExit(str(error)) from None
    own_workdir = args.workdir is None
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="device_check-")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    log_dir = Path(args.log_dir or workdir).resolve()
    log_dir.mkdir(parents=True, exist_ok=True)
    s = settings_from(args, workdir)
    child_argv = _without_option(_without_option(argv, "--out"), "--workdir") + ["--workdir", str(workdir)]
    out = Path(args.out).resolve()
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "dry_run": s.dry_run,
        "argv": argv,
        "commit": _git_commit(),
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "budget_s": args.budget_s,
        "settings": {k: v for k, v in dataclasses.asdict(s).items() if k != "workdir"},
        "stages": {},
    }
    start = time.perf_counter()
    for stage in stages:
        budget = min(budgets[stage], args.budget_s - (time.perf_counter() - start))
        if budget < 1:
            entry = {
                "status": "skipped",
                "reason": "the total budget was spent",
                "budget_s": 0,
                "elapsed_s": 0,
            }
        else:
            entry = run_stage(stage, budget, child_argv, s, log_dir)
        report["stages"][stage] = entry
        if stage == "env" and "device_kind" in entry:
            report.update({k: entry.get(k) for k in ("device_kind", "backend", "jax")})
        report["total_s"] = time.perf_counter() - start
        write_json(out, report)
        status, elapsed = entry["status"], entry["elapsed_s"]
        print(
            f"[device_check] {stage}: {status} in {elapsed:.1f}s (budget {entry['budget_s']:.0f}s)",
            flush=True,
        )
    if own_workdir:  # logs kept only with --log-dir; their tails are in the JSON for a stage that failed
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"[device_check] wrote {out} in {report['total_s']:.1f}s", flush=True)
    return 0 if all(e["status"] == "ok" for e in report["stages"].values()) else 1


SUMMARY_HEADER = (
    "| device | jax | date | kernels passed | greedy bf16 = CPU fp32 (top-2 gaps where not) "
    "| dflash speedup by batch | Qwen3-8B 1 / 16 / 33 tokens, ms (x roofline) |\n"
    "|---|---|---|---|---|---|---|"
)


def summary_row(report: dict) -> str:
    """One markdown row (columns: SUMMARY_HEADER) of a device check's JSON; a stage that did not finish
    shows its status after what it saved before that."""
    stages = report["stages"]

    def cell(stage: str, text: str) -> str:
        status = stages.get(stage, {}).get("status", "not run")
        return text if status == "ok" else f"{text} ({status})".strip()

    kernels, greedy = stages.get("kernels", {}), stages.get("greedy", {})
    gaps = ", ".join(
        f"{p['top2_gap']:.3g}" for p in greedy.get("prompts", []) if p.get("top2_gap") is not None
    )
    bench = [
        r for r in stages.get("bench", {}).get("rows", []) if r["method"] == "dflash" and r.get("speedup")
    ]
    steps = stages.get("steps", {}).get("steps", {}).values()
    cells = [
        report.get("device_kind", "-"),
        report.get("jax", "-"),
        report.get("started_utc", "-")[:10],
        cell("kernels", f"{kernels.get('passed', 0)}/{len(kernels.get('cases', []))}"),
        cell(
            "greedy",
            f"{greedy.get('identical', '-')}/{greedy.get('n_prompts', '-')}" + (f" ({gaps})" if gaps else ""),
        ),
        cell("bench", ", ".join(f"{r['batch_size']}: {r['speedup']:.2f}x" for r in bench)),
        cell(
            "steps",
            " / ".join(
                f"{1e3 * s['median_s']:.2f}"
                + (f" ({s['measured_over_roofline']:.2f}x)" if "roofline_s" in s else "")
                for s in steps
            ),
        ),
    ]
    return "| " + " | ".join(cells) + " |"


def batch_sizes(text: str) -> tuple[int, ...]:
    """ "1,8,32" -> (1, 8, 32).

    Raises:
      argparse.ArgumentTypeError: for anything but positive integers.
    """
    try:
        sizes = tuple(int(b) for b in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive integers, e.g. 1,8,32")
    return sizes


def build_parser() -> argparse.ArgumentParser:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--out", default="device_check.json", help="the JSON file written")
    p.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU (interpret-mode kernels)")
    p.add_argument("--stages", default=",".join(STAGES), help="comma-separated stages to run")
    p.add_argument("--budget-s", type=float, default=TOTAL_BUDGET_S, help="seconds for all stages together")
    p.add_argument("--budgets", help=f"seconds per stage, e.g. bench=200 (defaults: {BUDGET_S})")
    p.add_argument("--chip", help="price steps with this chip's figures (h100, h200, v5e, ...)")
    p.add_argument("--workdir", help="scratch directory (default: a temporary one, removed at the end)")
    p.add_argument("--log-dir", help="keep each process's log here, as device_check.<process>.log")
    p.add_argument("--target", default="smollm2-135m", help="the greedy and bench target")
    p.add_argument("--greedy-prompts", type=int, default=4, choices=range(1, len(PROMPTS) + 1), metavar="N",
                   help=f"prompts decoded greedily (1 to {len(PROMPTS)})")  # fmt: skip
    p.add_argument("--greedy-tokens", type=int, default=32, help="new tokens per greedy prompt")
    p.add_argument("--bench-prompts", default="humaneval", help="humaneval, mtbench, a JSONL file or inline")
    p.add_argument(
        "--bench-batch-sizes", type=batch_sizes, default="1,8,32", help="one run_bench call per batch size"
    )
    p.add_argument(
        "--bench-min-prompts", type=int, default=16, help="prompts per batch size, at least a batch"
    )
    p.add_argument("--bench-tokens", type=int, default=64, help="new tokens per bench prompt")
    p.add_argument(
        "--bench-block-size", type=int, default=8, help="dflash block size (auto's timing is slow)"
    )
    p.add_argument(
        "--bench-prompt-bucket",
        type=int,
        default=128,
        help="bench prompts of one bucket: at most this many tokens, more than half as many where possible",
    )
    p.add_argument("--steps-model", default="configs/models/qwen3-8b", help="config of the random target")
    p.add_argument("--steps-context", type=int, default=1024, help="cached tokens before each timed step")
    p.add_argument("--steps-reps", type=int, default=10, help="timed calls per step (median)")
    p.add_argument(
        "--summary", metavar="JSON", help="print a written check's README row (SUMMARY_HEADER) and exit"
    )
    p.add_argument("--stage", help=argparse.SUPPRESS)  # internal: run one process of a stage
    p.add_argument("--stage-out", help=argparse.SUPPRESS)
    p.add_argument("--stage-input", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point: the whole check, a written check's README row (--summary), or (internally, with --stage)
    one process of a stage."""
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if args.summary:
        print(SUMMARY_HEADER)
        print(summary_row(json.loads(Path(args.summary).read_text())))
        return 0
    if args.stage is None:
        return run_all(args, argv)
    sys.path.insert(0, str(REPO))  # dflax and pallas_kernels from this checkout when not installed
    s = settings_from(args, Path(args.workdir))
    return run_process(
        args.stage, s, Path(args.stage_out), Path(args.stage_input) if args.stage_input else None
    )


if __name__ == "__main__":
    sys.exit(main())
