"""The weights digest of a local checkpoint: what tells two checkpoints of one architecture apart
(`ModelFingerprint.weights_sha256`) without reading every byte of a 100 GB model; and the
safetensors header reader it shares with the bundle's shards (a leaf module: imports no moetool)."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
DIGEST_SAMPLES = 32  # per weight file that is not safetensors
DIGEST_SAMPLE_BYTES = 1 << 16
DIGEST_WHOLE_TENSOR = 1 << 16  # a safetensors tensor up to this size is hashed whole (routers, norms, biases)
DIGEST_VERSION = 2  # ModelFingerprint.digest_version of `weights_digest`


def weights_digest(source: str) -> str:
    """sha256 over every weight file of a local checkpoint ("" for a hub id or a directory with no
    weight files): its name and size, then per tensor of a safetensors file its name, dtype, shape
    and bytes (a tensor of up to 64 KiB whole, a larger one at 4 points of 256 bytes spread over it);
    other files at 32 points of 64 KiB spread over the file.

    Not a hash of every byte: a 100 GB checkpoint would take minutes to hash on every command, and
    what it has to catch is a different checkpoint of the same architecture (a fine-tune, a rebuilt
    demo model) where most of some tensor differs. Sampling per file missed a change to the small
    tensors alone (routers rescaled: every artifact of the old model was reused for the new one);
    per tensor, each router and norm is read whole. About 1 KiB per large tensor."""
    root = Path(source)
    if not root.is_dir():
        return ""
    files = sorted(p for p in root.iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES)  # HF layout: flat
    if not files:
        return ""
    h = hashlib.sha256()
    for f in files:
        size = f.stat().st_size
        h.update(os.fsencode(f"{f.relative_to(root)}\0{size}\0"))  # a file name need not be UTF-8
        try:
            start, header = read_header(f) if f.suffix == ".safetensors" else (0, None)
        except (OSError, ValueError, RecursionError):  # not a safetensors file after all: sampled as bytes
            header = None
        with f.open("rb") as fh:
            spans = _tensor_spans(start, header, size) if isinstance(header, dict) else None
            if spans is None:
                spans = [("", 0, size, DIGEST_SAMPLES, DIGEST_SAMPLE_BYTES)]
            for name, begin, end, points, width in spans:
                h.update(name.encode("utf-8", "surrogatepass") + b"\0")  # a header's name: any JSON string
                n = end - begin
                if n <= points * width:
                    fh.seek(begin)
                    h.update(fh.read(n))
                    continue
                for i in range(points):
                    fh.seek(begin + (n - width) * i // (points - 1))
                    h.update(fh.read(width))
    return h.hexdigest()


def _tensor_spans(start: int, header: dict, size: int) -> list[tuple] | None:
    """(name with dtype and shape, first byte, end, points, bytes a point) per tensor, by name;
    None when the header's offsets do not describe this file."""
    spans = []
    for name in sorted(k for k in header if k != "__metadata__"):
        info = header[name]
        try:
            a, b = (int(x) for x in info["data_offsets"])
            label = f"{name}\0{info['dtype']}\0{list(info['shape'])}"
        except (TypeError, KeyError, ValueError):
            return None
        if not 0 <= a <= b <= size - start:
            return None
        small = b - a <= DIGEST_WHOLE_TENSOR
        spans.append((label, start + a, start + b, 1 if small else 4, DIGEST_WHOLE_TENSOR if small else 256))
    return spans


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
