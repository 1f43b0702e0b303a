"""Where a model comes from and whether moetool takes it, from its files alone, before any weight is
read: a local directory, a hub id (its cache offline) or "demo" (`resolve_source`); its config.json,
with what moetool refuses in one sentence (a model type defined by code shipped with the checkpoint,
one transformers does not know, a pre-quantized method it does not read, impossible sizes:
`load_config`), a checkpoint for another task (`check_task`), and its generation config
(`load_generation_config`). The model itself is loaded by `model.py`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moetool.errors import first_line as _first_line
from moetool.checkpoint import text_config
from moetool.checkpoint_files import refuse_broken_links
from moetool.errors import MoetoolError, quote
from moetool.files import CONFIG_BYTES, check_file, lock_held
from moetool.prequantized import DEQUANTIZED, quant_method
from moetool.prequantized import check as check_prequantized


def resolve_source(source: str | Path) -> str:
    """A local directory as a string, or a hub id to let transformers resolve (from its cache offline)."""
    text = str(source)
    if text == "demo":
        from moetool.demo import build_demo_model  # lazy: the demo pulls in GGUF conversion code

        return str(build_demo_model().path)
    p = Path(text).expanduser()
    if p.exists():
        if p.is_dir():
            refuse_broken_links(p)  # a config.json linking nowhere is a broken copy, not "no config.json"
            _refuse_bundle(p)
        if not p.is_dir() or not (p / "config.json").exists():
            raise MoetoolError(f"{p} is not a Hugging Face model directory (no config.json in it).")
        for name in ("config.json", "generation_config.json"):  # transformers reads them whole
            if (p / name).exists():
                check_file(p / name, CONFIG_BYTES, "model file")
        return str(p)
    looks_like_hub_id = re.fullmatch(r"[\w.-]+/[\w.-]+", text) is not None and not text.startswith((".", "/"))
    if not looks_like_hub_id:
        raise MoetoolError(f"{text} does not exist (give a local model directory or a hub id like org/name).")
    from moetool.hub import cache_only_if_unreachable

    cache_only_if_unreachable(text)  # offline: the local cache or one sentence, not a minute of retries
    return text


def _refuse_bundle(p: Path) -> None:
    """A bundle, or the model directory inside one, given where a checkpoint is asked for: its experts
    are in the bundle's shards, so as a checkpoint it reads as one without experts."""
    # quant.bundle.MANIFEST, quant.quantize.JOURNAL and quant.shards.MODEL_DIR (modules that import this one)
    if not (p / "bundle.json").is_file() and lock_held(p / ".quantize.lock"):  # quantize.LOCK
        raise MoetoolError(f"{p} is a bundle a moetool quantize is writing now, not a model checkpoint: wait for it "
                           f"to finish and give it as --bundle {p}.")
    if not (p / "bundle.json").is_file() and (p / ".quantize-journal.json").is_file():  # quantize.JOURNAL: one begun
        raise MoetoolError(f"{p} is an unfinished moetool bundle (its quantize was stopped before it wrote bundle.json), "
                           "not a model checkpoint: rerun the quantize command that made it to finish it.")
    if (p / "bundle.json").is_file():
        raise MoetoolError(f"{p} is a moetool bundle, not a model checkpoint: give it as --bundle {p} (check and "
                           "quantize read the checkpoint a bundle is made from).")
    if p.name == "model" and (p.parent / "bundle.json").is_file():
        raise MoetoolError(f"{p} is the model directory of the bundle {p.parent}, which keeps the experts in its "
                           f"shards: give the bundle as --bundle {p.parent} (check and quantize read the checkpoint "
                           "a bundle is made from).")


def load_config(source: str) -> Any:
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig, PretrainedConfig

    try:
        raw = PretrainedConfig.get_config_dict(source)[0]
        _check_model_type(raw, source)
        _check_dtype(raw, source)
        # Code shipped with a checkpoint (its auto_map) is never run, and never asked about: without
        # trust_remote_code=False transformers waits on the terminal for a yes or no.
        config = AutoConfig.from_pretrained(source, trust_remote_code=False)
    except MoetoolError:
        raise
    except Exception as e:  # noqa: BLE001 - no moetool code runs in there: config.json is user input
        # transformers 5 validates configs as huggingface_hub strict dataclasses: their errors say what
        # is wrong (a field's type, layer_types against num_hidden_layers) in the exception they wrap.
        # Others come from a config class's own __post_init__ reading a value it cannot use (an
        # AttributeError for a dtype torch lacks, a KeyError for a rope type): named with their type.
        cause = e.__cause__ if isinstance(e, StrictDataclassError) and e.__cause__ is not None else e
        reason = str(cause).strip().splitlines()[0] if str(cause).strip() else e.__class__.__name__
        if not isinstance(cause, (OSError, ValueError, TypeError)):
            reason = f"{cause.__class__.__name__}: {reason}"
        if not Path(source).exists() and isinstance(cause, OSError):
            # 'ckpt/nosuch' reads as a hub id (org/name): a typo of a local path got only the hub's words
            raise MoetoolError(f"there is no local directory '{source}', and as a hub id it could not be read: "
                               f"{reason}") from None
        raise MoetoolError(f"cannot read the config of '{source}' (locally or from the hub): {reason}") from None
    config = _language_model_config(config, source)
    _check_config(config, source)
    return config


def _language_model_config(config: Any, source: str) -> Any:
    """The config of the causal LM transformers makes of `config`: a vision-language release whose
    model type AutoModelForCausalLM maps to its text decoder's class (Qwen3.5-MoE's
    `Qwen3_5MoeForConditionalGeneration` checkpoint loads as `Qwen3_5MoeForCausalLM`) is its text
    config, with the release's quantization_config, as AutoModelForCausalLM makes it; the vision
    tower's weights are left unread, as transformers leaves them. Its task is checked first, on the
    release's own `architectures` (the text config names none)."""
    from transformers import AutoModelForCausalLM

    text = getattr(config, "sub_configs", {}).get("text_config")
    model_class = AutoModelForCausalLM._model_mapping.get(type(config), None) if text is not None else None
    if model_class is None or getattr(model_class, "config_class", None) is not text:
        return config
    check_task(config, source)
    language = config.get_text_config()
    if getattr(config, "quantization_config", None) is not None:
        language.quantization_config = config.quantization_config
    return language


def _check_dtype(raw: dict, source: str) -> None:
    """Refuse a config.json whose `dtype` (or older `torch_dtype`), its own or its text config's, names
    no floating-point torch dtype: transformers reads it with getattr(torch, ...) as the config
    loads, and would raise an AttributeError for a name torch lacks, or build a model of integers."""
    for where, part in (("", raw), ("text_config's ", raw.get("text_config"))):
        if not isinstance(part, dict):
            continue
        for key in ("dtype", "torch_dtype"):
            value = part.get(key)
            if value is None:
                continue
            named = getattr(torch, value, None) if isinstance(value, str) else None
            if not isinstance(named, torch.dtype) or not named.is_floating_point:
                raise MoetoolError(f"the config.json of '{source}' gives {where}{key} = {value!r}, which is not a "
                                   "floating-point torch dtype; give \"bfloat16\", \"float16\" or \"float32\" "
                                   "(the dtype its weights are stored in).")


def _check_model_type(raw: dict, source: str) -> None:
    """Refuse, from config.json as read, a model type transformers does not ship: one defined by
    code shipped with the checkpoint (DeepSeek-MoE's "deepseek", MiniCPM-MoE, Skywork-MoE), which
    moetool does not run, one this transformers does not know, or none at all (transformers would
    guess it from the directory's name). An auto_map beside a type transformers ships (DeepSeek-V3's
    config.json has one) is not refused: that model runs on transformers' own classes."""
    from transformers import __version__
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = raw.get("model_type")
    if isinstance(model_type, str) and model_type in CONFIG_MAPPING:
        return
    if raw.get("auto_map"):
        named = f"the model type {quote(model_type, 40)}" if model_type else "the model"
        raise MoetoolError(f"{named} of '{source}' is defined by code shipped with the checkpoint (config.json's "
                           "auto_map), which moetool does not run; moetool runs the Mixture-of-Experts architectures "
                           "transformers ships (docs/models.md lists them).")
    if not model_type:
        raise MoetoolError(f"the config.json of '{source}' names no model_type, so its architecture is unknown; "
                           "moetool runs the Mixture-of-Experts architectures transformers ships (docs/models.md lists "
                           "them), each saved with its model_type.")
    raise MoetoolError(f"transformers {__version__} does not know the model type {quote(model_type, 40)} of '{source}' "
                       "(config.json's model_type); moetool runs the Mixture-of-Experts architectures transformers "
                       "ships (docs/models.md lists them).")


# Sizes a model cannot have as 0 or less. transformers builds such a model anyway (empty tensors,
# with torch's warnings), and a context of 0 positions would disable the context-length checks.
_POSITIVE_FIELDS = ("vocab_size", "hidden_size", "num_attention_heads", "max_position_embeddings")


def _check_config(config: Any, source: str) -> None:
    """Refuse what a config says that moetool cannot run as it says: a pre-quantized checkpoint other
    than FP8 and MXFP4 (which are read dequantized, `prequantized.py`): GPTQ, AWQ, bitsandbytes...,
    whose stored weights are not the model's numbers without their quantizer; and a size that is 0
    or negative."""
    method = quant_method(config)
    if method is not None and method not in DEQUANTIZED:
        what = f" (quant_method '{method}')" if method else ""
        raise MoetoolError(f"'{source}' is a pre-quantized checkpoint: its config.json has a quantization_config{what}, "
                           "and moetool reads unquantized weights (bf16, fp16, fp32) and, dequantized, FP8 and MXFP4 "
                           "checkpoints; give the unquantized checkpoint and let "
                           "`moetool quantize` quantize its experts.")
    if method is not None:
        check_prequantized(config, source)  # a malformed FP8/MXFP4 quantization_config is one sentence here
    text = text_config(config)
    for name in _POSITIVE_FIELDS:
        value = getattr(text, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            raise MoetoolError(f"the config of '{source}' gives {name} = {value}; a model has at least 1 (check its "
                               "config.json).")


def load_generation_config(model: nn.Module, directory: Path) -> None:
    """The checkpoint's generation_config.json (eos ids, defaults), as from_pretrained would load it."""
    if not (Path(directory) / "generation_config.json").is_file():
        return
    from transformers import GenerationConfig

    try:
        config = GenerationConfig.from_pretrained(str(directory))
    except (OSError, ValueError) as e:
        raise MoetoolError(f"{directory}/generation_config.json is not valid: {_first_line(e)}.") from None
    # Every generate moetool makes is greedy, one sequence a prompt, as the README says (do_sample=False
    # overrides a checkpoint's sampling). A checkpoint's beam count is made 1 the same way: left, generate
    # searched beams in lm-eval, and in `run` its progress streamer refused them in a traceback after the
    # model had loaded; refusing it would keep check and quantize from a model whose weights are fine.
    config.num_beams = 1
    config.num_return_sequences = 1
    # Nor does a checkpoint's clock or text stop one: `run` decodes all of --max-new-tokens on every path
    # (a `max_time` cut the host path short without a word, and the captured step ignores it), and
    # `stop_strings` needs a tokenizer handed to generate (a traceback in `run`); lm-eval passes its own.
    config.max_time = None
    config.stop_strings = None
    model.generation_config = config


# Class-name endings of models for another task than language modelling: their checkpoints store a
# classification or extraction head (`score`, `qa_outputs`) where a causal LM stores `lm_head`.
_OTHER_TASKS = {"ForSequenceClassification": "a sequence-classification (or reward) model",
                "ForTokenClassification": "a token-classification model",
                "ForQuestionAnswering": "an extractive question-answering model",
                "ForMultipleChoice": "a multiple-choice model", "ForMaskedLM": "a masked language model"}


def check_task(config: Any, source: str) -> None:
    """Refuse a checkpoint whose config.json's `architectures` names only models for another task, or
    the bare model (`Qwen2MoeModel`): it has no language-model head, so the causal LM built from its
    config would lack `lm_head` (plain transformers would initialise one at random)."""
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    names = getattr(config, "architectures", None)
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        return
    # transformers maps a few model types' bare model to a generation class (llama4's is
    # Llama4ForConditionalGeneration, which has a head): only a name without a task is the bare model
    bare = MODEL_MAPPING_NAMES.get(getattr(config, "model_type", None))
    tasks = [next((t for end, t in _OTHER_TASKS.items() if n.endswith(end)),
                  "the bare model, without a language-model head" if n == bare and not _TASK_SUFFIX.search(n)
                  else None) for n in names]
    if all(tasks):
        raise MoetoolError(f"'{source}' holds {quote(names[0])} (config.json's architectures), {tasks[0]}, and "
                           "moetool runs causal language models (...ForCausalLM): give the model's causal-LM "
                           "checkpoint.")


_TASK_SUFFIX = re.compile(r"For[A-Z]\w*$")  # ...ForCausalLM, ...ForConditionalGeneration: a model with a task head
