"""Code-completion training prompts from the Python standard library's own source.

HumanEval asks a model to complete a function from its signature and docstring; the standard library holds
thousands of such functions. Each prompt is one documented function's source from its `def` line through
the end of its docstring, dedented to the top level, as a raw completion (no chat template), so the target
writes the body the way it would for a benchmark prompt. A second prompt set does the same for documented
classes (the `class` line through the docstring: the target writes the methods). Test packages and private
modules are skipped, prompts are deduplicated, any prompt containing a benchmark prompt is dropped, and the
rest is split into train / validation by a hash of the text, as for ShareGPT.
"""

from __future__ import annotations

import ast
import sys
import sysconfig
import textwrap
from collections.abc import Iterator
from pathlib import Path

from dflax.prompts import PromptRecord
from dflax.train.sharegpt import SPLITS, benchmark_texts, normalize, split_of

_SKIPPED_DIRS = {"test", "tests", "idle_test", "site-packages", "lib2to3", "__pycache__", "turtledemo"}
_MIN_DOCSTRING_CHARS = 20
# The standard-library prompt sets (their names are also their prompt ids' prefix) and the definitions each
# is cut from.
STDLIB_PROMPT_SETS = {"stdlib": (ast.FunctionDef, ast.AsyncFunctionDef), "stdlib-classes": (ast.ClassDef,)}


def stdlib_dir() -> Path:
    """The directory of this interpreter's pure-Python standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_version() -> str:
    """The interpreter version whose standard library the prompts come from (it fixes the prompt set)."""
    return "{}.{}.{}".format(*sys.version_info[:3])


def _source_files(root: Path) -> list[Path]:
    return sorted(
        path
        for path in root.rglob("*.py")
        if not _SKIPPED_DIRS.intersection(path.relative_to(root).parts[:-1])
        and not path.name.startswith("test_")
    )


def definition_prompts(source: str, prompt_set: str = "stdlib") -> Iterator[tuple[str, str]]:
    """(qualified name, prompt) for each documented definition of one module's source.

    Args:
      source: a module's Python source.
      prompt_set: "stdlib" (functions: def and async def) or "stdlib-classes" (classes).

    The prompt is the definition's decorator-free source from its `def` / `class` line through its
    docstring, dedented. Definitions whose docstring is shorter than 20 characters are skipped; a module
    that does not parse yields nothing.
    """
    if prompt_set not in STDLIB_PROMPT_SETS:
        raise ValueError(f"prompt set {prompt_set!r} unknown; choose one of {', '.join(STDLIB_PROMPT_SETS)}")
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return
    lines = source.splitlines()
    wanted = STDLIB_PROMPT_SETS[prompt_set]

    def visit(node: ast.AST, prefix: str) -> Iterator[tuple[str, str]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, wanted):
                doc = ast.get_docstring(child, clean=False)
                body0 = child.body[0] if child.body else None
                if doc and len(doc.strip()) >= _MIN_DOCSTRING_CHARS and body0 is not None:
                    text = "\n".join(lines[child.lineno - 1 : body0.end_lineno])
                    yield f"{prefix}{child.name}", textwrap.dedent(text) + "\n"
            if isinstance(child, ast.ClassDef):  # methods and nested classes
                yield from visit(child, f"{prefix}{child.name}.")

    yield from visit(tree, "")


def load_stdlib_prompts(
    validation_fraction: float, root: Path | None = None, prompt_set: str = "stdlib"
) -> dict[str, list[PromptRecord]]:
    """Documented standard-library functions (or classes) as raw completion prompts, split by a hash of
    their text.

    Args:
      validation_fraction: share of prompts (by text hash) held out for validation.
      root: the library directory to read (default: this interpreter's standard library).
      prompt_set: "stdlib" or "stdlib-classes" (see `definition_prompts`).

    Returns:
      {"train": [...], "validation": [...]}, each in file order; ids are "<prompt set>:<module path>:
      <qualname>".
    """
    root = root or stdlib_dir()
    exclude = [t for t in benchmark_texts() if t]
    splits: dict[str, list[PromptRecord]] = {name: [] for name in SPLITS}
    seen: set[str] = set()
    for path in _source_files(root):
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        module = path.relative_to(root).as_posix()
        for qualname, prompt in definition_prompts(source, prompt_set):
            key = normalize(prompt)
            if key in seen or any(bench in key for bench in exclude):
                continue
            seen.add(key)
            splits[split_of(key, validation_fraction)].append(
                PromptRecord(f"{prompt_set}:{module}:{qualname}", prompt)
            )
    return splits
