"""Code-completion training prompts from Python source on this machine: the standard library and installed
packages.

HumanEval asks a model to complete a function from its signature and docstring; the standard library holds
thousands of such functions. Each prompt is one documented function's source from its `def` line through
the end of its docstring, dedented to the top level, as a raw completion (no chat template), so the target
writes the body the way it would for a benchmark prompt. A second prompt set does the same for documented
classes (the `class` line through the docstring: the target writes the methods). A third, "packages", takes
documented functions from the installed pure-Python packages of `PACKAGE_MODULES` (numpy, sympy, networkx,
jax, ...; `bash .ci/setup --test` installs them all), whose versions fix it as the interpreter's version fixes
the standard library's. Test packages are skipped, prompts are deduplicated, any prompt containing a benchmark
prompt is dropped, and the rest is split into train / validation by a hash of the text, as for ShareGPT.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import sys
import sysconfig
import textwrap
from collections.abc import Iterator
from pathlib import Path

from dflax.prompts import PromptRecord
from dflax.train.sharegpt import SPLITS, benchmark_texts, normalize, split_of

_SKIPPED_DIRS = {"test", "tests", "idle_test", "site-packages", "lib2to3", "__pycache__", "turtledemo"}
_MIN_DOCSTRING_CHARS = 20
_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)
# The code prompt sets (their names are also their prompt ids' prefix) and the definitions each is cut from.
CODE_PROMPT_SETS = {"stdlib": _FUNCTIONS, "stdlib-classes": (ast.ClassDef,), "packages": _FUNCTIONS}
STDLIB_PROMPT_SETS = ("stdlib", "stdlib-classes")
# Installed packages (import names) whose documented functions the "packages" set reads, in this order:
# math and algorithms with doctest-style docstrings first (HumanEval's shape), then the array, plotting and
# text libraries dflax itself runs on.
PACKAGE_MODULES = (
    "sympy", "mpmath", "networkx", "numpy", "jax", "optax", "flax", "matplotlib", "PIL", "fontTools",
    "jinja2", "markdown_it", "pygments", "rich", "click", "packaging", "dateutil", "tqdm", "etils",
    "huggingface_hub",
)


def stdlib_dir() -> Path:
    """The directory of this interpreter's pure-Python standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_version() -> str:
    """The interpreter version whose standard library the prompts come from (it fixes the prompt set)."""
    return "{}.{}.{}".format(*sys.version_info[:3])


def package_dir(module: str) -> Path:
    """The source directory of an installed package (by import name); a clear error when it is missing."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"the 'packages' prompt set reads the source of the {module!r} package, which is not installed: "
            "run `bash .ci/setup --test`, which installs every module of code_prompts.PACKAGE_MODULES"
        )
    return Path(list(spec.submodule_search_locations)[0])


def package_versions() -> dict[str, str | None]:
    """{distribution: version} of the packages the "packages" prompt set reads (they fix the prompt set);
    None for a package that is not installed."""
    distributions = importlib.metadata.packages_distributions()
    versions = {}
    for module in PACKAGE_MODULES:
        for name in distributions.get(module, [module]):
            try:
                versions[name] = importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                versions[name] = None
    return versions


def _definitions_cut(prompt_set: str) -> tuple[type[ast.AST], ...]:
    """The definitions a code prompt set is cut from; a clear error for an unknown set."""
    if prompt_set not in CODE_PROMPT_SETS:
        raise ValueError(f"prompt set {prompt_set!r} unknown; choose one of {', '.join(CODE_PROMPT_SETS)}")
    return CODE_PROMPT_SETS[prompt_set]


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
      prompt_set: "stdlib" or "packages" (functions: def and async def) or "stdlib-classes" (classes).

    The prompt is the definition's decorator-free source from its `def` / `class` line through its
    docstring, dedented. Definitions whose docstring is shorter than 20 characters are skipped; a module
    that does not parse yields nothing.
    """
    wanted = _definitions_cut(prompt_set)
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return
    lines = source.splitlines()

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


def _code_files(prompt_set: str, root: Path | None) -> list[tuple[Path, Path]]:
    """(file, the directory its id is relative to) for every source file a prompt set reads, in order."""
    if prompt_set in STDLIB_PROMPT_SETS:
        root = root or stdlib_dir()
        return [(path, root) for path in _source_files(root)]
    files = []
    for module in PACKAGE_MODULES:
        directory = root / module if root else package_dir(module)
        files += [(path, directory.parent) for path in _source_files(directory)]
    return files


def load_code_prompts(
    validation_fraction: float, prompt_set: str = "stdlib", root: Path | None = None
) -> dict[str, list[PromptRecord]]:
    """Documented functions (or classes) of the standard library or of installed packages as raw completion
    prompts, split by a hash of their text.

    Args:
      validation_fraction: share of prompts (by text hash) held out for validation.
      prompt_set: "stdlib", "stdlib-classes" or "packages" (see `definition_prompts`).
      root: the directory to read (default: this interpreter's standard library; for "packages", a
        directory holding a folder per module of `PACKAGE_MODULES`, by default where each is installed).

    Returns:
      {"train": [...], "validation": [...]}, each in file order; ids are "<prompt set>:<path>:<qualname>",
      the path relative to the standard library (or to the folder holding the package).
    """
    _definitions_cut(prompt_set)  # an unknown set fails before any file is read
    exclude = [t for t in benchmark_texts() if t]
    splits: dict[str, list[PromptRecord]] = {name: [] for name in SPLITS}
    seen: set[str] = set()
    for path, base in _code_files(prompt_set, root):
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        module = path.relative_to(base).as_posix()
        for qualname, prompt in definition_prompts(source, prompt_set):
            key = normalize(prompt)
            if key in seen or any(bench in key for bench in exclude):
                continue
            seen.add(key)
            splits[split_of(key, validation_fraction)].append(
                PromptRecord(f"{prompt_set}:{module}:{qualname}", prompt)
            )
    return splits
