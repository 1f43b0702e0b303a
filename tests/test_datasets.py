"""The packaged offline data: train/held-out text are disjoint, unseen text is a domain of its own,
MC tasks load with valid answers."""

import hashlib
from importlib import resources

import pytest

from moetool import datasets
from moetool.errors import MoetoolError


def _lines(text: str, min_len: int = 40) -> set[str]:
    # Short lines ("Exeunt.", speaker names, ">>> a") legitimately repeat across works.
    return {ln.strip() for ln in text.splitlines() if len(ln.strip()) >= min_len}


# One string per fitting domain, found in no other domain: Shakespeare's stage direction, the Python
# docs' interpreter prompt, the Debian handbook's example company, a Jargon File entry's
# pronunciation-then-noun, a WordNet gloss's opening.
DOMAIN_MARKERS = {"shakespeare": "Exeunt", "python docs": ">>> ", "debian handbook": "Falcot",
                  "jargon file": "/, n.", "wordnet": "any of various"}


def test_train_heldout_and_unseen_text_are_nonempty_and_disjoint():
    train, heldout, unseen = datasets.train_text(), datasets.heldout_text(), datasets.unseen_text()
    assert len(train) > 2_000_000 and len(heldout) > 200_000 and len(unseen) > 100_000
    shared = _lines(train) & _lines(heldout)
    assert not shared, sorted(shared)[:5]
    for domain, marker in DOMAIN_MARKERS.items():
        assert marker in train and marker in heldout, f"{domain} missing from train or heldout"
        assert marker not in unseen, f"unseen text holds {domain} text"
    shared = _lines(unseen, 60) & (_lines(train, 60) | _lines(heldout, 60))
    assert not shared, sorted(shared)[:5]


def test_manifest_splits_by_whole_work_and_hashes_match():
    man = datasets.manifest()
    for src in man["sources"]:
        ex = src["extracted"]
        if "train" in ex:
            assert not set(ex["train"]) & set(ex["heldout"])
        assert src["licence"]
    root = resources.files("moetool").joinpath("data")
    for out in man["outputs"]:
        data = root.joinpath(out["path"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == out["sha256"], out["path"]


@pytest.mark.parametrize("name", datasets.MC_TASKS)
def test_mc_task_loads_with_valid_answers(name):
    items = datasets.mc_task(name)
    assert len(items) >= 30
    for q in items:
        assert q.question and len(q.choices) >= 2
        assert len(set(q.choices)) == len(q.choices)
        assert 0 <= q.answer < len(q.choices)


def test_unknown_mc_task_is_a_user_error():
    with pytest.raises(MoetoolError, match="unknown multiple-choice task"):
        datasets.mc_task("mmlu_everything")


def test_prompt_lines_take_strings_prompts_and_questions_and_name_the_bad_line():
    parse_prompt_lines = datasets.parse_prompt_lines
    text = '"plain"\n\n{"prompt": "p"}\n{"question": "q"}\n'
    assert parse_prompt_lines(text, "f.jsonl") == ["plain", "p", "q"]
    with pytest.raises(MoetoolError, match="f.jsonl line 2 is not JSON"):
        parse_prompt_lines('"ok"\n{oops\n', "f.jsonl")
    with pytest.raises(MoetoolError, match="f.jsonl line 1 has no string 'prompt' or 'question'"):
        parse_prompt_lines('{"text": "x"}\n', "f.jsonl")


def test_a_prompt_holding_a_unicode_line_separator_is_one_line_of_json_lines():
    """JSON Lines ends a line at \n alone; `json.dumps(..., ensure_ascii=False)` writes U+2028, U+2029 and
    U+0085 unescaped (text pasted from a PDF holds them), and splitting at them read a valid file as "not
    JSON". A CRLF file still reads."""
    text = '{"prompt": "one\u2028two\u2029three\u0085four"}\r\n{"prompt": "five"}\r\n'
    assert datasets.parse_prompt_lines(text, "f.jsonl") == ["one\u2028two\u2029three\u0085four", "five"]
