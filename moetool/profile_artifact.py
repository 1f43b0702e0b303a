"""The artifact of `moetool profile` (`Profile`) and its parts, read without torch (`moetool report`,
`moetool fit`); each part is measured by the module of `profile/` its section names, and the stage
itself is `profile/__init__.py`.

    prof = Profile.load(Path("demo.profile.json")); prof.routing.layers[0].gini
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar

from moetool.artifacts import Artifact
from moetool.bits import Bits
from moetool.schema import SchemaError

WHAT = ("routing", "sensitivity", "similarity", "prefetch", "timing")


# -- routing (`profile/routing.py`) ----------------------------------------------------------------


@dataclass(frozen=True)
class LayerRouting:
    """One MoE layer; per-expert lists are indexed by expert id."""

    layer: int
    prefill: tuple[int, ...]  # [E] routed (token, slot) pairs in prefill
    decode: tuple[int, ...]  # [E] routed (token, slot) pairs in decode
    heavy_hitter: tuple[int, ...]  # [E] heavy-hitter tokens routed to the expert, prefill (DyMoE eq. 2)
    hh_load_corr: float | None  # Pearson r between token load and heavy-hitter load (DyMoE Fig. 4's claim)
    top10_share: float  # share of routed tokens taken by the top 10% of experts (prefill + decode)
    top25_share: float
    gini: float  # 0 = every expert equally loaded, -> 1 = one expert takes everything
    entropy: float  # of the load distribution, normalised by log(E) (1 = uniform)
    mean_sorted_score: tuple[float, ...]  # [E] mean gate score by rank, decode (SMoE Fig. 4)
    by_data: dict[str, tuple[int, ...]]  # data set -> [E] counts, prefill + decode
    hot_sets: dict[str, tuple[int, ...]]  # data set -> its top-`hot_k` experts, most used first


@dataclass(frozen=True)
class RoutingProfile:
    tokens: dict[str, int]  # phase -> tokens routed (per layer)
    top_k: int
    num_experts: int
    hh_ratio: float
    importance: str  # how token importance was measured ("eager attention ..." or "unavailable: ...")
    hot_k: int
    layers: tuple[LayerRouting, ...]
    score_bins: tuple[float, ...]  # histogram edges of softmax gate scores
    score_hist: dict[str, tuple[int, ...]]  # "selected" / "unselected" -> counts per bin, all layers, decode
    jaccard: dict[str, float]  # "A|B" -> mean over layers of |hot_A & hot_B| / |hot_A | hot_B|
    activation_ratio: dict[str, dict[str, float]]  # phase -> batch size -> mean share of experts activated


# -- sensitivity (`profile/sensitivity.py`) --------------------------------------------------------


@dataclass(frozen=True)
class LayerSensitivity:
    layer: int
    ppl: dict[int, float]  # bits -> held-out perplexity with this layer's experts at those bits
    delta: dict[int, float]  # bits -> ppl - base_ppl


@dataclass(frozen=True)
class SensitivityProfile:
    base_ppl: float  # every expert at the checkpoint's precision
    tokens: int  # held-out tokens scored
    data: str
    source: str  # "bundle DIR" or "hqq in memory, group size G"
    bits: tuple[int, ...]
    layers: tuple[LayerSensitivity, ...]
    int2_share: dict[str, float]  # Fate Fig. 10: share p (as text) -> perplexity (INT4 cache, INT2 for the share)


# -- similarity (`profile/similarity.py`) ----------------------------------------------------------


@dataclass(frozen=True)
class LayerSimilarity:
    """MoE layer `layer` (i+1) against the MoE layer before it (`previous`, i)."""

    layer: int
    previous: int
    positions: dict[str, float]  # Fate position -> mean cosine with Gate_in of `layer`


@dataclass(frozen=True)
class SimilarityProfile:
    adjacent: tuple[float, ...]  # [n_layers - 1] mean cos(h_l, h_{l+1}) of decoder layer outputs (DyMoE Fig. 6)
    layers: tuple[LayerSimilarity, ...]
    positions: dict[str, float]  # Fate Table 1 "Average Similarity": mean over MoE layer pairs
    tokens: int


# -- prefetch accuracy (`profile/prefetch.py`) -----------------------------------------------------


@dataclass(frozen=True)
class LayerPrefetch:
    layer: int  # the predicted MoE layer (i+1)
    previous: int  # the MoE layer whose gate input feeds the prediction (i)
    recall_topk: dict[str, float]  # phase -> mean recall
    recall_p75: dict[str, float]
    fetched_p75: dict[str, float]  # phase -> mean experts in the 75th-percentile set
    smoe_recall: float | None  # decode: true top-score experts that the predicted top-score set holds
    smoe_precision: float | None
    positions: dict[str, dict[str, float]]  # Fate position -> phase -> recall at top-k


@dataclass(frozen=True)
class PrefetchProfile:
    layers: tuple[LayerPrefetch, ...]
    positions: dict[str, dict[str, float]]  # Fate Table 1 "Prefetch Accuracy": position -> phase -> mean
    percentile: float
    smoe_alpha: float
    samples: dict[str, int]  # phase -> samples per layer (prompts in prefill, tokens in decode)


# -- timings (`profile/timing.py`) -----------------------------------------------------------------


@dataclass(frozen=True)
class LayerTiming:
    layer: int
    t_attn: float  # s, one decode token through the decoder layer outside its MoE block (attention or another mixer, norms)
    t_gate: float  # s, the router
    t_moe: float  # s, the whole MoE block (router, routed and shared experts)
    t_experts: float  # s, the routed experts alone (k experts from host memory in this measurement)


@dataclass(frozen=True)
class ExpertTiming:
    bits: int
    nbytes: int  # one expert's blob
    load_s: float  # host -> compute device copy of the blob (a host memcpy on CPU)
    dequant_s: float  # blob -> weights in the compute dtype (0 where the path reads the codes as stored)
    compute_s: float  # one token through the expert: its share of a layer's top-k, as the path runs them
    path: str = "grouped"  # the engine's path that was timed (`PATHS`)
    convert_s: float = 0.0  # once per fill, not per use: a CPU kernel's rewrite of a blob as it lands


@dataclass(frozen=True)
class TimingProfile:
    device: str
    dtype: str
    steps: int  # decode steps timed per layer (medians reported)
    layers: tuple[LayerTiming, ...]
    experts: tuple[ExpertTiming, ...]
    c_cpu_s: float  # one reference-precision expert, one token, on the host CPU (SMoE's C_CPU)
    h2d_gbps: float | None  # measured pinned host-to-device bandwidth; None without CUDA
    t_dense_s: float  # mean over MoE layers of t_attn + (t_moe - t_experts): the router is inside t_moe
    # The same inside the captured decode step (one graph replay on CUDA: no launches from the host,
    # so far below t_dense_s there): a captured step with every expert resident, less its experts'
    # time, per MoE layer. None where it was not measured (`captured_note` says why).
    t_dense_captured_s: float | None = None
    captured_note: str = ""


# -- the profile -----------------------------------------------------------------------------------


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
        if len(set(self.moe_layers)) != len(self.moe_layers):
            raise SchemaError("moe_layers", f"names a layer twice ({list(self.moe_layers)})")
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
    notes: tuple[str, ...] = ()  # what the model did not read of the data (unknown tokens, dropped characters)

    def validate(self) -> None:
        """On read, what fit and report index by: parts of this model's shape, one count per expert."""
        bad = [w for w in self.what if w not in WHAT]
        if bad:
            raise SchemaError("what", f"names {bad[0]!r}, not one of {', '.join(WHAT)}")
        _all_finite("", self)  # profile writes no NaN: one is an edit, and fit would compute with it
        moe = set(self.info.moe_layers)
        for part in ("routing", "sensitivity", "similarity", "prefetch", "timing"):
            value = getattr(self, part)
            if value is not None and hasattr(value, "layers"):
                # similarity and prefetch pair each MoE layer with the one before: none for a single MoE layer
                pairs = part in ("similarity", "prefetch") and len(moe) < 2
                _moe_layers(f"{part}.layers", value.layers, moe, empty_ok=pairs or part == "sensitivity")
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
            for phase, ratios in r.activation_ratio.items():
                for size in ratios:
                    if not (size.isdigit() and int(size) >= 1):
                        raise SchemaError(f"routing.activation_ratio[{phase!r}][{size!r}]", "is keyed by a batch "
                                                                                            "size, a whole number of at least 1")
                _finite(f"routing.activation_ratio[{phase!r}]", ratios, low=0.0, high=1.0)
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
            if s.int2_share and not any(float(share) == 0.0 for share in s.int2_share):
                raise SchemaError("sensitivity.int2_share", "lacks the share 0 (no expert at INT2), the perplexity "
                                                            "each other share's loss is measured from")
        t = self.timing
        if t is not None:
            for i, lt in enumerate(t.layers):
                _finite(f"timing.layers[{i}]", {n: getattr(lt, n) for n in ("t_attn", "t_gate", "t_moe", "t_experts")},
                        low=0.0)
            if t.h2d_gbps is not None and not t.h2d_gbps > 0:
                raise SchemaError("timing.h2d_gbps", f"is {t.h2d_gbps}; a measured bandwidth is above 0")
        if self.prefetch is not None:
            for i, lp in enumerate(self.prefetch.layers):
                for name in ("recall_topk", "recall_p75"):
                    _finite(f"prefetch.layers[{i}].{name}", getattr(lp, name), low=0.0, high=1.0)
            for position, phases in self.prefetch.positions.items():
                _finite(f"prefetch.positions[{position!r}]", phases, low=0.0, high=1.0)


def _all_finite(field: str, value: Any) -> None:
    """Refuse, naming the field, any float in `value` (a dataclass, a tuple, a dict, nested) that is NaN
    or infinite."""
    if isinstance(value, float):
        if not math.isfinite(value):
            raise SchemaError(field, f"is {value}; a measurement is a finite number")
    elif dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            _all_finite(f"{field}.{f.name}" if field else f.name, getattr(value, f.name))
    elif isinstance(value, dict):
        for k, v in value.items():
            _all_finite(f"{field}[{k!r}]", v)
    elif isinstance(value, (tuple, list)):
        for i, v in enumerate(value):
            _all_finite(f"{field}[{i}]", v)


def _moe_layers(field: str, layers: tuple, moe: set[int], empty_ok: bool = False) -> None:
    """A part's per-layer entries: each of a MoE layer of the model (`info.moe_layers`; `previous`
    too, where the entry has one), each layer once, and at least one where the part was measured
    (fit reads its knobs off them)."""
    if not layers and not empty_ok:
        raise SchemaError(field, "is empty; the part was measured on the model's MoE layers")
    seen: set[int] = set()
    for i, entry in enumerate(layers):
        for name in ("layer", "previous"):
            index = getattr(entry, name, None)
            if index is not None and index not in moe:
                raise SchemaError(f"{field}[{i}].{name}", f"is {index}, not a MoE layer of the model "
                                                          f"(info.moe_layers: {sorted(moe)})")
        if entry.layer in seen:
            raise SchemaError(f"{field}[{i}].layer", f"is {entry.layer} again; each layer is measured once")
        seen.add(entry.layer)


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
