"""Load a Hugging Face MoE model with its experts owned by moetool instead of the device.

transformers 5 keeps each MoE block's experts as one fused module (`gate_up_proj` [E, 2I, H],
`down_proj` [E, H, I]; gpt_oss transposed with biases), decorated by `use_experts_implementation`.
`load_model` lets transformers read the checkpoint (it knows every architecture's key layout and
conversion), keeps the fused expert tensors in the checkpoint (`StreamedExperts` reads them a layer at a time),
puts a parameter-free `ProviderExperts` module in their place, and only then moves the rest of the model
to the device: expert weights never reach the device except through an expert provider.

    lm = load_model("path/to/ckpt", device="cpu", dtype=torch.float32)
    lm.geometry.layers[0].num_experts, lm.experts.get(lm.geometry.layers[0].index, 3).gate_up.shape
"""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from moetool.artifacts import ModelFingerprint
from moetool.checkpoint import (build_skeleton, causal_lm_class, find_experts_modules, load_dequantized, open_checkpoint,
                                text_config)
from moetool.errors import first_line as _first_line
from moetool.digest import DIGEST_VERSION, weights_digest
from moetool.errors import MoetoolError
from moetool.inference import refuse_unroutable
from moetool.source import check_task, load_config, load_generation_config, resolve_source
from moetool.tokenizer import load_tokenizer

# Config keys whose presence marks a model as Mixture-of-Experts (used only to word the error
# for an architecture whose experts are not a fused transformers module).
_MOE_CONFIG_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "ffn_config")
# Config keys that give the experts each token is routed to, where the router and block keep no `top_k`
# (Gemma 4's router reads `config.top_k_experts` at call time).
_TOP_K_CONFIG_KEYS = ("num_experts_per_tok", "top_k_experts", "moe_topk", "moe_k")
_LAYER_INDEX = re.compile(r"\blayers\.(\d+)\.")


@dataclass(frozen=True)
class ExpertWeights:
    """One expert's weights in a canonical, never-transposed layout."""

    gate_up: torch.Tensor  # [2I, H] gated (rows in the model's own order: [gate; up], or interleaved for gpt_oss) or [I, H]
    down: torch.Tensor  # [H, I]
    gate_up_bias: torch.Tensor | None = None  # [2I]
    down_bias: torch.Tensor | None = None  # [H]

    def tensors(self) -> dict[str, torch.Tensor]:
        parts = {"gate_up": self.gate_up, "down": self.down, "gate_up_bias": self.gate_up_bias,
                 "down_bias": self.down_bias}
        return {k: v for k, v in parts.items() if v is not None}

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> "ExpertWeights":
        return ExpertWeights(**{k: v.to(device=device, dtype=dtype or v.dtype) for k, v in self.tensors().items()})

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())


@dataclass(frozen=True)
class MoeLayer:
    """Geometry of one MoE block; `index` is the decoder layer index, the layer key everywhere."""

    index: int
    path: str  # module path of the block, e.g. "model.layers.3.mlp"
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    gated: bool  # gate_up (act(gate) * up) vs a single up projection
    transposed: bool  # checkpoint stores [E, H, 2I] (gpt_oss); ExpertWeights are always [2I, H]
    has_bias: bool
    concatenated: bool  # [gate; up] rows vs interleaved gate/up rows
    router: str  # attribute name of the router inside the block ("gate" or "router")
    shared_experts: tuple[str, ...]  # attribute names of always-on shared experts in the block


@dataclass(frozen=True)
class MoeGeometry:
    model_type: str
    num_hidden_layers: int
    layers: tuple[MoeLayer, ...]
    dense_layers: tuple[int, ...]  # decoder layers with a plain FFN (e.g. DeepSeek's first_k_dense_replace)

    def layer(self, index: int) -> MoeLayer:
        for layer in self.layers:
            if layer.index == index:
                return layer
        raise KeyError(f"layer {index} is not a MoE layer")


class ExpertProvider(Protocol):
    """Anything that hands out one expert's weights, ready to compute on `device`."""

    def get(self, layer: int, expert: int) -> ExpertWeights: ...


class StreamedExperts:
    """The checkpoint's fused expert tensors, read a few experts at a time and kept in a small LRU.

    `get` returns views (no copy) in the canonical layout. Experts are read from the memory-mapped
    checkpoint in spans of `chunk` experts (default: a whole layer) on first use and kept while they
    fit in `cache_bytes` (default: a quarter of the memory available at open), so a reference
    forward over a small model reads each layer once, and `quantize` (chunk 8, cache 0) holds eight
    experts whatever the number of experts per layer.
    """

    def __init__(self, checkpoint: Any, geometry: MoeGeometry, cache_bytes: int | None = None,
                 chunk: int | None = None):
        self.checkpoint, self.geometry, self.chunk = checkpoint, geometry, chunk
        self.cache_bytes = available_memory() // 4 if cache_bytes is None else cache_bytes
        self._spans: OrderedDict[tuple[int, int], dict[str, torch.Tensor]] = OrderedDict()

    def span(self, layer: int, start: int, stop: int) -> dict[str, torch.Tensor]:
        """Experts [start, stop) of a MoE layer: {"gate_up_proj": [n, 2I, H] (or [n, H, 2I]), "down_proj": ...}."""
        key = (layer, start)
        if key in self._spans:
            self._spans.move_to_end(key)
            return self._spans[key]
        fused = self.checkpoint.layer_experts(self.geometry.layer(layer).path + ".experts", start, stop)
        size = sum(t.numel() * t.element_size() for t in fused.values())
        while self._spans and self._bytes() + size > self.cache_bytes:
            self._spans.popitem(last=False)
        self._spans[key] = fused
        return fused

    def layer(self, index: int) -> dict[str, torch.Tensor]:
        """Every expert of one MoE layer, fused."""
        return self.span(index, 0, self.geometry.layer(index).num_experts)

    def get(self, layer: int, expert: int) -> ExpertWeights:
        g = self.geometry.layer(layer)
        width = self.chunk or g.num_experts
        start = expert // width * width
        return fused_expert(self.span(layer, start, min(start + width, g.num_experts)), g, expert - start)

    def _bytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in self._spans.values() for t in d.values())

    def clear(self) -> None:
        """Drop the cached spans (after their experts were copied elsewhere, e.g. into a host store)."""
        self._spans.clear()

    @property
    def nbytes(self) -> int:
        """All experts at the checkpoint's load dtype (computed from the geometry; nothing is read)."""
        item = self.checkpoint.dtype.itemsize
        return sum(g.num_experts * expert_numel(g) * item for g in self.geometry.layers)


def expert_numel(g: MoeLayer) -> int:
    proj = 2 * g.intermediate_size if g.gated else g.intermediate_size
    bias = proj + g.hidden_size if g.has_bias else 0
    return proj * g.hidden_size + g.hidden_size * g.intermediate_size + bias


def fused_expert(t: dict[str, torch.Tensor], g: MoeLayer, expert: int) -> ExpertWeights:
    """One expert of a layer's fused tensors, as views in the canonical (never transposed) layout."""
    gate_up, down = t["gate_up_proj" if g.gated else "up_proj"][expert], t["down_proj"][expert]
    if g.transposed:
        gate_up, down = gate_up.t(), down.t()  # [H, 2I] -> [2I, H]; [I, H] -> [H, I]
    return ExpertWeights(gate_up=gate_up, down=down,
                         gate_up_bias=t["gate_up_proj_bias" if g.gated else "up_proj_bias"][expert] if g.has_bias else None,
                         down_bias=t["down_proj_bias"][expert] if g.has_bias else None)


def available_memory() -> int:
    """Bytes this process can allocate now without swapping: what the kernel says (MemAvailable, or 8 GiB
    if unknown), less where a cgroup's memory limit (a container, a batch job's) or this process's
    address-space limit (`ulimit -v`) leaves less. MemAvailable is the whole machine's, so a budget
    sized from it alone was killed, or ran out of memory, inside such a limit."""
    free = 8 << 30
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                free = int(line.split()[1]) * 1024
    except OSError:
        pass
    return max(0, min(free, _cgroup_room(), _address_space_room()))


# Where a cgroup's memory limit and use are read: (mount, limit file, usage file, the page-cache entry of
# memory.stat), cgroup v2 first, then v1. The page cache (a bundle read through its mapping) counts as
# use there but is given back on demand, so it is not taken off the room.
_CGROUPS = {"v2": ("/sys/fs/cgroup", "memory.max", "memory.current", "file"),
            "v1": ("/sys/fs/cgroup/memory", "memory.limit_in_bytes", "memory.usage_in_bytes", "total_cache")}


def _cgroup_room() -> int:
    """What this process's memory cgroup and those above it leave under their limits; none: a huge number."""
    room = 1 << 62
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return room
    for line in lines:
        _, controllers, own = (line.split(":", 2) + ["", ""])[:3]
        version = "v2" if controllers == "" else "v1" if "memory" in controllers.split(",") else None
        if version is None:
            continue
        mount, limit_file, usage_file, cache_key = _CGROUPS[version]
        group = Path(mount) / own.strip().lstrip("/")
        for d in (group, *group.parents):  # a container sees its own group as the mount's root
            if not d.is_relative_to(mount):
                break
            try:
                limit, used = (d / limit_file).read_text().strip(), int((d / usage_file).read_text())
                stat = dict(ln.split()[:2] for ln in (d / "memory.stat").read_text().splitlines() if ln.strip())
                cache = int(stat.get(cache_key, 0))
            except (OSError, ValueError):
                continue
            if limit != "max" and int(limit) < 1 << 60:  # v1 writes "no limit" as a number near 2**63
                room = min(room, int(limit) - max(0, used - cache))
    return room


def _address_space_room() -> int:
    """What `ulimit -v` (RLIMIT_AS) leaves this process beyond the address space it maps now; unlimited:
    a huge number."""
    import resource

    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    if limit == resource.RLIM_INFINITY:
        return 1 << 62
    try:
        mapped = next(int(line.split()[1]) * 1024 for line in Path("/proc/self/status").read_text().splitlines()
                      if line.startswith("VmSize:"))
    except (OSError, StopIteration, ValueError):
        return limit
    return limit - mapped


class DeviceProvider:
    """Serve host experts on a compute device, copying per call (the reference path, not the engine)."""

    def __init__(self, host: ExpertProvider, device: torch.device | str, dtype: torch.dtype):
        self.host, self.device, self.dtype = host, torch.device(device), dtype

    def get(self, layer: int, expert: int) -> ExpertWeights:
        w = self.host.get(layer, expert)
        if w.gate_up.device == self.device and w.gate_up.dtype == self.dtype:
            return w
        return w.to(self.device, self.dtype)


class ProviderExperts(nn.Module):
    """Parameter-free stand-in for a fused experts module: same call, weights from a provider.

    It keeps the original module (with its parameters removed) as `impl` so that the model's own
    activation and gate (`act_fn`, gpt_oss's clamped `_apply_gate`) are used unchanged.
    """

    def __init__(self, original: nn.Module, layer: MoeLayer, provider: ExpertProvider):
        super().__init__()
        original._parameters.clear()
        self.impl = original
        self.layer = layer
        self.provider = provider

    def activation(self, h: torch.Tensor) -> torch.Tensor:
        """The model's own activation on gate_up's output: [n, 2I] -> [n, I] (or act([n, I]) ungated)."""
        return self.impl._apply_gate(h) if self.layer.gated else self.impl.act_fn(h)

    def expert_forward(self, x: torch.Tensor, w: ExpertWeights) -> torch.Tensor:
        """One expert's MLP on its tokens: [n, H] -> [n, H], with the model's own activation."""
        h = F.linear(x, w.gate_up, w.gate_up_bias)  # [n, 2I]
        return F.linear(self.activation(h), w.down, w.down_bias)  # [n, H]

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)  # [T, H]
        # The reference path loops over the experts hit in this call (a host sync is fine here;
        # the engine's module replaces this loop with a planned, sync-free one).
        for e in torch.unique(top_k_index).tolist():
            if not 0 <= e < self.layer.num_experts:  # some routers mark dropped slots with E
                continue
            # (slot, token) order, as transformers' eager loop: same rows in the same GEMM positions,
            # so fp32 results match bit for bit (BLAS rounds tail rows of a block differently).
            slot, token_idx = torch.where((top_k_index == e).t())  # [n], [n]
            y = self.expert_forward(hidden_states[token_idx], self.provider.get(self.layer.index, e))
            y = y * top_k_weights[token_idx, slot, None]  # [n, H]
            out.index_add_(0, token_idx, y.to(out.dtype))
        return out


@dataclass
class LoadedModel:
    """A model whose experts live outside it, plus what the rest of moetool needs to know.

    `experts` serves reference weights where a stage needs them (the checkpoint's, streamed per
    layer; or a bundle's highest stored precision); `bundle` is the opened bundle for bundle runs.
    """

    model: nn.Module
    tokenizer: Any
    geometry: MoeGeometry
    experts: ExpertProvider
    fingerprint: ModelFingerprint
    path: str
    bundle: Any = None  # quant.bundle.OpenBundle when loaded from a bundle

    def non_expert_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())


def _has_fused_experts_class(model: nn.Module) -> bool:
    """Whether the model's modeling file defines a fused experts module (a class it decorates with
    transformers' `use_experts_implementation`), even where this config instantiates none."""
    import sys

    module = sys.modules.get(type(model).__module__)
    return module is not None and getattr(module, "use_experts_implementation", None) is not None


# Config fields that decide which decoder layers are MoE, across architectures (named where none is).
_LAYOUT_KEYS = ("mlp_layer_types", "mlp_only_layers", "decoder_sparse_step", "first_k_dense_replace", "moe_layer_freq",
                "moe_layer_start_index", "moe_layer_end_index", "moe_layer_interval", "expert_layer_period",
                "expert_layer_offset", "interleave_moe_layer_step", "enable_moe_block", "num_experts",
                "num_local_experts", "n_routed_experts", "moe_num_experts")


def inspect_geometry(model: nn.Module) -> MoeGeometry:
    """Describe every MoE block of `model`; refuse dense models and unfused MoE architectures."""
    cfg = model.config
    text = text_config(cfg)  # composite (VL) configs nest it
    model_type = getattr(cfg, "model_type", type(model).__name__)
    experts = find_experts_modules(model)
    if not experts:
        if _has_fused_experts_class(model):
            fields = ", ".join(f"{k}={v!r}" for k in _LAYOUT_KEYS if (v := getattr(text, k, None)) is not None)
            raise MoetoolError(f"this '{model_type}' config builds no Mixture-of-Experts layer (every layer is dense "
                               f"under its {fields or 'config'}); moetool needs at least one MoE layer.")
        if any(getattr(cfg, k, None) for k in _MOE_CONFIG_KEYS):
            raise MoetoolError(f"moetool does not support the '{model_type}' architecture: its experts are not a "
                               "fused transformers experts module (supported: mixtral, qwen2_moe, qwen3_moe, olmoe, "
                               "deepseek_v2/v3, phimoe, granitemoe, gpt_oss and other fused-experts models).")
        raise MoetoolError(f"'{model_type}' is a dense model with no Mixture-of-Experts layers; moetool needs a MoE model.")
    n_layers = int(getattr(text, "num_hidden_layers", 0) or 0)
    layers = []
    for path, m in experts.items():
        block_path = path.rsplit(".", 1)[0]
        block = model.get_submodule(block_path)
        match = _LAYER_INDEX.search(path + ".")
        if match is None:
            raise MoetoolError(f"cannot tell the decoder layer of the experts module at '{path}' in '{model_type}'.")
        if getattr(m, "has_post_expert_norm", False):
            # Each expert's output goes through the module's own norm before its routing weight
            # (transformers' `has_post_expert_norm`): the engine's experts, the captured step's and the
            # fused kernels compute up (-> gate) -> down only, so running it would be silently wrong.
            raise MoetoolError(f"'{model_type}' normalises each expert's output (its experts module's "
                               "post_expert_norm), which moetool's experts do not compute; it is not supported.")
        w = m.gate_up_proj if m.has_gate else m.up_proj
        num_experts = w.shape[0]
        if m.is_transposed:
            hidden, proj = w.shape[1], w.shape[2]
        else:
            proj, hidden = w.shape[1], w.shape[2]
        router = next((n for n, c in block.named_children() if n in ("gate", "router")), "")
        # The first that is set, an explicit 0 included (refused below, not replaced by the next).
        found = (getattr(getattr(block, router, None), "top_k", None), getattr(block, "top_k", None),
                 *(getattr(text, k, None) for k in _TOP_K_CONFIG_KEYS))
        top_k = next((v for v in found if v is not None), None)
        if top_k is None:
            raise MoetoolError(f"cannot tell how many experts each token uses in '{model_type}' (no top_k on its "
                               f"router or block, none of {', '.join(_TOP_K_CONFIG_KEYS)} in its config).")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= int(num_experts):
            raise MoetoolError(f"'{model_type}' routes each token to {top_k!r} experts (its config's top-k, e.g. "
                               f"num_experts_per_tok), but a layer of {int(num_experts)} experts needs 1 to "
                               f"{int(num_experts)}.")
        layers.append(MoeLayer(
            index=int(match.group(1)), path=block_path, num_experts=int(num_experts), top_k=int(top_k),
            hidden_size=int(hidden), intermediate_size=int(proj // 2 if m.has_gate else proj),
            gated=bool(m.has_gate), transposed=bool(m.is_transposed), has_bias=bool(m.has_bias),
            concatenated=bool(m.is_concatenated), router=router,
            shared_experts=tuple(n for n, _ in block.named_children() if n.startswith("shared_expert"))))
    layers.sort(key=lambda g: g.index)
    moe_idx = {g.index for g in layers}
    return MoeGeometry(model_type=model_type, num_hidden_layers=n_layers, layers=tuple(layers),
                       dense_layers=tuple(i for i in range(n_layers) if i not in moe_idx))


def model_fingerprint(config: Any, source: str) -> ModelFingerprint:
    """`config`'s fingerprint, its local directory recorded resolved: a bundle quantized from `ckpt`, from
    `/abs/ckpt` or from `../ckpt` holds the same bytes, and a manifest that spelled the path as typed made
    them three bundles to every stage that keys a bundle by its manifest's sha256 (report's pairing,
    sweep's reuse)."""
    recorded = str(Path(source).resolve()) if Path(source).is_dir() else source
    return ModelFingerprint.of_config(recorded, config.to_dict(), weights_digest(source), DIGEST_VERSION)


def load_reference(source: str | Path, dtype: torch.dtype = torch.float32, experts_impl: str = "eager") -> nn.Module:
    """Plain transformers model on CPU with its experts inside, for comparisons (loads everything).

    `experts_impl` is transformers' experts kernel: "eager" (its per-expert loop, what
    `ProviderExperts` and the engine's eager path match) or "grouped_mm" (its default, what the
    engine's grouped path matches).
    """
    src = resolve_source(source)
    config = load_config(src)
    _check_architecture(config, src)
    try:
        model = (load_dequantized(src, config, dtype, experts_impl)  # FP8, MXFP4: the numbers moetool reads
                 or causal_lm_class(config).from_pretrained(src, dtype=dtype,
                                                            experts_implementation=experts_impl))
    except MoetoolError:
        raise
    except Exception as e:  # noqa: BLE001 - the checkpoint is user input: any failure is one sentence
        if "ignore_mismatched_sizes" in str(e):  # transformers' own sentence points at a report it logged
            raise MoetoolError(f"the weights of '{src}' do not fit its config.json: some tensor's shape differs from "
                               "what the config implies (moetool quantize or run names the tensor).") from None
        raise MoetoolError(f"cannot load the weights of '{src}': {_first_line(e)}") from None
    # Expert weights read from a mapped checkpoint can sit at any byte offset; a CPU GEMM (grouped_mm
    # on AVX-512) takes another path for unaligned operands and rounds differently. The engine keeps
    # experts in 64-byte aligned slots: the reference's experts get the same alignment (the same
    # numbers), so "bit for bit" compares the arithmetic, not the allocator.
    for experts in find_experts_modules(model).values():
        for p in experts.parameters():
            if p.data_ptr() % 64:
                p.data = p.data.clone()
    return model.eval()


def attention_for_decode(device: str | torch.device) -> None:
    """On CUDA, take cuDNN's fused attention out of SDPA's choices, process-wide. It builds and caches
    a graph for every (query, key) length it has not seen: profiled on an H100 (torch 2.11), a decode
    step at a new length spent ~2.2 ms of host time per attention call in it, against ~11 us once
    cached, so every token of a fresh process's generation paid it (a 4-layer model: 42 ms a step,
    8 ms with the graphs cached). Flash and memory-efficient attention take any length. No effect
    off CUDA."""
    if torch.device(device).type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)


def load_model(source: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
               provider: ExpertProvider | None = None, expert_cache_bytes: int | None = None,
               expert_chunk: int | None = None) -> LoadedModel:
    """Load `source` with every MoE block's experts replaced by a `ProviderExperts` module.

    The skeleton is built on the meta device, only the non-expert weights are read (streamed from
    the memory-mapped safetensors) and moved to `device`; the experts stay in the checkpoint and
    are read a span of experts at a time by `StreamedExperts` when something asks for them. Without
    `provider`, experts are served from there (copied to `device` per call).
    """
    src = resolve_source(source)
    config = load_config(src)
    _check_architecture(config, src)
    ckpt = open_checkpoint(src, config, dtype)
    model = ckpt.model
    geometry = inspect_geometry(model)
    experts = StreamedExperts(ckpt, geometry, expert_cache_bytes, expert_chunk)
    install_provider(model, geometry, provider or DeviceProvider(experts, device, dtype))
    load_generation_config(model, ckpt.directory)
    attention_for_decode(device)
    model.to(device)
    return LoadedModel(model=model, tokenizer=load_tokenizer(str(ckpt.directory)), geometry=geometry,
                       experts=experts, fingerprint=model_fingerprint(model.config, src), path=src)


def install_provider(model: nn.Module, geometry: MoeGeometry, provider: ExpertProvider) -> None:
    for layer in geometry.layers:
        block = model.get_submodule(layer.path)
        block.experts = ProviderExperts(block.experts, layer, provider)


def _check_architecture(config: Any, source: str) -> None:
    """Refuse dense and unsupported models from the config alone, before reading any weights."""
    check_task(config, source)
    skeleton = build_skeleton(config, torch.float32)
    refuse_unroutable(skeleton, inspect_geometry(skeleton).layers, source)
