"""One module per CLI command; each registers itself on `moetool.app.app` when imported (moetool/cli.py imports them all)."""
