"""Host mirrors: every expert of a MoE layer at one precision as one [E, nbytes] uint8 tensor in host
memory, the rows the captured decode step reads a missed expert from (zero-copy) and the host half
copies a slot's fill from.

On a CPU a mirror is a view: the memory-mapped bundle shard (a layer's blobs lie expert-major at a
fixed stride) or the in-memory store's rows, so it costs no memory of its own. On CUDA it is pinned
(page-locked) host memory, which a kernel reads over the bus through its host address (unified
virtual addressing) and which copies to a slot asynchronously; pinning it all must fit
`--host-budget`, else the captured step is not available and the run says so.

    mirrors = host_mirrors(lm, store, bits=(4,), device=torch.device("cpu"), host_budget=None)
    mirrors.rows(layer=3, bits=4)[7]            # expert 7's blob, uint8 [nbytes]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from moetool.engine.store import HostArena, HostStore
from moetool.errors import size_text


@dataclass
class Mirrors:
    """(layer, bits) -> [E, nbytes] uint8 rows on the host; `checked` tells which blobs passed their
    bundle checksum (a mapped mirror is checked on first use, one step behind; a pinned one as it is
    copied in)."""

    rows_by_key: dict[tuple[int, int], torch.Tensor]
    pinned: bool
    nbytes: int  # host memory the mirrors hold of their own (0 for views of a mapping or of the store)
    check: Any = None  # (layer, expert, bits) -> None, raising MoetoolError on a corrupt blob; None: checked
    checked: set[tuple[int, int, int]] = field(default_factory=set)
    pinned_bits: tuple[int, ...] = ()  # the precisions whose rows are page-locked copies

    def pinned_row(self, layer: int, expert: int, bits: int) -> torch.Tensor | None:
        """The blob's page-locked copy, or None (a view of the bundle or the store is no better a source)."""
        return self.rows_by_key[layer, bits][expert] if bits in self.pinned_bits else None

    def rows(self, layer: int, bits: int) -> torch.Tensor:
        return self.rows_by_key[layer, bits]

    def verify(self, layer: int, expert: int, bits: int) -> None:
        """A blob read in place for the first time: its checksum, once (the host half calls this)."""
        key = (layer, expert, bits)
        if self.check is not None and key not in self.checked:
            self.check(layer, expert, bits)
            self.checked.add(key)


def _strided(blobs: list[torch.Tensor]) -> torch.Tensor | None:
    """The blobs as one [E, n] view when they lie in one storage at a fixed stride, else None."""
    first = blobs[0]
    if any(b.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() for b in blobs):
        return None
    stride = blobs[1].data_ptr() - first.data_ptr() if len(blobs) > 1 else first.numel()
    if stride < first.numel() or any(b.data_ptr() - first.data_ptr() != i * stride for i, b in enumerate(blobs)):
        return None
    return first.as_strided((len(blobs), first.numel()), (stride, 1))


def host_mirrors(lm: Any, store: HostStore, bits: tuple[int, ...], device: torch.device,
                 host_budget: int | None, lifelong: tuple[int, ...] = ()) -> Mirrors | str:
    """The mirrors of every MoE layer at each of `bits`, or the reason they cannot be made. `lifelong`:
    precisions whose every expert stays on the device for the engine's life (`resident`, `static`,
    DynaExq's low tier): the step never reads their mirrors and nothing is copied from them, so they
    are views of the bundle or the store, never pinned (pinning a whole model's experts only to keep
    them made the fastest captured policies fall back on a host with less memory than the experts)."""
    layers = lm.geometry.layers
    bundle = getattr(lm, "bundle", None)
    pin = device.type == "cuda"
    need = sum(g.num_experts * store.layout(g.index, b).nbytes for g in layers for b in bits if b not in lifelong)
    pinned_bits = [b for b in bits if b not in lifelong]
    too_much = (f"pinning every expert the policy runs ({size_text(need)} at {'/'.join(map(str, pinned_bits))} bits) "
                f"exceeds --host-budget {size_text(host_budget or 0)}")
    if pin and host_budget is not None and need > host_budget:
        return too_much
    # Page-locked memory in the store's arena: a few power-of-two allocations, so what is held (torch
    # rounds each pinned allocation up to a power of two) is what the host budget counts.
    arena = HostArena(host_budget if host_budget is not None else need * 2, page_lock=True) if pin and need else None
    rows: dict[tuple[int, int], torch.Tensor] = {}
    packed, left = 0, need  # bytes copied because the blobs did not lie at a fixed stride; bytes still to pin
    for g in layers:
        for b in bits:
            n = store.layout(g.index, b).nbytes
            if bundle is not None:
                entries = [bundle.entry(g.index, e, b) for e in range(g.num_experts)]
                blobs = [bundle.shards[x.shard][x.offset:x.offset + n] for x in entries]  # views: nothing read
            else:
                blobs = [store.host(g.index, e, b)[:n] for e in range(g.num_experts)]
            view = _strided(blobs)
            if arena is not None and b not in lifelong:
                buf = arena.take(g.num_experts * n, left)
                if buf is None:
                    return too_much
                left -= g.num_experts * n
                pinned = buf.view(g.num_experts, n)
                for e in range(g.num_experts):  # each blob's checksum as it is read, then pinned
                    pinned[e].copy_(bundle.blob(g.index, e, b) if bundle is not None else blobs[e])
                rows[g.index, b] = pinned
            elif view is not None:
                rows[g.index, b] = view
            else:
                rows[g.index, b] = torch.stack(blobs)
                packed += rows[g.index, b].numel()
    check, checked = None, set()
    if bundle is not None and (arena is None or lifelong):
        check = lambda layer, e, b: bundle.blob(layer, e, b)  # noqa: E731 - the bundle's CRC-32, on first read
        if arena is not None:  # the pinned ones were checked as they were copied in
            checked = {(g.index, e, b) for g in layers for b in bits if b not in lifelong for e in range(g.num_experts)}
    return Mirrors(rows, arena is not None, (arena.held if arena is not None else 0) + packed, check, checked,
                   tuple(pinned_bits) if arena is not None else ())
