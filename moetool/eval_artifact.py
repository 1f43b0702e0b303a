"""The artifact of `moetool eval` (`Eval`): task metrics beside the engine's record, read without torch
(`moetool report`, `moetool fit`); the eval stage itself is `evaluate.py`.

    Eval.load(Path("out/dymoe.eval.json")).metrics["ppl"]
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from moetool.artifacts import Artifact
from moetool.schema import SchemaError
from moetool.spec import EngineRecord


# lm-eval metrics that are shares of the examples scored, whatever the task.
SHARES = ("acc", "acc_norm", "exact_match", "accuracy", "mean_accuracy")


@dataclass(frozen=True)
class Eval(EngineRecord, Artifact):
    """What one `moetool eval` measured: task metrics, beside the engine's record while measuring.

    `metrics` holds the headline values of `task` under lm-eval's metric names (`acc`,
    `acc_norm`, ...; a filter other than lm-eval's "none" is kept as `name,filter`), or `ppl` and
    `nll` (mean negative log-likelihood per predicted token, nats) for perplexity. `subtasks`
    breaks a group down by leaf task. `samples` keeps what a paired comparison of two policies
    needs: per example the target, lm-eval's filtered responses (for multiple choice one
    [log-likelihood, is-greedy] pair per choice) and the per-example metrics; for perplexity, per
    window its first token, predicted tokens and summed NLL. The engine's counters over the whole
    evaluation (precision mix, skips, hit rate, bytes) are the `EngineRecord` fields.
    """

    SCHEMA: ClassVar[str] = "eval"
    SCHEMA_VERSION: ClassVar[int] = 2  # 2: the engine record's peak_device_bytes and dtype at the top, as in a Run

    task: str
    metrics: dict[str, float]
    stderr: dict[str, float]  # metric -> standard error, where lm-eval reports one
    n: int  # examples scored (lm-eval tasks, summed over a group) or tokens predicted (ppl)
    unit: str  # "examples" or "tokens"
    subtasks: dict[str, dict[str, float]]  # leaf task -> metric (and metric_stderr) -> value
    samples: dict[str, list[dict[str, Any]]]  # leaf task (or "ppl") -> per-example records
    options: dict[str, Any]  # num_fewshot, limit, batch_size, context, stepwise, data, lm_eval version

    def validate(self) -> None:
        super().validate()
        Eval.check_present({"task": self.task, "metrics": self.metrics, "n": self.n, "subtasks": self.subtasks})
        Eval.check_metrics(self.metrics)
        Eval.check_scores({"stderr": self.stderr, "samples": self.samples, "summary": self.summary})

    @staticmethod
    def check_scores(fields: dict[str, Any]) -> None:
        """On read, of those of these fields present: what report compares policies with. Standard errors
        are finite and not negative; a sample's doc_id is a number or a name; a multiple-choice sample's
        responses are [log-likelihood, is-greedy] pairs with a finite log-likelihood (report's "agree w/
        resident" takes their argmax); the summary's TPOT statistics are an object."""
        for key, v in (fields.get("stderr") or {}).items():
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise SchemaError(f"stderr['{key}']", f"is {v!r}, not a finite number of at least 0")
        for task, records in (fields.get("samples") or {}).items():
            for i, r in enumerate(records):
                where = f"samples[{task!r}][{i}]"
                doc = r.get("doc_id")
                if doc is not None and (isinstance(doc, bool) or not isinstance(doc, (int, str))):
                    raise SchemaError(f"{where}.doc_id", f"is {doc!r}, not a document's number or name")
                resps = r.get("resps")
                if resps is None:
                    continue
                if not isinstance(resps, list):
                    raise SchemaError(f"{where}.resps", f"is {resps!r}, not a list of responses")
                if any(isinstance(x, list) for x in resps) and not all(
                        isinstance(x, list) and x and isinstance(x[0], (int, float)) and not isinstance(x[0], bool)
                        and math.isfinite(x[0]) for x in resps):
                    raise SchemaError(f"{where}.resps", "holds a response that is not a [log-likelihood, is-greedy] "
                                                        "pair with a finite log-likelihood")
        tpot = (fields.get("summary") or {}).get("tpot_s")
        if tpot is not None and not isinstance(tpot, dict):
            raise SchemaError("summary['tpot_s']", f"is {tpot!r}, not the object of TPOT statistics")

    @staticmethod
    def check_present(fields: dict[str, Any]) -> None:
        """On read, of those of these fields present (report takes hand-made records of a few): a
        task is named, at least one metric is reported (an lm-eval tag has no headline of its own: its
        tasks' metrics are in `subtasks`), at least one example or token scored."""
        if "task" in fields and not str(fields["task"]).strip():
            raise SchemaError("task", "is empty; an evaluation names its task")
        tasks = fields.get("subtasks")
        if "metrics" in fields and not fields["metrics"] and not (isinstance(tasks, dict) and any(tasks.values())):
            raise SchemaError("metrics", "is empty; an evaluation reports at least one metric")
        if "n" in fields and fields["n"] < 1:
            raise SchemaError("n", f"is {fields['n']}; an evaluation scores at least one example or token")

    @staticmethod
    def check_metrics(metrics: dict[str, Any]) -> None:
        """On read: every metric is a finite number, and a perplexity or NLL one it can be (`fit`
        divides by the perplexity at p = 0)."""
        for key, v in metrics.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise SchemaError(f"metrics['{key}']", f"is {v!r}, not a finite number")
            if (key == "ppl" and v < 1.0) or (key == "nll" and v < 0.0):
                raise SchemaError(f"metrics['{key}']", f"is {v}, which no {key} can be")
            if key.split(",")[0] in SHARES and not 0.0 <= v <= 1.0:  # lm-eval's "acc,none" is a share too
                raise SchemaError(f"metrics['{key}']", f"is {v}, but an {key.split(',')[0]} lies in [0, 1]")

    @classmethod
    def upgrade(cls, data: dict[str, Any], version: int) -> dict[str, Any]:
        if version < 2:  # version 1 kept the peak and the dtype only in the engine summary
            summary = data.get("summary") or {}
            data.setdefault("peak_device_bytes", summary.get("peak_device_bytes", 0))
            data.setdefault("dtype", summary.get("dtype", "float32"))
        return data
