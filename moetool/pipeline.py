"""`moetool demo`: the whole pipeline on the demo model, reusing every artifact that is still valid.

demo model -> bundle (16/8/4/2, HQQ) -> profile -> fit -> every policy at a 25% budget on the sim
clock -> perplexity and offline multiple-choice accuracy under a few policies -> report.

    paths = demo_pipeline(DemoConfig(out=Path("out/demo")), progress=lambda step, i, n: None)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from moetool.artifacts import Artifact, atomic_write_bytes
from moetool.errors import MoetoolError

# (file label, policy, knobs): what `run` compares at the demo budget.
RUN_POLICIES = (
    ("resident", "resident", {}), ("static-int4", "static", {"bits": "4"}), ("lod", "lod", {}), ("lru", "lru", {}),
    ("eap", "eap", {}), ("fate", "fate", {}), ("dymoe-4-2", "dymoe", {"config": "4/2"}),
    ("dymoe-4-0", "dymoe", {"config": "4/0"}), ("smoe", "smoe", {}), ("dynaexq", "dynaexq", {}),
    ("dynaexq-4-2", "dynaexq", {"config": "4/2"}),  # the 16/4 default's INT4 low tier alone outgrows a 25% budget
)
# What accuracy is measured under (label, policy, knobs, budget; None = the demo budget): the exact
# model, uniform INT4, and two of the papers' lossy policies at the demo budget.
EVAL_POLICIES = (
    ("resident", "resident", {}, "100%"), ("static-int4", "static", {"bits": "4"}, "100%"),
    ("dymoe-4-0", "dymoe", {"config": "4/0"}, None), ("dynaexq-4-2", "dynaexq", {"config": "4/2"}, None),
)


# Each choice's text scored (cloze), not MMLU's lettered prompt: the 135M demo model answers "A" to
# 230 of 231 lettered questions whatever the policy, so only the cloze form shows what a policy changes.
MC_TASK = "bigbench-mc-cloze"


@dataclass(frozen=True)
class DemoConfig:
    out: Path = Path("out/demo")
    model: str | None = None  # None: the demo model (built if needed)
    budget: str = "25%"
    hw: str = "rtx3090"
    prompts: int = 4
    tokens: int = 32
    mc_limit: int = 40  # questions per multiple-choice task
    ppl_tokens: int = 2048
    # SMoE's R (eq. 5) for the alpha fit: about the TPOT with every expert resident on the simulated
    # RTX 3090 (2.8 ms), i.e. "as fast as if the model fit". Another --hw wants another R.
    target_tpot: float = 0.003


Progress = Callable[[str, int, int], None]  # (step description, done, total)


def heldout_prompts(n: int, words: int = 48) -> tuple[str, ...]:
    """`n` prompts of about `words` words from evenly spaced places in the held-out text."""
    from moetool.datasets import heldout_text

    lines = [ln.strip() for ln in heldout_text().splitlines() if len(ln.split()) >= 6]
    step = max(1, len(lines) // (n + 1))
    prompts = []
    for i in range(n):
        chunk, j = [], (i + 1) * step
        while len(" ".join(chunk).split()) < words and j < len(lines):
            chunk.append(lines[j])
            j += 1
        prompts.append(" ".join(chunk))
    return tuple(prompts)


def _valid(path: Path, kind: type[Artifact], model) -> bool:
    """An artifact that exists and reads cleanly for this model is reused, not recomputed."""
    if not path.is_file():
        return False
    try:
        kind.load(path, model=model)
    except MoetoolError:
        return False
    return True


def _refused(path: Path, why: Exception) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, f"{why}\n".encode())


def demo_pipeline(cfg: DemoConfig, progress: Progress | None = None) -> dict[str, Path]:
    from moetool.demo import build_demo_model
    from moetool.evaluate import Eval, EvalConfig, evaluate
    from moetool.fit import FitConfig, fit
    from moetool.model import load_config, model_fingerprint
    from moetool.profile import Profile, ProfileConfig, profile
    from moetool.quant.bundle import MANIFEST, Bundle
    from moetool.quant.quantize import QuantizeConfig, quantize
    from moetool.report import report
    from moetool.run import Fit, Run, RunConfig, run

    steps = 6 + len(RUN_POLICIES) + 2 * len(EVAL_POLICIES)
    done = 0

    def step(what: str) -> None:
        nonlocal done
        if progress:
            progress(what, done, steps)
        done += 1

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    step("demo model")
    model = cfg.model or str(build_demo_model().path)
    fp = model_fingerprint(load_config(model), model)

    bundle = out / "bundle"
    step("quantize (16/8/4/2, HQQ)")
    if (bundle / MANIFEST).is_file():
        Bundle.open(bundle, model=fp)  # refuses a corrupt or foreign bundle in one sentence
    else:
        quantize(QuantizeConfig(model=model, out=bundle, bits=(16, 8, 4, 2), dtype="float32"))

    prof = out / "demo.profile.json"
    step("profile")
    if not _valid(prof, Profile, fp):
        profile(ProfileConfig(model=model, bundle=bundle)).save(prof)

    fitted = out / "demo.fit.json"
    step("fit")
    if not _valid(fitted, Fit, fp):
        fit(FitConfig(profile=prof, sweep=True, budget=cfg.budget, model=model, bundle=bundle, hw=cfg.hw,
                      sweep_budget=cfg.budget, target_tpot=cfg.target_tpot)).save(fitted)

    prompts = heldout_prompts(cfg.prompts)
    runs = out / "runs"
    for label, policy, knobs in RUN_POLICIES:
        step(f"run {label}")
        path = runs / f"{label}.run.json"
        if _valid(path, Run, fp):
            continue
        budget = "100%" if policy in ("resident", "static") else cfg.budget
        try:
            result = run(RunConfig(model=model, bundle=bundle, policy=policy, settings=knobs, fit=fitted,
                                   budget=budget, clock="sim", hw=cfg.hw, prompts=prompts,
                                   max_new_tokens=cfg.tokens))
        except MoetoolError as e:  # e.g. dynaexq when the low tier cannot fit the budget: recorded, not fatal
            _refused(runs / f"{label}.refused.txt", e)
            continue
        result.save(path)

    evals = out / "evals"
    for label, policy, knobs, budget in EVAL_POLICIES:
        for task, limit in (("ppl", cfg.ppl_tokens), (MC_TASK, cfg.mc_limit)):
            step(f"eval {task} {label}")
            path = evals / f"{label}.{task}.eval.json"
            if _valid(path, Eval, fp):
                continue
            try:
                result = evaluate(EvalConfig(task=task, model=model, bundle=bundle, policy=policy, settings=knobs,
                                             fit=fitted, budget=budget or cfg.budget, limit=limit))
            except MoetoolError as e:  # a policy the budget cannot hold on this model: recorded, not fatal
                _refused(evals / f"{label}.{task}.refused.txt", e)
                continue
            result.save(path)

    step("report")
    report([prof, fitted, runs, evals], out / "report")
    return {"model": Path(model), "bundle": bundle, "profile": prof, "fit": fitted, "runs": runs, "evals": evals,
            "report": out / "report"}
