"""`moetool demo`: the whole pipeline on the demo model, reusing every artifact that is still valid.

demo model -> bundle (16/8/4/2, HQQ) -> profile -> fit -> every policy at a 25% budget on the sim
clock -> perplexity and offline multiple-choice accuracy under a few policies -> report. The runs
and evals are `moetool sweep`s of the packaged grids demo-runs and demo-evals (on a local Ray);
every setting demo-evals evaluates has a run of the same label, knobs and budget in demo-runs, so
the report pairs each quality with a TPOT.

    paths = demo_pipeline(DemoConfig(out=Path("out/demo")), progress=lambda step, i, n: None)
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moetool.artifacts import Artifact, sha256_file
from moetool.errors import MoetoolError
from moetool.spec import EngineSpec, check_positive

if TYPE_CHECKING:
    from moetool.sweep import SweepConfig

# moetool/grids/demo-runs.yaml and demo-evals.yaml; this module fills in the model, bundle, fit and sizes.
RUNS_GRID, EVALS_GRID = "demo-runs", "demo-evals"


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    out: Path = Path("out/demo")
    # What every run and eval of the demo (and the fit's smoe sweep) shares: model (None: the demo model,
    # built if needed), budget, hw, device, dtype, host_budget. A field left at its default leaves the
    # grids' own setting; the bundle and the fit are the ones the pipeline makes, the policies the grids'.
    engine: EngineSpec = field(default_factory=EngineSpec)
    prompts: int = 4
    tokens: int = 32
    mc_limit: int = 40  # questions per multiple-choice task
    ppl_tokens: int = 2048
    # SMoE's R (eq. 5) for the alpha fit: about the TPOT with every expert resident on the simulated
    # RTX 3090 (2.8 ms), i.e. "as fast as if the model fit". Another --hw wants another R.
    target_tpot: float = 0.003
    # The runs and evals go to a local Ray with this many CPUs (None: all cores), one cell per CPU with
    # one torch thread each; 0 runs them one after another in this process. On this 2-core machine Ray
    # took 80 s for the demo's run grid where one process took 107 s, or 967 s when other jobs held a
    # core (torch's two OpenMP threads then wait on each other): README, "Sweeps".
    workers: int | None = None

    def check(self) -> None:
        if self.engine.bundle is not None or self.engine.fit is not None:
            raise MoetoolError("the demo makes its own bundle and fit; give them to `moetool sweep` instead.")
        check_positive(prompts=self.prompts, tokens=self.tokens, mc_limit=self.mc_limit)
        if self.ppl_tokens < 2:
            raise MoetoolError(f"the demo's perplexity needs at least 2 tokens, not {self.ppl_tokens}.")
        if not (math.isfinite(self.target_tpot) and self.target_tpot > 0):
            raise MoetoolError(f"--target-tpot must be more than 0 seconds, not {self.target_tpot:g}.")
        self.engine.check()

    def shared(self) -> dict[str, Any]:
        """The engine settings every cell gets: those of `engine` not left at their defaults."""
        default = EngineSpec()
        return {k: str(v) if isinstance(v, Path) else v for k, v in self.engine.engine_fields().items()
                if v != getattr(default, k)}


Progress = Callable[[str, int, int], None]  # (step description, done, total)


def _valid(path: Path, kind: type[Artifact], model) -> bool:
    """An artifact that exists and reads cleanly for this model's weights is reused, not recomputed
    (strictly: one from before fingerprints had a weights digest is recomputed, as the demo model
    may have been rebuilt from other parameters in the same directory since)."""
    if not path.is_file():
        return False
    try:
        return kind.load(path, model=model).model.same_model(model, strict=True)
    except MoetoolError:
        return False


def demo_sweeps(cfg: DemoConfig, model: str, bundle: Path, fitted: Path) -> dict[str, "SweepConfig"]:
    """The demo's run and eval grids with this model, bundle, fit and the sizes of `cfg`."""
    from moetool.grid import load_grid
    from moetool.sweep import SweepConfig

    evals = load_grid(EVALS_GRID)
    evals["grid"]["task"] = [{**t, "limit": cfg.ppl_tokens if t["task"] == "ppl" else cfg.mc_limit}
                             for t in evals["grid"]["task"]]
    # A grid's own paths are relative to its file (moetool/grids/); ours are relative to the caller's
    # directory, so they go in absolute (a model that is no local path is a hub id, left as it is).
    model = str(Path(model).resolve()) if Path(model).exists() else model
    where = {**cfg.shared(), "model": model, "bundle": str(Path(bundle).resolve()), "fit": str(Path(fitted).resolve())}
    out = Path(cfg.out).resolve()
    return {"runs": SweepConfig(grid=RUNS_GRID, out=out / "runs", workers=cfg.workers,
                                overrides={**where, "prompts": {"heldout": cfg.prompts}, "max_new_tokens": cfg.tokens}),
            "evals": SweepConfig(grid=evals, out=out / "evals", workers=cfg.workers, overrides=where)}


def demo_pipeline(cfg: DemoConfig, progress: Progress | None = None) -> dict[str, Path]:
    from moetool.fit_artifact import Fit
    from moetool.demo import build_demo_model
    from moetool.fit import SWEEP_TOKENS, FitConfig, fit
    from moetool.model import model_fingerprint
    from moetool.source import load_config
    from moetool.profile import Profile, ProfileConfig, profile
    from moetool.quant.bundle import MANIFEST, Bundle
    from moetool.quant.quantize import QuantizeConfig, quantize
    from moetool.report import report
    from moetool.run import RunConfig
    from moetool.sweep import INDEX, Sweep, cells_of, sweep

    cfg.check()
    out = Path(cfg.out).resolve()  # every stage below gets absolute paths (see demo_sweeps)
    out.mkdir(parents=True, exist_ok=True)
    bundle, prof, fitted = out / "bundle", out / "demo.profile.json", out / "demo.fit.json"
    # Five stages and one step per run or eval cell (ran, reused, or refused by its budget and recorded
    # in sweep.json, not fatal: e.g. dynaexq's default 16/4 tiers at 25%).
    planned = demo_sweeps(cfg, cfg.engine.model or "demo", bundle, fitted)
    done, steps = 0, 5 + sum(len(cells_of(s)) for s in planned.values())

    def step(what: str) -> None:
        nonlocal done
        if progress:
            progress(what, done, steps)
        done += 1

    step("demo model")
    model = cfg.engine.model or str(build_demo_model().path)
    fp = model_fingerprint(load_config(model), model)

    step("quantize (16/8/4/2, HQQ)")
    if (bundle / MANIFEST).is_file():
        theirs = Bundle.open(bundle).manifest.model  # refuses a corrupt bundle in one sentence
        earlier = theirs.source == fp.source or theirs.same_architecture(fp)
        if earlier and not theirs.same_model(fp, strict=True):
            # The pipeline's own bundle of an earlier version of this model: other weights of this
            # architecture, or whatever now lies at the same place (the demo model rebuilt from new
            # parameters, in another geometry too). Quantized again, and every later stage with it.
            shutil.rmtree(bundle)
        else:
            Bundle.open(bundle, model=fp)  # refuses a bundle of another model in one sentence
    if not (bundle / MANIFEST).is_file():
        quantize(QuantizeConfig(model=model, out=bundle, bits=(16, 8, 4, 2), dtype="float32"))

    step("profile")
    # Sensitivity on as many held-out tokens as the evals' perplexity: on 512 a layer at INT2 moved
    # perplexity by noise alone (seven layers "improved" by 0.3-0.7 of 58), which hid the depth trend.
    wanted = ProfileConfig(model=model, bundle=bundle, ppl_tokens=cfg.ppl_tokens)
    if not _valid(prof, Profile, fp) or Profile.load(prof).settings != wanted.recorded():
        profile(wanted).save(prof)

    step("fit")
    # A fit records the profile it read (its sha256): one read from another profile is stale.
    if not _valid(fitted, Fit, fp) or Fit.load(fitted).inputs.get(str(prof)) != sha256_file(prof):
        sweep_runs = RunConfig(**{**cfg.engine.engine_fields(), "model": model, "bundle": bundle},
                               max_new_tokens=SWEEP_TOKENS)
        fit(FitConfig(profile=prof, sweep=sweep_runs, budget=cfg.engine.budget,
                      target_tpot=cfg.target_tpot)).save(fitted)

    sweeps = demo_sweeps(cfg, model, bundle, fitted)
    for sweep_cfg in sweeps.values():
        index = Path(sweep_cfg.out) / INDEX
        try:
            stale = index.is_file() and not Sweep.load(index).model.same_model(fp, strict=True)
        except MoetoolError:
            stale = False  # unreadable: sweep() rebuilds it from the cells, which check their own inputs
        if stale:
            shutil.rmtree(sweep_cfg.out)  # our own cells, of other weights: run afresh
    reported = []
    for stage, sweep_cfg in sweeps.items():
        index = sweep(sweep_cfg, progress=lambda name, status, *_, stage=stage: step(f"{stage[:-1]} {name}: {status}"))
        # The index and its cells' artifacts, not the whole directory: a cell an earlier version of the
        # grid had (another label) keeps its file there but is no setting of this demo.
        names = [INDEX, *(c["artifact"] for c in index.cells.values() if c.get("artifact"))]
        reported += sorted(Path(sweep_cfg.out) / name for name in names)

    step("report")
    report([prof, fitted, *reported], out / "report")
    return {"model": Path(model), "bundle": bundle, "profile": prof, "fit": fitted, "runs": sweeps["runs"].out,
            "evals": sweeps["evals"].out, "report": out / "report"}
