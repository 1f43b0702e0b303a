"""Shared helpers of the policy tests: the engine's real residency over a tiny host store, and
hand-made read-only views for plan-only tests.

`residency_for(policy)` builds the real `Residency` over the policy's pools and a host store of
small byte blobs; `load` does what the engine does with an admission (evict the victims, take the
slot, publish). `FakeCache` stands in for the read-only `ResidencyView` protocol where a test only
plans; `make_view` / `make_ctx` build the `LayerView` / `EngineContext` a policy is given. A test
file binds its own defaults with `functools.partial`.
"""

import torch

from moetool.engine.residency import Budget, Residency
from moetool.engine.store import HostStore
from moetool.policies.base import EngineContext, LayerView, Phase, Step

BYTES = {16: 1600, 8: 800, 4: 400, 2: 200}


def residency_for(policy, pools=None):
    """The engine's `Residency` over `policy.pools()` (or `pools`), blobs of BYTES[bits] bytes."""
    ctx = policy.ctx
    sizes = {(layer, e, b): BYTES[b] for layer in ctx.moe_layers for e in range(ctx.num_experts)
             for b in ctx.available_bits}
    store = HostStore(lambda layer, e, b: torch.zeros(BYTES[b], dtype=torch.uint8), sizes,
                      {b: None for b in ctx.available_bits}, torch.float32)
    return Residency(store, policy.pools() if pools is None else pools, Budget(1 << 40), torch.device("cpu"))


def load(policy, res, want, shield=(), demand=True, publish=True):
    """What the engine does for one load: ask `policy.admit`, then evict, take the slot and (once the
    copy landed) publish. Returns the victims (None: not admitted)."""
    victims = policy.admit(want, res, set(shield), demand)
    if victims is not None:
        res.begin_load(want, victims, prefetched=not demand)
        if publish:
            res.publish(want.layer, want.expert, want.bits)
    return victims


class FakeCache:
    """Test double of the engine's read-only ResidencyView: what is held per bits, resident or in flight."""

    def __init__(self, pools):
        self.cap = {p.bits: p.slots for p in pools} if isinstance(pools, list) else dict(pools)
        self.held = {b: {} for b in self.cap}  # bits -> {(layer, expert): resident?}

    def resident_bits(self, layer, expert):
        return tuple(b for b, h in self.held.items() if h.get((layer, expert)) is True)

    def loading_bits(self, layer, expert):
        return tuple(b for b, h in self.held.items() if h.get((layer, expert)) is False)

    def residents(self, bits, layer=None):
        return [k for k in self.held.get(bits, {}) if layer is None or k[0] == layer]

    def capacity(self, bits):
        return self.cap.get(bits, 0)

    def free(self, bits):
        return self.cap.get(bits, 0) - len(self.held.get(bits, {}))

    def put(self, layer, expert, bits, loading=False):
        self.held[bits][layer, expert] = not loading

    def publish(self, layer, expert, bits):  # the copy's event completed
        self.held[bits][layer, expert] = True


def make_ctx(layers=(0, 1), E=8, k=2, cache_bytes=10_000, hw=None):
    return EngineContext(moe_layers=tuple(layers), num_experts=E, top_k=k, expert_bytes=BYTES,
                         cache_bytes=cache_bytes, available_bits=(16, 8, 4, 2), hw=hw or {})


def make_view(idx, cache, *, layer=None, pos=0, E=None, phase=Phase.DECODE, weights=None, weight=0.5,
              logits=None, importance=None, predict=None):
    """A LayerView of routing `idx` [T][k]. `layer` defaults to `pos`; `E` to the logits' width, else 8;
    the weights to `weight` in every slot; the logits to zeros; `predict` to no look-ahead."""
    idx = torch.tensor(idx)
    T = idx.shape[0]
    if E is None:
        E = logits.shape[1] if logits is not None else 8
    return LayerView(layer=pos if layer is None else layer, moe_pos=pos, num_experts=E,
                     step=Step(0, phase, T), top_k_index=idx,
                     top_k_weights=weights if weights is not None else torch.full(idx.shape, weight),
                     router_logits=logits if logits is not None else torch.zeros(T, E), residency=cache,
                     predict=predict or (lambda later: None), token_importance=importance)
