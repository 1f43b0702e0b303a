"""Tiny random checkpoints of real transformers MoE architectures, saved to disk like a real one."""

from __future__ import annotations

from pathlib import Path

import torch

_COMMON = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               vocab_size=128, max_position_embeddings=128, tie_word_embeddings=False)
_DEEPSEEK = dict(n_routed_experts=4, moe_intermediate_size=16, intermediate_size=48, n_shared_experts=1,
                 first_k_dense_replace=1, num_hidden_layers=3, kv_lora_rank=16, q_lora_rank=None,
                 qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, head_dim=8, n_group=1, topk_group=1,
                 num_key_value_heads=4,
                 num_experts_per_tok=2)

TINY_CONFIGS: dict[str, dict] = {
    "mixtral": dict(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, head_dim=8),
    "qwen2_moe": dict(intermediate_size=64, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                      shared_expert_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[]),
    "qwen3_moe": dict(intermediate_size=64, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                      head_dim=8, decoder_sparse_step=1, mlp_only_layers=[]),
    "olmoe": dict(intermediate_size=16, num_experts=4, num_experts_per_tok=2),
    "deepseek_v2": dict(_DEEPSEEK),
    "deepseek_v3": dict(_DEEPSEEK),
    "phimoe": dict(intermediate_size=16, num_local_experts=4, num_experts_per_tok=2),
    "granitemoe": dict(intermediate_size=16, num_local_experts=4, num_experts_per_tok=2),
    "gpt_oss": dict(intermediate_size=16, num_local_experts=4, num_experts_per_tok=2, head_dim=8,
                    layer_types=["sliding_attention", "full_attention"], sliding_window=16),
    # Its router takes the block's `e_score_correction_bias` besides the hidden states (sigmoid scores).
    "minimax_m2": dict(intermediate_size=16, num_local_experts=4, num_experts_per_tok=2, head_dim=8),
    # A hybrid of short convolutions and attention; the block passes its `expert_bias` to the router
    # (an optional parameter there), and layer 0 is dense.
    "lfm2_moe": dict(intermediate_size=32, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                     num_dense_layers=1, num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"]),
    # A hybrid: a linear-attention (gated DeltaNet) layer before a softmax one, each with a MoE block.
    "qwen3_next": dict(intermediate_size=64, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                       shared_expert_intermediate_size=32, head_dim=8, layer_types=["linear_attention", "full_attention"],
                       linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8),
}


# The other fused-experts causal LMs of transformers 5.24, each checked exact by `moetool check` in
# tests/test_model.py (the engine's own tests use TINY_CONFIGS). Hybrids name an attention layer among
# their two (their defaults make both linear, which plain transformers cannot cache); MLA models keep
# as many KV heads as query heads; gemma4_text keeps top-k only in `top_k_experts` and mixes head sizes.
MORE_CONFIGS: dict[str, dict] = {
    "afmoe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, intermediate_size=64, head_dim=8, num_shared_experts=1, num_dense_layers=0, sliding_window=16),
    "aria_text": dict(moe_num_experts=4, moe_topk=2, intermediate_size=64, head_dim=8),
    "axk1": dict(num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, intermediate_size=64, head_dim=8, n_shared_experts=1, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8),
    "axk2": dict(num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, intermediate_size=64, head_dim=8, n_shared_experts=1, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8),
    "bailing_hybrid": dict(num_key_value_heads=4, num_experts=4, moe_intermediate_size=16, intermediate_size=64, head_dim=8, num_shared_experts=1, topk_group=1, first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, pad_token_id=0, num_experts_per_token=2, num_expert_group=1, layer_group_size=2, model_max_length=128),
    "beam": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, intermediate_size=64, head_dim=8, n_group=1, topk_group=1, sliding_window=16, mlp_layer_types=['dense', 'sparse']),
    "cohere2_moe": dict(num_experts=4, num_experts_per_tok=2, intermediate_size=64, head_dim=8, num_shared_experts=1, sliding_window=16),
    "deepseek_v32": dict(num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, intermediate_size=64, head_dim=8, n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, index_head_dim=16, index_n_heads=2, index_topk=8),
    "deepseek_v4": dict(num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, head_dim=8, n_shared_experts=1, q_lora_rank=16, qk_rope_head_dim=8, sliding_window=16, index_head_dim=16, index_n_heads=2, index_topk=8),
    "dots1": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, intermediate_size=64, n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=0, sliding_window=16),
    "dots3_note_text": dict(num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, intermediate_size=64, head_dim=8, n_shared_experts=1, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, sliding_window=16, index_head_dim=16, index_n_heads=2, index_topk=8, pad_token_id=0),
    "ernie4_5_moe": dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=16, intermediate_size=64),
    "exaone_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, intermediate_size=64, num_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=0, sliding_window=16),
    "flex_olmo": dict(num_experts=4, num_experts_per_tok=2, intermediate_size=64, pad_token_id=0),
    "flint": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, intermediate_size=64, head_dim=8, shared_expert_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[], sliding_window=16),
    "gemma4_text": dict(num_experts=4, moe_intermediate_size=16, intermediate_size=32, head_dim=8, sliding_window=16, enable_moe_block=True, top_k_experts=2, global_head_dim=16, hidden_size_per_layer_input=8, vocab_size_per_layer_input=128, layer_types=['sliding_attention', 'full_attention']),
    "glm4_moe": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, intermediate_size=64, n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=0),
    "glm4_moe_lite": dict(num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, intermediate_size=64, n_shared_experts=1, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8),
    "glm_moe_dsa": dict(num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, intermediate_size=64, head_dim=8, n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, index_head_dim=16, index_n_heads=2, index_topk=8),
    "granitemoe_swa": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64, sliding_window=16),
    "granitemoehybrid": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64, mamba_n_heads=4, mamba_d_state=8, mamba_chunk_size=16, layer_types=['linear_attention', 'attention'], shared_intermediate_size=32),
    "granitemoeshared": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64),
    "hunyuan_v1_moe": dict(num_experts=4, moe_topk=2, intermediate_size=64, head_dim=8),
    "hy_v3": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, intermediate_size=64, head_dim=8, num_shared_experts=1),
    "hy_v4": dict(num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, intermediate_size=64, head_dim=8, n_shared_experts=1, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, pad_token_id=0),
    "inkling_text": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, intermediate_size=64, head_dim=8, n_shared_experts=1),
    "inkling2_text": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, head_dim=8, unpadded_vocab_size=128),
    "inkling2_loop_text": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, head_dim=8, unpadded_vocab_size=128),
    "jamba": dict(num_experts=4, num_experts_per_tok=2, intermediate_size=64, expert_layer_period=1, expert_layer_offset=0, attn_layer_period=2, attn_layer_offset=1, mamba_d_state=8, mamba_dt_rank=4),
    "kimi_linear": dict(num_key_value_heads=4, num_experts=4, moe_intermediate_size=16, intermediate_size=64, head_dim=8, num_shared_experts=1, topk_group=1, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, pad_token_id=0, num_experts_per_token=2, num_expert_group=1, layer_types=['linear_attention', 'full_attention'], linear_num_heads=4, linear_head_dim=8),
    "kolibri1": dict(num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, head_dim=8, shared_expert_intermediate_size=32, sliding_window=16),
    "laguna": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, intermediate_size=64, head_dim=8, shared_expert_intermediate_size=32, sliding_window=16),
    "lara_mini": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, head_dim=8, shared_expert_intermediate_size=32, sliding_window=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8),
    "mellum": dict(num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, intermediate_size=64, head_dim=8, sliding_window=16),
    "mimo_v2_flash": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, intermediate_size=64, head_dim=8, n_group=1, topk_group=1, v_head_dim=8, sliding_window=16),
    "minimax": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64, head_dim=8, sliding_window=16),
    "minimax_m3_vl_text": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64, head_dim=8),
    "nemotron_h": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, intermediate_size=64, head_dim=8, n_shared_experts=1, n_group=1, topk_group=1, sliding_window=16),
    "qwen3_5_moe_text": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, head_dim=8, shared_expert_intermediate_size=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, layer_types=['linear_attention', 'full_attention']),
    "qwen4_exp_text": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, head_dim=8, shared_expert_intermediate_size=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, layer_types=['linear_attention', 'indexed_attention'], indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=16, indexer_compress_ratio=4, hc_lowrank=8, ngram_vocab_size_base=1024, split_ngram_parts=4, heads_per_ngram=2),
    "solar_open": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, head_dim=8, n_shared_experts=1, n_group=1, topk_group=1),
    "zaya": dict(num_experts=4, num_experts_per_tok=1, moe_intermediate_size=16, head_dim=8, sliding_window=16),
    # Its head size is qk_nope + qk_rope (the config sets it); its causal-LM class is not in
    # AutoModelForCausalLM's mapping (_CLASSES).
    "mistral4": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, intermediate_size=48,
                     n_shared_experts=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                     v_head_dim=8, num_key_value_heads=4, pad_token_id=0),
}

# Causal LMs transformers ships but does not map its auto class to (by their transformers name).
_CLASSES = {"mistral4": "Mistral4ForCausalLM"}

# Vision-language releases whose model type AutoModelForCausalLM maps to a causal LM, as released
# (`...ForConditionalGeneration`, text weights under `model.language_model`): the tiny text config of
# MORE_CONFIGS, a one-block vision tower where the release has one. Qwen3.5-MoE's maps to its text
# decoder's class, Gemma 4's to the release's own class.
_QWEN_VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=4,
                    spatial_merge_size=1, temporal_patch_size=1)
RELEASES: dict[str, tuple[str, dict]] = {
    "qwen3_5_moe": ("qwen3_5_moe_text", dict(vision_config=_QWEN_VISION)),
    "qwen4_exp": ("qwen4_exp_text", dict(vision_config=_QWEN_VISION)),
    "gemma4": ("gemma4_text", dict(vision_config=None, audio_config=None)),
    # dots.3's towers sit at the top of the release (`vision_encoder`, `audio_encoder`), beside the
    # text model its causal-LM class loads, which does not list them as ignored.
    "dots3_note": ("dots3_note_text", dict(
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                           patch_size=4, moe_intermediate_size=8, spatial_merge_size=1,
                           mlp_layer_types=["dense", "sparse"], num_local_experts=4, num_experts_per_tok=2,
                           adapter_in_dim=16, adapter_out_dim=32, adapter_merge_size=1),
        audio_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                          num_key_value_heads=2, head_dim=8, downsample_hidden_size=8, adapter_input_size=16,
                          adapter_out_dim=32, conv_output_size=64))),
}


def tiny_config(arch: str, **overrides):
    from transformers import AutoConfig

    return AutoConfig.for_model(arch, **{**_COMMON, **TINY_CONFIGS.get(arch, MORE_CONFIGS.get(arch, {})), **overrides})


def save_tiny(arch: str, out: Path, seed: int = 0, dtype: torch.dtype | None = None, **overrides) -> Path:
    """A random-weight checkpoint of `arch`, saved with save_pretrained (safetensors), in `dtype` if given."""
    import transformers

    torch.manual_seed(seed)
    config = tiny_config(arch, **overrides)
    model = (getattr(transformers, _CLASSES[arch])(config) if arch in _CLASSES
             else transformers.AutoModelForCausalLM.from_config(config))
    # Random init leaves routers near-uniform; larger router weights make routing decisive so a
    # wrong expert shows up as a routing disagreement rather than hiding in a near-tie.
    for name, p in model.named_parameters():
        if name.endswith(("gate.weight", "router.weight", "router.layer.weight")) and p.dim() == 2:
            torch.nn.init.normal_(p, std=0.5)
    if dtype is not None:
        model.to(dtype)
    model.save_pretrained(out)
    return out


def save_tiny_release(arch: str, out: Path, seed: int = 0) -> torch.nn.Module:
    """A random-weight vision-language release of `arch` (RELEASES) saved as released; returns the
    release's model (its `generate` is the reference for the text moetool runs)."""
    import importlib

    from transformers import AutoConfig

    text, parts = RELEASES[arch]
    config = AutoConfig.for_model(arch, text_config={**_COMMON, **MORE_CONFIGS[text]}, **parts)
    modeling = importlib.import_module(type(config).__module__.replace(".configuration_", ".modeling_"))
    cls = next(c for name, c in vars(modeling).items() if name.endswith("ForConditionalGeneration"))
    torch.manual_seed(seed)
    model = cls(config)
    for name, p in model.named_parameters():  # decisive routing, as save_tiny
        if name.endswith(("gate.weight", "router.weight")) and p.dim() == 2:
            torch.nn.init.normal_(p, std=0.5)
    model.save_pretrained(out)
    return model.eval()


class DequantProvider:
    """Experts replaced by a bundle's weights dequantized on the host at one precision (a reference
    model for the engine over that bundle: `load_model(path, provider=DequantProvider(opened, 4))`)."""

    def __init__(self, opened, bits: int):
        self.opened, self.bits = opened, bits

    def get(self, layer: int, expert: int):
        return self.opened.dequantize(layer, expert, self.bits, torch.float32)
