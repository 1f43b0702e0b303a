"""How far the demo MoE's perplexity is from what its expert partition allows: routers vs oracles.

Runs the dense SmolLM2 with each FFN replaced by the committed conversion in training form
(`lab.distil`-style: every neuron computed, then masked) and chooses the active neurons per token
in several ways, on held-out text of the fitting domains and on the unseen domain:

  soft     the conversion as committed: its routers, softmax top-k renormalised (what `demo-model` builds)
  hard     its routers' top-k, every selected expert weighted 1
  expert   oracle: the shared expert plus the k experts whose output has the largest norm, weights 1
  neuron   oracle: the same number of neurons (shared + k experts' worth), the largest |a_i| * ||w_down_i||
           per token, ignoring the expert partition
  all      every neuron (a dense FFN, corrections included)
  dense    the dense model's own FFN (no corrections): what a dense layer of the conversion runs

`--no-adapt` leaves out the conversion's low-rank corrections (the experts are then an exact
partition of the dense neurons). The gap between `expert` and `neuron` is what the partition into
experts costs; between `soft` and `expert`, what the routers cost. 4,096 tokens a text (8 windows
spread over it, so every domain counts) take ~40 s a mode on 2 cores.

`--per-layer MODE` asks where the gap sits: MODE in one layer at a time (`--layers`, default all),
every other layer `soft`, one row a layer (~25 s a layer and text). `--top-k K` and `--dense-layers
LIST` read the conversion in another geometry (its routers' top-K; those layers dense). `--texts`
picks the texts: `heldout`, `unseen`, and `samples`, text sampled from the dense model itself
(stage 3's teacher samples of seed `--samples-seed`, kept in the fit's workdir or drawn once,
~10 minutes), which reads no evaluation text at all. The demo's dense layers were chosen so: layer 0
with `--per-layer dense` on held-out and unseen text, layers 1 and 25 as the two best single
layers on the samples of seed 4, which no round of stage 3 trains on, read on the conversion of
the commit before (layer 0 dense, top-7; lab/LOG.md, 2026-11-27):

    git show 797db0a:moetool/data/demo_moe/conversion.safetensors > /tmp/prev.safetensors
    .venv/bin/python -m lab.demo_routing_oracle --params /tmp/prev.safetensors --modes soft \
        --top-k 6 --dense-layers 0 --texts samples --per-layer dense

`--partition SHARED,EXPERTS,TOP_K` (repeatable) asks what other geometries would allow: the
layerwise fit's own neuron layout (`lab.layerwise.layout`: shared neurons by mean contribution, the
rest clustered by co-activation) made afresh on the first 8,192 training tokens for each, then the
`expert` oracle on it, without corrections or routers (~2 min for the layouts, ~1 min a geometry).

    .venv/bin/python -m lab.demo_routing_oracle --modes soft,expert,neuron
    .venv/bin/python -m lab.demo_routing_oracle --no-adapt --modes all,neuron,expert,hard
    .venv/bin/python -m lab.demo_routing_oracle --params refined.safetensors --modes soft,expert
    .venv/bin/python -m lab.demo_routing_oracle --modes all --partition 768,24,8 --partition 512,32,16
    .venv/bin/python -m lab.demo_routing_oracle --modes soft --per-layer dense
    .venv/bin/python -m lab.demo_routing_oracle --modes '' --per-layer expert --layers 0,1
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from lab.layerwise import FitSettings, ffn_act, layout, spread_windows, train_ids
from lab.stages import stored_teacher_samples
from moetool import datasets
from moetool.demo import adapted_ffn, cache_root, committed_params_path, fetch_dense_gguf, load_dense, load_params

MODES = ("soft", "hard", "expert", "neuron", "all", "dense")
TEXTS = ("heldout", "unseen", "samples")
WIDTH = 1536  # SmolLM2-135M's FFN neurons per layer


class OracleFFN(nn.Module):
    def __init__(self, mlp: nn.Module, p, layer: int, adapt: bool):
        super().__init__()
        wg, wu, wd = adapted_ffn(mlp, p, layer, adapt=adapt)
        perm = p.perm[layer]  # shared neurons first, then the experts' groups
        self.wg, self.wu, self.wd = wg[perm], wu[perm], wd[:, perm]
        self.router, self.p, self.mode, self.layer = p.router[layer].float(), p, "soft", layer
        self.dense = mlp  # the dense FFN it stands in for (its weights are read afresh by --partition)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "dense" or self.layer in self.p.dense_layers:  # a dense layer of the conversion
            return self.dense(x)
        s, e, k, m = self.p.shared, self.p.experts, self.p.top_k, self.p.expert_size
        a = F.silu(x @ self.wg.T) * (x @ self.wu.T)  # [..., I]
        if self.mode == "all":
            return a @ self.wd.T
        if self.mode == "neuron":
            keep = (a.abs() * self.wd.norm(dim=0)).topk(s + k * m, dim=-1).indices
            return (a * torch.zeros_like(a).scatter(-1, keep, 1.0)) @ self.wd.T
        routed = a[..., s:].unflatten(-1, (e, m))
        if self.mode == "expert":
            norms = torch.einsum("...em,hem->...eh", routed, self.wd[:, s:].unflatten(-1, (e, m))).norm(dim=-1)
            idx = norms.topk(k, dim=-1).indices
            w = torch.ones(idx.shape, dtype=a.dtype)
        else:
            top = torch.softmax(x @ self.router.T, dim=-1).topk(k, dim=-1)
            idx = top.indices
            # Qwen2-MoE with norm_topk_prob: weights sum to 1, the converted down projection is k-scaled.
            w = top.values / top.values.sum(-1, keepdim=True) * k if self.mode == "soft" else torch.ones_like(top.values)
        gate = torch.zeros(*x.shape[:-1], e, dtype=a.dtype).scatter(-1, idx, w.to(a.dtype))
        return torch.cat([a[..., :s], (routed * gate[..., None]).flatten(-2)], dim=-1) @ self.wd.T


def text_windows(dense, tok, names: list[str], tokens: int, seed: int, seq_len: int = 512) -> dict[str, torch.Tensor]:
    """[n, seq_len] token windows per text: spread over the text (every domain counts), or every
    (120 / n)-th of the 120 teacher samples of `seed` (stage 3's size of a round)."""
    out = {}
    for name in names:
        if name == "samples":
            rows = stored_teacher_samples(dense, tok, 120, seq_len, seed, cache_root() / "demo-fit",
                                          progress=lambda msg: print(msg, end="\r", flush=True))
            n = max(1, min(len(rows), tokens // seq_len))
            out[name] = rows[::len(rows) // n][:n]
        else:
            text = datasets.heldout_text() if name == "heldout" else datasets.unseen_text()
            out[name] = spread_windows(torch.tensor(tok(text)["input_ids"]), tokens, seq_len)
    return out


@torch.no_grad()
def perplexity(model, ids: torch.Tensor, batch: int = 4) -> float:
    nll, count = 0.0, 0
    for i in range(0, ids.shape[0], batch):
        x = ids[i:i + batch]
        logits = model(input_ids=x).logits[:, :-1]
        nll += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum").item()
        count += x[:, 1:].numel()
    return math.exp(nll / count)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="soft,hard,expert,neuron,all", help=f"comma list among {','.join(MODES)}")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per text (whole 512-token windows spread over it)")
    ap.add_argument("--texts", default="heldout,unseen", help=f"comma list among {','.join(TEXTS)}")
    ap.add_argument("--samples-seed", type=int, default=4, metavar="SEED",
                    help="the teacher samples `--texts samples` reads (stage 3 trains on seeds 1-3)")
    ap.add_argument("--params", default=None, metavar="FILE",
                    help="a conversion (.safetensors) to read instead of the committed one")
    ap.add_argument("--top-k", type=int, default=0, help="route this many experts (0: the conversion's top-k)")
    ap.add_argument("--dense-layers", default=None, metavar="LIST",
                    help="comma list of the layers kept dense ('' for none; default: the conversion's)")
    ap.add_argument("--no-adapt", action="store_true", help="without the conversion's low-rank corrections")
    ap.add_argument("--per-layer", default=None, choices=MODES, metavar="MODE",
                    help="MODE in one layer at a time, the others soft (one row a layer)")
    ap.add_argument("--layers", default=None, help="comma list of layers for --per-layer (default: all)")
    ap.add_argument("--partition", action="append", default=[], metavar="SHARED,EXPERTS,TOP_K",
                    help="also the expert oracle on a fresh layout of this geometry (repeatable)")
    args = ap.parse_args()
    try:
        geometries = [tuple(int(v) for v in g.split(",")) for g in args.partition]
        layers = None if args.layers is None else [int(v) for v in args.layers.split(",")]
        dense_layers = None if args.dense_layers is None else tuple(
            sorted({int(v) for v in args.dense_layers.split(",") if v.strip()}))
    except ValueError:
        ap.error("--partition takes three integers, SHARED,EXPERTS,TOP_K; --layers and --dense-layers comma lists "
                 "of integers")
    for shared, experts, top_k in (g if len(g) == 3 else ap.error("--partition takes SHARED,EXPERTS,TOP_K")
                                   for g in geometries):
        if not (0 <= shared < WIDTH and experts > 0 and (WIDTH - shared) % experts == 0 and 0 < top_k <= experts):
            ap.error(f"--partition {shared},{experts},{top_k}: the {WIDTH} - SHARED routed neurons must split into "
                     "EXPERTS equal experts, and 0 < TOP_K <= EXPERTS")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if set(modes) - set(MODES):
        ap.error(f"--modes takes {','.join(MODES)}, not {','.join(sorted(set(modes) - set(MODES)))}")
    names = [t.strip() for t in args.texts.split(",") if t.strip()]
    if not names or set(names) - set(TEXTS):
        ap.error(f"--texts takes a comma list among {','.join(TEXTS)}, not {args.texts!r}")
    p = load_params(args.params or committed_params_path())
    p = dataclasses.replace(p, top_k=args.top_k or p.top_k,
                            dense_layers=p.dense_layers if dense_layers is None else dense_layers)
    n_layers = p.perm.shape[0]
    if not 0 < p.top_k <= p.experts:
        ap.error(f"--top-k must lie in 1..{p.experts}, the conversion's experts")
    if any(not 0 <= i < n_layers for i in (*(layers or ()), *p.dense_layers)):
        ap.error(f"--layers and --dense-layers must lie in 0..{n_layers - 1}")
    dense, tok = load_dense(fetch_dense_gguf())
    texts = text_windows(dense, tok, names, args.tokens, args.samples_seed)
    base = {name: perplexity(dense, ids) for name, ids in texts.items()}
    ffns = []
    for i, block in enumerate(dense.model.layers):
        block.mlp = OracleFFN(block.mlp, p, i, adapt=not args.no_adapt)
        ffns.append(block.mlp)

    def row(label: str, width: int = 12) -> None:
        ppl = {name: perplexity(dense, ids) for name, ids in texts.items()}
        print(f"{label:<{width}} " + " ".join(f"{ppl[n]:9.2f} {ppl[n] / base[n]:8.3f}" for n in texts), flush=True)

    print(f"{args.tokens} tokens a text; top-{p.top_k} of {p.experts}, dense layers {list(p.dense_layers)}; "
          f"corrections {'off' if args.no_adapt else 'on'}; dense: " + ", ".join(f"{n} {v:.2f}" for n, v in base.items()))
    print(f"{'mode':<12} " + " ".join(f"{n:>9} {'x dense':>8}" for n in texts))
    for mode in modes:
        for f in ffns:
            f.mode = mode
        row(mode)
    if args.per_layer:
        for f in ffns:
            f.mode = "soft"
        for i in range(n_layers) if layers is None else layers:
            ffns[i].mode = args.per_layer
            row(f"{args.per_layer} in {i}")
            ffns[i].mode = "soft"
    if geometries:
        for block, f in zip(dense.model.layers, ffns):
            block.mlp = f.dense
        print("expert oracle on fresh layouts, no corrections: shared + top-k of experts x width")
        for g, q in zip(geometries, fresh_layouts(dense, tok, geometries)):
            for i, block in enumerate(dense.model.layers):
                block.mlp = OracleFFN(ffns[i].dense, q, i, adapt=False)
                block.mlp.mode = "expert"
            width = (WIDTH - g[0]) // g[1]
            row(f"{g[0]} + {g[2]} of {g[1]} x {width} ({g[0] + g[2] * width} active)", 34)


@torch.no_grad()
def fresh_layouts(dense, tok, geometries: list[tuple[int, int, int]]) -> list[SimpleNamespace]:
    """For each (shared, experts, top_k): the layerwise fit's neuron layout of every layer, made on
    the first 8,192 training tokens, as conversion parameters without routers or corrections."""
    perms: dict[tuple[int, int, int], list[torch.Tensor]] = {g: [] for g in geometries}

    def hook(mod, inp):
        x = inp[0].reshape(-1, inp[0].shape[-1]).float()
        wg, wu, wd = (w.detach().float() for w in (mod.gate_proj.weight, mod.up_proj.weight, mod.down_proj.weight))
        a = ffn_act(x, wg, wu)
        for g in geometries:
            perms[g].append(layout(a, wd, FitSettings(shared=g[0], experts=g[1], top_k=g[2])))

    mlps = [block.mlp for block in dense.model.layers]
    handles = [m.register_forward_pre_hook(hook) for m in mlps]
    try:
        dense(input_ids=train_ids(tok, FitSettings(train_tokens=8192)))
    finally:
        for h in handles:
            h.remove()
    hidden, width = dense.config.hidden_size, mlps[0].gate_proj.weight.shape[0]
    return [SimpleNamespace(shared=g[0], experts=g[1], top_k=g[2], expert_size=(width - g[0]) // g[1],
                            perm=torch.stack(perms[g]), router=torch.zeros(len(mlps), g[1], hidden), lora={},
                            dense_layers=())
            for g in geometries]


if __name__ == "__main__":
    main()
