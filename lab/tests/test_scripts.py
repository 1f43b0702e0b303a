"""The lab's analysis scripts measure what they say they measure.

lab/demo_int2_depth.py puts a dense FFN's neurons to INT2 "the way a demo bundle stores them";
here that is checked against the bundle's own path (`make_layout`, HQQ, `encode`, `dequantize`) on
a small FFN, expert by expert, and the neurons it was not asked to touch must stay as they were.
"""

from types import SimpleNamespace

import torch
from torch import nn

from lab import demo_int2_depth as depth
from moetool.model import ExpertWeights
from moetool.quant.format import Bits, auto_group_size, dequantize, encode, make_layout
from moetool.quant.hqq import quantize_expert


class _FFN(nn.Module):  # the projections a Llama-style MLP has, all the script touches
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(hidden, inter, bias=False), nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)


def test_int2_depth_quantizes_neurons_as_a_bundle_stores_its_experts():
    torch.manual_seed(0)
    hidden, inter, width = 64, 160, 32
    mlp = _FFN(hidden, inter)
    before = [w.detach().clone() for w in (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)]
    neurons = torch.randperm(inter)[32:]  # four 32-neuron experts; the first 32 of the order stay (the shared)
    with torch.no_grad():
        depth.int2_in_place(mlp, neurons, width)
    group = auto_group_size([SimpleNamespace(hidden_size=hidden, intermediate_size=width)])  # as `quantize` picks
    assert depth.group_size(576, 32) == 32  # the demo's experts
    layout = make_layout(Bits.INT2, (2 * width, hidden), (hidden, width), False, group_size=group)
    wg, wu, wd = before
    for e in range(4):
        rows = neurons[e * width:(e + 1) * width]
        ref = ExpertWeights(gate_up=torch.cat([wg[rows], wu[rows]]), down=wd[:, rows].contiguous())
        stored = dequantize(encode(layout, ref, quantize_expert(ref, Bits.INT2, group)), layout)
        assert torch.equal(mlp.gate_proj.weight[rows], stored.gate_up[:width])
        assert torch.equal(mlp.up_proj.weight[rows], stored.gate_up[width:])
        assert torch.equal(mlp.down_proj.weight[:, rows], stored.down)
        assert not torch.equal(stored.down, ref.down)  # INT2 did change them
    untouched = torch.ones(inter, dtype=torch.bool)
    untouched[neurons] = False
    assert torch.equal(mlp.gate_proj.weight[untouched], wg[untouched])
    assert torch.equal(mlp.up_proj.weight[untouched], wu[untouched])
    assert torch.equal(mlp.down_proj.weight[:, untouched], wd[:, untouched])
