"""Small Triton functions the experts kernels' loop modes share (`triton_experts` for modes 0-2 and
the launches, `triton_words` for mode 3): sums, pointers into a slot's blob, the epilogues."""

from __future__ import annotations

import triton
import triton.language as tl

# 16-bit weight and bias dtypes, as the kernels' constexpr codes (the reference precision is the
# bundle's bf16, or the compute dtype in a store packed from a checkpoint).
WDTYPES = {"bfloat16": 0, "float16": 1, "float32": 2}


# Only Triton's builtins here and in the kernels' modules, none of its jit-written standard library
# (tl.sum, tl.sigmoid, tl.zeros): those are decorated once, when triton.language is first imported, so
# in a process that imported Triton before setting TRITON_INTERPRET=1 they cannot run under the
# interpreter.


@triton.jit
def _sum(x, axis: tl.constexpr):
    """tl.sum, spelled as the builtin reduce with tl.sum's own combine function: the same code on a
    GPU, and the interpreter recognises that function (by identity) and sums in numpy."""
    return tl.reduce(x, axis, tl.standard._sum_combine)


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _ptr(base, off, DT: tl.constexpr):
    """`base` (a uint8 pointer) + `off` bytes, as a pointer to dtype code DT (`WDTYPES`; 3: int32)."""
    if DT == 0:
        return (base + off).to(tl.pointer_type(tl.bfloat16))
    elif DT == 1:
        return (base + off).to(tl.pointer_type(tl.float16))
    elif DT == 2:
        return (base + off).to(tl.pointer_type(tl.float32))
    else:  # 3: packed codes read four bytes at a time (mode 3)
        return (base + off).to(tl.pointer_type(tl.int32))


@triton.jit
def _quads(n, Q: tl.constexpr):
    """Where column n of a row of 4 Q columns is kept in quads: column 4w + b at b Q + w, so that the
    columns b of four words in a row are 4 consecutive floats (one 16-byte load of a thread in mode 3,
    `triton_words._gemv_words`, where the stored order took four 4-byte loads)."""
    return (n % 4) * Q + n // 4


@triton.jit
def _activate(g, u, ACT: tl.constexpr, GATED: tl.constexpr, alpha, limit):
    """The epilogue's activation (codes: `activation.Act`) on gate rows g and up rows u (fp32)."""
    if ACT == 5:  # gpt_oss's clamped SwiGLU
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        return (u + 1.0) * g * _sigmoid(g * alpha)
    else:
        if ACT == 1:
            a = g * _sigmoid(g)
        elif ACT == 2:
            a = 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476))
        elif ACT == 3:  # 0.5 g (1 + tanh(z)) = g * sigmoid(2z), z = sqrt(2/pi) (g + 0.044715 g^3)
            a = g * _sigmoid(1.5957691216057308 * (g + 0.044715 * g * g * g))
        elif ACT == 4:
            a = tl.maximum(g, 0.0)
        else:  # 6: relu^2
            a = tl.maximum(g, 0.0)
            a = a * a
        if GATED:
            a = a * u
        return a


@triton.jit
def _gate_up_out(h_row, blob, g, u, n, grow, urow, nmask, BDT: tl.constexpr, HAS_BIAS: tl.constexpr,
                 B_OFF: tl.constexpr, ACT: tl.constexpr, GATED: tl.constexpr, alpha, limit, QH: tl.constexpr):
    """gate_up's epilogue for neurons n (gate rows grow, up rows urow; [R] fp32 sums g and u): biases,
    then the activation into h[n] (in quads, `_quads`, where QH > 0 is a quarter of h's width), or the
    raw rows into h[grow], h[urow] when the block's own function runs next (Act.NONE)."""
    if HAS_BIAS:
        g += tl.load(_ptr(blob, B_OFF, BDT) + grow, mask=nmask, other=0.0).to(tl.float32)
        if GATED:
            u += tl.load(_ptr(blob, B_OFF, BDT) + urow, mask=nmask, other=0.0).to(tl.float32)
    if ACT == 0:  # raw gate_up rows, in their own order: the block's own function runs next
        tl.store(h_row + grow, g, mask=nmask)
        if GATED:
            tl.store(h_row + urow, u, mask=nmask)
    elif QH > 0:
        tl.store(h_row + _quads(n, QH), _activate(g, u, ACT, GATED, alpha, limit), mask=nmask)
    else:
        tl.store(h_row + n, _activate(g, u, ACT, GATED, alpha, limit), mask=nmask)


@triton.jit
def _down_out(y_row, blob, y, rows, rmask, weight, BDT: tl.constexpr, HAS_BIAS: tl.constexpr, B_OFF: tl.constexpr):
    if HAS_BIAS:
        y += tl.load(_ptr(blob, B_OFF, BDT) + rows, mask=rmask, other=0.0).to(tl.float32)
    tl.store(y_row + rows, y * weight, mask=rmask)
