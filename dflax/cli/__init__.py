"""The `dflax` command line; each command lives in its own module and registers itself on `app`."""

# isort: skip_file
from dflax.cli.app import app
from dflax.cli import generate, bench, train, reference, plan  # noqa: F401  (registered in `--help` order)

__all__ = ["app"]
