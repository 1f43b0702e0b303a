"""The files of a bundle: expert shards (one safetensors file of uint8 blobs per MoE layer) and the
files under `model/` — their manifest records, writing them (temp file, fsync, rename), reading
their headers, checking them, and mapping a shard's blobs. `bundle.py` holds the manifest.

    writer = ShardWriter(directory / "layer-003.safetensors", layer=3, nbytes=total, metadata={...})
    writer.write(blob); shard = writer.finish()
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
import tempfile
import zlib
from dataclasses import dataclass
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moetool.artifacts import sha256_file
from moetool.digest import read_header
from moetool.errors import MoetoolError
from moetool.files import temp_path, umask_mode
from moetool.quant.format import ALIGN

TENSOR = "blobs"  # the one tensor name inside every shard
MODEL_DIR = "model"  # config, generation config, tokenizer files and the non-expert weights
NON_EXPERT = "non_expert.safetensors"


@dataclass(frozen=True)
class Shard:
    name: str  # file name inside the bundle directory
    layer: int
    nbytes: int  # file size
    sha256: str  # of the whole file


@dataclass(frozen=True)
class ModelFile:
    """One file under `model/`: the non-expert weights, config, tokenizer."""

    name: str  # path relative to model/
    nbytes: int
    sha256: str
    crc32: int  # checked whenever the file is read (the non-expert weights at every load)


def _header(nbytes: int, metadata: dict[str, str]) -> bytes:
    """A safetensors header for one uint8 tensor, padded so the data starts ALIGN-aligned."""
    body = {"__metadata__": metadata, TENSOR: {"dtype": "U8", "shape": [nbytes], "data_offsets": [0, nbytes]}}
    text = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    pad = (-(8 + len(text))) % ALIGN
    text += b" " * pad  # safetensors allows trailing spaces in the header
    return struct.pack("<Q", len(text)) + text


class ShardWriter:
    """Stream blobs into a shard: header first (sizes are known from the layouts), then each blob
    in order, hashing as it goes; `finish` renames the temp file into place."""

    def __init__(self, path: Path, layer: int, nbytes: int, settings_sha256: str):
        self.path, self.layer, self.nbytes, self.written = path, layer, nbytes, 0
        self.tmp = temp_path(path)  # named before it is made: an interruption right after still finds it
        try:
            self.file = os.fdopen(os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600), "wb")
            self.hash = hashlib.sha256()
            self._write(_header(nbytes, {"layer": str(layer), "settings_sha256": settings_sha256}))
        except BaseException:
            self.tmp.unlink(missing_ok=True)
            raise

    def _write(self, data: bytes | memoryview) -> None:
        with _naming(self.path):
            self.file.write(data)
        self.hash.update(data)

    def write(self, blob: torch.Tensor) -> tuple[int, int]:
        """Append one uint8 blob; returns its offset in the blob tensor and its CRC-32."""
        offset = self.written
        data = memoryview(blob.contiguous().numpy())
        self._write(data)
        self.written += blob.numel()
        return offset, zlib.crc32(data)

    def finish(self) -> Shard:
        if self.written != self.nbytes:
            raise RuntimeError(f"shard {self.path.name}: wrote {self.written} bytes, planned {self.nbytes}")
        with _naming(self.path):
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
        os.chmod(self.tmp, umask_mode())  # mkstemp makes it private; the caller's umask says what to share
        os.replace(self.tmp, self.path)
        return Shard(name=self.path.name, layer=self.layer, nbytes=self.path.stat().st_size,
                     sha256=self.hash.hexdigest())

    def abort(self) -> None:
        try:
            self.file.close()  # flushes what is buffered: on a full disk that fails too
        except OSError:
            pass
        finally:
            self.tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def _naming(path: Path) -> Iterator[None]:
    """A write's OSError names the file it wrote (a file object's write raises one with no filename: a full
    disk or `ulimit -f` was said of the bundle's directory, not its shard)."""
    try:
        yield
    except OSError as e:
        if e.filename is None:
            e.filename = str(path)
        raise


_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
                      torch.bool: "BOOL"}


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """A safetensors file written tensor by tensor (never a second copy of them all in memory), atomically."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)  # the data starts 8-byte aligned
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with _naming(path), os.fdopen(fd, "wb") as f:
            f.write(struct.pack("<Q", len(text)) + text)
            for t in tensors.values():
                f.write(memoryview(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _dangling(path: Path) -> str | None:
    """What to say of a bundle file that is a link leading nowhere (`cp -rs` of a bundle whose original went),
    or None: quantize, which "missing" sent the user to, refuses a finished bundle."""
    if not path.is_symlink():
        return None
    return (f"is a link to {os.readlink(path)}, which does not exist; restore that file, or copy the bundle with "
            "cp -r rather than links")


def check_shard(path: Path, shard: Shard, settings_sha256: str, full: bool) -> None:
    """Refuse, in one sentence naming the shard, a shard that is missing, resized, stale or corrupt."""
    where = f"shard {shard.name} of the bundle in {path.parent}"
    if not path.is_file():
        raise MoetoolError(f"{where} {_dangling(path) or 'is missing; re-run moetool quantize'}.")
    size = path.stat().st_size
    if size != shard.nbytes:
        raise MoetoolError(f"{where} is {size} bytes, not the {shard.nbytes} its manifest records; "
                           "it is truncated or from another run, re-run moetool quantize.")
    try:
        start, header = read_header(path)
        meta = header.get("__metadata__", {})
        tensor = header[TENSOR]
        # map_shard trusts this: one uint8 tensor that fills the file from the end of the header.
        if tensor["dtype"] != "U8" or list(tensor["data_offsets"]) != [0, size - start] or \
                list(tensor["shape"]) != [size - start] or not isinstance(meta, dict):
            raise ValueError("not a shard of blobs")
    except (ValueError, UnicodeDecodeError, AttributeError, KeyError, TypeError, RecursionError):
        raise MoetoolError(f"{where} has a corrupt header; re-run moetool quantize.") from None
    if meta.get("settings_sha256") != settings_sha256 or meta.get("layer") != str(shard.layer):
        raise MoetoolError(f"{where} belongs to another quantization run (its header does not match the manifest); "
                           "re-run moetool quantize.")
    if full and sha256_file(path) != shard.sha256:
        raise MoetoolError(f"{where} is corrupt (its sha256 does not match the manifest); re-run moetool quantize.")


def blob_crc32(blob: torch.Tensor) -> int:
    """CRC-32 of a uint8 tensor's bytes (a few GB/s: cheap next to reading the blob from disk)."""
    return zlib.crc32(memoryview(blob.contiguous().numpy()))


def file_crc32(path: Path, chunk: int = 1 << 24) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return crc


SMALL_MODEL_FILE = 1 << 20  # bytes: non-expert weights at most this size are hashed whenever a bundle opens


def check_model_file(directory: Path, f: ModelFile, full: bool, crc: bool = False) -> None:
    """Refuse, in one sentence naming the file, a model file that is missing, resized or corrupt."""
    path = directory / MODEL_DIR / f.name
    what = "non-expert weights" if f.name == NON_EXPERT else f.name
    if not path.is_file() and (link := _dangling(path)):
        raise MoetoolError(f"the {what} of the bundle in {directory} ({MODEL_DIR}/{f.name}) {link}.")
    if not path.is_file():
        raise MoetoolError(f"the bundle in {directory} lacks its {what} ({MODEL_DIR}/{f.name}); it is incomplete: "
                           "re-run moetool quantize.")
    if path.stat().st_size != f.nbytes:
        raise MoetoolError(f"{MODEL_DIR}/{f.name} in the bundle in {directory} is {path.stat().st_size} bytes, not the "
                           f"{f.nbytes} its manifest records; re-run moetool quantize.")
    # Every file but the non-expert weights (config.json, tokenizer files of any size) is hashed even
    # on a fast open: a one-byte change there alters routing or the vocabulary silently, transformers
    # reads each of them whole at load anyway, and an edit that transformers cannot parse would end in
    # its traceback instead of this sentence. The non-expert weights are checked by CRC-32 as they are
    # read (`OpenBundle.non_expert_path`), since hashing gigabytes twice at every start would not be fast.
    cheap = f.name != NON_EXPERT or f.nbytes <= SMALL_MODEL_FILE
    if (crc and file_crc32(path) != f.crc32) or ((full or cheap) and sha256_file(path) != f.sha256):
        raise MoetoolError(f"{MODEL_DIR}/{f.name} in the bundle in {directory} is corrupt (checksum mismatch); "
                           "re-run moetool quantize.")


def map_shard(path: Path) -> torch.Tensor:
    """The shard's blob tensor, memory-mapped (pages are read on first touch, never copied)."""
    start, header = read_header(path)
    nbytes = header[TENSOR]["data_offsets"][1]
    # Copy-on-write mapping: writable as numpy wants for torch.from_numpy, yet the file is never modified.
    array = np.memmap(path, dtype=np.uint8, mode="c", offset=start, shape=(nbytes,))
    return torch.from_numpy(array)  # uint8 [nbytes]
