"""A long text is tokenized in pieces (bounded host memory) to exactly the ids of one call on all of it."""

import tracemalloc

import pytest
import torch

from moetool import tokenizer as tk
from moetool.datasets import heldout_text
from moetool.tokenizer import encode

TEXT = heldout_text()[:40_000]  # prose and indented code: both kinds of cut, and lines a cut must not take
CHUNK = 4096  # ~10 pieces of TEXT


class Recording:
    """A tokenizer that records the longest text it was called on."""

    def __init__(self, tok):
        self.tok, self.longest = tok, 0

    def __call__(self, text, **kw):
        self.longest = max(self.longest, len(text))
        return self.tok(text, **kw)

    def __getattr__(self, name):
        return getattr(self.tok, name)


def _wrap(tok):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def _bpe(pre_tokenizer=None, normalizer=None, post_processor=None, byte_level=False):
    """A small BPE trained on TEXT's head, offline, with the given pipeline."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None if byte_level else "<unk>"))
    tok.normalizer, tok.pre_tokenizer = normalizer, pre_tokenizer
    alphabet = pre_tokenizers.ByteLevel.alphabet() if byte_level else []
    tok.train_from_iterator(TEXT[:20_000].splitlines(), trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=alphabet, show_progress=False))
    if post_processor is not None:
        tok.post_processor = post_processor(tok)
    return _wrap(tok)


def _byte_level(**kw):
    from tokenizers import pre_tokenizers

    return _bpe(pre_tokenizers.ByteLevel(add_prefix_space=False), byte_level=True, **kw)


def _template(single):
    from tokenizers import processors

    return lambda tok: processors.TemplateProcessing(
        single=single, special_tokens=[(t, tok.token_to_id(t)) for t in ("<s>", "</s>")])


def _encode(tok, text, special_tokens):
    """encode's ids of `text`, one call's ids, and the longest text the tokenizer was called on."""
    rec = Recording(tok)
    got = encode(rec, text, 10**6, special_tokens)
    assert got.dtype == torch.long
    return got.tolist(), tok(text, add_special_tokens=special_tokens).input_ids, rec.longest


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(tk, "CHUNK", CHUNK)


@pytest.fixture(scope="module")
def byte_level():
    return _byte_level()


@pytest.mark.parametrize("special_tokens", [False, True])
def test_the_demo_tokenizer_tokenizes_the_heldout_text_in_pieces_to_the_ids_of_one_call(special_tokens):
    from moetool.demo import MARKER, build_demo_model, cache_root
    from moetool.tokenizer import load_tokenizer

    if not (cache_root() / "demo-moe" / MARKER).is_file():
        pytest.skip("the demo model is not built (`moetool` builds it on first use)")
    tok = load_tokenizer(str(build_demo_model().path))
    text = heldout_text()
    got, want, longest = _encode(tok, text, special_tokens)
    assert got == want
    assert longest <= CHUNK  # ~140 pieces, none longer than a chunk


@pytest.mark.parametrize("special_tokens", [False, True])
def test_byte_level_bpe_takes_its_cuts(byte_level, special_tokens):
    got, want, longest = _encode(byte_level, TEXT, special_tokens)
    assert got == want and longest <= CHUNK


def _llama2():
    from tokenizers import normalizers, pre_tokenizers

    # Llama-2's and Mixtral's tokenizer.json: no pre-tokenizer, "▁" prepended to every text, so a
    # piece's start is not the text's middle unless the space before it is dropped ("word" ->
    # "▁word", as " word" is inside). Its vocabulary is SentencePiece's, whose pieces never hold a
    # "▁" past their first character: trained here split at "▁" as SentencePiece trains.
    tok = _bpe(pre_tokenizers.Metaspace(prepend_scheme="always"))
    tok.backend_tokenizer.pre_tokenizer = None
    tok.backend_tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    return tok


@pytest.mark.parametrize("special_tokens", [False, True])
def test_a_tokenizer_that_prepends_to_every_text_is_cut_at_a_space_the_next_piece_drops(special_tokens):
    tok = _llama2()
    cut = TEXT.index(" the ", 5000)
    assert not tk._local(tok, TEXT, cut) and not tk._local(tok, TEXT, TEXT.index("\nThe") + 1)
    assert tk._local(tok, TEXT, cut, drop=1)
    got, want, longest = _encode(tok, TEXT, special_tokens)
    assert got == want and longest <= CHUNK


def test_a_dropped_space_is_never_taken_where_it_changes_the_ids(byte_level):
    # Byte-level BPE keeps a space in " the": dropping it gives other ids, so that kind never passes.
    cut = TEXT.index(" the ", 5000)
    assert tk._local(byte_level, TEXT, cut) and not tk._local(byte_level, TEXT, cut, drop=1)


@pytest.mark.parametrize("scheme", ["first", "always"])
def test_metaspace_prepending_is_cut_only_before_a_space(scheme):
    from tokenizers import pre_tokenizers

    # A piece from just after a newline would gain a "▁"; one from just before a space already starts with one.
    tok = _bpe(pre_tokenizers.Metaspace(prepend_scheme=scheme))
    assert not tk._local(tok, TEXT, TEXT.index("\nThe") + 1)
    got, want, longest = _encode(tok, TEXT, True)
    assert got == want and longest <= CHUNK


@pytest.mark.parametrize("single", ["<s> $A", "$A </s>", "<s> $A </s>"])
def test_special_tokens_frame_the_pieces_as_they_frame_the_text(single):
    tok = _byte_level(post_processor=_template(single))
    got, want, longest = _encode(tok, TEXT, True)
    assert got == want and longest <= CHUNK
    assert got.count(tok.bos_token_id) == single.count("<s>") and got.count(tok.eos_token_id) == single.count("</s>")
    assert _encode(tok, TEXT, False)[0] == tok(TEXT, add_special_tokens=False).input_ids


def test_a_text_without_spaces_or_line_ends_is_cut_before_its_punctuation():
    import random

    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    # Chinese on one line, through a byte-level BPE split as Qwen2's and GPT-4's regex splits:
    # "[^\r\n\p{L}\p{N}]?\p{L}+" takes "。" into the letters after it, so a cut before it is where a pre-token starts.
    rng = random.Random(0)
    text = "".join("".join(rng.choice("的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年") for _ in range(rng.randint(5, 30)))
                   + rng.choice("。，、！？") for _ in range(2000))
    split = r"""[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), "isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.train_from_iterator([text[:8000]], trainers.BpeTrainer(
        vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok = _wrap(tok)
    stop = text.index("。", 5000)
    assert tk._local(tok, text, stop)
    got, want, longest = _encode(tok, text, False)
    assert " " not in text and "\n" not in text and got == want and longest <= CHUNK


def test_a_text_without_line_ends_or_spaces_is_tokenized_in_one_call(byte_level):
    text = "abcdefgh" * (CHUNK // 2)
    got, want, longest = _encode(byte_level, text, False)
    assert got == want and longest == len(text)


def test_a_long_texts_tokenization_holds_a_pieces_worth_of_python_objects(byte_level, monkeypatch):
    monkeypatch.setattr(tk, "CHUNK", 1 << 16)
    text = TEXT * 16  # 640k characters, ~10 chunks

    def peak(f):
        tracemalloc.start()
        try:
            f()
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    # The Rust side's ~400 B a token are not traced; the Python lists of ids scale the same way.
    whole = peak(lambda: byte_level(text, add_special_tokens=False).input_ids)
    pieces = peak(lambda: encode(byte_level, text, 10**6, False))
    assert pieces < whole / 4, (pieces, whole)


@pytest.mark.parametrize("tokens", [1, 40, 300])
def test_the_head_of_a_long_text_holds_its_first_tokens_and_little_more(byte_level, tokens):
    # eval ppl --limit N reads the start of a file: its ids are the whole text's first N, and the rest
    # of a long file is never tokenized.
    text = heldout_text()
    rec = Recording(byte_level)
    start = tk.head(rec, text, tokens)
    assert len(start) < len(text) // 10
    got = encode(rec, start, 10**6, special_tokens=False)[:tokens].tolist()
    assert got == byte_level(text[:len(start) + 20_000], add_special_tokens=False).input_ids[:tokens]
    assert rec.longest <= CHUNK


def test_the_head_of_a_text_without_a_tokenizer_is_its_first_bytes():
    assert tk.head(None, "héllo world", 3) == "hél"  # 4 bytes, so 4 tokens: at least the 3 asked
    assert tk.head(None, "hi", 5) == "hi"
