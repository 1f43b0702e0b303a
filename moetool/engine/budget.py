"""Device memory sizing: one source for how a budget splits, used by the engine and by `fit`.

A budget is either a size (`12GiB`: everything on the device) or a share of the experts at the
reference precision (`25%`: the expert cache alone, with the fixed parts added on top). The fixed
parts are the non-expert weights, the KV cache and activations for the planned sequence length
(`kv_margin`), and the staging buffers. `Budget` then tracks reservations against the total.

    split = split_budget("25%", n_experts=96, expert_bytes={16: 4096, 4: 1280},
                         non_expert_bytes=1 << 20, margin_bytes=1 << 20)
    split.cache_bytes == 96 * 4096 // 4
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from collections.abc import Iterable
from typing import Any

import torch

from moetool.checkpoint import looped_layers, text_config
from moetool.engine.store import REFERENCE_BITS
from moetool.errors import MoetoolError, size_text

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
ACTIVATION_MARGIN = 16 * 2**20  # bytes for activations and workspace beside the KV cache
PLAN_TOKENS = 4096  # sequence length a run's KV margin is planned for unless it knows its own
STAGING_SLOTS = 2  # per precision: a demand load that is not cached streams through these, double-buffered


@dataclass(frozen=True)
class BudgetSplit:
    """How the device budget is spent (a policy's per-layer `plan` is another thing)."""

    total_bytes: int
    non_expert_bytes: int
    margin_bytes: int  # KV cache for the longest sequence + activations
    staging_bytes: int
    cache_bytes: int  # what policies may carve into expert slots
    expert_bytes_reference: int  # all experts at the reference precision (what a percentage refers to)


def parse_size(text: str, option: str = "--budget") -> int:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        share = " or a percentage like 25%" if option == "--budget" else ""
        raise MoetoolError(f"{option} '{text}' is not a size like 12GiB / 500MB{share}.")
    if not m.group(2) and "." in m.group(1):  # `--budget 0.25`: 0 bytes, refused as below a minimum of MiB
        share = f", {float(m.group(1)) * 100:g}% for a share of the experts" if option == "--budget" else ""
        raise MoetoolError(f"{option} '{text}' has no unit, and a bare number is bytes; write a size like "
                           f"500MB or 12GiB{share}.")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def kv_margin(config: Any, max_tokens: int, batch: int, dtype: torch.dtype, top_k: int = 0) -> int:
    """Bytes of a KV cache for `batch` sequences of `max_tokens`, plus activations.

    The activations are a fixed workspace margin plus the engine's per-layer expert outputs, held
    for a prefill of `max_tokens` until they are summed in expert order (T * top_k rows of H).
    """
    cfg = text_config(config)
    item = torch.empty((), dtype=dtype).element_size()
    kv = sum(2 * heads * dim for heads, dim in _kv_shapes(cfg))  # K and V values per token
    per_token = kv * item + top_k * cfg.hidden_size * item
    return per_token * max_tokens * batch + ACTIVATION_MARGIN


def _layer_configs(cfg: Any) -> list[Any]:
    """Each decoder layer's config: the per-layer views of a heterogeneous config (Gemma 4's sliding
    and full-attention layers differ in head_dim, and its global `head_dim` raises rather than pick
    one), else the config itself once per layer."""
    try:
        views = list(cfg.per_layer_config)
    except (AttributeError, TypeError):
        views = []
    return views or [cfg] * cfg.num_hidden_layers


def _kv_shapes(cfg: Any) -> list[tuple[int, int]]:
    """(KV heads, head size) of each cache layer the model builds: a sliding layer's own where the
    config gives them apart (Inkling2's `swa_num_key_value_heads`, `swa_head_dim`), and a looped
    model's extra cache layers, one per extra pass of each looped layer (`looped_layers`)."""
    types = getattr(cfg, "layer_types", None)
    shapes = []
    for i, c in enumerate(_layer_configs(cfg)):
        sliding = isinstance(types, (list, tuple)) and i < len(types) and "sliding" in str(types[i])
        heads = getattr(c, "swa_num_key_value_heads", None) if sliding else None
        dim = getattr(c, "swa_head_dim", None) if sliding else None
        shapes.append((heads if isinstance(heads, int) else _kv_heads(c), dim if isinstance(dim, int) else _head_dim(c)))
    core, passes = looped_layers(cfg)
    return shapes + [shapes[i] for i in core if i < len(shapes)] * (passes - 1)


# Layer types whose state does not grow with the sequence (linear attention, state-space, convolution):
# a decode step reads no cache of past positions there.
_STATEFUL = ("linear", "mamba", "conv", "recurrent", "ssm", "rwkv")


def attention_layers(config: Any, dtype: torch.dtype) -> tuple[tuple[float, float, int | None], ...]:
    """The softmax-attention layers, summed per window they attend over: (bytes of K and V one position
    adds to their caches, flops of one query-key pair (QK and PV), the window or None for the whole
    sequence). What the simulated clock charges a step's attention beside its weights
    (`CostModel.t_attention`, once a MoE layer: summed here, not per layer there). Layers the config
    types as linear attention or state space (`layer_types`, or `layers_block_type` as Jamba's and
    Granite's hybrids spell it) hold no growing cache and are left out."""
    cfg = text_config(config)
    item = torch.empty((), dtype=dtype).element_size()
    types = getattr(cfg, "layer_types", None) or getattr(cfg, "layers_block_type", None)
    window = getattr(cfg, "sliding_window", None)
    sums: dict[int | None, tuple[float, float]] = {}
    for i, (c, (heads, dim)) in enumerate(zip(_layer_configs(cfg), _kv_shapes(cfg))):
        kind = str(types[i]).lower() if isinstance(types, (list, tuple)) and i < len(types) else ""
        if any(k in kind for k in _STATEFUL):
            continue
        q = getattr(c, "num_attention_heads", heads) * _head_dim(c)
        span = window if "sliding" in kind and isinstance(window, int) and window > 0 else None
        kv, flops = sums.get(span, (0.0, 0.0))
        sums[span] = (kv + 2.0 * heads * dim * item, flops + 4.0 * q)
    return tuple((kv, flops, span) for span, (kv, flops) in sums.items())


def _kv_heads(c: Any) -> int:
    return getattr(c, "num_key_value_heads", None) or c.num_attention_heads


def _head_dim(c: Any) -> int:
    return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


def decode_workspace(expert_params: int, dtype: torch.dtype, experts: int) -> int:
    """Bytes the grouped path decodes into: `experts` experts' weights in the compute dtype, plus what
    they are decoded from (their gathered parts and unpacked codes, at most 2 bytes a weight). The
    engine decodes at most `experts` at once (a batch with more runs in chunks), so this bounds it."""
    item = torch.empty((), dtype=dtype).element_size()
    return experts * expert_params * (item + 2)


def expert_params(layer: Any) -> int:
    """Weights of one expert of a MoE layer (`model.MoeLayer`): gate and up (or up alone), and down."""
    return layer.hidden_size * layer.intermediate_size * (3 if layer.gated else 2)


def plan_margin(config: Any, layers: Any, max_tokens: int, batch: int, dtype: torch.dtype, decoded: bool) -> int:
    """The margin a budget plans beside weights and experts: the KV cache and activations
    (`kv_margin`), plus the grouped path's decode workspace where some stored precision is decoded
    rather than read in place (`decode_workspace`, a chunk of top-k experts)."""
    top_k = max(g.top_k for g in layers)  # a model may route each layer to its own count (Hunyuan's list)
    workspace = decode_workspace(max(expert_params(g) for g in layers), dtype, top_k) if decoded else 0
    return kv_margin(config, max_tokens, batch, dtype, top_k) + workspace


def device_workspace(device: torch.device) -> int:
    """Device memory a run's GEMMs hold beside any tensor: cuBLAS's and cuBLASLt's workspaces, which
    torch takes from its caching allocator at a stream's first matmul (tens of MiB on recent GPUs,
    set by CUBLAS_WORKSPACE_CONFIG). Measured, not assumed: torch's workspaces are dropped, one
    matmul and one addmm run, and what stays allocated is theirs. 0 off CUDA."""
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    before = torch.cuda.memory_allocated(device)
    with torch.cuda.device(device):
        a = torch.ones(64, 64, device=device, dtype=torch.bfloat16)
        results = (torch.addmm(a, a, a), a @ a)
        torch.cuda.synchronize(device)
        del a, results
    held = max(0, torch.cuda.memory_allocated(device) - before)
    if clear is not None:
        clear()  # the run takes them again, inside its own peak
    return held


def capture_workspace(device: torch.device) -> int:
    """Device memory that compiling and capturing the decode step takes beside the step's tensors, on
    CUDA: inductor times a kernel that has several configurations at its first run, after writing a
    buffer the size of the L2 cache (torch/_inductor/runtime/benchmarking.py), and the stream the step
    is captured on takes its own GEMM workspaces (`device_workspace`). On a lent H200 the captured step's
    allocator peak went 51 MiB past tiny models' budgets that planned neither (docs/benchmarks.md).
    0 off CUDA."""
    if device.type != "cuda":
        return 0
    return torch.cuda.get_device_properties(device).L2_cache_size + device_workspace(device)


def check_plan(length: int, batch: int, plan_tokens: int, plan_batch: int) -> None:
    """The budget's KV/activation margin holds `plan_batch` sequences of `plan_tokens`: a longer or
    wider forward would use device memory the budget never reserved, so it is refused."""
    if length > plan_tokens or batch > plan_batch:
        raise MoetoolError(f"a forward of {batch} sequence(s) of {length} tokens exceeds the KV/activation margin "
                           f"the budget was planned for ({plan_batch} of {plan_tokens} tokens); plan the engine "
                           "for the longer sequences (build_engine's max_tokens and batch).")


def staging_bytes(expert_bytes: dict[int, int]) -> int:
    """The staging buffers: STAGING_SLOTS of each stored precision's slot."""
    return STAGING_SLOTS * sum(expert_bytes.values())


MAX_SHARE_PCT = 1000.0  # a share budget above this is a typo, not a plan


def parse_budget(spec: str, option: str = "--budget") -> tuple[str, float]:
    """("share", fraction of the 16-bit experts) for `25%`, ("size", bytes) for `12GiB`, or one sentence."""
    text = spec.strip()
    if not text.endswith("%"):
        return "size", float(parse_size(text, option))
    try:
        pct = float(text[:-1])
    except ValueError:
        raise MoetoolError(f"{option} '{spec}' is not a percentage like 25%.") from None
    if not (math.isfinite(pct) and 0 <= pct <= MAX_SHARE_PCT):
        raise MoetoolError(f"{option} '{spec}' must be between 0% and {MAX_SHARE_PCT:g}% of the 16-bit expert bytes.")
    return "share", pct / 100


def split_budget(spec: str, *, n_experts: int, expert_bytes: dict[int, int], non_expert_bytes: int,
                 margin_bytes: int, staged: Iterable[int] | None = None) -> BudgetSplit:
    """Split `spec` over non-expert weights, the KV/activation margin, staging and the expert cache.

    `expert_bytes` maps each stored precision to one expert's slot. Without a 16-bit copy the
    reference is the highest precision scaled to 16 bits. `staged`: the precisions given staging
    buffers, the policy's (`Policy.bits_in_use`); None: every stored one.
    """
    top = max(expert_bytes)
    ref = n_experts * (expert_bytes[REFERENCE_BITS] if REFERENCE_BITS in expert_bytes
                       else expert_bytes[top] * REFERENCE_BITS // top)
    staging = staging_bytes(expert_bytes if staged is None else {b: expert_bytes[b] for b in staged})
    fixed = non_expert_bytes + margin_bytes + staging
    kind, value = parse_budget(spec)
    if kind == "share":
        cache = int(value * ref)
        total = fixed + cache
    else:
        total = int(value)
        cache = total - fixed
        if cache < 0:
            raise MoetoolError(f"--budget {spec} is below the minimum of {size_text(fixed, up=True)} ({fixed:,} B: non-expert weights "
                               f"{size_text(non_expert_bytes)} + KV/activation margin {size_text(margin_bytes)} "
                               f"+ staging {size_text(staging)}).")
    return BudgetSplit(total_bytes=total, non_expert_bytes=non_expert_bytes, margin_bytes=margin_bytes,
                      staging_bytes=staging, cache_bytes=cache, expert_bytes_reference=ref)


class BudgetExceeded(RuntimeError):
    """An internal invariant broke: something asked for device bytes beyond the budget."""


class Budget:
    """Device bytes: what was promised, what is reserved, and the peak."""

    def __init__(self, total: int):
        self.total = int(total)
        self.used = 0
        self.peak = 0

    def try_reserve(self, nbytes: int) -> bool:
        if self.used + nbytes > self.total:
            return False
        self.used += nbytes
        self.peak = max(self.peak, self.used)
        return True

    def reserve(self, nbytes: int, what: str) -> None:
        if not self.try_reserve(nbytes):
            raise BudgetExceeded(f"{what} needs {nbytes} B but only {self.total - self.used} B of the budget is left")
