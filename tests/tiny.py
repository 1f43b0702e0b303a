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


def tiny_config(arch: str, **overrides):
    from transformers import AutoConfig

    return AutoConfig.for_model(arch, **{**_COMMON, **TINY_CONFIGS[arch], **overrides})


def save_tiny(arch: str, out: Path, seed: int = 0, dtype: torch.dtype | None = None, **overrides) -> Path:
    """A random-weight checkpoint of `arch`, saved with save_pretrained (safetensors), in `dtype` if given."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **overrides))
    # Random init leaves routers near-uniform; larger router weights make routing decisive so a
    # wrong expert shows up as a routing disagreement rather than hiding in a near-tie.
    for name, p in model.named_parameters():
        if name.endswith(("gate.weight", "router.weight", "router.layer.weight")) and p.dim() == 2:
            torch.nn.init.normal_(p, std=0.5)
    if dtype is not None:
        model.to(dtype)
    model.save_pretrained(out)
    return out


class DequantProvider:
    """Experts replaced by a bundle's weights dequantized on the host at one precision (a reference
    model for the engine over that bundle: `load_model(path, provider=DequantProvider(opened, 4))`)."""

    def __init__(self, opened, bits: int):
        self.opened, self.bits = opened, bits

    def get(self, layer: int, expert: int):
        return self.opened.dequantize(layer, expert, self.bits, torch.float32)
