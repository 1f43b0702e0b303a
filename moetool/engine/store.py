"""Host store: every (layer, expert, bits) as one contiguous uint8 blob, plus how to read it back.

A blob is what one host-to-device copy moves. The store hands out host blobs and decodes a blob
that has landed on the device into an expert's weights, without copying the reference precision.
Host memory follows a budget (`configure_host`, on CUDA): the precisions the policy uses are pinned
lazily per layer while the budget lasts, and the rest is copied from the memory-mapped bundle
through a small pinned staging ring (MoE-Infinity's SSD tier), so a bundle larger than the
machine's memory runs. What is pinned is counted as the allocator holds it (`HostArena`), so the
budget is what the process holds.

    store = HostStore.from_experts(lm.experts, dtype=torch.float32)   # reference precision only
    blob, _ = store.source(layer=3, expert=5, bits=16); w = store.decode(blob, 3, 5, 16)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from moetool.errors import MoetoolError, size_text
from moetool.model import ExpertWeights

if TYPE_CHECKING:
    from moetool.quant.format import ExpertStack, Layout, Part

REFERENCE_BITS = 16  # the unquantized precision (bf16 in bundles; the model's dtype in memory)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _align(n: int, to: int = 64) -> int:
    # Parts start on 64-byte boundaries so a reinterpreting view is aligned for any dtype.
    return (n + to - 1) // to * to


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


PIN_CHUNK = 64 << 20  # the pinned tier's allocation unit (a power of two, see HostArena)


def held_bytes(nbytes: int, page_lock: bool) -> int:
    """What one host allocation of `nbytes` holds: torch's caching host allocator (behind
    `pin_memory`) rounds a page-locked request up to a power of two; a pageable one is held as asked."""
    return _pow2_ceil(nbytes) if page_lock else nbytes


class HostArena:
    """The pinned tier's host memory: a few large allocations, blobs placed in them back to back.

    Pinning blob by blob costs up to twice the bytes pinned (a 9.4 MB bf16 expert is held as
    16 MiB, `held_bytes`), and one page-locking call per blob; here an allocation (PIN_CHUNK, or 16
    blobs where they are larger) is a power of two where page-locked, so what the arena holds
    (`held`) is what the budget counts and never passes `capacity`. An allocation is sized by what
    is still to be placed (`want`), so a small model holds little; a chunk's tail serves the next
    layer's blobs.
    """

    def __init__(self, capacity: int, page_lock: bool):
        self.capacity, self.page_lock = capacity, page_lock
        self.held = 0
        self._chunk: torch.Tensor | None = None
        self._used = 0

    def take(self, nbytes: int, want: int) -> torch.Tensor | None:
        """A uint8 [nbytes] buffer for one blob, with `want` bytes (this one included) still to place;
        None once the capacity cannot hold it."""
        start = _align(self._used)
        if self._chunk is None or start + nbytes > self._chunk.numel():
            left = self.capacity - self.held
            # At least 16 blobs a chunk: a chunk's unused tail (under one blob) stays under 1/16 of it.
            size = max(nbytes, min(max(PIN_CHUNK, 16 * nbytes), want))
            if self.page_lock:
                size = _pow2_ceil(size)
                while size > left and size // 2 >= nbytes:
                    size //= 2
            else:
                size = min(size, left)
            if size < nbytes or size > left:
                return None
            self._chunk = torch.empty(size, dtype=torch.uint8, pin_memory=self.page_lock)  # [size]
            self.held += size
            start = 0
        self._used = start + nbytes
        return self._chunk[start:start + nbytes]


def pack_reference(w: ExpertWeights, dtype: torch.dtype) -> tuple[torch.Tensor, tuple[Part, ...]]:
    """Pack an expert's tensors back to back in `dtype` into one uint8 blob (the bundle format's parts)."""
    from moetool.quant.format import DTYPES, Part  # here: the quant package's import pulls in its backends

    parts, offset = [], 0
    dtype_name = {v: k for k, v in DTYPES.items()}[dtype]
    for name, t in w.tensors().items():
        parts.append(Part(name, offset, _numel(t.shape) * t.new_empty((), dtype=dtype).element_size(), dtype_name,
                          tuple(t.shape)))
        offset = _align(offset + parts[-1].nbytes)
    blob = torch.empty(offset, dtype=torch.uint8)
    for part, t in zip(parts, w.tensors().values()):
        blob[part.offset:part.offset + part.nbytes].view(dtype).view(part.shape).copy_(t)
    return blob, tuple(parts)


def unpack_reference(blob: torch.Tensor, parts: tuple[Part, ...]) -> ExpertWeights:
    """Views into `blob` (no copy): the device-side decode of the reference precision."""
    # A part's dtype is a key of quant.format.DTYPES, which are torch's own names.
    return ExpertWeights(**{p.name: blob[p.offset:p.offset + p.nbytes].view(getattr(torch, p.dtype)).view(p.shape)
                            for p in parts})


Decoder = Callable[[torch.Tensor, int, int, int], ExpertWeights]
Key3 = tuple[int, int, int]  # (layer, expert, bits)


class StagingRing:
    """A few host buffers that blobs outside the pinned tier are copied through on their way to the device.

    Pinned (page-locked) where CUDA exists, so the host-to-device copy is asynchronous; a slot is
    reused only after the copy that last read it has completed (its event), which costs a host wait
    only when more copies are in flight than the ring has slots.
    """

    def __init__(self, slots: int, slot_bytes: int, page_lock: bool):
        # Page-locked at allocation: pin_memory() of a pageable buffer would allocate it twice.
        self.buf = torch.empty(slots, slot_bytes, dtype=torch.uint8, pin_memory=page_lock)  # [slots, bytes]
        self.page_lock = page_lock
        self.events: list[Any] = [None] * slots
        self.next = 0

    @property
    def nbytes(self) -> int:
        """What the ring holds, as the allocator holds it (`held_bytes`)."""
        return held_bytes(self.buf.numel(), self.page_lock)

    def stage(self, blob: torch.Tensor) -> tuple[torch.Tensor, int]:
        i = self.next
        self.next = (i + 1) % len(self.events)
        if self.events[i] is not None:
            self.events[i].synchronize()
            self.events[i] = None
        view = self.buf[i, : blob.numel()]
        view.copy_(blob)
        return view, i

    def release(self, slot: int, event: Any) -> None:
        self.events[slot] = event


class HostStore:
    """Blobs by (layer, expert, bits) on the host, and the decoder for each precision.

    Blobs are fetched lazily from their source (a memory-mapped bundle, or blobs packed in memory).
    With host tiers on (CUDA), the precisions the policy uses are pinned a layer at a time while
    the host budget lasts; every other blob reaches the device through the staging ring.
    """

    def __init__(self, fetch: Callable[[int, int, int], torch.Tensor], sizes: dict[Key3, int],
                 decoders: dict[int, Decoder], compute_dtype: torch.dtype,
                 layouts: Callable[[int, int], Layout] | None = None):
        self._fetch = fetch
        self._layouts = layouts  # (layer, bits) -> the layout every expert of the layer has at those bits
        self._layout_cache: dict[tuple[int, int], Layout] = {}
        self._is_view: dict[tuple[int, int], bool] = {}
        self._sizes = sizes
        self._decoders = decoders
        self.compute_dtype = compute_dtype
        self.bits = tuple(sorted(decoders, reverse=True))
        self._slot_bytes = {b: max(n for (_, _, bb), n in sizes.items() if bb == b) for b in self.bits}
        self._pinned: dict[Key3, torch.Tensor] = {}
        self._pinned_layers: set[int] = set()
        self._arena: HostArena | None = None
        self._to_pin: dict[int, list[tuple[Key3, int]]] = {}
        self.tiers = False
        # (layer, expert, bits) -> a pinned copy made elsewhere (the captured step's host mirrors), or None:
        # without tiers, a copy then reads it rather than the mapped file (a pageable, blocking copy)
        self.pinned_elsewhere: Any = None
        self.pin_bits: tuple[int, ...] = ()
        self.pin_capacity = 0
        self.page_lock = False
        self.ring: StagingRing | None = None
        self.pinned_bytes = 0
        self.staged_bytes = 0

    @classmethod
    def from_experts(cls, experts, dtype: torch.dtype) -> "HostStore":
        """A reference-precision store packed in memory from the checkpoint's experts, a layer at a time."""
        from moetool.quant.format import Layout, Projection

        blobs: dict[Key3, torch.Tensor] = {}
        layouts: dict[tuple[int, int], tuple[Part, ...]] = {}
        for g in experts.geometry.layers:
            rows = None  # [E, blob bytes]: a layer's blobs back to back, one row each (a host mirror's rows)
            for e in range(g.num_experts):
                blob, layouts[g.index, e] = pack_reference(experts.get(g.index, e), dtype)
                if rows is None:
                    rows = torch.empty((g.num_experts, blob.numel()), dtype=torch.uint8)
                blobs[g.index, e, REFERENCE_BITS] = rows[e].copy_(blob)
            experts.clear()  # the packed blobs are the copy now: keep one, not two

        def decode(blob: torch.Tensor, layer: int, expert: int, bits: int) -> ExpertWeights:
            return unpack_reference(blob, layouts[layer, expert])

        def layout(layer: int, bits: int) -> Layout:
            # Every expert of a layer has the same shapes, so expert 0's parts stand for the layer's.
            parts = layouts[layer, 0]
            projections = tuple(Projection(p.name, p.shape, "bf16", 0, 1) for p in parts if p.name in ("gate_up", "down"))
            return Layout(REFERENCE_BITS, blobs[layer, 0, REFERENCE_BITS].numel(), projections, parts)

        return cls(lambda layer, expert, bits: blobs[layer, expert, bits], {k: v.numel() for k, v in blobs.items()},
                   {REFERENCE_BITS: decode}, dtype, layout)

    @classmethod
    def from_bundle(cls, bundle, dtype: torch.dtype) -> "HostStore":
        """A store over a verified, memory-mapped bundle (`quant.bundle.Bundle.open`); each blob's
        checksum is checked by the bundle the first time it is read."""
        from moetool.quant.format import dequantize_into, empty_weights

        sizes = {(e.layer, e.expert, e.bits): e.nbytes for e in bundle.manifest.entries}
        scratch: dict[tuple[str, str], ExpertWeights] = {}  # (layout, device) -> preallocated output

        def decode(blob: torch.Tensor, layer: int, expert: int, bits: int) -> ExpertWeights:
            entry = bundle.entry(layer, expert, bits)
            key = (entry.layout, str(blob.device))
            if key not in scratch:
                scratch[key] = empty_weights(bundle.layout(entry), dtype, blob.device)
            # One buffer per layout is safe: experts of a layer run one after another on one stream.
            return dequantize_into(blob, bundle.layout(entry), scratch[key])

        first = {(e.layer, e.bits): e for e in reversed(bundle.manifest.entries)}  # a layout is per (layer, bits)

        def layout(layer: int, bits: int):
            return bundle.layout(first[layer, bits])

        return cls(bundle.blob, sizes, {int(b): decode for b in bundle.manifest.bits}, dtype, layout)

    def configure_host(self, *, bits: tuple[int, ...], host_budget: int, ring_slots: int, page_lock: bool) -> None:
        """Turn on host tiers: pin `bits` per layer within `host_budget`, stage the rest through a ring.

        The ring (`ring_slots` blobs of the largest used precision: one layer's demand loads for a
        token) comes off the budget first; a budget that cannot hold it is refused.
        """
        used = tuple(b for b in bits if b in self.bits) or self.bits
        slot = max(self._slot_bytes[b] for b in used)
        ring_bytes = held_bytes(ring_slots * slot, page_lock)  # as the allocator will hold it
        if host_budget < ring_bytes:
            raise MoetoolError(f"--host-budget {size_text(host_budget)} cannot hold one layer's staging ring "
                               f"({ring_slots} blobs of {max(used)} bits, {size_text(ring_bytes)}); raise it.")
        self.tiers, self.pin_bits, self.page_lock = True, used, page_lock
        self.pin_capacity = host_budget - ring_bytes
        self._arena = HostArena(self.pin_capacity, page_lock)
        self._to_pin = {}  # layer -> its blobs at the pinned precisions: a layer's pinning reads only its own
        for key, n in self._sizes.items():
            if key[2] in used:
                self._to_pin.setdefault(key[0], []).append((key, n))
        # What the tiers will hold once every layer is pinned: refused now, before the run, when the
        # machine (or this process's cgroup or ulimit -v) cannot give it, not killed or failed at a
        # layer deep into the run. A default budget is sized from the same room, less a margin.
        from moetool.model import available_memory

        hold = ring_bytes + min(self.pin_capacity, sum(n for blobs in self._to_pin.values() for _, n in blobs))
        room = available_memory()
        if hold > room:
            raise MoetoolError(f"--host-budget {size_text(host_budget)} would hold {size_text(hold)} of experts in "
                               f"host memory, more than the {size_text(room)} this process can allocate now (free "
                               "memory, less any cgroup or ulimit -v limit); give a smaller --host-budget or free "
                               "memory.")
        self.ring = StagingRing(ring_slots, slot, page_lock)

    def slot_bytes(self, bits: int) -> int:
        return self._slot_bytes[bits]

    def holds(self, layer: int, expert: int, bits: int) -> bool:
        """Whether the store has a blob for (layer, expert) at `bits`: a policy's fetch names one."""
        return (layer, expert, bits) in self._sizes

    def host(self, layer: int, expert: int, bits: int) -> torch.Tensor:
        """The blob where it lies on the host (for compute there): the pinned copy or the mapped file."""
        pinned = self._pinned.get((layer, expert, bits))
        return pinned if pinned is not None else self._fetch(layer, expert, bits)

    def source(self, layer: int, expert: int, bits: int) -> tuple[torch.Tensor, int | None]:
        """What a host-to-device copy of the blob reads: the blob, its pinned copy, or a staging-ring
        slot it was just copied into (with the slot's index, to `release` after the copy starts)."""
        if not self.tiers:
            row = self.pinned_elsewhere(layer, expert, bits) if self.pinned_elsewhere is not None else None
            return (row if row is not None else self._fetch(layer, expert, bits)), None
        if layer not in self._pinned_layers:
            self._pin_layer(layer)
        pinned = self._pinned.get((layer, expert, bits))
        if pinned is not None:
            return pinned, None
        view, slot = self.ring.stage(self._fetch(layer, expert, bits))
        self.staged_bytes += view.numel()
        return view, slot

    def release(self, slot: int | None, event: Any) -> None:
        """The copy out of ring slot `slot` has been issued; `event` marks its completion."""
        if slot is not None:
            self.ring.release(slot, event)

    def decode(self, blob: torch.Tensor, layer: int, expert: int, bits: int) -> ExpertWeights:
        """Weights of the expert whose blob is `blob` (on any device), in the compute dtype."""
        w = self._decoders[bits](blob, layer, expert, bits)
        if w.gate_up.dtype != self.compute_dtype:
            w = w.to(w.gate_up.device, self.compute_dtype)
        return w

    def decode_stack(self, parts: dict[str, torch.Tensor], layer: int, bits: int) -> ExpertStack:
        """Weights of n experts of `layer` at `bits` from their blobs' parts ([n, *shape] each, as
        `quant.format.stack_views` gives them, on any device), stacked for a grouped GEMM in the
        compute dtype (views where the blobs hold that dtype already)."""
        from moetool.quant.format import dequantize_parts

        return dequantize_parts(parts, self.layout(layer, bits), self.compute_dtype)

    def stack_is_view(self, layer: int, bits: int) -> bool:
        """Whether `decode_stack` at `bits` is a view of the blobs (the compute dtype, unquantized)."""
        from moetool.quant.format import DTYPES, PACKING_BY_NAME

        key = (layer, bits)
        if key not in self._is_view:
            lay = self.layout(layer, bits)
            self._is_view[key] = all(p.packing not in PACKING_BY_NAME and DTYPES[lay.part(p.name).dtype] ==
                                     self.compute_dtype for p in lay.projections)
        return self._is_view[key]

    def layout(self, layer: int, bits: int) -> Layout:
        """Where each part of `layer`'s experts lies in their `bits` blobs (one layout per layer and bits)."""
        key = (layer, bits)
        if key not in self._layout_cache:
            self._layout_cache[key] = self._layouts(layer, bits)
        return self._layout_cache[key]

    def host_stats(self) -> dict[str, int | bool]:
        return {"host_tiers": self.tiers, "host_pinned_bytes": self.pinned_bytes,
                "host_pinned_held_bytes": self._arena.held if self._arena else 0,
                "host_staging_bytes": self.ring.nbytes if self.ring else 0, "host_staged_bytes": self.staged_bytes,
                "host_pin_capacity_bytes": self.pin_capacity}

    def _pin_layer(self, layer: int) -> None:
        # Pinned (page-locked) host memory is what lets a copy stream overlap with compute; only the
        # precisions the policy uses, and only while the host budget lasts (the rest is staged).
        todo = self._to_pin.get(layer, [])
        want = sum(n for _, n in todo)
        for key, n in todo:
            buf = self._arena.take(n, want)
            want -= n
            if buf is None:
                continue  # a smaller blob of another precision may still fit the arena's last chunk
            buf.copy_(self._fetch(*key))  # checksum checked here, on the first read
            self._pinned[key] = buf
            self.pinned_bytes += n
        self._pinned_layers.add(layer)
