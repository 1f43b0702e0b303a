"""Device cache: a budget tracker, fixed slot pools per precision, and the residency table.

Pools and staging buffers are carved from the budget once, at start; the hot path only moves
slots between a free list and the residency table, so there is no allocator churn and the
budget cannot be exceeded. A copy in flight is LOADING until its event has completed; only
RESIDENT copies are visible to plans (DynaExq's invariant: the forward reads only fully
materialized versions).

    cache = DeviceCache(store, {16: 8}, Budget(1 << 30), torch.device("cpu"))
    h = cache.begin_load(3, 5, 16, event=None, ready_at=0.0)
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import torch

from moetool.engine.store import HostStore
from moetool.errors import MoetoolError
from moetool.policies.base import Key

STAGING_SLOTS = 2  # per precision: a demand load that is not cached streams through these, double-buffered


class BudgetExceeded(RuntimeError):
    """An internal invariant broke: something asked for device bytes beyond the budget."""


class Budget:
    """Device bytes: what was promised, what is reserved, and the peak."""

    def __init__(self, total: int):
        self.total = int(total)
        self.used = 0
        self.peak = 0

    def try_reserve(self, nbytes: int) -> bool:
        if self.used + nbytes > self.total:
            return False
        self.used += nbytes
        self.peak = max(self.peak, self.used)
        return True

    def reserve(self, nbytes: int, what: str) -> None:
        if not self.try_reserve(nbytes):
            raise BudgetExceeded(f"{what} needs {nbytes} B but only {self.total - self.used} B of the budget is left")

    def release(self, nbytes: int) -> None:
        self.used -= nbytes
        assert self.used >= 0, "budget released more than it reserved"


class State(IntEnum):
    LOADING = 1
    RESIDENT = 2


@dataclass
class Handle:
    """One device copy of (layer, expert) at `bits`, in `slot` of that precision's pool."""

    slot: int
    state: State
    event: Any  # torch.cuda.Event or None
    ready_at: float  # simulated completion time
    prefetched: bool  # brought in ahead of use; counted as used on its first hit
    background: bool  # a migration: published only when complete, never waited for
    staging: torch.Tensor | None = None  # set for a demand load streamed through a staging buffer


class DeviceCache:
    """Implements the policies' read-only `CacheView` over the engine's slots."""

    def __init__(self, store: HostStore, pools: dict[int, int], budget: Budget, device: torch.device):
        self.store, self.budget, self.device = store, budget, device
        self.pool: dict[int, torch.Tensor] = {}
        self.free_slots: dict[int, list[int]] = {}
        self.staging: dict[int, torch.Tensor] = {}
        self._staging_next: dict[int, int] = {}
        for bits in store.bits:
            n = STAGING_SLOTS * store.slot_bytes(bits)
            if not budget.try_reserve(n):
                raise MoetoolError(f"the expert budget cannot hold even the {STAGING_SLOTS} staging buffers of "
                                   f"{bits}-bit experts ({n} B); raise --budget.")
            self.staging[bits] = torch.empty(STAGING_SLOTS, store.slot_bytes(bits), dtype=torch.uint8, device=device)
            self._staging_next[bits] = 0
        for bits, n in pools.items():
            if bits not in store.bits:
                raise MoetoolError(f"the policy wants a {bits}-bit cache but the bundle has only {list(store.bits)} bits.")
            budget.reserve(n * store.slot_bytes(bits), f"the {bits}-bit pool of {n} slots")
            self.pool[bits] = torch.empty(n, store.slot_bytes(bits), dtype=torch.uint8, device=device)  # [n, bytes]
            self.free_slots[bits] = list(range(n - 1, -1, -1))
        self.table: dict[tuple[int, int, int], Handle] = {}
        self._by_bits: dict[int, dict[Key, None]] = {b: {} for b in pools}

    # -- CacheView --------------------------------------------------------------------------
    def resident_bits(self, layer: int, expert: int) -> tuple[int, ...]:
        return tuple(b for b in self._by_bits if (h := self.table.get((layer, expert, b))) and h.state == State.RESIDENT)

    def loading_bits(self, layer: int, expert: int) -> tuple[int, ...]:
        return tuple(b for b in self._by_bits if (h := self.table.get((layer, expert, b))) and h.state == State.LOADING)

    def residents(self, bits: int) -> list[Key]:
        """Every key holding a slot at `bits` (resident or still loading)."""
        return list(self._by_bits.get(bits, ()))

    def capacity(self, bits: int) -> int:
        return self.pool[bits].shape[0] if bits in self.pool else 0

    def free(self, bits: int) -> int:
        return len(self.free_slots.get(bits, ()))

    # -- the engine's side ----------------------------------------------------------------------
    def get(self, layer: int, expert: int, bits: int) -> Handle | None:
        return self.table.get((layer, expert, bits))

    def begin_load(self, layer: int, expert: int, bits: int, *, prefetched: bool = False,
                   background: bool = False) -> tuple[Handle, torch.Tensor]:
        """Take a free slot for (layer, expert, bits); the caller copies into the returned view."""
        if not self.free_slots.get(bits):
            raise BudgetExceeded(f"no free {bits}-bit slot for ({layer}, {expert}): the policy did not make room")
        slot = self.free_slots[bits].pop()
        handle = Handle(slot=slot, state=State.LOADING, event=None, ready_at=0.0, prefetched=prefetched,
                        background=background)
        self.table[layer, expert, bits] = handle
        self._by_bits[bits][layer, expert] = None
        return handle, self.pool[bits][slot]

    def publish(self, layer: int, expert: int, bits: int) -> None:
        self.table[layer, expert, bits].state = State.RESIDENT

    def evict(self, layer: int, expert: int, bits: int) -> None:
        handle = self.table.pop((layer, expert, bits), None)
        if handle is None:
            return
        del self._by_bits[bits][layer, expert]
        self.free_slots[bits].append(handle.slot)

    def view(self, bits: int, handle: Handle) -> torch.Tensor:
        return self.pool[bits][handle.slot][: self.store.slot_bytes(bits)]

    def staging_slot(self, bits: int) -> torch.Tensor:
        i = self._staging_next[bits]
        self._staging_next[bits] = (i + 1) % STAGING_SLOTS
        return self.staging[bits][i]

    def occupied_bytes(self) -> int:
        return sum(len(keys) * self.store.slot_bytes(b) for b, keys in self._by_bits.items())
