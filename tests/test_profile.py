"""moetool profile: routing, similarity, prefetch, sensitivity and timing on tiny models."""

import dataclasses
import json
import math

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from moetool.cli import app
from moetool.engine.clock import load_hw
from moetool.errors import MoetoolError
from moetool.model import load_model
from moetool.profile import Profile, ProfileConfig, parse_what, profile
from moetool.profile.routing import RoutingAccumulator, entropy, gini, jaccard, top_share
from moetool.profile.trace import LayerTrace, Trace

from helpers import one_error_line

runner = CliRunner()
SMALL = dict(data=("heldout", "general_knowledge"), seqs_per_data=2, seq_len=16, decode_tokens=3, ppl_tokens=32,
             ppl_seq_len=16, int2_shares=(0.0, 0.5), timing_steps=2)


@pytest.fixture(scope="module")
def full(tiny_ckpt):
    path = tiny_ckpt("qwen2_moe")
    return path, profile(ProfileConfig(model=str(path), **SMALL))


def test_routing_counts_sum_to_tokens_times_k(full):
    _, prof = full
    r = prof.routing
    assert r.tokens["decode"] == 2 * 2 * 3  # data sets x prompts x decode steps
    for lr in r.layers:
        assert sum(lr.prefill) == r.tokens["prefill"] * r.top_k
        assert sum(lr.decode) == r.tokens["decode"] * r.top_k
        assert sum(sum(c) for c in lr.by_data.values()) == (r.tokens["prefill"] + r.tokens["decode"]) * r.top_k
        assert 0 < sum(lr.heavy_hitter) < sum(lr.prefill)  # only the top 20% of each prompt's tokens
        assert 0 <= lr.gini < 1 and 0 < lr.entropy <= 1 and lr.top10_share <= lr.top25_share <= 1
        assert len(lr.mean_sorted_score) == r.num_experts
        assert list(lr.mean_sorted_score) == sorted(lr.mean_sorted_score, reverse=True)
    assert "eager" in r.importance
    assert set(r.jaccard) == {"general_knowledge|heldout"}
    assert r.activation_ratio["decode"]["1"] == pytest.approx(r.top_k / r.num_experts)
    assert sum(r.score_hist["selected"]) == r.tokens["decode"] * r.top_k * len(r.layers)


def test_similarity_and_prefetch_are_bounded(full):
    _, prof = full
    s = prof.similarity
    assert len(s.adjacent) == prof.info.num_hidden_layers - 1
    values = [*s.adjacent, *[v for ls in s.layers for v in ls.positions.values()]]
    assert all(-1.0 <= v <= 1.0 for v in values)
    p = prof.prefetch
    assert [lp.layer for lp in p.layers] == list(prof.info.moe_layers[1:])
    for lp in p.layers:
        for d in (lp.recall_topk, lp.recall_p75):
            assert set(d) == {"prefill", "decode"} and all(0.0 <= v <= 1.0 for v in d.values())


def test_sensitivity_and_timing(full, tmp_path):
    _, prof = full
    s = prof.sensitivity
    assert math.isfinite(s.base_ppl) and s.base_ppl > 1 and s.tokens == 2 * 15
    assert [ls.layer for ls in s.layers] == list(prof.info.moe_layers)
    assert all(ls.delta[2] == pytest.approx(ls.ppl[2] - s.base_ppl) for ls in s.layers)
    assert set(s.int2_share) == {"0", "0.5"}
    t = prof.timing
    assert t.h2d_gbps is None and t.c_cpu_s > 0 and t.t_dense_s > 0
    assert {e.bits for e in t.experts} == {16, 8, 4, 2}
    assert all(x.t_moe >= x.t_gate > 0 for x in t.layers)
    path = tmp_path / "measured.hw.json"
    path.write_text(json.dumps(prof.hw))
    hw, _ = load_hw(str(path))
    assert hw.t_dense_s == t.t_dense_s and set(hw.t_expert_s) == {16, 8, 4, 2} and hw.c_cpu_s == t.c_cpu_s


def test_profile_round_trips_and_is_refused_for_another_model(full, tiny_ckpt, tmp_path):
    path, prof = full
    saved = prof.save(tmp_path / "a.profile.json")
    assert Profile.load(saved, model=prof.model) == prof
    other = load_model(tiny_ckpt("mixtral")).fingerprint
    with pytest.raises(MoetoolError, match="was made for model"):
        Profile.load(saved, model=other)


def _same_input_ckpt(tmp_path):
    """Tiny mixtral whose layer 1 router sees exactly layer 0's gate input, through the same router.

    Layer 0's experts output zero and layer 1's attention outputs zero, so the residual stream is
    unchanged between the two routers; the post-attention norms and router weights are shared.
    """
    from transformers import AutoModelForCausalLM

    from tiny import save_tiny

    src = save_tiny("mixtral", tmp_path / "src")
    model = AutoModelForCausalLM.from_pretrained(src)
    layers = model.model.layers
    with torch.no_grad():
        layers[0].mlp.experts.down_proj.zero_()
        layers[1].self_attn.o_proj.weight.zero_()
        layers[1].post_attention_layernorm.weight.copy_(layers[0].post_attention_layernorm.weight)
        layers[1].mlp.gate.weight.copy_(layers[0].mlp.gate.weight)
    model.save_pretrained(tmp_path / "same")
    return tmp_path / "same"


def test_prefetch_recall_is_one_when_the_next_router_sees_the_same_input(tmp_path):
    path = _same_input_ckpt(tmp_path)
    prof = profile(ProfileConfig(model=str(path), **{**SMALL, "what": ("prefetch", "similarity")}))
    (lp,) = prof.prefetch.layers
    assert lp.recall_topk == {"prefill": 1.0, "decode": 1.0}
    assert lp.positions["2"] == {"prefill": 1.0, "decode": 1.0}
    assert lp.smoe_recall == 1.0 and lp.smoe_precision == 1.0
    assert prof.similarity.positions["2"] == pytest.approx(1.0)
    assert prof.routing is None and prof.timing is None


def test_profile_leaves_the_callers_random_stream_where_it_was(tiny_ckpt):
    # --seed seeds the timing part's activations; a notebook that profiles between two draws of its own
    # gets the draw it would have got without the call (it had been reset to the profile's seed)
    path = tiny_ckpt("qwen2_moe")  # built (from its own seed) before the stream is drawn from
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    profile(ProfileConfig(model=str(path), what=("timing",), data=("heldout",), seqs_per_data=1,
                          seq_len=8, timing_steps=1))
    assert torch.equal(torch.rand(4), expected)


def test_routing_statistics():
    assert gini(np.ones(8)) == pytest.approx(0.0)
    assert gini(np.eye(8)[0]) == pytest.approx(7 / 8)
    assert entropy(np.ones(8)) == pytest.approx(1.0) and entropy(np.eye(8)[0]) == 0.0
    assert top_share(np.array([5, 1, 1, 1, 1, 1, 0, 0, 0, 0]), 0.10) == pytest.approx(0.5)
    assert jaccard({1, 2, 3}, {2, 3, 4}) == pytest.approx(0.5)


def test_routing_accumulator_on_a_synthetic_trace():
    E, k, T = 6, 2, 5
    top_k = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 0], [5, 0]])
    lt = LayerTrace(layer=0, attn_in=torch.zeros(T, 4), gate_in=torch.zeros(T, 4), logits=torch.randn(T, E),
                    top_k=top_k, importance=torch.tensor([9.0, 0, 0, 0, 0]))
    acc = RoutingAccumulator(E, k, (0,), hh_ratio=0.2)
    acc.add(Trace("prefill", [lt]), "a")
    lr = acc.result().layers[0]
    assert lr.prefill == (5, 2, 1, 1, 0, 1) and lr.heavy_hitter == (1, 1, 0, 0, 0, 0)
    assert lr.hot_sets["a"] == (0,)


def test_what_and_data_are_checked(tiny_ckpt):
    assert parse_what(["routing,timing"]) == ("routing", "timing")
    assert parse_what(["all"]) == parse_what([]) == ("routing", "sensitivity", "similarity", "prefetch", "timing")
    with pytest.raises(MoetoolError, match="--what"):
        parse_what(["speed"])
    with pytest.raises(MoetoolError, match="neither a file nor a known data set"):
        profile(ProfileConfig(model=str(tiny_ckpt("qwen2_moe")), data=("nope.txt",), what=("routing",)))


@pytest.mark.parametrize("prompts,said", [
    (["   ", "one about kings", "two", "three"], "prompt 1 of {path} is empty; give it some text or remove it."),
    (["The sky is blue. " * 8, "two"], "the longest prompt of --data (136 tokens) plus --decode-tokens 2 is 138 "
                                       "tokens, more than {ckpt}'s context of 128"),
])
def test_a_jsonl_prompt_profile_cannot_trace_whole_is_refused(char_ckpt, tmp_path, prompts, said):
    """A blank prompt was skipped, so fewer sequences than --seqs were traced without a word (`run` refuses
    it); a prompt longer than the model's context ran past it (--seq-len cuts only texts, not prompts)."""
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    with pytest.raises(MoetoolError) as e:
        profile(ProfileConfig(model=str(char_ckpt), data=(str(path),), what=("routing",), seqs_per_data=4,
                              seq_len=16, decode_tokens=2))
    assert str(e.value).startswith(said.format(path=path, ckpt=char_ckpt)), str(e.value)


def test_a_data_file_is_recorded_by_its_own_sha256(char_ckpt, tmp_path):
    """The profile hashed the decoded text: a file with a byte-order mark, or in UTF-16, was recorded
    under a hash no file on disk has (and the same as the plain UTF-8 file's), where `eval ppl --data`
    records the file's own."""
    import hashlib

    text = "The king said the sky was blue, and the queen agreed with him. " * 3
    got = {}
    for name, data in (("plain.txt", text.encode()), ("bom.txt", b"\xef\xbb\xbf" + text.encode()),
                       ("utf16.txt", text.encode("utf-16"))):
        path = tmp_path / name
        path.write_bytes(data)
        prof = profile(ProfileConfig(model=str(char_ckpt), data=(str(path),), what=("routing",), seqs_per_data=1,
                                     seq_len=16, decode_tokens=1))
        got[name] = prof.inputs[f"data:{path}"]
        assert got[name] == hashlib.sha256(data).hexdigest()
    assert len(set(got.values())) == 3


def test_cli_profile_writes_artifact_and_hw(tiny_ckpt, tmp_path):
    out = tmp_path / "t.profile.json"
    result = runner.invoke(app, ["profile", "--model", str(tiny_ckpt("qwen2_moe")), "--data", "heldout",
                                 "--what", "routing,timing", "--seqs", "1", "--seq-len", "12", "--decode-tokens", "2",
                                 "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert Profile.load(out).what == ("routing", "timing")
    assert load_hw(str(tmp_path / "t.hw.json"))[0].t_expert_s
    assert "one expert, one token, on cpu" in result.output and "grouped" in result.output  # each precision's path
    help_text = runner.invoke(app, ["profile", "--help"]).output
    assert "Example" in help_text


def test_sensitivity_reads_a_bundle_and_refuses_missing_bits(tiny_ckpt, tmp_path):
    from moetool.quant import QuantizeConfig, quantize

    path = str(tiny_ckpt("qwen2_moe"))
    quantize(QuantizeConfig(model=path, out=tmp_path / "b", bits=(16, 4, 2), group_size=16))
    cfg = ProfileConfig(model=path, bundle=tmp_path / "b", what=("sensitivity",), sensitivity_bits=(2, 4),
                        int2_shares=(0.0, 1.0), ppl_tokens=32, ppl_seq_len=16)
    prof = profile(cfg)
    assert prof.sensitivity.source.startswith("bundle") and prof.info.expert_bytes_source.startswith("bundle")
    assert set(prof.sensitivity.layers[0].delta) == {2, 4} and prof.inputs
    with pytest.raises(MoetoolError, match="lacks 8-bit experts"):
        profile(dataclasses.replace(cfg, sensitivity_bits=(8,)))


@pytest.mark.parametrize("tokens,n,seq_len,windows", [(145, 4, 128, 1), (600, 4, 128, 4), (512, 4, 128, 4),
                                                      (511, 4, 128, 3), (60, 4, 128, 1)])
def test_text_windows_never_overlap_and_are_as_many_as_the_text_holds(tokens, n, seq_len, windows):
    """A 145-token text gave 4 windows of 128 over the same tokens, so its routing was counted four times."""
    from moetool.profile.data import spread_chunks

    chunks = spread_chunks(torch.arange(tokens), n, seq_len)
    assert len(chunks) == windows
    seen = torch.cat([c[0] for c in chunks])
    assert seen.unique().numel() == seen.numel()  # no token in two windows
    assert all(c.shape == (1, min(seq_len, tokens)) for c in chunks)


def test_an_hw_out_the_profile_would_not_write_is_refused(tiny_ckpt, tmp_path):
    """--hw-out without timing in --what wrote nothing and said nothing."""
    result = runner.invoke(app, ["profile", "--model", str(tiny_ckpt("qwen2_moe")), "--data", "heldout", "--what",
                                 "routing", "--seqs", "1", "--seq-len", "12", "--decode-tokens", "2",
                                 "--out", str(tmp_path / "p.json"), "--hw-out", str(tmp_path / "h.json")])
    assert result.exit_code == 1 and "is written from the timing part, which --what routing leaves out" in result.stderr
    assert not (tmp_path / "p.json").exists() and not (tmp_path / "h.json").exists()


def test_a_bundle_without_its_reference_is_not_profiled_as_the_model(tmp_path):
    """A --no-reference bundle's model runs on its highest stored precision: its sensitivity measured
    INT2 against INT4 (base perplexity the INT4 model's) and its routing was traced through INT4
    experts, all recorded as the model's, and fitted from."""
    from helpers import quantize_config, tiny_moe
    from moetool.quant import quantize

    model = tiny_moe(tmp_path / "m")
    bundle = tmp_path / "b"
    quantize(quantize_config(model, bundle, bits=(4, 2), calibrate=False, hqq_optimize=False))
    for what in (("routing",), ("sensitivity",)):
        with pytest.raises(MoetoolError, match=rf"stores no bf16 reference .* so {what[0]} would measure the model "
                                               r"at its 4-bit experts, not the model; add --model"):
            profile(ProfileConfig(bundle=str(bundle), what=what, data=("heldout",), seqs_per_data=1, seq_len=8,
                                  decode_tokens=1, ppl_tokens=16))
    got = profile(ProfileConfig(model=str(model), bundle=str(bundle), what=("routing",), data=("heldout",),
                                seqs_per_data=1, seq_len=8, decode_tokens=1))  # the checkpoint is the reference
    assert got.routing is not None


def test_a_jsonl_file_is_read_as_prompts_whatever_the_case_of_its_suffix(char_ckpt, tmp_path):
    """`prompts.JSONL` was profiled as raw text: windows of its JSON, not its prompts."""
    for name in ("p.jsonl", "p.JSONL"):
        path = tmp_path / name
        path.write_text('{"prompt": "The king said"}\n{"prompt": "The queen said"}\n')
        prof = profile(ProfileConfig(model=str(char_ckpt), data=(str(path),), what=("routing",), seqs_per_data=4,
                                     seq_len=16, decode_tokens=1))
        assert prof.data == {str(path): 2}, prof.data  # two prompts, not windows of the file's text


def test_the_profiles_kv_margin_plans_no_more_tokens_than_the_model_has_positions(tmp_path):
    """A 1,024-position model's margin planned for 4,096 tokens made `fit --budget 20MiB` refuse what
    `run --budget 20MiB` ran."""
    from moetool.engine.budget import PLAN_TOKENS, plan_margin
    from moetool.profile import _info
    from tiny import save_tiny

    short = load_model(save_tiny("qwen2_moe", tmp_path / "short", max_position_embeddings=256))
    info = _info(short, None, torch.float32, "float32")
    layers = short.geometry.layers
    assert info.kv_margin_bytes == plan_margin(short.model.config, layers, 256, 1, torch.float32, decoded=True)
    assert info.kv_margin_bytes < plan_margin(short.model.config, layers, PLAN_TOKENS, 1, torch.float32, decoded=True)


def test_the_sensitivity_is_scored_on_the_text_ppl_data_names(tiny_ckpt, tmp_path):
    """`--data` never reached the sensitivity: it always scored the shipped English held-out text, so a
    code model's INT2 sensitivity (and Fate's p from it) came from English prose."""
    code = tmp_path / "code.txt"
    code.write_text("def f(x):\n    return [i * x for i in range(10) if i % 2]\n" * 60)
    out = tmp_path / "p.json"
    args = ["profile", "--model", str(tiny_ckpt("qwen2_moe")), "--what", "sensitivity", "--ppl-tokens", "64", "--out", str(out)]
    result = runner.invoke(app, [*args, "--ppl-data", str(code)])
    assert result.exit_code == 0, result.output
    prof = json.loads(out.read_text())
    assert prof["sensitivity"]["data"] == str(code) and f"data:{code}" in prof["inputs"]
    bad = runner.invoke(app, [*args, "--ppl-data", "general_knowledge"])  # prompts, not running text
    assert bad.exit_code == 1 and "--ppl-data general_knowledge is neither a text file nor a text data set" in bad.output
    unused = runner.invoke(app, ["profile", "--model", str(tiny_ckpt("qwen2_moe")), "--what", "routing", "--ppl-data", str(code),
                                 "--out", str(tmp_path / "q.json")])
    assert unused.exit_code == 1 and "--ppl-data" in unused.output


def test_a_ppl_data_file_is_read_before_the_model_and_a_short_one_is_said(tiny_ckpt, tmp_path, monkeypatch):
    """A binary, NUL or blank --ppl-data was refused only after the whole profile (72-93 s on the demo),
    in a sentence naming --data; a text far shorter than --ppl-tokens was scored without a word."""
    import moetool.profile as stage

    def loads(*a, **k):
        raise AssertionError("the model loaded")

    monkeypatch.setattr(stage, "load_model", loads)
    args = ["profile", "--model", str(tiny_ckpt("qwen2_moe")), "--what", "sensitivity", "--out", str(tmp_path / "p.json")]
    for name, data, said in (("bin", bytes(range(128, 256)), "is not UTF-8 text"), ("nul", b"a\x00b", "NUL"),
                             ("blank", b"  \n\t\n", "holds no text")):
        (tmp_path / name).write_bytes(data)
        line = one_error_line(runner.invoke(app, [*args, "--ppl-data", str(tmp_path / name)]))
        assert line.startswith(f"error: --ppl-data {tmp_path / name}") and said in line, line
    assert not (tmp_path / "p.json").exists()
    monkeypatch.undo()
    (tmp_path / "short.txt").write_text("a short text of a few words")
    result = runner.invoke(app, [*args, "--ppl-data", str(tmp_path / "short.txt"), "--ppl-tokens", "256"])
    assert result.exit_code == 0, result.output
    assert "note: the sensitivity scored" in result.output and "not the 256 --ppl-tokens asked for" in result.output
