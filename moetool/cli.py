"""The `moetool` entry point: import every command (each registers itself on `moetool.app.app`) and run the app.

    moetool run --help          # the console script (pyproject.toml: moetool = "moetool.entry:main")
    python -m moetool.cli run --help

The app, its consoles and the error policy are in moetool/app.py, the shared options in
moetool/options.py, each command in moetool/commands/.
"""

from __future__ import annotations

from moetool.app import app
# In pipeline order, not alphabetical: `moetool --help` lists the commands in the order they registered.
from moetool.commands import check, demo, quantize, verify, profile, fit, run, eval, sweep, report  # noqa: F401,I001


def main() -> None:
    app()


if __name__ == "__main__":
    main()
