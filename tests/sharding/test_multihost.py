"""Two processes on 127.0.0.1 (4 fake CPU devices each, gloo collectives) driving one data=2,model=4 mesh
write, between their two output files, exactly the one-process results: every id once, the same tokens.
One id is already in process 0's file before the run: both processes skip it (resume), so their batches
stay the same."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

from eight_devices import fake_devices_env
from typer.testing import CliRunner

from dflax.cli import app
from dflax.prompts import shard_of

PROMPTS = [  # 6 prompts of 2-5 words
    {"id": f"p{i}", "prompt": " ".join(f"w{5 + 3 * i + j}" for j in range(2 + i % 4))} for i in range(6)
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_two_processes_write_the_one_process_results(tmp_path, tiny_checkpoint):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    args = ["generate", "--target", str(tiny_checkpoint("qwen3-8kv")[0]), "--prompts", str(prompts)]
    args += ["--max-new-tokens", "5", "--batch-size", "8", "--temperature", "1.0", "--seed", "3"]
    args += ["--method", "dflash", "--drafter", "untrained", "--block-size", "4"]
    result = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "one.jsonl")])
    assert result.exit_code == 0, result.output
    expected = {r["id"]: r["tokens"] for r in _lines(tmp_path / "one.jsonl")}

    resumed = next(p["id"] for p in PROMPTS if shard_of(p["id"], 2) == 0)
    done_line = next(r for r in _lines(tmp_path / "one.jsonl") if r["id"] == resumed)
    (tmp_path / "out-0.jsonl").write_text(json.dumps(done_line) + "\n")

    env = fake_devices_env(4)
    coordinator = f"127.0.0.1:{_free_port()}"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "dflax",
                *args,
                "--out",
                str(tmp_path / f"out-{i}.jsonl"),
                "--mesh",
                "data=2,model=4",
                "--coordinator",
                coordinator,
                "--num-processes",
                "2",
                "--process-id",
                str(i),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for i in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (_, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-3000:]
    assert "1 of 6 prompts already done" in " ".join(outputs[1][1].split())  # process 1 saw process 0's line

    files = [_lines(tmp_path / f"out-{i}.jsonl") for i in range(2)]
    for i, lines in enumerate(files):
        assert {shard_of(r["id"], 2) for r in lines} == {i}  # each process wrote its own shard
    ids = [r["id"] for lines in files for r in lines]
    assert sorted(ids) == sorted(expected)  # every id exactly once
    assert {r["id"]: r["tokens"] for lines in files for r in lines} == expected


def test_multihost_flags_are_one_clear_error_each(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps(PROMPTS[0]) + "\n")
    run = ["generate", "--prompts", str(prompts), "--out", str(tmp_path / "o.jsonl"), "--mesh", "data=2"]
    for args, message in (
        (["--num-processes", "2", "--process-id", "1"], "need --coordinator host:port"),
        (["--coordinator", "10.0.0.1"], "give host:port of process 0"),
        (["--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "2"], "one id in 0 .. 1"),
        (["--coordinator", "127.0.0.1:1", "--num-shards", "2"], "leave out --num-shards"),
    ):
        result = CliRunner().invoke(app, [*run, *args])
        assert result.exit_code == 2 and message in " ".join(result.output.split()), result.output
    result = CliRunner().invoke(app, ["generate", "--coordinator", "127.0.0.1:1", "w5 w6"])
    assert result.exit_code == 2 and "needs --prompts, --out (one file per process) and --mesh" in " ".join(
        result.output.split()
    )
