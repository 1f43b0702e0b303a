"""Fit the demo MoE conversion and write moetool/data/demo_moe/conversion.safetensors (`make fit-demo`).

Run by a maintainer (never by CI, which applies the committed result), from the repository root.
Four stages (lab/stages.py), the first three resumable, about 2 hours on a 2-core machine with
nothing else running: the layerwise fit (lab/layerwise.py, ~10 minutes), the end-to-end
distillation towards the dense model on the fitting text (lab/distil.py, ~33 minutes), three
rounds of refinement on that text mixed with text sampled from the dense model, each on new
samples, the first moving the conversion to the demo's geometry (layers 0, 1 and 25 dense, top-6;
lab.distil.REFINE, REFINE_ROUNDS: ~9.5 minutes of sampling and ~12 of training a round), and one
temperature for the routers chosen on the fitting text (lab/gates.py, ~2 minutes); rerunning after
an interruption picks up where the last checkpoint left off (kept in ~/.cache/moetool/demo-fit/).
Then ~5 minutes of evaluation:

    .venv/bin/python -m lab.fit_demo_moe                      # fit, distil, evaluate, write the file
    .venv/bin/python -m lab.fit_demo_moe --steps 20 --out /tmp/c.safetensors   # a quick trial
    .venv/bin/python -m lab.fit_demo_moe --evaluate moetool/data/demo_moe/conversion.safetensors
    .venv/bin/python -m lab.fit_demo_moe --refined stage3.safetensors   # stage 4 only, then evaluate
    .venv/bin/moetool demo-model --conversion /tmp/c.safetensors --out /tmp/trial   # a model of a trial

It reports perplexity of the dense model, of the MoE before training (least-squares routers), after
the layerwise fit, after distillation, after the refinement and after the router temperature (stage 4), on held-out text of the fitting domains and on a domain
no fit ever sees (moetool.datasets.unseen_text); the active neuron fraction; how peaked the gates
are (mean top-1 vs (k+1)-th softmax score, share of the top-k weight on the best k/4 experts); the
per-layer share of routed tokens taken by the busiest 25% of experts; and a greedy chat answer.
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

from lab.distil import REFINE, REFINE_ROUNDS, DistilSettings
from lab.gates import router_stats
from lab.layerwise import FitSettings, spread_windows
from lab.stages import Fitted, calibrate_routers, fit_demo
from moetool import datasets
from moetool.demo import (
    cache_root, committed_params_path, convert, fetch_dense_gguf, load_dense, load_params, save_params,
)

console = Console(stderr=True)
PROMPT = "What is the capital of France? Answer in one sentence."


def windows(tok, text: str, max_tokens: int, seq_len: int = 512) -> torch.Tensor:
    """[n, seq_len] windows spread evenly over `text` (its domains come one after another)."""
    return spread_windows(torch.tensor(tok(text)["input_ids"]), max_tokens, seq_len)


@torch.no_grad()
def perplexity(model, tok, text: str, max_tokens: int, seq_len: int = 512, batch: int = 8) -> float:
    ids = windows(tok, text, max_tokens, seq_len)
    n = ids.shape[0]
    nll, count = 0.0, 0
    for i in range(0, n, batch):
        x = ids[i:i + batch]
        logits = model(input_ids=x).logits[:, :-1].float()
        nll += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum").item()
        count += x[:, 1:].numel()
    return math.exp(nll / count)


@torch.no_grad()
def chat(model, tok, prompt: str, max_new_tokens: int = 40) -> str:
    msgs = [{"role": "user", "content": prompt}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def _summary(stats: list[dict[str, float]]) -> dict[str, float]:
    mean = lambda key: sum(r[key] for r in stats) / len(stats)  # noqa: E731
    return {"top1_over_next": round(mean("top1") / mean("next"), 3),
            "top_quarter_weight": round(mean("top_quarter_weight"), 4),
            "top25_experts_mean": round(mean("top25_experts"), 4),
            "layers_top25_at_least_40pct": sum(r["top25_experts"] >= 0.4 for r in stats)}


def main() -> None:
    d, dd = FitSettings(), DistilSettings()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=committed_params_path())
    ap.add_argument("--workdir", type=Path, default=cache_root() / "demo-fit", help="checkpoints of both stages")
    ap.add_argument("--shared", type=int, default=d.shared)
    ap.add_argument("--experts", type=int, default=d.experts)
    ap.add_argument("--top-k", type=int, default=d.top_k)
    ap.add_argument("--train-tokens", type=int, default=d.train_tokens)
    ap.add_argument("--router-steps", type=int, default=d.router_steps)
    ap.add_argument("--rank", type=int, default=d.compensation_rank, help="layerwise down-projection refit rank (0: none)")
    ap.add_argument("--steps", type=int, default=dd.steps, help="distillation steps (0: layerwise fit only)")
    ap.add_argument("--batch", type=int, default=dd.batch, help="distillation windows per step")
    ap.add_argument("--logit-std", type=float, default=dd.logit_std, help="router logit spread after annealing")
    ap.add_argument("--refine-steps", type=int, default=REFINE.steps,
                    help="stage 3 steps a round on fitting text + teacher samples (0: stop after distillation)")
    ap.add_argument("--refine-rounds", type=int, default=REFINE_ROUNDS,
                    help="stage 3 rounds, each on new teacher samples from the last round's result")
    ap.add_argument("--refine-top-k", type=int, default=REFINE.top_k,
                    help="stage 3: the top-k its rounds train and the demo keeps (0: stage 1's --top-k)")
    ap.add_argument("--dense-layers", default=",".join(map(str, REFINE.dense_layers)), metavar="LIST",
                    help="stage 3: comma list of layers whose FFN stays dense ('' for none)")
    ap.add_argument("--min-ratio", type=float, default=3.25,
                    help="stage 4: flatten the routers while top-1 / (k+1)-th stays >= this on fitting text (0: skip)")
    ap.add_argument("--eval-tokens", type=int, default=8192, help="tokens per text for perplexity")
    ap.add_argument("--refined", type=Path, default=None, metavar="FILE",
                    help="stage 4 only: FILE is stage 3's result (a conversion before its router temperature)")
    ap.add_argument("--evaluate", type=Path, default=None, metavar="FILE",
                    help="no fit: measure this conversion file (e.g. the committed one) and print the report")
    args = ap.parse_args()
    try:
        dense_layers = tuple(sorted({int(v) for v in args.dense_layers.split(",") if v.strip()}))
    except ValueError:
        ap.error(f"--dense-layers takes a comma list of layer numbers, not {args.dense_layers!r}")
    if args.refine_top_k < 0:
        ap.error(f"--refine-top-k takes 0 (stage 1's) or more, not {args.refine_top_k}")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    s = dataclasses.replace(d, shared=args.shared, experts=args.experts, top_k=args.top_k,
                            train_tokens=args.train_tokens, router_steps=args.router_steps,
                            compensation_rank=args.rank)
    ds = dataclasses.replace(dd, steps=args.steps, batch=args.batch, logit_std=args.logit_std)
    refine = dataclasses.replace(REFINE, steps=args.refine_steps, top_k=args.refine_top_k,
                                 dense_layers=dense_layers) if args.refine_steps else False
    t_all = time.perf_counter()
    with console.status("loading the dense model") as status:
        def progress(msg: str) -> None:
            status.update(msg)
            if msg.startswith(("layer", "stage")):
                console.log(msg)

        last = {"done": 0}  # the step reported before: a jump means a run resumed from its checkpoint

        def step_report(done: int, total: int, kl: float, gap: float, sec: float) -> None:
            if done not in (1, last["done"] + 1):
                console.log(f"distil resumed from its checkpoint at step {done - 1}/{total}")
            last["done"] = done
            left = (total - done) * sec / 60
            status.update(f"training step {done}/{total}, KL {kl:.4f}, log-gap {gap:.2f}, "
                          f"{sec:.1f}s/step, ~{left:.0f} min left")
            if done % 10 == 0 or done == total:
                console.log(f"distil step {done}/{total}: KL {kl:.4f}, top-1/(k+1)-th log-gap {gap:.2f} ({sec:.1f}s/step)")

        dense, tok = load_dense(fetch_dense_gguf(progress=progress))
        t0 = time.perf_counter()
        if args.evaluate is not None:
            params = load_params(args.evaluate)
            models = {"dense": dense, "moe": convert(dense, params)}
        else:
            if args.refined is not None:
                refined = load_params(args.refined)
                fitted = Fitted(calibrate_routers(dense, tok, refined, args.min_ratio, progress), None, None, None,
                                refined)
            else:
                fitted = fit_demo(dense, tok, s, ds, refine, workdir=args.workdir, progress=progress,
                                  report=step_report, min_ratio=args.min_ratio or None, rounds=args.refine_rounds)
            console.log(f"fitted in {time.perf_counter() - t0:.0f}s")
            # Evaluate what gets committed: the fp16 round trip of the parameters.
            params = fitted.params
            tmp = args.out.with_name(args.out.name + ".eval")
            save_params(params, tmp)
            params = load_params(tmp)
            tmp.unlink()
            stages = {"before_training": fitted.baseline, "layerwise": fitted.layerwise,
                      "distilled": fitted.distilled if refine else None,
                      "refined": fitted.refined if fitted.refined is not fitted.params else None}
            models = {"dense": dense} | {k: convert(dense, p) for k, p in stages.items() if p is not None}
            models["moe"] = convert(dense, params)
        fit_s = time.perf_counter() - t0
        texts = {"heldout": datasets.heldout_text(), "unseen": datasets.unseen_text()}
        ppl = {}
        for name, model in models.items():
            for text_name, text in texts.items():
                status.update(f"perplexity: {name} on {text_name}")
                ppl[f"{name}_{text_name}"] = round(perplexity(model, tok, text, args.eval_tokens), 3)
        status.update("router statistics and a sample answer")
        ids = windows(tok, texts["heldout"], 8 * 512)
        stats = {name: router_stats(models[name], ids) for name in ("layerwise", "distilled", "refined", "moe")
                 if name in models}
        answer_moe, answer_dense = chat(models["moe"], tok, PROMPT), chat(dense, tok, PROMPT)

    report = {
        "experts": params.experts, "top_k": params.top_k, "shared": params.shared,
        "expert_size": params.expert_size, "dense_layers": list(params.dense_layers),
        "active_fraction": round(params.active_fraction, 4),
        "eval_tokens": args.eval_tokens, "ppl": ppl,
        "ppl_ratio_heldout": round(ppl["moe_heldout"] / ppl["dense_heldout"], 4),
        "ppl_ratio_unseen": round(ppl["moe_unseen"] / ppl["dense_unseen"], 4),
        "gates": _summary(stats["moe"]),
        "top25pct_expert_share_per_layer": [round(r["top25_experts"], 4) for r in stats["moe"]],
        "top1_over_next_per_layer": [round(r["top1"] / r["next"], 3) for r in stats["moe"]],
        "fit_seconds": round(fit_s), "total_seconds": round(time.perf_counter() - t_all),
        "prompt": PROMPT, "answer_moe": answer_moe, "answer_dense": answer_dense,
    }
    if "calibrate" in params.meta:
        report["router_temperature"] = params.meta["calibrate"]["t"]
    for stage in ("layerwise", "distilled", "refined"):
        if stage in models:
            report |= {f"ppl_ratio_{stage}_heldout": round(ppl[f"{stage}_heldout"] / ppl["dense_heldout"], 4),
                       f"ppl_ratio_{stage}_unseen": round(ppl[f"{stage}_unseen"] / ppl["dense_unseen"], 4),
                       f"gates_{stage}": _summary(stats[stage])}
    if args.evaluate is None:
        params = dataclasses.replace(params, meta=params.meta | {"report": report})
        save_params(params, args.out)

    table = Table(title=f"demo MoE conversion {args.evaluate or '-> ' + str(args.out)}")
    table.add_column("quantity")
    table.add_column("value")
    for key, val in report.items():
        table.add_row(key, json.dumps(val) if isinstance(val, (list, dict)) else str(val))
    Console().print(table)


if __name__ == "__main__":
    main()
