"""`dflax plan` end to end on a tiny checkpoint: the table of compiled numbers, and clear errors."""

from __future__ import annotations

from typer.testing import CliRunner

from dflax.cli import app

runner = CliRunner()


def test_plan_prints_the_compiled_numbers(tpu_device, tiny_checkpoint):
    tpu_device("v5e:2x2")
    path = str(tiny_checkpoint("qwen3")[0])
    args = ["plan", "--model", path, "--drafter", "untrained", "--batch", "2", "--prompt-len", "16"]
    args += ["--max-new-tokens", "8", "--block-size", "4", "--stages", "prefill,decode_loop"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    rows = [line.split("|")[1:-1] for line in result.stdout.splitlines() if line.startswith(f"| {path}")]
    assert [row[1].strip() for row in rows] == ["prefill", "decode_loop"], result.stdout
    for row in rows:
        arguments_mib, gflop = float(row[2].replace(",", "")), float(row[6].replace(",", ""))
        assert arguments_mib > 0 and gflop > 0, row


def test_plan_errors_name_the_problem(tpu_device, tiny_checkpoint):
    tpu_device("v5e:2x2")
    result = runner.invoke(app, ["plan", "--model", "no-such-model"])
    assert result.exit_code == 2 and "unknown model 'no-such-model'" in result.output, result.output
    path = str(tiny_checkpoint("qwen3")[0])
    result = runner.invoke(app, ["plan", "--model", path, "--topology", "v99x:1x1"])
    assert result.exit_code == 2 and "v99x:1x1" in result.output, result.output
    result = runner.invoke(app, ["plan", "--model", path, "--stages", "verify"])
    assert result.exit_code == 2 and "unknown stages" in result.output, result.output
