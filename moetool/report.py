"""The report stage: PNG figures (`figures.py`) and a markdown summary from profile, fit, run and eval
artifacts. `summary.md` holds every table, DyMoE Table 3's ablation among them; the report refuses
artifacts of different models (or groups them, `by_model`) and replaces its directory whole.

    paths = report([Path("out/")], Path("out/report"))   # [..., out/report/summary.md]
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from moetool.artifacts import ModelFingerprint, atomic_write_bytes, read_json, replace_dir
from moetool.errors import MoetoolError
from moetool.evaluate import Eval
from moetool.figures import comparison_figures, fit_figure, precisions, profile_figures, setting_label
from moetool.fit import primary_metric
from moetool.profile import Profile
from moetool.run import Fit, Run
from moetool.schema import SchemaError, build, build_fields
from moetool.sweep import Sweep

ABLATION = ("1. Load on Demand", "2. Cache", "3. Cache + Prefetch", "4. Cache+Dyquant(4/2)",
            "5. Cache+Dyquant(4/2)+Prefetcher", "6. Cache+Dyquant(4/0)+Prefetcher", "Cache+Dyquant(4/0)")


Found = dict[str, list[tuple[Path, Any]]]  # schema -> (file, artifact), in the order found


def _read_eval(data: Any, where: str) -> dict[str, Any]:
    """Evals stay dicts: report takes hand-made eval records too (a few of Eval's fields), so only
    the fields present are checked against Eval's types, and `model` is required."""
    Eval.check_header(data, where)
    try:
        fields = build_fields(Eval, data, required=("model",))
        Eval.check_metrics(fields.get("metrics", {}))
        Eval.check_params(fields.get("policy"), fields.get("params"))
    except SchemaError as e:
        raise MoetoolError(f"{where} is not a valid eval artifact: {e.sentence()}.") from None
    return data


READERS = {"profile": Profile.from_json, "fit": Fit.from_json, "run": Run.from_json, "eval": _read_eval,
           "sweep": Sweep.from_json}  # a sweep index: its cells without artifacts
ARTIFACT_NAMES = tuple(f".{schema}.json" for schema in READERS)  # what moetool names the files it writes


def _collect(inputs: list[Path]) -> Found:
    """Every artifact under `inputs`. A file found in a directory that is not an artifact report
    draws (other JSON: configs, tokenizers, bundle manifests) is passed over; a file named on the
    command line must be one, and so must a file named like one (`*.run.json`, ...): a damaged run
    is an error, not a row missing from the tables without a word."""
    files: list[tuple[Path, bool]] = []  # (file, must be an artifact)
    for p in map(Path, inputs):
        if p.is_dir():
            files += [(f, f.name.endswith(ARTIFACT_NAMES)) for f in sorted(p.rglob("*.json"))]
        elif p.is_file():
            files.append((p, True))
        else:
            raise MoetoolError(f"{p} does not exist.")
    found: Found = defaultdict(list)
    for f, named in files:
        try:
            data = read_json(f)
        except MoetoolError:
            if named:
                raise
            continue
        schema = data.get("schema") if isinstance(data, dict) else None
        if isinstance(schema, str) and schema in READERS:
            found[schema].append((f, READERS[schema](data, where=str(f))))
        elif named:
            raise MoetoolError(f"{f} is not an artifact report draws (a {', '.join(READERS)} artifact).")
    if not found:
        raise MoetoolError(f"no profile, fit, run or eval artifacts in {', '.join(map(str, inputs))}.")
    return found


def _model(art: Any) -> ModelFingerprint:
    return build(ModelFingerprint, art["model"]) if isinstance(art, dict) else art.model


def _by_model(found: Found) -> dict[tuple[str, str], tuple[ModelFingerprint, Found]]:
    """(model_type, config sha256) -> (the model, its artifacts), in the order the models were found."""
    groups: dict[tuple[str, str], tuple[ModelFingerprint, Found]] = {}
    for schema, items in found.items():
        for path, art in items:
            fp = _model(art)
            _, mine = groups.setdefault((fp.model_type, fp.config_sha256), (fp, defaultdict(list)))
            mine[schema].append((path, art))
    return groups


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    def cell(v: Any) -> str:
        if v is None:
            return "-"
        return f"{v:.5g}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]) + "\n"


def _tag(path: Path, many: bool) -> str:
    return "-" + re.sub(r"[^A-Za-z0-9_.-]", "_", path.name.split(".")[0]) if many else ""


# -- profile figures and tables --------------------------------------------------------------------


def _peak(mean_sorted: tuple[float, ...], k: int) -> float | None:
    """Mean best gate score over the mean (k+1)-th: how peaked routing is (near 1: flat scores)."""
    if len(mean_sorted) <= k or not mean_sorted[k]:
        return None
    return mean_sorted[0] / mean_sorted[k]


def _profile_tables(path: Path, prof: Profile) -> str:
    md = [f"## Profile `{path.name}`\n\n", f"Model {prof.model.source} ({prof.model.model_type}); parts: "
          f"{', '.join(prof.what)}; data: {', '.join(f'{k} ({v} seqs)' for k, v in prof.data.items())}.\n"]
    r = prof.routing
    if r:
        md.append(f"\n### Routing\n\nTokens per layer: {r.tokens}; top-k {r.top_k} of {r.num_experts}; "
                  f"token importance: {r.importance}.\n\n")
        md.append(_table(["layer", "gini", "entropy", "top-10% share", "top-25% share", "corr(load, heavy-hitter load)",
                          f"top-1 / top-{r.top_k + 1} score"],
                         [[lr.layer, lr.gini, lr.entropy, lr.top10_share, lr.top25_share, lr.hh_load_corr,
                           _peak(lr.mean_sorted_score, r.top_k)] for lr in r.layers]))
        if r.jaccard:
            md.append(f"\nWorkload shift (DynaExq Fig. 2): mean Jaccard of per-layer top-{r.hot_k} hot sets.\n\n")
            md.append(_table(["data sets", "Jaccard"], [[k.replace("|", " vs "), v] for k, v in r.jaccard.items()]))
        if r.activation_ratio:
            sizes = sorted({int(b) for d in r.activation_ratio.values() for b in d})
            md.append("\nExpert activation ratio (%) vs batch size (DynaExq Tables 1-2; decode batches are random "
                      "decode tokens, prefill batches random prompts).\n\n")
            md.append(_table(["phase", *map(str, sizes)], [[ph, *[100 * d[str(b)] if str(b) in d else None for b in sizes]]
                                                          for ph, d in r.activation_ratio.items()]))
    s = prof.sensitivity
    if s:
        md.append(f"\n### Sensitivity\n\nBase perplexity {s.base_ppl:.3f} on {s.tokens} tokens of {s.data}; "
                  f"quantized weights: {s.source}.\n\n")
        md.append(_table(["layer", *[f"Δppl INT{b}" for b in s.bits]],
                         [[ls.layer, *[ls.delta[b] for b in s.bits]] for ls in s.layers]))
        if s.int2_share:
            md.append("\nINT2 share (Fate Fig. 10), INT4 otherwise:\n\n")
            md.append(_table(["share p", "perplexity"], [[k, v] for k, v in s.int2_share.items()]))
    if prof.similarity and prof.similarity.positions:
        pf = prof.prefetch.positions if prof.prefetch else {}
        md.append("\n### Fate Table 1 (positions vs Gate_in(i+1))\n\n")
        md.append(_table(["position", "mean cosine", "prefetch recall prefill", "prefetch recall decode"],
                         [[pos, v, pf.get(pos, {}).get("prefill"), pf.get(pos, {}).get("decode")]
                          for pos, v in prof.similarity.positions.items()]))
    if prof.prefetch:
        md.append("\n### Prefetch accuracy per layer\n\n")
        md.append(_table(["layer", "top-k prefill", "top-k decode", "p75 decode", "experts fetched p75 decode",
                          "SMoE top-score recall", "SMoE top-score precision"],
                         [[lp.layer, lp.recall_topk.get("prefill"), lp.recall_topk.get("decode"),
                           lp.recall_p75.get("decode"), lp.fetched_p75.get("decode"), lp.smoe_recall,
                           lp.smoe_precision] for lp in prof.prefetch.layers]))
    t = prof.timing
    if t:
        md.append(f"\n### Timing on {t.device} ({t.dtype}), decode medians\n\nC_CPU {t.c_cpu_s * 1e6:.1f} µs; "
                  f"H2D {'%.2f GB/s' % t.h2d_gbps if t.h2d_gbps else 'not measured (no CUDA)'}; "
                  f"t_dense {t.t_dense_s * 1e3:.3f} ms.\n\n")
        md.append(_table(["layer", "t_attn ms", "t_gate ms", "t_moe ms", "t_experts ms"],
                         [[x.layer, x.t_attn * 1e3, x.t_gate * 1e3, x.t_moe * 1e3, x.t_experts * 1e3] for x in t.layers]))
        md.append("\n" + _table(["bits", "bytes", "load µs", "dequant µs", "compute µs (1 token)"],
                                [[e.bits, e.nbytes, e.load_s * 1e6, e.dequant_s * 1e6, e.compute_s * 1e6]
                                 for e in t.experts]))
    return "".join(md)


# -- fits, runs, evals -----------------------------------------------------------------------------


def _fit_tables(path: Path, fit: Fit) -> str:
    md = [f"## Fit `{path.name}`\n\n",
          _table(["policy", "knob", "value"], [[p, k, v] for p, knobs in fit.params.items() for k, v in knobs.items()])]
    for w in fit.evidence.get("warnings", []):
        md.append(f"\n- warning: {w}")
    for k, v in fit.evidence.get("skipped", {}).items():
        md.append(f"\n- not fitted: {k}: {v}")
    lam = fit.evidence.get("dymoe", {}).get("lam")
    if lam:
        md.append(f"\n\nDyMoE schedule (eq. 4-5), lam = {lam['value']:.4f}, r = {lam['r']:.4f}, M = {lam['M']}:\n\n")
        md.append(_table(["MoE position", "r(l)", "t_l"], [[row["position"], row["r"], row["t"]] for row in lam["schedule"]]))
    return "".join(md) + "\n"


def _joined(runs: list[tuple[Path, Run]], evals: list[tuple[Path, dict]]) -> list[dict[str, Any]]:
    """One row per eval, with the TPOT of the run made with the same policy and knobs."""
    rows = []
    for epath, e in evals:
        m = primary_metric(e.get("metrics", {}))
        if m is None:
            continue
        pol, params = e.get("policy", "?"), e.get("params") or {}
        same = [(p, r) for p, r in runs if r.policy == pol and all(
            r.params[k] == v for k, v in params.items() if k in r.params and isinstance(v, (str, int, float, bool)))]
        # No fallback to "the one run of this policy": a run at other knobs (static INT4 for an INT2
        # eval, SMoE's fitted alpha for alpha = 0.3) would lend the eval a TPOT it did not have.
        tpot = same[0][1].tpot_s["mean"] if same and same[0][1].tpot_s else None
        source = same[0][0].name if tpot is not None else None
        if tpot is None:  # no matching run: the eval's own engine counters, when they hold decode steps
            tpot = ((e.get("summary") or {}).get("tpot_s") or {}).get("mean")
            source = "eval counters" if tpot is not None else None
        task = e.get("task", "?")
        rows.append({"label": setting_label(pol, params), "policy": pol, "params": params, "value": m[1],
                     "metric": m[0] if task in (m[0], "?") else f"{task} {m[0]}",  # acc of which task
                     "higher": m[2], "tpot": tpot, "eval": epath.name, "run": source})
    return rows


def _choices(e: dict) -> dict[tuple[str, Any], int]:
    """(leaf task, doc id) -> the choice with the highest log-likelihood, for multiple-choice evals."""
    return {(task, r["doc_id"]): max(range(len(r["resps"])), key=lambda i: r["resps"][i][0])
            for task, recs in (e.get("samples") or {}).items() for r in recs
            if isinstance(r, dict) and r.get("resps") and "doc_id" in r}


def _quality_table(evals: list[tuple[Path, dict]]) -> str:
    """One row per setting (policy, knobs, budget), one column per task: what each policy costs in quality.

    "agree" is the share of questions answered like `resident` (the exact model) on the same
    questions: a paired measure that still separates policies when accuracy sits near chance.
    """
    tasks = sorted({e.get("task", "?") for _, e in evals if primary_metric(e.get("metrics", {}))})
    if not tasks:
        return ""
    rows: dict[tuple[str, int], dict[str, dict]] = defaultdict(dict)
    for _, e in evals:
        if primary_metric(e.get("metrics", {})):
            cache = int((e.get("budget") or {}).get("cache_bytes") or 0)  # total budgets differ by the KV margin
            rows[setting_label(e.get("policy", "?"), e.get("params") or {}), cache][e.get("task", "?")] = e
    ref = {t: _choices(e) for (label, _), by_task in rows.items() if label.startswith("resident")
           for t, e in by_task.items()}
    with_err = {t for _, e in evals if e.get("stderr") for t in [e.get("task")]}
    heads, body = ["setting", "expert cache MiB"], []
    for t in tasks:
        heads += [t] + (["± stderr"] if t in with_err else []) + (["agree w/ resident"] if ref.get(t) else [])
    for (label, budget), by_task in sorted(rows.items(), key=lambda kv: (not kv[0][0].startswith("resident"), kv[0])):
        cells: list[Any] = [label, budget / 2**20]
        for t in tasks:
            e = by_task.get(t)
            m = primary_metric(e.get("metrics", {})) if e else None
            cells.append(m[1] if m else None)
            if t in with_err:
                cells.append((e.get("stderr") or {}).get(m[0].split(".")[-1]) if m else None)
            if ref.get(t):
                mine = _choices(e) if e else {}
                shared = [k for k in mine if k in ref[t]]
                cells.append(sum(mine[k] == ref[t][k] for k in shared) / len(shared) if shared else None)
        body.append(cells)
    return ("\n## Quality under each setting\n\nOne row per policy, knobs and budget; \"agree w/ resident\" is the "
            "share of the same questions answered as the exact model answers them.\n\n" + _table(heads, body))


def _ablation_row(r: Run) -> str | None:
    p = r.params
    if r.policy == "lod":
        return ABLATION[0]
    if r.policy in ("lru", "eap"):
        return ABLATION[1 if r.policy == "lru" else 2]
    if r.policy != "dymoe":
        return None
    prefetch = p.get("prefetcher", "dymoe") != "none"
    if float(p.get("r", 0)) >= 1.0:
        return ABLATION[2 if prefetch else 1]
    if precisions(p)[1] == 0:
        return ABLATION[5 if prefetch else 6]
    return ABLATION[4 if prefetch else 3]


def _runs_tables(runs: list[tuple[Path, Run]], rows: list[dict]) -> str:
    md = ["## Runs\n\n", _table(["run", "setting", "clock", "budget MiB", "TTFT ms", "TPOT mean ms", "hit rate"],
                                [[p.name, setting_label(r.policy, r.params), f"{r.clock}{'/' + r.hw if r.hw else ''}",
                                  r.budget_bytes / 2**20, r.ttft_s * 1e3 if r.ttft_s is not None else None,
                                  r.tpot_s["mean"] * 1e3 if r.tpot_s else None, r.hit_rate] for p, r in runs])]
    if rows:
        md += ["\n## Policy comparison (eval + run)\n\n",
               _table(["setting", "metric", "value", "TPOT mean ms", "eval", "TPOT from"],
                      [[x["label"], x["metric"], x["value"], x["tpot"] * 1e3 if x["tpot"] else None, x["eval"],
                        x["run"]] for x in rows])]
    cells: dict[tuple[str, int], list[Run]] = defaultdict(list)
    names: dict[str, list[str]] = defaultdict(list)
    for path, r in runs:
        row = _ablation_row(r)
        if row:
            cells[row, r.budget_bytes].append(r)
            names[row].append(path.name)
    if cells:
        budgets = sorted({b for _, b in cells})
        heads = [h for b in budgets for h in (f"TTFT(s) {b / 2**20:.0f} MiB", f"TPOT(s) {b / 2**20:.0f} MiB")]
        body = []
        for name in ABLATION:
            if not any((name, b) in cells for b in budgets):
                continue
            vals = []
            for b in budgets:
                rs = cells.get((name, b), [])
                vals.append(float(np.mean([r.ttft_s for r in rs if r.ttft_s is not None])) if rs else None)
                vals.append(float(np.mean([r.tpot_s["mean"] for r in rs if r.tpot_s])) if rs else None)
            body.append([name, *vals, ", ".join(names[name])])
        clocks = sorted({f"{r.clock}{'/' + r.hw if r.hw else ''}" for rs in cells.values() for r in rs})
        md += [f"\n## Ablation in the style of DyMoE Table 3 (clock: {', '.join(clocks)}; a cell averages its runs)\n\n",
               _table(["Configuration", *heads, "runs"], body)]
    return "".join(md)


def _sweep_table(sweeps: list[tuple[Path, Sweep]]) -> str:
    """The cells of `moetool sweep` indexes that left no artifact, each with its one-sentence reason."""
    rows = [[str(path.parent), name, c.get("status"), str(c.get("reason") or "-").replace("|", "\\|")]
            for path, s in sweeps for name, c in s.cells.items() if c.get("status") != "done"]
    if not rows:
        return ""
    return "\n## Sweep cells without an artifact\n\n" + _table(["sweep", "cell", "status", "reason"], rows)


def _eval_ppl(evals: list[tuple[Path, dict]], policy: str, **knobs: Any) -> dict | None:
    """The first perplexity eval of `policy` whose recorded params include `knobs` (floats to 1e-9)."""
    def same(a: Any, b: Any) -> bool:
        if isinstance(b, dict):
            return isinstance(a, dict) and all(same(a.get(k), v) for k, v in b.items())
        if isinstance(b, float) and isinstance(a, (int, float)):
            return math.isclose(a, b, rel_tol=1e-9)
        return a == b

    for _, e in evals:
        if e.get("task") == "ppl" and e.get("policy") == policy and same(e.get("params") or {}, knobs):
            return e
    return None


def _trends_table(found: Found) -> str:
    """The papers' headline trends checked on this model, from the evals and profiles present.

    SMoE §VI-B (substitution at alpha = 0.3 costs little), DyMoE Table 2 (4/0 at r = 0.9 near
    uniform INT4), DynaExq §5 (4/2 above static INT2 at the same budget), DyMoE Fig. 5 (INT2 in one
    shallow layer hurts more than in a deep one). A row appears only when both sides were measured.
    """
    evals = found.get("eval", [])
    ppl = lambda e: e["metrics"]["ppl"]  # noqa: E731
    rows = []
    resident, int4 = _eval_ppl(evals, "resident"), _eval_ppl(evals, "static", bits=4)
    int2 = _eval_ppl(evals, "static", bits=2)
    smoe = _eval_ppl(evals, "smoe", alpha=0.3)
    dymoe = _eval_ppl(evals, "dymoe", r=0.9, precisions={"high": 4, "low": 0})
    dynaexq = _eval_ppl(evals, "dynaexq", precisions={"high": 4, "low": 2})
    if smoe and resident:
        d = ppl(smoe) / ppl(resident) - 1
        rows.append(["SMoE alpha = 0.3 within 1% of resident", f"{ppl(smoe):.3f} vs {ppl(resident):.3f}",
                     f"{100 * d:+.2f}%", "met" if d <= 0.01 else "not met"])
    if dymoe and int4:
        d = ppl(dymoe) / ppl(int4) - 1
        rows.append(["DyMoE 4/0 r = 0.9 within 2% of static INT4", f"{ppl(dymoe):.3f} vs {ppl(int4):.3f}",
                     f"{100 * d:+.2f}%", "met" if d <= 0.02 else "not met"])
    if dynaexq and int2:
        d = ppl(dynaexq) / ppl(int2) - 1
        budget = (dynaexq.get("budget") or {}).get("cache_bytes")
        at = f" (DynaExq's expert cache {budget / 2**20:.1f} MiB)" if budget else ""
        rows.append([f"DynaExq 4/2 better than static INT2{at}", f"{ppl(dynaexq):.3f} vs {ppl(int2):.3f}",
                     f"{100 * d:+.2f}%", "met" if d < 0 else "not met"])
    for path, prof in found.get("profile", []):
        s = prof.sensitivity
        if s and 2 in s.bits and len(s.layers) >= 3:
            third = max(1, len(s.layers) // 3)
            shallow = sum(ls.delta[2] for ls in s.layers[:third]) / third
            deep = sum(ls.delta[2] for ls in s.layers[-third:]) / third
            rows.append([f"INT2 in one layer hurts shallow layers more than deep ones (`{path.name}`)",
                         f"mean Δppl first {third} layers {shallow:+.3f}, last {third} {deep:+.3f}",
                         f"{shallow / deep:.2f}x" if deep > 0 else "-", "met" if shallow > deep else "not met"])
    if not rows:
        return ""
    return ("\n## The papers' trends on this model\n\nEach claim as the papers state it, measured here "
            "(perplexity).\n\n" + _table(["claim", "measured", "difference", ""], rows))


def _report_one(found: Found, out_dir: Path) -> list[Path]:
    """Figures and summary.md for the artifacts of one model, into the existing `out_dir`."""
    out: list[Path] = []
    fits = [f for _, f in found.get("fit", [])]
    md = ["# moetool report\n\n", "Inputs: " + ", ".join(f"`{p}` ({s})" for s, items in found.items()
                                                          for p, _ in items) + "\n\n"]
    for path, prof in found.get("profile", []):
        same = [f for f in fits if f.model.same_model(prof.model)]
        profile_figures(prof, same, out_dir, _tag(path, len(found["profile"]) > 1), out)
        md.append(_profile_tables(path, prof) + "\n")
    for path, fit in found.get("fit", []):
        fit_figure(fit, out_dir, _tag(path, len(fits) > 1), out)
        md.append(_fit_tables(path, fit))
    runs = found.get("run", [])
    rows = _joined(runs, found.get("eval", []))
    if runs or rows:
        md.append(_runs_tables(runs, rows))
    md.append(_quality_table(found.get("eval", [])))
    md.append(_trends_table(found))
    md.append(_sweep_table(found.get("sweep", [])))
    comparison_figures(rows, out_dir, out)
    md.append("\n## Figures\n\n" + "".join(f"- ![{p.stem}]({p.name})\n" for p in out))
    summary = out_dir / "summary.md"
    atomic_write_bytes(summary, "".join(md).encode())
    return [*out, summary]


def _is_report(directory: Path, depth: int = 0) -> str | None:
    """None if `directory` holds only what a report writes (summary.md, the figures it links,
    per-model sub-reports), else the first name that is not, so replacing it can lose nothing of
    the user's (a figure of their own that summary.md does not link included)."""
    summary = directory / "summary.md"
    try:
        linked = summary.read_text(encoding="utf-8") if summary.is_file() else ""
    except (OSError, UnicodeDecodeError):
        linked = ""
    for p in sorted(directory.iterdir()):
        if p.is_dir() and not p.is_symlink() and depth == 0:
            bad = _is_report(p, depth + 1)
            if bad is not None:
                return f"{p.name}/{bad}"
        elif not (p.is_file() and (p.name == "summary.md" or (p.suffix == ".png" and f"({p.name})" in linked))):
            return p.name
    return None


def report(inputs: list[Path], out_dir: Path, by_model: bool = False) -> list[Path]:
    """Write figures and `summary.md` for the artifacts in `inputs` (files or directories) to `out_dir`.

    Artifacts of different models are refused, or with `by_model` reported one sub-directory per
    model (`<model_type>-<config hash>`) under an index summary.md. The report is built in a temp
    directory beside `out_dir` and swapped in whole: an interrupted report leaves the previous one
    (or none), never figures without their summary, and a new one leaves no stale figures behind.
    """
    found = _collect(list(inputs))
    groups = _by_model(found)
    if len(groups) > 1 and not by_model:
        (fa, ga), (fb, gb) = list(groups.values())[:2]
        a, b = (next(path for items in g.values() for path, _ in items) for g in (ga, gb))
        raise MoetoolError(f"{a} and {b} were made for different models ({fa.source}, {fa.model_type} config "
                           f"{fa.config_sha256[:12]}, vs {fb.source}, {fb.model_type} config {fb.config_sha256[:12]}); "
                           "report them separately, or pass --by-model for one sub-report per model.")
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise MoetoolError(f"{out_dir} is a file; a report is a directory, choose another --out.")
    if out_dir.is_dir() and (bad := _is_report(out_dir)) is not None:
        raise MoetoolError(f"{out_dir} holds {bad!r}, which is not part of a moetool report; a report replaces its "
                           "directory whole, so choose another --out.")

    def fill(tmp: Path) -> list[Path]:
        if not by_model:
            return _report_one(found, tmp)
        written, index = [], ["# moetool report\n\nOne report per model:\n\n"]
        for fp, mine in groups.values():
            name = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{fp.model_type}-{fp.config_sha256[:12]}")
            (tmp / name).mkdir()
            written += _report_one(mine, tmp / name)
            index.append(f"- [{fp.source} ({fp.model_type}, config {fp.config_sha256[:12]})]({name}/summary.md)\n")
        atomic_write_bytes(tmp / "summary.md", "".join(index).encode())
        return [*written, tmp / "summary.md"]

    return replace_dir(out_dir, fill)


__all__ = ["report"]
