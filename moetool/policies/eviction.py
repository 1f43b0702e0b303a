"""Eviction orders for expert pools: small classes behind one interface, chosen by name.

An eviction order only orders keys; the residency (`engine/residency.py`) decides scope (per layer
or global) and capacity, and tells the order about requests, hits, inserts and removals. The
general orders live here; a paper's own order lives in its file and registers itself (SMoE eq. 3's
`score` order in `policies/smoe.py`).

    order = EVICTIONS["lru"]()
    order.insert((3, 7)); order.touch((3, 7)); order.victim([(3, 7), (3, 1)])
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, ClassVar

import torch

from moetool.policies.base import Key


class Eviction:
    """Interface: keep track of keys and pick a victim among candidates (never empty).

    Candidates may include keys this order never saw (another layer's, when a layer under its quota
    takes a slot from a full pool): an order ranks what it knows and falls back to the first.
    """

    reads_scores: ClassVar[bool] = False  # wants each layer's mean router scores (`observe`)

    def observe(self, layer: int, scores: torch.Tensor) -> None:
        """This forward's mean router scores [E] of `layer` (only for orders with `reads_scores`)."""

    def request(self, key: Key) -> None:
        """`key` missed and is about to be admitted (ARC adapts its target before choosing a victim)."""

    def touch(self, key: Key) -> None:
        """`key` was used while resident (a hit)."""

    def insert(self, key: Key) -> None:
        """`key` became resident."""

    def remove(self, key: Key) -> None:
        """`key` left the cache (evicted by this order or by anyone else)."""

    def victim(self, candidates: list[Key]) -> Key:
        raise NotImplementedError


EVICTIONS: dict[str, Callable[[], Eviction]] = {}


def register_eviction(name: str) -> Callable[[type[Eviction]], type[Eviction]]:
    def deco(cls: type[Eviction]) -> type[Eviction]:
        EVICTIONS[name] = cls
        return cls
    return deco


@register_eviction("lru")
class LRU(Eviction):
    """Least recently used first (mixtral-offloading's per-layer expert cache)."""

    def __init__(self) -> None:
        self.order: OrderedDict[Key, None] = OrderedDict()  # oldest first

    def touch(self, key: Key) -> None:
        if key in self.order:
            self.order.move_to_end(key)

    def insert(self, key: Key) -> None:
        self.order[key] = None
        self.order.move_to_end(key)

    def remove(self, key: Key) -> None:
        self.order.pop(key, None)

    def victim(self, candidates: list[Key]) -> Key:
        allowed = set(candidates)
        for key in self.order:
            if key in allowed:
                return key
        return candidates[0]  # a candidate this order never saw


@register_eviction("lfu")
class LFU(Eviction):
    """Least frequently used first; ties broken by least recent use."""

    def __init__(self) -> None:
        self.count: dict[Key, int] = {}
        self.last: dict[Key, int] = {}
        self.clock = 0

    def _bump(self, key: Key) -> None:
        self.clock += 1
        self.count[key] = self.count.get(key, 0) + 1
        self.last[key] = self.clock

    def touch(self, key: Key) -> None:
        self._bump(key)

    def insert(self, key: Key) -> None:
        self._bump(key)

    def remove(self, key: Key) -> None:
        # Frequencies survive eviction: an expert that comes back is still known to be popular.
        pass

    def victim(self, candidates: list[Key]) -> Key:
        return min(candidates, key=lambda k: (self.count.get(k, 0), self.last.get(k, 0)))


@register_eviction("arc")
class ARC(Eviction):
    """Adaptive Replacement Cache (Megiddo & Modha, FAST 2003), Fate's per-layer eviction.

    T1 holds resident keys referenced once recently, T2 those referenced at least twice; B1/B2 are
    ghosts (keys only) of what was evicted from T1/T2; `p` is the adaptive target size of T1. Cases
    I-IV below are the paper's. ARC must see the incoming key before it picks a victim (cases II/III
    move `p`, and REPLACE breaks the tie |T1| = p by whether the key is in B2): the residency calls
    `request(key)` on a miss, then `victim`, `remove(victim)`, `insert(key)`. An `insert` that was not
    announced runs `request` itself.

    The registry builds orders without the pool's size, so the capacity `c` is learned as the most
    keys ever resident at once (a pool only evicts when full, so this is its size) unless given.
    """

    def __init__(self, c: int = 0):
        self.c = c
        self.p = 0.0
        self.t1: OrderedDict[Key, None] = OrderedDict()  # LRU first, MRU last (all four lists)
        self.t2: OrderedDict[Key, None] = OrderedDict()
        self.b1: OrderedDict[Key, None] = OrderedDict()
        self.b2: OrderedDict[Key, None] = OrderedDict()
        self._seen = 0  # most keys resident at once
        self._pending: Key | None = None  # announced by request(), not yet inserted
        self._drop: Key | None = None  # case IV.A with |T1| = c: this victim leaves without a ghost

    def capacity(self) -> int:
        return self.c or self._seen

    def touch(self, key: Key) -> None:
        # Case I: a hit moves the key to the MRU end of T2.
        if key in self.t1:
            del self.t1[key]
            self.t2[key] = None
        elif key in self.t2:
            self.t2.move_to_end(key)

    def request(self, key: Key) -> None:
        """A miss on `key`: adapt `p` (cases II, III) or trim the ghosts (case IV) before REPLACE."""
        if key in self.t1 or key in self.t2:
            return
        c = self.capacity()
        if key in self.b1:  # Case II: a ghost hit in B1 says T1 was too small
            delta = 1.0 if len(self.b1) >= len(self.b2) else len(self.b2) / len(self.b1)
            self.p = min(float(c), self.p + delta)
        elif key in self.b2:  # Case III: a ghost hit in B2 says T2 was too small
            delta = 1.0 if len(self.b2) >= len(self.b1) else len(self.b1) / len(self.b2)
            self.p = max(0.0, self.p - delta)
        elif c:  # Case IV: a key ARC has never seen (or forgot)
            l1 = len(self.t1) + len(self.b1)
            total = l1 + len(self.t2) + len(self.b2)
            if l1 >= c:  # IV.A
                if len(self.t1) < c:
                    if self.b1:
                        self.b1.popitem(last=False)
                else:
                    self._drop = next(iter(self.t1))  # B1 is empty: T1's LRU page is deleted outright
            elif total >= 2 * c and self.b2:  # IV.B (|L1| < c <= |L1|+|L2|): drop B2's LRU if the directory is full
                self.b2.popitem(last=False)
        self._pending = key

    def victim(self, candidates: list[Key]) -> Key:
        allowed = set(candidates)
        if self._drop is not None and self._drop in allowed:
            return self._drop
        # REPLACE(x, p): evict from T1 if |T1| > p, or |T1| = p and x is a B2 ghost; else from T2.
        x = self._pending
        from_t1 = len(self.t1) >= 1 and (len(self.t1) > self.p or (x in self.b2 and len(self.t1) == self.p))
        for lst in ((self.t1, self.t2) if from_t1 else (self.t2, self.t1)):
            for key in lst:
                if key in allowed:
                    return key
        return candidates[0]  # a candidate this order never saw

    def remove(self, key: Key) -> None:
        if key in self.t1:
            del self.t1[key]
            if key != self._drop:
                self.b1[key] = None
        elif key in self.t2:
            del self.t2[key]
            self.b2[key] = None
        if key == self._drop:
            self._drop = None
        self._trim()

    def insert(self, key: Key) -> None:
        if key != self._pending:
            self.request(key)
        self._pending = self._drop = None
        if key in self.t1 or key in self.t2:
            self.touch(key)
        elif key in self.b1 or key in self.b2:  # cases II/III end: the key comes back into T2
            self.b1.pop(key, None)
            self.b2.pop(key, None)
            self.t2[key] = None
        else:  # case IV end: into T1
            self.t1[key] = None
        self._seen = max(self._seen, len(self.t1) + len(self.t2))

    def _trim(self) -> None:
        """Keep |T1|+|B1| <= c and the directory <= 2c when keys leave behind ARC's back (a no-op in the
        paper's own flow)."""
        c = self.capacity()
        if not c:
            return
        while self.b1 and len(self.t1) + len(self.b1) > c:
            self.b1.popitem(last=False)
        while (self.b1 or self.b2) and len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) > 2 * c:
            (self.b2 or self.b1).popitem(last=False)
