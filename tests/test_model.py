"""The model layer: bit-exact expert replacement on real architectures loaded from disk."""

import pytest
import torch

from helpers import ARCHS, save_char_tokenizer
from tiny import MORE_CONFIGS, RELEASES, save_tiny, save_tiny_release
from moetool.check import check_model
from moetool.errors import MoetoolError
from moetool.model import find_experts_modules, load_model, load_reference


@pytest.mark.parametrize("arch", ARCHS)
def test_check_is_exact_on_every_architecture(tiny_ckpt, arch):
    report = check_model(tiny_ckpt(arch))
    assert report.passed, report
    assert report.max_abs_diff <= 1e-5
    assert report.layers and all(lc.routing_agreement == 1.0 for lc in report.layers)


@pytest.mark.parametrize("arch", ["qwen2_moe", "gpt_oss", "deepseek_v3"])
def test_experts_are_not_model_parameters_after_load(tiny_ckpt, arch):
    ref = load_reference(tiny_ckpt(arch))
    expert_bytes = sum(p.numel() * p.element_size() for m in find_experts_modules(ref).values()
                       for p in m.parameters(recurse=False))
    total = sum(p.numel() * p.element_size() for p in ref.parameters())
    lm = load_model(tiny_ckpt(arch))
    assert expert_bytes > 0
    assert lm.non_expert_bytes() == total - expert_bytes  # the device side holds no expert byte
    assert lm.experts.nbytes == expert_bytes  # ... and host memory holds each expert once
    assert not any("experts." in n and "shared" not in n for n, _ in lm.model.named_parameters())


@pytest.mark.parametrize("arch", ["mixtral", "gpt_oss"])
def test_host_experts_match_checkpoint_weights_in_canonical_layout(tiny_ckpt, arch):
    ref = load_reference(tiny_ckpt(arch))
    lm = load_model(tiny_ckpt(arch))
    g = lm.geometry.layers[-1]
    fused = ref.get_submodule(f"{g.path}.experts")
    w = lm.experts.get(g.index, 2)
    want_gate_up = fused.gate_up_proj[2].t() if g.transposed else fused.gate_up_proj[2]
    assert w.gate_up.shape == (2 * g.intermediate_size, g.hidden_size)
    assert w.down.shape == (g.hidden_size, g.intermediate_size)
    torch.testing.assert_close(w.gate_up, want_gate_up, rtol=0, atol=0)
    if g.has_bias:
        torch.testing.assert_close(w.down_bias, fused.down_proj_bias[2], rtol=0, atol=0)


def test_geometry_describes_shared_experts_dense_layers_and_layouts(tiny_ckpt):
    qwen = load_model(tiny_ckpt("qwen2_moe")).geometry
    assert [g.index for g in qwen.layers] == [0, 1] and qwen.dense_layers == ()
    assert qwen.layers[0].shared_experts == ("shared_expert", "shared_expert_gate")
    assert (qwen.layers[0].num_experts, qwen.layers[0].top_k, qwen.layers[0].intermediate_size) == (4, 2, 16)
    ds = load_model(tiny_ckpt("deepseek_v3")).geometry
    assert ds.dense_layers == (0,) and [g.index for g in ds.layers] == [1, 2]
    oss = load_model(tiny_ckpt("gpt_oss")).geometry.layers[0]
    assert oss.transposed and oss.has_bias and not oss.concatenated and oss.router == "router"


def test_a_wrong_expert_is_detected(tiny_ckpt):
    """The check is not vacuous: swapping two experts' weights breaks it."""
    lm = load_model(tiny_ckpt("mixtral"))
    g = lm.geometry.layers[0]
    fused = lm.experts.layer(g.index)["gate_up_proj"]  # the streamed layer stays cached
    fused[[0, 1]] = fused[[1, 0]].clone()
    ref = load_reference(tiny_ckpt("mixtral"))
    ids = torch.arange(1, 20)[None]
    with torch.no_grad():
        assert (ref(ids).logits - lm.model(ids).logits).abs().max() > 1e-3


def test_missing_path_is_one_sentence(tmp_path):
    with pytest.raises(MoetoolError, match="does not exist"):
        load_model(tmp_path / "nowhere")


def test_past_tokens_reads_a_cache_of_linear_attention_layers_only():
    """transformers' cache has no sequence length without a softmax-attention layer: the state the
    linear layers hold (or the positions, where given) says prefill or decode instead."""
    from transformers import DynamicCache

    from moetool.inference import past_tokens
    from tiny import tiny_config

    cache = DynamicCache(config=tiny_config("qwen3_next", layer_types=["linear_attention"] * 2))
    with pytest.raises(ValueError):
        cache.get_seq_length()  # what past_tokens works around
    assert past_tokens({"past_key_values": cache}) == 0
    cache.layers[0].update_conv_state(torch.zeros(1, 4, 3))  # a prefill went through
    assert past_tokens({"past_key_values": cache}) == 1
    assert past_tokens({"past_key_values": cache, "position_ids": torch.tensor([[7]])}) == 7
    mixed = DynamicCache(config=tiny_config("qwen3_next"))
    mixed.layers[1].update(torch.zeros(1, 2, 5, 8), torch.zeros(1, 2, 5, 8))
    assert past_tokens({"cache": mixed}) == 5


@pytest.mark.parametrize("arch", sorted(MORE_CONFIGS))
def test_check_is_exact_on_the_other_fused_experts_architectures(tmp_path, arch):
    """Every other fused-experts causal LM transformers ships: found, its top-k read (from the router,
    the block or the config's own key), and its experts replaced bit for bit."""
    report = check_model(save_tiny(arch, tmp_path / arch))
    assert report.passed, report
    assert report.max_abs_diff <= 1e-5
    assert report.layers and all(lc.routing_agreement == 1.0 for lc in report.layers)
    cfg = MORE_CONFIGS[arch]
    top_k = next(cfg[k] for k in ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k", "top_k_experts")
                 if k in cfg)
    assert {layer.top_k for layer in load_model(tmp_path / arch).geometry.layers} == {top_k}


def test_a_fused_experts_architecture_configured_without_a_moe_layer_says_so(tmp_path):
    # beam's default mlp_layer_types make its first three layers dense: two layers build no MoE block.
    with pytest.raises(MoetoolError, match="builds no Mixture-of-Experts layer"):
        load_model(save_tiny("beam", tmp_path / "beam", mlp_layer_types=None))
    # The sentence names the fields of the config at hand (it had named other architectures' fields).
    with pytest.raises(MoetoolError, match=r"under its mlp_only_layers=\[\], decoder_sparse_step=3, num_experts=4\)") as e:
        load_model(save_tiny("qwen2_moe", tmp_path / "q", decoder_sparse_step=3))
    assert "first_k_dense_replace" not in str(e.value)


def test_an_experts_module_that_normalises_each_experts_output_is_refused(tmp_path):
    """transformers' `has_post_expert_norm` (muse_spark) puts each expert's output through a norm before
    its routing weight; moetool's experts compute up -> down only, so such a model is refused, not run."""
    from transformers import AutoModelForCausalLM

    from moetool.model import inspect_geometry
    from tiny import tiny_config

    model = AutoModelForCausalLM.from_config(tiny_config("qwen2_moe"))
    assert inspect_geometry(model).layers  # the plain module is taken
    next(iter(find_experts_modules(model).values())).has_post_expert_norm = True
    with pytest.raises(MoetoolError, match="post_expert_norm"):
        inspect_geometry(model)


def test_a_causal_lm_outside_transformers_auto_mapping_runs_and_one_without_a_class_is_refused(tmp_path):
    """transformers 5.24 ships Mistral4ForCausalLM but maps no auto class to it: moetool finds it in the
    config's own model module (check above is exact on it). A model type with no causal-LM class at
    all (a vision-language MoE, a diffusion LM) is refused by name before any weight is read."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from moetool.checkpoint import causal_lm_class
    from tiny import tiny_config

    config = tiny_config("mistral4")
    assert type(config) not in AutoModelForCausalLM._model_mapping
    assert causal_lm_class(config).__name__ == "Mistral4ForCausalLM"
    for model_type, why in (("qwen3_vl_moe", r"a model of several parts \(text_config among them\) whose text transformers loads as no causal LM"),
                            ("openai_privacy_filter", "transformers has no causal-LM class for it"),
                            ("aria", r"transformers loads this release of several parts as no causal LM, though its "
                                     r"text model \('aria_text'\) is one: save that alone")):
        AutoConfig.for_model(model_type).save_pretrained(tmp_path / model_type)
        with pytest.raises(MoetoolError, match=f"'{model_type}' architecture: {why}"):
            load_model(tmp_path / model_type)
    # Llama 4 as released: transformers maps its bare model to the release's class, which has a head; it
    # was refused as "the bare model, without a language-model head" for a causal-LM checkpoint that
    # does not exist, where the reason is its experts
    AutoConfig.for_model("llama4", architectures=["Llama4ForConditionalGeneration"]).save_pretrained(tmp_path / "l4")
    with pytest.raises(MoetoolError, match="'llama4_text' architecture: its experts are not a fused"):
        load_model(tmp_path / "l4")


@pytest.mark.parametrize("arch", sorted(RELEASES))
def test_a_vision_language_release_runs_as_the_causal_lm_transformers_makes_of_it(tmp_path, arch):
    """Qwen3.5-MoE is released as `Qwen3_5MoeForConditionalGeneration`, text weights under
    `model.language_model`; AutoModelForCausalLM loads its text decoder (its text config) or, for
    Gemma 4, the release's own class (a config whose sizes are in its text_config). Both run through
    check, quantize and a run, with the tokens of the release's own greedy generate."""
    from moetool.quant.quantize import QuantizeConfig, quantize
    from moetool.run import RunConfig, run

    release = save_tiny_release(arch, tmp_path / arch)
    save_char_tokenizer(tmp_path / arch)
    report = check_model(tmp_path / arch)
    assert report.passed and report.max_abs_diff <= 1e-5, report
    prompt = "The king said"
    ids = load_model(tmp_path / arch).tokenizer(prompt, return_tensors="pt").input_ids
    want = release.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, min_new_tokens=6,
                            do_sample=False)[0, ids.shape[1]:].tolist()
    quantize(QuantizeConfig(model=str(tmp_path / arch), out=tmp_path / "bundle", bits=(16, 4), group_size=16,
                            dtype="float32", hqq_optimize=False))
    for source in (dict(model=str(tmp_path / arch)), dict(bundle=tmp_path / "bundle")):
        got = run(RunConfig(**source, policy="lru", settings={"bits": "16"}, budget="50%", clock="sim",
                            prompts=(prompt,), max_new_tokens=6))
        assert got.tokens[0] == want, source
