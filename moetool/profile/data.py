"""Token sequences to profile on: the packaged offline text and multiple-choice sets, or local files.

A name is `train` or `heldout` (packaged text, `moetool.datasets`), a BIG-bench task name from
`moetool.datasets.MC_TASKS` (each question is one prompt), or a path: a `.jsonl` file of prompts
({"prompt": ...}, {"question": ...} or plain strings) or a UTF-8 text file cut into sequences.

    seqs, sha = load_sequences(lm, "heldout", n=4, seq_len=128)   # 4 tensors [1, 128], sha256 of the text
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from moetool import datasets
from moetool.artifacts import sha256_file
from moetool.errors import MoetoolError, quote
from moetool.inference import vocab_size
from moetool.model import LoadedModel
from moetool.tokenizer import dropped_characters, encode, unknown_tokens

TEXTS = {"train": datasets.train_text, "heldout": datasets.heldout_text}


def known_names() -> tuple[str, ...]:
    return (*TEXTS, *datasets.MC_TASKS)


def _ids(lm: LoadedModel, text: str, what: str | None = None) -> torch.Tensor:
    return encode(lm.tokenizer, text, vocab_size(lm.model), what=what)  # [T]


def spread_chunks(ids: torch.Tensor, n: int, seq_len: int) -> list[torch.Tensor]:
    """`n` windows of `seq_len` tokens spread evenly over `ids` (so a mixed text contributes all its parts),
    as many as the text holds without overlap: overlapping windows counted the same tokens' routing again
    (a 145-token text gave 4 windows of 128). The Profile's `data` records how many were taken."""
    if len(ids) < 2:
        return []
    seq_len = min(seq_len, len(ids))
    n = min(n, len(ids) // seq_len)
    last = len(ids) - seq_len
    starts = sorted({round(i * last / max(1, n - 1)) for i in range(n)}) if n > 1 else [0]
    return [ids[s:s + seq_len][None] for s in starts]


def _unread(lm: LoadedModel, texts: list[str], seqs: list[torch.Tensor], source: object) -> list[str]:
    """What the profile says of data the model does not read whole (`Profile.notes`): characters the
    vocabulary lacks, read as its unknown token, and characters the tokenizer drops. The routing,
    sensitivity and look-ahead measured there are the placeholder's, or the text's without them."""
    if lm.tokenizer is None:
        return []
    said = []
    unknown = sum(unknown_tokens(ids.reshape(-1), lm.tokenizer, t)[0] for ids, t in zip(seqs, texts))
    if unknown:
        said.append(f"{source} has {unknown} unknown token(s) ({quote(lm.tokenizer.unk_token, 10)}) in place of "
                    "characters the vocabulary lacks: the profile measured the placeholder there.")
    if dropped := sum(dropped_characters(lm.tokenizer, t) for t in texts):
        said.append(f"{source} has {dropped} character(s) the tokenizer drops (no token covers them): the profile "
                    "measured the text without them.")
    return said


def _prompts(lm: LoadedModel, prompts: list[str], n: int, source: object = "--data",
             notes: list[str] | None = None) -> list[torch.Tensor]:
    seqs = []
    for i, p in enumerate(prompts[:n], 1):
        if not p.strip():  # skipped, it left fewer sequences than --seqs without a word (`run` refuses it)
            raise MoetoolError(f"prompt {i} of {source} is empty; give it some text or remove it.")
        ids = _ids(lm, p, f"prompt {i} of {source} ({quote(p, 40)})")
        if not len(ids):  # text the tokenizer maps to no token (its normalizer drops it): nothing to run
            raise MoetoolError(f"prompt {i} of {source} ({quote(p, 40)}) has no tokens under this model's tokenizer; "
                               "remove it or give text the tokenizer keeps.")
        seqs.append(ids[None])
    if notes is not None:
        notes += _unread(lm, prompts[:n], seqs, source)
    return seqs


def _text(lm: LoadedModel, text: str, n: int, seq_len: int, source: object,
          notes: list[str] | None) -> list[torch.Tensor]:
    ids = _ids(lm, text)
    if notes is not None:
        notes += _unread(lm, [text], [ids], source)
    return spread_chunks(ids, n, seq_len)


def load_sequences(lm: LoadedModel, name: str, n: int, seq_len: int, option: str = "--data",
                   notes: list[str] | None = None) -> tuple[list[torch.Tensor], str]:
    """(`n` sequences [1, T] of `name`, sha256 of the data they come from); `option` names where it was given.
    What the model does not read of the data is appended to `notes` (`_unread`)."""
    if name in TEXTS:
        text = TEXTS[name]()
        return _text(lm, text, n, seq_len, name, notes), hashlib.sha256(text.encode()).hexdigest()
    if name in datasets.MC_TASKS:
        items = datasets.mc_task(name)
        prompts = [f"Question: {q.question}\nAnswer:" for q in items]
        return _prompts(lm, prompts, n, name, notes), hashlib.sha256("\n".join(prompts).encode()).hexdigest()
    path = Path(name)
    if not path.is_file():
        raise MoetoolError(f"{option} {name} is neither a file nor a known data set ({', '.join(known_names())}).")
    text = datasets.read_text_file(path, option)
    sha = sha256_file(path)  # the file's, as every artifact records its inputs (a BOM or UTF-16 is not the text's)
    prompts_file = path.suffix.lower() == ".jsonl" or datasets.is_json(text)  # .ndjson, .json: JSON, not text
    if prompts_file:
        prompts = datasets.parse_prompt_lines(text, path)
        seqs = _prompts(lm, prompts, n, path, notes)
    else:
        seqs = _text(lm, text, n, seq_len, path, notes)
    if not seqs:
        what = "no prompt" if prompts_file else "fewer than 2 tokens"
        raise MoetoolError(f"{path} holds {what}: nothing to profile on.")
    return seqs, sha
