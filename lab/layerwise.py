"""Stage 1 of the demo conversion: the layerwise fit of shared expert, routed experts and routers.

One forward pass over training text fits the layers in order, each on inputs produced by the
already-converted layers below it (so later layers see the errors they will see at run time):

1. shared expert: the S neurons with the largest mean contribution |a_i| * ||down_i||;
2. routed experts: the other neurons in E equal groups by balanced k-means on their co-activation
   (MoEfication, Zhang et al. 2022);
3. router: least squares onto each group's output norm, then refined on the exact layer
   reconstruction error with the model's own top-k, plus a straight-through sigmoid so that
   unselected experts also get a gradient;
4. optional compensation: the down projections are refit by ridge regression on the routed
   activations (dropped experts' contribution is partly predictable from the kept neurons); the
   change is stored as a low-rank factor pair so the committed file stays small.

    >>> from moetool.demo import fetch_dense_gguf, load_dense
    >>> from lab.layerwise import FitSettings, fit_conversion
    >>> dense, tok = load_dense(fetch_dense_gguf())
    >>> params = fit_conversion(dense, tok, FitSettings(train_tokens=8192))
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moetool.demo import ConversionParams

Progress = Callable[[str], None]


@dataclass(frozen=True)
class FitSettings:
    # 768 shared + 8 of 24 experts x 32 neurons = 1024 of 1536 neurons active (2/3). 32-neuron
    # experts (not 16) so that every projection's input width is a legal group size (>= 32) for
    # torch's packed-INT4 kernel, and k/E = 1/3 as before. The previous 48 x 16, top-16 layout
    # had a least-squares ratio of 1.43; the soft weights are trained end to end (lab/distil.py).
    shared: int = 768  # neurons in the always-on shared expert
    experts: int = 24
    top_k: int = 8
    popular: float = 0.25  # share of experts formed from the routed neurons used most often (see layout)
    train_tokens: int = 32768  # from datasets.train_text(), in seq_len windows spread over it
    seq_len: int = 512
    cluster_tokens: int = 8192  # tokens whose co-activation drives the clustering
    router_steps: int = 150
    router_lr: float = 3e-3
    compensation_rank: int = 32  # 0: no low-rank change to the FFN weights (exact partition)
    ridge: float = 1e-2  # relative ridge for the down-projection refit
    logit_scale: float = 1e-2  # std of router logits: keeps top-k weights ~1/k (hard gating)
    seed: int = 0


def train_ids(tok, s: FitSettings) -> torch.Tensor:
    """[B, seq_len] windows spread evenly over the training text (plays and docs alike)."""
    from moetool.datasets import train_text

    return spread_windows(torch.tensor(tok(train_text())["input_ids"]), s.train_tokens, s.seq_len)


def spread_windows(ids: torch.Tensor, tokens: int, seq_len: int) -> torch.Tensor:
    """[n, seq_len]: `tokens` tokens' worth of whole windows of `ids` [N], spread evenly from the first
    window to the last (every window once if fewer). The texts hold one domain after another, so
    their first windows would all be the first domain's."""
    n_win = len(ids) // seq_len
    starts = torch.linspace(0, n_win - 1, max(1, min(n_win, tokens // seq_len))).long() * seq_len
    return torch.stack([ids[o:o + seq_len] for o in starts.tolist()])


def spread_rows(n_tokens: int, want: int, seq_len: int) -> torch.Tensor:
    """The row indices of `spread_windows` over [n_tokens] rows that come in windows of `seq_len`."""
    return spread_windows(torch.arange(n_tokens), want, seq_len).flatten()


def ffn_act(x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor) -> torch.Tensor:
    return F.silu(x @ wg.T) * (x @ wu.T)  # [T, I]


def balanced_kmeans(feat: torch.Tensor, k: int, iters: int = 20, seed: int = 0) -> torch.Tensor:
    """Labels for the rows of `feat` (L2-normalised) in k clusters of exactly n/k rows each."""
    n = feat.shape[0]
    cap = n // k
    gen = torch.Generator().manual_seed(seed)
    cent = feat[torch.randperm(n, generator=gen)[:k]].clone()
    labels = None
    for _ in range(iters):
        sim = (feat @ cent.T).numpy()
        # Greedy balanced assignment: best (row, cluster) pairs first, clusters close when full.
        order = (-sim).ravel().argsort(kind="stable").tolist()
        lab, cnt, left = [-1] * n, [0] * k, n
        for flat in order:
            row, c = divmod(flat, k)
            if lab[row] < 0 and cnt[c] < cap:
                lab[row] = c
                cnt[c] += 1
                left -= 1
                if left == 0:
                    break
        new = torch.tensor(lab)
        if labels is not None and torch.equal(new, labels):
            break
        labels = new
        cent = F.normalize(torch.stack([feat[labels == c].mean(0) for c in range(k)]), dim=1)
    return labels


def layout(a: torch.Tensor, wd: torch.Tensor, s: FitSettings) -> torch.Tensor:
    """Neuron permutation: shared neurons first, then the experts' groups back to back.

    The routed neurons are split in two tiers by mean contribution before clustering: the most
    used `popular` share of them forms the same share of experts, the rest the others. Trained
    MoEs have such generalist experts that many tokens pick (skewed popularity, which caching
    papers exploit); clustering all routed neurons into equal co-activation groups spreads
    general-purpose neurons over every expert and flattens popularity. Our choice, not MoEfication's.
    """
    contrib = a.abs() * wd.norm(dim=0)  # [T, I]
    order = contrib.mean(0).argsort(descending=True)
    shared, rest = order[: s.shared], order[s.shared:]
    m = rest.numel() // s.experts
    n_pop = round(s.experts * s.popular)
    groups = []
    for tier, n_exp in ((rest[: n_pop * m], n_pop), (rest[n_pop * m:], s.experts - n_pop)):
        if n_exp == 0:
            continue
        rows = spread_rows(contrib.shape[0], s.cluster_tokens, s.seq_len)
        feat = F.normalize(contrib[rows][:, tier].T, dim=1)  # co-activation profile
        labels = balanced_kmeans(feat, n_exp, seed=s.seed)
        groups += [tier[labels == e].sort().values for e in range(n_exp)]
    return torch.cat([shared] + groups)


def route(z: torch.Tensor, k: int):
    """Qwen2-MoE routing with norm_topk_prob: (indices [T,k], weights [T,k] summing to k)."""
    top = torch.softmax(z.float(), dim=-1).topk(k, dim=-1)
    return top.indices, top.values / top.values.sum(-1, keepdim=True) * k


def moe_act(a: torch.Tensor, z: torch.Tensor, s: FitSettings) -> torch.Tensor:
    """Permuted activations [T, I] with routed groups weighted as the MoE block weights them."""
    m = (a.shape[1] - s.shared) // s.experts
    idx, w = route(z, s.top_k)
    gate = torch.zeros_like(z, dtype=a.dtype).scatter(1, idx, w.to(a.dtype))  # [T, E]
    routed = a[:, s.shared:].view(-1, s.experts, m) * gate[:, :, None]
    return torch.cat([a[:, : s.shared], routed.flatten(1)], dim=1)


def _group_stats(ap: torch.Tensor, wdp: torch.Tensor, s: FitSettings, chunk: int = 2048):
    """Per token: Gram Q [T,E,E] of the routed groups' outputs and weights w [T] of the loss."""
    m = (ap.shape[1] - s.shared) // s.experts
    wd_g = wdp[:, s.shared:].view(-1, s.experts, m)  # [H, E, m]
    qs, norms = [], []
    for i in range(0, ap.shape[0], chunk):
        ye = torch.einsum("tem,hem->teh", ap[i:i + chunk, s.shared:].view(-1, s.experts, m), wd_g)
        qs.append(ye @ ye.transpose(1, 2))
        norms.append((ap[i:i + chunk] @ wdp.T).pow(2).sum(-1))
    y2 = torch.cat(norms)
    # Relative error per token, softened so that near-zero outputs do not dominate.
    return torch.cat(qs), y2.mean() / (y2 + y2.mean())


def fit_router(x: torch.Tensor, ap: torch.Tensor, wdp: torch.Tensor,
               s: FitSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """(trained, least-squares) routers [E, H]; the first minimises the layer's routed error.

    The least-squares router is the starting point and the "before training" baseline. Both are
    rescaled to logits of std `logit_scale`: top-k selection ignores the scale, and tiny logits
    make the renormalised top-k weights ~1/k, i.e. hard gating of the k-scaled experts.
    """
    q, tok_w = _group_stats(ap, wdp, s)
    norms = q.diagonal(dim1=1, dim2=2).clamp_min(0).sqrt()  # [T, E] group output norms
    gram = x.T @ x
    gram += 1e-3 * gram.diagonal().mean() * torch.eye(x.shape[1])
    r0 = torch.linalg.solve(gram, x.T @ norms).T  # least-squares start, [E, H]
    r = nn.Parameter(r0 / (x @ r0.T).std())
    opt = torch.optim.Adam([r], lr=s.router_lr)
    gen = torch.Generator().manual_seed(s.seed)
    batch = min(4096, x.shape[0])
    with torch.enable_grad():
        for step in range(s.router_steps):
            j = torch.randint(0, x.shape[0], (batch,), generator=gen)
            z = x[j] @ r.T
            idx, _ = route(z.detach(), s.top_k)
            hard = torch.zeros_like(z).scatter(1, idx, 1.0)
            kth = z.detach().gather(1, idx).min(-1).values
            nxt = z.detach().scatter(1, idx, -math.inf).max(-1).values
            soft = torch.sigmoid((z - 0.5 * (kth + nxt)[:, None]) / z.detach().std(-1, keepdim=True))
            miss = 1.0 - (hard + soft - soft.detach())  # share of each group left out, [B, E]
            err = torch.einsum("be,bef,bf->b", miss, q[j], miss)
            loss = (err * tok_w[j]).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            for g in opt.param_groups:
                g["lr"] = s.router_lr * 0.5 * (1 + math.cos(math.pi * (step + 1) / s.router_steps))
    r = r.detach()
    return r * (s.logit_scale / (x @ r.T).std()), r0 * (s.logit_scale / (x @ r0.T).std())


def refit_down(ap_routed: torch.Tensor, y: torch.Tensor, wdp: torch.Tensor,
               s: FitSettings) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Low-rank (b [H,r], a [r,I]) change of the permuted down projection, or None if it hurts."""
    # Fit on 9 windows in 10, keep the change only if every 10th window (all domains) agrees.
    held = (torch.arange(ap_routed.shape[0]) // s.seq_len) % 10 == 9
    f_tr, y_tr = ap_routed[~held], y[~held]
    gram = f_tr.T @ f_tr
    gram += s.ridge * gram.diagonal().mean() * torch.eye(gram.shape[0])
    w_new = torch.linalg.solve(gram, f_tr.T @ y_tr).T  # [H, I]
    u, sv, vh = torch.linalg.svd(w_new - wdp, full_matrices=False)
    r = s.compensation_rank
    b, a = u[:, :r] * sv[:r], vh[:r]
    f_va, y_va = ap_routed[held], y[held]
    before = (f_va @ wdp.T - y_va).pow(2).sum()
    after = (f_va @ (wdp + b @ a).T - y_va).pow(2).sum()
    return (b, a) if after < before else None


class _FitInPlace(nn.Module):
    """Stands in for one dense MLP during the fitting pass: fits on its input, returns MoE output."""

    def __init__(self, mlp: nn.Module, layer: int, s: FitSettings, sink: dict, progress):
        super().__init__()
        self.mlp, self.layer, self.s, self.sink, self.progress = mlp, layer, s, sink, progress

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        s, shape = self.s, x.shape
        x = x.reshape(-1, shape[-1]).float()
        wg, wu, wd = (w.detach().float() for w in (self.mlp.gate_proj.weight, self.mlp.up_proj.weight,
                                                    self.mlp.down_proj.weight))
        a = ffn_act(x, wg, wu)
        y = a @ wd.T  # the dense FFN output this layer must reproduce
        perm = layout(a, wd, s)
        ap, wdp = a[:, perm], wd[:, perm]
        router, router_ls = fit_router(x, ap, wdp, s)
        lora = None
        if s.compensation_rank:
            lora = refit_down(moe_act(ap, x @ router.T, s), y, wdp, s)
        if lora is not None:
            wdp = wdp + lora[0] @ lora[1]
        out = moe_act(ap, x @ router.T, s) @ wdp.T
        rel = ((out - y).pow(2).sum() / y.pow(2).sum()).item()
        self.sink[self.layer] = (perm, router, lora, rel, router_ls)
        if self.progress is not None:
            self.progress(f"layer {self.layer}: relative FFN error {rel:.4f} "
                          f"({time.perf_counter() - t0:.1f}s)")
        return out.view(shape).to(x.dtype)


@dataclass(frozen=True)
class FitOutcome:
    params: ConversionParams  # what gets committed
    baseline: ConversionParams  # same layout, least-squares routers, no compensation


@torch.no_grad()
def fit_conversion(dense, tok, s: FitSettings = FitSettings(), progress: Progress | None = None) -> FitOutcome:
    """Fit the per-layer neuron layout, routers and (optionally) compensation for `dense`."""
    torch.manual_seed(s.seed)
    ids = train_ids(tok, s)
    layers = dense.model.layers
    sink: dict[int, tuple] = {}
    originals = [blk.mlp for blk in layers]
    try:
        for i, blk in enumerate(layers):
            blk.mlp = _FitInPlace(blk.mlp, i, s, sink, progress)
        dense.model(input_ids=ids)  # the base model only: no [tokens, vocab] logits
    finally:
        for blk, mlp in zip(layers, originals):
            blk.mlp = mlp
    n_layers, inter, hidden = len(layers), originals[0].gate_proj.weight.shape[0], dense.config.hidden_size
    perm = torch.stack([sink[i][0] for i in range(n_layers)])
    router = torch.stack([sink[i][1] for i in range(n_layers)])
    lora: dict[str, torch.Tensor] = {}
    if s.compensation_rank:
        # Zero factors where the refit did not help, so every layer has the same shapes.
        zeros = (torch.zeros(hidden, s.compensation_rank), torch.zeros(s.compensation_rank, inter))
        pairs = [sink[i][2] if sink[i][2] is not None else zeros for i in range(n_layers)]
        # The fit works in permuted neuron order; stored factors index the dense neurons.
        inv = [torch.argsort(perm[i]) for i in range(n_layers)]
        lora = {"down_b": torch.stack([b for b, _ in pairs]),
                "down_a": torch.stack([a[:, inv[i]] for i, (_, a) in enumerate(pairs)])}
    meta = {"fit": asdict(s), "fit_relative_ffn_error": [round(sink[i][3], 5) for i in range(n_layers)]}
    baseline = torch.stack([sink[i][4] for i in range(n_layers)])
    return FitOutcome(ConversionParams(s.shared, s.experts, s.top_k, perm, router, lora, meta),
                      ConversionParams(s.shared, s.experts, s.top_k, perm, baseline, {}, {}))
