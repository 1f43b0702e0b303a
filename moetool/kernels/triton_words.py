"""Loop mode 3 of the experts kernels (`config.MODES`): packed codes read as 32-bit words and made
floats in place, about half the instructions a weight of modes 0-2 (docs/benchmarks.md). The
launches and modes 0-2 are in `triton_experts`; a precision whose layout mode 3 cannot read takes
mode 1's loop there (`experts.kernel_meta`'s flags M[26] and M[30])."""

from __future__ import annotations

import triton
import triton.language as tl

from moetool.kernels.triton_parts import _down_out, _gate_up_out, _ptr, _sum


@triton.jit
def _field(w, S: tl.constexpr, MASK: tl.constexpr, fbits):
    """One code of each word of `w` (int32, 4 code bytes) as the fp32 0.5 + code * 2^(P - 24): the word
    shifted by S so the code sits at bits P .. P + BITS of `MASK`, masked and or-ed into 0.5's
    exponent. Every code of a slice lands on one P (`_gemv_words`), and the and-or is one logic op
    on the GPU because `fbits` (0.5's bits, 0x3F000000) is a register, not an immediate: a LOP3
    takes one immediate (two immediates were two LOP3s a weight, sm_90)."""
    if S > 0:
        v = w << S
    elif S < 0:
        v = w >> (-S)  # arithmetic: the sign's copies land above MASK
    else:
        v = w
    return ((v & MASK) | fbits).to(tl.float32, bitcast=True)


@triton.jit
def _word_slice(d, w, x0, x1, x2, x3, T: tl.constexpr, BITS: tl.constexpr, J: tl.constexpr, fbits):
    """d + the products of slice J's codes in the words `w` with their columns' x (byte b of a word
    is column 4 * word + b): four FMAs, one logic op each, and one shift a byte shared by the slices."""
    P: tl.constexpr = T + 8 - BITS * (J + 1)
    MASK: tl.constexpr = ((1 << BITS) - 1) << P
    d = d + _field(w, T, MASK, fbits) * x0
    d = d + _field(w, T - 8, MASK, fbits) * x1
    d = d + _field(w, T - 16, MASK, fbits) * x2
    return d + _field(w, T - 24, MASK, fbits) * x3


@triton.jit
def _slice_sum(d, X, blob, rows, rmask, k0, K: tl.constexpr, S_OFF: tl.constexpr, Z_OFF: tl.constexpr,
               GS: tl.constexpr, GW: tl.constexpr, NG: tl.constexpr, P: tl.constexpr):
    """Slice J's [NG, R] chunk sums d (of 0.5 + code * 2^(P-24) times x) with their groups' scales and
    zeros applied: s * (d - (0.5 + z * 2^(P-24)) * X) = s * sum((code - z) * x) / 2^(24-P), X the
    chunk's sum of x. Once a row and chunk, not once a weight."""
    col = k0 + tl.arange(0, NG)[:, None] * GW  # [NG, 1]: first column of each chunk
    grp = rows[None, :] * (K // GS) + col // GS  # [NG, R]
    mask = rmask[None, :] & (col < K)
    scale = tl.load(_ptr(blob, S_OFF, 1) + grp, mask=mask, other=0.0)
    zero = tl.load(_ptr(blob, Z_OFF, 1) + grp, mask=mask, other=0.0)
    return scale.to(tl.float32) * (d - 0.5 * X - zero.to(tl.float32) * (X * (1.0 / (1 << (24 - P)))))


@triton.jit
def _gemv_words(x_row, blob, p, pmask, K: tl.constexpr, BITS: tl.constexpr, NQ: tl.constexpr, Q_OFF: tl.constexpr,
                S_OFF: tl.constexpr, Z_OFF: tl.constexpr, GS: tl.constexpr, GW: tl.constexpr, BK: tl.constexpr,
                RB: tl.constexpr, NS: tl.constexpr, T: tl.constexpr, fbits, XQ: tl.constexpr):
    """Mode 3 (`config.MODES`): the dot products with x (fp32) of byte rows `p` [RB] of a packed
    projection, for their first NS slices (slice j is row p + j * NQ): (a0, a1, a2, a3) [RB] fp32,
    the slices past NS zero. At batch 1 the other modes are bound by the instructions a weight costs
    (7.7 a thread at INT4, 3.4 at bf16: docs/benchmarks.md), not by bytes. Here codes are read as
    32-bit words and never unpacked to bytes: byte b's codes are moved by one shift a word (T - 8b)
    to bits T .. T + 8, so each slice's code is at one place P in the mantissa of 0.5 and becomes a
    float by one logic op (`_field`), then one FMA with x. A thread keeps a chunk's 4 words of a row
    for GW/16 sub-tiles (its products summed in registers, no shuffles), and scale and zero are applied
    once a row and chunk (`_slice_sum`). T = 15 (`experts.kernel_meta`) puts byte b's bits at 15..22,
    just under the exponent: slice j's code at P = 23 - BITS (j + 1). The lower a code sits, the
    more of fp32's 24 bits the 0.5 beside it takes until the chunk's sum removes it (measured: T = 12
    was 6e-5 of the largest output off the fp32 reference, T = 15 under 3e-5); one shift a byte
    whatever the slice needs every slice of a byte to move together, hence one T, not a P a slice.
    With XQ, x is kept in quads (`triton_parts._quads`): a thread's x for its 4 words is 4 loads of
    16 bytes, where x as stored takes 16 loads of 4 (11% of an INT4 down loop's instructions, sm_90)."""
    NG: tl.constexpr = BK // GW
    # Tiles are [chunk, row, word]: with the chunk axis first the compiler spreads threads over chunks
    # and words before rows, so a thread holds a few rows of one chunk and its x serves them all
    # (rows first, a thread held one row and loaded x once per two weights: 0.56 loads a weight)
    g = tl.arange(0, NG)[:, None, None]
    c = tl.arange(0, 4)[None, None, :]
    words = _ptr(blob, Q_OFF, 3) + p[None, :, None] * (K // 4)  # [1, RB, 1] int32 pointers
    rmask = pmask[None, :, None]
    a0 = tl.full((NG, RB), 0.0, tl.float32)
    a1 = a0
    a2 = a0
    a3 = a0
    for k0 in range(0, K, BK):
        gmask = k0 + g * GW < K  # [NG, 1, 1]: whole chunks (K is a multiple of GW)
        d0 = tl.full((NG, RB, 4), 0.0, tl.float32)
        d1 = d0
        d2 = d0
        d3 = d0
        xsum = tl.full((NG, 1, 4), 0.0, tl.float32)
        for j in tl.static_range(GW // 16):
            # [NG, 1, 4] words (4 columns each) of sub-tile j, read as one 16-byte load a row. x is
            # read as four tiles, one a byte of the words: in quads each is 4 consecutive floats,
            # as stored 4 strided ones (one contiguous tile split in four went through shared
            # memory, 26 barriers a loop, sm_90)
            wi = k0 // 4 + g * (GW // 4) + j * 4 + c
            w = tl.load(words + wi, mask=rmask & gmask, other=0)
            if XQ:
                x0 = tl.load(x_row + wi, mask=gmask, other=0.0)
                x1 = tl.load(x_row + K // 4 + wi, mask=gmask, other=0.0)
                x2 = tl.load(x_row + 2 * (K // 4) + wi, mask=gmask, other=0.0)
                x3 = tl.load(x_row + 3 * (K // 4) + wi, mask=gmask, other=0.0)
            else:
                x0 = tl.load(x_row + 4 * wi, mask=gmask, other=0.0).to(tl.float32)
                x1 = tl.load(x_row + 4 * wi + 1, mask=gmask, other=0.0).to(tl.float32)
                x2 = tl.load(x_row + 4 * wi + 2, mask=gmask, other=0.0).to(tl.float32)
                x3 = tl.load(x_row + 4 * wi + 3, mask=gmask, other=0.0).to(tl.float32)
            xsum = xsum + x0 + x1 + x2 + x3
            d0 = _word_slice(d0, w, x0, x1, x2, x3, T, BITS, 0, fbits)
            if NS > 1:
                d1 = _word_slice(d1, w, x0, x1, x2, x3, T, BITS, 1, fbits)
            if NS > 2:
                d2 = _word_slice(d2, w, x0, x1, x2, x3, T, BITS, 2, fbits)
                d3 = _word_slice(d3, w, x0, x1, x2, x3, T, BITS, 3, fbits)
        X = _sum(xsum, 2)  # [NG, 1]
        a0 += _slice_sum(_sum(d0, 2), X, blob, p, pmask, k0, K, S_OFF, Z_OFF, GS, GW, NG, T + 8 - BITS)
        if NS > 1:
            a1 += _slice_sum(_sum(d1, 2), X, blob, p + NQ, pmask, k0, K, S_OFF, Z_OFF, GS, GW, NG, T + 8 - 2 * BITS)
        if NS > 2:
            a2 += _slice_sum(_sum(d2, 2), X, blob, p + 2 * NQ, pmask, k0, K, S_OFF, Z_OFF, GS, GW, NG,
                             T + 8 - 3 * BITS)
            a3 += _slice_sum(_sum(d3, 2), X, blob, p + 3 * NQ, pmask, k0, K, S_OFF, Z_OFF, GS, GW, NG,
                             T + 8 - 4 * BITS)
    # back from 2^(P-24) units to codes: slice j's P is T + 8 - BITS (j + 1)
    a0 = _sum(a0, 0) * (1 << (16 - T + BITS))
    if NS > 1:
        a1 = _sum(a1, 0) * (1 << (16 - T + 2 * BITS))
        if NS > 2:
            a2 = _sum(a2, 0) * (1 << (16 - T + 3 * BITS))
            a3 = _sum(a3, 0) * (1 << (16 - T + 4 * BITS))
        else:
            a2 = a1 * 0.0
            a3 = a2
    else:
        a1 = a0 * 0.0
        a2 = a1
        a3 = a1
    return a0, a1, a2, a3


@triton.jit
def _gate_up_words(x_row, blob, h_row, b, H: tl.constexpr, I: tl.constexpr, N1: tl.constexpr, M: tl.constexpr,
                   ACT: tl.constexpr, GATED: tl.constexpr, alpha, limit, R: tl.constexpr, fbits, XQ: tl.constexpr,
                   QH: tl.constexpr):
    """Block b of one pair's packed gate_up in mode 3 (`_gemv_words`), by byte rows: all of a byte
    row's slices at once. [gate; up] packed 2+ rows a byte (INT4, INT2) puts gate row p + j NQ and its
    up row I + p + j NQ in byte row p; INT8's gate and up rows are byte rows of their own. x in quads
    with XQ, h written in quads where QH > 0 (`_gemv_words`)."""
    BITS: tl.constexpr = M[0]
    BDT: tl.constexpr = M[2]
    HAS_BIAS: tl.constexpr = M[3]
    Q_OFF: tl.constexpr = M[4]
    S_OFF: tl.constexpr = M[5]
    Z_OFF: tl.constexpr = M[6]
    GS: tl.constexpr = M[7]
    B_OFF: tl.constexpr = M[12]
    SL: tl.constexpr = M[18]
    SHARED: tl.constexpr = M[20]
    NQ: tl.constexpr = M[22]
    BK1: tl.constexpr = M[23]
    GW: tl.constexpr = M[27]
    T: tl.constexpr = M[29]
    PER: tl.constexpr = 8 // BITS
    RB: tl.constexpr = R // SL  # byte rows a block (the launch's grid counts R // SL a block, `_lanes`)
    p = b * RB + tl.arange(0, RB)
    pmask = p < NQ
    if GATED:
        if SHARED:
            a0, a1, a2, a3 = _gemv_words(x_row, blob, p, pmask, H, BITS, NQ, Q_OFF, S_OFF, Z_OFF, GS, GW, BK1, RB,
                                         PER, T, fbits, XQ)
            if PER == 2:  # NQ = I: gate p, up I + p
                _gate_up_out(h_row, blob, a0, a1, p, p, I + p, pmask, BDT, HAS_BIAS, B_OFF, ACT, GATED, alpha, limit, QH)
            else:  # PER 4, NQ = I / 2: gates p and p + NQ, their ups two slices on
                _gate_up_out(h_row, blob, a0, a2, p, p, I + p, pmask, BDT, HAS_BIAS, B_OFF, ACT, GATED, alpha, limit, QH)
                _gate_up_out(h_row, blob, a1, a3, p + NQ, p + NQ, I + p + NQ, pmask, BDT, HAS_BIAS, B_OFF, ACT,
                             GATED, alpha, limit, QH)
        else:
            n = b * R + tl.arange(0, R)
            nmask = n < I
            g, _, _, _ = _gemv_words(x_row, blob, n, nmask, H, BITS, N1, Q_OFF, S_OFF, Z_OFF, GS, GW, BK1, R, 1, T, fbits,
                                     XQ)
            u, _, _, _ = _gemv_words(x_row, blob, I + n, nmask, H, BITS, N1, Q_OFF, S_OFF, Z_OFF, GS, GW, BK1, R, 1, T,
                                     fbits, XQ)
            _gate_up_out(h_row, blob, g, u, n, n, I + n, nmask, BDT, HAS_BIAS, B_OFF, ACT, GATED, alpha, limit, QH)
    else:
        a0, a1, a2, a3 = _gemv_words(x_row, blob, p, pmask, H, BITS, NQ, Q_OFF, S_OFF, Z_OFF, GS, GW, BK1, RB, PER, T,
                                     fbits, XQ)
        _gate_up_out(h_row, blob, a0, a0, p, p, p, pmask, BDT, HAS_BIAS, B_OFF, ACT, GATED, alpha, limit, QH)
        if PER > 1:
            _gate_up_out(h_row, blob, a1, a1, p + NQ, p + NQ, p + NQ, pmask, BDT, HAS_BIAS, B_OFF, ACT, GATED, alpha,
                         limit, QH)
        if PER > 2:
            _gate_up_out(h_row, blob, a2, a2, p + 2 * NQ, p + 2 * NQ, p + 2 * NQ, pmask, BDT, HAS_BIAS, B_OFF, ACT,
                         GATED, alpha, limit, QH)
            _gate_up_out(h_row, blob, a3, a3, p + 3 * NQ, p + 3 * NQ, p + 3 * NQ, pmask, BDT, HAS_BIAS, B_OFF, ACT,
                         GATED, alpha, limit, QH)


@triton.jit
def _down_words(h_row, blob, y_row, b, weight, H: tl.constexpr, I: tl.constexpr, M: tl.constexpr, R: tl.constexpr,
                fbits, XQ: tl.constexpr):
    """Block b of one pair's packed down projection in mode 3 (`_gemv_words`): byte rows p, each
    with its slices' rows p + j NQ; h in quads with XQ (`_gemv_words`)."""
    BITS: tl.constexpr = M[0]
    BDT: tl.constexpr = M[2]
    HAS_BIAS: tl.constexpr = M[3]
    Q_OFF: tl.constexpr = M[8]
    S_OFF: tl.constexpr = M[9]
    Z_OFF: tl.constexpr = M[10]
    GS: tl.constexpr = M[11]
    B_OFF: tl.constexpr = M[13]
    SL: tl.constexpr = M[19]
    NQ: tl.constexpr = M[21]
    BK2: tl.constexpr = M[24]
    GW: tl.constexpr = M[28]
    T: tl.constexpr = M[29]
    PER: tl.constexpr = 8 // BITS
    RB: tl.constexpr = R // SL
    p = b * RB + tl.arange(0, RB)
    pmask = p < NQ
    a0, a1, a2, a3 = _gemv_words(h_row, blob, p, pmask, I, BITS, NQ, Q_OFF, S_OFF, Z_OFF, GS, GW, BK2, RB, PER, T,
                                 fbits, XQ)
    _down_out(y_row, blob, a0, p, pmask, weight, BDT, HAS_BIAS, B_OFF)
    if PER > 1:
        _down_out(y_row, blob, a1, p + NQ, pmask, weight, BDT, HAS_BIAS, B_OFF)
    if PER > 2:
        _down_out(y_row, blob, a2, p + 2 * NQ, pmask, weight, BDT, HAS_BIAS, B_OFF)
        _down_out(y_row, blob, a3, p + 3 * NQ, pmask, weight, BDT, HAS_BIAS, B_OFF)
