"""The fit stage: policy knobs from a profile (and runs and evals), each with the evidence it came from.

The stage reads the artifacts, checks they are of one model, splits `--budget` as the engine would,
and asks every registered policy that has a `fit` (`Knobs.fit`, `policies/stages.py`) for its
knobs; the papers' own rules live in their knobs files: SMoE's alpha from T(alpha) (eq. 5,
`smoe_fit.py`), Fate's L, n and p (§4.3-4.5, `fate_knobs.py`), DyMoE's lambda (eq. 4, `dymoe_knobs.py`),
DynaExq's n_hi (§3.1, `dynaexq_knobs.py`). The result is one `Fit` artifact (`artifacts.py`): knobs
and evidence per policy name.

    result = fit(FitConfig(profile=Path("demo.profile.json"), runs=(Path("a0.run.json"), ...), target_tpot=0.05))
    result.params["smoe"]["alpha"], result.evidence["smoe"]["alpha"]["coefficients"]
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moetool.artifacts import read_json, sha256_file
from moetool.fit_artifact import Fit
from moetool.errors import MoetoolError, size_text
from moetool.policies import POLICIES, hooked
from moetool.policies.knobs import parse_params
from moetool.policies.dymoe_knobs import RETENTION_FLOOR
from moetool.policies.smoe_fit import ALPHAS
from moetool.policies.stages import FitInputs, FitTargets
from moetool.spec import check_budget

if TYPE_CHECKING:
    from moetool.profile_artifact import ModelInfo
    from moetool.run import RunConfig
    from moetool.run_artifact import Run

# Tokens per run of a sweep (SMoE's alphas): `run`'s own default, so the R a fit says alpha meets is the TPOT
# of the run it is then given to (TPOT grows with the context: a 16-token sweep's alpha met R there and missed
# it at run's 32 by 0.6%).
SWEEP_TOKENS = 32


@dataclass(frozen=True, kw_only=True)
class FitConfig(FitTargets):
    """The fit stage's inputs beside the targets the policies' fits read (`FitTargets`: target_tpot,
    max_loss, l_threshold, r, budget, alphas)."""

    profile: Path
    runs: tuple[Path, ...] = ()  # run artifacts (smoe at several alpha) and eval artifacts (fate at several p)
    # Run policies whose fit asks for runs (smoe at `alphas`) instead of (or beside) given runs: this
    # config's engine, prompts and tokens, with the policy's own settings and the sim clock; its model
    # defaults to the profile's.
    sweep: RunConfig | None = None
    alphas: tuple[float, ...] = ALPHAS  # SMoE: the sweep's alphas

    def check(self) -> None:
        """Refuse in one sentence, before the profile is read, values no fit could use."""
        if not (math.isfinite(self.max_loss) and self.max_loss >= 0):
            raise MoetoolError(f"--max-loss is a relative loss, 0 or more (0.01 = 1%), not {self.max_loss:g}.")
        if not 0 <= self.l_threshold <= 1:
            raise MoetoolError(f"--l-threshold is a recall between 0 and 1, not {self.l_threshold:g}.")
        if self.r is not None and not RETENTION_FLOOR <= self.r <= 1:
            raise MoetoolError(f"--r is a share of critical experts between {RETENTION_FLOOR:g} (the least the cosine "
                               f"schedule keeps, DyMoE eq. 4-5) and 1, not {self.r:g}.")
        if self.target_tpot is not None and not (math.isfinite(self.target_tpot) and self.target_tpot > 0):
            raise MoetoolError(f"--target-tpot must be more than 0 seconds, not {self.target_tpot:g}.")
        if self.budget is not None:
            check_budget(self.budget)
        if self.sweep is not None:
            # SMoE's alpha is in [0, 1) (`SMoE.Params`): refused here, before the sweep runs the others
            if not self.alphas or not all(0 <= a < 1 for a in self.alphas):
                raise MoetoolError(f"--alphas are SMoE thresholds between 0 and 1 (1 excluded), not "
                                   f"{', '.join(f'{a:g}' for a in self.alphas) or 'none'}.")
            if len(set(self.alphas)) < 2 and not self.runs:  # eq. 5 fits T(alpha) through 2+ points
                raise MoetoolError(f"--alphas {', '.join(f'{a:g}' for a in self.alphas)} gives the --sweep one point of "
                                   "SMoE's T(alpha) (eq. 5), and a curve needs two or more alphas; give more --alphas "
                                   "(or smoe runs at other alphas with --runs).")
            check_budget(self.sweep.budget, "--sweep-budget")
            dataclasses.replace(self.sweep, clock="sim").check()
            if self.sweep.max_new_tokens < 2:  # the first token is the prefill's: TPOT times the ones after it
                raise MoetoolError(f"--max-new-tokens {self.sweep.max_new_tokens} gives the --sweep runs no decode step "
                                   "to time (TPOT is the time of each token after the first); give 2 or more.")

    def sweep_run(self, model: str | None, policy: str, settings: dict[str, str]) -> RunConfig:
        """One run of the sweep: `policy` at `settings` on the sweep's engine and the sim clock."""
        return dataclasses.replace(self.sweep, model=model, policy=policy, settings=settings, clock="sim")


def cache_bytes(budget: str, info: ModelInfo, staged: tuple[int, ...] | None = None) -> int:
    """Device bytes left for experts, split as the engine splits a budget (`engine.budget.split_budget`):
    with staging for the precisions `staged` (a policy's, as its run stages them), else for every one."""
    from moetool.engine.budget import split_budget

    split = split_budget(budget, n_experts=len(info.moe_layers) * info.num_experts,
                         expert_bytes=info.expert_bytes, staged=staged,
                         non_expert_bytes=info.non_expert_bytes, margin_bytes=info.kv_margin_bytes)
    return split.cache_bytes


def fit(cfg: FitConfig, progress: Callable[[str, int, int], None] | None = None) -> Fit:
    from moetool.eval_artifact import Eval
    from moetool.profile_artifact import Profile
    from moetool.run_artifact import Run

    cfg.check()
    prof = Profile.load(Path(cfg.profile))
    inputs = {str(cfg.profile): sha256_file(Path(cfg.profile))}
    runs, evals, first, again = [], [], {}, []
    for path in cfg.runs:
        # loaded first: a directory or an unreadable file is its one sentence
        art = (Eval if _schema(Path(path)) == "eval" else Run).load(Path(path), model=prof.model)
        sha = sha256_file(Path(path))
        if sha in first:  # one artifact given twice (or a copy of it) is one measurement, not a second point
            again.append(f"{path} is the same artifact as {first[sha]}; it is read once.")
            continue
        first[sha] = path
        (evals if isinstance(art, Eval) else runs).append((str(path), art))
        inputs[str(path)] = sha
    shared = FitInputs(policy="", profile=prof, runs=tuple(runs), evals=tuple(evals), config=cfg,
                       cache_bytes=cache_bytes(cfg.budget, prof.info) if cfg.budget else None, progress=progress,
                       staged_cache=(lambda bits: cache_bytes(cfg.budget, prof.info, bits)) if cfg.budget else None)
    sweep = _Sweep(cfg, prof) if cfg.sweep is not None else None
    params: dict[str, dict[str, Any]] = {}
    ev: dict[str, Any] = {"warnings": [*again, *(sweep.warnings if sweep else ())], "skipped": {}}
    if cfg.budget and not cfg.budget.strip().endswith("%") and shared.cache_bytes is not None:
        from moetool.engine.budget import PLAN_TOKENS

        ev["warnings"].append(
            f"--budget {cfg.budget} is a size: the fit plans the profile's KV margin (up to {PLAN_TOKENS:,} tokens), so the "
            f"expert cache it sizes knobs for ({size_text(shared.cache_bytes)}) is not every run's; a run whose "
            "cache differs by more than 10% takes the policies' defaults instead (a share, 25%, holds for any run).")
    fitting = [cls for _, cls in hooked("fit")]
    for kind, given in (("a run", runs), ("an eval", evals)):  # inputs no fit reads, recorded without a word
        for path, art in given:
            cls = POLICIES.get(art.policy)
            if cls is None or not any(issubclass(cls, f) for f in fitting):
                ev["warnings"].append(f"{path} is {kind} of policy '{art.policy}', which no paper's fit reads; "
                                      "nothing was fitted from it.")
    for name, cls in hooked("fit"):  # each paper's fit once
        mine = dataclasses.replace(shared, policy=name, sweep=sweep.of(name) if sweep else None,
                                   sweep_note=sweep.note if sweep else "", sweep_sized=sweep.sized if sweep else None)
        got = cls.fit(mine)
        if got is None:
            continue
        unknown = set(got.knobs) - {f.name for f in dataclasses.fields(cls.Params)}
        if unknown:
            raise MoetoolError(f"policy '{name}' fitted {sorted(unknown)}, which are not its knobs: a bug in its fit().")
        try:  # as `run --fit` will read them: a value it refuses is refused here, not written
            parse_params(cls, {}, got.knobs)
        except MoetoolError as e:
            raise MoetoolError(f"policy '{name}' fit() gave a knob `run --fit` would refuse: {e}") from None
        if got.knobs:
            params[name] = got.knobs
        if got.evidence:
            ev[name] = got.evidence
        ev["warnings"] += got.warnings
        ev["skipped"].update({f"{name}.{k}": why for k, why in got.skipped.items()})
    return Fit(model=prof.model, inputs=inputs, params=params, evidence=ev)


class _Sweep:
    """Runs for a policy's fit on the `--sweep` engine; the model is checked against the profile's
    once, before the first run."""

    def __init__(self, cfg: FitConfig, prof: Any):
        sw = cfg.sweep
        self.warnings: list[str] = []
        made = prof.settings.get("bundle") if isinstance(prof.settings, dict) else None
        if sw.model is None and sw.bundle is None and isinstance(made, str):
            # Neither given: the sweep runs what the profile measured, its bundle (and its --model, if it
            # had one). The checkpoint alone sized T(alpha) for its fp32 experts, and every later run over
            # the bundle dropped the alpha as fitted for another link time.
            from moetool.quant.bundle import MANIFEST

            if (Path(made) / MANIFEST).is_file():
                sw = dataclasses.replace(sw, bundle=made, model=prof.settings.get("model"))
                cfg = dataclasses.replace(cfg, sweep=sw)
            else:
                from moetool.source import resolve_source

                try:
                    resolve_source(prof.model.source)
                except MoetoolError:  # "ckpt does not exist", a path the user never typed here
                    raise MoetoolError(f"the profile was made on the bundle {made}, which is not there now, and its "
                                       f"model {prof.model.source} is not found either (paths recorded relative to "
                                       "where profile ran); give --bundle or --model.") from None
                self.warnings.append(f"the profile was made on the bundle {made}, which is not there now: the sweep runs "
                                     f"the profile's model {prof.model.source} (give --bundle to run a bundle).")
        self.cfg, self.prof, self.source = cfg, prof, None
        on = f", bundle {sw.bundle}" if sw.bundle is not None else ""
        self.note = f"sweep: sim clock on {sw.hw}, budget {sw.budget}, {sw.max_new_tokens} tokens{on}"
        from moetool.engine.clock import load_hw

        hw = load_hw(sw.hw)[0]
        self.sized = {"budget": sw.budget, "cache_bytes": cache_bytes(sw.budget, prof.info),
                      "link": {"h2d_gbps": hw.h2d_gbps, "copy_latency_s": hw.copy_latency_s}}

    def of(self, policy: str) -> Callable[[dict[str, str]], Run]:
        return lambda settings: self.run(policy, settings)

    def run(self, policy: str, settings: dict[str, str]) -> Run:
        from moetool.model import model_fingerprint
        from moetool.source import load_config, resolve_source
        from moetool.run import run

        sweep = self.cfg.sweep
        if self.source is None and sweep.bundle is not None and sweep.model is None:
            # The bundle holds the whole model, as `run --bundle B` reads it: its non-expert weights
            # (bf16), not the profile's checkpoint's (the sweep's T(alpha) was another model's by 0.3-0.5%)
            from moetool.quant.bundle import MANIFEST, Bundle

            Bundle.load(Path(sweep.bundle) / MANIFEST, model=self.prof.model)  # another model's: one sentence
            self.source = ""
        if self.source is None:
            source = resolve_source(sweep.model or self.prof.model.source)
            if not model_fingerprint(load_config(source), source).same_model(self.prof.model):
                raise MoetoolError(f"--model {source} is not the model {self.cfg.profile} was made for "
                                   f"({self.prof.model.source}).")
            self.source = source
        return run(self.cfg.sweep_run(self.source or None, policy, settings))


def _schema(path: Path) -> str | None:
    """The schema an artifact file names (None when unreadable: `Run.load` then says why in one sentence)."""
    try:
        data = read_json(path)  # bounded: a FIFO or /dev/zero named like a run is refused, not read forever
    except MoetoolError:
        return None
    return data.get("schema") if isinstance(data, dict) else None


__all__ = ["FitConfig", "SWEEP_TOKENS", "cache_bytes", "fit"]
