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

import codecs
import json
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

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


class _Twice(Exception):
    pass


def _one_of_each(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    if len(set(keys)) < len(keys):
        raise _Twice(next(k for k in keys if keys.count(k) > 1))
    return dict(pairs)


def parse_prompt_lines(text: str, where: object) -> list[str]:
    """Prompts of a JSONL text: one per line, a string or an object with "prompt" (or "question")."""
    prompts = []
    for n, line in enumerate(text.split("\n"), 1):  # JSON Lines ends a line at \n only (U+2028 is text)
        if not line.strip():
            continue
        try:
            item = json.loads(line, object_pairs_hook=_one_of_each)
        except _Twice as e:  # json keeps the last: `{"prompt": "a", "prompt": "b"}` ran "b" without a word
            raise MoetoolError(f"{where} line {n} gives the key {e.args[0]!r} twice; give it once.") from None
        except (ValueError, RecursionError):  # not JSON, a 5,000-digit number, nested thousands deep
            raise MoetoolError(f"{where} line {n} is not JSON (expected {{\"prompt\": \"...\"}}).") from None
        value = item.get("prompt", item.get("question")) if isinstance(item, dict) else item
        if not isinstance(value, str):
            raise MoetoolError(f"{where} line {n} has no string 'prompt' or 'question'.")
        if (why := not_text(value)) is not None:
            raise MoetoolError(f"{where} line {n} {why}.")
        prompts.append(value)
    return prompts


# Byte-order marks, longest first (UTF-32 LE's begins with UTF-16 LE's), and the codec each says.
_BOMS = ((codecs.BOM_UTF32_LE, "UTF-32", "utf-32-le"), (codecs.BOM_UTF32_BE, "UTF-32", "utf-32-be"),
         (codecs.BOM_UTF16_LE, "UTF-16", "utf-16-le"), (codecs.BOM_UTF16_BE, "UTF-16", "utf-16-be"),
         (codecs.BOM_UTF8, "UTF-8", "utf-8"))


def decode_text(raw: bytes, where: str, then: str, wide: bool = True) -> str:
    """`raw`, a user's file (`where` names it), as text, or one sentence ending with `then`.
    UTF-8, less a byte-order mark (editors on Windows add one, and it is not text); UTF-16 or UTF-32
    where a byte-order mark says so (what Windows Notepad saves as "Unicode"), when `wide` (else
    one sentence: a file another program reads again, an lm-eval task's, must be UTF-8 for it). No
    other encoding is guessed, and a NUL character is refused: a binary file read as text would be
    scored as garbage."""
    bom, codec, python = next(((b, n, c) for b, n, c in _BOMS if raw.startswith(b)), (b"", "UTF-8", "utf-8"))
    if codec != "UTF-8" and not wide:
        raise MoetoolError(f"{where} is {codec} text (it starts with a {codec} byte-order mark); save it as "
                           f"UTF-8{then}")
    try:
        # As stored: no newline translation, so the sha256 an artifact records is the file's.
        text = raw[len(bom):].decode(python)  # the mark off first, so that an offset is the file's own
    except UnicodeDecodeError as e:
        mark = "" if codec == "UTF-8" else f", though it starts with a {codec} byte-order mark"
        raise MoetoolError(f"{where} is not {codec} text (byte {len(bom) + e.start} is not{mark}){then}") from None
    if (nul := text.find("\0")) >= 0:  # valid UTF-8, and no text: UTF-16 without its mark reads as "H\0e\0l\0..."
        raise MoetoolError(f"{where} holds a NUL character (character {nul + 1}), which no text holds: a binary "
                           f"file, or UTF-16 saved without its byte-order mark{then}")
    return text


def read_text_file(path: Path, option: str) -> str:
    """A user's text file (`option` names where it was given), or one sentence: UTF-8, or UTF-16/32
    with a byte-order mark (`decode_text`)."""
    path = Path(path)
    text = decode_text(read_bytes(path, TEXT_BYTES, option), f"{option} {path}", "; give a text file.")
    if not text.strip():  # an editor's empty save, a failed extraction: nothing to score, profile or calibrate on
        raise MoetoolError(f"{option} {path} holds no text (it is empty or only whitespace); give a text file.")
    return text


def read_prompts(path: Path, what: str = "--prompts") -> tuple[str, ...]:
    """The prompts of a JSONL file (`parse_prompt_lines`), or one sentence naming the file."""
    path = Path(path)
    text = decode_text(read_bytes(path, PROMPTS_BYTES, what), str(path),
                       " (expected JSONL lines such as {\"prompt\": \"...\"}).")
    prompts = parse_prompt_lines(text, path)
    if not prompts:
        raise MoetoolError(f"{path} holds no prompts.")
    return tuple(prompts)


def heldout_prompts(n: int, words: int = 48) -> tuple[str, ...]:
    """`n` prompts of about `words` words from evenly spaced places in the held-out text."""
    lines = [ln.strip() for ln in heldout_text().splitlines() if len(ln.split()) >= 6]
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n < len(lines):
        raise MoetoolError(f"the held-out text gives 1 to {len(lines) - 1} prompts, not {n!r}.")
    step = max(1, len(lines) // (n + 1))
    prompts = []
    for i in range(n):
        chunk, j = [], (i + 1) * step
        while len(" ".join(chunk).split()) < words and j < len(lines):
            chunk.append(lines[j])
            j += 1
        prompts.append(" ".join(chunk))
    return tuple(prompts)
