"""`moetool verify`: rehash a whole bundle (shards, every blob's checksum, the model files)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from moetool.app import command, err, out, styled


@command
def verify(
    bundle: Annotated[Path, typer.Argument(help="Bundle directory (holds bundle.json).")],
) -> None:
    """Check that BUNDLE is exactly what its manifest says: each shard's sha256, each expert blob's
    CRC-32 (one blob per entry, the blobs filling each shard), the sha256 of every file under model/
    (the non-expert weights, config, tokenizer), and no file the manifest does not list.

    Runs check a bundle cheaply as they go (sizes and headers at open, each blob's CRC-32 the first
    time it is read); this reads it all, e.g. after copying a bundle to another machine. Exit 0 if
    it is intact; otherwise one sentence naming the first bad shard, expert or file, and exit 1.

    Example: `moetool verify out/qwen-bundle`
    """
    from moetool.quant.bundle import Bundle

    opened = Bundle.open(bundle, verify="fast")
    with Progress(TextColumn("verify"), BarColumn(), MofNCompleteColumn(), console=err, transient=True,
                  disable=not err.is_terminal) as bar:
        task = bar.add_task("verify", total=len(opened.manifest.shards))
        opened.verify_all(progress=lambda done, total: bar.update(task, completed=done), exact=True)
    m = opened.manifest
    size = sum(s.nbytes for s in m.shards) + sum(f.nbytes for f in m.model_files)
    out.print(styled(("OK", "green"), f"  {bundle}: {len(m.shards)} shards, {len(m.entries)} expert blobs, "
                     f"{len(m.model_files)} model files, {size / 2**30:.2f} GiB verified"), highlight=False)
