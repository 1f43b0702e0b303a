"""Fit the demo MoE conversion and write moetool/data/demo_moe/conversion.safetensors.

Run once by a maintainer (the fit takes ~6 minutes on 2 idle CPU cores, the evaluation ~3 more);
CI only applies the result:

    .venv/bin/python scripts/fit_demo_moe.py                   # fit, evaluate, write the file
    .venv/bin/python scripts/fit_demo_moe.py --experts 64 --top-k 16 --shared 512 --out /tmp/c.safetensors

It reports held-out perplexity of the dense model, of the MoE with least-squares routers only
("before training") and of the fitted MoE, the active neuron fraction, the per-layer share of
routed tokens taken by the busiest 25% of experts, and a greedy chat answer.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from moetool import datasets
from moetool.demo import (
    committed_params_path, convert, fetch_dense_gguf, load_dense, save_params,
)
from moetool.demo_fit import FitSettings, fit_conversion

console = Console(stderr=True)
PROMPT = "What is the capital of France? Answer in one sentence."


@torch.no_grad()
def perplexity(model, tok, text: str, max_tokens: int, seq_len: int = 512, batch: int = 8) -> float:
    ids = torch.tensor(tok(text)["input_ids"])
    n = min(len(ids), max_tokens) // seq_len
    ids = ids[: n * seq_len].view(n, seq_len)
    nll, count = 0.0, 0
    for i in range(0, n, batch):
        x = ids[i:i + batch]
        logits = model(input_ids=x).logits[:, :-1].float()
        nll += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum").item()
        count += x[:, 1:].numel()
    return math.exp(nll / count)


@torch.no_grad()
def expert_load(model, tok, text: str, max_tokens: int) -> list[float]:
    """Per layer: share of routed (token, expert) slots taken by the busiest 25% of experts."""
    counts = {}

    def hook(mod, _inp, out, layer):
        idx = out[2].flatten()  # the router returns (logits, weights, indices)
        counts[layer] = counts.get(layer, 0) + torch.bincount(idx, minlength=mod.num_experts)

    handles = [blk.mlp.gate.register_forward_hook(lambda m, i, o, l=l: hook(m, i, o, l))
               for l, blk in enumerate(model.model.layers)]
    try:
        ids = torch.tensor(tok(text)["input_ids"][:max_tokens])[None]
        model(input_ids=ids)
    finally:
        for h in handles:
            h.remove()
    shares = []
    for l in sorted(counts):
        c = counts[l].float().sort(descending=True).values
        shares.append((c[: max(1, len(c) // 4)].sum() / c.sum()).item())
    return shares


@torch.no_grad()
def chat(model, tok, prompt: str, max_new_tokens: int = 40) -> str:
    msgs = [{"role": "user", "content": prompt}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def main() -> None:
    d = FitSettings()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=committed_params_path())
    ap.add_argument("--shared", type=int, default=d.shared)
    ap.add_argument("--experts", type=int, default=d.experts)
    ap.add_argument("--top-k", type=int, default=d.top_k)
    ap.add_argument("--train-tokens", type=int, default=d.train_tokens)
    ap.add_argument("--router-steps", type=int, default=d.router_steps)
    ap.add_argument("--rank", type=int, default=d.compensation_rank, help="compensation rank (0: none)")
    ap.add_argument("--eval-tokens", type=int, default=16384, help="held-out tokens for perplexity")
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    s = dataclasses.replace(d, shared=args.shared, experts=args.experts, top_k=args.top_k,
                            train_tokens=args.train_tokens, router_steps=args.router_steps,
                            compensation_rank=args.rank)
    t_all = time.perf_counter()
    with console.status("loading the dense model") as status:
        def progress(msg: str) -> None:
            status.update(msg)
            if msg.startswith("layer"):
                console.log(msg)

        dense, tok = load_dense(fetch_dense_gguf(progress=progress))
        t0 = time.perf_counter()
        outcome = fit_conversion(dense, tok, s, progress=progress)
        fit_s = time.perf_counter() - t0
        console.log(f"fitted in {fit_s:.0f}s")
        heldout = datasets.heldout_text()
        status.update("held-out perplexity: dense")
        ppl_dense = perplexity(dense, tok, heldout, args.eval_tokens)
        status.update("held-out perplexity: MoE before router training")
        ppl_before = perplexity(convert(dense, outcome.baseline), tok, heldout, args.eval_tokens)
        status.update("held-out perplexity: fitted MoE")
        params = outcome.params
        moe = convert(dense, params)
        ppl_moe = perplexity(moe, tok, heldout, args.eval_tokens)
        status.update("expert load and a sample answer")
        load = expert_load(moe, tok, heldout, 4096)
        answer_moe, answer_dense = chat(moe, tok, PROMPT), chat(dense, tok, PROMPT)

    report = {
        "experts": params.experts, "top_k": params.top_k, "shared": params.shared,
        "expert_size": params.expert_size, "active_fraction": round(params.active_fraction, 4),
        "eval_tokens": args.eval_tokens, "ppl_dense": round(ppl_dense, 3),
        "ppl_moe_before_training": round(ppl_before, 3), "ppl_moe": round(ppl_moe, 3),
        "ppl_ratio": round(ppl_moe / ppl_dense, 4), "ppl_ratio_before": round(ppl_before / ppl_dense, 4),
        "top25pct_expert_share_per_layer": [round(v, 4) for v in load],
        "fit_seconds": round(fit_s), "total_seconds": round(time.perf_counter() - t_all),
        "prompt": PROMPT, "answer_moe": answer_moe, "answer_dense": answer_dense,
    }
    params = dataclasses.replace(params, meta=params.meta | {"report": report})
    save_params(params, args.out)

    table = Table(title=f"demo MoE conversion -> {args.out}")
    table.add_column("quantity")
    table.add_column("value")
    for key, val in report.items():
        table.add_row(key, json.dumps(val) if isinstance(val, list) else str(val))
    Console().print(table)


if __name__ == "__main__":
    main()
