"""How far the demo MoE's perplexity is from what its expert partition allows: routers vs oracles.

Runs the dense SmolLM2 with each FFN replaced by the committed conversion in training form
(`demo_distil`-style: every neuron computed, then masked) and chooses the active neurons per token
in several ways, on held-out text of the fitting domains and on the unseen domain:

  soft     the conversion as committed: its routers, softmax top-k renormalised (what `demo-model` builds)
  hard     its routers' top-k, every selected expert weighted 1
  expert   oracle: the shared expert plus the k experts whose output has the largest norm, weights 1
  neuron   oracle: the same number of neurons (shared + k experts' worth), the largest |a_i| * ||w_down_i||
           per token, ignoring the expert partition
  all      every neuron (a dense FFN)

`--no-adapt` leaves out the conversion's low-rank corrections (the experts are then an exact
partition of the dense neurons). The gap between `expert` and `neuron` is what the partition into
experts costs; between `soft` and `expert`, what the routers cost. 4,096 tokens a text take ~40 s a
mode on 2 cores.

    .venv/bin/python scripts/demo_routing_oracle.py --modes soft,expert,neuron
    .venv/bin/python scripts/demo_routing_oracle.py --no-adapt --modes all,neuron,expert,hard
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from torch import nn

from moetool import datasets
from moetool.demo import adapted_ffn, committed_params_path, fetch_dense_gguf, load_dense, load_params

MODES = ("soft", "hard", "expert", "neuron", "all")


class OracleFFN(nn.Module):
    def __init__(self, mlp: nn.Module, p, layer: int, adapt: bool):
        super().__init__()
        wg, wu, wd = adapted_ffn(mlp, p, layer, adapt=adapt)
        perm = p.perm[layer]  # shared neurons first, then the experts' groups
        self.wg, self.wu, self.wd = wg[perm], wu[perm], wd[:, perm]
        self.router, self.p, self.mode = p.router[layer].float(), p, "soft"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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


@torch.no_grad()
def perplexity(model, tok, text: str, tokens: int, seq_len: int = 512, batch: int = 4) -> float:
    ids = torch.tensor(tok(text)["input_ids"][: tokens // seq_len * seq_len]).view(-1, seq_len)
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
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per text (whole 512-token windows)")
    ap.add_argument("--no-adapt", action="store_true", help="without the conversion's low-rank corrections")
    args = ap.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if set(modes) - set(MODES):
        ap.error(f"--modes takes {','.join(MODES)}, not {','.join(sorted(set(modes) - set(MODES)))}")
    dense, tok = load_dense(fetch_dense_gguf())
    texts = {"heldout": datasets.heldout_text(), "unseen": datasets.unseen_text()}
    base = {name: perplexity(dense, tok, text, args.tokens) for name, text in texts.items()}
    p = load_params(committed_params_path())
    ffns = []
    for i, block in enumerate(dense.model.layers):
        block.mlp = OracleFFN(block.mlp, p, i, adapt=not args.no_adapt)
        ffns.append(block.mlp)
    print(f"{args.tokens} tokens a text; corrections {'off' if args.no_adapt else 'on'}; dense: "
          + ", ".join(f"{n} {v:.2f}" for n, v in base.items()))
    print(f"{'mode':<8} {'heldout':>9} {'x dense':>8} {'unseen':>9} {'x dense':>8}")
    for mode in modes:
        for f in ffns:
            f.mode = mode
        ppl = {name: perplexity(dense, tok, text, args.tokens) for name, text in texts.items()}
        print(f"{mode:<8} {ppl['heldout']:9.2f} {ppl['heldout'] / base['heldout']:8.3f} "
              f"{ppl['unseen']:9.2f} {ppl['unseen'] / base['unseen']:8.3f}", flush=True)


if __name__ == "__main__":
    main()
