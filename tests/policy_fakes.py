"""Shared helpers of the policy tests: hand-made test doubles of the engine's read-only views.

`FakeCache` stands in for the `CacheView` protocol and `make_view` / `make_ctx` build the
`LayerView` / `EngineContext` a policy is given; they are inputs written by hand, not fake
systems. The few mutators (`put`, `apply`, `start`, `publish`) only let a test say what the engine
would have done between two calls. A test file binds its own defaults with `functools.partial`.
"""

import torch

from moetool.policies.base import EngineContext, LayerView, Phase, Step

BYTES = {16: 1600, 8: 800, 4: 400, 2: 200}


class FakeCache:
    """Test double of the engine's read-only CacheView: what is held per bits, resident or in flight."""

    def __init__(self, capacity):
        self.cap = dict(capacity)
        self.held = {b: {} for b in capacity}  # bits -> {(layer, expert): resident?}

    def resident_bits(self, layer, expert):
        return tuple(b for b, h in self.held.items() if h.get((layer, expert)) is True)

    def loading_bits(self, layer, expert):
        return tuple(b for b, h in self.held.items() if h.get((layer, expert)) is False)

    def residents(self, bits):
        return list(self.held.get(bits, {}))

    def capacity(self, bits):
        return self.cap.get(bits, 0)

    def free(self, bits):
        return self.cap.get(bits, 0) - len(self.held.get(bits, {}))

    def put(self, layer, expert, bits, loading=False):
        self.held[bits][layer, expert] = not loading

    def apply(self, victims, want):  # what the engine does with make_room's answer
        for v in victims:
            self.held[v.bits].pop((v.layer, v.expert), None)
        self.put(want.layer, want.expert, want.bits)

    def start(self, victims, want):  # the engine: evict the victims, start the copy (in flight)
        for v in victims:
            self.held[v.bits].pop((v.layer, v.expert), None)
        self.put(want.layer, want.expert, want.bits, loading=True)

    def publish(self, layer, expert, bits):  # the copy's event completed
        self.held[bits][layer, expert] = True


def make_ctx(layers=(0, 1), E=8, k=2, cache_bytes=10_000, hw=None):
    return EngineContext(moe_layers=tuple(layers), num_experts=E, top_k=k, expert_bytes=BYTES,
                         cache_bytes=cache_bytes, available_bits=(16, 8, 4, 2), hw=hw or {})


def make_view(idx, cache, *, layer=None, pos=0, n_layers=2, E=None, phase=Phase.DECODE, weights=None, weight=0.5,
              logits=None, importance=None, predict=None):
    """A LayerView of routing `idx` [T][k]. `layer` defaults to `pos`; `E` to the logits' width, else 8;
    the weights to `weight` in every slot; the logits to zeros; `predict` to no look-ahead."""
    idx = torch.tensor(idx)
    T = idx.shape[0]
    if E is None:
        E = logits.shape[1] if logits is not None else 8
    return LayerView(layer=pos if layer is None else layer, moe_pos=pos, num_moe_layers=n_layers, num_experts=E,
                     step=Step(0, phase, T), top_k_index=idx,
                     top_k_weights=weights if weights is not None else torch.full(idx.shape, weight),
                     router_logits=logits if logits is not None else torch.zeros(T, E), cache=cache,
                     predict=predict or (lambda later: None), token_importance=importance)
