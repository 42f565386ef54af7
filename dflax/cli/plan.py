"""`dflax plan`: generation compiled for TPUs or GPUs without a chip."""

from __future__ import annotations

import typer

from dflax.cli.app import app
from dflax.cli.common import TARGET_HELP, console, fail


@app.command("plan")
def plan_command(
    model: str = typer.Option(
        "smollm2-135m",
        help="preset (smollm2-135m, gemma3-270m, qwen3-8b, llama-3.1-8b), " + TARGET_HELP + " or config.json",
    ),
    drafter: str = typer.Option(
        None,
        help="'none' (plain decoding), 'untrained', 'shipped' or a drafter directory; default: the preset's",
    ),
    topology: str = typer.Option(
        None,
        help="TPU topology compiled for (default v5e:2x2, one device of it; with --mesh the v5e slice "
        "of --devices chips)",
    ),
    mesh: str = typer.Option(
        None, help="data=D,model=M: compile sharded over D * M devices and report bytes per device"
    ),
    platform: str = typer.Option("tpu", help="with --mesh: tpu or cuda"),
    devices: int = typer.Option(None, help="with --mesh: abstract devices (default D * M)"),
    card: str = typer.Option("h100", help="with --platform cuda: h100 or a100"),
    batch: int = typer.Option(1, help="rows decoded together (with --mesh padded to a multiple of D)"),
    prompt_len: int = typer.Option(1024, help="prompt bucket (tokens per row in prefill)"),
    max_new_tokens: int = typer.Option(256, help="new-token budget per row"),
    block_size: int = typer.Option(16, help="tokens verified per step with a drafter"),
    dtype: str = typer.Option("bfloat16", help="bfloat16 or float32"),
    attention_backend: str = typer.Option("pallas", help="pallas (the TPU/GPU kernel) or reference"),
    stages: str = typer.Option(
        None,
        help="comma-separated stages to compile (prefill, decode_step, decode_loop); default all, "
        "with --mesh decode_step",
    ),
) -> None:
    """Compile generation for TPUs or GPUs on this machine (no chip needed); print the compiler's numbers."""
    from dflax.aot import STAGES, StepShape, TpuCompilerUnavailableError, markdown_table, plan
    from dflax.aot.gpu import GpuCompilerUnavailableError
    from dflax.aot.sharded_plan import plan_sharded, sharded_table

    chosen = tuple(s.strip() for s in stages.split(",") if s.strip()) if stages else None
    try:
        shape = StepShape(batch, prompt_len, max_new_tokens, block_size)
        if mesh:
            with console.status(f"compiling {model} for {devices or 'the mesh of'} {platform} devices ..."):
                chip, shape, rows = plan_sharded(
                    model, mesh=mesh, platform=platform, devices=devices, topology=topology, card=card,
                    drafter=drafter, shape=shape, dtype=dtype, attention_backend=attention_backend,
                    stages=chosen or ("decode_step",),
                )  # fmt: skip
            console.print(f"{chip.name}, batch {shape.batch}, prompt bucket {shape.prompt_len}, budget "
                          f"{shape.max_new_tokens}, block {shape.block_size}")  # fmt: skip
            print(sharded_table(model, mesh, chip, rows))
            return
        topology = topology or "v5e:2x2"
        with console.status(f"compiling {model} for {topology} ..."):
            rows = plan(
                model,
                drafter=drafter,
                topology=topology,
                shape=shape,
                dtype=dtype,
                attention_backend=attention_backend,
                stages=chosen or STAGES,
            )
    except (TpuCompilerUnavailableError, GpuCompilerUnavailableError, ValueError, FileNotFoundError) as e:
        fail(str(e))
    print(markdown_table(rows))
