"""`moetool run`: greedy generation under a policy and a device budget, with the engine's stats.

    result = run(RunConfig(model="path/to/ckpt", policy="lru", budget="25%", clock="sim", hw="rtx3090",
                           prompts=("Hello",), max_new_tokens=16))
    result.tpot_s["p50"], result.hit_rate
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
from moetool.engine import BudgetPlan, build_engine
from moetool.engine.store import HostStore
from moetool.errors import MoetoolError
from moetool.model import LoadedModel, load_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


@dataclass(frozen=True)
class RunConfig:
    model: str = "demo"
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
    dtype: str = "float32"


def open_store(lm: LoadedModel, bundle: Path | None, dtype: torch.dtype) -> tuple[HostStore, dict[str, str]]:
    """The bundle's blobs, or a reference-precision store built in memory from the checkpoint."""
    if bundle is None:
        return HostStore.from_experts(lm.experts, dtype), {}
    from moetool.quant.bundle import Bundle

    opened = Bundle.open(Path(bundle), model=lm.fingerprint)
    return HostStore.from_bundle(opened, dtype), {str(Path(bundle) / "bundle.json"): sha256_file(Path(bundle) / "bundle.json")}


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


def prepare(cfg: RunConfig, max_tokens: int = 2048) -> Prepared:
    """Load the model, open the store, build the policy and the engine from `cfg`."""
    if cfg.dtype not in DTYPES:
        raise MoetoolError(f"--dtype must be one of {', '.join(DTYPES)}, not '{cfg.dtype}'.")
    dtype = DTYPES[cfg.dtype]
    lm = load_model(cfg.model, device=cfg.device, dtype=dtype)
    store, inputs = open_store(lm, cfg.bundle, dtype)
    fitted = None
    if cfg.fit is not None:
        fit = Fit.load(Path(cfg.fit), model=lm.fingerprint)
        fitted = fit.params.get(cfg.policy, {})
        inputs[str(cfg.fit)] = sha256_file(Path(cfg.fit))
    engine, plan = build_engine(lm, store, cfg.policy, settings=cfg.settings, fitted=fitted, budget=cfg.budget,
                                clock=cfg.clock, hw=cfg.hw, device=cfg.device, max_tokens=max_tokens,
                                batch=cfg.batch_size)
    return Prepared(lm=lm, engine=engine, plan=plan, inputs=inputs)


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
               prompts=prompts, tokens=tokens, texts=texts)


__all__ = ["Fit", "Prepared", "Run", "RunConfig", "BudgetPlan", "prepare", "run", "read_prompts"]
