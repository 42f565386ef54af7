"""`python -m dflax` runs the command line."""

from dflax.cli import app

app()
