"""Counters the engine keeps per step and per layer, and their summary for the Run artifact.

Counting happens once per layer from host tensors the engine already has (no extra syncs).

    stats = Stats(moe_layers=(0, 1)); stats.layer(0).hits[16] += 3; stats.summary()
"""

from __future__ import annotations

import statistics
from array import array
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field


@dataclass
class LayerStats:
    # Hits, misses and CPU experts count distinct experts a layer's forward runs (a prefill expert serving
    # nine tokens is one), the unit of a copy; `precision_mix` counts (token, slot) uses.
    hits: Counter = field(default_factory=Counter)  # bits -> experts served by a copy on the device (or in flight)
    misses: Counter = field(default_factory=Counter)  # bits -> experts that needed a demand load
    precision_mix: Counter = field(default_factory=Counter)  # bits -> (token, slot) pairs run at bits
    bytes_h2d: int = 0
    stall_s: float = 0.0
    prefetch_issued: int = 0
    prefetch_used: int = 0  # prefetched copies that a later plan used
    needed: int = 0  # distinct experts run on the device (the prefetch recall denominator)
    substitutions: int = 0
    skips: int = 0
    cpu_experts: int = 0  # experts computed on the host (SMoE Algorithm 2): device-cache misses too

    def to_json(self) -> dict:
        issued, used = self.prefetch_issued, self.prefetch_used
        # the device cache's hit rate: an expert computed on the host missed it, as SMoE's "GPU expert
        # cache hit ratio" counts it (§VI); leaving it out raised the rate as CPU assistance grew
        uses = sum(self.hits.values()) + sum(self.misses.values()) + self.cpu_experts
        return {
            "hits": {str(k): v for k, v in sorted(self.hits.items())},
            "misses": {str(k): v for k, v in sorted(self.misses.items())},
            "hit_rate": sum(self.hits.values()) / uses if uses else None,
            "precision_mix": {str(k): v for k, v in sorted(self.precision_mix.items())},
            "bytes_h2d": self.bytes_h2d, "stall_s": self.stall_s,
            "prefetch_issued": issued, "prefetch_used": used,
            "prefetch_precision": used / issued if issued else None,
            "prefetch_recall": used / self.needed if self.needed else None,
            "substitutions": self.substitutions, "skips": self.skips, "cpu_experts": self.cpu_experts,
        }


@dataclass
class StepRecord:
    phase: str
    tokens: int
    seconds: float


class StepLog:
    """Every step's record, kept as three flat arrays: 17 bytes a step where a list of StepRecords took
    ~130 (bench_memory.py --lengths). The TPOT percentiles need every decode step's time, so the run
    keeps one number a step; nothing more. Appends and iterates as that list did."""

    def __init__(self) -> None:
        self._prefill = array("B")  # 1: a prefill, 0: a decode step
        self._tokens = array("q")
        self._seconds = array("d")

    def append(self, record: StepRecord) -> None:
        self._prefill.append(record.phase == "prefill")
        self._tokens.append(record.tokens)
        self._seconds.append(record.seconds)

    def __len__(self) -> int:
        return len(self._seconds)

    def __iter__(self) -> Iterator[StepRecord]:
        for prefill, tokens, seconds in zip(self._prefill, self._tokens, self._seconds):
            yield StepRecord("prefill" if prefill else "decode", tokens, seconds)

    def seconds(self, phase: str) -> list[float]:
        want = phase == "prefill"
        return [s for p, s in zip(self._prefill, self._seconds) if p == want]

    def tokens(self, phase: str) -> int:
        want = phase == "prefill"
        return sum(t for p, t in zip(self._prefill, self._tokens) if p == want)


class Stats:
    def __init__(self, moe_layers: tuple[int, ...]):
        self.layers = {layer: LayerStats() for layer in moe_layers}
        self.steps = StepLog()
        self.peak_device_bytes = 0  # the budget's reservations (pools, staging, non-expert weights, margin)
        # torch.cuda.max_memory_allocated less `foreign_bytes` (the process's device memory that is not
        # the model's when the engine was built): what the budget's plan must cover. CUDA only.
        self.peak_allocated_bytes: int | None = None
        self.foreign_bytes = 0
        # What the run was set up with, read when summarised (compute dtype, host memory tiers).
        self.context: Callable[[], dict] = dict

    def layer(self, index: int) -> LayerStats:
        return self.layers[index]

    def total(self, name: str) -> float:
        return sum(getattr(s, name) for s in self.layers.values())

    def summary(self) -> dict:
        hits = sum(sum(s.hits.values()) for s in self.layers.values())
        misses = sum(sum(s.misses.values()) for s in self.layers.values())
        cpu = sum(s.cpu_experts for s in self.layers.values())
        decode, prefill = self.steps.seconds("decode"), self.steps.seconds("prefill")
        decode_tokens = self.steps.tokens("decode")
        mix: Counter = Counter()
        for s in self.layers.values():
            mix.update(s.precision_mix)
        return {
            "ttft_s": statistics.mean(prefill) if prefill else None,
            "tpot_s": _dist(decode),
            "hit_rate": hits / (hits + misses + cpu) if hits + misses + cpu else None,
            "bytes_h2d": int(self.total("bytes_h2d")),
            "bytes_per_token": self.total("bytes_h2d") / max(1, decode_tokens + self.steps.tokens("prefill")),
            "stall_s": self.total("stall_s"),
            "substitutions": int(self.total("substitutions")), "skips": int(self.total("skips")),
            "cpu_experts": int(self.total("cpu_experts")),
            "prefetch_issued": int(self.total("prefetch_issued")), "prefetch_used": int(self.total("prefetch_used")),
            "precision_mix": {str(k): v for k, v in sorted(mix.items())},
            "peak_device_bytes": self.peak_device_bytes, "peak_allocated_bytes": self.peak_allocated_bytes,
            **self.context(),
        }


def _dist(xs: list[float]) -> dict | None:
    if not xs:
        return None
    s = sorted(xs)
    return {"mean": statistics.mean(s), "p50": statistics.median(s),
            "p99": s[min(len(s) - 1, int(round(0.99 * (len(s) - 1))))], "n": len(s)}
