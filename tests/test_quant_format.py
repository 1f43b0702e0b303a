"""Blob format and HQQ backend: pack/unpack round trips against hqq's own dequantization."""

import pytest
import torch
from hqq.core.bitpack import BitPack
from hqq.core.quantize import Quantizer

from moetool.errors import MoetoolError
from moetool.quant import hqq
from moetool.quant.format import (ALIGN, PACKINGS, Bits, dequantize, dequantize_into, dequantize_qtensor,
                                  dequantize_stack, empty_weights, encode, make_layout, relative_error, views)
from helpers import gaussian_expert

QUANT_BITS = (Bits.INT8, Bits.INT4, Bits.INT2)


def hqq_reference(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: Bits, shape, axis: int,
                  dtype: torch.dtype) -> torch.Tensor:
    """hqq's own Quantizer.dequantize on our packed bytes, with meta cast to the compute dtype as HQQLinear does."""
    meta = {"nbits": int(bits), "group_size": 64, "axis": axis, "shape": torch.Size(shape),
            "packing": PACKINGS[bits].name, "view_as_float": False, "unpack_view_dtype": torch.uint8,
            "compute_dtype": dtype, "scale": scale.to(dtype), "zero": zero.to(dtype)}
    return Quantizer.dequantize(packed, meta)


@pytest.mark.parametrize("bits", QUANT_BITS)
def test_packing_matches_hqq_bitpack(bits):
    codes = torch.randint(0, 1 << int(bits), (64, 48), dtype=torch.uint8)  # [R, C]
    ours = PACKINGS[bits].pack(codes)
    theirs = {8: BitPack.pack_8bit_u8, 4: BitPack.pack_4bit_u8, 2: BitPack.pack_2bit_u8}[int(bits)](codes)
    assert torch.equal(ours, theirs)
    assert ours.shape == (64 * int(bits) // 8, 48)
    out = torch.empty(64, 48, dtype=torch.uint8)
    assert torch.equal(PACKINGS[bits].unpack(ours, out), codes)


@pytest.mark.parametrize("axis", [1, 0])
@pytest.mark.parametrize("bits", QUANT_BITS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_equals_hqq_dequantize_exactly(bits, axis, dtype):
    w = gaussian_expert(bias=True)
    layout = make_layout(bits, w.gate_up.shape, w.down.shape, has_bias=True, group_size=64, axis=axis)
    blob = encode(layout, w, hqq.quantize_expert(w, bits, 64, axis))
    assert blob.dtype == torch.uint8 and blob.shape == (layout.nbytes,)
    got = dequantize(blob, layout, dtype)
    v = views(blob, layout)
    for name in ("gate_up", "down"):
        ref = hqq_reference(v[f"{name}.q"], v[f"{name}.scale"], v[f"{name}.zero"], bits,
                            getattr(w, name).shape, axis, dtype)
        assert torch.equal(getattr(got, name), ref), name
    assert torch.equal(got.gate_up_bias, w.gate_up_bias.to(torch.bfloat16).to(dtype))


def test_relative_errors_per_bit_width_are_ordered_and_near_hqq_figures():
    w = gaussian_expert()
    errors = {}
    for bits in QUANT_BITS:
        layout = make_layout(bits, w.gate_up.shape, w.down.shape, has_bias=False)
        got = dequantize(encode(layout, w, hqq.quantize_expert(w, bits)), layout)
        errors[bits] = relative_error(w.gate_up, got.gate_up)
    assert errors[Bits.INT8] < errors[Bits.INT4] < errors[Bits.INT2]
    assert 0.002 < errors[Bits.INT8] < 0.012  # Gaussian weights, group 64: ~0.005
    assert 0.06 < errors[Bits.INT4] < 0.12  # ~0.086
    assert 0.35 < errors[Bits.INT2] < 0.5  # ~0.43


def test_reference_precision_is_bf16_rounding_only():
    w = gaussian_expert(bias=True)
    layout = make_layout(Bits.BF16, w.gate_up.shape, w.down.shape, has_bias=True)
    got = dequantize(encode(layout, w), layout)
    for name, t in w.tensors().items():
        assert torch.equal(getattr(got, name), t.to(torch.bfloat16).float()), name


def test_layout_is_contiguous_aligned_and_sized():
    layout = make_layout(Bits.INT4, (256, 256), (256, 128), has_bias=True)
    ends = 0
    for part in layout.parts:
        assert part.offset % ALIGN == 0 and part.offset >= ends
        ends = part.offset + part.nbytes
    assert layout.nbytes % ALIGN == 0 and layout.nbytes - ends < ALIGN
    q = layout.part("gate_up.q")
    assert q.shape == (256 * 256 // 64 // 2, 64) and q.nbytes == 256 * 256 // 2
    assert layout.part("gate_up.scale").shape == (256 * 256 // 64, 1)


def test_dequantize_into_reuses_buffers_and_matches():
    w = gaussian_expert()
    layout = make_layout(Bits.INT2, w.gate_up.shape, w.down.shape, has_bias=False)
    q = hqq.quantize_expert(w, Bits.INT2)
    blob = encode(layout, w, q)
    out = empty_weights(layout)
    ptr = out.gate_up.data_ptr()
    dequantize_into(blob, layout, out)
    assert out.gate_up.data_ptr() == ptr
    assert torch.equal(out.gate_up, dequantize(blob, layout).gate_up)
    # dequantize_qtensor predicts the stored result before the blob exists (used by GPTQ's down calibration)
    assert torch.equal(dequantize_qtensor(q["down"], layout.projections[1]), out.down)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("has_bias", [False, True])
@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("bits", [Bits.BF16, *QUANT_BITS])
def test_dequantize_stack_is_dequantize_for_each_blob_bit_for_bit(bits, axis, has_bias, dtype):
    """The grouped path decodes n experts at once from strided rows of a slot pool: each must be
    exactly what the per-expert decode gives (the engine's two paths then differ only in the GEMM)."""
    experts = [gaussian_expert(rows=32, hidden=64, bias=has_bias, seed=s) for s in range(3)]
    layout = make_layout(bits, experts[0].gate_up.shape, experts[0].down.shape, has_bias, group_size=32, axis=axis)
    pool = torch.zeros(4, layout.nbytes + ALIGN, dtype=torch.uint8)  # padded slots, as a pool's rows are
    for i, w in enumerate(experts):
        encode(layout, w, None if bits == Bits.BF16 else hqq.quantize_expert(w, bits, 32, axis, optimize=False),
               out=pool[i + 1, :layout.nbytes])
    stack = dequantize_stack(pool[1:], layout, dtype)  # a strided view, like a slot range
    for i in range(3):
        want = dequantize(pool[i + 1, :layout.nbytes], layout, dtype)
        for name, t in want.tensors().items():
            assert torch.equal(getattr(stack, name)[i], t), name
    if bits == Bits.BF16 and dtype == torch.bfloat16:  # the reference in the compute dtype is read in place
        assert stack.gate_up.data_ptr() == pool[1:, :].data_ptr() + layout.part("gate_up").offset


@pytest.mark.parametrize("bad", [5, 3, 0, 1, 32, 4.5, "four"])
def test_unsupported_bits_are_refused(bad):
    with pytest.raises(MoetoolError, match="not a stored precision"):
        Bits.parse(bad)


def test_group_size_that_does_not_tile_is_refused():
    with pytest.raises(MoetoolError, match="group size 48"):
        make_layout(Bits.INT4, (64, 64), (64, 32), has_bias=False, group_size=48)
    with pytest.raises(MoetoolError, match="cannot be packed"):
        make_layout(Bits.INT2, (2, 64), (64, 64), has_bias=False, group_size=64)  # 2 groups, 4 codes a byte
    # the way out, where there is one: each group size it names packs both projections
    with pytest.raises(MoetoolError, match="with group size 2 cannot be packed 4 codes per byte: group size 1 packs"):
        make_layout(Bits.INT2, (4, 6), (6, 2), has_bias=False, group_size=2)
    make_layout(Bits.INT2, (4, 6), (6, 2), has_bias=False, group_size=1)
    # and where there is none (widths 33 and 5: an odd number of groups at every size), not a loop of
    # "pick another group size" and "pick one that divides both widths (e.g. 1)"
    with pytest.raises(MoetoolError, match=r"no group size dividing both input widths \(33 and 5\) packs these "
                                           r"experts at 4 bits; leave 4 out of --bits"):
        make_layout(Bits.INT4, (10, 33), (33, 5), has_bias=False, group_size=1)
    make_layout(Bits.INT8, (10, 33), (33, 5), has_bias=False, group_size=1)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_quantize_and_device_dequantize_agree_with_cpu():
    w = gaussian_expert()
    layout = make_layout(Bits.INT4, w.gate_up.shape, w.down.shape, has_bias=False)
    blob = encode(layout, w, hqq.quantize_expert(w, Bits.INT4, device="cuda"))  # hqq's fp16 optimizer on the GPU
    on_cpu = dequantize(blob, layout, torch.bfloat16)
    on_gpu = dequantize(blob.cuda(), layout, torch.bfloat16)
    assert on_gpu.gate_up.is_cuda
    assert torch.equal(on_gpu.gate_up.cpu(), on_cpu.gate_up) and torch.equal(on_gpu.down.cpu(), on_cpu.down)
    assert relative_error(w.gate_up, on_cpu.gate_up) < 0.12


@pytest.mark.parametrize("bits", [16, 8, 4, 2])
@pytest.mark.parametrize("has_bias,axis", [(False, 1), (True, 1), (False, 0)])
def test_a_layout_read_back_is_checked_against_the_one_make_layout_gives(bits, has_bias, axis):
    import dataclasses

    from moetool.quant.format import Layout
    from moetool.schema import SchemaError, build

    layout = make_layout(bits, (32, 16), (16, 16), has_bias, group_size=8, axis=axis)
    assert build(Layout, dataclasses.asdict(layout)) == layout
    moved = dataclasses.asdict(layout)
    moved["parts"][-1]["offset"] += 64
    with pytest.raises(SchemaError, match=r"parts\[\d+\] is not where this format puts"):
        build(Layout, moved)
    padded = {**dataclasses.asdict(layout), "nbytes": layout.nbytes + 64}
    with pytest.raises(SchemaError, match="nbytes is"):
        build(Layout, padded)
    with pytest.raises(SchemaError, match="bits is 3, not a stored precision"):
        build(Layout, {**dataclasses.asdict(layout), "bits": 3})
