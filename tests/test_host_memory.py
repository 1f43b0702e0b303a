"""A bundle-only run's host memory is its budget, not its model (issue 46): the peak anonymous memory
of `moetool run` in a subprocess, sampled from /proc, on a model with many experts, against a bound
computed from the budget the run was given; and the pinned tier held within --host-budget.

The bound is the issue's: 1.3 x (non-expert weights + budget), over the import baseline. The 30%
holds what every run keeps beside its budget whatever the model (modeling code, tokenizer, Python
objects: ~45 MiB measured on a 16-expert model), so the budget is large enough for 30% of it to
cover that; the experts themselves are small, so anything sized by the model's 256 experts stands out.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from moetool.engine import build_engine
from moetool.engine.store import HostArena, HostStore
from moetool.quant import QuantizeConfig, quantize
from moetool.quant.bundle import load_bundle_model
from helpers import save_char_tokenizer
from tiny import save_tiny

EXPERTS = 256
BUDGET = "128MiB"
RUN_BOUND = 1.3  # the bound over (non-expert weights + budget)
IMPORTS = "import torch, transformers, moetool.cli, moetool.quant.quantize, moetool.run"
CLI = "import sys; from moetool.cli import main; sys.argv[0] = 'moetool'; main()"


def tree_anon(pid: int) -> int:
    """RssAnon bytes of `pid` and its descendants now."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            total += next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("RssAnon:"))
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, StopIteration, ValueError):
            continue  # the process ended between two reads
    return total


def peak_anon(code: str, *args: str) -> int:
    """Peak RssAnon of `python -c code args` and its children, sampled every 5 ms; it must succeed."""
    proc = subprocess.Popen([sys.executable, "-c", code, *args], cwd="/", stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    peak, done = 0, threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, tree_anon(proc.pid))
            time.sleep(0.005)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    _, stderr = proc.communicate()
    done.set()
    thread.join()
    assert proc.returncode == 0, stderr[-2000:]
    return peak


@pytest.fixture(scope="module")
def many_experts(tmp_path_factory):
    """One MoE layer of 256 small experts (top-8), INT4 only: the kernel path's shapes (rows a
    multiple of 128, groups of 64), a bundle of a few MB."""
    root = tmp_path_factory.mktemp("many-experts")
    ckpt = save_tiny("qwen3_moe", root / "ckpt", dtype=torch.bfloat16, num_hidden_layers=1, num_experts=EXPERTS,
                     num_experts_per_tok=8, hidden_size=256, moe_intermediate_size=128, head_dim=32)
    save_char_tokenizer(ckpt)
    quantize(QuantizeConfig(model=str(ckpt), out=root / "bundle", bits=(4,), hqq_optimize=False))
    return root / "bundle"


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads /proc")
def test_a_bundle_only_runs_peak_memory_is_bounded_by_its_budget_not_its_expert_count(many_experts, tmp_path):
    artifact = tmp_path / "run.json"
    with ThreadPoolExecutor(2) as pool:  # side by side: each process's memory is its own, the wait is halved
        base = pool.submit(peak_anon, IMPORTS)
        peak = pool.submit(peak_anon, CLI, "run", "--bundle", str(many_experts), "--policy", "lru", "--set", "bits=4",
                           "--budget", BUDGET, "--prompt", "the quick brown fox", "--max-new-tokens", "4",
                           "--out", str(artifact))
        base, peak = base.result(), peak.result()
    run = json.loads(artifact.read_text())
    assert run["summary"]["kernel_layers"] == {"4": 1}  # the INT4 kernel path (where issue 46 was found) ran
    plan = run["budget"]
    bound = RUN_BOUND * (plan["non_expert_bytes"] + plan["total_bytes"])
    assert peak - base <= bound, (f"peak {(peak - base) / 2**20:.0f} MiB over the import baseline, bound "
                                  f"{bound / 2**20:.0f} MiB from a {BUDGET} budget")


def test_the_pinned_tier_holds_at_most_its_host_budget(many_experts):
    """Host tiers (the CUDA path's host side, run here on the CPU): what the arena holds stays within
    what --host-budget leaves after the ring, pinned blobs are the bundle's bytes, the rest is staged."""
    lm = load_bundle_model(many_experts)
    store = HostStore.from_bundle(lm.bundle, torch.float32)
    blob = store.slot_bytes(4)
    host_budget = 8 * blob + 40 * blob  # the ring (top-8) and 40 of the 256 experts
    engine, _ = build_engine(lm, store, "lru", settings={"bits": "4"}, budget="100%", host_tiers=True,
                             host_budget=host_budget)
    with torch.no_grad():
        lm.model(torch.tensor([[5, 17, 42, 99, 3, 64, 20, 7]]))
    engine.close()
    stats = store.host_stats()
    assert stats["host_staging_bytes"] + stats["host_pinned_held_bytes"] <= host_budget
    assert 0 < stats["host_pinned_bytes"] <= stats["host_pinned_held_bytes"]
    assert stats["host_staged_bytes"] > 0
    for (layer, expert, bits), pinned in store._pinned.items():
        assert torch.equal(pinned, lm.bundle.blob(layer, expert, bits))


@pytest.mark.parametrize("page_lock", [False, pytest.param(True, marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="page-locked memory needs CUDA"))])
def test_the_arena_holds_what_it_counts_and_never_more_than_its_capacity(page_lock):
    """Blobs of uneven sizes: every one placed (aligned, disjoint) until the capacity is spent; where
    page-locked, torch's host allocator is asked only for powers of two, so it holds what `held` says."""
    capacity, sizes = 3 << 20, [300_000, 70_000, 1_000_000] * 6
    if page_lock:
        torch.cuda.init()
    active = lambda: torch.cuda.host_memory_stats().get("active_bytes.current", 0) if page_lock else 0  # noqa: E731
    before = active()
    arena = HostArena(capacity, page_lock)
    placed = []
    for i, n in enumerate(sizes):
        buf = arena.take(n, sum(sizes[i:]))
        if buf is not None:
            assert buf.numel() == n and buf.data_ptr() % 64 == 0 and buf.is_pinned() == page_lock
            buf.fill_(i % 251)
            placed.append((buf, i % 251))
    used = sum(b.numel() for b, _ in placed)
    assert used <= arena.held <= capacity
    assert used >= 0.75 * capacity  # most of the capacity holds blobs, little is lost to chunk tails
    assert all(bool((b == v).all()) for b, v in placed)  # no two blobs share bytes
    if page_lock:
        assert active() - before == arena.held  # blocks as the allocator rounded them: nothing beyond
