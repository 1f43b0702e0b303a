"""The bundle artifact: `bundle.json` plus one safetensors shard of expert blobs per MoE layer.

Each shard holds a single uint8 tensor "blobs": every expert of its layer at every stored
precision, expert-major, each blob ALIGN-aligned. `bundle.json` says where each (layer, expert,
bits) blob lies, how it is laid out, how it was made and how far it is from the reference.

    ob = Bundle.open(Path("out/qwen-bundle"), verify="fast", model=lm.fingerprint)
    blob = ob.blob(layer=3, expert=7, bits=4)          # uint8 view of the memory-mapped shard
    w = ob.dequantize(3, 7, 4, dtype=torch.float32)    # ExpertWeights
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
import torch

from moetool.artifacts import Artifact, ModelFingerprint, sha256_file
from moetool.errors import MoetoolError
from moetool.model import ExpertWeights
from moetool.quant.format import ALIGN, Layout, dequantize

MANIFEST = "bundle.json"
TENSOR = "blobs"  # the one tensor name inside every shard


@dataclass(frozen=True)
class Entry:
    """One (layer, expert, bits) blob."""

    layer: int
    expert: int
    bits: int
    method: str  # what made it: "bf16", "hqq" or "gptq" (a GPTQ bundle falls back to hqq per expert)
    shard: str
    offset: int  # bytes from the start of the shard's blob tensor
    nbytes: int
    layout: str  # key into Bundle.layouts: packing, shapes, group size, part offsets and dtypes
    rel_error: dict[str, float]  # projection -> ||W - W_hat||_F / ||W||_F against the loaded weights
    out_error: float | None = None  # ||f(X) - f_hat(X)||_F / ||f(X)||_F on the expert's calibration tokens
    tokens: int | None = None  # calibration tokens the router sent to this expert


@dataclass(frozen=True)
class Shard:
    name: str  # file name inside the bundle directory
    layer: int
    nbytes: int  # file size
    sha256: str  # of the whole file


@dataclass(frozen=True)
class Bundle(Artifact):
    """Manifest of a quantized expert bundle (`bundle.json`).

    `settings` holds everything else that shaped the numbers (calibration, damping, device);
    `settings_sha256` is written into every shard's header so a fast open can tell a shard of
    this bundle from a stale one without hashing gigabytes.
    """

    SCHEMA: ClassVar[str] = "bundle"
    SCHEMA_VERSION: ClassVar[int] = 1

    method: str
    bits: tuple[int, ...]
    group_size: int
    axis: int
    settings: dict[str, Any]
    settings_sha256: str
    layouts: dict[str, Layout]
    shards: tuple[Shard, ...]
    entries: tuple[Entry, ...]

    def sizes(self) -> dict[int, int]:
        """Bytes stored per precision, over all experts."""
        out: dict[int, int] = {}
        for e in self.entries:
            out[e.bits] = out.get(e.bits, 0) + e.nbytes
        return dict(sorted(out.items(), reverse=True))

    @classmethod
    def open(cls, directory: Path, verify: Literal["fast", "full"] = "fast",
             model: ModelFingerprint | None = None) -> "OpenBundle":
        """Read `directory`'s manifest, check its shards and memory-map them.

        fast: every shard exists, has its recorded size and this bundle's settings hash in its
        header; full: also rehash every shard. With `model`, refuse a bundle of another model.
        """
        if verify not in ("fast", "full"):
            raise MoetoolError(f"verify must be 'fast' or 'full', not '{verify}'.")
        directory = Path(directory)
        manifest = cls.load(directory / MANIFEST, model=model)
        blobs = {}
        for shard in manifest.shards:
            path = directory / shard.name
            check_shard(path, shard, manifest.settings_sha256, full=verify == "full")
            blobs[shard.name] = map_shard(path)
        return OpenBundle(directory, manifest, blobs)


class OpenBundle:
    """A verified bundle with its shards memory-mapped: blobs as zero-copy uint8 views."""

    def __init__(self, directory: Path, manifest: Bundle, blobs: dict[str, torch.Tensor]):
        self.directory = directory
        self.manifest = manifest
        self.shards = blobs  # shard name -> uint8 [n], the whole mapped blob tensor
        self._index = {(e.layer, e.expert, e.bits): e for e in manifest.entries}

    def entry(self, layer: int, expert: int, bits: int) -> Entry:
        try:
            return self._index[(layer, expert, int(bits))]
        except KeyError:
            raise MoetoolError(f"the bundle in {self.directory} has no expert {expert} of layer {layer} at "
                               f"{int(bits)} bits (it stores {', '.join(map(str, self.manifest.bits))}).") from None

    def layout(self, entry: Entry) -> Layout:
        return self.manifest.layouts[entry.layout]

    def blob(self, layer: int, expert: int, bits: int) -> torch.Tensor:
        e = self.entry(layer, expert, bits)
        return self.shards[e.shard][e.offset:e.offset + e.nbytes]  # uint8 [nbytes], no copy

    def dequantize(self, layer: int, expert: int, bits: int, dtype: torch.dtype = torch.float32) -> ExpertWeights:
        e = self.entry(layer, expert, bits)
        return dequantize(self.blob(layer, expert, bits), self.layout(e), dtype)


# ---- shard files --------------------------------------------------------------------------------


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
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        self.tmp = Path(tmp)
        self.file = os.fdopen(fd, "wb")
        self.hash = hashlib.sha256()
        self._write(_header(nbytes, {"layer": str(layer), "settings_sha256": settings_sha256}))

    def _write(self, data: bytes | memoryview) -> None:
        self.file.write(data)
        self.hash.update(data)

    def write(self, blob: torch.Tensor) -> int:
        """Append one uint8 blob; returns its offset in the blob tensor."""
        offset = self.written
        self._write(memoryview(blob.contiguous().numpy()))
        self.written += blob.numel()
        return offset

    def finish(self) -> Shard:
        if self.written != self.nbytes:
            raise RuntimeError(f"shard {self.path.name}: wrote {self.written} bytes, planned {self.nbytes}")
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.chmod(self.tmp, 0o644)  # mkstemp makes it private; a bundle is meant to be shared read-only
        os.replace(self.tmp, self.path)
        return Shard(name=self.path.name, layer=self.layer, nbytes=self.path.stat().st_size,
                     sha256=self.hash.hexdigest())

    def abort(self) -> None:
        self.file.close()
        self.tmp.unlink(missing_ok=True)


def read_header(path: Path) -> tuple[int, dict[str, Any]]:
    """(data start, header dict) of a safetensors file; ValueError if it is not one."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError("too short")
        (n,) = struct.unpack("<Q", raw)
        if n > 1 << 24:
            raise ValueError("header length out of range")
        text = f.read(n)
    return 8 + n, json.loads(text)


def check_shard(path: Path, shard: Shard, settings_sha256: str, full: bool) -> None:
    """Refuse, in one sentence naming the shard, a shard that is missing, resized, stale or corrupt."""
    where = f"shard {shard.name} of the bundle in {path.parent}"
    if not path.is_file():
        raise MoetoolError(f"{where} is missing; re-run moetool quantize.")
    size = path.stat().st_size
    if size != shard.nbytes:
        raise MoetoolError(f"{where} is {size} bytes, not the {shard.nbytes} its manifest records; "
                           "it is truncated or from another run, re-run moetool quantize.")
    try:
        _, header = read_header(path)
        meta = header.get("__metadata__", {})
    except (ValueError, UnicodeDecodeError, AttributeError):
        raise MoetoolError(f"{where} has a corrupt header; re-run moetool quantize.") from None
    if meta.get("settings_sha256") != settings_sha256 or meta.get("layer") != str(shard.layer):
        raise MoetoolError(f"{where} belongs to another quantization run (its header does not match the manifest); "
                           "re-run moetool quantize.")
    if full and sha256_file(path) != shard.sha256:
        raise MoetoolError(f"{where} is corrupt (its sha256 does not match the manifest); re-run moetool quantize.")


def map_shard(path: Path) -> torch.Tensor:
    """The shard's blob tensor, memory-mapped (pages are read on first touch, never copied)."""
    start, header = read_header(path)
    nbytes = header[TENSOR]["data_offsets"][1]
    # Copy-on-write mapping: writable as numpy wants for torch.from_numpy, yet the file is never modified.
    array = np.memmap(path, dtype=np.uint8, mode="c", offset=start, shape=(nbytes,))
    return torch.from_numpy(array)  # uint8 [nbytes]
