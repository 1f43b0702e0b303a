"""The profile stage: measure a model's routing, sensitivity, similarity, prefetch accuracy and timings.

One pass of traced forwards (prefill, then greedy decode steps) over each data set feeds routing,
similarity and prefetch; sensitivity scores held-out perplexity with experts swapped for quantized
ones; timing runs decode steps with timers. Each part is optional (`what`).

    prof = profile(ProfileConfig(model="demo", data=("heldout", "general_knowledge"), what=("routing",)))
    prof.save(Path("demo.profile.json")); prof.routing.layers[0].gini
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from moetool.artifacts import Artifact, sha256_file
from moetool.defaults import DEFAULT_HW
from moetool.errors import MoetoolError
from moetool.inference import context_length
from moetool.model import LoadedModel, load_model
from moetool.quant.bundle import load_bundle_model
from moetool.schema import SchemaError
from moetool.profile.data import load_sequences
from moetool.profile.prefetch import PrefetchAccumulator, PrefetchProfile
from moetool.profile.routing import RoutingAccumulator, RoutingProfile
from moetool.profile.sensitivity import INT2_SHARES, MemoryQuantizer, SensitivityProfile, \
    measure_sensitivity
from moetool.profile.similarity import SimilarityAccumulator, SimilarityProfile
from moetool.profile.timing import TimingProfile, measure_timing
from moetool.profile.trace import Tracer, route
from moetool.quant.format import Bits
from moetool.spec import check_device, resolve_dtype

WHAT = ("routing", "sensitivity", "similarity", "prefetch", "timing")
Progress = Callable[[str, int, int], None]  # (part, done, total)


@dataclass(frozen=True)
class ProfileConfig:
    model: str | None = None  # None: the bundle's own model, or the demo model without a bundle
    bundle: Path | None = None
    data: tuple[str, ...] = ("heldout", "general_knowledge", "movie_recommendation")
    what: tuple[str, ...] = ("all",)
    seqs_per_data: int = 4  # sequences (prompts) per data set
    seq_len: int = 128  # tokens per text sequence
    decode_tokens: int = 16  # greedy decode steps after each prompt
    hh_ratio: float = 0.2  # heavy-hitter share of a prompt's tokens (DyMoE eq. 2)
    sensitivity_bits: tuple[int, ...] = (2,)  # DyMoE Fig. 5 uses INT2; add 4 for INT4
    int2_shares: tuple[float, ...] = INT2_SHARES  # Fate Fig. 10; () to skip
    ppl_data: str = "heldout"
    ppl_tokens: int = 512
    ppl_seq_len: int = 256
    timing_steps: int = 8
    hw_base: str = DEFAULT_HW  # preset whose throughputs the written hardware profile keeps
    device: str = "cpu"
    dtype: str = "auto"  # auto: bf16 on CUDA, fp32 on CPU (recorded resolved in `info.dtype`)
    seed: int = 0

    def recorded(self) -> dict[str, Any]:
        """These settings as `Profile.settings` holds them: tuples as lists, paths as strings, as JSON reads back."""
        return json.loads(json.dumps(dataclasses.asdict(self), default=str))


@dataclass(frozen=True)
class ModelInfo:
    """What fit needs of the model without loading it: shapes and memory."""

    moe_layers: tuple[int, ...]
    num_hidden_layers: int
    num_experts: int
    top_k: int
    expert_bytes: dict[int, int]  # bits -> one expert's blob
    expert_bytes_source: str  # "bundle DIR" or "layout (not quantized)"
    non_expert_bytes: int  # at `dtype`
    kv_margin_bytes: int  # `run`'s margin without its own lengths: KV for PLAN_TOKENS, activations, decode workspace
    staging_bytes: int  # the engine's staging buffers
    dtype: str

    def validate(self) -> None:
        """On read: a model has experts and MoE layers, and an expert's size at each stored precision."""
        if not self.moe_layers:
            raise SchemaError("moe_layers", "is empty; a MoE model has at least one MoE layer")
        for i, layer in enumerate(self.moe_layers):
            if not 0 <= layer < self.num_hidden_layers:
                raise SchemaError(f"moe_layers[{i}]", f"is {layer}, not a layer of the {self.num_hidden_layers}")
        if self.num_experts < 1:
            raise SchemaError("num_experts", f"is {self.num_experts}; a MoE layer has at least one expert")
        if not 1 <= self.top_k <= self.num_experts:
            raise SchemaError("top_k", f"is {self.top_k}, not between 1 and the {self.num_experts} experts")
        stored = {int(b) for b in Bits}
        if not self.expert_bytes:
            raise SchemaError("expert_bytes", "is empty; it gives an expert's size at each stored precision")
        for bits, nbytes in self.expert_bytes.items():
            if bits not in stored:
                raise SchemaError(f"expert_bytes[{bits!r}]", "is not a stored precision "
                                                             f"({', '.join(map(str, sorted(stored)))})")
            if nbytes < 1:
                raise SchemaError(f"expert_bytes[{bits!r}]", f"is {nbytes}; an expert takes at least one byte")


@dataclass(frozen=True)
class Profile(Artifact):
    """What `moetool profile` measured on one model. A part not asked for is None."""

    SCHEMA: ClassVar[str] = "profile"
    SCHEMA_VERSION: ClassVar[int] = 1

    what: tuple[str, ...]
    data: dict[str, int]  # data set -> sequences profiled
    settings: dict[str, Any]
    info: ModelInfo
    routing: RoutingProfile | None = None
    sensitivity: SensitivityProfile | None = None
    similarity: SimilarityProfile | None = None
    prefetch: PrefetchProfile | None = None
    timing: TimingProfile | None = None
    hw: dict[str, Any] | None = None  # the hardware profile JSON written from `timing`

    def validate(self) -> None:
        """On read, what fit and report index by: parts of this model's shape, one count per expert."""
        bad = [w for w in self.what if w not in WHAT]
        if bad:
            raise SchemaError("what", f"names {bad[0]!r}, not one of {', '.join(WHAT)}")
        r, experts = self.routing, self.info.num_experts
        if r is not None:
            if (r.num_experts, r.top_k) != (experts, self.info.top_k):
                raise SchemaError("routing", f"is of {r.num_experts} experts, top-{r.top_k}, but info says "
                                             f"{experts}, top-{self.info.top_k}")
            if not r.layers:
                raise SchemaError("routing.layers", "is empty")
            for i, lr in enumerate(r.layers):
                for name in ("prefill", "decode", "heavy_hitter", "mean_sorted_score"):
                    if len(getattr(lr, name)) != experts:
                        raise SchemaError(f"routing.layers[{i}].{name}", f"holds {len(getattr(lr, name))} values, "
                                                                         f"not one per expert ({experts})")
            for name, counts in r.score_hist.items():
                if len(counts) != len(r.score_bins) - 1:
                    raise SchemaError(f"routing.score_hist[{name!r}]", f"holds {len(counts)} counts, not one per "
                                                                       f"bin ({len(r.score_bins) - 1})")
            _finite("routing.score_bins", r.score_bins, low=0.0)
            _finite("routing.jaccard", r.jaccard, low=0.0, high=1.0)
        s = self.sensitivity
        if s is not None:
            if not s.bits or any(b not in (2, 4, 8) for b in s.bits):
                raise SchemaError("sensitivity.bits", f"is {list(s.bits)}, not a choice among 2, 4, 8")
            _finite("sensitivity.base_ppl", [s.base_ppl], low=1.0)
            for i, ls in enumerate(s.layers):
                for name in ("ppl", "delta"):
                    lacking = [b for b in s.bits if b not in getattr(ls, name)]
                    if lacking:
                        raise SchemaError(f"sensitivity.layers[{i}].{name}", f"lacks the {lacking[0]}-bit value")
                _finite(f"sensitivity.layers[{i}].ppl", ls.ppl, low=1.0)
                _finite(f"sensitivity.layers[{i}].delta", ls.delta)
            for share in s.int2_share:
                try:
                    ok = 0.0 <= float(share) <= 1.0
                except ValueError:
                    ok = False
                if not ok:
                    raise SchemaError(f"sensitivity.int2_share[{share!r}]", "is keyed by a share of the experts "
                                                                            "at INT2, a number in [0, 1]")
            _finite("sensitivity.int2_share", s.int2_share, low=1.0)
        if self.prefetch is not None:
            for i, lp in enumerate(self.prefetch.layers):
                for name in ("recall_topk", "recall_p75"):
                    _finite(f"prefetch.layers[{i}].{name}", getattr(lp, name), low=0.0, high=1.0)
            for position, phases in self.prefetch.positions.items():
                _finite(f"prefetch.positions[{position!r}]", phases, low=0.0, high=1.0)


def _finite(field: str, values: Any, low: float | None = None, high: float | None = None) -> None:
    """Refuse, naming the field, a value of `values` (a list or a dict's values) that is NaN or
    infinite, or outside [low, high]: measurements fit and report compute with (a perplexity is at
    least 1, a recall or a Jaccard index lies in [0, 1])."""
    items = values.items() if isinstance(values, dict) else enumerate(values)
    for key, v in items:
        where = f"{field}[{key!r}]"
        if not math.isfinite(v):
            raise SchemaError(where, f"is {v}; a measurement is a finite number")
        if low is not None and v < low:
            raise SchemaError(where, f"is {v}; it must be at least {low}" + (f" (and at most {high})" if high is not None else ""))
        if high is not None and v > high:
            raise SchemaError(where, f"is {v}; it must be at most {high}")


def parse_what(items: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    names = [w.strip() for item in items for w in str(item).split(",") if w.strip()]
    bad = [w for w in names if w not in (*WHAT, "all")]
    if bad:
        raise MoetoolError(f"--what {bad[0]} is not one of all, {', '.join(WHAT)}.")
    return WHAT if not names or "all" in names else tuple(w for w in WHAT if w in names)


def _info(lm: LoadedModel, bundle, dtype: torch.dtype, dtype_name: str) -> ModelInfo:
    from moetool.engine.budget import PLAN_TOKENS, plan_margin, staging_bytes

    g = lm.geometry.layers[0]
    if bundle is not None:
        sizes = {int(b): bundle.entry(g.index, 0, b).nbytes for b in bundle.manifest.bits}
        how = f"bundle {bundle.directory}"
    else:
        from moetool.quant.format import make_layout
        from moetool.quant.format import auto_group_size

        gate_up = (2 * g.intermediate_size if g.gated else g.intermediate_size, g.hidden_size)
        gs = auto_group_size(lm.geometry.layers)  # what `moetool quantize` picks
        sizes = {b: make_layout(b, gate_up, (g.hidden_size, g.intermediate_size), g.has_bias, gs).nbytes
                 for b in (16, 8, 4, 2)}
        how = f"hqq layout at group size {gs} (no bundle given)"
    return ModelInfo(moe_layers=tuple(x.index for x in lm.geometry.layers),
                     num_hidden_layers=lm.geometry.num_hidden_layers, num_experts=g.num_experts, top_k=g.top_k,
                     expert_bytes=sizes, expert_bytes_source=how, non_expert_bytes=lm.non_expert_bytes(),
                     kv_margin_bytes=plan_margin(lm.model.config, lm.geometry.layers, PLAN_TOKENS, 1, dtype,
                                                 decoded=any(b != 16 for b in sizes) or dtype != torch.bfloat16),
                     staging_bytes=staging_bytes(sizes), dtype=dtype_name)


def _check(cfg: ProfileConfig) -> None:
    check_device(cfg.device)  # before the model loads: a device this machine lacks is one sentence
    resolve_dtype(cfg.dtype, cfg.device)  # refuses an unknown dtype in one sentence
    if cfg.seqs_per_data < 1:
        raise MoetoolError(f"--seqs must be at least 1, not {cfg.seqs_per_data}.")
    if cfg.seq_len < 2 or cfg.ppl_tokens < 2:
        raise MoetoolError(f"--seq-len and --ppl-tokens must be at least 2 tokens (a prediction needs one token "
                           f"before it), not {cfg.seq_len} and {cfg.ppl_tokens}.")
    if cfg.decode_tokens < 0:
        raise MoetoolError(f"--decode-tokens must not be negative, not {cfg.decode_tokens}.")
    if not 0 < cfg.hh_ratio <= 1:
        raise MoetoolError("the heavy-hitter ratio must be in (0, 1].")
    if any(b not in (2, 4, 8) for b in cfg.sensitivity_bits):
        raise MoetoolError("sensitivity bits must be among 2, 4, 8.")
    if cfg.bundle is not None and not (Path(cfg.bundle) / "bundle.json").is_file():
        raise MoetoolError(f"{cfg.bundle} is not a bundle directory (no bundle.json in it).")


def profile(cfg: ProfileConfig, progress: Progress | None = None) -> Profile:
    """Measure `cfg.what` on `cfg.model` over `cfg.data`."""
    _check(cfg)
    tick = progress or (lambda part, done, total: None)
    what = parse_what(cfg.what)
    dtype = resolve_dtype(cfg.dtype, cfg.device)
    torch.manual_seed(cfg.seed)
    inputs: dict[str, str] = {}
    bundle = None
    if cfg.bundle is not None and cfg.model is None:  # the bundle's own model: no checkpoint is read
        lm = load_bundle_model(Path(cfg.bundle), device=cfg.device, dtype=dtype)
    else:
        lm = load_model(cfg.model or "demo", device=cfg.device, dtype=dtype)
    if cfg.bundle is not None:
        from moetool.quant.bundle import Bundle

        bundle = lm.bundle or Bundle.open(Path(cfg.bundle), model=lm.fingerprint)
        inputs[str(Path(cfg.bundle) / "bundle.json")] = sha256_file(Path(cfg.bundle) / "bundle.json")
        needed = (*cfg.sensitivity_bits, *((4, 2) if cfg.int2_shares else ())) if "sensitivity" in what else ()
        missing = [b for b in needed if b not in bundle.manifest.bits]
        if missing:
            raise MoetoolError(f"the bundle in {cfg.bundle} lacks {missing[0]}-bit experts that the "
                               "sensitivity measurement needs; quantize with those bits.")
    data: dict[str, list[torch.Tensor]] = {}
    for name in dict.fromkeys(cfg.data):
        data[name], inputs[f"data:{name}"] = load_sequences(lm, name, cfg.seqs_per_data, cfg.seq_len)
    limit = context_length(lm.model)
    traced = bool({"routing", "similarity", "prefetch"} & set(what))  # what runs --seq-len + --decode-tokens
    if traced and limit is not None and cfg.seq_len + cfg.decode_tokens > limit:
        raise MoetoolError(f"--seq-len {cfg.seq_len} plus --decode-tokens {cfg.decode_tokens} is "
                           f"{cfg.seq_len + cfg.decode_tokens} tokens, more than {lm.path}'s context of {limit} "
                           "(max_position_embeddings in its config.json).")
    parts: dict[str, Any] = {}
    if traced:
        parts.update(_trace_parts(lm, cfg, what, data, tick))
    if "sensitivity" in what:
        seq_len = min(cfg.ppl_seq_len, cfg.ppl_tokens, limit or cfg.ppl_seq_len)  # windows within the model's context
        chunks, inputs[f"data:{cfg.ppl_data}"] = load_sequences(lm, cfg.ppl_data, cfg.ppl_tokens // seq_len, seq_len)
        source = bundle or MemoryQuantizer(lm)
        name = f"bundle {cfg.bundle}" if bundle is not None else "hqq in memory (calibration-free)"
        parts["sensitivity"] = measure_sensitivity(
            lm, source, chunks, tuple(cfg.sensitivity_bits), tuple(cfg.int2_shares), cfg.ppl_data, name,
            progress=lambda d, t: tick("sensitivity", d, t))
    info = _info(lm, bundle, dtype, str(dtype).removeprefix("torch."))  # before timing installs an engine in lm
    if "timing" in what:
        tick("timing", 0, 1)
        ids = next(iter(data.values()))[0][:, :32]
        parts["timing"] = measure_timing(lm, _timing_blobs(lm, bundle), ids, cfg.timing_steps,
                                         store=_captured_store(lm, bundle, dtype))
        from moetool.profile.timing import hw_profile

        parts["hw"] = hw_profile(parts["timing"], cfg.hw_base,
                                 name=f"{lm.fingerprint.model_type}-{parts['timing'].device}-measured")
        tick("timing", 1, 1)
    return Profile(model=lm.fingerprint, inputs=inputs, what=what, data={k: len(v) for k, v in data.items()},
                   settings=cfg.recorded(), info=info, **parts)


def _captured_store(lm: LoadedModel, bundle, dtype: torch.dtype):
    """The store whose captured step the timing part measures, where `--decode auto` takes that step:
    on CUDA, for the model types it is checked on (engine/decode.py). None elsewhere."""
    from moetool.engine.decode import VERIFIED_MODEL_TYPES
    from moetool.engine.store import HostStore

    if next(lm.model.parameters()).device.type != "cuda" or lm.fingerprint.model_type not in VERIFIED_MODEL_TYPES:
        return None
    return HostStore.from_bundle(bundle, dtype) if bundle is not None else HostStore.from_experts(lm.experts, dtype)


def _trace_parts(lm: LoadedModel, cfg: ProfileConfig, what: tuple[str, ...], data: dict[str, list[torch.Tensor]],
                 tick: Progress) -> dict[str, Any]:
    g = lm.geometry.layers[0]
    layers = tuple(x.index for x in lm.geometry.layers)
    accs: dict[str, Any] = {}
    if "routing" in what:
        accs["routing"] = RoutingAccumulator(g.num_experts, g.top_k, layers, cfg.hh_ratio, cfg.seed)
    if "similarity" in what:
        accs["similarity"] = SimilarityAccumulator(layers)
    if "prefetch" in what:
        accs["prefetch"] = PrefetchAccumulator(lambda layer, h: route(lm, layer, h), g.num_experts, g.top_k)
    tracer = Tracer(lm, attention_weights="routing" in what)
    total, done = sum(len(v) for v in data.values()), 0
    try:
        for name, seqs in data.items():
            for ids in seqs:
                for trace in tracer.sequence_traces(ids, cfg.decode_tokens):
                    for part, acc in accs.items():
                        if part == "routing":
                            acc.add(trace, name)
                        else:
                            acc.add(trace)
                done += 1
                tick("trace", done, total)
    finally:
        tracer.close()
    return {part: acc.result() for part, acc in accs.items()}


def _timing_blobs(lm: LoadedModel, bundle) -> dict[int, tuple[torch.Tensor, Any]]:
    g = lm.geometry.layers[0]
    if bundle is not None:
        return {int(b): (bundle.blob(g.index, 0, b).clone(), bundle.layout(bundle.entry(g.index, 0, b)))
                for b in bundle.manifest.bits}
    quantizer = MemoryQuantizer(lm)
    return {b: quantizer.blob(g.index, 0, b) for b in (16, 8, 4, 2)}


__all__ = ["ModelInfo", "Profile", "ProfileConfig", "WHAT", "parse_what", "profile"]
