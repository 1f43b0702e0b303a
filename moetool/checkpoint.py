"""Open a Hugging Face MoE checkpoint without materializing it: non-expert weights now, experts one layer at a time.

transformers builds the model skeleton with every parameter on the meta device; moetool loads the
non-expert weights into it and reads a MoE layer's experts only when asked. Checkpoint keys are
mapped to the model's fused expert layout by transformers' own conversion machinery
(`conversion_mapping.get_model_conversion_mapping` + `core_model_loading.convert_and_load_state_dict_in_model`,
the code `from_pretrained` runs), so per-expert checkpoints (`experts.3.w1.weight`), renamed blocks
(`block_sparse_moe`) and fused ones load alike, with no key table of ours. Host memory is the
non-expert weights plus one layer's experts, whatever the size of the checkpoint: safetensors
shards are memory-mapped and only the requested tensors are read.

    ckpt = open_checkpoint("path/to/ckpt", dtype=torch.bfloat16)
    fused = ckpt.layer_experts(3)          # {"gate_up_proj": [E, 2I, H], "down_proj": [E, H, I]}
    ckpt.model                             # skeleton: non-expert weights real, experts on meta
"""

from __future__ import annotations

import copy
import re
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moetool.checkpoint_files import local_directory, open_safetensors, weight_files
from moetool.errors import MoetoolError, first_line
from moetool.prequantized import dequantizer, quant_method, read_fp8, unscaled_blocks, without_quantization

def find_experts_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Fused experts modules by path: those built by transformers' `use_experts_implementation`."""
    return {name: m for name, m in model.named_modules()
            if hasattr(m, "has_gate") and hasattr(m, "is_transposed")
            and (isinstance(getattr(m, "gate_up_proj", None), torch.Tensor)
                 or isinstance(getattr(m, "up_proj", None), torch.Tensor))}


def causal_lm_class(config: Any) -> type[nn.Module]:
    """transformers' causal-LM class for `config`: its auto mapping's, else the `...ForCausalLM` class
    of the config's own model module. transformers 5.24 ships Mistral4ForCausalLM, say, without
    mapping `mistral4` to it, so AutoModelForCausalLM refuses a checkpoint the class itself loads.
    Only transformers' own modules are read: a model defined by code beside a checkpoint never runs."""
    import importlib

    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM._model_mapping[type(config)]
    except KeyError:
        pass
    module = type(config).__module__  # transformers.models.X.configuration_X
    if module.startswith("transformers.models.") and ".configuration_" in module:
        try:
            modeling = importlib.import_module(module.replace(".configuration_", ".modeling_"))
        except ImportError:
            modeling = None
        found = [c for name, c in sorted(vars(modeling).items()) if name.endswith("ForCausalLM")
                 and isinstance(c, type) and getattr(c, "config_class", None) is type(config)] if modeling else []
        if len(found) == 1:
            return found[0]
    several = "text_config" in getattr(config, "sub_configs", {})  # Qwen3-VL-MoE, GLM-4.5V, ERNIE-4.5-VL
    what = ("a model of several parts (text_config among them) whose text transformers loads as no causal LM"
            if several else "transformers has no causal-LM class for it")
    text = config.get_text_config() if several else None
    if text is not None and text is not config:
        try:
            causal_lm_class(text)  # Aria's, MiniMax-M3-VL's: the text model alone is one moetool runs
            what = (f"transformers loads this release of several parts as no causal LM, though its text model "
                    f"('{getattr(text, 'model_type', '?')}') is one: save that alone (its text_config as config.json, "
                    "its language-model weights) and give it")
        except MoetoolError:
            pass
    raise MoetoolError(f"moetool does not support the '{getattr(config, 'model_type', '?')}' architecture: {what} "
                       "(moetool runs causal language models; docs/models.md lists them).")


def build_skeleton(config: Any, dtype: torch.dtype) -> nn.Module:
    """The causal-LM model of `config` with every parameter on the meta device (buffers real, e.g. RoPE)."""
    from accelerate import init_empty_weights

    cls = causal_lm_class(config)
    try:
        with init_empty_weights(include_buffers=False):
            model = cls._from_config(config, dtype=dtype)  # what AutoModelForCausalLM.from_config calls
    except Exception as e:  # noqa: BLE001 - a config from disk that transformers cannot build
        model_type = getattr(config, "model_type", "?")
        raise MoetoolError(f"cannot build a '{model_type}' model from its config: {first_line(e)}.") from None
    return model.eval()


def expert_parameter_names(model: nn.Module) -> dict[str, str]:
    """Parameter name of every fused expert tensor -> path of its experts module."""
    return {f"{path}.{name}": path for path, m in find_experts_modules(model).items()
            for name, _ in m.named_parameters(recurse=False)}


def load_into(model: nn.Module, tensors: dict[str, Any], dtype: torch.dtype, mapping: list | None,
              where: str = "the checkpoint", first_expert: int | None = None) -> Any:
    """Load `tensors` (lazy safetensors slices or tensors, by checkpoint key) into `model` through
    transformers' loader, converting keys and layouts with `mapping` (None: names already match).

    What it loaded must be finite (`refuse_not_finite`): checked here, on the data just read, so no
    weight of a checkpoint or a bundle (non-expert weights as a model opens, experts a span at a
    time as they are read, `first_expert` the span's first) reaches a forward or a bundle as NaN."""
    from transformers.core_model_loading import convert_and_load_state_dict_in_model
    from transformers.modeling_utils import LoadStateDictConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # its per-call "Loading weights" bar would print once per layer
    cfg = LoadStateDictConfig(dtype=dtype, weight_mapping=mapping or [], device_map={"": "cpu"})
    try:
        info, _ = convert_and_load_state_dict_in_model(model, tensors, cfg)
    except MoetoolError:
        raise
    except Exception as e:  # noqa: BLE001 - data read from a user's file: one sentence, naming what failed
        raise MoetoolError(f"cannot read the checkpoint's weights: {first_line(e)}.") from None
    if info.conversion_errors:
        target, report = next(iter(info.conversion_errors.items()))
        raise MoetoolError(f"the checkpoint's weights do not fit the model's config: {target}: {_reason(report)}.")
    if info.mismatched_keys:
        raise MoetoolError(f"the checkpoint's weights do not fit the model's config ({sorted(info.mismatched_keys)[0]}).")
    refuse_not_finite(((n, p) for n, p in model.named_parameters() if not p.is_meta), where, first_expert, dtype)
    return info


_FINITE_CHUNK = 1 << 24  # elements checked at a time: a bool mask of a few MiB, not one of a whole embedding


def refuse_not_finite(named: Any, where: str, first_expert: int | None = None,
                      dtype: torch.dtype | None = None) -> None:
    """Refuse the first of `named` ((name, tensor) pairs) that holds a NaN or an infinity, naming the
    tensor, the element and (a fused experts tensor, `first_expert` the expert of its first row) the
    expert. A weight that is not a finite number makes every output it reaches NaN: a model would
    run and print empty text, a bundle would store it, a report would plot it. Loaded as float16
    (`dtype`), an infinity may be the cast's: a finite float32 weight past 65504."""
    for name, t in named:
        if not t.is_floating_point():
            continue
        flat = t.detach().reshape(-1)
        for start in range(0, flat.numel(), _FINITE_CHUNK):
            chunk = flat[start:start + _FINITE_CHUNK]
            if bool(torch.isfinite(chunk).all()):
                continue
            i = start + int((~torch.isfinite(chunk)).nonzero()[0, 0])
            value = float(flat[i])
            what = "NaN" if value != value else ("+" if value > 0 else "-") + "Infinity"
            at = [int(c) for c in torch.unravel_index(torch.tensor(i), t.shape)] if t.dim() else []
            expert = ""
            if first_expert is not None and at:  # a fused experts tensor: its first index is the span's expert
                expert, at = f" of expert {first_expert + at[0]}", at[1:]
            if what != "NaN" and dtype == torch.float16 == t.dtype:  # the cast to --dtype may have made it
                raise MoetoolError(f"the weight {name}{expert} at {at} in {where} is {what} in "
                                   f"float16: the file stores an infinity there, or a value past float16's range "
                                   f"({torch.finfo(torch.float16).max:.0f}) that --dtype float16 overflowed; run it in "
                                   "bfloat16 or float32 (--dtype), or give an intact copy.")
            raise MoetoolError(f"{where} stores {what} in the weight {name}{expert} at {at}: a weight that is not a "
                               "finite number makes every output it reaches NaN; the file is damaged (or overflowed "
                               "when it was saved or converted): give an intact copy.")


def _reason(report: Any) -> str:
    """The error's own sentence out of a conversion report transformers wrote with its traceback."""
    lines = [ln.strip() for ln in str(report).splitlines() if ln.strip()]
    said = [ln.split(": ", 1)[1] for ln in lines if re.match(r"^[A-Za-z_.]*(Error|Exception): ", ln)]
    return (said[0] if said else lines[-1] if lines else "a conversion failed").rstrip(".")


# Config fields that count routed experts (per architecture) and that must agree with that count.
_EXPERT_COUNT = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_PER_EXPERT_KEY = re.compile(r"(?:^|\.)experts\.(\d+)\.")  # experts.37.gate_proj.weight


class _Rows:
    """Rows [start, stop) of a lazily read safetensors tensor: what the loader reads of a fused
    checkpoint tensor whose first dimension is the expert (gpt_oss, granitemoe)."""

    def __init__(self, tensor: Any, start: int, stop: int):
        self.tensor, self.start, self.stop = tensor, start, stop

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self.tensor[self.start:self.stop]


def text_config(config: Any) -> Any:
    """The config of a model's language model: its own, or a vision-language config's text_config."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def looped_layers(config: Any) -> tuple[range, int]:
    """(the decoder layers a token runs more than once, how many times each): a looped model's core
    (Inkling2-Loop's `loop_layer_index_start` .. `_end`, `loop_num_passes` passes), else (range(0), 1).
    Its forward appends a cache layer per extra pass of each looped layer, and calls their MoE blocks
    once a pass."""
    cfg = text_config(config)
    passes, start, end = (getattr(cfg, n, None) for n in ("loop_num_passes", "loop_layer_index_start",
                                                           "loop_layer_index_end"))
    layers = getattr(cfg, "num_hidden_layers", 0) or 0
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (passes, start, end)) or passes < 2:
        return range(0), 1
    core = range(max(0, start), min(end, layers))
    return (core, passes) if len(core) else (range(0), 1)


def _expert_count(config: Any) -> int:
    text = text_config(config)
    return next(getattr(text, n) for n in _EXPERT_COUNT if isinstance(getattr(text, n, None), int))


@dataclass
class Checkpoint:
    """A checkpoint opened for streaming. `model` holds the real non-expert weights and meta experts."""

    source: str
    directory: Path
    config: Any
    model: nn.Module
    dtype: torch.dtype
    expert_keys: dict[str, dict[str, Any]]  # experts module path -> checkpoint key -> lazy slice
    _files: ExitStack = field(repr=False)
    quantizer: Any = field(default=None, repr=False)  # transformers' dequantizer of an FP8/MXFP4 checkpoint
    _shells: dict[int, nn.Module] = field(default_factory=dict, repr=False)

    def stored_dtypes(self) -> set[str]:
        """The dtypes the checkpoint stores its expert tensors in, as safetensors names them ("BF16",
        "F16", "F32", ...), read from the shards' headers."""
        return {t.get_dtype() for keys in self.expert_keys.values() for t in keys.values()
                if hasattr(t, "get_dtype")}

    def layer_experts(self, path: str, start: int = 0, stop: int | None = None) -> dict[str, torch.Tensor]:
        """Experts [start, stop) of the experts module at `path` as fused tensors, read from disk now.

        They are built by transformers' conversion in an all-meta "shell" skeleton whose config has
        `stop - start` experts (the live model's experts modules are moetool's): only those experts'
        checkpoint tensors (or those rows of a fused one) are read, stacked and taken out, and the
        shell goes back to meta, so reading a few experts costs a few experts of memory.
        """
        from transformers.conversion_mapping import get_model_conversion_mapping

        keys = self.expert_keys.get(path)
        if not keys:
            raise MoetoolError(f"the checkpoint in {self.directory} has no expert weights for {path}; "
                               "it is incomplete or of another model.")
        total = _expert_count(self.config)
        stop = total if stop is None else stop
        chosen = {}
        for key, tensor in keys.items():
            m = _PER_EXPERT_KEY.search(key)
            if m is None:
                chosen[key] = tensor if (start, stop) == (0, total) else _Rows(tensor, start, stop)
            elif start <= int(m.group(1)) < stop:
                chosen[key] = tensor
        shell = self._shell(stop - start)
        module = shell.get_submodule(path)
        load_into(shell, chosen, self.dtype, get_model_conversion_mapping(shell, hf_quantizer=self.quantizer),
                  where=f"the checkpoint in {self.directory}", first_expert=start)
        out = {}
        for name, p in list(module.named_parameters(recurse=False)):
            if p.is_meta:
                raise MoetoolError(f"the checkpoint in {self.directory} lacks {path}.{name}; it is incomplete.")
            out[name] = p.detach()
            setattr(module, name, nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=False))
        return out

    def _shell(self, experts: int) -> nn.Module:
        """An all-meta skeleton whose MoE layers have `experts` experts (built once per count)."""
        if experts not in self._shells:
            cfg = copy.deepcopy(self.config)
            text = text_config(cfg)
            for name in _EXPERT_COUNT:
                if isinstance(getattr(text, name, None), int):
                    setattr(text, name, experts)
            # Routing fields bounded by the expert count (only the experts' shapes matter in a shell).
            if isinstance(getattr(text, "num_experts_per_tok", None), int):
                text.num_experts_per_tok = min(text.num_experts_per_tok, experts)
            for name in ("n_group", "topk_group"):
                if isinstance(getattr(text, name, None), int):
                    setattr(text, name, 1)
            self._shells[experts] = build_skeleton(cfg, self.dtype)
        return self._shells[experts]

    def close(self) -> None:
        self._files.close()


def _refuse_unused(model: nn.Module, info: Any, experts: dict[str, dict[str, Any]], directory: Path) -> None:
    """Refuse weights the config does not use: a config.json with fewer layers (or experts) than the
    checkpoint would otherwise run a truncated model without a word. The keys transformers itself
    ignores on load (`_keys_to_ignore_on_load_unexpected`: DeepSeek-V3's multi-token-prediction
    layer, old rotary buffers) are ignored here too, by its own rule."""
    model._adjust_missing_and_unexpected_keys(info)
    unused = sorted(k for k in info.unexpected_keys if not _other_part(model, k))
    text = text_config(model.config)
    count = next((getattr(text, n) for n in _EXPERT_COUNT if isinstance(getattr(text, n, None), int)), None)
    if count is not None:
        unused += sorted(k for keys in experts.values() for k in keys
                         if (m := _PER_EXPERT_KEY.search(k)) is not None and int(m.group(1)) >= count)
    if unused:
        layers = getattr(text, "num_hidden_layers", "?")
        raise MoetoolError(f"the checkpoint in {directory} holds {len(unused)} weights its config.json does not use "
                           f"(e.g. {unused[0]}; the config gives num_hidden_layers={layers} and {count} experts a "
                           "layer): the config is of another model, or cut short.")


def _other_part(model: nn.Module, key: str) -> bool:
    """Whether `key` (a name after the loader's renaming) belongs to a part the causal LM does not have:
    a release's vision or audio tower, a reward head. Its path leaves the model's module tree at a
    named child, where a config cut short leaves it at an index past a list's end (`model.layers.7`,
    `experts.9`). transformers' causal LM reads neither; only the second is refused, since it means
    the config runs fewer layers or experts than the checkpoint holds. dots.3's release keeps its
    towers at the top (`vision_encoder.*`) and its causal LM class does not list them as ignored."""
    module: nn.Module = model
    for part in key.split(".")[:-1]:
        child = module._modules.get(part)
        if child is None:
            return not (part.isdigit() or isinstance(module, (nn.ModuleList, nn.ModuleDict)))
        module = child
    return False


def _tie(model: nn.Module, missing: set[str], directory: Path) -> None:
    """Tie the weights the config ties (lm_head to the embedding) as from_pretrained does: to the one
    the checkpoint stores, whichever it is (a checkpoint may store lm_head alone). Both stored with
    different values is refused: transformers then leaves them untied (its config is wrong, it warns),
    but a bundle's model is re-tied by its config.json as it loads, so only a corrected config runs
    the same model everywhere."""
    if not hasattr(model, "tie_weights"):
        return
    for target, source in getattr(model, "all_tied_weights_keys", {}).items():
        if target in missing or source in missing:
            continue
        a, b = model.get_parameter_or_buffer(target), model.get_parameter_or_buffer(source)
        if not a.is_meta and not b.is_meta and (a.shape != b.shape or not torch.equal(a, b)):
            raise MoetoolError(f"the checkpoint in {directory} stores {target} and {source} with different values, "
                               "but its config.json ties them (tie_word_embeddings, or its model type's default "
                               "of true): set \"tie_word_embeddings\": false in config.json to run the weights it "
                               "stores, as transformers does.")
    model.tie_weights(missing_keys=set(missing), recompute_mapping=False)


# safetensors' names of the floating-point dtypes (F8_* included: plain fp8 values cast exactly).
_FLOAT_DTYPES = ("F", "BF")


# What an MXFP4 checkpoint stores as uint8 by design: codes and power-of-two scales, read by
# transformers' dequantizer, never cast.
_PACKED = ("_blocks", "_scales")


def _refuse_integer_weights(dtype: str, key: str, path: Path) -> None:
    """Refuse a weight stored as integers or booleans (`dtype`, safetensors' name; the caller gives
    "F32" where the model's tensor is itself an integer buffer): the loader would cast the stored
    integers silently, as if they were the weights' values (a quantized tensor without its scales, a
    shard of something else)."""
    if not dtype.startswith(_FLOAT_DTYPES):
        raise MoetoolError(f"checkpoint shard {path.name} in {path.parent} stores the weight {key} as {dtype}, not "
                           "floating point: it is a quantized or damaged checkpoint, which moetool cannot read; give "
                           "the unquantized (bf16, fp16 or fp32) checkpoint.")


def _entries(directory: Path, files: ExitStack) -> dict[str, tuple[Any, str, Path]]:
    """Every checkpoint key -> (its lazy slice, its safetensors dtype, its shard), the shards kept open in `files`."""
    entries = {}
    for path in weight_files(directory):
        handle = files.enter_context(open_safetensors(path))
        for key in handle.keys():
            if key in entries:  # which copy a loader keeps is an accident of file order: neither is chosen
                raise MoetoolError(f"the checkpoint in {directory} stores the weight {key} twice, in "
                                   f"{entries[key][2].name} and in {path.name}: a shard of another copy or version "
                                   "is among its files; remove it or download the checkpoint again.")
            tensor = handle.get_slice(key)
            entries[key] = (tensor, tensor.get_dtype(), path)
    return entries


def open_checkpoint(source: str, config: Any, dtype: torch.dtype) -> Checkpoint:
    """Open `source` (a resolved local directory or hub id): skeleton, non-expert weights, lazy experts."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    directory = local_directory(source)
    model = build_skeleton(config, dtype)
    # An MXFP4 checkpoint: transformers' quantizer dequantizes its experts as they load (FP8: `read_fp8`).
    quantizer = dequantizer(config)
    mapping = get_model_conversion_mapping(model, hf_quantizer=quantizer)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    targets = model.state_dict()
    experts = expert_parameter_names(model)
    files = ExitStack()
    rest: dict[str, Any] = {}
    by_module: dict[str, dict[str, Any]] = {}
    try:
        entries = _entries(directory, files)
        if quant_method(config) == "fp8":
            entries = read_fp8(entries, config, directory)
        elif quantizer is not None and (bare := unscaled_blocks({k: e[1] for k, e in entries.items()})):
            raise MoetoolError(f"the checkpoint in {directory} stores {bare} in MXFP4 without its scales, so its values "
                               "are unknown: it is incomplete or damaged.")
        for key, (tensor, stored, path) in entries.items():
            # The name this key will have in the model, by the same rules the loader applies.
            target, _ = rename_source_key(key, renamings, converters, model.base_model_prefix, targets)
            module = experts.get(target)
            floating = module is not None or (target in targets and targets[target].is_floating_point())
            if quantizer is None or not key.endswith(_PACKED):
                _refuse_integer_weights(stored if floating else "F32", key, path)
            (by_module.setdefault(module, {}) if module else rest)[key] = tensor
        info = load_into(model, rest, dtype, get_model_conversion_mapping(model, hf_quantizer=quantizer),
                         where=f"the checkpoint in {directory}")
        _refuse_unused(model, info, by_module, directory)
        _tie(model, info.missing_keys, directory)
        missing = [n for n, p in model.named_parameters() if p.is_meta and n not in experts]
        if missing:
            raise MoetoolError(f"the checkpoint in {directory} lacks {len(missing)} non-expert weights "
                               f"(e.g. {missing[0]}); it is incomplete or of another model.")
    except BaseException:
        files.close()
        raise
    return Checkpoint(source=source, directory=directory, config=config, model=model, dtype=dtype,
                      expert_keys=by_module, _files=files, quantizer=quantizer)


def load_dequantized(src: str, config: Any, dtype: torch.dtype, experts_impl: str) -> nn.Module | None:
    """transformers' own model of an FP8 or MXFP4 checkpoint, holding the numbers moetool reads (what
    `check` compares with: it loads everything anyway); None for any other checkpoint."""
    method = quant_method(config)
    if method == "fp8":  # `read_fp8`'s weights in transformers' model (prequantized.py says why)
        directory = local_directory(src)
        with ExitStack() as files:
            entries = _entries(directory, files)
            state = {k: t[:] for k, (t, _, _) in read_fp8(entries, config, directory).items()}
        return causal_lm_class(config).from_pretrained(None, config=without_quantization(config), state_dict=state,
                                                       dtype=dtype, experts_implementation=experts_impl)
    if method == "mxfp4":
        return causal_lm_class(config).from_pretrained(src, dtype=dtype, experts_implementation=experts_impl,
                                                       quantization_config=dequantizer(config).quantization_config)
    return None
