"""Measure how much of moetool one decode step goes through: files and functions, and policy calls.

A profiler (sys.setprofile) records every moetool function called while the engine is in its last
decode step, under a policy at a budget, on the demo model's experts or a bundle of them (fp32, CPU, sim clock).
It prints the files touched, the number of distinct functions, and which `Policy` methods the
engine called, with counts. Used for issue 16's "files touched per decode step".

    .venv/bin/python scripts/files_per_step.py --policy dymoe --set config=4/2 --budget 25% --bundle out/demo/bundle
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch

import moetool
from moetool.engine import build_engine
from moetool.engine.store import HostStore
from moetool.model import load_model
from moetool.spec import DEFAULT_BUDGET

ROOT = str(Path(moetool.__file__).parent)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--policy", default="dymoe")
    ap.add_argument("--set", dest="settings", action="append", default=[], help="knob=value (repeatable)")
    ap.add_argument("--bundle", default=None, help="a quantized bundle of the model (for low-bit policies)")
    ap.add_argument("--budget", default=DEFAULT_BUDGET)
    ap.add_argument("--tokens", type=int, default=4)
    args = ap.parse_args()

    lm = load_model(args.model)
    if args.bundle:
        from moetool.quant.bundle import Bundle

        lm.bundle = Bundle.open(Path(args.bundle), model=lm.fingerprint)
        store = HostStore.from_bundle(lm.bundle, torch.float32)
    else:
        store = HostStore.from_experts(lm.experts, torch.float32)
    settings = dict(s.split("=", 1) for s in args.settings)
    engine, _ = build_engine(lm, store, args.policy, settings=settings, budget=args.budget, clock="sim")
    ids = lm.tokenizer("The history of the city begins", return_tensors="pt").input_ids

    last = args.tokens  # step indices: 0 is the prefill, 1.. the decode steps
    files: collections.Counter[str] = collections.Counter()
    functions: set[tuple[str, str]] = set()
    policy_calls: collections.Counter[str] = collections.Counter()
    policy_type = type(engine.policy)

    def tracer(frame, event, arg):
        if event != "call" or engine.step is None or engine.step.index != last:
            return
        path = frame.f_code.co_filename
        if not path.startswith(ROOT):
            return
        rel = str(Path(path).relative_to(Path(ROOT).parent))
        files[rel] += 1
        functions.add((rel, frame.f_code.co_qualname))
        caller = frame.f_back
        self_ = frame.f_locals.get("self")
        if isinstance(self_, policy_type) and caller is not None and caller.f_code.co_filename.endswith("runtime.py"):
            policy_calls[frame.f_code.co_name] += 1

    sys.setprofile(tracer)
    try:
        with torch.no_grad():
            lm.model.generate(ids, max_new_tokens=args.tokens + 1, do_sample=False)
    finally:
        sys.setprofile(None)
    print(f"policy {args.policy} {' '.join(args.settings)} at {args.budget}, decode step {last}:")
    print(f"  files touched: {len(files)}")
    for f, n in sorted(files.items()):
        print(f"    {f}: {n} calls")
    print(f"  distinct functions: {len(functions)}")
    print(f"  policy methods the engine called: {dict(sorted(policy_calls.items()))}")


if __name__ == "__main__":
    main()
