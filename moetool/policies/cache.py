"""A cache component for one precision: capacity per layer (or one global pool) + an eviction order.

Presets compose it: `lru` is one per-layer LRU cache at 16 bits; Fate gives each layer its own
capacity (shallow-favoring) with ARC; DynaExq keeps one for its high-precision tier.

    cache = ExpertCache(bits=4, quota={3: 2, 4: 2}, eviction="lru")
    victims = cache.make_room(Fetch(3, 7, 4), view, shield=set())
"""

from __future__ import annotations

from moetool.policies.base import CacheView, Fetch, Key
from moetool.policies.eviction import EVICTIONS, Eviction


class ExpertCache:
    """Logical admission and eviction for one bits pool; the engine owns the physical slots.

    `quota` maps a layer to its slot count (per-layer scope, as mixtral-offloading and Fate);
    without it the pool is one global cache. Each layer gets its own eviction order object in
    per-layer scope, so ARC's adaptation and LRU recency stay per layer.
    """

    def __init__(self, bits: int, eviction: str = "lru", quota: dict[int, int] | None = None):
        self.bits = bits
        self.quota = quota
        self.eviction_name = eviction
        self._orders: dict[int | None, Eviction] = {}

    def order(self, layer: int) -> Eviction:
        scope = layer if self.quota is not None else None
        if scope not in self._orders:
            self._orders[scope] = EVICTIONS[self.eviction_name]()
        return self._orders[scope]

    def make_room(self, want: Fetch, cache: CacheView, shield: set[Key]) -> list[Fetch] | None:
        """Victims so that `want` fits, [] if it fits already, None if it should not be cached."""
        key = (want.layer, want.expert)
        if self.quota is None or self.quota.get(want.layer, 0) > 0:
            self.order(want.layer).request(key)
        if self.quota is not None:
            limit = self.quota.get(want.layer, 0)
            if limit <= 0:
                return None
            mine = [k for k in cache.residents(self.bits) if k[0] == want.layer]
            if len(mine) < limit and cache.free(self.bits) > 0:
                self.order(want.layer).insert(key)
                return []
            candidates = [k for k in mine if k not in shield] if len(mine) >= limit else \
                [k for k in cache.residents(self.bits) if k not in shield]
        else:
            if cache.capacity(self.bits) <= 0:
                return None
            if cache.free(self.bits) > 0:
                self.order(want.layer).insert(key)
                return []
            candidates = [k for k in cache.residents(self.bits) if k not in shield]
        if not candidates:
            return None
        victim = self.order(want.layer).victim(candidates)
        self.order(victim[0]).remove(victim)
        self.order(want.layer).insert(key)
        return [Fetch(victim[0], victim[1], self.bits)]

    def touch(self, layer: int, expert: int) -> None:
        self.order(layer).touch((layer, expert))

    def forget(self, layer: int, expert: int) -> None:
        self.order(layer).remove((layer, expert))


def even_quota(layers: tuple[int, ...], slots: int) -> dict[int, int]:
    """Split `slots` evenly over `layers`, the remainder going to the shallowest ones."""
    if not layers:
        return {}
    base, extra = divmod(slots, len(layers))
    return {layer: base + (1 if i < extra else 0) for i, layer in enumerate(layers)}
