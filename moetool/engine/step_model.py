"""What the captured decode step needs of a model: the architectures whose step is checked against
transformers' own tokens, the greedy rule of its generation config, and its static cache made to
hold no position in a Python number (`engine/decode.py` builds the step over these).

    reason = architecture_refusal(model_type, unverified_ok=False)   # None: the step may run
    suppressed = greedy_rule(model)          # ids never picked, or why the step cannot decode as generate
    whole_windows(cache, max_tokens)         # sliding-window layers kept whole
"""

from __future__ import annotations

from typing import Any

import torch


# Model types whose captured step decodes plain transformers' greedy tokens, each checked on a tiny
# random checkpoint by tests/test_captured.py::test_every_architecture_decodes_transformers_tokens_or_falls_back
# (transformers 5.24). The step runs the model's own attention over transformers' StaticCache, and
# a static cache is not the dynamic one for every architecture: `auto` takes the captured step only
# for these; `--decode captured` runs another (a newer transformers' model) and says it is unchecked.
VERIFIED_MODEL_TYPES = frozenset({
    "afmoe", "aria_text", "axk1", "axk2", "bailing_hybrid", "beam", "cohere2_moe", "deepseek_v2", "deepseek_v3",
    "deepseek_v32", "dots1", "ernie4_5_moe", "exaone_moe", "flex_olmo", "flint", "gemma4_text", "glm4_moe",
    "glm4_moe_lite", "gpt_oss", "granitemoe", "granitemoe_swa", "granitemoehybrid",
    "granitemoeshared", "hunyuan_v1_moe", "hy_v3", "hy_v4", "inkling2_loop_text", "inkling2_text", "inkling_text",
    "jamba", "kimi_linear", "kolibri1", "laguna", "lara_mini", "lfm2_moe", "mellum", "mimo_v2_flash", "minimax_m2",
    "minimax_m3_vl_text", "mistral4", "mixtral", "nemotron_h", "olmoe", "phimoe", "qwen2_moe", "qwen3_5_moe_text",
    "qwen3_moe", "qwen3_next", "solar_open", "zaya",
    "gemma4",  # the Gemma 4 release (vision-language), which transformers runs as its own class
})

# Model types whose step compiles but whose tokens over a StaticCache are not transformers' own
# (over its default dynamic cache): refused even when asked for. Both select keys with a
# sparse-attention indexer, and plain transformers' `generate(cache_implementation="static")`
# parts from its default the same way a few tokens in, on a tiny checkpoint (tests/test_captured.py
# checks that each still differs; why is transformers' to say). deepseek_v32, whose indexer code
# reads the same, decodes the same tokens over both.
_STATIC_DIFFERS = ("plain transformers decodes other tokens over its StaticCache than over its default cache for "
                   "{} (its sparse-attention indexer), so the captured step would too")
DIFFERENT_MODEL_TYPES = {t: _STATIC_DIFFERS.format(t) for t in ("dots3_note_text", "glm_moe_dsa")}


def architecture_refusal(model_type: str, unverified_ok: bool) -> str | None:
    """Why the captured step does not run a model of `model_type`, or None: one whose static cache is
    known to decode other tokens, or (unless `unverified_ok`) one not checked (`VERIFIED_MODEL_TYPES`)."""
    if model_type in DIFFERENT_MODEL_TYPES:
        return DIFFERENT_MODEL_TYPES[model_type]
    if model_type not in VERIFIED_MODEL_TYPES and not unverified_ok:
        return (f"the captured step's tokens are not checked against transformers' for model type "
                f"'{model_type or 'unknown'}' (--decode captured runs it anyway)")
    return None


# What `generate` applies before its greedy argmax that the captured step reproduces: a run decodes
# all of --max-new-tokens (min_new_tokens), so end-of-sequence ids are never picked (MinNewTokens),
# which covers any min_length too. Any other processor (a checkpoint's repetition_penalty,
# suppress_tokens, ...) is the host path's alone.
_EOS_PROCESSORS = ("MinNewTokensLengthLogitsProcessor", "MinLengthLogitsProcessor")


def whole_windows(cache: Any, max_tokens: int) -> None:
    """Replace `cache`'s sliding-window layers by full static layers of `max_tokens`, in place.

    transformers' static sliding-window layer (5.24) keeps how far it has filled as a Python int: its
    attention mask's offset and length, and whether it rolls, are read from it. A compiled step takes
    that int as a constant, so one captured program would attend every later token as at the position
    it was captured at (on a CPU, it compiles again at every token). A full static layer holds every
    position in tensors; the model's sliding-window mask, built from the token's position, hides the
    keys past the window as the sliding layer would. The budget already plans the KV cache of every
    layer at the run's length (`budget.kv_margin`). A sliding layer of another kind stays, and the
    recompile check in `_build` sends it to the host path."""
    from transformers.cache_utils import (LinearAttentionAndStaticFullAttentionLayer,
                                          LinearAttentionAndStaticSlidingWindowAttentionLayer, StaticLayer,
                                          StaticSlidingWindowLayer)

    for i, layer in enumerate(cache.layers):
        if type(layer) is StaticSlidingWindowLayer:
            cache.layers[i] = StaticLayer(max_cache_len=max_tokens)
        elif type(layer) is LinearAttentionAndStaticSlidingWindowAttentionLayer:
            cache.layers[i] = LinearAttentionAndStaticFullAttentionLayer(
                max_cache_len=max_tokens, number_of_states=getattr(layer, "number_of_states", 1))


def greedy_rule(model: Any) -> list[int] | str:
    """The token ids the captured step must never pick, as the host path's greedy `generate(...,
    min_new_tokens=max_new_tokens)` with the checkpoint's generation config never does, or why the
    step cannot decode as it does (a logits processor it does not apply). Read from transformers'
    own preparation of that call, so the same config gives the same rule."""
    try:
        config, _ = model._prepare_generation_config(None, do_sample=False, max_new_tokens=2, min_new_tokens=2)
        model._prepare_special_tokens(config, True, device=torch.device("cpu"))
        processors = model._get_logits_processor(config, input_ids_seq_length=1, device="cpu", model_kwargs={})
    except Exception as e:  # noqa: BLE001 - a generation config transformers cannot prepare is the host path's
        return f"transformers cannot prepare greedy decoding for this model ({type(e).__name__}: {str(e)[:160]})"
    head = getattr(model.get_output_embeddings(), "weight", None)
    vocab = int(head.shape[0]) if isinstance(head, torch.Tensor) else None  # the logits' width
    suppressed: set[int] = set()
    for proc in processors:
        name = type(proc).__name__
        if name not in _EOS_PROCESSORS:
            return (f"the model's generation config turns on {name}, which the captured step does not apply "
                    "(the host path's generate does)")
        ids = torch.as_tensor(proc.eos_token_id).reshape(-1).tolist()
        suppressed.update(int(i) for i in ids if i >= 0 and (vocab is None or i < vocab))  # generate ignores the rest
    return sorted(suppressed)


__all__ = ["DIFFERENT_MODEL_TYPES", "VERIFIED_MODEL_TYPES", "architecture_refusal", "greedy_rule", "whole_windows"]
