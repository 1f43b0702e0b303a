"""`python -m moetool ...`, the same program as the `moetool` command."""

from moetool.entry import main

main()
