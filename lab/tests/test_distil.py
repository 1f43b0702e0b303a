"""The demo conversion's stages on a tiny dense llama: the training form of the MoE block is the
Qwen2-MoE block `moetool.demo.convert` builds, training lowers the KL, an interrupted run resumes to
the same parameters as an uninterrupted one, and the router temperature keeps the gate ratio."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from lab import stages
from lab.distil import DistilSettings, MoeFFN, _general_rows, _router_inputs, _scale_at, distil, teacher_samples
from lab.gates import calibrate, gate_ratio, router_stats
from lab.layerwise import FitSettings, spread_rows
from moetool import demo
from moetool.demo import ConversionParams

H, I, SHARED, E, K = 32, 96, 32, 8, 2  # 8 routed experts of 8 neurons, top-2


def _dense(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=128, hidden_size=H, intermediate_size=I, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=True, bos_token_id=0, eos_token_id=1, pad_token_id=2,
                      initializer_range=0.2)  # large weights: a peaked next-token distribution to match
    return LlamaForCausalLM(cfg).eval()


def _params(dense, seed: int = 0) -> ConversionParams:
    gen = torch.Generator().manual_seed(seed)
    layers = dense.config.num_hidden_layers
    perm = torch.stack([torch.randperm(I, generator=gen) for _ in range(layers)])
    router = torch.randn(layers, E, H, generator=gen)
    return ConversionParams(SHARED, E, K, perm, router, {}, {})


def _ids(n: int = 4000, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(seed))


SMALL = DistilSettings(steps=6, batch=2, seq_len=32, rank=4, lr=3e-3, router_lr=3e-3, warmup=1,
                       anneal=0.5, checkpoint_every=2)


@torch.no_grad()
def test_training_form_equals_the_converted_qwen2_moe_block():
    """Swapped into the dense model with random corrections, MoeFFN gives the logits of demo.convert."""
    dense, x = _dense(), _ids(40)[None]
    p = _params(dense)
    gen = torch.Generator().manual_seed(3)
    sample = torch.randn(16, H)
    students = [MoeFFN(blk.mlp, p, i, SMALL, gen, sample) for i, blk in enumerate(dense.model.layers)]
    for st in students:  # non-zero corrections everywhere, and a router that is not the start
        for name, q in st.named_parameters():
            q.copy_(torch.randn(q.shape, generator=gen) * (0.3 if name == "router" else 0.05))
    originals = [blk.mlp for blk in dense.model.layers]
    for blk, st in zip(dense.model.layers, students):
        blk.mlp = st
    want = dense(input_ids=x).logits
    for blk, mlp in zip(dense.model.layers, originals):
        blk.mlp = mlp
    exported = [st.export() for st in students]
    trained = ConversionParams(SHARED, E, K, p.perm, torch.stack([r for r, _ in exported]),
                               {k: torch.stack([lo[k] for _, lo in exported]) for k in exported[0][1]}, {})
    got = demo.convert(dense, trained)(input_ids=x).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_a_run_can_make_layers_dense_and_change_top_k():
    """`dense_layers` and `top_k` in the settings set the geometry a run trains: the dense layer keeps
    the dense FFN exactly (its router and corrections carried, untouched), the other layers train at
    the new k, and the converted checkpoint is a Qwen2-MoE with that layer in `mlp_only_layers`."""
    dense, ids = _dense(), _ids()
    first = distil(dense, ids, _params(dense), SMALL)
    s = DistilSettings(**{**SMALL.__dict__, "anneal": 0.0, "top_k": K + 1, "dense_layers": (0,)})
    again = distil(dense, ids, first, s)
    assert (again.top_k, again.dense_layers) == (K + 1, (0,))
    for bad in ({"top_k": E + 1}, {"dense_layers": (0, 1)}, {"dense_layers": (2,)}):
        with pytest.raises(ValueError, match="not a geometry"):
            distil(dense, ids, first, replace(s, **bad))
    torch.testing.assert_close(again.router[0], first.router[0], rtol=0, atol=0)
    for k, v in first.lora.items():
        torch.testing.assert_close(again.lora[k][0], v[0], rtol=0, atol=0)
    assert not torch.equal(again.router[1], first.router[1]) and not torch.equal(again.lora["gate_b"][1], first.lora["gate_b"][1])
    m = (I - SHARED) // E
    assert again.active_fraction == pytest.approx((1 + (SHARED + (K + 1) * m) / I) / 2)
    moe = demo.convert(dense, again)
    assert moe.config.mlp_only_layers == [0] and moe.config.num_experts_per_tok == K + 1
    x = _ids(40, seed=5)[None]
    with torch.no_grad():
        h = torch.randn(1, 7, H, generator=torch.Generator().manual_seed(2))
        torch.testing.assert_close(moe.model.layers[0].mlp(h), dense.model.layers[0].mlp(h), rtol=0, atol=0)
        # The training form of the other layer, swapped into the dense model, gives the same logits.
        st = MoeFFN(dense.model.layers[1].mlp, again, 1, replace(s, dense_layers=()), torch.Generator(), h[0])
        original = dense.model.layers[1].mlp
        dense.model.layers[1].mlp = st
        try:
            want = dense(input_ids=x).logits
        finally:
            dense.model.layers[1].mlp = original
        torch.testing.assert_close(moe(input_ids=x).logits, want, rtol=1e-4, atol=1e-4)


def test_dense_layers_survive_the_parameter_file(tmp_path):
    dense = _dense()
    p = replace(_params(dense), dense_layers=(1,))
    demo.save_params(p, tmp_path / "c.safetensors")
    back = demo.load_params(tmp_path / "c.safetensors")
    assert back.dense_layers == (1,) and "dense_layers" not in back.meta
    assert demo.load_params(_saved(tmp_path, _params(dense))).dense_layers == ()


def _saved(tmp_path, p):
    demo.save_params(p, tmp_path / "plain.safetensors")
    return tmp_path / "plain.safetensors"


def test_logit_multiplier_anneals_from_hard_gating_to_the_target_spread():
    s = DistilSettings(steps=100, anneal=0.4, logit_std=1.0, start_std=0.01)
    assert math.isclose(_scale_at(0, s) * s.logit_std, s.start_std)
    assert _scale_at(20, s) < _scale_at(30, s) < 1.0
    assert _scale_at(40, s) == 1.0 and _scale_at(100, s) == 1.0


@torch.no_grad()
def _kl(dense, moe, x: torch.Tensor) -> float:
    target = torch.log_softmax(dense(input_ids=x).logits, -1)
    logp = torch.log_softmax(moe(input_ids=x).logits, -1)
    return torch.nn.functional.kl_div(logp.flatten(0, 1), target.flatten(0, 1), log_target=True,
                                      reduction="batchmean").item()


def test_distillation_lowers_held_out_kl_and_leaves_the_dense_model_unchanged():
    dense = _dense()
    before = {k: v.clone() for k, v in dense.state_dict().items()}
    p = _params(dense)
    # No annealing (start spread = target spread), so the first student is exactly convert(dense, start).
    s = DistilSettings(**{**SMALL.__dict__, "steps": 60, "batch": 4, "lr": 1e-2, "start_std": 1.0, "logit_std": 1.0})
    trained = distil(dense, _ids(), p, s)
    held = _ids(256, seed=9).view(4, 64)
    samples = _router_inputs(dense, _ids()[: s.seq_len])
    scaled = torch.stack([p.router[i] * (s.logit_std / (samples[i] @ p.router[i].T).std()) for i in range(2)])
    first = ConversionParams(SHARED, E, K, p.perm, scaled, {}, {})
    assert _kl(dense, demo.convert(dense, trained), held) < 0.95 * _kl(dense, demo.convert(dense, first), held)
    for k, v in dense.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert type(dense.model.layers[0].mlp).__name__ == "LlamaMLP"
    assert set(trained.lora) == {"gate_a", "gate_b", "up_a", "up_b", "down_a", "down_b"}
    assert trained.lora["gate_b"].shape == (2, I, s.rank) and trained.router.shape == (2, E, H)


def test_interrupted_distillation_resumes_to_the_same_parameters(tmp_path):
    dense, ids = _dense(), _ids()
    p = _params(dense)
    whole = distil(dense, ids, p, SMALL, checkpoint=tmp_path / "a.pt")

    class Stop(Exception):
        pass

    def stop_at_5(done, total, kl, gap, sec):
        if done == 5:
            raise Stop

    ckpt = tmp_path / "b.pt"
    with pytest.raises(Stop):
        distil(dense, ids, p, SMALL, checkpoint=ckpt, report=stop_at_5)
    assert torch.load(ckpt, weights_only=True)["step"] == 4  # the last checkpoint before the stop
    seen: list[int] = []
    resumed = distil(dense, ids, p, SMALL, checkpoint=ckpt, report=lambda done, *_: seen.append(done))
    assert seen == [5, 6]
    torch.testing.assert_close(resumed.router, whole.router, rtol=0, atol=0)
    for k in whole.lora:
        torch.testing.assert_close(resumed.lora[k], whole.lora[k], rtol=0, atol=0)


def test_a_checkpoint_of_other_settings_is_not_resumed(tmp_path):
    dense, ids = _dense(), _ids()
    p = _params(dense)
    ckpt = tmp_path / "c.pt"
    distil(dense, ids, p, SMALL, checkpoint=ckpt)
    other = DistilSettings(**{**SMALL.__dict__, "lr": 1e-3})
    seen: list[int] = []
    distil(dense, ids, p, other, checkpoint=ckpt, report=lambda done, *_: seen.append(done))
    assert seen == list(range(1, other.steps + 1))


def test_refinement_starts_from_the_distilled_conversion_and_trains_on_teacher_samples(tmp_path):
    """Stage 3: a run without annealing over a distilled conversion starts exactly at that
    conversion (routers and every correction kept), mixes teacher samples into each step, lowers
    the KL on those samples, and resumes an interruption to the same parameters."""
    dense, ids = _dense(), _ids()
    first = DistilSettings(**{**SMALL.__dict__, "steps": 4})
    distilled = distil(dense, ids, _params(dense), first)
    refine = DistilSettings(**{**SMALL.__dict__, "steps": 40, "batch": 1, "general": 2, "lr": 1e-2, "anneal": 0.0})
    # Sampled from the dense model itself, each row from the document separator.
    samples = teacher_samples(dense, 8, refine.seq_len, start_id=0, seed=5, batch=3)
    assert samples.shape == (8, refine.seq_len) and (samples[:, 0] == 0).all()
    assert torch.equal(samples, teacher_samples(dense, 8, refine.seq_len, start_id=0, seed=5, batch=3))
    rows = _general_rows(8, refine)
    assert rows.shape == (40, 2) and sorted(rows.flatten()[:8].tolist()) == list(range(8))  # each once first

    gen = torch.Generator().manual_seed(3)
    sample = _router_inputs(dense, ids[: refine.seq_len])
    students = [MoeFFN(blk.mlp, distilled, i, refine, gen, sample[i]) for i, blk in enumerate(dense.model.layers)]
    with torch.no_grad():
        exported = [st.export() for st in students]
    torch.testing.assert_close(torch.stack([r for r, _ in exported]), distilled.router, rtol=0, atol=0)
    for k in distilled.lora:
        torch.testing.assert_close(torch.stack([lo[k] for _, lo in exported]), distilled.lora[k], rtol=0, atol=0)

    with pytest.raises(ValueError, match="teacher-sample"):
        distil(dense, ids, distilled, refine)
    refined = distil(dense, ids, distilled, refine, general=samples, checkpoint=tmp_path / "r.pt")
    held = teacher_samples(dense, 4, refine.seq_len, start_id=0, seed=6)
    assert _kl(dense, demo.convert(dense, refined), held) < 0.95 * _kl(dense, demo.convert(dense, distilled), held)
    assert refined.meta["refine"]["general"] == 2 and refined.meta["distil"]["general"] == 0

    class Stop(Exception):
        pass

    def stop_at_3(done, *_):
        if done == 3:
            raise Stop

    with pytest.raises(Stop):
        distil(dense, ids, distilled, refine, general=samples, checkpoint=tmp_path / "s.pt", report=stop_at_3)
    resumed = distil(dense, ids, distilled, refine, general=samples, checkpoint=tmp_path / "s.pt")
    torch.testing.assert_close(resumed.router, refined.router, rtol=0, atol=0)
    # Other samples are other training data: their checkpoint is not resumed.
    assert refine.key(distilled, samples) != refine.key(distilled, samples.flip(0))


def test_each_refinement_round_starts_from_the_last_on_new_samples_and_is_kept(tmp_path, monkeypatch):
    """Stage 3 in rounds (`lab.stages._refine`): round r trains at seed REFINE.seed + r on that seed's
    teacher samples, from the fp16 result of the round before, and keeps its result, which a rerun
    reuses without training."""
    dense, ids = _dense(), _ids()
    distilled = distil(dense, ids, _params(dense), DistilSettings(**{**SMALL.__dict__, "steps": 4}))
    refine = DistilSettings(**{**SMALL.__dict__, "steps": 4, "batch": 1, "general": 1, "anneal": 0.0, "seed": 1})

    class Tok:  # the document separator is token 0 in this vocabulary
        @staticmethod
        def convert_tokens_to_ids(token):
            return 0

    r1 = stages._refine(dense, Tok(), ids, distilled, refine, 0, 2, tmp_path, "t", None, None)
    r2 = stages._refine(dense, Tok(), ids, r1, refine, 1, 2, tmp_path, "t", None, None)
    s1, s2 = (torch.load(tmp_path / f"teacher-4x32-{seed}.pt", weights_only=True) for seed in (1, 2))
    assert not torch.equal(s1, s2)
    assert torch.equal(s2, teacher_samples(dense, 4, 32, start_id=0, seed=2))
    expect = distil(dense, ids, r1, replace(refine, seed=2), general=s2)
    demo.save_params(expect, tmp_path / "expect.safetensors")
    expect = demo.load_params(tmp_path / "expect.safetensors")
    torch.testing.assert_close(r2.router, expect.router, rtol=0, atol=0)
    for k in expect.lora:
        torch.testing.assert_close(r2.lora[k], expect.lora[k], rtol=0, atol=0)
    assert r2.meta["refine"]["seed"] == 2 and not torch.equal(r2.router, r1.router)

    def no_training(*args, **kwargs):
        raise AssertionError("a kept round was trained again")

    monkeypatch.setattr(stages, "distil", no_training)
    again = stages._refine(dense, Tok(), ids, r1, refine, 1, 2, tmp_path, "t", None, None)
    torch.testing.assert_close(again.router, r2.router, rtol=0, atol=0)


@torch.no_grad()
def test_router_stats_read_peaked_and_flat_routers():
    dense = _dense()
    p = _params(dense)
    flat = demo.convert(dense, ConversionParams(SHARED, E, K, p.perm, p.router * 1e-4, {}, {}))
    peaked = demo.convert(dense, ConversionParams(SHARED, E, K, p.perm, p.router * 3.0, {}, {}))
    x = _ids(64)[None]
    for layer in router_stats(flat, x):
        assert layer["top1"] / layer["next"] < 1.01
        assert math.isclose(layer["top_quarter_weight"], 1 / K, rel_tol=1e-2)
    for layer in router_stats(peaked, x):
        assert layer["top1"] / layer["next"] > 3.0
        assert layer["top_quarter_weight"] > 1 / K
        assert 0.25 <= layer["top25_experts"] <= 1.0


def test_fit_stage_files_depend_on_the_training_text_and_settings():
    """A refit after the training text changed (e.g. a domain added) must not resume another text's
    checkpoint: the stages' file tag changes with the text and with the settings."""
    base = stages.stage_tag(FitSettings(), "some text")
    assert stages.stage_tag(FitSettings(), "some text") == base
    assert stages.stage_tag(FitSettings(), "some text, and more") != base
    assert stages.stage_tag(FitSettings(top_k=4), "some text") != base


def test_clustering_and_validation_rows_span_every_part_of_the_training_windows():
    """Training windows come one domain after another; the rows the clustering reads are whole
    windows spread from the first to the last, not the first domain's."""
    rows = spread_rows(64 * 8, 4 * 8, 8)  # 64 windows of 8 tokens, 4 windows' worth wanted
    assert rows.numel() == 32 and rows.unique().numel() == 32
    windows = (rows // 8).unique().tolist()
    assert windows[0] == 0 and windows[-1] == 63 and len(windows) == 4
    assert all((rows.view(4, 8) % 8 == torch.arange(8)).all(1))  # whole windows, in order
    assert spread_rows(3 * 8, 100, 8).numel() == 24  # more wanted than there is: every window once


@torch.no_grad()
def test_calibration_flattens_the_routers_only_as_far_as_the_gate_ratio_allows():
    """Stage 4: t goes down from 1 until the ratio falls under the floor; the kept t is the allowed
    one with the lowest perplexity on the windows, measured the same way here independently."""
    dense = _dense()
    p = _params(dense)
    peaked = ConversionParams(SHARED, E, K, p.perm, p.router * 3.0, {}, {})
    windows = _ids(6 * 32).view(6, 32)
    start = gate_ratio(router_stats(demo.convert(dense, peaked), windows))
    floor = start * 0.6
    out, tried = calibrate(dense, windows, peaked, demo.convert, min_ratio=floor, step=0.1, batch=4)
    assert tried[0]["t"] == 1.0 and math.isclose(tried[0]["ratio"], start, rel_tol=1e-5)
    assert all(r["ratio"] >= floor for r in tried[:-1]) and tried[-1]["ratio"] < floor
    assert [r["ratio"] for r in tried] == sorted((r["ratio"] for r in tried), reverse=True)  # flatter each step
    allowed = [r for r in tried if r["ratio"] >= floor]
    best = min(allowed, key=lambda r: r["ppl"])
    assert out.meta["calibrate"]["t"] == best["t"] < 1.0
    torch.testing.assert_close(out.router, peaked.router * best["t"], rtol=0, atol=0)
    moe = demo.convert(dense, out)
    logits = moe(input_ids=windows).logits[:, :-1]
    ppl = math.exp(torch.nn.functional.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten()).item())
    assert math.isclose(ppl, best["ppl"], rel_tol=1e-4)
    assert gate_ratio(router_stats(moe, windows)) >= floor
    # A floor that even t = 1 misses leaves the routers as they are.
    same, tried = calibrate(dense, windows, peaked, demo.convert, min_ratio=start * 2, step=0.1)
    assert len(tried) == 1 and same.meta["calibrate"]["t"] == 1.0
    torch.testing.assert_close(same.router, peaked.router, rtol=0, atol=0)
