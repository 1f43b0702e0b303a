"""The checkpoint's tokenizer, loaded only whole (or None where a checkpoint ships none), and text to
token ids: the byte fallback for tokenizer-less checkpoints, and every id checked against the model's vocabulary."""

from __future__ import annotations

import json
import unicodedata
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from moetool.errors import first_line as _first_line
from moetool.errors import MoetoolError, not_text, quote
from moetool.files import TOKENIZER_BYTES, check_file

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_TOKENIZER_EXTRAS = ("merges.txt", "vocab.txt", "special_tokens_map.json", "added_tokens.json", "tokenizer.tiktoken")
_TOKENIZER_PROBE = "Hello world"  # every tokenizer with a vocabulary gives it at least one token
CHUNK = 1 << 16  # characters one tokenizer call takes from a long text (see `encode`)
_WINDOW = 512  # characters each side of a cut that its check tokenizes: longer than any pre-token in practice
_TRIES = 4  # cuts of each kind tried before a chunk, and so the whole text, is tokenized in one call


def encode(tokenizer: Any, text: str, vocab_size: int, special_tokens: bool = True, what: str | None = None,
           unknown_ok: bool = False) -> torch.Tensor:
    """Token ids [T] of `text`, exactly those of one tokenizer call on all of it. Tokenizer-less
    checkpoints (the tests' tiny models) get the text's UTF-8 bytes folded into their vocabulary:
    the one place that fallback is written.

    A text longer than CHUNK characters (`eval ppl --data`, `profile --data`: up to 256 MiB) is
    tokenized a piece at a time, since a tokenizer call holds ~500-600 B of host memory a token while
    it runs (the Rust encoding's token strings and offsets, then Python lists): tens of GB for 256 MiB
    in one call, ~30 MiB for one piece of 64 Ki characters (at one token a character; a quarter of
    that for English), for ~2% more tokenizer time in the cuts' checks. A piece ends just after a newline
    followed by a non-space (else just before a single space, which the next piece drops where the
    tokenizer prepends "▁" to every text, as Llama-2's and Mixtral's do; else just before a
    punctuation mark after a letter, for text without either) near CHUNK characters on, and only
    where the tokenizer is seen to be local there: the _WINDOW characters each side of the cut
    tokenize to the ids of the two sides apart. Where no cut of a chunk passes (a text of letters
    alone, a tokenizer that is local at none), the whole text is tokenized in one call, as a short
    text is. Special tokens the tokenizer adds
    (BOS, EOS) frame the pieces' ids as they frame a text's own, checked on the text's head and tail
    against the tokenizer; where they do not, one call too. A text read as nothing but the unknown token
    is refused (`refuse_unknown`, naming `what`, else the text), unless `unknown_ok` (a prefix the caller
    reads on past)."""
    if (why := not_text(text)) is not None:  # what no tokenizer encodes: one sentence, not a traceback
        raise MoetoolError(f"the text {quote(text, 40)} {why}.")
    if tokenizer is None:
        return torch.tensor([b % vocab_size for b in text.encode()], dtype=torch.long)
    spans = _spans(tokenizer, text) if len(text) > CHUNK else None
    frame = (_frame(tokenizer, text) if special_tokens else ([], [])) if spans else None
    if spans is None or frame is None:
        ids = torch.tensor(tokenizer(text, add_special_tokens=special_tokens).input_ids, dtype=torch.long)
    else:
        head, tail = frame
        # One tensor a piece, concatenated once: a long text's ids are never all in one Python list.
        ids = torch.cat([torch.tensor(head, dtype=torch.long),
                         *(torch.tensor(_plain(tokenizer, text[a:b]), dtype=torch.long) for a, b in spans),
                         torch.tensor(tail, dtype=torch.long)])
    if not unknown_ok:
        refuse_unknown(ids, tokenizer, what or f"the text {quote(text, 40)}", text)
        refuse_dropped(tokenizer, text, ids.tolist() if ids.numel() < 64 else None, what or f"the text {quote(text, 40)}")
    return check_ids(ids, tokenizer, vocab_size)


def head(tokenizer: Any, text: str, tokens: int) -> str:
    """The start of `text` that holds its first `tokens` tokens as `encode` reads them (`eval ppl
    --limit`: a 256 MiB file's first 512 tokens without tokenizing all of it). No token spells more
    characters than the vocabulary's longest string, so the cut goes past that many characters a token
    (and as many again for what a normalizer drops), at a cut the tokenizer is local at (`_local`, as
    `encode`'s pieces are): the head's ids are the text's first ones. All of `text` where it is not
    much longer, or no cut passes; the caller checks the head gave `tokens` tokens and reads all of it
    where not."""
    if tokenizer is None:  # one token a byte, at least one a character
        return text[:tokens]
    most = max(map(len, tokenizer.get_vocab()), default=1)
    want = 2 * (tokens + 1) * most
    if len(text) <= want + CHUNK:
        return text
    return next((text[:cut] for cut, kind in _cuts(text, want, want + CHUNK, list(_KINDS)) if kind[2] == 0
                 and _local(tokenizer, text, cut)), text)


def refuse_dropped(tokenizer: Any, text: str, ids: list[int] | None, what: str) -> int:
    """How many characters of `text` (not whitespace) its tokenizer drops (`dropped_characters`); one
    sentence naming `what` where it keeps none of them, or where `ids` (the text's, with special tokens;
    None for a long text) are only the special tokens it frames every text with (a normalizer that
    strips the text)."""
    dropped = dropped_characters(tokenizer, text)
    kept_none = ids is not None and not own_tokens(ids, framing(tokenizer))
    if text.strip() and (kept_none or (dropped and dropped == sum(not c.isspace() for c in text))):
        raise MoetoolError(f"{what} gives no token of its own under this model's tokenizer (at most whitespace and "
                           "the special tokens it frames every text with): the tokenizer drops its characters; give "
                           "text the tokenizer keeps.")
    return dropped


def _plain(tokenizer: Any, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def _spans(tokenizer: Any, text: str) -> list[tuple[int, int]] | None:
    """(start, end) of the pieces `encode` tokenizes `text` in, each at most CHUNK characters, or None
    where a chunk has no cut the tokenizer passes. A piece starts at its cut, or one character after
    it where the cut's space is dropped (_KINDS). All cuts are found before any piece is tokenized,
    so a tokenizer that is not local costs a few short calls, not a text's worth of wasted pieces.
    The kind of cut that passed last is tried first: one tokenizer takes the same kind throughout."""
    spans, start, kinds = [], 0, list(_KINDS)
    while len(text) - start > CHUNK:
        found = next(((cut, kind) for cut, kind in _cuts(text, start + CHUNK // 2, start + CHUNK, kinds)
                      if _local(tokenizer, text, cut, kind[2])), None)
        if found is None:
            return None
        (cut, kind), drop = found, found[1][2]
        kinds.remove(kind)
        kinds.insert(0, kind)
        spans.append((start, cut))
        start = cut + drop
    return [*spans, (start, len(text))]


# Kinds of cut, as (mark, the cut's offset past the mark, characters the next piece drops):
# - just after a newline followed by a non-space (where regex pre-tokenizers start a pre-token: a
#   newline before spaces joins them in GPT-2's);
# - just before a single space between non-spaces (" word" is one pre-token in byte-level BPE and
#   in SentencePiece's Metaspace, which then adds no "▁" of its own);
# - the same space, dropped from the next piece: for a tokenizer that prepends "▁" to every text
#   (Llama-2's and Mixtral's tokenizer.json: a Prepend normalizer), "word" comes out as the
#   "▁word" that " word" is in the middle of a text, where " word" would be "▁▁word";
# - just before a punctuation mark that follows a letter (mark ""): for text without spaces or
#   line ends (Chinese or Japanese on one line), where a letter run ends ("。日本" is one pre-token
#   of GPT-4-style regexes, "語" | "。" is a boundary).
_KINDS = (("\n", 1, 0), (" ", 0, 0), (" ", 0, 1), ("", 0, 0))


def _cuts(text: str, lo: int, hi: int, kinds: list[tuple[str, int, int]]) -> Iterator[tuple[int, tuple[str, int, int]]]:
    """Up to _TRIES cuts in (lo, hi] of each kind (_KINDS), in the order `kinds` gives, nearest `hi` first."""
    for kind in kinds:
        mark, after, _ = kind
        tries, end = 0, hi
        if not mark:  # punctuation after a letter, found a character at a time (only where no other kind passed)
            for i in range(hi - 1, lo, -1):
                if unicodedata.category(text[i])[0] == "P" and text[i - 1].isalpha():
                    yield i, kind
                    if (tries := tries + 1) == _TRIES:
                        break
            continue
        while tries < _TRIES and (i := text.rfind(mark, lo, end)) >= 0:
            end = i
            if not text[i + 1].isspace() and (after or not text[i - 1].isspace()):
                tries += 1
                yield i + after, kind


def _local(tokenizer: Any, text: str, cut: int, drop: int = 0) -> bool:
    """Whether the tokenizer tokenizes across `cut` as it does up to it and from it (less `drop`
    characters): the _WINDOW characters each side give the ids of the two sides apart (without
    special tokens)."""
    a, b = max(0, cut - _WINDOW), cut + _WINDOW
    return _plain(tokenizer, text[a:b]) == _plain(tokenizer, text[a:cut]) + _plain(tokenizer, text[cut + drop:b])


def _frame(tokenizer: Any, text: str) -> tuple[list[int], list[int]] | None:
    """(head, tail): the ids the tokenizer adds before and after a text's own with special tokens
    (BOS; EOS), read off _TOKENIZER_PROBE, or None where `text`'s first and last _WINDOW characters
    are not so framed (a tokenizer that adds its tokens elsewhere, or changes the text's own)."""
    plain, framed = _plain(tokenizer, _TOKENIZER_PROBE), tokenizer(_TOKENIZER_PROBE, add_special_tokens=True).input_ids
    ends = (text[:_WINDOW], text[-_WINDOW:])
    for i in range(len(framed) - len(plain) + 1):
        head, tail = framed[:i], framed[i + len(plain):]
        if framed[i:i + len(plain)] == plain and all(
                tokenizer(s, add_special_tokens=True).input_ids == head + _plain(tokenizer, s) + tail for s in ends):
            return head, tail
    return None


def framing(tokenizer: Any) -> tuple[list[int], list[int]]:
    """(head, tail): the ids a tokenizer adds before and after every text with special tokens (BOS;
    EOS), read off _TOKENIZER_PROBE; ([], []) for none. OLMo's and OLMoE's tokenizer.json append EOS
    to every text (a TemplateProcessing post-processor `$A </s>`)."""
    if tokenizer is None:
        return [], []
    plain, framed = _plain(tokenizer, _TOKENIZER_PROBE), tokenizer(_TOKENIZER_PROBE, add_special_tokens=True).input_ids
    for i in range(len(framed) - len(plain) + 1):
        if framed[i:i + len(plain)] == plain:
            return framed[:i], framed[i + len(plain):]
    return [], []


def own_tokens(ids: list[int], frame: tuple[list[int], list[int]]) -> int:
    """How many of one text's `ids` (with special tokens) the text itself gave: less the `frame`."""
    head, tail = frame
    n = len(ids) - (len(head) if head and ids[:len(head)] == head else 0)
    return n - (len(tail) if tail and n >= len(tail) and ids[len(ids) - len(tail):] == tail else 0)


def without_tail(ids: list[int], frame: tuple[list[int], list[int]]) -> list[int]:
    """One text's `ids` without the tail its tokenizer ends every text with (`framing`): a text the model
    is to continue (a prompt, an lm-eval context or choice) does not end with EOS, as the model was
    trained to read text; kept, the model continues past an end of document and lm-eval scores every
    choice after an EOS where its space was."""
    tail = frame[1]
    return ids[:len(ids) - len(tail)] if tail and ids[len(ids) - len(tail):] == tail else ids


def dropped_characters(tokenizer: Any, text: str) -> int:
    """Characters of `text`, not whitespace, that no token of a fast tokenizer covers: a BPE with
    neither an unknown token nor byte fallback drops what its vocabulary lacks, so the model would
    read the text without them and nothing would say so. 0 where the tokenizer is not a fast one (no
    offsets to read), none, or one that cannot drop a character (`_may_drop`). Read CHUNK characters
    at a time (as `encode` reads a long text)."""
    if not _may_drop(tokenizer):
        return 0
    dropped = 0
    for start in range(0, len(text), CHUNK):
        piece = text[start:start + CHUNK]
        covered = bytearray(len(piece))
        for a, b in tokenizer(piece, add_special_tokens=False, return_offsets_mapping=True).offset_mapping:
            covered[a:b] = b"\x01" * (b - a)
        dropped += sum(1 for c, seen in zip(piece, covered) if not seen and not c.isspace())
    return dropped


def _may_drop(tokenizer: Any) -> bool:
    """Whether a fast tokenizer's model can leave a character out: a BPE (or WordPiece, Unigram) with no
    unknown token and no byte fallback, over a pre-tokenizer that is not byte-level (which spells every
    byte). The others write `<unk>` (counted by `unknown_tokens`) or spell bytes, so a pass over the
    offsets is spent only where it can find something."""
    backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    if backend is None:
        return False
    model = backend.model
    unknown = getattr(model, "unk_token", getattr(model, "unk_id", "absent"))
    return (unknown is None and not getattr(model, "byte_fallback", False)
            and "ByteLevel" not in repr(backend.pre_tokenizer))


def unknown_tokens(ids: torch.Tensor, tokenizer: Any, text: str | None = None) -> tuple[int, int]:
    """(tokens of `ids` that are the tokenizer's unknown token, tokens that are not special): a text in a
    script the vocabulary lacks (CJK under a Latin character vocabulary) is read as a run of `<unk>`,
    one placeholder, and would be scored or run as that. (0, n) for a tokenizer without one (byte-level
    BPE, which has no character it cannot spell). The unknown token's own string written in `text`
    (SmolLM2's is `<|endoftext|>`) is the text's, not a placeholder for it, and is not counted."""
    unk = getattr(tokenizer, "unk_token_id", None) if tokenizer is not None else None
    if unk is None:
        return 0, ids.numel()
    special = [i for i in getattr(tokenizer, "all_special_ids", []) if i != unk]
    content = ~torch.isin(ids, torch.tensor(special, dtype=ids.dtype)) if special else torch.ones_like(ids, dtype=torch.bool)
    written = text.count(tokenizer.unk_token) if text and tokenizer.unk_token else 0
    return max(0, int((ids == unk).sum()) - written), int(content.sum())


def refuse_unknown(ids: torch.Tensor, tokenizer: Any, what: str, text: str | None = None) -> None:
    """One sentence when every token of `what` (a text, a prompt) is the unknown token."""
    unknown, content = unknown_tokens(ids, tokenizer, text)
    if content and unknown == content:
        raise MoetoolError(f"{what} is read by this model's tokenizer as {unknown} unknown token"
                           f"{'' if unknown == 1 else 's'} ({quote(tokenizer.unk_token, 10)}): its characters are not in "
                           "the vocabulary, so the model would see a placeholder, not the text; give text in a script "
                           "the tokenizer spells.")


def check_ids(ids: torch.Tensor, tokenizer: Any, vocab_size: int) -> torch.Tensor:
    """`ids` (any shape), once each is a token the model embeds; else one sentence. A tokenizer that
    gives an id past the model's vocabulary is another model's (its files copied beside these
    weights): the forward would fail inside the embedding lookup. Checked on the ids a text actually
    gives, since a tokenizer may list ids it never produces."""
    if ids.numel() and int(ids.max()) >= vocab_size:
        bad = int(ids[ids >= vocab_size].reshape(-1)[0])
        piece = tokenizer.convert_ids_to_tokens(bad) if tokenizer is not None else None
        raise MoetoolError(f"the model's tokenizer gives the token id {bad}{f' ({quote(piece, 30)})' if piece else ''}, "
                           f"but the model embeds only {vocab_size} (vocab_size in its config.json): the tokenizer "
                           "files are another model's; copy this model's own.")
    return ids


def load_tokenizer(source: str) -> Any:
    """The checkpoint's tokenizer, or None for a checkpoint that ships no tokenizer file (the tests'
    tiny models). A tokenizer the directory names must load and tokenize: a missing or damaged
    tokenizer.json must not quietly become another tokenizer (other ids, empty text)."""
    from transformers import AutoTokenizer

    local = Path(source)
    if not local.is_dir():  # a hub id: what its snapshot has, as transformers resolves it
        try:
            return AutoTokenizer.from_pretrained(source, trust_remote_code=False)
        except (OSError, ValueError, TypeError):
            return None
    # transformers 5 builds an *empty* tokenizer for some model types when a directory has no
    # tokenizer files, so a local directory must actually ship one.
    named = [f for f in _TOKENIZER_FILES if (local / f).exists()]
    if not named:
        return None
    for f in local.iterdir():  # transformers reads each of these whole: regular files of bounded size
        if f.name in _TOKENIZER_FILES or f.name in _TOKENIZER_EXTRAS:
            check_file(f, TOKENIZER_BYTES, "tokenizer file")
    _refuse_custom_code(local)
    try:
        # Code shipped with a checkpoint is never run, and never asked about on the terminal.
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=False)
        ids = tokenizer(_TOKENIZER_PROBE, add_special_tokens=False).input_ids
        vocabulary = len(tokenizer.get_vocab()) - len(set(tokenizer.all_special_ids))
    except Exception as e:  # noqa: BLE001 - the files are user input: tokenizers raises bare Exceptions
        reason = _first_line(e)[:200].rstrip(":. ")
        raise MoetoolError(f"the tokenizer in {local} ({', '.join(named)}) does not load: {reason}; copy or download "
                           "its tokenizer files again.") from None
    if not ids or vocabulary < 1:
        raise MoetoolError(f"the tokenizer in {local} ({', '.join(named)}) holds no vocabulary (\"{_TOKENIZER_PROBE}\" "
                           "gives no tokens): its vocabulary file is missing; copy or download its tokenizer files "
                           "again.")
    return tokenizer


def _custom_classes(auto_map: Any) -> list[str]:
    """The tokenizer classes an auto_map's AutoTokenizer entry names ("tokenization_kimi.TikTokenTokenizer",
    or "org/repo--module.Class"), as a [slow, fast] pair or the legacy list."""
    refs = auto_map.get("AutoTokenizer") if isinstance(auto_map, dict) else auto_map
    refs = [refs] if isinstance(refs, str) else refs if isinstance(refs, list | tuple) else []
    return [r.split("--")[-1].rsplit(".", 1)[-1] for r in refs if isinstance(r, str) and r]


def _refuse_custom_code(local: Path) -> None:
    """Refuse a tokenizer whose class is defined by code shipped with the checkpoint (tokenizer_config.json's
    auto_map names a class transformers does not ship: Kimi-K2's TikTokenTokenizer, Qwen-1's QWenTokenizer).
    moetool does not run that code, and does not fall back to a tokenizer transformers builds from the
    directory's tokenizer.json (as transformers itself does): such a class exists to tokenize otherwise
    (tiktoken, added prefix tokens, its own normalization), and ids that differ but lie inside the
    vocabulary pass every check, so the model would read other text than it was given without a word.
    An auto_map that names a class transformers ships loads that class, as transformers does."""
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    path = local / "tokenizer_config.json"
    try:
        config = json.loads(path.read_bytes()) if path.is_file() else {}
    except (OSError, ValueError, RecursionError):  # unreadable or not JSON: transformers' load names it
        return
    custom = [c for c in _custom_classes(config.get("auto_map") if isinstance(config, dict) else None)
              if tokenizer_class_from_name(c) is None]
    if custom:
        raise MoetoolError(f"the tokenizer in {local} is the class {quote(custom[0], 40)}, defined by code shipped "
                           "with the checkpoint (tokenizer_config.json's auto_map), which moetool does not run; moetool "
                           "reads the tokenizers transformers ships (if the checkpoint's tokenizer.json tokenizes as "
                           "that class does, drop the auto_map and set tokenizer_class to \"TokenizersBackend\").")
