"""Layers the engine runs on the device as transformers does: for a policy that never reads the
routing on the host (`Policy.host_routing` False: resident, static), once every expert of a layer
is resident in consecutive pool slots in the compute dtype, the layer is transformers' own
`grouped_mm` experts forward over those slots. The routing never leaves the device, so the host
queues the next layer without waiting for this one (a general layer waits once, for its routing).

    layers = DeviceLayers(weights, bits=16, enabled=True)
    out = layers.run(module, hidden, top_k_index, top_k_weights, st)  # None: not (yet) on the device
"""

from __future__ import annotations

import torch
from torch import nn

from moetool.engine.groups import counted_uses, grouped_mm  # transformers' dispatcher, with a fallback for unaligned rows
from moetool.engine.stats import LayerStats
from moetool.engine.weights import PoolWeights
from moetool.quant.format import ExpertStack


class DeviceLayers:
    def __init__(self, weights: PoolWeights, bits: int, enabled: bool):
        self.weights, self.bits, self.enabled = weights, bits, enabled
        self.stacks: dict[int, ExpertStack | None] = {}  # layer -> its experts in expert order, or None
        # this step's layers: tokens per expert [E] (device), and the requests' uses where a batch has padding
        self.routed: list[tuple[LayerStats, torch.Tensor, torch.Tensor | None]] = []

    def run(self, module: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
            st: LayerStats, real: torch.Tensor | None = None) -> torch.Tensor | None:
        """The layer's output [T, H], or None where the general path must run it. `real`: the rows of
        requests' tokens (a batch's left padding not), for the precision mix."""
        stack = self.stacks.get(module.layer.index)
        if stack is None:
            return None
        out, counts = routed_on_device(module, hidden, top_k_index, top_k_weights, stack)
        # no op of its own in a decode step: the counts sum to the routed slots (histc drops -1 and E)
        padded = None if real is None else counted_uses(top_k_index, stack.gate_up.shape[0], real).sum()
        self.routed.append((st, counts, padded))
        return out

    def learn(self, layer: int, num_experts: int) -> None:
        """After the layer's first (general) run: whether it runs on the device from now on. Such a
        policy never evicts, so the answer holds for the engine's life."""
        if self.enabled and layer not in self.stacks:
            self.stacks[layer] = self.weights.layer_stack(layer, self.bits, num_experts)

    def end_step(self) -> None:
        """Count the experts the device-side layers ran (as hits): one read a step, not one a layer."""
        if self.routed:
            for (st, _, padded), counts in zip(self.routed, torch.stack([c for _, c, _ in self.routed]).tolist()):
                n = sum(c > 0 for c in counts)
                st.hits[self.bits] += n
                st.needed += n
                st.precision_mix[self.bits] += int(sum(counts)) if padded is None else int(padded)
            self.routed.clear()


def routed_on_device(module: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                     stack: ExpertStack) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer whose experts are all resident, as transformers' `grouped_mm` experts forward computes
    it (same sort, offsets, GEMMs, weighting and sum: bit for bit), over `stack` (the layer's experts
    in expert order, views of the pool). The routing never leaves the device, so the host queues
    the next layer without waiting. Returns the output [T, H] and the tokens routed to each expert
    ([E] on the device, read once per step for the stats)."""
    k, E = top_k_index.shape[-1], stack.gate_up.shape[0]
    T, H = hidden.shape
    expert_ids, perm = torch.sort(top_k_index.reshape(-1))
    x = hidden[perm // k]
    # histc: float input on a CPU, integer on CUDA (as transformers feeds it)
    counts = torch.histc(expert_ids.float() if hidden.device.type == "cpu" else expert_ids.int(), bins=E, min=0,
                         max=E - 1)
    offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
    h = grouped_mm(x, stack.gate_up.transpose(-2, -1), offs)  # [T*k, 2I]
    if stack.gate_up_bias is not None:
        h.add_(stack.gate_up_bias[expert_ids])
    h = module.impl._apply_gate(h) if module.layer.gated else module.impl.act_fn(h)  # [T*k, I]
    y = grouped_mm(h, stack.down.transpose(-2, -1), offs)  # [T*k, H]
    if stack.down_bias is not None:
        y.add_(stack.down_bias[expert_ids])
    y = y * top_k_weights.reshape(-1)[perm].unsqueeze(-1)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=perm.device)
    return y[inverse].view(T, k, H).sum(dim=1).to(hidden.dtype), counts
