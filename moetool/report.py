"""The report stage: PNG figures and a markdown summary from profile, fit, run and eval artifacts.

`summary.md` holds the tables of each artifact (a profile's parts, a fit's knobs, the runs, quality
under each setting, each eval paired with the run of its setting), then each paper's own part: every
registered policy with a `report` (`Knobs.report`, `policies/stages.py`) adds its tables, figures
and claims (Fate's Table 1, DyMoE's Table 3 ablation, ...), the claims gathered in one table. The
report refuses artifacts of different models (or groups them, `by_model`) and replaces its
directory whole.

    paths = report([Path("out/")], Path("out/report"))   # [..., out/report/summary.md]
"""

from __future__ import annotations

import os
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from moetool.artifacts import atomic_write_bytes, replace_dir
from moetool.fit_artifact import Fit
from moetool.errors import MoetoolError
from moetool.figures import comparison_figures, profile_figures, setting_label
from moetool.files import text_bytes
from moetool.policies import hooked
from moetool.policies.stages import (ReportInputs, bundle_names, bundle_of, cache_bytes, machine, ppl_measurement,
                                     primary_metric, shown_names)
from moetool.policies.stages import table as _table
from moetool.profile_artifact import Profile
from moetool.report_inputs import Found, collect, group_by_model
from moetool.run_artifact import Run
from moetool.sweep import Sweep


# -- profile tables --------------------------------------------------------------------------------


def _peak(mean_sorted: tuple[float, ...], k: int) -> float | None:
    """Mean best gate score over the mean (k+1)-th: how peaked routing is (near 1: flat scores)."""
    if len(mean_sorted) <= k or not mean_sorted[k]:
        return None
    return mean_sorted[0] / mean_sorted[k]


def _profile_tables(name: str, prof: Profile) -> str:
    md = [f"## Profile `{name}`\n\n", f"Model {prof.model.source} ({prof.model.model_type}); parts: "
          f"{', '.join(prof.what)}; data: {', '.join(f'{k} ({v} seqs)' for k, v in prof.data.items())}.\n"]
    r = prof.routing
    if r:
        md.append(f"\n### Routing\n\nTokens per layer: {r.tokens}; top-k {r.top_k} of {r.num_experts}; "
                  f"token importance: {r.importance}.\n\n")
        md.append(_table(["layer", "gini", "entropy", "top-10% share", "top-25% share", "corr(load, heavy-hitter load)",
                          f"top-1 / top-{r.top_k + 1} score"],
                         [[lr.layer, lr.gini, lr.entropy, lr.top10_share, lr.top25_share, lr.hh_load_corr,
                           _peak(lr.mean_sorted_score, r.top_k)] for lr in r.layers]))
    s = prof.sensitivity
    if s:
        md.append(f"\n### Sensitivity\n\nBase perplexity {s.base_ppl:.3f} on {s.tokens} tokens of {s.data}; "
                  f"quantized weights: {s.source}.\n\n")
        md.append(_table(["layer", *[f"Δppl INT{b}" for b in s.bits]],
                         [[ls.layer, *[ls.delta[b] for b in s.bits]] for ls in s.layers]))
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
                  f"t_dense {t.t_dense_s * 1e3:.3f} ms"
                  + (f", {t.t_dense_captured_s * 1e3:.3f} ms in the captured step" if t.t_dense_captured_s is not None
                     else "") + ".\n\n")
        md.append(_table(["layer", "t_attn ms", "t_gate ms", "t_moe ms", "t_experts ms"],
                         [[x.layer, x.t_attn * 1e3, x.t_gate * 1e3, x.t_moe * 1e3, x.t_experts * 1e3] for x in t.layers]))
        md.append("\n" + _table(["bits", "bytes", "path", "load µs", "dequant µs", "compute µs (1 token)"],
                                [[e.bits, e.nbytes, e.path, e.load_s * 1e6, e.dequant_s * 1e6, e.compute_s * 1e6]
                                 for e in t.experts]))
    return "".join(md)


# -- fits, runs, evals -----------------------------------------------------------------------------


def _fit_tables(name: str, fit: Fit) -> str:
    md = [f"## Fit `{name}`\n\n",
          _table(["policy", "knob", "value"], [[p, k, v] for p, knobs in fit.params.items() for k, v in knobs.items()])]
    for w in fit.evidence.get("warnings", []):
        md.append(f"\n- warning: {w}")
    for k, v in fit.evidence.get("skipped", {}).items():
        md.append(f"\n- not fitted: {k}: {v}")
    return "".join(md) + "\n"


def _same_budget(r: Run, e: dict) -> bool:
    """Whether a run and an eval had the same budget: the same expert cache (a share such as 25%), or
    the same whole budget (12GiB, whose cache shrinks with the longer eval's KV margin). A hand-made
    eval that records neither is not held to it."""
    pairs = [(a, b) for a, b in ((r.budget.get("cache_bytes"), (e.get("budget") or {}).get("cache_bytes")),
                                 (r.budget_bytes, e.get("budget_bytes"))) if a is not None and b is not None]
    return not pairs or any(a == b for a, b in pairs)


def _joined(runs: list[tuple[Path, Run]], evals: list[tuple[Path, dict]], names: dict | None = None) -> list[dict]:
    """One row per eval, with the TPOT of the run made with the same policy, knobs and budget."""
    names = names if names is not None else shown_names([p for p, _ in (*runs, *evals)])
    rows = []
    # a task measured more than one way (ppl at two windows) gets a metric per way: one axis and one
    # column mixed perplexities of different windows as if they were one measure
    columns = _measures([e for _, e in evals if primary_metric(e.get("metrics", {}))])
    # Where several runs match an eval, every row takes one from the same clock, machine and decode path
    # (the one most runs have): the first by file name gave one policy the captured path's TPOT and
    # another the host path's, side by side in one table and one figure.
    timing = Counter(_timing(r) for _, r in runs)
    preferred = max(timing, key=lambda t: (timing[t], t)) if timing else None
    for epath, e in evals:
        m = primary_metric(e.get("metrics", {}))
        if m is None:
            continue
        pol, params = e.get("policy", "?"), e.get("params") or {}
        same = [(p, r) for p, r in runs if r.policy == pol and _same_budget(r, e) and bundle_of(r.inputs) == bundle_of(
            e.get("inputs")) and all(r.params[k] == v for k, v in params.items() if k in r.params and
                                     isinstance(v, (str, int, float, bool)))]
        # No fallback to "the one run of this policy": a run at other knobs (static INT4 for an INT2
        # eval, SMoE's fitted alpha for alpha = 0.3) would lend the eval a TPOT it did not have.
        # A batch of one first: a quality row's TPOT is one sequence's (a batched run's steps serve several).
        same.sort(key=lambda pr: (_timing(pr[1]) != preferred, pr[1].batch_size != 1, pr[0].name))
        tpot = same[0][1].tpot_s["mean"] if same and same[0][1].tpot_s else None
        source = f"{names[same[0][0]]} ({', '.join(_timing(same[0][1]))})" if tpot is not None else None
        if source and _eval_clock(e) and _timing(same[0][1])[0] != _eval_clock(e):  # a residency-reading policy
            source += f"; quality on the {_eval_clock(e)} clock"
        eval_path = f"{(e.get('summary') or {}).get('path', 'host')} path"  # an eval decodes on the host path
        if source and _timing(same[0][1])[1] != eval_path:  # a policy that reads residency decides a token late there
            source += f"; quality on the {eval_path}"
        if tpot is None:  # no matching run: the eval's own engine counters, when they hold decode steps
            tpot = ((e.get("summary") or {}).get("tpot_s") or {}).get("mean")
            source = "eval counters" if tpot is not None else None
        task, column = e.get("task", "?"), columns[id(e)]
        metric = m[0] if task == "?" else column if task == m[0] else f"{column} {m[0]}"  # acc of which task
        rows.append({"label": setting_label(pol, params), "policy": pol, "params": params, "value": m[1],
                     "metric": metric,
                     "higher": m[2], "tpot": tpot, "eval": names[epath], "run": source})
    return rows


def _eval_clock(e: dict) -> str | None:
    """The clock an eval ran on, with the simulated machine (`stages.machine`: "sim/rtx3090", "wall"); None
    for a hand-made eval that records none."""
    return machine(e.get("clock"), e.get("hw"), e.get("inputs"))


def _timing(r: Run) -> tuple[str, str]:
    """What a run's TPOT was measured on: its clock (with the simulated machine) and its decode path."""
    return machine(r.clock, r.hw, r.inputs) or "?", f"{(r.summary or {}).get('path', 'host')} path"


def _choices(e: dict) -> dict[tuple[str, Any], Any]:
    """(leaf task, doc id) -> the model's answer: for multiple choice the choice with the highest
    log-likelihood; for one continuation (`output_type: loglikelihood`) whether it is the greedy one, what
    lm-eval's acc scores (its argmax over one pair was always 0, so every policy "agreed" on every doc)."""
    def answer(resps: list) -> Any:
        if len(resps) > 1:
            return max(range(len(resps)), key=lambda i: resps[i][0])
        return bool(resps[0][1]) if len(resps[0]) > 1 else None

    picked = {(task, r["doc_id"]): answer(r["resps"])
              for task, recs in (e.get("samples") or {}).items() for r in recs
              if isinstance(r, dict) and r.get("resps") and "doc_id" in r
              and all(isinstance(x, list) and x for x in r["resps"])}  # [log-likelihood, is-greedy] pairs
    return {k: v for k, v in picked.items() if v is not None}


def _measures(evals: list[dict]) -> dict[int, str]:
    """Each eval's column: its task, and where one task was measured more than one way (ppl on two texts,
    or one file's two contents, windows, limits; a task at two few-shot counts or limits, or of one name
    and two contents: a task YAML named as typed in two directories, or edited) what it was
    measured on, so that one row's cell never shows one of several numbers (the last one read)."""
    def measure(e: dict) -> tuple:
        if e.get("task") == "ppl":
            return ppl_measurement(e)
        o = e.get("options") or {}
        shots, ran = o.get("num_fewshot"), set((o.get("n_shot") or {}).values()) - {None}
        if shots is not None and len(ran) == 1 and shots not in ran:  # a task that pins its count: what ran
            shots = ran.pop()
        return (shots, o.get("limit"), o.get("task_files") or known.get(e.get("task")))  # its files' content

    # an eval written before task files were recorded is of the one content its task's others record, if one
    contents: dict[str, set] = defaultdict(set)
    for e in evals:
        contents[e.get("task")].add((e.get("options") or {}).get("task_files"))
    known = {t: next(iter(c - {None})) for t, c in contents.items() if len(c - {None}) == 1}
    kinds: dict[str, set] = defaultdict(set)
    for e in evals:
        kinds[e.get("task", "?")].add(measure(e))
    out = {}
    for e in evals:
        task, m = e.get("task", "?"), measure(e)
        if len(kinds[task]) == 1:
            out[id(e)] = task
        elif task == "ppl":
            name, sha, context, limit, stepwise = m
            same_name = sum(k[0] == name for k in kinds[task]) > 1 and len({k[1] for k in kinds[task]
                                                                             if k[0] == name}) > 1
            out[id(e)] = (f"ppl ({name}{'@' + sha[:8] if same_name and sha else ''}, context {context}"
                          f"{f', {limit} tokens' if limit else ''}{', stepwise' if stepwise else ''})")
        else:
            shots, limit, files = m
            other_files = len({k[2] for k in kinds[task]}) > 1
            out[id(e)] = (f"{task}{'@' + files[:8] if other_files and files else ''} "
                          f"({'default' if shots is None else shots}-shot{f', limit {limit}' if limit else ''})")
    return out


def _quality_table(evals: list[tuple[Path, dict]], names: dict[Path, str] | None = None) -> str:
    """One row per setting (policy, knobs, budget), one column per task: what each policy costs in quality.

    "agree" is the share of questions answered like `resident` (the exact model) on the same
    questions: a paired measure that still separates policies when accuracy sits near chance.
    """
    names = names if names is not None else shown_names([p for p, _ in evals])
    paths = {id(e): p for p, e in evals}
    scored = [e for _, e in evals if primary_metric(e.get("metrics", {}))]
    columns = _measures(scored)
    tasks = sorted(set(columns.values()))
    if not tasks:
        return ""
    # bf16 against fp32 moves a perplexity by tenths of a percent: where both were scored, each its own row.
    # So does the clock for a policy that reads residency (SMoE's substitutes, DyMoE's reuse of a resident
    # high-bit copy, every prefetch): fills land when the simulated link finishes, or at once on a CPU's
    # wall clock, so one setting evaluated on both computed different things.
    dtypes = len({e.get("dtype", "float32") for e in scored}) > 1
    clocks = len({_eval_clock(e) for e in scored} - {None}) > 1
    # two bundles of one model (group size, method): each its own row, named by its directory's last parts
    bundles = bundle_names([e.get("inputs") for e in scored])
    several = len({bundle_of(e.get("inputs")) for e in scored}) > 1
    rows: dict[tuple[str, int], dict[str, dict]] = defaultdict(dict)
    again: list[str] = []
    for e in scored:
        cache = int((e.get("budget") or {}).get("cache_bytes") or 0)  # total budgets differ by the KV margin
        label = setting_label(e.get("policy", "?"), e.get("params") or {})
        label += f" ({e.get('dtype', 'float32')})" if dtypes else ""
        label += f" ({_eval_clock(e) or 'unrecorded'} clock)" if clocks else ""
        label += f" (bundle {bundles[bundle_of(e.get('inputs'))]})" if several else ""
        held = rows[label, cache].get(columns[id(e)])
        if held is not None:  # one cell, two evals: the table shows one, and says which
            again.append(f"`{names[paths[id(held)]]}` and `{names[paths[id(e)]]}` ({label}, {columns[id(e)]}: "
                         f"the table shows the second)")
        rows[label, cache][columns[id(e)]] = e
    ref = {t: _choices(e) for (label, _), by_task in rows.items() if label.startswith("resident")
           for t, e in by_task.items()}
    with_err = {columns[id(e)] for e in scored if e.get("stderr")}
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
    note = ("\nEvals of one setting and measure: " + "; ".join(again) + ".\n") if again else ""
    return ("\n## Quality under each setting\n\nOne row per policy, knobs and budget; \"agree w/ resident\" is the "
            "share of the same questions answered as the exact model answers them.\n\n" + _table(heads, body) + note)


def _runs_tables(runs: list[tuple[Path, Run]], rows: list[dict], names: dict[Path, str] | None = None) -> str:
    names = names if names is not None else shown_names([p for p, _ in runs])
    bundles = bundle_names([r.inputs for _, r in runs])
    several = len({bundle_of(r.inputs) for _, r in runs}) > 1  # runs of a group-16 and a group-8 bundle, alike

    def setting(r: Run) -> str:
        return setting_label(r.policy, r.params) + (f", batch {r.batch_size}" if r.batch_size > 1 else "") + (
            f", bundle {bundles[bundle_of(r.inputs)]}" if several else "")

    # the workload beside the times: TTFT and TPOT move with the prompts and how far they are decoded
    md = ["## Runs\n\n", _table(["run", "setting", "clock", "path", "prompts x tokens", "expert cache MiB",
                                 "budget MiB", "TTFT ms", "TPOT mean ms", "hit rate"],
                                [[names[p], setting(r), _clock_cell(r), (r.summary or {}).get("path", "-"),
                                  f"{len(r.prompts)} x {max(map(len, r.tokens), default=0)}",
                                  cache_bytes(r) / 2**20,
                                  r.budget_bytes / 2**20, r.ttft_s * 1e3 if r.ttft_s is not None else None,
                                  r.tpot_s["mean"] * 1e3 if r.tpot_s else None, r.hit_rate] for p, r in runs])]
    if rows:
        md += ["\n## Policy comparison (eval + run)\n\n",
               _table(["setting", "metric", "value", "TPOT mean ms", "eval", "TPOT from"],
                      [[x["label"], x["metric"], x["value"], x["tpot"] * 1e3 if x["tpot"] else None, x["eval"],
                        x["run"]] for x in rows])]
    return "".join(md)


def _clock_cell(r: Run) -> str:
    """A run's clock as the Runs table says it: the simulated machine (`stages.machine`), or the device and
    (on a CPU) the threads a wall-clock time was measured with (two CPU times at 1 and 16 threads are two machines)."""
    if r.clock != "wall":
        return machine(r.clock, r.hw, r.inputs) or "?"
    threads = (r.summary or {}).get("host_threads")
    return f"wall/{r.device}" + (f", {threads} thread{'s' * (threads != 1)}" if threads and r.device.startswith("cpu") else "")


def _sweep_table(sweeps: list[tuple[Path, Sweep]]) -> str:
    """The cells of `moetool sweep` indexes that left no artifact, each with its one-sentence reason; a
    cell the index calls done whose artifact is gone from the sweep's directory too (deleted, or the
    directory copied in part), which would otherwise be missing from the tables without a word."""
    from moetool.files import lock_held

    # a pending cell whose artifact is there was written after the index last was (a sweep under way)
    rows = [[str(path.parent), name, c.get("status"), str(c.get("reason") or "-").replace("|", "\\|")]
            for path, s in sweeps for name, c in s.cells.items() if c.get("status") != "done"
            and not (c.get("status") == "pending" and (path.parent / f"{name}.{s.stage}.json").is_file())]
    rows += [[str(path.parent), name, "done, artifact missing", f"{c['artifact']} is not in {path.parent}"]
             for path, s in sweeps for name, c in s.cells.items()
             if c.get("status") == "done" and c.get("artifact") and not (path.parent / c["artifact"]).is_file()]
    busy = [str(path.parent) for path, _ in sweeps if lock_held(path.parent / ".sweep.lock")]  # sweep.LOCK
    said = f"\nA sweep is still writing {', '.join(busy)}: this report shows it part-way.\n" if busy else ""
    if not rows:
        return said
    return "\n## Sweep cells without an artifact\n\n" + _table(["sweep", "cell", "status", "reason"], rows) + said


def _claims_table(claims: list[list[str]]) -> str:
    """The papers' headline claims checked on this model, one row each where both sides were measured."""
    if not claims:
        return ""
    return ("\n## The papers' trends on this model\n\nEach claim as the papers state it, measured here "
            "(perplexity).\n\n" + _table(["claim", "measured", "difference", ""], claims))


def _report_one(found: Found, out_dir: Path, copies: dict[Path, Path] | None = None) -> list[Path]:
    """Figures and summary.md for the artifacts of one model, into the existing `out_dir`."""
    out: list[Path] = []
    mine = {p for items in found.values() for p, _ in items}
    same = [f"`{c}` (a copy of `{f}`)" for c, f in (copies or {}).items() if f in mine]
    md = ["# moetool report\n\n", "Inputs: " + ", ".join(f"`{p}` ({s})" for s, items in sorted(found.items())
                                                          for p, _ in items) + "\n\n",
          *([f"Read once, as the same bytes as another input: {', '.join(same)}.\n\n"] if same else [])]
    runs, profiles = found.get("run", []), found.get("profile", [])  # the Profiles (the hooks' ProfileRecord has less)
    names = shown_names([p for items in found.values() for p, _ in items])
    rows = _joined(runs, found.get("eval", []), names)
    inputs = ReportInputs(profiles=tuple(profiles), fits=tuple(found.get("fit", [])), runs=tuple(runs),
                          evals=tuple(found.get("eval", [])), rows=tuple(rows), out_dir=out_dir, names=names)
    for path, prof in profiles:
        profile_figures(prof, out_dir, inputs.tag(path), out)
        md.append(_profile_tables(names[path], prof) + "\n")
    for path, fit in inputs.fits:
        md.append(_fit_tables(names[path], fit))
    if runs or rows:
        md.append(_runs_tables(runs, rows, names))
    md.append(_quality_table(found.get("eval", []), names))
    comparison_figures(rows, out_dir, out)
    papers, claims = [], []
    for _, cls in hooked("report"):  # each paper's report once, without its engine half (no torch)
        part = cls.report(inputs)
        if part is not None:
            papers.append(part.markdown)
            out += part.figures
            claims += part.claims
    md.append(_claims_table(claims))
    md += ["\n" + m for m in papers if m]
    md.append(_sweep_table(found.get("sweep", [])))
    md.append("\n## Figures\n\n" + "".join(f"- ![{p.stem}]({p.name})\n" for p in out))
    summary = out_dir / "summary.md"
    atomic_write_bytes(summary, text_bytes("".join(md)))
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
    copies: dict[Path, Path] = {}
    found = collect(list(inputs), copies)
    groups = group_by_model(found)
    if len(groups) > 1 and not by_model:
        (fa, ga), (fb, gb) = list(groups.values())[:2]
        a, b = (next(path for items in g.values() for path, _ in items) for g in (ga, gb))
        raise MoetoolError(f"{a} and {b} were made for different models ({fa.describe()} vs {fb.describe()}); "
                           "report them separately, or pass --by-model for one sub-report per model.")
    out_dir = Path(out_dir)
    if out_dir.is_symlink():  # the swap renames a directory over the link: the link, not its target, is replaced
        raise MoetoolError(f"--out {out_dir} is a symbolic link (to {os.readlink(out_dir)}); a report replaces its "
                           "directory whole, so give the directory itself, or another --out.")
    if out_dir.exists() and not out_dir.is_dir():
        raise MoetoolError(f"{out_dir} is a file; a report is a directory, choose another --out.")
    if out_dir.is_dir() and (bad := _is_report(out_dir)) is not None:
        raise MoetoolError(f"{out_dir} holds {bad!r}, which is not part of a moetool report; a report replaces its "
                           "directory whole, so choose another --out.")

    def fill(tmp: Path) -> list[Path]:
        if not by_model:
            return _report_one(found, tmp, copies)
        written, index = [], ["# moetool report\n\nOne report per model:\n\n"]
        for name, (fp, mine) in groups.items():
            (tmp / name).mkdir()
            written += _report_one(mine, tmp / name, copies)
            index.append(f"- [{fp.describe()}]({name}/summary.md)\n")
        atomic_write_bytes(tmp / "summary.md", text_bytes("".join(index)))
        return [*written, tmp / "summary.md"]

    return replace_dir(out_dir, fill)


__all__ = ["report"]
