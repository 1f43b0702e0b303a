"""Residency: the one owner of what is on the device — slots per precision pool, their per-layer
quotas, their eviction orders, and the table of copies (resident or in flight).

A policy declares its pools once (`Policy.pools`: bits, slots, quota per layer, eviction order) and
answers once per layer with a plan; the residency does the rest. `make_room` is the generic
admission rule (quota, then the pool's eviction order, never a shielded expert); a policy whose
paper has its own rule (DyMoE's no-duplication and promotion, DynaExq's target set, Fate's INT2
pool) wraps it in `Policy.admit`. Pools and staging buffers are carved from the budget once, at
start: the hot path only moves slots between a free list and the table, so there is no allocator
churn and the budget cannot be exceeded. A copy in flight is LOADING until its event has completed;
only RESIDENT copies serve plans (DynaExq's invariant: the forward reads only fully materialized
versions).

    residency = Residency(store, [Pool(bits=16, slots=8, quota={0: 4, 1: 4})], Budget(1 << 30), torch.device("cpu"))
    victims = residency.make_room(Fetch(0, 5, 16), shield=set(), demand=True)
    handle, dst = residency.begin_load(Fetch(0, 5, 16), victims, prefetched=False)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import torch

from moetool.engine.budget import STAGING_SLOTS, Budget, BudgetExceeded
from moetool.engine.store import HostStore
from moetool.errors import MoetoolError
from moetool.policies.base import Fetch, Key, Pool
from moetool.policies.eviction import EVICTIONS, Eviction

class State(IntEnum):
    LOADING = 1
    RESIDENT = 2


@dataclass
class Handle:
    """One device copy of (layer, expert) at `bits`: in `slot` of that precision's pool, or, for a
    demand load the policy did not admit, in a staging buffer (`staged`) and dropped after use."""

    slot: int | None  # None: staged
    state: State = State.LOADING
    event: Any = None  # torch.cuda.Event or None
    ready_at: float = 0.0  # simulated completion time
    prefetched: bool = False  # brought in ahead of use; counted as used on its first hit
    seq: int = 0  # the order its copy was issued in (copies run in order on one stream): compute order
    data: torch.Tensor | None = field(default=None, repr=False)  # a staged copy's bytes, once its copy started

    @property
    def staged(self) -> bool:
        return self.slot is None


@dataclass
class _PoolState:
    """One precision's physical slots and its logical eviction orders."""

    spec: Pool
    slots: torch.Tensor  # [n, slot bytes] uint8
    free: list[int]  # free slot indices, next one last
    holders: dict[Key, None]  # keys holding a slot (resident or loading), in admission order
    orders: dict[int | None, Eviction]  # scope (layer, or None for a global pool) -> eviction order
    # layer -> its keys among `holders`, in admission order: a layer's admission reads its own, not the
    # pool's (a pass over 3,712 slots an admission at DeepSeek-V3's 58 x 256 experts, 25%)
    by_layer: dict[int, dict[Key, None]] = field(default_factory=dict)


class Residency:
    """Implements the policies' read-only `CacheView`, admission (`make_room`), and the slot table."""

    def __init__(self, store: HostStore, pools: list[Pool], budget: Budget, device: torch.device,
                 staged: tuple[int, ...] | None = None):
        """`staged`: the precisions given staging buffers (the policy's `bits_in_use`; None: every stored one)."""
        self.store, self.budget, self.device = store, budget, torch.device(device)
        self.staging: dict[int, torch.Tensor] = {}
        self._staging_next: dict[int, int] = {}
        for bits in store.bits if staged is None else staged:
            n = STAGING_SLOTS * store.slot_bytes(bits)
            if not budget.try_reserve(n):
                raise MoetoolError(f"the expert budget cannot hold even the {STAGING_SLOTS} staging buffers of "
                                   f"{bits}-bit experts ({n} B); raise --budget.")
            self.staging[bits] = torch.empty(STAGING_SLOTS, store.slot_bytes(bits), dtype=torch.uint8, device=device)
            self._staging_next[bits] = 0
        self.pools: dict[int, _PoolState] = {}
        for spec in pools:
            if spec.slots <= 0:
                continue
            if spec.bits not in store.bits:
                raise MoetoolError(f"the policy wants a {spec.bits}-bit cache, but the experts it runs from are "
                                   f"stored at {list(store.bits)} bits only; give a --bundle made with `moetool "
                                   f"quantize --bits {spec.bits}`.")
            if spec.eviction is not None and spec.eviction not in EVICTIONS:
                raise MoetoolError(f"unknown eviction '{spec.eviction}' (known: {', '.join(sorted(EVICTIONS))}).")
            if not budget.try_reserve(need := spec.slots * store.slot_bytes(spec.bits)):  # a policy's pools() past it
                raise MoetoolError(f"the policy's {spec.bits}-bit pool of {spec.slots} slots needs {need} B, and the "
                                   f"expert budget has {budget.total - budget.used} B left: its pools() must fit the "
                                   "cache bytes it is given (ctx.cache_bytes).")
            self.pools[spec.bits] = _PoolState(
                spec=spec, free=list(range(spec.slots - 1, -1, -1)), holders={}, orders={},
                slots=torch.empty(spec.slots, store.slot_bytes(spec.bits), dtype=torch.uint8, device=device))
        self.table: dict[tuple[int, int, int], Handle] = {}  # (layer, expert, bits) -> the copy
        self._in_flight: set[tuple[int, int, int]] = set()  # LOADING keys: what a layer start may publish
        self._reads_scores = any(p.spec.eviction and EVICTIONS[p.spec.eviction].reads_scores
                                 for p in self.pools.values())
        self._ordered: set[tuple[int, int, int]] = set()  # keys an eviction order holds
        # Brought in ahead of use and not referenced yet: for a pool with `prefetch_is_reference`, the
        # admission stood for the first reference (otherwise ARC would put every prefetched expert in
        # its frequency list T2 on first use).
        self._fresh: set[tuple[int, int, int]] = set()
        # (layer, expert, bits, slot or -1) as copies become usable or leave, for a device-side copy of
        # the table (`engine/captured.py`'s slot table); None: nobody keeps one.
        self.changes: list[tuple[int, int, int, int]] | None = None

    # -- CacheView (what policies read) -------------------------------------------------------
    def resident_bits(self, layer: int, expert: int) -> tuple[int, ...]:
        return tuple(b for b in self.pools if (h := self.table.get((layer, expert, b))) and h.state == State.RESIDENT)

    def loading_bits(self, layer: int, expert: int) -> tuple[int, ...]:
        return tuple(b for b in self.pools if (h := self.table.get((layer, expert, b))) and h.state == State.LOADING)

    def residents(self, bits: int, layer: int | None = None) -> list[Key]:
        """Every key holding a slot at `bits` (resident or still loading), oldest admission first; `layer`'s alone
        if given (read from its own list, not a pass over the pool)."""
        pool = self.pools.get(bits)
        if pool is None:
            return []
        return list(pool.holders) if layer is None else list(pool.by_layer.get(layer, ()))

    def capacity(self, bits: int) -> int:
        pool = self.pools.get(bits)
        return pool.spec.slots if pool else 0

    def free(self, bits: int) -> int:
        pool = self.pools.get(bits)
        return len(pool.free) if pool else 0

    # -- admission ------------------------------------------------------------------------------
    def order(self, bits: int, layer: int) -> Eviction:
        """The eviction order that ranks `layer`'s experts in the `bits` pool (per layer when the pool
        has quotas, so ARC's adaptation and LRU recency stay per layer; else one for the pool)."""
        pool = self.pools[bits]
        scope = layer if pool.spec.quota is not None else None
        if scope not in pool.orders:
            pool.orders[scope] = EVICTIONS[pool.spec.eviction](**pool.spec.eviction_options)
        return pool.orders[scope]

    def make_room(self, want: Fetch, shield: set[Key], demand: bool) -> list[Fetch] | None:
        """The generic rule: victims so that `want` fits ([] if it fits already), or None to not cache it.

        Within the layer's quota (or the whole pool without quotas) a free slot is taken; otherwise the
        pool's eviction order picks a victim among the unshielded holders of the layer (of the pool when
        the layer is under its quota but the pool is full), never a copy still in flight. The order is
        told in the sequence ARC needs: the request, the victim's removal, then the insertion. A pool
        without an eviction order only admits into free slots.
        """
        pool = self.pools.get(want.bits)
        if pool is None:
            return None
        spec, key = pool.spec, (want.layer, want.expert)
        if spec.eviction is None:
            return [] if pool.free else None
        limit = spec.quota.get(want.layer, 0) if spec.quota is not None else spec.slots
        if limit <= 0:
            return None
        order = self.order(want.bits, want.layer)
        if spec.quota is not None:
            mine = list(pool.by_layer.get(want.layer, ()))
            if len(mine) < limit and pool.free:
                candidates = None
            else:
                candidates = mine if len(mine) >= limit else list(pool.holders)
        else:
            candidates = None if pool.free else list(pool.holders)
        victims = []
        if candidates is not None:
            # Only a RESIDENT copy is a victim: one in flight has already spent its bytes and link
            # time and would be dropped unused (a layer's prefetches beyond its quota evicted one
            # another), its slot still being written. None when only such copies are left: a demand
            # load then streams through a staging buffer, a prefetch is skipped; the pool never grows.
            candidates = [k for k in candidates if k not in shield and self._settled((*k, want.bits))]
            if not candidates:
                return None  # refused before the order hears of it: ARC adapts only to admitted misses
        order.request(key)
        if candidates is not None:
            victim = order.victim(candidates)
            if victim not in candidates:  # a registered order's bug: it would evict a copy in flight or in use
                raise MoetoolError(f"eviction order '{spec.eviction}' chose {victim} as the victim, which is not one of "
                                   "the candidates it was given (the resident, unshielded copies it may evict): a bug "
                                   "in its victim().")
            self._forget((*victim, want.bits))
            victims.append(Fetch(victim[0], victim[1], want.bits))
        order.insert(key)
        self._ordered.add((*key, want.bits))
        if spec.prefetch_is_reference and not demand:
            self._fresh.add((*key, want.bits))
        return victims

    def tracks_use(self) -> bool:
        """Whether `used` has anything to tell: some eviction order holds a key (not so for a resident
        or static policy, whose pools need no order)."""
        return bool(self._ordered)

    def used(self, layer: int, experts: list[tuple[int, int, bool]]) -> None:
        """After a layer ran: (expert, bits, was_hit) of every expert it used on the device."""
        if not self._ordered:
            return  # no eviction order holds anything: nothing to tell
        for e, bits, hit in experts:
            pool = self.pools.get(bits)
            if pool is None or pool.spec.eviction is None:
                continue
            key = (layer, e, bits)
            if key in self._fresh:
                self._fresh.discard(key)
            elif hit:
                self.order(bits, layer).touch((layer, e))

    def observe(self, layer: int, scores: torch.Tensor) -> None:
        """Give every eviction order that ranks by router scores this layer's mean scores [E] (SMoE eq. 3)."""
        for bits in self.pools:
            if self.pools[bits].spec.eviction is not None:
                order = self.order(bits, layer)
                if hasattr(order, "observe"):
                    order.observe(layer, scores)

    def wants_scores(self) -> bool:
        """Whether some pool's eviction order ranks by router scores (then the engine calls `observe`)."""
        return self._reads_scores

    def _settled(self, key: tuple[int, int, int]) -> bool:
        """Whether `key`'s copy has been published (not LOADING): the only kind an eviction may take."""
        h = self.table.get(key)
        return h is not None and h.state == State.RESIDENT

    def _forget(self, key: tuple[int, int, int]) -> None:
        """Take `key` out of its eviction order (once) and out of the fresh set."""
        self._fresh.discard(key)
        if key in self._ordered:
            self._ordered.discard(key)
            self.order(key[2], key[0]).remove(key[:2])

    # -- the slot table ----------------------------------------------------------------------------
    def get(self, layer: int, expert: int, bits: int) -> Handle | None:
        return self.table.get((layer, expert, bits))

    def check_victims(self, policy: str, want: Fetch, victims: list[Fetch], shield: set[Key]) -> None:
        """One sentence for victims a policy's `admit` may not give: a copy not held at its bits, a copy of an
        expert the layer uses now (`shield`; only the expert's own other copy, as DyMoE's promotion evicts
        its low one), a copy in flight (the same exception), or too few to leave `want` a slot."""
        for v in victims:
            own = (v.layer, v.expert) == (want.layer, want.expert) and v.bits != want.bits
            why = ("which is not held at those bits" if self.get(v.layer, v.expert, v.bits) is None else
                   "an expert the layer is using now (in the shield)" if (v.layer, v.expert) in shield and not own else
                   "a copy still in flight" if not own and not self._settled((v.layer, v.expert, v.bits)) else None)
            if why:
                raise MoetoolError(f"policy '{policy}' admit() gave ({v.layer}, {v.expert}) at {v.bits} bits as a victim "
                                   f"for ({want.layer}, {want.expert}) at {want.bits} bits, {why}: a bug in its admit().")
        pool = self.pools.get(want.bits)
        if pool is None or len(pool.free) + sum(v.bits == want.bits for v in victims) < 1:
            raise MoetoolError(f"policy '{policy}' admitted ({want.layer}, {want.expert}) at {want.bits} bits without "
                               f"making room ({'no pool of those bits' if pool is None else 'no free slot and no victim'}): "
                               "a bug in its admit() (return None to not cache it).")

    def begin_load(self, want: Fetch, victims: list[Fetch], *, prefetched: bool = False) -> tuple[Handle, torch.Tensor]:
        """Evict `victims`, take a free slot for `want`; the caller copies into the returned view."""
        for v in victims:
            self.evict(v.layer, v.expert, v.bits)
        pool = self.pools.get(want.bits)
        if pool is None or not pool.free:
            raise BudgetExceeded(f"no free {want.bits}-bit slot for ({want.layer}, {want.expert}): the policy did "
                                 "not make room")
        handle = Handle(slot=pool.free.pop(), prefetched=prefetched)
        self.table[want.layer, want.expert, want.bits] = handle
        self._in_flight.add((want.layer, want.expert, want.bits))
        pool.holders[want.layer, want.expert] = None
        pool.by_layer.setdefault(want.layer, {})[want.layer, want.expert] = None
        return handle, pool.slots[handle.slot]

    def staging_slot(self, bits: int) -> torch.Tensor:
        if bits not in self.staging:  # a policy asked for a precision outside its `bits_in_use`
            raise RuntimeError(f"no staging buffer for {bits}-bit experts: the policy's bits_in_use() "
                               f"{tuple(self.staging)} leaves them out")
        i = self._staging_next[bits]
        self._staging_next[bits] = (i + 1) % STAGING_SLOTS
        return self.staging[bits][i]

    def publish(self, layer: int, expert: int, bits: int) -> None:
        handle = self.table[layer, expert, bits]
        handle.state = State.RESIDENT
        self._in_flight.discard((layer, expert, bits))
        if self.changes is not None:
            self.changes.append((layer, expert, bits, handle.slot))

    def loading(self) -> list[tuple[tuple[int, int, int], Handle]]:
        """The copies still in flight (a few per layer, not the whole table)."""
        return [(key, self.table[key]) for key in self._in_flight]

    def evict(self, layer: int, expert: int, bits: int) -> None:
        self._forget((layer, expert, bits))
        self._in_flight.discard((layer, expert, bits))
        handle = self.table.pop((layer, expert, bits), None)
        if handle is None:
            return
        if self.changes is not None:
            self.changes.append((layer, expert, bits, -1))
        pool = self.pools[bits]
        del pool.holders[layer, expert]
        del pool.by_layer[layer][layer, expert]
        pool.free.append(handle.slot)

    def pool_bytes(self, bits: int) -> torch.Tensor:
        """The `bits` pool's slots, [slots, slot bytes] uint8: what a grouped GEMM reads in place."""
        return self.pools[bits].slots

    def data(self, bits: int, handle: Handle) -> torch.Tensor:
        """The bytes of a copy: its slot, or its staging buffer."""
        if handle.staged:
            return handle.data
        return self.pools[bits].slots[handle.slot][: self.store.slot_bytes(bits)]
