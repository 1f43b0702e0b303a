"""What moetool reads off a transformers model as it runs, across architectures: a MoE layer's
router called outside its block, the tokens already in a KV cache, and the model's context length.

    logits = call_router(lm, layer, hidden)[0]          # cross-layer look-ahead
    past = past_tokens(forward_kwargs)                  # 0: this forward is a prefill
"""

from __future__ import annotations

import copy
import inspect
from functools import lru_cache
from typing import Any

import torch
from torch import nn
from transformers.generation.logits_process import LogitsProcessor

from moetool.checkpoint import text_config
from moetool.errors import MoetoolError, first_line


def call_router(lm: Any, layer: int, hidden: torch.Tensor) -> Any:  # lm: a model.LoadedModel (model imports this module)
    """MoE layer `layer`'s router on `hidden` [T, H] outside its block's forward (cross-layer
    look-ahead, routing profiles): what the router returns, or None where it cannot run alone.

    A router that takes more than the hidden states gets what its block would pass, by name: each
    further parameter of its class's forward that names an attribute of the block gets that
    attribute (MiniMax-M2's `e_score_correction_bias`, LFM2-MoE's `expert_bias`); the others keep
    their defaults (ZAYA's `router_states`, carried from the layer before, is then left out: the
    prediction is the router's own without it). None when a required one names no attribute. A
    router that reads the hidden states as [B, T, H] (ZAYA's) gets them so: each router class is
    tried flat first, once, and the form that worked is kept; one that fails both ways gives None."""
    g = lm.geometry.layer(layer)
    block = lm.model.get_submodule(g.path)
    router = block.get_submodule(g.router)
    params = _router_extra_args(type(router))
    if params is None or any(required and not hasattr(block, name) for name, required in params):
        return None
    param = next(router.parameters(), None)
    if param is not None:
        hidden = hidden.to(param.device, param.dtype)
    extra = {name: getattr(block, name) for name, _ in params if hasattr(block, name)}
    form = router_form(router, extra, hidden)
    return router(hidden[None] if form == "batched" else hidden, **extra) if form != "none" else None


_ROUTER_FORM: dict[type, str] = {}  # router class -> "flat" [T, H], "batched" [1, T, H] or "none"


def router_form(router: nn.Module, extra: dict[str, Any], probe: torch.Tensor) -> str:
    """How `router`'s class reads hidden states: "flat" [T, H], "batched" [1, T, H], or "none" (it
    runs neither way). Found once per class by running its own forward (not an engine's wrapper
    around it) on `probe` [T, H] flat, then batched; kept for every later call, and for the captured
    step, which cannot try and catch inside its traced code."""
    form = _ROUTER_FORM.get(type(router))
    if form is not None:
        return form
    form = "none"
    with torch.no_grad():
        for name, x in (("flat", probe), ("batched", probe[None])):
            try:
                type(router).forward(router, x, **extra)
            except (RuntimeError, IndexError, ValueError):  # a shape this router does not take
                continue
            form = name
            break
    _ROUTER_FORM[type(router)] = form
    return form


def router_logits(output: Any, num_experts: int) -> torch.Tensor:
    """The expert logits [T, E] in a router's output (its first element when a tuple). A router may
    score classes that are not experts (ZAYA's skip expert, after the E real ones): only the
    experts' columns are kept, so every policy reads one score per expert."""
    logits = output[0] if isinstance(output, tuple) else output
    return logits.reshape(-1, logits.shape[-1])[:, :num_experts]


@lru_cache(maxsize=None)
def _router_extra_args(cls: type) -> tuple[tuple[str, bool], ...] | None:
    """(name, required) of a router class's forward parameters after the hidden states; None when
    its signature cannot be read or one of them cannot be passed by name."""
    try:
        params = list(inspect.signature(cls.forward).parameters.values())[2:]  # after self, hidden_states
    except (TypeError, ValueError):
        return None
    named = [p for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if any(p.kind == p.POSITIONAL_ONLY for p in named):
        return None
    return tuple((p.name, p.default is inspect.Parameter.empty) for p in named)


def vocab_size(model: nn.Module) -> int:
    """The rows of the model's embedding: the ids a tokenizer may give it."""
    return text_config(model.config).vocab_size


def context_length(model: nn.Module) -> int | None:
    """The longest sequence the model was built for (its config's max_position_embeddings), or None.
    Dynamic NTK rope scaling reads max_position_embeddings as the length it starts rescaling at
    (transformers' `original_max_seq_len`), and exists to go past it: its context is that times its
    factor (the other rope types give the extended length as max_position_embeddings already)."""
    config = text_config(model.config)
    n = getattr(config, "max_position_embeddings", None)
    if not (isinstance(n, int) and n > 0):
        return None
    factor = _dynamic_factor(config)
    return int(n * factor) if factor else n


def context_words(model: nn.Module) -> str:
    """Where `context_length` comes from, for a sentence that refuses a longer sequence."""
    if _dynamic_factor(text_config(model.config)):
        return "max_position_embeddings times its dynamic rope factor, in its config.json"
    return "max_position_embeddings in its config.json"


def _dynamic_factor(config: Any) -> float | None:
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) == "dynamic":
        factor = rope.get("factor")
        if isinstance(factor, (int, float)) and not isinstance(factor, bool) and factor > 1:
            return float(factor)
    return None


def with_cache(model: nn.Module, cache: Any) -> dict[str, Any]:
    """The keyword that hands `model` its KV cache: `cache` from transformers 5.24 (which warns on the
    old name, and will drop it), `past_key_values` before."""
    return {_cache_keyword(type(model)): cache}


@lru_cache(maxsize=None)
def _cache_keyword(cls: type) -> str:  # read once per model class, not at every decode step
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


def past_tokens(kwargs: dict) -> int:
    """Tokens already in the KV cache, from a model forward's keyword arguments (0: a prefill)."""
    # transformers >= 5.24 passes the KV cache as `cache`; earlier releases (and callers that still
    # pass it by its old name) as `past_key_values`.
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if cache is not None:
        try:
            return int(cache.get_seq_length())
        except ValueError:  # a cache of linear-attention / SSM layers only has no sequence length
            pass
    # No cache under a name we know, or no length in it: the first position says prefill (0) or
    # decode; without positions, a linear-attention cache that holds a state says decode.
    pos = kwargs.get("cache_position", kwargs.get("position_ids"))
    if isinstance(pos, torch.Tensor) and pos.numel():
        return int(pos.reshape(-1)[0]) if pos.dim() == 1 else int(pos[..., 0].min())
    layers = getattr(cache, "layers", ())
    return int(any(any(getattr(layer, "has_previous_state", {}).values()) for layer in layers))


def real_rows(attention_mask: Any, ids: Any) -> torch.Tensor | None:
    """[B*T] bool on the host: which rows of a prefill's B x T tokens are real (a batch's prompts are
    left-padded to one length, the pads masked out), in the order an MoE layer sees its hidden rows;
    None when every row is real or no 2-D mask says otherwise (one small read, in prefill only)."""
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2 or not isinstance(ids, torch.Tensor) \
            or ids.dim() != 2 or attention_mask.shape[0] != ids.shape[0] or attention_mask.shape[1] < ids.shape[1]:
        return None
    real = attention_mask[:, -ids.shape[1]:].reshape(-1).bool().cpu()
    return None if bool(real.all()) else real


def not_finite(logits: torch.Tensor) -> torch.Tensor:
    """Whether `logits` hold a NaN or a +inf, as a 0-dim bool on their device (no host read). -inf is a
    logit a model or a logits processor may mean (a masked token); NaN and +inf leave the argmax
    meaningless: the greedy token is then whatever index the kernel happens to return."""
    return logits.isnan().any() | logits.isposinf().any()


def nonfinite_sentence(where: str, model: str, what: str = "logits") -> str:
    """The one sentence for a model that computed NaN or infinite `what` `where` (e.g. "for prompt 2 of 3")."""
    return (f"the model computed NaN or infinite {what} {where}, so its results are meaningless and nothing was "
            f"written; if `moetool check {model}` fails too, its config.json (e.g. rms_norm_eps) or its weights are "
            "at fault, else the precision this run gave its experts or the compute --dtype overflows.")


class NonFiniteRows(LogitsProcessor):
    """Marks, on the device, each row of a batch whose logits at some step hold a NaN or +inf (`not_finite`
    by row); it changes no score and reads nothing back during generate."""

    def __init__(self, rows: int, device: Any):
        self.rows = torch.zeros(rows, dtype=torch.bool, device=device)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.rows.logical_or_(scores.isnan().any(-1) | scores.isposinf().any(-1))
        return scores


# Config fields a router reads that a config.json can set so that transformers' own router cannot run
# (DeepSeek-V3's group top-2 over groups of one expert), named in the refusal with their values.
_ROUTING_FIELDS = ("num_experts_per_tok", "num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts",
                   "n_group", "topk_group", "routed_scaling_factor", "topk_method", "scoring_func")


def refuse_unroutable(model: nn.Module, layers: Any, source: str) -> None:
    """Refuse a config whose MoE routers plain transformers cannot run, before any weight is read.

    A config.json that builds (its values pass transformers' checks) may still give a router that
    fails on every input: DeepSeek-V3's group routing takes the top 2 scores of each group, so groups
    of one expert (n_routed_experts = n_group) raise in `topk`. Found late, that is transformers'
    traceback after the model has loaded (or, in a sweep, a failed cell per policy). Each distinct
    router of `model` (a skeleton on the meta device is enough: `layers` are its geometry's) is
    copied to the CPU with random weights and run on two random tokens, flat then batched, as
    `router_form` tries it; one that runs neither way is refused with its own error. A router that
    cannot be called alone (`call_router` gives None) is not tried."""
    from transformers import __version__

    tried: set[tuple] = set()
    for g in layers:
        block = model.get_submodule(g.path)
        router = getattr(block, g.router, None) if g.router else None
        params = _router_extra_args(type(router)) if isinstance(router, nn.Module) else None
        if params is None or any(required and not hasattr(block, name) for name, required in params):
            continue
        key = (type(router), *((n, tuple(t.shape)) for n, t in router.state_dict().items()))
        if key in tried:
            continue
        tried.add(key)
        probe = _materialized(router)
        extra = {name: _materialized(getattr(block, name)) for name, _ in params if hasattr(block, name)}
        dtype = next((p.dtype for p in probe.parameters() if p.is_floating_point()), torch.float32)
        hidden = torch.randn(2, g.hidden_size, generator=torch.Generator().manual_seed(0)).to(dtype)
        errors = []
        with torch.no_grad():
            for x in (hidden, hidden[None]):
                try:
                    _refuse_other_width(type(probe).forward(probe, x, **extra), g, type(router).__name__, source)
                    break
                except MoetoolError:
                    raise
                except Exception as e:  # noqa: BLE001 - transformers' router on the config's values: any failure
                    errors.append(e)
            else:
                text = text_config(model.config)
                fields = ", ".join(f"{n}={getattr(text, n)!r}" for n in _ROUTING_FIELDS
                                   if getattr(text, n, None) is not None)
                raise MoetoolError(f"plain transformers {__version__} cannot route tokens with the config of '{source}': "
                                   f"the router of MoE layer {g.index} ({type(router).__name__}) raises "
                                   f"{type(errors[0]).__name__}: {first_line(errors[0])} on two random tokens; check "
                                   f"config.json's routing fields ({fields}).")


def _refuse_other_width(output: Any, g: Any, router: str, source: str) -> None:
    """Refuse a router that routes a token to more or fewer experts than the top-k moetool read (its
    attribute or the config's): PhiMoE's sparsemixer always chooses 2 whatever `num_experts_per_tok`
    says, and every plan, record and budget would be sized for the config's count."""
    found = [t for t in (output if isinstance(output, tuple) else (output,)) if isinstance(t, torch.Tensor)
             and not t.is_floating_point() and t.dtype != torch.bool and t.dim() >= 2 and t.shape[-2] == 2]
    if found and found[-1].shape[-1] != g.top_k:
        raise MoetoolError(f"the router of MoE layer {g.index} of '{source}' ({router}) routes each token to "
                           f"{found[-1].shape[-1]} experts, and its top-k (the router's or config.json's, e.g. "
                           f"num_experts_per_tok) says {g.top_k}; moetool sizes plans and budgets by the top-k, so "
                           f"set it to {found[-1].shape[-1]}.")


def _materialized(value: Any) -> Any:
    """`value` (a module or a tensor, on the meta device or not) as a CPU copy filled with random
    numbers; anything else as it is."""
    gen = torch.Generator().manual_seed(0)

    def fill(t: torch.Tensor) -> torch.Tensor:
        out = torch.empty(t.shape, dtype=t.dtype)
        if out.is_floating_point():
            return out.copy_(torch.randn(t.shape, generator=gen) * 0.02)
        return out.zero_()

    if isinstance(value, torch.Tensor):
        return fill(value)
    if not isinstance(value, nn.Module):
        return value
    module = copy.deepcopy(value).to_empty(device="cpu")
    with torch.no_grad():
        for t in (*module.parameters(), *module.buffers()):
            t.copy_(fill(t))
    return module
