"""Where a Hugging Face checkpoint's files are: its local directory (a hub snapshot from the cache
offline), the safetensors shards transformers would read, each opened memory-mapped; refused in one
sentence where a link leads nowhere, an index names a file out of the directory, or a shard is
truncated.

    directory = local_directory("Qwen/Qwen1.5-MoE-A2.7B")     # or a local path, returned as it is
    for path in weight_files(directory):
        with open_safetensors(path) as f: ...
"""

from __future__ import annotations

import fnmatch
import os
from pathlib import Path
from typing import Any

from moetool.artifacts import read_json
from moetool.errors import MoetoolError, first_line, not_text
from moetool.files import CONFIG_BYTES, check_file

WEIGHT_INDEX = "model.safetensors.index.json"
# What a run needs of a hub snapshot besides the weights: config, tokenizer, generation config.
_SNAPSHOT_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


def local_directory(source: str) -> Path:
    """A local checkpoint directory for `source`: itself, or a hub snapshot (from the cache offline)."""
    p = Path(source)
    if p.is_dir():
        refuse_broken_links(p)
        return p
    try:
        from huggingface_hub import snapshot_download

        snapshot = Path(snapshot_download(repo_id=source, allow_patterns=_SNAPSHOT_PATTERNS))
    except Exception as e:  # noqa: BLE001 - any failure to resolve a hub id is one sentence
        raise MoetoolError(f"cannot get the weights of '{source}' from the hub or its local cache: {first_line(e)}.") \
            from None
    refuse_broken_links(snapshot)  # a blob deleted from the cache (`hf cache delete`, a cleaner)
    return snapshot


# What a checkpoint directory's links may lead to: its config, tokenizer and weight files.
_CHECKPOINT_FILES = (*_SNAPSHOT_PATTERNS, "*.bin", "*.pt", "*.pth")


def refuse_broken_links(directory: Path) -> None:
    """Refuse a checkpoint file that is a symbolic link leading to no file. A hub snapshot's files
    are links into its cache's blobs/ (`../../blobs/<sha>`): a snapshot copied without following
    them (`cp -r`) or whose blobs were deleted keeps only dangling links, and a missing file would
    otherwise be read as absent (no tokenizer: text as bytes; no generation config) or blamed on
    the wrong cause ("no config.json")."""
    try:
        entries = sorted(os.scandir(directory), key=lambda e: e.name)
    except OSError:  # unreadable: the read that needs it names the cause
        return
    for entry in entries:
        if (entry.is_symlink() and any(fnmatch.fnmatch(entry.name, p) for p in _CHECKPOINT_FILES)
                and not os.path.exists(entry.path)):
            raise MoetoolError(f"{entry.path} is a symbolic link to {os.readlink(entry.path)}, which leads to no file: "
                               "the checkpoint was copied without the files its links point to (a hub snapshot's "
                               "blobs/) or they were deleted; copy it with `cp -rL` or download it again.")


def weight_files(directory: Path) -> list[Path]:
    """The checkpoint's safetensors shards, the files transformers' from_pretrained reads: those its
    index lists, else `model.safetensors` (another .safetensors beside it, such as Mistral's
    `consolidated.safetensors` or a PEFT `adapter_model.safetensors`, is not the model's), else every
    .safetensors file (shards whose index was lost). Pickled (.bin) checkpoints are refused: moetool
    streams safetensors only, reading each tensor where its header says it lies."""
    index = directory / WEIGHT_INDEX
    if index.exists():
        data = read_json(index, CONFIG_BYTES, "safetensors index")  # a regular file of bounded size, and JSON
        try:
            names = sorted(set(data["weight_map"].values()))
            files = [directory / n for n in names]
        except (KeyError, TypeError, AttributeError):
            raise MoetoolError(f"{index} is not a valid safetensors index (no weight_map).") from None
        outside = [n for n in names if not isinstance(n, str) or Path(n).name != n or n in (".", "..")]
        if outside:  # a shard is a file of the checkpoint's own directory, never a path out of it
            raise MoetoolError(f"{index} lists the shard {outside[0]!r}, which is not a file name in {directory}.")
        if not files:
            raise MoetoolError(f"{index} lists no shard (its weight_map is empty); copy or download the checkpoint "
                               "again.")
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise MoetoolError(f"checkpoint shard {missing[0]} listed in {index} is missing.")
    elif (directory / "model.safetensors").exists():
        files = [directory / "model.safetensors"]
    else:
        files = sorted(directory.glob("*.safetensors"))
    if files:
        for f in files:  # memory-mapped, not read whole: any size, but a FIFO or a device is no checkpoint
            check_file(f, 1 << 62, "checkpoint shard")
        return files
    if any(directory.glob("*.bin")) or any(directory.glob("*.pt")):
        # transformers 5's save_pretrained writes safetensors only (it has no safe_serialization switch).
        raise MoetoolError(f"{directory} holds only pickled (.bin) weights, which moetool does not read (it streams "
                           "safetensors shards, tensor by tensor); convert them once to safetensors: load the model with "
                           "transformers' AutoModelForCausalLM.from_pretrained and save it with save_pretrained.")
    raise MoetoolError(f"{directory} holds no safetensors weights.")


def open_safetensors(path: Path) -> Any:
    """A memory-mapped safetensors file; a truncated or corrupt one is refused by name."""
    from safetensors import safe_open

    if not_text(str(path)) is not None:  # safetensors takes only UTF-8 paths: the file is not at fault
        raise MoetoolError(f"the path {path} is not UTF-8 (a byte of it is not), and safetensors opens only UTF-8 "
                           "paths; rename the directory or file.")
    try:
        return safe_open(str(path), framework="pt")
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error type for every corrupt layout
        raise MoetoolError(f"checkpoint shard {path.name} in {path.parent} is truncated or corrupt ({first_line(e)}); "
                           "download or copy it again.") from None
