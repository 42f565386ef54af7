"""The `dflax` command line: generate, bench, make-data, train, validate, pipeline, export, check-reference
and plan."""

from __future__ import annotations

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)


@app.callback()
def _process_settings() -> None:
    """Every command: glibc's malloc set for XLA's temporaries (dflax.host_memory)."""
    from dflax.host_memory import configure_malloc

    configure_malloc()
