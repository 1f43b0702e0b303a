"""Quantization sensitivity: held-out perplexity when part of the experts run at low precision.

- per layer (DyMoE Fig. 5): one MoE layer's experts at INT2 (optionally INT4), every other layer at
  the checkpoint's precision; the perplexity delta per layer;
- Fate Fig. 10: every expert at INT4 except, per layer and per forward, the least popular share p of
  the experts the forward activates at INT2 (popularity counted from the forward's own routing, as
  Fate's prefill does from its predicted routing); the perplexity for each p.

Quantized weights come from a bundle, or from HQQ in memory (`MemoryQuantizer`) when none is given.
A `SwapProvider` is installed as every experts module's provider for the measurement and removed after.

    swap = SwapProvider.install(lm, MemoryQuantizer(lm))
    base = perplexity(lm, chunks); swap.bits = {3: 2}; worse = perplexity(lm, chunks); swap.remove()
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F

from moetool.errors import MoetoolError
from moetool.inference import nonfinite_sentence, not_finite
from moetool.model import ExpertWeights, LoadedModel
from moetool.policies.common import popularity
from moetool.policies.fate import int2_experts
from moetool.profile_artifact import LayerSensitivity, SensitivityProfile
from moetool.quant.format import auto_group_size

INT2_SHARES = (0.0, 0.125, 0.25, 0.375, 0.5, 0.75, 1.0)  # Fate Fig. 10's x axis, as shares
FATE_CACHE_BITS, FATE_LOW_BITS = 4, 2  # Fate §4.5: INT4 cache, INT2 for unpopular prefill experts


class QuantSource(Protocol):
    """Anything that rebuilds an expert at `bits` (an `OpenBundle`, a `MemoryQuantizer`)."""

    def dequantize(self, layer: int, expert: int, bits: int, dtype: torch.dtype = torch.float32) -> ExpertWeights: ...


class MemoryQuantizer:
    """HQQ on the checkpoint's experts in memory, on first use; keeps the packed blobs (not fp32 copies)."""

    def __init__(self, lm: LoadedModel):
        self.lm = lm
        # The group size `moetool quantize` would pick, so in-memory sensitivity matches a bundle's.
        gs = auto_group_size(lm.geometry.layers)
        self.group_size = {g.index: gs for g in lm.geometry.layers}
        self._blobs: dict[tuple[int, int, int], torch.Tensor] = {}
        self._layouts: dict[tuple[int, int], object] = {}

    def dequantize(self, layer: int, expert: int, bits: int, dtype: torch.dtype = torch.float32) -> ExpertWeights:
        from moetool.quant import hqq
        from moetool.quant.format import dequantize, encode, make_layout

        key = (layer, expert, int(bits))
        if (layer, int(bits)) not in self._layouts:
            g = self.lm.geometry.layer(layer)
            gate_up = (2 * g.intermediate_size if g.gated else g.intermediate_size, g.hidden_size)
            self._layouts[layer, int(bits)] = make_layout(bits, gate_up, (g.hidden_size, g.intermediate_size),
                                                          g.has_bias, self.group_size[layer])
        layout = self._layouts[layer, int(bits)]
        if key not in self._blobs:
            ref = self.lm.experts.get(layer, expert).to("cpu", torch.float32)
            q = None if int(bits) == 16 else hqq.quantize_expert(ref, bits, self.group_size[layer])
            self._blobs[key] = encode(layout, ref, q)  # uint8 [layout.nbytes]
        return dequantize(self._blobs[key], layout, dtype)

    def blob(self, layer: int, expert: int, bits: int) -> tuple[torch.Tensor, object]:
        """(packed blob, layout) of one expert, quantizing it if needed (for timing)."""
        self.dequantize(layer, expert, bits)
        return self._blobs[layer, expert, int(bits)], self._layouts[layer, int(bits)]


class SwapProvider:
    """Expert provider that serves chosen (layer, expert)s at low precision, the rest from `base`.

    `bits[layer]` puts a whole layer at that precision; `low[layer]` (set per forward by a hook) puts
    those experts at `low_bits` instead.
    """

    def __init__(self, lm: LoadedModel, source: QuantSource, device: torch.device, dtype: torch.dtype):
        self.lm, self.source, self.device, self.dtype = lm, source, device, dtype
        self.modules = [lm.model.get_submodule(g.path).experts for g in lm.geometry.layers]
        self.base = self.modules[0].provider
        self.bits: dict[int, int] = {}
        self.low: dict[int, set[int]] = {}
        self.low_bits = FATE_LOW_BITS
        self._hooks: list = []

    @classmethod
    def install(cls, lm: LoadedModel, source: QuantSource) -> "SwapProvider":
        p = next(lm.model.parameters())
        swap = cls(lm, source, p.device, p.dtype)
        for m in swap.modules:
            m.provider = swap
        return swap

    def get(self, layer: int, expert: int) -> ExpertWeights:
        bits = self.low_bits if expert in self.low.get(layer, ()) else self.bits.get(layer)
        if bits is None:
            return self.base.get(layer, expert)
        return self.source.dequantize(layer, expert, bits, torch.float32).to(self.device, self.dtype)

    def popularity_share(self, p: float) -> None:
        """Per forward, the least popular share p of each layer's active experts go to `low_bits` (Fate §4.5)."""
        self.clear_hooks()
        for g, m in zip(self.lm.geometry.layers, self.modules):
            def hook(module, args, kwargs, layer=g.index, E=g.num_experts):
                idx = args[1] if len(args) > 1 else kwargs["top_k_index"]  # [T, k]
                self.low[layer] = int2_experts(popularity(idx.cpu(), E), p)
            self._hooks.append(m.register_forward_pre_hook(hook, with_kwargs=True))

    def clear_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self.low.clear()

    def remove(self) -> None:
        self.clear_hooks()
        for m in self.modules:
            m.provider = self.base


@torch.no_grad()
def perplexity(lm: LoadedModel, chunks: list[torch.Tensor]) -> float:
    """exp(mean next-token NLL) over every chunk [1, T] (each scored on its own)."""
    device = next(lm.model.parameters()).device
    nll, n = 0.0, 0
    for ids in chunks:
        ids = ids.to(device)
        logits = lm.model(input_ids=ids, use_cache=False).logits.float()  # [1, T, V]
        if bool(not_finite(logits)):  # a sensitivity of nan against nan would rank nothing
            raise MoetoolError(nonfinite_sentence("on the profile's text", lm.fingerprint.source))
        nll += F.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="sum").item()
        n += ids.shape[1] - 1
    return math.exp(nll / max(1, n))


def measure_sensitivity(lm: LoadedModel, source: QuantSource, chunks: list[torch.Tensor], bits: tuple[int, ...],
                        shares: tuple[float, ...], data: str, source_name: str,
                        progress: Callable[[int, int], None] | None = None) -> SensitivityProfile:
    layers = [g.index for g in lm.geometry.layers]
    total = 1 + len(bits) * len(layers) + len(shares)
    done = 0

    def tick() -> None:
        nonlocal done
        done += 1
        if progress:
            progress(done, total)

    swap = SwapProvider.install(lm, source)
    try:
        base = perplexity(lm, chunks)
        tick()
        per_layer: dict[int, dict[str, float]] = {layer: {} for layer in layers}
        for b in bits:
            for layer in layers:
                swap.bits = {layer: int(b)}
                per_layer[layer][int(b)] = perplexity(lm, chunks)
                tick()
        curve = {}
        swap.bits = {layer: FATE_CACHE_BITS for layer in layers}
        for p in shares:
            swap.popularity_share(p)
            curve[f"{p:g}"] = perplexity(lm, chunks)
            tick()
    finally:
        swap.remove()
    return SensitivityProfile(
        base_ppl=base, tokens=sum(c.shape[1] - 1 for c in chunks), data=data, source=source_name,
        bits=tuple(int(b) for b in bits),
        layers=tuple(LayerSensitivity(layer=layer, ppl=ppl, delta={b: v - base for b, v in ppl.items()})
                     for layer, ppl in per_layer.items()),
        int2_share=curve)
