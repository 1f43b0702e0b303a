"""One module per CLI command added after the core ones; each registers itself on `moetool.cli.app`."""
from moetool.commands import quantize  # noqa: F401
