"""Clocks: `wall` measures real time; `sim` models it from a hardware profile.

The simulated clock keeps three timelines, so overlap and stalls are modelled, not assumed:
compute (the GPU's stream), copy (the host-to-device link) and cpu (host expert compute). A copy
starts when the link is free and the request is made; a computation that needs it waits for it
(the wait is a stall); a prefetch issued early overlaps with compute.

    cost, _ = engine.cost_model(lm, store, "rtx3090")  # moetool.engine.cost_model
    clock = SimClock(cost)
    clock.begin_step(); clock.compute(1e-3); ready = clock.copy(8 << 20); stall = clock.wait(ready)
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moetool.errors import MoetoolError, quote

HW_DIR = Path(__file__).parents[1] / "hw_presets"  # the presets shipped in the package
USER_HW_DIR = Path("profiles") / "hw"  # a user's own profiles, relative to where moetool runs


@dataclass(frozen=True)
class HwProfile:
    """Throughputs of one machine; every field is sourced in the profile JSON's `sources`."""

    name: str
    h2d_gbps: float  # effective pinned host-to-device bandwidth, GB/s
    gpu_tflops: float  # dense bf16 tensor throughput, TFLOP/s
    gpu_mem_gbps: float  # device memory bandwidth, GB/s
    cpu_tflops: float  # host fp32/bf16 matmul throughput, TFLOP/s
    cpu_mem_gbps: float  # host memory bandwidth, GB/s
    kernel_s: float = 5e-6  # fixed cost per launched expert kernel group
    copy_latency_s: float = 1e-5  # fixed cost per host-to-device copy
    # Measured on a machine by `moetool profile --what timing`; each one, when present, replaces
    # the throughput-derived estimate (so a profile calibrates the sim clock for one model).
    t_dense_s: float | None = None  # attention + router + shared experts of one MoE layer, one token
    t_dense_captured_s: float | None = None  # the same inside the captured decode step (one graph replay)
    t_expert_s: dict[int, float] | None = None  # bits -> one expert on one token, on the device
    c_cpu_s: float | None = None  # one reference-precision expert on one token, on the host CPU

    def validate(self) -> None:
        """Every value finite and within what a machine can be (`PLAUSIBLE`): throughputs divide byte
        and FLOP counts and times are summed over every layer and step, so a 0, 1e-300 or 1e308 here
        would put Infinity or NaN into every run (and `report` and `fit` refuse those)."""
        from moetool.schema import SchemaError

        from moetool.bits import Bits

        stored = sorted(int(b) for b in Bits)
        odd = [b for b in (self.t_expert_s or {}) if b not in stored]
        if odd:  # a time for no precision: never read, and the precision meant falls back to the FLOP estimate
            raise SchemaError(f"t_expert_s[{odd[0]}]", f"is keyed by {odd[0]}, not a stored precision "
                                                     f"({', '.join(map(str, stored))})")
        values = {name: getattr(self, name) for name in PLAUSIBLE if name != "t_expert_s"}
        values |= {f"t_expert_s[{b}]": t for b, t in (self.t_expert_s or {}).items()}
        for name, value in values.items():
            if value is None:
                continue
            low, high, unit = PLAUSIBLE[name.split("[")[0]]
            if not (math.isfinite(value) and low <= value <= high):  # NaN fails this too
                raise SchemaError(name, f"is {value!r}, outside what a machine can be ({low:g} to {high:g} {unit})")


# (lowest, highest, unit) of each value of a hardware profile: a factor of 100 or more beyond any
# machine today either way, so that no real profile is refused and nothing over- or underflows.
PLAUSIBLE: dict[str, tuple[float, float, str]] = {
    "h2d_gbps": (1e-3, 1e5, "GB/s"), "gpu_tflops": (1e-3, 1e6, "TFLOP/s"), "gpu_mem_gbps": (1e-2, 1e6, "GB/s"),
    "cpu_tflops": (1e-5, 1e5, "TFLOP/s"), "cpu_mem_gbps": (1e-3, 1e5, "GB/s"),
    "kernel_s": (0.0, 1.0, "s"), "copy_latency_s": (0.0, 1.0, "s"),
    "t_dense_s": (0.0, 60.0, "s"), "t_expert_s": (0.0, 60.0, "s"), "c_cpu_s": (0.0, 60.0, "s"),
    "t_dense_captured_s": (0.0, 60.0, "s"),
}


# What a hardware profile holds beside `HwProfile`'s fields: its provenance, and the model a measured one
# was measured on (`engine.measured_on`).
HW_NOTES = ("description", "sources", "base", "devices", "model")


def hw_path(name_or_path: str) -> Path:
    """The file `load_hw` reads for `name_or_path` (the order its docstring gives), or one sentence. A
    bare name (no directory, no .json) is a preset's or the user's own before a file of the working
    directory: a file named `rtx3090` there replaced the default preset unsaid."""
    path = Path(name_or_path)
    named = not (name_or_path.endswith(".json") or "/" in name_or_path or "\\" in name_or_path)
    order = (HW_DIR / f"{name_or_path}.json", USER_HW_DIR / f"{name_or_path}.json", path) if named else \
        (path, HW_DIR / f"{name_or_path}.json", USER_HW_DIR / f"{name_or_path}.json")
    preset, own = HW_DIR / f"{name_or_path}.json", USER_HW_DIR / f"{name_or_path}.json"
    if named and preset.is_file() and own.is_file() and preset.read_bytes() != own.read_bytes():
        # the preset would win unsaid over a profile the user measured and named after their machine
        raise MoetoolError(f"--hw {name_or_path} names both the shipped preset and your {own}, which differ; give "
                           f"the file's path (--hw {own}) to use yours, or rename it.")
    for path in order:
        if path.exists():  # a directory, FIFO or device given as --hw is refused by name below, not taken for a name
            return path
    if name_or_path.endswith(".json") or "/" in name_or_path or "\\" in name_or_path:  # a path, not a name
        raise MoetoolError(f"no hardware profile file {name_or_path} (`moetool profile --what timing` writes one "
                           f"beside its --out; shipped presets: {', '.join(packaged_hw_names()) or 'none'}).")
    raise MoetoolError(f"no hardware profile '{name_or_path}' (shipped: {', '.join(packaged_hw_names()) or 'none'}; "
                       f"or put it in {USER_HW_DIR}/{name_or_path}.json, or give a path to a profile JSON).")


def load_hw(name_or_path: str) -> tuple[HwProfile, dict[str, Any]]:
    """A shipped preset by name (moetool/hw_presets/NAME.json), else one of the user's own
    (profiles/hw/NAME.json under the working directory), else a profile JSON path (`hw_path`)."""
    path = hw_path(name_or_path)
    from moetool.artifacts import read_json
    from moetool.files import GRID_BYTES

    data = read_json(path, GRID_BYTES, "hardware profile")  # a regular file of at most 1 MiB, and JSON
    if not isinstance(data, dict):
        raise MoetoolError(f"{path} is not a hardware profile (its top level is not an object).")
    from moetool.schema import SchemaError, build

    known = (*HwProfile.__dataclass_fields__, *HW_NOTES)
    if odd := [k for k in data if k not in known]:  # `t_expert` for t_expert_s ran on the estimates, unsaid
        import difflib

        near = difflib.get_close_matches(str(odd[0]), known, n=1)
        raise MoetoolError(f"{path} names {quote(str(odd[0]))}, which is no field of a hardware profile"
                           f"{f' (did you mean {near[0]}?)' if near else ''}; its fields: {', '.join(known)}.")
    fields = {k: data[k] for k in HwProfile.__dataclass_fields__ if k in data}
    try:
        return build(HwProfile, fields), data  # types and ranges, as artifacts are read
    except SchemaError as e:
        raise MoetoolError(f"{path} is not a usable hardware profile: {e}.") from None


@dataclass(frozen=True)
class CostModel:
    """Seconds for the engine's operations on one machine, for one model."""

    hw: HwProfile
    expert_bytes: dict[int, int]  # bits -> blob bytes
    expert_flops_per_token: float  # 2 * params of one expert
    reference_bytes: int  # one expert at the reference precision (what a GPU dequant writes)
    dense_bytes_per_layer: float  # non-expert weights per MoE layer (attention, router, shared experts, share of head)
    dense_flops_per_token_per_layer: float
    # softmax-attention layers summed per window: K+V bytes a position adds, flops of a query-key pair,
    # the window or None (`budget.attention_layers`); shared among the MoE layers as the dense bytes are
    attention: tuple[tuple[float, float, int | None], ...] = ()
    moe_layers: int = 1

    def t_dense(self, tokens: int, captured: bool = False, past: int = 0, sequences: int = 1) -> float:
        """Attention + router + shared experts of one layer (and its share of embeddings / lm_head);
        `captured`: inside the captured decode step, where the profile measured it there. `tokens` new
        positions over `sequences` sequences with `past` cached before them: their attention over the
        cache (`t_attention`) grows with it, which weights read once a step do not."""
        measured = self.hw.t_dense_captured_s if captured and self.hw.t_dense_captured_s is not None else self.hw.t_dense_s
        if measured is not None:
            # Measured at one token at a short context (the weight-read floor); more tokens cost compute
            # beyond it, and a longer context its cache reads.
            return max(measured, self.dense_flops_per_token_per_layer * tokens / (self.hw.gpu_tflops * 1e12)) + \
                self.t_attention(tokens, past, sequences)
        return max(self.dense_bytes_per_layer / (self.hw.gpu_mem_gbps * 1e9),
                   self.dense_flops_per_token_per_layer * tokens / (self.hw.gpu_tflops * 1e12)) + self.hw.kernel_s + \
            self.t_attention(tokens, past, sequences)

    def t_attention(self, tokens: int, past: int, sequences: int = 1) -> float:
        """One MoE layer's share of attention over the KV cache: each sequence reads the K and V of its
        `past` positions and its new ones (a sliding layer, its window's), and each new query meets the
        keys before it (a prefill's n^2 / 2 pairs). Bytes at memory bandwidth or flops at peak, the slower."""
        if not self.attention:
            return 0.0
        new = max(1, tokens // max(1, sequences))  # positions each sequence adds
        read = pairs = 0.0
        for kv_bytes, pair_flops, window in self.attention:
            seen = past + new if window is None else min(past + new, window)
            read += kv_bytes * seen * sequences
            mean = past + (new + 1) / 2 if window is None else min(past + (new + 1) / 2, window)
            pairs += pair_flops * mean * new * sequences
        return max(read / (self.hw.gpu_mem_gbps * 1e9), pairs / (self.hw.gpu_tflops * 1e12)) / self.moe_layers

    def t_expert(self, bits: int, tokens: int) -> float:
        """One expert on the GPU: read its weights (dequantizing if quantized) and multiply."""
        if self.hw.t_expert_s and bits in self.hw.t_expert_s:
            return max(self.hw.t_expert_s[bits], self.expert_flops_per_token * tokens / (self.hw.gpu_tflops * 1e12))
        read = self.expert_bytes[bits] + (self.reference_bytes if bits != 16 else 0)
        return max(read / (self.hw.gpu_mem_gbps * 1e9),
                   self.expert_flops_per_token * tokens / (self.hw.gpu_tflops * 1e12)) + self.hw.kernel_s

    def t_copy(self, nbytes: int) -> float:
        return nbytes / (self.hw.h2d_gbps * 1e9) + self.hw.copy_latency_s

    def t_host_copy(self, nbytes: int) -> float:
        """A host memcpy of `nbytes` (a blob into the staging ring): read and written, so twice the bytes."""
        return 2 * nbytes / (self.hw.cpu_mem_gbps * 1e9)

    def c_cpu(self, tokens: int) -> float:
        """One expert on the host CPU at the reference precision (SMoE's C_CPU)."""
        if self.hw.c_cpu_s is not None:
            return self.hw.c_cpu_s * tokens
        return max(self.reference_bytes / (self.hw.cpu_mem_gbps * 1e9),
                   self.expert_flops_per_token * tokens / (self.hw.cpu_tflops * 1e12))

    def policy_view(self, captured: bool = False) -> dict[str, Any]:
        """The numbers cost-aware policies read (`EngineContext.hw`). `captured`: a layer's dense time
        is the captured step's, where the profile measured it (0.16 against 1.6 ms a layer on an
        H100): Fate's n (§4.3) is the copies that fit in a layer's compute, and the captured step's
        layer is that much shorter."""
        return {"t_load": {b: self.t_copy(n) for b, n in self.expert_bytes.items()},
                "t_expert": {b: self.t_expert(b, 1) for b in self.expert_bytes},
                "c_cpu": self.c_cpu(1), "c_cpu_model": self.c_cpu_model(),
                "t_attn": self.t_dense(1, captured=captured), "t_gate": self.hw.kernel_s, "name": self.hw.name}

    def c_cpu_model(self) -> dict[str, float]:
        """`c_cpu(n) = max(floor, per_token * n)`, plus `trip`, as numbers a policy can evaluate for any n
        (SMoE's Algorithm 2 weighs a CPU expert serving n tokens with what the clock will charge for it:
        the engine's sim clock adds each expert's rows' copy back to the device, of which the latency is
        what counts at a few tokens)."""
        trip = self.hw.copy_latency_s
        if self.hw.c_cpu_s is not None:
            return {"floor": 0.0, "per_token": self.hw.c_cpu_s, "trip": trip}
        return {"floor": self.reference_bytes / (self.hw.cpu_mem_gbps * 1e9),
                "per_token": self.expert_flops_per_token / (self.hw.cpu_tflops * 1e12), "trip": trip}


def cpu_experts_ready(clock: Any, cost: CostModel, hidden: torch.Tensor, rows: list[int]) -> float:
    """When a layer's CPU-assisted experts (serving `rows` rows each) are back on the device: the sim
    clock's time, 0 on the wall's. The CPU starts once the layer's rows have crossed to the host
    (`transfer.rows_to_host`), then runs each expert and sends its rows back (`transfer.upload`): each
    crossing costs a copy, latency included, so an expert computed on the host is never cheaper than
    the two transfers around it."""
    if not rows:
        return 0.0
    row = hidden.shape[1] * hidden.element_size()
    clock.cpu(cost.t_copy(hidden.shape[0] * row))  # the rows down, before the first expert
    return max(clock.cpu(cost.c_cpu(n) + cost.t_copy(n * row)) for n in rows)


class SimClock:
    """Simulated time on three timelines (compute, copy, cpu)."""

    kind = "sim"

    def __init__(self, cost: CostModel):
        self.cost = cost
        self.now = 0.0  # compute timeline
        self.copy_free = 0.0  # when the link is next idle
        self.cpu_free = 0.0
        self._step_start = 0.0

    def begin_step(self) -> None:
        self._step_start = self.now

    def compute(self, seconds: float) -> None:
        self.now += seconds

    def copy(self, nbytes: int, staged: bool = False) -> float:
        """Enqueue a copy requested now; return when it completes. `staged`: the blob is outside the
        pinned host tier, so the host first copies it from the mapped bundle into a staging-ring slot
        (`store.StagingRing.stage`, on the host's timeline at its memory bandwidth, a floor: a page
        not in the page cache costs a disk read on top) and the transfer starts after that."""
        host = self.cpu(self.cost.t_host_copy(nbytes)) if staged else 0.0
        start = max(self.copy_free, self.now, host)
        self.copy_free = start + self.cost.t_copy(nbytes)
        return self.copy_free

    def read_in_place(self, seconds: float, after: float) -> float:
        """A kernel's reads of pinned host memory, from `after` or when the link is next idle: they cross
        the link the copies use, so they queue behind copies in flight and copies queue behind them.
        Returns when they end."""
        start = max(self.copy_free, after)
        self.copy_free = start + seconds
        return self.copy_free

    def cpu(self, seconds: float) -> float:
        start = max(self.cpu_free, self.now)
        self.cpu_free = start + seconds
        return self.cpu_free

    def wait(self, ready: float) -> float:
        """Compute waits until `ready`; returns the stall."""
        stall = max(0.0, ready - self.now)
        self.now += stall
        return stall

    def ready(self, at: float) -> bool:
        return at <= self.now

    def end_step(self) -> float:
        return self.now - self._step_start


class WallClock:
    """Real time: perf_counter around each step, after a device sync on CUDA (one per step)."""

    kind = "wall"

    def __init__(self, device: torch.device):
        self.device = device
        self._t0 = 0.0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def begin_step(self) -> None:
        self._sync()
        self._t0 = time.perf_counter()

    def compute(self, seconds: float) -> None:
        pass

    def copy(self, nbytes: int, staged: bool = False) -> float:
        return 0.0

    def cpu(self, seconds: float) -> float:
        return 0.0

    def wait(self, ready: float) -> float:
        return 0.0

    def ready(self, at: float) -> bool:
        return True

    def end_step(self) -> float:
        self._sync()
        return time.perf_counter() - self._t0


def preset_for_device(device_name: str) -> str | None:
    """The shipped preset made for the device named `device_name` (torch.cuda.get_device_name): the
    first whose `devices` list has a name that the device's contains (case-insensitive), else None."""
    from moetool.artifacts import read_json
    from moetool.files import GRID_BYTES

    name = device_name.lower()
    for preset in packaged_hw_names():
        devices = read_json(HW_DIR / f"{preset}.json", GRID_BYTES, "hardware profile").get("devices") or []
        if any(isinstance(d, str) and d and d.lower() in name for d in devices):
            return preset
    return None


def packaged_hw_names() -> list[str]:
    """The presets shipped in moetool/hw_presets (what `--hw NAME` accepts besides profiles/hw/NAME.json)."""
    return sorted(p.stem for p in HW_DIR.glob("*.json")) if HW_DIR.is_dir() else []

