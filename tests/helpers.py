"""Helpers several test modules share. Test modules import this one (and tiny.py), never each other.

    from helpers import one_error_line, tiny_moe, quantize_config
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import resource
import shutil
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from hypothesis import HealthCheck, settings

from moetool.artifacts import CheckReport, LayerCheck, ModelFingerprint
from moetool.fit_artifact import Fit
from moetool.evaluate import Eval
from moetool.model import ExpertWeights
from moetool.profile import ModelInfo, Profile
from moetool.profile.prefetch import LayerPrefetch, PrefetchProfile
from moetool.profile.routing import SCORE_BINS, LayerRouting, RoutingProfile
from moetool.profile.sensitivity import LayerSensitivity, SensitivityProfile
from moetool.profile.similarity import LayerSimilarity, SimilarityProfile
from moetool.profile.timing import ExpertTiming, LayerTiming, TimingProfile
from moetool.quant import QuantizeConfig
from moetool.quant.bundle import MANIFEST, _manifest_checksum
from moetool.run import Run
from moetool.sweep import Sweep
from tiny import TINY_CONFIGS

ARCHS = sorted(TINY_CONFIGS)

# ---- the CLI ------------------------------------------------------------------------------------


def one_error_line(result):
    """A CliRunner result that failed as a user mistake must: exit 1, one "error:" line, no traceback."""
    assert result.exit_code == 1, result.output
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    return lines[0]


# ---- tiny checkpoints, tokenizers, bundles --------------------------------------------------------


def tiny_moe(path: Path, seed: int = 0, **overrides) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                  shared_expert_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen2_moe", **kwargs)).save_pretrained(path)
    return path


def quantize_config(model: Path, out: Path, **overrides) -> QuantizeConfig:
    # group 16: the tiny experts' down projection is only 16 columns wide
    kwargs = dict(model=str(model), out=out, bits=(16, 8, 4, 2), group_size=16, dtype="float32", calibrate=True,
                  calib_tokens=256, calib_seq_len=64)
    kwargs.update(overrides)
    return QuantizeConfig(**kwargs)


def save_char_tokenizer(out: Path) -> None:
    """A character-level tokenizer (printable ASCII and newline: 98 ids, within the tiny vocab of 128)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = ["\n"] + [chr(i) for i in range(32, 127)]
    vocab = {"<unk>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>").save_pretrained(out)


# ---- quantized experts and the low-bit kernels -----------------------------------------------------


def gaussian_expert(rows: int = 128, hidden: int = 256, bias: bool = False, seed: int = 0) -> ExpertWeights:
    g = torch.Generator().manual_seed(seed)
    return ExpertWeights(gate_up=torch.randn(2 * rows, hidden, generator=g),  # [2I, H]
                         down=torch.randn(hidden, rows, generator=g),  # [H, I]
                         gate_up_bias=torch.randn(2 * rows, generator=g) if bias else None,
                         down_bias=torch.randn(hidden, generator=g) if bias else None)


KERNEL_IDS = torch.tensor([[5, 17, 33, 2, 9, 100, 45, 7], [1, 2, 3, 4, 5, 6, 7, 8]])


def close(got: torch.Tensor, want: torch.Tensor, share: float = 0.02) -> None:
    """The low-bit kernels' stated tolerance: within `share` of the largest magnitude of `want`."""
    got, want = got.float(), want.float()
    assert (got - want).abs().max() <= share * want.abs().max(), f"max diff {(got - want).abs().max():.4g}"


# ---- synthetic artifacts ---------------------------------------------------------------------------

FP = ModelFingerprint(source="synthetic", model_type="qwen2_moe", config_sha256="a" * 64)
INFO = ModelInfo(moe_layers=(0, 1, 2, 3), num_hidden_layers=4, num_experts=8, top_k=2,
                 expert_bytes={16: 4096, 8: 2304, 4: 1280, 2: 768}, expert_bytes_source="layout",
                 non_expert_bytes=1 << 20, kv_margin_bytes=1 << 20, staging_bytes=2 * (4096 + 2304 + 1280 + 768),
                 dtype="float32")


def synthetic_profile(model: ModelFingerprint = FP) -> Profile:
    """A profile of a 4-layer, 8-expert model with prefetch, sensitivity and timing parts."""
    acc = {1: 0.6, 2: 0.9, 3: 0.95}
    prefetch = PrefetchProfile(
        layers=tuple(LayerPrefetch(layer=i, previous=i - 1, recall_topk={"prefill": 1.0, "decode": a},
                                   recall_p75={"prefill": 1.0, "decode": min(1.0, a + 0.05)},
                                   fetched_p75={"prefill": 8.0, "decode": 2.0}, smoe_recall=a, smoe_precision=a,
                                   positions={p: {"prefill": 1.0, "decode": a} for p in "123"})
                     for i, a in acc.items()),
        positions={p: {"prefill": 1.0, "decode": 0.8} for p in "123"}, percentile=0.75, smoe_alpha=0.3,
        samples={"prefill": 4, "decode": 32})
    sens = SensitivityProfile(
        base_ppl=10.0, tokens=510, data="heldout", source="hqq in memory", bits=(2,),
        layers=tuple(LayerSensitivity(layer=i, ppl={2: 10.0 + d}, delta={2: d})
                     for i, d in enumerate((3.0, 1.0, 0.4, 0.1))),
        int2_share={"0": 11.0, "0.125": 11.02, "0.25": 11.08, "0.375": 11.2, "0.5": 11.05})
    timing = TimingProfile(device="cpu", dtype="float32", steps=4,
                           layers=tuple(LayerTiming(layer=i, t_attn=1e-4, t_gate=1e-5, t_moe=2e-4, t_experts=1.5e-4)
                                        for i in range(4)),
                           experts=tuple(ExpertTiming(bits=b, nbytes=n, load_s=1e-6, dequant_s=1e-5, compute_s=1e-5)
                                         for b, n in ((16, 4096), (4, 1280), (2, 768))),
                           c_cpu_s=2e-5, h2d_gbps=None, t_dense_s=1.6e-4)
    hw = {"name": "x", "h2d_gbps": 0.01, "copy_latency_s": 0.0}  # t_expert(INT4) = 128 us
    return Profile(model=model, inputs={}, what=("sensitivity", "prefetch", "timing"), data={"heldout": 2},
                   settings={"hw_base": "x"}, info=INFO, sensitivity=sens, prefetch=prefetch, timing=timing, hw=hw)


def synthetic_run(policy: str, params: dict, tpot: float, budget: int = 64 << 20, model=FP, ttft: float = 0.5,
                  batch_size: int = 1) -> Run:
    return Run(model=model, inputs={}, policy=policy, params=params, clock="sim", hw="rtx3090", device="cpu",
               budget_bytes=budget, budget={}, peak_device_bytes=0, ttft_s=ttft,
               tpot_s={"mean": tpot, "p50": tpot, "p99": tpot, "n": 8}, hit_rate=0.5, bytes_h2d=0,
               bytes_per_token=0.0, stall_s=0.0, summary={}, layers={}, prompts=["x"], tokens=[[1]], texts=[""],
               batch_size=batch_size)


def routing_profile() -> RoutingProfile:
    layers = tuple(LayerRouting(layer=i, prefill=tuple(range(8)), decode=(1,) * 8, heavy_hitter=(1,) * 8,
                                hh_load_corr=0.9, top10_share=0.2, top25_share=0.4, gini=0.3, entropy=0.9,
                                mean_sorted_score=tuple(0.5 / (r + 1) for r in range(8)),
                                by_data={"a": (1,) * 8, "b": (2,) * 8}, hot_sets={"a": (0, 1), "b": (1, 2)})
                   for i in range(4))
    return RoutingProfile(tokens={"prefill": 28, "decode": 8}, top_k=2, num_experts=8, hh_ratio=0.2,
                          importance="eager", hot_k=2, layers=layers, score_bins=SCORE_BINS,
                          score_hist={"selected": (1,) * 25, "unselected": (2,) * 25}, jaccard={"a|b": 1 / 3},
                          activation_ratio={"decode": {"1": 0.25, "2": 0.4}, "prefill": {"1": 0.9}})


def similarity_profile() -> SimilarityProfile:
    return SimilarityProfile(adjacent=(0.9, 0.92, 0.95),
                             layers=tuple(LayerSimilarity(layer=i, previous=i - 1,
                                                          positions={"1": 0.93, "2": 0.89, "3": 0.84})
                                          for i in (1, 2, 3)),
                             positions={"1": 0.93, "2": 0.89, "3": 0.84}, tokens=36)


def sample(tp: Any, **overrides: Any) -> Any:
    """A valid value of a type hint, built from the schema alone (so it follows the artifacts' fields
    as they change): 1, 0.5, "x", true, one item per list and dict, every dataclass field filled."""
    if tp is ModelFingerprint:
        return FP
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        return tp(**{f.name: overrides[f.name] if f.name in overrides else sample(hints[f.name])
                     for f in dataclasses.fields(tp) if f.init})
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return sample(next(a for a in args if a is not type(None)))
    if origin is list:
        return [sample(args[0])]
    if origin is tuple:
        return (sample(args[0]),) if args[-1] is Ellipsis else tuple(sample(a) for a in args)
    if origin is dict:
        return {"k": sample(args[1])}
    return {int: 1, float: 0.5, str: "x", bool: True}.get(tp, {"any": [1, "x", None]})


RECORD = dict(clock="sim", device="cpu", dtype="float32")  # an engine record's fields of a closed set of values


def valid_artifacts() -> dict[str, Any]:
    """One valid artifact of every kind, each with nested parts where it has any."""
    return {
        "check": CheckReport(model=FP, inputs={}, prompt="hi", passed=True, max_abs_diff=0.0,
                             layers=(LayerCheck(layer=0, routing_agreement=1.0, max_abs_diff=0.0),)),
        "run": sample(Run, tpot_s={"mean": 0.01, "p50": 0.01, "p99": 0.01, "n": 8}, tokens=[[1, 2]], **RECORD),
        "fit": Fit(model=FP, inputs={}, params={"smoe": {"alpha": 0.2}}, evidence={"warnings": []}),
        "eval": sample(Eval, metrics={"acc": 0.5}, samples={"mc": [{"doc_id": 0, "resps": [[-1.0, False]]}]},
                       **RECORD),
        "profile": dataclasses.replace(synthetic_profile(), routing=routing_profile(), similarity=similarity_profile()),
        "sweep": Sweep(model=FP, inputs={}, stage="run", grid={"policy": ["lru"]},
                       cells={"lru": {"status": "refused", "reason": "no."}}),
    }


VALID = {name: art.to_json() for name, art in valid_artifacts().items()}


def write_json(path: Path, doc: Any) -> Path:
    path.write_text(json.dumps(doc))
    return path


def manifest(directory: Path) -> dict:
    return json.loads((directory / MANIFEST).read_text())


def rewrite(directory: Path, doc: Any, checksum: bool = True) -> None:
    """Write `doc` as the manifest, its checksum recomputed so that the schema, not the checksum, is tested."""
    if checksum and isinstance(doc, dict):
        doc = {**{k: v for k, v in doc.items() if k != "checksum"}}
        doc["checksum"] = _manifest_checksum(doc)
    (directory / MANIFEST).write_text(json.dumps(doc))


# ---- the fault tests' shared pieces (test_faults.py, test_faults_inputs.py) ----------------------

SOME = settings(max_examples=8, deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def run_args(bundle: Path, *extra: str) -> list[str]:
    """`moetool run` over `bundle`, quick and on the simulated clock, with `extra` options."""
    return ["run", "--bundle", str(bundle), "--budget", "100%", "--clock", "sim", "--max-new-tokens", "2",
            "--prompt", "Hi", *extra]


@contextlib.contextmanager
def file_size_limit(nbytes: int) -> Iterator[None]:
    """This process may write files of at most `nbytes` inside the block (`ulimit -f`): Python ignores
    SIGXFSZ, so a write past it fails with EFBIG, as on a filesystem that holds no larger file."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
