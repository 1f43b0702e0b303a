"""GPTQ backend: calibrated on routed tokens, never worse than HQQ on them, HQQ fallback for starved experts.

Most tests need the optional gptqmodel package (moetool[gptq]) and are skipped without it.
"""

import statistics

import pytest
import torch

from moetool.errors import MoetoolError
from moetool.quant import gptq, hqq, quantize
from moetool.quant.format import Bits, make_layout, relative_error, dequantize_qtensor
from helpers import quantize_config as config
from helpers import tiny_moe

needs_gptqmodel = pytest.mark.skipif(not gptq.available(), reason="gptqmodel (moetool[gptq]) is not installed")


@pytest.mark.skipif(gptq.available(), reason="gptqmodel is installed")
def test_gptq_without_the_extra_says_how_to_install(tmp_path):
    with pytest.raises(MoetoolError, match=r"moetool\[gptq\]"):
        quantize(config(tmp_path / "no-model", tmp_path / "out", method="gptq"))


@needs_gptqmodel
@pytest.mark.parametrize("bits", [Bits.INT8, Bits.INT4, Bits.INT2])
def test_gptq_weight_beats_hqq_on_its_own_inputs(bits):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 128, generator=g) * 0.02  # [out, in]
    x = torch.randn(512, 128, generator=g) * torch.linspace(0.1, 3.0, 128)  # [n, in], uneven channels
    proj = make_layout(bits, (64, 128), (128, 64), has_bias=False).projections[0]
    q = gptq.quantize_weight(w, x, bits, 64)
    assert q.codes.dtype == torch.uint8 and int(q.codes.max()) < (1 << int(bits))
    w_gptq = dequantize_qtensor(q, proj)
    w_hqq = dequantize_qtensor(hqq.quantize_weight(w, bits, 64), proj)
    err_gptq = relative_error(x @ w.T, x @ w_gptq.T)
    err_hqq = relative_error(x @ w.T, x @ w_hqq.T)
    assert err_gptq < err_hqq


@needs_gptqmodel
def test_gptq_bundle_output_error_at_4_bits_is_at_most_hqqs(tmp_path):
    model = tiny_moe(tmp_path / "m")
    common = dict(bits=(4,), calib_tokens=512, min_tokens=16)
    b_gptq = quantize(config(model, tmp_path / "gptq", method="gptq", **common))
    b_hqq = quantize(config(model, tmp_path / "hqq", method="hqq", **common))
    assert {e.method for e in b_gptq.entries} == {"gptq"}
    assert [e.tokens for e in b_gptq.entries] == [e.tokens for e in b_hqq.entries]  # same calibration tokens
    mean_gptq = statistics.mean(e.out_error for e in b_gptq.entries)
    mean_hqq = statistics.mean(e.out_error for e in b_hqq.entries)
    assert mean_gptq <= mean_hqq
    assert b_gptq.settings["gptq"]["min_tokens"] == 16 and b_gptq.settings["calibration"]["tokens"] == 512


@needs_gptqmodel
def test_starved_experts_fall_back_to_hqq_and_say_so(tmp_path):
    model = tiny_moe(tmp_path / "m")
    bundle = quantize(config(model, tmp_path / "b", method="gptq", bits=(16, 4), min_tokens=10**6))
    quantized = [e for e in bundle.entries if e.bits == 4]
    assert quantized and all(e.method == "hqq" and e.tokens < 10**6 for e in quantized)
    assert all(e.method == "bf16" for e in bundle.entries if e.bits == 16)


@needs_gptqmodel
def test_loading_gptqmodel_leaves_the_terminal_and_the_environment_as_they_were():
    """Its import printed a dozen lines (a banner, a version table, a GIL warning) on every GPTQ
    quantize, and set HF_HOME and the hub caches under /tmp, the CUDA allocator's settings and
    device order for the whole process. A fresh process, as the CLI is."""
    import json
    import subprocess
    import sys

    code = ("import json, os; before = dict(os.environ)\n"
            "from moetool.quant.gptq import load_gptqmodel; load_gptqmodel()\n"
            "print(json.dumps({k: v for k, v in os.environ.items() if before.get(k) != v}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {}
    # torch's own pytree deprecation lines (torchao's enums, as any moetool process that loads it) aside
    assert [ln for ln in done.stderr.splitlines() if ln.strip() and "_pytree.py" not in ln] == []
