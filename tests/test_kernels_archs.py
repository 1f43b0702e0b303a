"""The fused Triton experts kernels on every architecture's experts (tests/tiny.py: every fused-experts
causal LM of transformers 5.24), under Triton's interpreter: the activation `activation_of` reads off
the block, what `supported` says of the layer's layouts, and the layer's experts through the kernels
against transformers' own experts module holding the same (dequantized) weights.

Tolerances are test_triton_experts.py's: RTOL (a summation order) at bf16 in mode 0, RTOL_WORDS
(mode 3's 0.5 offsets) at INT4 in mode 3 at the GPU's word tiles; a wrong code, row, gate or
activation is off by far more.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.activations import ReLUSquaredActivation

pytest.importorskip("triton")

# Imported first: it decorates the kernels for the interpreter (its `_import_interpreted`).
from test_triton_experts import RTOL_WORDS, layer_pools, set_weights, spec_of  # noqa: E402

from kernel_cases import RTOL, assert_close, random_ids, random_pool, reference_forward, with_ids  # noqa: E402
from moetool.kernels import Act, Activation, activation_of, experts_forward, supported  # noqa: E402
from moetool.kernels import config as kconfig  # noqa: E402
from moetool.kernels import experts as kexperts  # noqa: E402
from moetool.kernels.activation import reference  # noqa: E402
from moetool.model import inspect_geometry, load_model, load_reference  # noqa: E402
from moetool.quant.format import auto_group_size  # noqa: E402
from tiny import MORE_CONFIGS, TINY_CONFIGS, save_tiny  # noqa: E402

pytestmark = pytest.mark.skipif(not kexperts._interpreted(), reason="moetool.kernels was imported before this "
                                "module, without TRITON_INTERPRET=1: its kernels cannot run on CPU tensors")


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


ARCHS = [*TINY_CONFIGS, *MORE_CONFIGS]

# Blocks whose activation the kernels have no epilogue for: the kernel writes gate_up's raw rows and
# the block's own function runs between two launches (Act.NONE). Every other architecture's
# activation must be read as one the kernel computes.
OWN_FUNCTION = {
    "beam": "act(gate.float()) * up.float(): a copy of the default gate under its own name",
    "deepseek_v4": "SiLU of a clamped gate times a clamped up",
    "hy_v4": "SiLU of a clamped gate times a clamped up",
    "inkling2_text": "a softcapped SwiGLU",
    "inkling2_loop_text": "a softcapped SwiGLU",
}

WORDS_GPU = (*kconfig.WORDS_TILES, 3)


@pytest.mark.parametrize("arch", ARCHS)
def test_every_architectures_experts_through_the_kernels(tmp_path, arch):
    """The first MoE layer of a bf16 tiny checkpoint: its activation read as a kind whose torch
    reference is the block's own function (or Act.NONE with that function, for OWN_FUNCTION), its
    layouts taken, and its experts through the kernels as transformers' module computes them: bf16 in
    mode 0, INT4 at the quantizer's group (`auto_group_size`) in mode 3 (32-bit words) at the GPU's word tiles."""
    model = load_reference(save_tiny(arch, tmp_path / arch, dtype=torch.bfloat16), experts_impl="eager")
    layers = inspect_geometry(model).layers
    g, group = layers[0], auto_group_size(layers)
    experts = model.get_submodule(g.path).experts
    spec = spec_of(experts, g)
    assert (spec.kind == Act.NONE) == (arch in OWN_FUNCTION), spec
    if spec.kind != Act.NONE:
        h = 20 * torch.randn(5, 2 * g.intermediate_size if g.gated else g.intermediate_size,
                             generator=torch.Generator().manual_seed(0))
        assert_close(reference(spec, h), spec.fn(h).float())
    gen = torch.Generator().manual_seed(7)
    T = 3
    idx = torch.stack([torch.randperm(g.num_experts, generator=gen)[:g.top_k] for _ in range(T)])  # [T, k]
    w = torch.softmax(torch.randn(T, g.top_k, generator=gen), -1)
    x = 4 * torch.randn(T, g.hidden_size, generator=gen)
    for bits, config, rtol in ((16, (), RTOL), (4, WORDS_GPU, RTOL_WORDS)):
        pool, held = layer_pools(experts, g, bits, group)
        assert supported(pool.layout, spec, "cpu") is None  # none of these layers is refused
        set_weights(experts, g, held)
        with torch.no_grad():
            want = experts(x, idx, w)
        assert_close(experts_forward(x, w, [with_ids(pool, idx.int())], spec, config), want, rtol)


# ---- activations the kernel computes, read off the block -------------------------------------------

@pytest.mark.parametrize("act_fn,kind", [(F.silu, Act.SILU), (F.gelu, Act.GELU), (F.relu, Act.RELU),
                                         (torch.relu, Act.RELU), (ReLUSquaredActivation(), Act.RELU2)],
                         ids=["F.silu", "F.gelu", "F.relu", "torch.relu", "relu2"])
def test_an_act_fn_is_read_by_its_class_or_as_a_torch_function(tiny_ckpt, act_fn, kind):
    """lfm2_moe keeps `act_fn = F.silu`, a function, not an activation module, and nemotron_h
    transformers' relu2 module: each read as the kernel's epilogue (before, Act.NONE: the block's
    function between two launches), as are torch's other functions the epilogue computes, each
    checked against the block's own function."""
    lm = load_model(tiny_ckpt("qwen2_moe"))
    experts = lm.model.get_submodule(lm.geometry.layers[0].path).experts
    del experts.impl.act_fn  # a child module: replaced by a plain attribute, as lfm2_moe's is
    experts.impl.act_fn = act_fn
    spec = activation_of(experts)
    assert spec.kind == kind and spec.gated
    h = 20 * torch.randn(3, 2 * lm.geometry.layers[0].intermediate_size)
    assert_close(reference(spec, h), experts.activation(h))


def test_a_wrapped_torch_function_falls_back_to_the_blocks_own(tiny_ckpt):
    """A function that calls torch's is not torch's: not recognised, so the block's own runs."""
    lm = load_model(tiny_ckpt("qwen2_moe"))
    experts = lm.model.get_submodule(lm.geometry.layers[0].path).experts
    del experts.impl.act_fn
    experts.impl.act_fn = lambda x: F.silu(x)
    spec = activation_of(experts)
    assert spec.kind == Act.NONE and spec.fn is not None


@pytest.mark.parametrize("gated", [False, True], ids=["ungated", "gated"])
@pytest.mark.parametrize("bits,config", [(16, ()), (8, ()), (2, ()), (4, WORDS_GPU), (2, (128, 64, 128, 64, 256, 4, 1))])
def test_the_squared_relu_epilogue(bits, config, gated):
    """relu(x)^2 (nemotron_h's ungated experts), with biases, in the first kernel's epilogue at every
    precision and in modes 0, 1 and 3: torch's reference on the dequantized weights."""
    spec = Activation(Act.RELU2, gated=gated)
    gen = torch.Generator().manual_seed(8 + bits)
    pool = with_ids(random_pool(bits, 64, 64, 32, slots=3, gen=gen, bias=True, gated=gated), random_ids(2, 3, 3, gen))
    x, w = torch.randn(2, 64, generator=gen), torch.rand(2, 3, generator=gen)
    assert_close(experts_forward(x, w, [pool], spec, config), reference_forward(x, w, [pool], spec),
                 RTOL_WORDS if config[-1:] == (3,) else RTOL)
