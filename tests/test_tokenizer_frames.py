"""Text the model would not read as given: a tokenizer that ends every text with EOS (OLMo's
tokenizer.json appends `</s>` with a TemplateProcessing post-processor), and a BPE with neither an
unknown token nor byte fallback, which drops the characters its vocabulary lacks. A prompt or an
lm-eval context is continued, so it runs without the appended EOS; text of which nothing is kept is
refused, and text of which some is dropped is said."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from helpers import one_error_line
from tiny import save_tiny

from moetool.cli import app

runner = CliRunner()


def _cli(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def framed_ckpt(tmp_path_factory) -> Path:
    """A tiny qwen2_moe with a character BPE of printable ASCII, no unknown token, no byte fallback, and
    a post-processor `<s> $A </s>`: "東京" is `<s> </s>`, "ab 東京" is `<s> a b ␣ </s>`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    out = tmp_path_factory.mktemp("framed") / "m"
    save_tiny("qwen2_moe", out)
    vocab = {"<s>": 0, "</s>": 1, **{c: i + 2 for i, c in enumerate(["\n"] + [chr(i) for i in range(32, 127)])}}
    tok = Tokenizer(models.BPE(vocab, [], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[("<s>", 0), ("</s>", 1)])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(out)
    return out


def _greedy(ckpt: Path, ids: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=1)
    return out[0, len(ids):].tolist()


def test_a_prompt_runs_without_the_eos_its_tokenizer_ends_every_text_with(framed_ckpt, tmp_path):
    """`<s> T h e ␣ s k y </s>` was the prompt handed to generate: the model continued past an end of
    document. It runs as `<s> The sky` now (plain transformers' greedy tokens from those ids), said and
    recorded."""
    out = tmp_path / "r.json"
    done = _cli("run", "--model", framed_ckpt, "--prompt", "The sky", "--max-new-tokens", 4, "--out", out)
    assert done.exit_code == 0, done.output
    assert "the tokenizer ends every text with '</s>'; prompts are run without it" in done.stderr
    run = json.loads(out.read_text())
    assert run["tokens"][0] == _greedy(framed_ckpt, [0] + [2 + 1 + ord(c) - 32 for c in "The sky"], 4)
    assert any("ends every text with" in n for n in run["summary"]["text_notes"])


def test_text_the_tokenizer_drops_whole_is_refused_and_in_part_said(framed_ckpt, tmp_path):
    """"東京" gave `<s> </s>` alone: run generated from it, eval ppl and profile measured it, each
    recording the text as if the model had read it. Now one sentence; a prompt that keeps some of its
    characters runs and says how many were dropped."""
    said = ("prompt 1 ('東京') gives no token of its own under this model's tokenizer (at most whitespace and the "
            "special tokens it frames every text with): the tokenizer drops its characters; give text the tokenizer "
            "keeps.")
    assert one_error_line(_cli("run", "--model", framed_ckpt, "--prompt", "東京", "--out", tmp_path / "r.json")) \
        == f"error: {said}"
    assert not (tmp_path / "r.json").exists()
    text = tmp_path / "cjk.txt"
    text.write_text("東京 大阪\n" * 20, encoding="utf-8")
    line = one_error_line(_cli("eval", "ppl", "--model", framed_ckpt, "--data", text))
    assert line.startswith("error: the text '東京 大阪") and "gives no token of its own" in line, line
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "ab"}) + "\n" + json.dumps({"prompt": "東京"}) + "\n", encoding="utf-8")
    line = one_error_line(_cli("profile", "--model", framed_ckpt, "--data", prompts, "--what", "routing",
                               "--out", tmp_path / "p.json"))
    assert "prompt 2 of" in line and "gives no token of its own" in line, line
    text.write_text("ab 東京\n" * 20, encoding="utf-8")
    done = _cli("eval", "ppl", "--model", framed_ckpt, "--data", text, "--out", tmp_path / "e.json")
    assert done.exit_code == 0 and "40 character(s) of" in done.stderr, done.output
    assert json.loads((tmp_path / "e.json").read_text())["options"]["dropped_characters"] == 40
    done = _cli("run", "--model", framed_ckpt, "--prompt", "ab 東京", "--max-new-tokens", 2, "--out", tmp_path / "r.json")
    assert done.exit_code == 0, done.output
    assert "prompt 1 ('ab 東京') has 2 character(s) the tokenizer drops" in done.stderr, done.stderr
    done = _cli("profile", "--model", framed_ckpt, "--data", text, "--what", "routing", "--seq-len", 8,
                "--decode-tokens", 2, "--out", tmp_path / "p.json")  # profiled as if read whole, before
    assert done.exit_code == 0, done.output
    assert f"note: {text} has 40 character(s) the tokenizer drops" in done.stderr.replace("\n", " "), done.stderr
    assert json.loads((tmp_path / "p.json").read_text())["notes"] == [
        f"{text} has 40 character(s) the tokenizer drops (no token covers them): the profile measured the text "
        "without them."]


def test_lm_eval_scores_contexts_and_choices_without_the_appended_eos(framed_ckpt, tmp_path, monkeypatch):
    """lm-eval encodes with the tokenizer's special tokens: `<s> The sky is </s>` and `b l u e </s>`, every
    choice scored after an EOS where its space was, and a note blamed a merge with the context. The
    log-likelihoods are now those of `<s> The sky is` + ` blue`, computed by hand on transformers' model."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr("moetool.eval_tasks.hub_reachable", lambda: False)
    rows = [{"q": "The sky is", "choices": ["blue", "green"], "answer": 0}]
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tasks / "t.yaml").write_text(f"task: t\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tasks / 't.jsonl'}\n"
                                  "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{q}}'\n"
                                  "doc_to_choice: choices\ndoc_to_target: answer\nmetric_list:\n  - metric: acc\n")
    out = tmp_path / "e.json"
    done = _cli("eval", tasks / "t.yaml", "--model", framed_ckpt, "--out", out)
    assert done.exit_code == 0, done.output
    assert "merged with the last token" not in done.stderr and "ends every text with '</s>'" in done.stderr
    got = [r[0] for r in json.loads(out.read_text())["samples"]["t"][0]["resps"]]
    model = AutoModelForCausalLM.from_pretrained(framed_ckpt, dtype=torch.float32).eval()

    def ids(s: str) -> list[int]:
        return [2 + 1 + ord(c) - 32 for c in s]

    want = []
    for choice in rows[0]["choices"]:
        context, cont = [0] + ids("The sky is"), ids(" " + choice)
        with torch.no_grad():
            logp = model(torch.tensor([context + cont])).logits[0].log_softmax(-1)
        want.append(sum(float(logp[len(context) - 1 + i, t]) for i, t in enumerate(cont)))
    assert got == pytest.approx(want, abs=1e-4)
    shutil.rmtree(tasks)


def test_line_ends_of_another_system_are_said_in_ppl_and_in_prompts(tiny_ckpt, tmp_path):
    """One text saved with CRLF (or lone CR) line ends read another perplexity without a word (its
    carriage returns are scored as text); a prompts file with lone-CR line ends was "not JSON" alone."""
    from moetool.datasets import line_ends

    assert [line_ends(t) for t in ("a\nb\n", "a\r\nb\r\n", "a\rb\r", "a\r\nb\n", "ab")] == [None, "crlf", "cr", "mixed", None]
    text = tmp_path / "t.txt"
    text.write_bytes(b"the cat sat on the mat.\r\n" * 30)
    done = _cli("eval", "ppl", "--model", tiny_ckpt("qwen2_moe"), "--data", text, "--out", tmp_path / "e.json")
    assert done.exit_code == 0 and "end in CRLF (Windows)" in done.stderr, done.output
    assert json.loads((tmp_path / "e.json").read_text())["options"]["line_ends"] == "crlf"
    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes(b'{"prompt": "a"}\r{"prompt": "b"}\r')
    line = one_error_line(_cli("run", "--model", tiny_ckpt("qwen2_moe"), "--prompts", prompts, "--out", tmp_path / "r.json"))
    assert line == (f"error: {prompts} line 1 is not JSON (its lines end in a lone carriage return, old Mac style; "
                    "JSON Lines ends a line at \\n) (expected {\"prompt\": \"...\"})."), line


def test_files_that_are_not_the_text_they_seem_are_named(tiny_ckpt, tmp_path):
    """A UTF-16 mark before UTF-8 bytes (a stray mark, or UTF-8 lines appended to a Notepad "Unicode"
    file) decoded as CJK and was scored; JSON Lines named .ndjson or .json was scored with its braces
    and keys (only .jsonl was refused); a prompts file that is one JSON array, or joined from two files
    with a byte-order mark in the middle, was "not JSON" alone; an escaped NUL ran as a prompt."""
    import codecs

    from moetool.datasets import decode_text, is_json
    from moetool.errors import MoetoolError

    text = "the cat sat on the mat, and then it sat again.\n" * 40
    for raw, at in [(codecs.BOM_UTF16_LE + text.encode(), "after the mark"),
                    (codecs.BOM_UTF16_LE + text[:400].encode("utf-16-le") + text[400:].encode(), "from byte 802 on")]:
        with pytest.raises(MoetoolError, match=f"starts with a UTF-16 byte-order mark, but its bytes {at} are UTF-8"):
            decode_text(raw, "f", ".")
    for proper in (text, "これは日本語のテキストです。東京と大阪、「引用」…—“テスト” 😀👨‍👩‍👧 " * 300):
        for codec, mark in (("utf-16-le", codecs.BOM_UTF16_LE), ("utf-16-be", codecs.BOM_UTF16_BE)):
            assert decode_text(mark + proper.encode(codec), "f", ".") == proper
    assert [is_json(t) for t in ('{"text": "a"}\n{"text": "b"}\n', '[\n  {"text": "a"}\n]\n', '"a"\n', "[1] Intro\n",
                                 "{braces} in prose\n", text)] == [True, True, True, False, False, False]
    model = tiny_ckpt("qwen2_moe")
    for name in ("docs.ndjson", "docs.json"):
        (tmp_path / name).write_text("".join(json.dumps({"text": text[:60], "id": i}) + "\n" for i in range(5)))
        line = one_error_line(_cli("eval", "ppl", "--model", model, "--data", tmp_path / name))
        assert line == (f"error: --data {tmp_path / name} is JSON data (JSON Lines, or one JSON document), and ppl "
                        "scores running text: give a text file (the documents one after another)."), line
    for body, why in [('[\n{"prompt": "a"}\n]\n', "the file is one JSON array, not JSON Lines"),
                      ('{"prompt": "a"}\n\ufeff{"prompt": "b"}\n', "it starts with a byte-order mark, U+FEFF"),
                      ('["a", "b"]\n', "is a JSON array, not a prompt"),
                      ('{"prompt": "a\\u0000b"}\n', "holds a NUL character at character 2")]:
        (tmp_path / "p.jsonl").write_text(body, encoding="utf-8")
        line = one_error_line(_cli("run", "--model", model, "--prompts", tmp_path / "p.jsonl", "--out", tmp_path / "r.json"))
        assert why in line, line


def test_a_prompt_too_long_for_any_tokenization_is_refused_untokenized(char_ckpt, tmp_path, monkeypatch):
    """A 4 MB prompt was tokenized in one call (2.2 GB, 38 s) to be refused as past the context: no token
    of a character vocabulary spells more than one character, so its length alone says so."""
    import moetool.run as run_module

    monkeypatch.setattr(run_module, "_encode", lambda *a, **k: pytest.fail("the prompt was tokenized"))
    line = one_error_line(_cli("run", "--model", char_ckpt, "--prompt", "ab " * 3000, "--out", tmp_path / "r.json"))
    assert line.startswith("error: prompt 1 of 1 is 9000 characters, more than ") and "no token of its tokenizer " \
        "spells more than 5 characters" in line, line


def test_an_lm_eval_task_on_a_tokenizer_without_bos_or_eos_is_one_sentence(char_ckpt, tmp_path, monkeypatch):
    """lm-eval starts every request with the BOS (else EOS) token: a tokenizer with neither was a TypeError
    inside lm-eval's tok_encode, for the packaged bigbench-mc too."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr("moetool.eval_tasks.hub_reachable", lambda: False)
    ckpt = tmp_path / "m"
    shutil.copytree(char_ckpt, ckpt)
    for f in ckpt.glob("tok*"):
        f.unlink()
    chars = ["\n"] + [chr(i) for i in range(32, 127)]
    tok = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token=" "))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(ckpt)
    line = one_error_line(_cli("eval", "bigbench-mc", "--model", ckpt, "--limit", 1))
    assert line == (f"error: the tokenizer of {ckpt} has neither a beginning- nor an end-of-sequence token, and lm-eval "
                    "starts every request with one of them (ppl and run need neither); give its tokenizer_config.json "
                    "a bos_token or eos_token."), line


def test_calibration_text_partly_in_a_script_the_vocabulary_lacks_is_said(char_ckpt, tmp_path):
    """`eval ppl` said how much of a text was the unknown token; `quantize --calib-text` calibrated on the
    same placeholders without a word."""
    text = tmp_path / "cjk.txt"
    text.write_text("ab 東京 cd\n" * 200, encoding="utf-8")
    done = _cli("quantize", char_ckpt, "--bits", "4", "--no-reference", "--calibrate", "--calib-text", text,
                "--calib-tokens", "256", "--out", tmp_path / "b")
    assert done.exit_code == 0, done.output
    assert "of the 256 calibration tokens are the tokenizer's unknown token" in done.stderr, done.stderr
    done = _cli("profile", "--model", char_ckpt, "--data", text, "--what", "routing", "--seq-len", 8,
                "--decode-tokens", 2, "--out", tmp_path / "p.json")
    assert done.exit_code == 0, done.output
    notes = json.loads((tmp_path / "p.json").read_text())["notes"]
    assert len(notes) == 1 and notes[0].startswith(f"{text} has 400 unknown token(s)"), notes
