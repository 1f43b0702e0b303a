"""Capture what every profile measurement reads from one forward pass: a `Trace` per step.

Hooks on each MoE layer record the input of its attention (Fate's Attn_in), the input of its router
(Gate_in), the router logits, the routing the experts module receives and, in prefill, the attention
each token receives (DyMoE eq. 1); hooks on every decoder layer record its output (the residual
stream DyMoE Fig. 6 compares). `sequence_traces` runs one prompt as a prefill and then greedy decode
steps with a KV cache, yielding one Trace per forward, so nothing larger than one step is kept.

    tracer = Tracer(lm)
    for trace in tracer.sequence_traces(ids, decode_tokens=8):   # ids [1, T]
        trace.phase, trace.layers[0].top_k.shape                 # "prefill", [T, k]
    tracer.close()
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from moetool.errors import MoetoolError
from moetool.inference import call_router, nonfinite_sentence, not_finite, router_logits, with_cache
from moetool.model import LoadedModel
from moetool.engine.signals import token_importance

PHASES = ("prefill", "decode")


@dataclass
class LayerTrace:
    """One MoE layer in one forward; every tensor on the host, float32, batch flattened."""

    layer: int  # decoder layer index
    attn_in: torch.Tensor  # [T, H] input of the layer's self-attention (after its input norm)
    gate_in: torch.Tensor  # [T, H] input of the router (after the post-attention norm)
    logits: torch.Tensor  # [T, E] router logits
    top_k: torch.Tensor  # [T, k] the routing the experts module received
    importance: torch.Tensor | None = None  # [T] attention received (DyMoE eq. 1), prefill with eager attention


@dataclass
class Trace:
    phase: str  # "prefill" or "decode"
    layers: list[LayerTrace]  # MoE layers, shallow to deep
    hidden: list[torch.Tensor] = field(default_factory=list)  # [T, H] output of every decoder layer


@torch.no_grad()
def route(lm: LoadedModel, layer: int, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer `layer`'s own router on `hidden` [T, H]: (logits [T, E], top-k experts [T, k]).

    The model's router decides the top-k (its own softmax/sigmoid, groups, biases); a router that
    returns only logits gets a plain top-k over them.
    """
    out = call_router(lm, layer, hidden)
    if out is None:
        raise MoetoolError(f"MoE layer {layer}'s router takes inputs its block does not hold under their names, "
                           "so it cannot be replayed on other hidden states")
    logits = router_logits(out, lm.geometry.layer(layer).num_experts)
    if isinstance(out, tuple) and len(out) >= 3:
        top_k = out[2]
    else:
        top_k = torch.topk(logits, lm.geometry.layer(layer).top_k, dim=-1).indices
    return logits.float().cpu(), top_k.long().cpu()


def _first_tensor(args: tuple, kwargs: dict, name: str) -> torch.Tensor:
    return args[0] if args else kwargs[name]


class Tracer:
    """Hooks that record a `Trace` while `recording`; eager attention while it lives (for eq. 1)."""

    def __init__(self, lm: LoadedModel, attention_weights: bool = True):
        self.lm = lm
        self.recording = False
        self._step: dict[str, dict[int, torch.Tensor]] = {}
        self._hidden: dict[int, torch.Tensor] = {}
        self._hooks: list = []
        cfg = lm.model.config
        self._attn_before = getattr(cfg, "_attn_implementation", None)
        # Only the eager kernel returns attention probabilities; sdpa/flash return None for them.
        self.eager = False
        if attention_weights and hasattr(lm.model, "set_attn_implementation"):
            try:
                lm.model.set_attn_implementation("eager")
                self.eager = True
            except (ValueError, NotImplementedError):
                self.eager = False
        self.decoder_layers = self._decoder_layers()
        for g in lm.geometry.layers:
            block = lm.model.get_submodule(g.path)
            parent = lm.model.get_submodule(g.path.rsplit(".", 1)[0])
            attn = getattr(parent, "self_attn", None)
            if attn is not None:
                self._hooks.append(attn.register_forward_pre_hook(self._keep_input("attn_in", g.index),
                                                                  with_kwargs=True))
                self._hooks.append(attn.register_forward_hook(self._keep_importance(g.index)))
            router = block.get_submodule(g.router)
            self._hooks.append(router.register_forward_pre_hook(self._keep_input("gate_in", g.index),
                                                                with_kwargs=True))
            self._hooks.append(router.register_forward_hook(self._keep_logits(g.index)))
            self._hooks.append(block.experts.register_forward_pre_hook(self._keep_routing(g.index),
                                                                       with_kwargs=True))
        for i, layer in enumerate(self.decoder_layers):
            self._hooks.append(layer.register_forward_hook(self._keep_hidden(i)))

    def _decoder_layers(self) -> list[nn.Module]:
        first = self.lm.geometry.layers[0].path  # e.g. model.layers.3.mlp
        head = first.split(".layers.")[0] + ".layers"
        stack = self.lm.model.get_submodule(head)
        return list(stack) if isinstance(stack, nn.ModuleList) else []

    # -- hooks -------------------------------------------------------------------------------------
    def _put(self, kind: str, layer: int, t: torch.Tensor) -> None:
        self._once(kind, layer)
        self._step.setdefault(kind, {})[layer] = t.detach().float().cpu()

    def _once(self, kind: str, layer: int) -> None:
        """A trace holds one routing per layer and forward: a model that runs a MoE layer twice in one
        forward (Inkling2-Loop's looped layers) would keep the last pass alone, and its routing,
        similarity and prefetch recall would describe a model that does not loop."""
        if layer in self._step.get(kind, {}):
            raise MoetoolError(f"the model runs MoE layer {layer} more than once a token (a looped model), and the "
                               "profile's routing, similarity and prefetch parts trace one pass a layer: profile it "
                               "with --what sensitivity,timing.")

    def _keep_input(self, kind: str, layer: int):
        def hook(module, args, kwargs):
            if self.recording:
                x = _first_tensor(args, kwargs, "hidden_states")
                self._put(kind, layer, x.reshape(-1, x.shape[-1]))  # [T, H]
        return hook

    def _keep_importance(self, layer: int):
        def hook(module, args, out):
            w = out[1] if isinstance(out, tuple) and len(out) > 1 else None  # [B, heads, Tq, Tk]
            if self.recording and isinstance(w, torch.Tensor) and w.dim() == 4:
                self._put("importance", layer, token_importance(w))  # [B*Tk] DyMoE eq. 1, as the engine reads it
        return hook

    def _keep_logits(self, layer: int):
        experts = self.lm.geometry.layer(layer).num_experts

        def hook(module, args, output):
            if self.recording:
                self._put("logits", layer, router_logits(output, experts))  # [T, E]
        return hook

    def _keep_routing(self, layer: int):
        def hook(module, args, kwargs):
            if self.recording:
                idx = args[1] if len(args) > 1 else kwargs["top_k_index"]
                self._once("top_k", layer)
                self._step.setdefault("top_k", {})[layer] = idx.detach().long().cpu()  # [T, k]
        return hook

    def _keep_hidden(self, i: int):
        def hook(module, args, output):
            if self.recording:
                h = output[0] if isinstance(output, tuple) else output
                self._hidden[i] = h.detach().float().reshape(-1, h.shape[-1]).cpu()  # [T, H]
        return hook

    # -- running ---------------------------------------------------------------------------------
    def _forward(self, phase: str, **kwargs) -> tuple[Trace, object]:
        self._step, self._hidden = {}, {}
        self.recording = True
        try:
            out = self.lm.model(**kwargs, use_cache=True)
        finally:
            self.recording = False
        if bool(not_finite(out.logits)):  # routing of NaN hidden states would be profiled as any other
            raise MoetoolError(nonfinite_sentence(f"in a {phase} step", self.lm.fingerprint.source))
        s = self._step
        layers = []
        for g in self.lm.geometry.layers:
            gate_in = s["gate_in"][g.index]
            layers.append(LayerTrace(layer=g.index, attn_in=s.get("attn_in", {}).get(g.index, gate_in),
                                     gate_in=gate_in, logits=s["logits"][g.index], top_k=s["top_k"][g.index],
                                     importance=s.get("importance", {}).get(g.index) if phase == "prefill" else None))
        hidden = [self._hidden[i] for i in sorted(self._hidden)]
        return Trace(phase=phase, layers=layers, hidden=hidden), out

    @torch.no_grad()
    def sequence_traces(self, ids: torch.Tensor, decode_tokens: int = 0) -> Iterator[Trace]:
        """The prefill of `ids` [1, T], then `decode_tokens` greedy decode steps, one Trace each."""
        device = next(self.lm.model.parameters()).device
        trace, out = self._forward("prefill", input_ids=ids.to(device))
        yield trace
        cache = out.past_key_values
        nxt = out.logits[:, -1:].argmax(-1)  # [1, 1]
        for _ in range(decode_tokens):
            trace, out = self._forward("decode", input_ids=nxt, **with_cache(self.lm.model, cache))
            yield trace
            cache = out.past_key_values
            nxt = out.logits[:, -1:].argmax(-1)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self.eager and self._attn_before and self._attn_before != "eager":
            self.lm.model.set_attn_implementation(self._attn_before)
