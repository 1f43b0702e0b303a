"""`moetool run`: greedy generation under a policy and a device budget, with the engine's stats.

    result = run(RunConfig(bundle=Path("out/bundle"), policy="lru", budget="25%", clock="sim", hw="rtx3090",
                           prompts=("Hello",), max_new_tokens=16))
    result.tpot_s["p50"], result.hit_rate

A bundle is self-contained: with `bundle` and no `model`, the model (config, tokenizer,
non-expert weights) comes from the bundle and nothing of the checkpoint is read. With `model`
too, the non-expert weights come from the checkpoint (streamed, experts never read) and the
bundle must be of that model. With `model` alone, experts are packed in memory from the checkpoint
at the reference precision (small models; quantize a bundle for large ones).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from moetool.artifacts import Artifact, sha256_file
from moetool.check import prompt_ids
from moetool.datasets import parse_prompt_lines
from moetool.engine import BudgetPlan, build_engine, parse_size
from moetool.engine.store import HostStore
from moetool.errors import MoetoolError
from moetool.model import LoadedModel, load_model
from moetool.quant.bundle import load_bundle_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: str) -> torch.dtype:
    """`auto` is bf16 on CUDA (what the kernels and the bundles are made for) and fp32 on CPU (exact
    against transformers, and CPU bf16 matmuls are slow); any other name is taken as it is."""
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if name not in DTYPES:
        raise MoetoolError(f"--dtype must be auto or one of {', '.join(DTYPES)}, not '{name}'.")
    return DTYPES[name]


@dataclass(frozen=True)
class Fit(Artifact):
    """Fitted policy knobs, per policy name (written by `moetool fit`), with their evidence."""

    SCHEMA: ClassVar[str] = "fit"
    SCHEMA_VERSION: ClassVar[int] = 1

    params: dict[str, dict[str, Any]]  # policy -> knob -> value
    evidence: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Run(Artifact):
    """What one `moetool run` measured. Times are seconds on `clock` (wall or sim on `hw`)."""

    SCHEMA: ClassVar[str] = "run"
    SCHEMA_VERSION: ClassVar[int] = 1

    policy: str
    params: dict[str, Any]
    clock: str
    hw: str | None
    device: str
    budget_bytes: int
    budget: dict[str, int]  # how the budget is spent (BudgetPlan)
    peak_device_bytes: int
    ttft_s: float | None
    tpot_s: dict[str, float] | None  # mean, p50, p99, n
    hit_rate: float | None
    bytes_h2d: int
    bytes_per_token: float
    stall_s: float
    summary: dict[str, Any]  # every engine counter (substitutions, skips, CPU experts, precision mix, ...)
    layers: dict[str, dict[str, Any]]  # per MoE layer
    prompts: list[str]
    tokens: list[list[int]]  # generated token ids per prompt
    texts: list[str]
    dtype: str = "float32"  # the compute dtype (`--dtype auto` resolved); older artifacts ran in fp32


@dataclass(frozen=True)
class RunConfig:
    model: str | None = None  # checkpoint; None: the bundle's own model, or the demo model without a bundle
    bundle: Path | None = None
    policy: str = "lru"
    settings: dict[str, str] = field(default_factory=dict)
    fit: Path | None = None
    budget: str = "25%"
    clock: str = "wall"
    hw: str = "rtx3090"
    prompts: tuple[str, ...] = ("The capital of France is",)
    max_new_tokens: int = 32
    batch_size: int = 1
    device: str = "cpu"
    dtype: str = "auto"  # auto: bf16 on CUDA, fp32 on CPU
    host_budget: str | None = None  # host bytes for pinned experts and the staging ring (default: free memory less a margin)


def load(cfg: RunConfig, dtype: torch.dtype) -> tuple[LoadedModel, HostStore, dict[str, str]]:
    """The model and the host store `cfg` asks for (see the module docstring), and the inputs' sha256."""
    if cfg.bundle is None:
        lm = load_model(cfg.model or "demo", device=cfg.device, dtype=dtype)
        return lm, HostStore.from_experts(lm.experts, dtype), {}
    from moetool.quant.bundle import MANIFEST, Bundle

    bundle = Path(cfg.bundle)
    if cfg.model is None:
        lm = load_bundle_model(bundle, device=cfg.device, dtype=dtype)
    else:
        lm = load_model(cfg.model, device=cfg.device, dtype=dtype)
        lm.bundle = Bundle.open(bundle, model=lm.fingerprint)
    return lm, HostStore.from_bundle(lm.bundle, dtype), {str(bundle / MANIFEST): sha256_file(bundle / MANIFEST)}


def read_prompts(path: Path) -> tuple[str, ...]:
    """A JSONL file of {"prompt": ...} objects (or plain strings), one per line."""
    if not Path(path).is_file():
        raise MoetoolError(f"{path} does not exist.")
    prompts = parse_prompt_lines(Path(path).read_text(), path)
    if not prompts:
        raise MoetoolError(f"{path} holds no prompts.")
    return tuple(prompts)


def _encode(lm: LoadedModel, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids and attention mask; tokenizer-less test models fold prompt bytes into the vocab."""
    tok = lm.tokenizer
    if tok is None:
        rows = [prompt_ids(None, p, lm.model.config.vocab_size)[0] for p in prompts]
        width = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, width - len(r):], mask[i, width - len(r):] = r, 1
        return ids, mask
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    enc = tok(prompts, return_tensors="pt", padding=True)
    return enc.input_ids, enc.attention_mask


@dataclass
class Prepared:
    """An engine-backed model ready to run: what run, eval and profile share."""

    lm: LoadedModel
    engine: Any
    plan: BudgetPlan
    inputs: dict[str, str]  # sha256 of the bundle manifest / fit artifact used
    dtype: str = "float32"  # the compute dtype, resolved


def prepare(cfg: RunConfig, max_tokens: int = 2048) -> Prepared:
    """Load the model, open the store, build the policy and the engine from `cfg`."""
    dtype = resolve_dtype(cfg.dtype, cfg.device)
    host_budget = None if cfg.host_budget is None else parse_size(cfg.host_budget, "--host-budget")
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        raise MoetoolError(f"--device {cfg.device} asks for CUDA, but this machine has no usable CUDA device.")
    lm, store, inputs = load(cfg, dtype)
    fitted = None
    if cfg.fit is not None:
        fit = Fit.load(Path(cfg.fit), model=lm.fingerprint)
        fitted = fit.params.get(cfg.policy, {})
        inputs[str(cfg.fit)] = sha256_file(Path(cfg.fit))
    engine, plan = build_engine(lm, store, cfg.policy, settings=cfg.settings, fitted=fitted, budget=cfg.budget,
                                clock=cfg.clock, hw=cfg.hw, device=cfg.device, max_tokens=max_tokens,
                                batch=cfg.batch_size, host_budget=host_budget)
    return Prepared(lm=lm, engine=engine, plan=plan, inputs=inputs, dtype=str(dtype).removeprefix("torch."))


def run(cfg: RunConfig, progress: Callable[[int, int], None] | None = None) -> Run:
    if cfg.max_new_tokens < 1 or cfg.batch_size < 1:
        raise MoetoolError("--max-new-tokens and --batch-size must be at least 1.")
    ready = prepare(cfg, max_tokens=4096)
    lm, engine, plan, inputs = ready.lm, ready.engine, ready.plan, ready.inputs
    tokens: list[list[int]] = []
    texts: list[str] = []
    prompts = list(cfg.prompts)
    with torch.no_grad():
        for start in range(0, len(prompts), cfg.batch_size):
            batch = prompts[start:start + cfg.batch_size]
            ids, mask = _encode(lm, batch)
            out = lm.model.generate(ids.to(cfg.device), attention_mask=mask.to(cfg.device), do_sample=False,
                                    max_new_tokens=cfg.max_new_tokens, min_new_tokens=cfg.max_new_tokens,
                                    pad_token_id=lm.tokenizer.pad_token_id if lm.tokenizer else 0)
            for row in out[:, ids.shape[1]:].tolist():
                tokens.append(row)
                texts.append(lm.tokenizer.decode(row, skip_special_tokens=True) if lm.tokenizer else "")
            if progress:
                progress(min(start + cfg.batch_size, len(prompts)), len(prompts))
    engine.close()
    s = engine.stats.summary()
    return Run(model=lm.fingerprint, inputs=inputs, policy=cfg.policy, params=engine.policy.describe(),
               clock=cfg.clock, hw=cfg.hw if cfg.clock == "sim" else None, device=str(cfg.device),
               budget_bytes=plan.total_bytes, budget=dataclasses.asdict(plan),
               peak_device_bytes=s["peak_device_bytes"], ttft_s=s["ttft_s"], tpot_s=s["tpot_s"],
               hit_rate=s["hit_rate"], bytes_h2d=s["bytes_h2d"], bytes_per_token=s["bytes_per_token"],
               stall_s=s["stall_s"], summary={**s, "warm_bytes": engine.warm_bytes},
               layers={str(k): v.to_json() for k, v in engine.stats.layers.items()},
               prompts=prompts, tokens=tokens, texts=texts, dtype=ready.dtype)


__all__ = ["Fit", "Prepared", "Run", "RunConfig", "BudgetPlan", "load", "prepare", "resolve_dtype", "run", "read_prompts"]
