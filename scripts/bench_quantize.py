"""Benchmark HQQ quantization of one Qwen3-30B-A3B-sized expert at 8+4+2 bits (plus packing).

    .venv/bin/python scripts/bench_quantize.py --experts 5 [--device cuda] [--threads 2]

Prints, per bit-width and for all three together, the median seconds per expert, experts/s and MB/s
of bf16 input (gate, up, down: 2048x768 each), plus the dequantize time of a blob. The goal is
<= 0.5 s per expert for all three bit-widths.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from moetool.model import ExpertWeights
from moetool.quant import hqq
from moetool.quant.format import Bits, dequantize, encode, make_layout

HIDDEN, INTERMEDIATE = 2048, 768  # Qwen3-30B-A3B: hidden_size, moe_intermediate_size


def expert(seed: int) -> ExpertWeights:
    g = torch.Generator().manual_seed(seed)
    return ExpertWeights(gate_up=(torch.randn(2 * INTERMEDIATE, HIDDEN, generator=g) * 0.02).bfloat16(),  # [2I, H]
                         down=(torch.randn(HIDDEN, INTERMEDIATE, generator=g) * 0.02).bfloat16())  # [H, I]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=3)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    bits_list = (Bits.INT8, Bits.INT4, Bits.INT2)
    layouts = {b: make_layout(b, (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE), False, args.group_size)
               for b in bits_list}
    mb = 3 * HIDDEN * INTERMEDIATE * 2 / 1e6  # bf16 bytes in one expert

    per_bits: dict[Bits, list[float]] = {b: [] for b in bits_list}
    totals, deq = [], []
    hqq.quantize_expert(expert(-1), Bits.INT4, args.group_size, device=args.device)  # warm-up (allocator, kernels)
    for i in range(args.experts):
        w = expert(i)
        total = 0.0
        for b in bits_list:
            t0 = time.perf_counter()
            blob = encode(layouts[b], w, hqq.quantize_expert(w, b, args.group_size, device=args.device))
            if args.device != "cpu":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            per_bits[b].append(dt)
            total += dt
            t0 = time.perf_counter()
            dequantize(blob, layouts[b], torch.bfloat16)
            deq.append(time.perf_counter() - t0)
        totals.append(total)
        print(f"expert {i}: {total:.3f} s for 8+4+2 bits", flush=True)

    print(f"\nQwen3-30B-A3B expert (gate/up/down {HIDDEN}x{INTERMEDIATE}, {mb:.1f} MB bf16), group {args.group_size}, "
          f"device {args.device}, {torch.get_num_threads()} torch threads, {os.cpu_count()} cpus, "
          f"load avg {os.getloadavg()[0]:.1f}, median of {args.experts}:")
    for b in bits_list:
        s = statistics.median(per_bits[b])
        print(f"  {int(b)}-bit     {s:7.3f} s/expert  {1 / s:6.2f} experts/s  {mb / s:7.1f} MB/s  "
              f"blob {layouts[b].nbytes / 1e6:.2f} MB")
    s = statistics.median(totals)
    verdict = "meets" if s <= 0.5 else "misses"
    print(f"  8+4+2     {s:7.3f} s/expert  {1 / s:6.2f} experts/s  {mb / s:7.1f} MB/s  ({verdict} the 0.5 s goal)")
    print(f"  dequantize one blob to bf16: median {statistics.median(deq) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
