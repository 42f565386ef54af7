"""tools/check_layers.py: dflax's layers import downward only, with no circles; and the checker itself
finds a circle and an upward import when a module has one."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import check_layers  # noqa: E402


def test_no_circles_and_at_most_three_upward_imports_each_with_a_reason():
    graph = check_layers.import_graph()
    assert check_layers.circles(graph) == []
    upward = check_layers.upward_imports(graph)
    assert len(upward) <= 3
    assert all(pair in check_layers.ACCEPTED_UPWARD for pair in upward), upward
    assert [m for m in graph if check_layers.layer_of(m) is None] == []


def test_the_checker_sees_a_circle_and_an_upward_import():
    graph = {
        "dflax.models.transformer": {"dflax.runtime.shapes"},  # models -> runtime: upward
        "dflax.runtime.shapes": {"dflax.runtime.programs"},
        "dflax.runtime.programs": {"dflax.runtime.shapes"},  # a circle
    }
    assert check_layers.circles(graph) == [["dflax.runtime.programs", "dflax.runtime.shapes"]]
    assert check_layers.upward_imports(graph) == [("dflax.models.transformer", "dflax.runtime.shapes")]


def test_deferred_imports_count_and_type_checking_ones_do_not(tmp_path):
    module = tmp_path / "dflax" / "models" / "example.py"
    module.parent.mkdir(parents=True)
    module.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from dflax.drafters import Drafter\n"
        "def f():\n    from dflax.runtime import shapes\n"
    )
    known = {"dflax.drafters.__init__", "dflax.runtime.shapes", "dflax.runtime.__init__"}
    original = check_layers.ROOT
    check_layers.ROOT = tmp_path
    try:
        assert set(check_layers.imported_modules(module, known)) == {"dflax.runtime.shapes"}
    finally:
        check_layers.ROOT = original
