"""The `moetool` console script and `python -m moetool`: the app, once its commands are imported.

Importing them (torch, transformers) takes a second or more; a Ctrl-C in that time is said in one line,
as one during a command is (`app._stopped`), not as a KeyboardInterrupt traceback from an import.
"""

from __future__ import annotations

import sys


def main() -> None:
    try:
        from moetool.cli import app
    except KeyboardInterrupt:
        sys.stderr.write("interrupted (Ctrl-C) while moetool started: nothing was done.\n")
        raise SystemExit(130) from None
    app(prog_name="moetool")


if __name__ == "__main__":
    main()
