"""One module per CLI command added after the core ones; each registers itself on `moetool.cli.app`."""
from moetool.commands import quantize  # noqa: F401
from moetool.commands import verify  # noqa: F401
from moetool.commands import eval  # noqa: F401
from moetool.commands import profile  # noqa: F401
from moetool.commands import fit  # noqa: F401
from moetool.commands import report  # noqa: F401
from moetool.commands import demo  # noqa: F401
from moetool.commands import sweep  # noqa: F401
