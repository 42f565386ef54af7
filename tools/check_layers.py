"""Prints the import circles and the upward imports between dflax's layers.

    python tools/check_layers.py    # exit status 1: a circle, or an upward import without a reason

A layer may import from the layers below it and from itself. Every `import` counts, at module level or inside
a function (a deferred import hides a circle from Python, not from a reader), except those under
`if TYPE_CHECKING:`. An upward import the design accepts is listed in `ACCEPTED_UPWARD` with its reason.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("dflax", "pallas_kernels")

# Bottom to top: each entry is (layer, module prefixes); a module belongs to its longest matching prefix.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("base", ("dflax.paths", "dflax.cpu_info", "dflax.host_memory")),
    ("model configs", ("dflax.models.config",)),
    ("kernels", ("pallas_kernels", "dflax.cpu_kernels")),
    ("sharding rules", ("dflax.sharding",)),
    ("models", ("dflax.models",)),
    ("checkpoints", ("dflax.checkpoints",)),
    ("targets", ("dflax.sharding.placement", "dflax.target")),
    ("decoding", ("dflax.decoding",)),
    ("drafters", ("dflax.drafters", "dflax.diffusion")),
    ("runtime", ("dflax.runtime", "dflax.sharding.programs", "dflax.divergence")),
    ("planning", ("dflax.planning",)),
    ("api", ("dflax.generation", "dflax.prompts")),
    (
        "applications",
        (
            "dflax.train",
            "dflax.aot",
            "dflax.bench",
            "dflax.reference",
            "dflax.reference_baseline",
            "dflax.hf_baseline",
            "dflax.plots",
        ),
    ),
    ("entry points", ("dflax.cli", "dflax.__main__", "dflax.__init__")),
)

# (importer, imported) -> why the design accepts it.
ACCEPTED_UPWARD: dict[tuple[str, str], str] = {}


def module_name(path: Path) -> str:
    """dflax/models/cache.py -> dflax.models.cache; a package's __init__.py -> dflax.models.__init__."""
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def layer_of(module: str) -> int | None:
    """The index in LAYERS of `module`'s layer (None: not one of dflax's modules)."""
    best, best_len = None, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    if best is None and module == "dflax":
        return len(LAYERS) - 1
    return best


def _under_type_checking(tree: ast.AST) -> set[int]:
    """ids of the import nodes inside `if TYPE_CHECKING:` blocks."""
    skipped = set()
    for node in ast.walk(tree):
        test = getattr(node, "test", None)
        if isinstance(node, ast.If) and getattr(test, "id", getattr(test, "attr", "")) == "TYPE_CHECKING":
            skipped |= {id(n) for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))}
    return skipped


def imported_modules(path: Path, known: set[str]) -> Iterator[str]:
    """The dflax modules `path` imports (a `from package import name` counts name when it is a module)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skipped = _under_type_checking(tree)
    package = module_name(path).rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield from _resolve(alias.name, known)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                child = f"{base}.{alias.name}"
                yield from _resolve(child if _known(child, known) else base, known)


def _known(module: str, known: set[str]) -> bool:
    return module in known or f"{module}.__init__" in known


def _resolve(module: str, known: set[str]) -> Iterator[str]:
    if module in known:
        yield module
    elif f"{module}.__init__" in known:
        yield f"{module}.__init__"


def import_graph() -> dict[str, set[str]]:
    """Each of dflax's modules -> the dflax modules it imports."""
    paths = [p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))]
    known = {module_name(p) for p in paths}
    return {module_name(p): set(imported_modules(p, known)) - {module_name(p)} for p in paths}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    counter = [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) pairs where the imported module sits in a higher layer."""
    found = []
    for importer, targets in sorted(graph.items()):
        for imported in sorted(targets):
            low, high = layer_of(importer), layer_of(imported)
            if low is not None and high is not None and high > low:
                found.append((importer, imported))
    return found


def main() -> int:
    """Prints the report; returns 1 when there is a circle or an upward import without a reason."""
    graph = import_graph()
    unlayered = sorted(m for m in graph if layer_of(m) is None)
    found_circles = circles(graph)
    upward = upward_imports(graph)
    unexplained = [pair for pair in upward if pair not in ACCEPTED_UPWARD]
    print(f"layers, bottom to top: {' < '.join(name for name, _ in LAYERS)}")
    print(f"{len(found_circles)} import circle(s)")
    for component in found_circles:
        print("  " + " <-> ".join(component))
    print(f"{len(upward)} upward import(s), {len(unexplained)} without a reason")
    for importer, imported in upward:
        reason = ACCEPTED_UPWARD.get((importer, imported), "NO REASON GIVEN")
        low, high = LAYERS[layer_of(importer)][0], LAYERS[layer_of(imported)][0]
        print(f"  {importer} ({low}) -> {imported} ({high}): {reason}")
    for module in unlayered:
        print(f"  not in any layer: {module}")
    return 1 if found_circles or unexplained or unlayered else 0


if __name__ == "__main__":
    sys.exit(main())
