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
            why = (" (its lines end in a lone carriage return, old Mac style; JSON Lines ends a line at \\n)"
                   if "\r" in line.strip() else
                   " (it starts with a byte-order mark, U+FEFF: files joined?)" if line.startswith("\ufeff") else
                   " (the file is one JSON array, not JSON Lines: give one prompt a line)"
                   if n == 1 and line.strip() == "[" else "")
            raise MoetoolError(f"{where} line {n} is not JSON{why} (expected {{\"prompt\": \"...\"}}).") from None
        value = item.get("prompt", item.get("question")) if isinstance(item, dict) else item
        if isinstance(item, list):
            raise MoetoolError(f"{where} line {n} is a JSON array, not a prompt: JSON Lines gives one prompt a line "
                               "(a string, or {\"prompt\": \"...\"}).")
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
    if codec == "UTF-16" and (at := _not_utf16(raw[len(bom):])) is not None:
        raise MoetoolError(f"{where} starts with a UTF-16 byte-order mark, but its bytes "
                           f"{'after the mark' if at == 0 else f'from byte {len(bom) + 2 * at} on'} are UTF-8 text, which read "
                           f"as UTF-16 would be other characters (a stray mark, or UTF-8 appended to a UTF-16 file){then}")
    if (nul := text.find("\0")) >= 0:  # valid UTF-8, and no text: UTF-16 without its mark reads as "H\0e\0l\0..."
        raise MoetoolError(f"{where} holds a NUL character (character {nul + 1}), which no text holds: a binary "
                           f"file, or UTF-16 saved without its byte-order mark{then}")
    return text


def _not_utf16(body: bytes) -> int | None:
    """The code unit from which `body` (after a UTF-16 byte-order mark) is UTF-8 or ASCII text, or None.
    Every pair of ASCII bytes is a valid UTF-16 unit (mostly CJK), so such bytes decode without an
    error, as other characters. The whole of it: UTF-8 text holding a space or a line end. A part: a run
    of RUN units whose two bytes are both printable ASCII (or tab, CR, LF), a sixth of them holding a
    space or LF byte; UTF-16 text has a zero byte in every ASCII unit, and its CJK or kana units rarely
    show a space byte (none in 590 kB of English, 400k characters of Japanese, emoji and ZWJ text)."""
    import numpy as np

    try:
        utf8 = body.decode("utf-8")
        if "\0" not in utf8 and (" " in utf8 or "\n" in utf8):
            return 0
    except UnicodeDecodeError:
        pass
    units = np.frombuffer(body[:len(body) // 2 * 2], dtype=np.uint8).reshape(-1, 2)
    printable = (((units >= 0x20) & (units <= 0x7E)) | (units == 9) | (units == 10) | (units == 13)).all(1)
    spaced = ((units == 0x20) | (units == 0x0A)).any(1)
    edges = np.flatnonzero(np.diff(np.concatenate([[0], printable.astype(np.int8), [0]])))
    count = np.concatenate([[0], np.cumsum(spaced)])
    for start, end in zip(edges[::2], edges[1::2]):
        if end - start >= _RUN and (count[end] - count[start]) * 6 >= end - start:
            return int(start)
    return None


_RUN = 24  # code units: a run of ASCII read as UTF-16 this long is no UTF-16 text's


def read_text_file(path: Path, option: str, running: str | None = None) -> str:
    """A user's text file (`option` names where it was given), or one sentence: UTF-8, or UTF-16/32
    with a byte-order mark (`decode_text`). `running` (what reads it: "ppl scores") refuses JSON data
    (`is_json`), whose braces and keys would be scored, profiled or calibrated on as if they were text."""
    path = Path(path)
    text = decode_text(read_bytes(path, TEXT_BYTES, option), f"{option} {path}", "; give a text file.")
    if not text.strip():  # an editor's empty save, a failed extraction: nothing to score, profile or calibrate on
        raise MoetoolError(f"{option} {path} holds no text (it is empty or only whitespace); give a text file.")
    if running and is_json(text):
        raise MoetoolError(f"{option} {path} is JSON data (JSON Lines, or one JSON document), and {running} running "
                           "text: give a text file (the documents one after another).")
    return text


def is_json(text: str) -> bool:
    """Whether `text` is JSON data, whatever its file's suffix (`.jsonl`, `.ndjson`, or `.json` as
    `datasets.to_json` writes JSON Lines): its first non-blank line is a JSON object, array or string
    on its own, or the whole text is one JSON document (a pretty-printed array)."""
    body = text.lstrip("\ufeff \t\r\n")
    if body[:1] not in ("{", "[", '"'):
        return False
    for candidate in (body.split("\n", 1)[0], body):
        try:
            json.loads(candidate)
            return True
        except (ValueError, RecursionError):
            pass
    return False


def line_ends(text: str) -> str | None:
    """How `text`'s lines end, where not as on Linux ("\\n"): "crlf" (Windows), "cr" (old Mac) or "mixed".
    A text is read as stored (`decode_text`), so its carriage returns are text the model scores: the same
    text saved on Windows reads ~5% lower perplexity under a byte-level BPE (each "\\r" is an easy
    token), with lone ones ~50% higher; said, so that two evals of one text differ visibly."""
    crlf = text.count("\r\n")
    cr, lf = text.count("\r") - crlf, text.count("\n") - crlf
    kinds = [name for name, n in (("crlf", crlf), ("cr", cr), ("lf", lf)) if n]
    return None if kinds in ([], ["lf"]) else kinds[0] if len(kinds) == 1 else "mixed"


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
