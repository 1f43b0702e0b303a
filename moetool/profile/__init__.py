"""The profile stage: measure a model's routing, sensitivity, similarity, prefetch accuracy and timings.

One pass of traced forwards (prefill, then greedy decode steps) over each data set feeds routing,
similarity and prefetch; sensitivity scores held-out perplexity with experts swapped for quantized
ones; timing runs decode steps with timers. Each part is optional (`what`). The artifact, `Profile`
and its parts, is `moetool/profile_artifact.py` (read without torch).

    prof = profile(ProfileConfig(model="demo", data=("heldout", "general_knowledge"), what=("routing",)))
    prof.save(Path("demo.profile.json")); prof.routing.layers[0].gini
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moetool.artifacts import sha256_file
from moetool.defaults import DEFAULT_HW
from moetool.errors import MoetoolError
from moetool.inference import context_length, context_words
from moetool.model import LoadedModel, load_model
from moetool.quant.bundle import load_bundle_model
from moetool.profile.data import load_sequences
from moetool.profile.prefetch import PrefetchAccumulator
from moetool.profile.routing import RoutingAccumulator
from moetool.profile.sensitivity import INT2_SHARES, MemoryQuantizer, measure_sensitivity
from moetool.profile.similarity import SimilarityAccumulator
from moetool.profile.timing import measure_timing
from moetool.profile.trace import Tracer, route
from moetool.profile_artifact import WHAT, ModelInfo, Profile
from moetool.router_scores import ScoreRules, score_rules
from moetool.spec import check_device, check_types, resolve_dtype

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
        """These settings as `Profile.settings` holds them: tuples as lists, paths as strings, as JSON reads back.
        The bundle and a local model as absolute paths: `fit --sweep` runs them from wherever it runs."""
        made = json.loads(json.dumps(dataclasses.asdict(self), default=str))
        for key in ("bundle", "model"):
            if made.get(key) and Path(made[key]).exists():
                made[key] = str(Path(made[key]).resolve())
        return made


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
                     # a run plans no more tokens than the model has positions (a 1,024-position model's
                     # margin for 4,096 made `fit --budget 20MiB` refuse what `run --budget 20MiB` ran)
                     kv_margin_bytes=plan_margin(lm.model.config, lm.geometry.layers,
                                                 min(PLAN_TOKENS, context_length(lm.model) or PLAN_TOKENS), 1, dtype,
                                                 decoded=any(b != 16 for b in sizes) or dtype != torch.bfloat16),
                     staging_bytes=staging_bytes(sizes), dtype=dtype_name)


def _check(cfg: ProfileConfig) -> None:
    check_types(cfg)  # a config built in Python (`data="heldout"` had been seven one-letter data sets)
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
    # --seed seeds the timing part's random activations, in a fork of torch's global generator: a
    # caller's own random stream (a notebook's, a script's) is where it was after the call.
    device = torch.device(cfg.device)
    with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
        torch.manual_seed(cfg.seed)
        return _measure(cfg, progress)


def _measure(cfg: ProfileConfig, progress: Progress | None) -> Profile:
    tick = progress or (lambda part, done, total: None)
    what = parse_what(cfg.what)
    dtype = resolve_dtype(cfg.dtype, cfg.device)
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
        measured = [w for w in what if w != "timing"]  # the parts that measure the model itself
        if cfg.model is None and 16 not in bundle.manifest.bits and measured:
            top = max(bundle.manifest.bits)
            raise MoetoolError(f"the bundle in {cfg.bundle} stores no bf16 reference (it was quantized with "
                               f"--no-reference), so {', '.join(measured)} would measure the model at its {top}-bit "
                               f"experts, not the model; add --model with the checkpoint it was quantized from, or "
                               f"profile only --what timing.")
        needed = (*cfg.sensitivity_bits, *((4, 2) if cfg.int2_shares else ())) if "sensitivity" in what else ()
        missing = [b for b in needed if b not in bundle.manifest.bits]
        if missing:
            raise MoetoolError(f"the bundle in {cfg.bundle} lacks {missing[0]}-bit experts that the "
                               "sensitivity measurement needs; quantize with those bits.")
    data: dict[str, list[torch.Tensor]] = {}
    notes: list[str] = []  # what the model does not read of the data (`profile.data._unread`)
    for name in dict.fromkeys(cfg.data):
        data[name], inputs[f"data:{name}"] = load_sequences(lm, name, cfg.seqs_per_data, cfg.seq_len, notes=notes)
    limit = context_length(lm.model)
    # timing: a prefill of up to 32 tokens, then timing_steps + 2 decode steps, all inside the model's positions
    room = 32 if limit is None else min(32, limit - cfg.timing_steps - 2)
    if "timing" in what and room < 1:
        raise MoetoolError(f"--what timing decodes {cfg.timing_steps + 2} tokens after its prompt, and {lm.path}'s "
                           f"context of {limit} ({context_words(lm.model)}) leaves no room for one.")
    traced = bool({"routing", "similarity", "prefetch"} & set(what))  # what runs --seq-len + --decode-tokens
    if traced and limit is not None and cfg.seq_len + cfg.decode_tokens > limit:
        raise MoetoolError(f"--seq-len {cfg.seq_len} plus --decode-tokens {cfg.decode_tokens} is "
                           f"{cfg.seq_len + cfg.decode_tokens} tokens, more than {lm.path}'s context of {limit} "
                           f"({context_words(lm.model)}).")
    # A prompt of a JSONL or task data set runs whole, whatever --seq-len says (which cuts only texts).
    longest = max((s.shape[-1] for seqs in data.values() for s in seqs), default=0)
    if traced and limit is not None and longest + cfg.decode_tokens > limit:
        raise MoetoolError(f"the longest prompt of --data ({longest} tokens) plus --decode-tokens {cfg.decode_tokens} "
                           f"is {longest + cfg.decode_tokens} tokens, more than {lm.path}'s context of {limit} "
                           f"({context_words(lm.model)}).")
    if "sensitivity" in what and limit is not None and limit < 2:  # its windows would predict nothing (ppl 1.0)
        raise MoetoolError(f"{lm.path}'s context is {limit} token ({context_words(lm.model)}): the sensitivity "
                           "part's perplexity windows need 2 tokens or more.")
    parts: dict[str, Any] = {}
    if traced:
        parts.update(_trace_parts(lm, cfg, what, data, tick))
    if "sensitivity" in what:
        seq_len = min(cfg.ppl_seq_len, cfg.ppl_tokens, limit or cfg.ppl_seq_len)  # windows within the model's context
        chunks, inputs[f"data:{cfg.ppl_data}"] = load_sequences(lm, cfg.ppl_data, cfg.ppl_tokens // seq_len, seq_len,
                                                                "--ppl-data", notes=notes)
        source = bundle or MemoryQuantizer(lm)
        name = f"bundle {cfg.bundle}" if bundle is not None else "hqq in memory (calibration-free)"
        parts["sensitivity"] = measure_sensitivity(
            lm, source, chunks, tuple(cfg.sensitivity_bits), tuple(cfg.int2_shares), cfg.ppl_data, name,
            progress=lambda d, t: tick("sensitivity", d, t))
    info = _info(lm, bundle, dtype, str(dtype).removeprefix("torch."))  # before timing installs an engine in lm
    if "timing" in what:
        tick("timing", 0, 1)
        ids = next(iter(data.values()))[0][:, :room]
        parts["timing"] = measure_timing(lm, _timing_blobs(lm, bundle), ids, cfg.timing_steps,
                                         store=_captured_store(lm, bundle, dtype))
        from moetool.profile.timing import hw_profile

        from moetool.engine import measured_on

        parts["hw"] = hw_profile(parts["timing"], cfg.hw_base, model=measured_on(lm),
                                 name=f"{lm.fingerprint.model_type}-{parts['timing'].device}-measured")
        tick("timing", 1, 1)
    return Profile(model=lm.fingerprint, inputs=inputs, what=what, data={k: len(v) for k, v in data.items()},
                   settings=cfg.recorded(), info=info, notes=tuple(dict.fromkeys(notes)), **parts)


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
    routers = score_rules(lm) if {"routing", "prefetch"} & set(what) else ScoreRules()
    if "routing" in what:
        accs["routing"] = RoutingAccumulator(g.num_experts, g.top_k, layers, cfg.hh_ratio, cfg.seed, routers)
    if "similarity" in what:
        accs["similarity"] = SimilarityAccumulator(layers)
    if "prefetch" in what:
        accs["prefetch"] = PrefetchAccumulator(lambda layer, h: route(lm, layer, h), g.num_experts, g.top_k,
                                                routers=routers)
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
