"""`python -m moetool ...`, the same program as the `moetool` command."""

from moetool.cli import app

app(prog_name="moetool")
