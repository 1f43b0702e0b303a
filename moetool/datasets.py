"""Offline text and multiple-choice data shipped inside the package (extracted by lab/fetch_data.py).

Text: Shakespeare plays (Project Gutenberg, public domain), Python 3.11 documentation pages (PSF
licence), The Debian Administrator's Handbook (GPL-2.0+ or CC-BY-SA-3.0), the Jargon File (public
domain) and WordNet's glosses (WordNet licence), split by whole work into `train_text()` (router
fitting, calibration) and `heldout_text()` (perplexity; never used for fitting), each one domain
after another in that order; `unseen_text()` is a sixth domain, fortune-file quotations (BSD), that
no fit ever reads.
Multiple choice: BIG-bench tasks (Apache-2.0) as MMLU-like records. Sources, versions and licences:
`manifest()`.

    >>> from moetool.datasets import mc_task, heldout_text
    >>> q = mc_task("general_knowledge")[0]
    >>> q.choices[q.answer]
    'four'
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path

from moetool.errors import MoetoolError, not_text
from moetool.files import PROMPTS_BYTES, TEXT_BYTES, read_bytes

# BIG-bench tasks on which SmolLM2-135M-Instruct is above chance (see MANIFEST.json, "tasks").
MC_TASKS: tuple[str, ...] = (
    "general_knowledge",
    "human_organs_senses",
    "logical_sequence",
    "movie_recommendation",
    "phrase_relatedness",
    "emoji_movie",
)


@dataclass(frozen=True)
class MCQuestion:
    """One multiple-choice item: `answer` indexes `choices`."""

    question: str
    choices: tuple[str, ...]
    answer: int


def _data_file(*parts: str):
    return resources.files("moetool").joinpath("data", *parts)


def _read_text(*parts: str) -> str:
    path = _data_file(*parts)
    if not path.is_file():
        raise MoetoolError(f"packaged data file moetool/data/{'/'.join(parts)} is missing; "
                           "reinstall moetool or run `make data`")
    return path.read_text(encoding="utf-8")


@lru_cache(maxsize=None)
def train_text() -> str:
    """Text for fitting routers and calibration (about 4.9 MB); disjoint from `heldout_text()`."""
    return _read_text("text", "train.txt")


@lru_cache(maxsize=None)
def heldout_text() -> str:
    """Text for held-out perplexity (about 590 kB); no work in it appears in `train_text()`."""
    return _read_text("text", "heldout.txt")


@lru_cache(maxsize=None)
def unseen_text() -> str:
    """Quotations from fortune files (about 200 kB): a domain no fit ever sees, unlike the held-out
    text whose domains are fitted. For perplexity on unseen text only; never fit on it."""
    return _read_text("text", "unseen.txt")


@lru_cache(maxsize=None)
def mc_task(name: str) -> tuple[MCQuestion, ...]:
    """All items of one multiple-choice task from `MC_TASKS`, in file order."""
    if name not in MC_TASKS:
        raise MoetoolError(f"unknown multiple-choice task {name!r}; choose one of {', '.join(MC_TASKS)}")
    items = []
    for n, line in enumerate(_read_text("mc", f"{name}.jsonl").splitlines(), 1):
        rec = json.loads(line)
        choices = tuple(rec["choices"])
        if not 0 <= rec["answer"] < len(choices):
            raise MoetoolError(f"moetool/data/mc/{name}.jsonl line {n} has an answer index out of range")
        items.append(MCQuestion(rec["question"], choices, rec["answer"]))
    return tuple(items)


@lru_cache(maxsize=None)
def manifest() -> dict:
    """Where every packaged data file came from: registry, package, version, licence, sha256."""
    return json.loads(_read_text("MANIFEST.json"))


def parse_prompt_lines(text: str, where: object) -> list[str]:
    """Prompts of a JSONL text: one per line, a string or an object with "prompt" (or "question")."""
    prompts = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except (ValueError, RecursionError):  # not JSON, a 5,000-digit number, nested thousands deep
            raise MoetoolError(f"{where} line {n} is not JSON (expected {{\"prompt\": \"...\"}}).") from None
        value = item.get("prompt", item.get("question")) if isinstance(item, dict) else item
        if not isinstance(value, str):
            raise MoetoolError(f"{where} line {n} has no string 'prompt' or 'question'.")
        if (why := not_text(value)) is not None:
            raise MoetoolError(f"{where} line {n} {why}.")
        prompts.append(value)
    return prompts


def read_text_file(path: Path, option: str) -> str:
    """A user's text file (`option` names where it was given), strictly UTF-8, or one sentence: a
    binary file read with replacement characters would be profiled, calibrated or scored as garbage."""
    path = Path(path)
    raw = read_bytes(path, TEXT_BYTES, option)
    try:
        # As stored (no newline translation, so its sha256 is the file's), less a UTF-8 byte-order
        # mark, which editors on Windows add and which is not text to score.
        text = raw.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        raise MoetoolError(f"{option} {path} is not UTF-8 text (byte {e.start} is not); give a text file.") from None
    if not text.strip():  # an editor's empty save, a failed extraction: nothing to score, profile or calibrate on
        raise MoetoolError(f"{option} {path} holds no text (it is empty or only whitespace); give a text file.")
    return text


def read_prompts(path: Path, what: str = "--prompts") -> tuple[str, ...]:
    """The prompts of a JSONL file (`parse_prompt_lines`), or one sentence naming the file."""
    path = Path(path)
    raw = read_bytes(path, PROMPTS_BYTES, what)
    try:
        text = raw.decode("utf-8-sig")  # -sig: a leading byte-order mark is not JSON
    except UnicodeDecodeError:
        raise MoetoolError(f"{path} is not UTF-8 text (expected JSONL lines such as {{\"prompt\": \"...\"}}).") from None
    prompts = parse_prompt_lines(text, path)
    if not prompts:
        raise MoetoolError(f"{path} holds no prompts.")
    return tuple(prompts)


def heldout_prompts(n: int, words: int = 48) -> tuple[str, ...]:
    """`n` prompts of about `words` words from evenly spaced places in the held-out text."""
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
