"""Host store: every (layer, expert, bits) as one contiguous uint8 blob, plus how to read it back.

A blob is what one host-to-device copy moves. The store hands out host blobs (pinned lazily per
layer when CUDA is present, so a huge bundle never has to be pinned at once) and decodes a blob
that has landed on the device into an expert's weights, without copying the reference precision.

    store = HostStore.from_experts(lm.experts, dtype=torch.float32)   # reference precision only
    blob = store.blob(layer=3, expert=5, bits=16); w = store.decode(blob, 3, 5, 16)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from moetool.model import ExpertWeights, HostExperts

REFERENCE_BITS = 16  # the unquantized precision (bf16 in bundles; the model's dtype in memory)


@dataclass(frozen=True)
class Part:
    """One tensor inside a blob."""

    name: str  # gate_up, down, gate_up_bias, down_bias
    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _align(n: int, to: int = 64) -> int:
    # Parts start on 64-byte boundaries so a reinterpreting view is aligned for any dtype.
    return (n + to - 1) // to * to


def pack_reference(w: ExpertWeights, dtype: torch.dtype) -> tuple[torch.Tensor, tuple[Part, ...]]:
    """Pack an expert's tensors back to back in `dtype` into one uint8 blob."""
    parts, offset = [], 0
    for name, t in w.tensors().items():
        parts.append(Part(name, offset, tuple(t.shape), dtype))
        offset = _align(offset + parts[-1].nbytes)
    blob = torch.empty(offset, dtype=torch.uint8)
    for part, t in zip(parts, w.tensors().values()):
        blob[part.offset:part.offset + part.nbytes].view(dtype).view(part.shape).copy_(t)
    return blob, tuple(parts)


def unpack_reference(blob: torch.Tensor, parts: tuple[Part, ...]) -> ExpertWeights:
    """Views into `blob` (no copy): the device-side decode of the reference precision."""
    return ExpertWeights(**{p.name: blob[p.offset:p.offset + p.nbytes].view(p.dtype).view(p.shape)
                            for p in parts})


Decoder = Callable[[torch.Tensor, int, int, int], ExpertWeights]


class HostStore:
    """Blobs by (layer, expert, bits) on the host, and the decoder for each precision."""

    def __init__(self, blobs: dict[tuple[int, int, int], torch.Tensor], decoders: dict[int, Decoder],
                 compute_dtype: torch.dtype):
        self._blobs = blobs
        self._decoders = decoders
        self.compute_dtype = compute_dtype
        self.bits = tuple(sorted(decoders, reverse=True))
        self._slot_bytes = {b: max(v.numel() for (_, _, bb), v in blobs.items() if bb == b) for b in self.bits}
        self._pinned_layers: set[int] = set()

    @classmethod
    def from_experts(cls, experts: HostExperts, dtype: torch.dtype) -> "HostStore":
        """A reference-precision store built in memory from the checkpoint's experts."""
        blobs: dict[tuple[int, int, int], torch.Tensor] = {}
        layouts: dict[tuple[int, int], tuple[Part, ...]] = {}
        for g in experts.geometry.layers:
            for e in range(g.num_experts):
                blobs[g.index, e, REFERENCE_BITS], layouts[g.index, e] = pack_reference(experts.get(g.index, e), dtype)

        def decode(blob: torch.Tensor, layer: int, expert: int, bits: int) -> ExpertWeights:
            return unpack_reference(blob, layouts[layer, expert])

        return cls(blobs, {REFERENCE_BITS: decode}, dtype)

    @classmethod
    def from_bundle(cls, bundle, dtype: torch.dtype) -> "HostStore":
        """A store over a verified, memory-mapped bundle (`quant.bundle.Bundle.open`)."""
        from moetool.quant.format import dequantize_into, empty_weights

        blobs = {(e.layer, e.expert, e.bits): bundle.blob(e.layer, e.expert, e.bits) for e in bundle.manifest.entries}
        scratch: dict[tuple[str, str], ExpertWeights] = {}  # (layout, device) -> preallocated output

        def decode(blob: torch.Tensor, layer: int, expert: int, bits: int) -> ExpertWeights:
            entry = bundle.entry(layer, expert, bits)
            key = (entry.layout, str(blob.device))
            if key not in scratch:
                scratch[key] = empty_weights(bundle.layout(entry), dtype, blob.device)
            # One buffer per layout is safe: experts of a layer run one after another on one stream.
            return dequantize_into(blob, bundle.layout(entry), scratch[key])

        return cls(blobs, {int(b): decode for b in bundle.manifest.bits}, dtype)

    def slot_bytes(self, bits: int) -> int:
        return self._slot_bytes[bits]

    def blob(self, layer: int, expert: int, bits: int) -> torch.Tensor:
        if torch.cuda.is_available() and layer not in self._pinned_layers:
            self._pin_layer(layer)
        return self._blobs[layer, expert, bits]

    def decode(self, blob: torch.Tensor, layer: int, expert: int, bits: int) -> ExpertWeights:
        """Weights of the expert whose blob is `blob` (on any device), in the compute dtype."""
        w = self._decoders[bits](blob, layer, expert, bits)
        if w.gate_up.dtype != self.compute_dtype:
            w = w.to(w.gate_up.device, self.compute_dtype)
        return w

    def _pin_layer(self, layer: int) -> None:
        # Pinned (page-locked) host memory is what lets a copy stream overlap with compute.
        for key in [k for k in self._blobs if k[0] == layer]:
            self._blobs[key] = self._blobs[key].pin_memory()
        self._pinned_layers.add(layer)
