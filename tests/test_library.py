"""moetool called from Python in one long-lived process (a notebook, a script): what a fresh process
gives, one sentence for a value the CLI would have typed, and the caller's process left as it was."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from moetool.errors import MoetoolError
from moetool.evaluate import EvalConfig, evaluate
from moetool.run import RunConfig

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("fields, said", [
    (dict(prompts="Hello"), "prompts is one string, 'Hello'; give a tuple of them, such as prompts=('Hello',)."),
    (dict(max_new_tokens=2.5), "RunConfig.max_new_tokens must be an integer, not the number 2.5."),
    (dict(max_new_tokens="4"), "RunConfig.max_new_tokens must be an integer, not the string '4'."),
    (dict(batch_size=True), "RunConfig.batch_size must be an integer, not true."),
    (dict(budget=0.25), "RunConfig.budget must be a string, not the number 0.25."),
    (dict(settings={"alpha": [0.3]}), "RunConfig.settings['alpha'] must be a string or an integer or a number or "
                                      "true or false, not a list."),
])
def test_a_config_built_in_python_holds_its_types_or_is_one_sentence(fields, said):
    """The CLI types its options as it parses them; a caller's values were taken as given: "Hello" ran
    five one-letter prompts, 2.5 tokens ran 3, and a budget of 0.25 failed inside the planner."""
    with pytest.raises(MoetoolError) as e:
        RunConfig(**fields).check()
    assert str(e.value) == said
    with pytest.raises(MoetoolError, match=r"EvalConfig.limit must be an integer, not the number 3.5"):
        EvalConfig(task="ppl", limit=3.5).check()
    with pytest.raises(MoetoolError, match=r"EvalConfig.limit must be an integer, not 40.0"):
        EvalConfig(task="ppl", limit=40.0).check()


def test_a_profile_config_built_in_python_holds_its_types():
    from moetool.profile import ProfileConfig, profile

    with pytest.raises(MoetoolError, match=r"^data is one string, 'heldout'; give a tuple of them"):
        profile(ProfileConfig(data="heldout"))
    with pytest.raises(MoetoolError, match=r"^ProfileConfig.seq_len must be an integer, not the number 64.5\.$"):
        profile(ProfileConfig(seq_len=64.5))


def test_a_config_built_in_python_takes_what_the_cli_would_pass():
    """Paths as text, prompts as a list, knobs as numbers: each as the CLI's own values run."""
    RunConfig(bundle="somewhere", prompts=["a", "b"], policy="smoe", settings={"alpha": 0.3}).check()


def _mc_task(directory: Path, name: str, rows: list[tuple[str, list[str], int]]) -> None:
    data = directory / f"{name}.jsonl"
    data.write_text("".join(json.dumps({"q": q, "choices": c, "answer": a}) + "\n" for q, c, a in rows))
    (directory / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
        "output_type: multiple_choice\ndoc_to_text: '{{q}}'\ndoc_to_choice: choices\ndoc_to_target: answer\n"
        "metric_list:\n  - metric: acc\n")


def test_a_task_file_edited_between_two_evals_in_one_process_is_read_again(char_ckpt, tmp_path, monkeypatch):
    """lm-eval's index of which file holds which task was kept for the process: after two task files
    swapped their names, `colours` ran the other file's questions and recorded a file that held
    neither; a task file added later was "unknown". Each eval now finds what a fresh process finds."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    _mc_task(tasks, "colours", [("The sky is", ["blue", "green"], 0), ("Grass is", ["red", "green"], 1),
                                ("Snow is", ["white", "black"], 0)])
    _mc_task(tasks, "shapes", [("Fire is", ["hot", "cold"], 0), ("Ice is", ["hot", "cold"], 1)])

    def ev(task):
        e = evaluate(EvalConfig(task=task, model=str(char_ckpt), include_path=tasks))
        return e.n, sorted(Path(k).name for k in e.inputs if k.endswith((".yaml", ".jsonl")))

    assert ev("colours") == (3, ["colours.jsonl", "colours.yaml"])
    for path, (old, new) in ((tasks / "colours.yaml", ("colours", "shapes")),
                             (tasks / "shapes.yaml", ("shapes", "colours"))):
        path.write_text(path.read_text().replace(f"task: {old}", f"task: {new}"))
    assert ev("colours") == (2, ["shapes.jsonl", "shapes.yaml"])
    _mc_task(tasks, "circles", [("A wheel is", ["round", "square"], 0)])
    assert ev("circles") == (1, ["circles.jsonl", "circles.yaml"])


def test_a_report_drawn_in_the_callers_process_leaves_its_matplotlib_backend(tmp_path):
    """Importing the report switched the caller's backend to Agg (`matplotlib.use`): a notebook's inline
    figures stopped showing. Figures are made without pyplot now, and still saved."""
    code = ("import matplotlib; matplotlib.use('svg')\n"
            "import moetool.report, moetool.figures as f\n"
            "fig, ax = f.plt.subplots(figsize=(2, 2)); ax.plot([0, 1]); f.save(fig, __import__('pathlib').Path(%r))\n"
            "import matplotlib.pyplot as plt\n"
            "print(matplotlib.get_backend(), len(plt.get_fignums()))\n") % str(tmp_path / "x.png")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["svg", "0"]
    assert (tmp_path / "x.png").read_bytes().startswith(b"\x89PNG")
