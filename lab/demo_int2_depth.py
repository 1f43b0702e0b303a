"""INT2 depth sensitivity of the dense SmolLM2 the demo MoE is made from (DyMoE Fig. 5's question).

For each layer in turn, the dense model's FFN neurons that the conversion routes (or every FFN
neuron, `--neurons all`) go to INT2 the way a demo bundle stores them: HQQ, 32-neuron experts
(gate and up rows together, then down columns), the group size `moetool quantize` picks (32),
the rest of the model in its own precision. Perplexity on 8 windows of 256 tokens spread over the held-out text, as `moetool
profile --what sensitivity --ppl-tokens 2048` measures the MoE. So the demo's per-layer figures
(`make demo`'s report) can be read against the model they were converted from: if the teacher's
last layers are as sensitive as its first, no conversion of it will show DyMoE's slope honestly.

    .venv/bin/python -m lab.demo_int2_depth                      # routed neurons, every layer (~6 min)
    .venv/bin/python -m lab.demo_int2_depth --neurons all --layers 0,11,29
"""

from __future__ import annotations

import argparse
import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from moetool import datasets
from moetool.demo import committed_params_path, fetch_dense_gguf, load_dense, load_params
from moetool.tokenizer import encode
from moetool.profile.data import spread_chunks
from moetool.quant.format import Bits, auto_group_size, dequantize_qtensor, make_layout
from moetool.quant.hqq import quantize_weight


def group_size(hidden: int, width: int) -> int:
    """What `moetool quantize` picks for experts of this shape (32 for the demo: hidden 576, width 32)."""
    return auto_group_size([SimpleNamespace(hidden_size=hidden, intermediate_size=width)])


@torch.no_grad()
def perplexity(model, windows: torch.Tensor) -> float:
    logits = model(input_ids=windows).logits[:, :-1].float()
    return math.exp(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1)).item())


def int2_in_place(mlp, neurons: torch.Tensor, width: int) -> None:
    """The FFN's `neurons` at INT2, `width` at a time as one expert each (HQQ, as a bundle holds them)."""
    hidden = mlp.gate_proj.weight.shape[1]
    group = group_size(hidden, width)
    gate_up, down = make_layout(Bits.INT2, (2 * width, hidden), (hidden, width), False, group_size=group).projections
    wg, wu, wd = (w.data for w in (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight))
    for e in range(len(neurons) // width):
        rows = neurons[e * width:(e + 1) * width]
        gu = torch.cat([wg[rows], wu[rows]]).float()
        gu = dequantize_qtensor(quantize_weight(gu, Bits.INT2, group, gate_up.axis), gate_up)
        wg[rows], wu[rows] = gu[:width].to(wg.dtype), gu[width:].to(wu.dtype)
        d = wd[:, rows].float().contiguous()
        wd[:, rows] = dequantize_qtensor(quantize_weight(d, Bits.INT2, group, down.axis), down).to(wd.dtype)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--neurons", choices=("routed", "all"), default="routed",
                    help="the neurons the conversion routes (what the MoE's INT2 touches), or the whole FFN")
    ap.add_argument("--params", default=None, metavar="FILE", help="a conversion to read instead of the committed one")
    ap.add_argument("--layers", default=None, help="comma list of layers (default: all)")
    ap.add_argument("--tokens", type=int, default=2048, help="held-out tokens, in windows of 256")
    args = ap.parse_args()
    dense, tok = load_dense(fetch_dense_gguf())
    p = load_params(args.params or committed_params_path())
    n_layers = len(dense.model.layers)
    try:
        layers = list(range(n_layers)) if args.layers is None else [int(v) for v in args.layers.split(",")]
    except ValueError:
        ap.error("--layers takes a comma list of integers")
    if any(not 0 <= i < n_layers for i in layers) or args.tokens < 512:
        ap.error(f"--layers must lie in 0..{n_layers - 1} and --tokens be at least 512")
    # The windows `moetool profile` scores sensitivity on: --ppl-tokens / 256 of them, spread over the text.
    windows = torch.cat(spread_chunks(encode(tok, datasets.heldout_text(), dense.config.vocab_size),
                                      args.tokens // 256, 256))
    base = perplexity(dense, windows)
    print(f"dense SmolLM2, {windows[:, 1:].numel()} held-out tokens: perplexity {base:.2f}; "
          f"INT2 on the {args.neurons} neurons of one layer at a time")
    print(f"{'layer':>5} {'ppl':>9} {'delta':>8}")
    deltas = {}
    for i in layers:
        if args.neurons == "routed" and i in p.dense_layers:
            print(f"{i:>5} {'-':>9} {'-':>8}  dense in the conversion: it routes no neurons there")
            continue
        mlp = dense.model.layers[i].mlp
        saved = [w.data.clone() for w in (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)]
        int2_in_place(mlp, p.perm[i][p.shared if args.neurons == "routed" else 0:], p.expert_size)
        ppl = perplexity(dense, windows)
        for w, s in zip((mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight), saved):
            w.data.copy_(s)
        deltas[i] = ppl - base
        print(f"{i:>5} {ppl:9.2f} {deltas[i]:+8.3f}", flush=True)
    third = n_layers // 3
    first = [deltas[i] for i in range(third) if i in deltas]
    last = [deltas[i] for i in range(n_layers - third, n_layers) if i in deltas]
    if first and last:
        f, l = sum(first) / len(first), sum(last) / len(last)
        ratio = f"{f / l:.2f}x" if l > 0 else "-"  # as `moetool report` reads the MoE's profile
        print(f"mean delta, first {third} layers {f:+.3f} ({len(first)} measured), last {third} {l:+.3f} "
              f"({len(last)} measured): first / last {ratio}")


if __name__ == "__main__":
    main()
