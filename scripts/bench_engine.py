"""Benchmark: engine `resident` vs plain transformers, decode at batch 1, in one run.

Both models decode the same greedy continuation with a KV cache; each decode forward is timed
(perf_counter, after a device sync on CUDA) and the medians compared. Prints the ratio.

    .venv/bin/python scripts/bench_engine.py --model demo --tokens 64
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from moetool.engine import build_engine
from moetool.engine.store import HostStore
from moetool.model import load_model, resolve_source


def decode_times(model, ids: torch.Tensor, tokens: int, device: torch.device) -> tuple[list[float], list[int]]:
    cache = DynamicCache()
    times, out = [], []
    with torch.no_grad():
        logits = model(ids.to(device), past_key_values=cache, use_cache=True).logits
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(tokens):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            logits = model(nxt, past_key_values=cache, use_cache=True).logits
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            out.append(int(nxt))
    return times, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    src = resolve_source(args.model)

    plain = AutoModelForCausalLM.from_pretrained(src, dtype=dtype).to(device).eval()  # transformers' default kernel
    eager = AutoModelForCausalLM.from_pretrained(src, dtype=dtype, experts_implementation="eager").to(device).eval()
    lm = load_model(src, device=device, dtype=dtype)
    engine, _ = build_engine(lm, HostStore.from_experts(lm.experts, dtype), "resident", budget="100%",
                             device=device)
    ids = (lm.tokenizer("The history of the city begins", return_tensors="pt").input_ids if lm.tokenizer
           else torch.arange(1, 9)[None])

    for m in (plain, eager, lm.model):  # warm-up
        decode_times(m, ids, 4, device)
    # Interleave the three so drift in machine load hits all alike.
    t_plain, t_eager, t_engine = [], [], []
    for _ in range(2):
        tp, toks_p = decode_times(plain, ids, args.tokens // 2, device)
        tq, _ = decode_times(eager, ids, args.tokens // 2, device)
        te, toks_e = decode_times(lm.model, ids, args.tokens // 2, device)
        t_plain += tp
        t_eager += tq
        t_engine += te
    mp, mq, me = statistics.median(t_plain), statistics.median(t_eager), statistics.median(t_engine)
    print(f"model {src} ({lm.geometry.model_type}), device {device}, dtype {args.dtype}, "
          f"threads {torch.get_num_threads()}, {len(t_plain)} decode steps each")
    print(f"plain transformers  median decode step {mp * 1e3:8.3f} ms  (default experts kernel: "
          f"{plain.config._experts_implementation})")
    print(f"plain, eager loop   median decode step {mq * 1e3:8.3f} ms")
    print(f"engine resident     median decode step {me * 1e3:8.3f} ms")
    print(f"same tokens: {toks_p == toks_e}")
    print(f"ratio engine / plain = {me / mp:.3f}x (goal <= 1.05x)")
    print(f"ratio engine / eager = {me / mq:.3f}x")


if __name__ == "__main__":
    main()
