"""The bundle artifact: `bundle.json`, one safetensors shard of expert blobs per MoE layer, and `model/`.

Each shard holds a single uint8 tensor "blobs": every expert of its layer at every stored
precision, expert-major, each blob ALIGN-aligned. `bundle.json` says where each (layer, expert,
bits) blob lies, how it is laid out, how it was made, how far it is from the reference, and its
CRC-32. `model/` holds what a run needs besides the experts (config, generation config, tokenizer
files, and the non-expert weights in `non_expert.safetensors`), so a bundle runs on its own.

Integrity without rehashing gigabytes at every start: opening checks sizes, headers, the
manifest's own checksum (and that no two entries share a blob) and hashes every file of `model/`
but the non-expert weights, whose CRC-32 is checked as they are read; each blob's CRC-32 is checked
the first time it is read; `verify_all` (`moetool verify`) rehashes everything and refuses any file
the manifest does not list.

    ob = Bundle.open(Path("out/qwen-bundle"), verify="fast", model=lm.fingerprint)
    blob = ob.blob(layer=3, expert=7, bits=4)          # uint8 view of the memory-mapped shard
    w = ob.dequantize(3, 7, 4, dtype=torch.float32)    # ExpertWeights
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, ClassVar, Literal

import torch

from moetool.artifacts import Artifact, ModelFingerprint, read_json
from moetool.errors import MoetoolError
from moetool.files import CONFIG_BYTES, lock_held
from moetool.inference import refuse_unroutable
from moetool.checkpoint import build_skeleton, expert_parameter_names, load_into
from moetool.checkpoint_files import open_safetensors
from moetool.model import DeviceProvider, ExpertWeights, LoadedModel, attention_for_decode, inspect_geometry, \
    install_provider
from moetool.quant.format import ALIGN, Bits, Layout, dequantize, make_layout
from moetool.quant.shards import (MODEL_DIR, NON_EXPERT, ModelFile, Shard, blob_crc32, check_model_file, check_shard,
                                  map_shard)
from moetool.schema import SchemaError
from moetool.source import load_config, load_generation_config
from moetool.tokenizer import load_tokenizer

MANIFEST = "bundle.json"
METHODS = ("hqq", "gptq")  # what quantizes a bundle's low-bit experts


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
    crc32: int  # of the blob's bytes: checked the first time the blob is read
    rel_error: dict[str, float]  # projection -> ||W - W_hat||_F / ||W||_F against the loaded weights
    out_error: float | None = None  # ||f(X) - f_hat(X)||_F / ||f(X)||_F on the expert's calibration tokens
    tokens: int | None = None  # calibration tokens the router sent to this expert
    # projection -> the largest relative error of one output row: a stacked projection's Frobenius ratio
    # hides a half of smaller weights stored far coarser (gate's norm swamps up's); None: not recorded
    row_error: dict[str, float] | None = None


@dataclass(frozen=True)
class Bundle(Artifact):
    """Manifest of a quantized expert bundle (`bundle.json`).

    `settings` holds everything else that shaped the numbers (calibration, damping, device);
    `settings_sha256` is written into every shard's header so a fast open can tell a shard of
    this bundle from a stale one without hashing gigabytes.
    """

    SCHEMA: ClassVar[str] = "bundle"
    # 2: self-contained (model/ with the non-expert weights), a CRC-32 per blob, a manifest checksum.
    SCHEMA_VERSION: ClassVar[int] = 2

    method: str
    bits: tuple[int, ...]
    group_size: int
    axis: int
    settings: dict[str, Any]
    settings_sha256: str
    layouts: dict[str, Layout]
    shards: tuple[Shard, ...]
    entries: tuple[Entry, ...]
    model_files: tuple[ModelFile, ...]

    @classmethod
    def upgrade(cls, data: dict[str, Any], version: int) -> dict[str, Any]:
        if version < 2:
            raise SchemaError("", "it was written by an older moetool (bundle format 1: no non-expert weights, "
                              "no per-blob checksums); re-quantize it with `moetool quantize MODEL --out DIR`")
        return data

    def to_json(self) -> dict[str, Any]:
        body = super().to_json()
        return {**body, "checksum": _manifest_checksum(body)}

    @classmethod
    def from_json(cls, data: dict[str, Any], *, where: str = "artifact") -> "Bundle":
        bundle = super().from_json(data, where=where)  # refuses other schemas and older formats first
        if data.get("checksum") != _manifest_checksum({k: v for k, v in data.items() if k != "checksum"}):
            raise MoetoolError(f"{where} has been modified since it was written (its checksum does not match its "
                               "content); re-run moetool quantize.")
        return bundle

    def validate(self) -> None:
        """On read, what the field types cannot say: every precision is one the format stores, every
        entry points at a blob laid out as recorded and lying inside its shard, every layer stores
        experts 0..E-1 at every precision, and every file name stays inside the bundle directory.
        (That an entry lies inside its shard's blob tensor, past the header, is checked once the
        shard is mapped: `open`.)"""
        choices = ", ".join(str(int(b)) for b in Bits)
        if not self.bits:
            raise SchemaError("bits", "is empty; a bundle stores at least one precision")
        for i, b in enumerate(self.bits):
            if b not in {int(x) for x in Bits}:
                raise SchemaError(f"bits[{i}]", f"is {b}, not a stored precision ({choices})")
        if len(set(self.bits)) != len(self.bits):
            raise SchemaError("bits", f"lists a precision twice ({', '.join(map(str, self.bits))})")
        stored = ", ".join(map(str, self.bits))
        if self.axis not in (0, 1):
            raise SchemaError("axis", f"is {self.axis}, not an hqq quantization axis (0 or 1)")
        if self.method not in METHODS:
            raise SchemaError("method", f"is {_quote(self.method)}, not one of {', '.join(METHODS)}")
        if self.settings.get("group_size", self.group_size) != self.group_size:
            raise SchemaError("settings.group_size", f"is {self.settings.get('group_size')!r}, but the bundle's "
                                                     f"group_size is {self.group_size}")
        for key, layout in self.layouts.items():
            if layout.bits not in self.bits:
                raise SchemaError(f"layouts[{key!r}].bits", f"is {layout.bits}, a precision the bundle does not "
                                                            f"store ({stored})")
            for proj in layout.projections:  # each low-bit projection in the bundle's groups, or per channel at INT8
                if proj.group_size and proj.group_size != self.group_size and not layout.per_channel:
                    raise SchemaError(f"layouts[{key!r}]", f"groups its {proj.name} projection by {proj.group_size} "
                                                           f"columns, but the bundle's group_size is {self.group_size}")
        for i, entry in enumerate(self.entries):
            if entry.method not in (*METHODS, "bf16"):
                raise SchemaError(f"entries[{i}].method", f"is {_quote(entry.method)}, not one of bf16, "
                                                          f"{', '.join(METHODS)}")
            errors = {f"rel_error[{name!r}]": err for name, err in entry.rel_error.items()}
            if entry.out_error is not None:
                errors["out_error"] = entry.out_error
            for name, err in errors.items():
                if not math.isfinite(err) or err < 0:
                    raise SchemaError(f"entries[{i}].{name}", f"is {err}; an error is finite and not negative")
        self._check_entries(self._check_files(), stored)

    def _check_files(self) -> dict[str, Shard]:
        """Shards and model files named inside the bundle directory, one shard per layer: name -> shard."""
        shards: dict[str, Shard] = {}
        for i, shard in enumerate(self.shards):
            if not _plain_name(shard.name):
                raise SchemaError(f"shards[{i}].name", f"is {_quote(shard.name)}, not a file name inside the bundle")
            if shard.name in shards:
                raise SchemaError(f"shards[{i}].name", f"repeats shard {_quote(shard.name)}")
            if any(s.layer == shard.layer for s in shards.values()):
                raise SchemaError(f"shards[{i}].layer", f"is {shard.layer}, a layer another shard already holds")
            shards[shard.name] = shard
        for i, f in enumerate(self.model_files):
            parts = PurePosixPath(f.name).parts
            if not parts or f.name.startswith("/") or ".." in parts or not all(_plain_name(x) for x in parts):
                raise SchemaError(f"model_files[{i}].name", f"is {_quote(f.name)}, not a path inside {MODEL_DIR}/")
        return shards

    def _check_entries(self, shards: dict[str, Shard], stored: str) -> None:
        """Each entry's blob where its shard, precision and layout say; experts 0..E-1 at every precision."""
        seen: dict[tuple[int, int, int], int] = {}
        experts: dict[int, dict[int, set[int]]] = {s.layer: {b: set() for b in self.bits} for s in self.shards}
        for i, e in enumerate(self.entries):
            at = f"entries[{i}]"
            shard = shards.get(e.shard)
            if shard is None:
                raise SchemaError(f"{at}.shard", f"is {_quote(e.shard)}, not a shard the manifest lists")
            if e.layer != shard.layer:
                raise SchemaError(f"{at}.layer", f"is {e.layer}, but its shard {shard.name} holds layer {shard.layer}")
            if e.bits not in self.bits:
                raise SchemaError(f"{at}.bits", f"is {e.bits}, not a precision the bundle stores ({stored})")
            layout = self.layouts.get(e.layout)
            if layout is None:
                raise SchemaError(f"{at}.layout", f"is {_quote(e.layout)}, not a layout the manifest lists")
            if layout.bits != e.bits:
                raise SchemaError(f"{at}.layout", f"is a {layout.bits}-bit layout for a {e.bits}-bit blob")
            if e.nbytes != layout.nbytes:
                raise SchemaError(f"{at}.nbytes", f"is {e.nbytes}, not the {layout.nbytes} bytes of its layout")
            if e.offset % ALIGN:
                raise SchemaError(f"{at}.offset", f"is {e.offset}, not a multiple of {ALIGN} as every blob's is")
            if e.offset + e.nbytes > shard.nbytes:
                raise SchemaError(f"{at}.offset", f"is {e.offset}: its {e.nbytes} bytes would run past the end of "
                                                  f"shard {shard.name} ({shard.nbytes} bytes)")
            key = (e.layer, e.expert, e.bits)
            if key in seen:
                raise SchemaError(at, f"repeats expert {e.expert} of layer {e.layer} at {e.bits} bits "
                                      f"(entries[{seen[key]}])")
            seen[key] = i
            experts[e.layer][e.bits].add(e.expert)
        by_shard = sorted(range(len(self.entries)), key=lambda i: (self.entries[i].shard, self.entries[i].offset))
        for i, j in zip(by_shard, by_shard[1:]):  # one blob per entry: no two entries share a byte of a shard
            a, b = self.entries[i], self.entries[j]
            if a.shard == b.shard and b.offset < a.offset + a.nbytes:
                raise SchemaError(f"entries[{j}].offset", f"is {b.offset}, inside the blob of entries[{i}] (expert "
                                                          f"{a.expert} of layer {a.layer} at {a.bits} bits) in shard "
                                                          f"{a.shard}; every entry has a blob of its own")
        for layer, by_bits in experts.items():
            every = set().union(*by_bits.values())
            if not every:
                raise SchemaError("entries", f"hold no expert of layer {layer}, which a shard is for")
            count = max(len(have) for have in by_bits.values())  # entries are unique: experts per precision
            outside = sorted(x for x in every if x >= count)
            if outside:
                i = next(i for i, e in enumerate(self.entries) if e.layer == layer and e.expert == outside[0])
                raise SchemaError(f"entries[{i}].expert", f"is {outside[0]}, but layer {layer} stores {count} experts, "
                                                          f"numbered 0-{count - 1}")
            for b, have in by_bits.items():
                if have != every:
                    raise SchemaError("entries", f"lack expert {min(every - have)} of layer {layer} at {b} bits")

    def experts_per_layer(self) -> dict[int, int]:
        """Layer -> the number of experts the bundle stores of it (validated: 0..E-1 at every precision)."""
        out: dict[int, set[int]] = {s.layer: set() for s in self.shards}
        for e in self.entries:
            out[e.layer].add(e.expert)
        return {layer: len(experts) for layer, experts in out.items()}

    def sizes(self) -> dict[int, int]:
        """Bytes stored per precision, over all experts."""
        out: dict[int, int] = {}
        for e in self.entries:
            out[e.bits] = out.get(e.bits, 0) + e.nbytes
        return dict(sorted(out.items(), reverse=True))

    def bf16_bytes(self) -> int:
        """What every expert takes at bf16, stored or not (`--no-reference`): each expert's layout at 16
        bits, from the shapes of one precision's layouts."""
        bits = max(e.bits for e in self.entries)
        total = 0
        for e in self.entries:
            if e.bits == bits:
                layout = self.layouts[e.layout]
                gate_up, down = (next(p for p in layout.projections if p.name == n) for n in ("gate_up", "down"))
                has_bias = any(p.name == "gate_up_bias" for p in layout.parts)
                total += make_layout(16, gate_up.shape, down.shape, has_bias).nbytes
        return total

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
        if not (directory / MANIFEST).is_file():
            what = "does not exist" if not directory.exists() else f"is not a bundle directory (no {MANIFEST} in it)"
            if lock_held(directory / ".quantize.lock"):  # quantize.LOCK (a module that imports this one)
                what = "is a bundle a moetool quantize is writing now; wait for it to finish"
            elif (directory / ".quantize-journal.json").is_file():  # quantize.JOURNAL
                what = (f"is an unfinished bundle (its quantize was stopped before it wrote {MANIFEST}); rerun the "
                        "quantize command that made it to finish it")
            raise MoetoolError(f"{directory} {what}.")
        manifest = cls.load(directory / MANIFEST, model=model)
        for f in manifest.model_files:
            check_model_file(directory, f, full=verify == "full")
        if NON_EXPERT not in {f.name for f in manifest.model_files}:
            raise MoetoolError(f"the bundle in {directory} records no non-expert weights; re-run moetool quantize.")
        _check_model_type(directory, manifest)
        blobs = {}
        for shard in manifest.shards:
            path = directory / shard.name
            check_shard(path, shard, manifest.settings_sha256, full=verify == "full")
            blobs[shard.name] = map_shard(path)
        for i, e in enumerate(manifest.entries):  # the manifest checked offsets against file sizes; now the blobs
            if e.offset + e.nbytes > blobs[e.shard].numel():
                raise MoetoolError(f"{directory / MANIFEST} is not a valid bundle artifact: entries[{i}].offset is "
                                   f"{e.offset}, so expert {e.expert} of layer {e.layer} at {e.bits} bits would run "
                                   f"past the end of the {blobs[e.shard].numel()} blob bytes in shard {e.shard}; "
                                   "re-run moetool quantize.")
        opened = OpenBundle(directory, manifest, blobs)
        if verify == "full":
            opened.verify_all()
        return opened


def _check_model_type(directory: Path, manifest: "Bundle") -> None:
    """The manifest's model_type is copied into every run's artifact: it must be config.json's."""
    cfg = directory / MODEL_DIR / "config.json"
    try:
        data = read_json(cfg, CONFIG_BYTES)
        model_type = data.get("model_type")
        # A multimodal checkpoint loaded as its language model is fingerprinted by its text config.
        text_type = (data.get("text_config") or {}).get("model_type")
    except (MoetoolError, AttributeError):
        return  # a missing or unreadable config is refused where the model is built, naming the file
    if model_type is not None and manifest.model.model_type not in (model_type, text_type):
        raise MoetoolError(f"{directory / MANIFEST} says the model is a {manifest.model.model_type!r} but its "
                           f"{MODEL_DIR}/config.json says {model_type!r}; re-run moetool quantize.")


class OpenBundle:
    """A verified bundle with its shards memory-mapped: blobs as zero-copy uint8 views."""

    def __init__(self, directory: Path, manifest: Bundle, blobs: dict[str, torch.Tensor]):
        self.directory = directory
        self.manifest = manifest
        self.shards = blobs  # shard name -> uint8 [n], the whole mapped blob tensor
        self._index = {(e.layer, e.expert, e.bits): e for e in manifest.entries}
        self._verified: set[tuple[int, int, int]] = set()

    @property
    def model_dir(self) -> Path:
        return self.directory / MODEL_DIR

    @property
    def non_expert_path(self) -> Path:
        """The non-expert weights, checked against their CRC-32 (they are read whole at every load anyway)."""
        record = next(f for f in self.manifest.model_files if f.name == NON_EXPERT)
        check_model_file(self.directory, record, full=False, crc=True)
        return self.model_dir / NON_EXPERT

    def entry(self, layer: int, expert: int, bits: int) -> Entry:
        try:
            return self._index[(layer, expert, int(bits))]
        except KeyError:
            raise MoetoolError(f"the bundle in {self.directory} has no expert {expert} of layer {layer} at "
                               f"{int(bits)} bits (it stores {', '.join(map(str, self.manifest.bits))}).") from None

    def layout(self, entry: Entry) -> Layout:
        return self.manifest.layouts[entry.layout]

    def blob(self, layer: int, expert: int, bits: int) -> torch.Tensor:
        """uint8 [nbytes] view of the mapped shard (no copy); its CRC-32 is checked on the first read."""
        e = self.entry(layer, expert, bits)
        view = self.shards[e.shard][e.offset:e.offset + e.nbytes]
        key = (e.layer, e.expert, e.bits)
        if key not in self._verified:
            if blob_crc32(view) != e.crc32:
                raise MoetoolError(f"expert {e.expert} of layer {e.layer} at {e.bits} bits in shard {e.shard} of the "
                                   f"bundle in {self.directory} is corrupt (checksum mismatch); re-run moetool quantize "
                                   "(`moetool verify` checks the whole bundle).")
            self._verified.add(key)
        return view

    def verify_all(self, progress: Callable[[int, int], None] | None = None, exact: bool = False) -> None:
        """Rehash everything: every shard's sha256, every blob's CRC-32, every model file's sha256.
        `exact` (`moetool verify`): also refuse any file the manifest does not list."""
        if exact:
            stray = self.unlisted()
            if stray:
                raise MoetoolError(f"the bundle in {self.directory} holds {stray[0]}, which its manifest does not "
                                   f"list{f' (and {len(stray) - 1} more)' if len(stray) > 1 else ''}; a bundle is "
                                   f"exactly what {MANIFEST} lists: move it out, or re-run moetool quantize.")
            used = dict.fromkeys(self.shards, 0)
            for e in self.manifest.entries:
                used[e.shard] += e.nbytes
            for name, n in used.items():  # blobs do not overlap (`Bundle.validate`): so they must fill the shard
                if n != self.shards[name].numel():
                    raise MoetoolError(f"shard {name} of the bundle in {self.directory} holds "
                                       f"{self.shards[name].numel() - n} bytes that no entry of its manifest "
                                       "describes; re-run moetool quantize.")
        for f in self.manifest.model_files:
            check_model_file(self.directory, f, full=True)
        for i, shard in enumerate(self.manifest.shards):
            for e in self.manifest.entries:  # blobs first: a bad one is named down to the expert
                if e.shard == shard.name:
                    self.blob(e.layer, e.expert, e.bits)
            check_shard(self.directory / shard.name, shard, self.manifest.settings_sha256, full=True)
            if progress:
                progress(i + 1, len(self.manifest.shards))

    def unlisted(self) -> list[str]:
        """Files and directories in the bundle directory that its manifest does not list (a stray shard
        of another model, a file dropped in by hand), as paths relative to it."""
        # The resume journal (quantize.JOURNAL) beside a manifest is what a quantize interrupted between
        # writing the manifest, its last write, and removing the journal leaves: the bundle is whole. So is
        # its lock file (quantize.LOCK), left where the quantize was killed while it read the bundle back.
        files = {MANIFEST, ".quantize-journal.json", ".quantize.lock", *(s.name for s in self.manifest.shards),
                 *(f"{MODEL_DIR}/{f.name}" for f in self.manifest.model_files)}
        dirs = {str(parent) for name in files for parent in PurePosixPath(name).parents if str(parent) != "."}
        found = []
        for root, subdirs, names in os.walk(self.directory):  # symlinked directories are not followed
            at = PurePosixPath(Path(root).relative_to(self.directory).as_posix())
            found += [str(at / d) for d in subdirs if str(at / d).removeprefix("./") not in dirs]
            found += [str(at / n) for n in names if str(at / n).removeprefix("./") not in files]
            subdirs[:] = [d for d in subdirs if str(at / d).removeprefix("./") in dirs]
        return sorted(f.removeprefix("./") for f in found)

    def dequantize(self, layer: int, expert: int, bits: int, dtype: torch.dtype = torch.float32) -> ExpertWeights:
        e = self.entry(layer, expert, bits)
        return dequantize(self.blob(layer, expert, bits), self.layout(e), dtype)


# ---- the model a bundle holds ---------------------------------------------------------------


def load_bundle_model(directory: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                      verify: str = "fast", model: ModelFingerprint | None = None) -> LoadedModel:
    """Load the model a self-contained bundle holds: config, tokenizer and non-expert weights from
    the bundle, experts served from its memory-mapped shards (nothing of the checkpoint is read).

    `lm.experts` dequantizes the bundle's highest stored precision (what a reference needs);
    `lm.bundle` is the opened bundle the engine's host store serves blobs from.
    """
    opened = Bundle.open(Path(directory), verify=verify, model=model)
    files = opened.model_dir
    config = load_config(str(files))
    skeleton = build_skeleton(config, dtype)
    geometry = inspect_geometry(skeleton)
    refuse_unroutable(skeleton, geometry.layers, str(directory))  # a config.json edited since quantize
    with open_safetensors(opened.non_expert_path) as f:
        load_into(skeleton, {k: f.get_slice(k) for k in f.keys()}, dtype, None, where=f"the bundle in {directory}")
    if hasattr(skeleton, "tie_weights"):
        skeleton.tie_weights()
    stored, expected = opened.manifest.experts_per_layer(), {g.index: g.num_experts for g in geometry.layers}
    if stored != expected:
        layer = min(k for k in stored.keys() | expected.keys() if stored.get(k) != expected.get(k))
        raise MoetoolError(f"the bundle in {directory} stores {stored.get(layer, 0)} experts of layer {layer}, but its "
                           f"model has {expected.get(layer, 0)} there; it is inconsistent: re-run moetool quantize.")
    experts = set(expert_parameter_names(skeleton))
    missing = [n for n, p in skeleton.named_parameters() if p.is_meta and n not in experts]
    if missing:
        raise MoetoolError(f"the bundle in {directory} lacks {len(missing)} non-expert weights (e.g. {missing[0]}); "
                           "it is incomplete: re-run moetool quantize.")
    reference = BundleExperts(opened, dtype)
    install_provider(skeleton, geometry, DeviceProvider(reference, device, dtype))
    load_generation_config(skeleton, files)
    attention_for_decode(device)
    skeleton.to(device)
    return LoadedModel(model=skeleton, tokenizer=load_tokenizer(str(files)), geometry=geometry, experts=reference,
                       fingerprint=opened.manifest.model, path=str(directory), bundle=opened)


class BundleExperts:
    """Reference weights from a bundle: each expert dequantized from the highest precision it stores."""

    def __init__(self, bundle: Any, dtype: torch.dtype):
        self.bundle, self.dtype, self.bits = bundle, dtype, max(bundle.manifest.bits)

    def get(self, layer: int, expert: int) -> ExpertWeights:
        return self.bundle.dequantize(layer, expert, self.bits, dtype=self.dtype)


def _plain_name(name: str) -> bool:
    """A single file name: nothing a manifest could use to reach outside the bundle directory."""
    return bool(name) and name not in (".", "..") and "/" not in name and "\\" not in name and name.isprintable()


def _quote(name: str) -> str:
    return repr(name if len(name) <= 60 else name[:57] + "...")


def _manifest_checksum(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


