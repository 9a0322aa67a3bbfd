"""`python -m kvc` runs the CLI."""

from kvc.main import app

app()
