"""The Triton kernels behind `moetool.kernels.experts`: one MoE layer's experts at small batch, read
from slot pools in the bundle's own blob layout, every stored precision in the same three launches.

    gate_up_kernel[(T*k, blocks)]  h[q, t*k+j] = act(gate_up_q[slot](x[t]) + bias)  for each precision q
    down_kernel[(T*k, blocks)]     y[q, t*k+j] = w[t, j] * (down_q[slot](h[q, t*k+j]) + bias)
    combine_kernel[(T, blocks)]    out[t] = sum over q, j with a slot of y[q, t*k+j]

Each program of the first two computes one block of output rows of one (token, slot) pair, a GEMV
(decode batches are a few tokens: gather by index, as gpt-fast's MoE, no sort or grouping, so
nothing depends on the routing but which bytes are read). It takes the pair's slot id of each
precision in turn (a compile-time loop over the precisions, each with its own bit width, groups
and offsets as constants) and skips the ones with -1; the third kernel sums only pairs that ran,
so partial buffers need no zeroing.

Codes follow hqq's packing (`quant.format`): weight [N, K] packed as [N / per, K] bytes, row n in
byte row n % (N / per) at bit 8 - bits * (n // (N / per) + 1), per = 8 / bits codes a byte. A
program's rows are chosen so that the `per` rows sharing a byte row are in the same program
(`_lanes`), so each byte is read from memory once and unpacked into `per` rows. Weights are
(code - zero) * scale in fp32 (fp16 scale and zero per group of GS input columns); a tile of K
is [groups, group width] so that one scale per row and group is loaded, not one per weight.
That is loop modes 0-2 (`config.MODES`); mode 3, which reads codes as 32-bit words by byte rows,
is `triton_words`, and what both share (pointers, sums, epilogues) `triton_parts`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from moetool.kernels.triton_parts import _down_out, _gate_up_out, _ptr, _sum
from moetool.kernels.triton_words import _down_words, _gate_up_words

# Only Triton's builtins here (see `triton_parts`).


@triton.jit
def _lanes(b, SL: tl.constexpr, SPAN: tl.constexpr, R: tl.constexpr):
    """Block b's R rows out of SL * SPAN: lane l is row (l // (R/SL)) * SPAN + b * (R/SL) + l % (R/SL).
    With SPAN = N / per (SL = per), the rows that share byte rows land in one program."""
    RP: tl.constexpr = R // SL
    lane = tl.arange(0, R)
    p = b * RP + lane % RP
    return (lane // RP) * SPAN + p, p < SPAN


@triton.jit
def _load_raw(blob, rows, rmask, k0, K: tl.constexpr, BITS: tl.constexpr, WDT: tl.constexpr, NQ: tl.constexpr,
              Q_OFF: tl.constexpr, GW: tl.constexpr, NG: tl.constexpr):
    """The tile of rows `rows` [R] and input columns k0 .. k0 + NG*GW as [R, NG, GW], as stored:
    code bytes (uint8) for a packed projection, 16-bit (or fp32) weights for a 16-bit one."""
    g = tl.arange(0, NG)[None, :, None]
    c = tl.arange(0, GW)[None, None, :]
    kk = k0 + g * GW + c  # [1, NG, GW]
    r3 = rows[:, None, None]  # [R, 1, 1]
    mask = rmask[:, None, None] & (kk < K)
    if BITS == 16:
        return tl.load(_ptr(blob, Q_OFF, WDT) + r3 * K + kk, mask=mask, other=0.0)
    else:
        return tl.load(blob + Q_OFF + (r3 % NQ) * K + kk, mask=mask, other=0)


@triton.jit
def _load_w(blob, rows, rmask, k0, K: tl.constexpr, BITS: tl.constexpr, WDT: tl.constexpr, NQ: tl.constexpr,
            Q_OFF: tl.constexpr, GW: tl.constexpr, NG: tl.constexpr):
    """`_load_raw`'s tile with 16-bit weights in fp32 (mode 0's tile; mode 1 holds the stored
    dtype while the previous tile's math runs: half the registers)."""
    raw = _load_raw(blob, rows, rmask, k0, K, BITS, WDT, NQ, Q_OFF, GW, NG)
    if BITS == 16:
        return raw.to(tl.float32)
    else:
        return raw


@triton.jit
def _load_sz(blob, rows, rmask, k0, K: tl.constexpr, BITS: tl.constexpr, S_OFF: tl.constexpr,
             Z_OFF: tl.constexpr, GS: tl.constexpr, GW: tl.constexpr, NG: tl.constexpr):
    """Scale and zero [R, NG] (fp16, as stored) of `rows`' groups in the tile at k0 (GW divides GS);
    zeros of no meaning for a 16-bit projection (never read)."""
    r2 = rows[:, None]
    col = k0 + tl.arange(0, NG)[None, :] * GW  # [1, NG]: first input column of each group slice
    if BITS == 16:
        none = (r2 + col) * 0.0
        return none, none
    else:
        # Loaded as [R, NG], given the tile's broadcast axis only where used: a load of an [R, NG, 1]
        # tensor takes the tile's layout, which spreads GW over each thread's registers, so every
        # thread loaded each scale and zero once per register of that axis (16x at GW 64 in the PTX;
        # ptxas removed the repeats in mode 0, not in mode 1: 71 global loads against 14, Triton 3.6).
        grp = r2 * (K // GS) + col // GS  # [R, NG]
        mask = rmask[:, None] & (col < K)
        scale = tl.load(_ptr(blob, S_OFF, 1) + grp, mask=mask, other=0.0)
        zero = tl.load(_ptr(blob, Z_OFF, 1) + grp, mask=mask, other=0.0)
        return scale, zero


@triton.jit
def _codes(raw, rows, BITS: tl.constexpr, NQ: tl.constexpr):
    """The row's code in each byte of a tile [R, NG, GW] as the fp32 1 + code / 2^BITS, exactly,
    in two integer ops and no int-to-float conversion: the row's bits shifted to the top of a
    float's mantissa and or-ed into 1.0's bits. A weight is then (that - (1 + zero / 2^BITS)) *
    (scale * 2^BITS), the zero and scale rescaled once a group (`_unit_sz`), the difference exact
    (two floats within 2x of each other). A conversion (I2F) issues at a fraction of the fp32
    add's rate (the CUDA guide's throughput table) and was one a weight, with its own shift and
    mask; FasterTransformer's and Marlin's int4 -> fp16 conversions use the same trick in fp16."""
    shift = 8 - BITS * (rows[:, None, None] // NQ + 1)  # [R, 1, 1]: where the row's slice sits in its byte
    top = (raw.to(tl.int32) << (23 - BITS - shift)) & (((1 << BITS) - 1) << (23 - BITS))
    return (top | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def _unit_sz(scale, zero, BITS: tl.constexpr):
    """A group's scale and zero [R, NG] (fp16) for `_codes`' 1 + code / 2^BITS: (scale * 2^BITS,
    1 + zero / 2^BITS) in fp32 (both exact but for the last add's rounding, ~1e-7 of a code)."""
    return scale.to(tl.float32) * (1 << BITS), 1.0 + zero.to(tl.float32) * (1.0 / (1 << BITS))


@triton.jit
def _weights(raw, scale, zero, rows, BITS: tl.constexpr, NQ: tl.constexpr):
    """fp32 weights [R, NG, GW] from a tile and its groups' scale and zero [R, NG]: (code - zero) *
    scale, the code being the row's slice of its byte; a 16-bit tile as it is, in fp32."""
    if BITS == 16:
        return raw.to(tl.float32)
    else:
        s, z = _unit_sz(scale, zero, BITS)
        return (_codes(raw, rows, BITS, NQ) - z[:, :, None]) * s[:, :, None]


@triton.jit
def _dequant(raw, blob, rows, rmask, k0, K: tl.constexpr, BITS: tl.constexpr, NQ: tl.constexpr,
             S_OFF: tl.constexpr, Z_OFF: tl.constexpr, GS: tl.constexpr, GW: tl.constexpr, NG: tl.constexpr):
    """Weights [R, NG, GW] fp32 from `_load_w`'s tile, with its groups' scales and zeros loaded."""
    scale, zero = _load_sz(blob, rows, rmask, k0, K, BITS, S_OFF, Z_OFF, GS, GW, NG)
    return _weights(raw, scale, zero, rows, BITS, NQ)


@triton.jit
def _tile_x(x_row, k0, K: tl.constexpr, GW: tl.constexpr, NG: tl.constexpr):
    kk = k0 + tl.arange(0, NG)[None, :, None] * GW + tl.arange(0, GW)[None, None, :]
    return tl.load(x_row + kk, mask=kk < K, other=0.0)  # [1, NG, GW], as stored


@triton.jit
def _tile_dot(raw, xf, blob, rows, rmask, k0, K: tl.constexpr, BITS: tl.constexpr, NQ: tl.constexpr,
              S_OFF: tl.constexpr, Z_OFF: tl.constexpr, GS: tl.constexpr, GW: tl.constexpr, NG: tl.constexpr):
    """One K tile's dot products [R] (fp32) of `rows` (codes `raw`, loaded ahead by modes 1 and 2) with
    x (`xf`), the groups' scales loaded now: a row's scales share cache lines, so after the first
    tile they come from L1. Low-bit rows as the sum over groups of scale * (codes . x - zero *
    sum(x)): scale and zero applied once a group, not once a weight, so a weight costs its code's
    bits and one FMA. At batch 1 these kernels are bound by the instructions a weight costs, not by
    its bytes (docs/benchmarks.md, the H100's tune): the zero's add per weight was 1 of 8.1 loop
    instructions a weight (INT4 gate_up, sm_90, Triton 3.6), now 7.4. The [1, NG] sum of x takes a
    layout of its own (two more barriers a tile through shared memory), a weight tile does not."""
    scale, zero = _load_sz(blob, rows, rmask, k0, K, BITS, S_OFF, Z_OFF, GS, GW, NG)
    if BITS == 16:
        return _sum(_sum(raw.to(tl.float32) * xf, 2), 1)
    else:
        s, z = _unit_sz(scale, zero, BITS)
        dots = _sum(_codes(raw, rows, BITS, NQ) * xf, 2)  # [R, NG]
        xs = _sum(xf, 2)  # [1, NG]
        return _sum(s * (dots - z * xs), 1)


@triton.jit
def _gemv_prefetch(x_row, blob, rows, rows2, rmask, K: tl.constexpr, R: tl.constexpr, BITS: tl.constexpr,
                   WDT: tl.constexpr, NQ: tl.constexpr, Q_OFF: tl.constexpr, S_OFF: tl.constexpr,
                   Z_OFF: tl.constexpr, GS: tl.constexpr, GW: tl.constexpr, NG: tl.constexpr, BK: tl.constexpr,
                   TWO: tl.constexpr, SHARED: tl.constexpr):
    """Mode 1 (`config.MODES`): the dot products with x over K of `rows` and, with TWO, of `rows2`
    ([R] fp32 each; the second 0 without TWO). The next K tile's codes are loaded before this
    tile's math, so a program keeps two tiles' reads in flight, not one (a loop of dependent reads
    is latency-bound whatever the precision), and each tile is reduced as it is done (an [R]
    accumulator, not an [R, BK] one). SHARED: rows2's codes are in rows' bytes (hqq packs [gate;
    up] 2+ rows a byte), read once. x is loaded in the iteration that uses it (every program reads
    it, so it is in cache): carried ahead beside the codes, its tile's layout won, and the compiler
    moved every codes tile into it through shared memory (sm_90 TTGIR)."""
    acc = tl.full((R,), 0.0, tl.float32)
    acc2 = tl.full((R,), 0.0, tl.float32)
    raw_n = _load_raw(blob, rows, rmask, 0, K, BITS, WDT, NQ, Q_OFF, GW, NG)
    raw2_n = raw_n
    if TWO:
        if not SHARED:
            raw2_n = _load_raw(blob, rows2, rmask, 0, K, BITS, WDT, NQ, Q_OFF, GW, NG)
    for k0 in range(0, K, BK):
        raw = raw_n
        raw2 = raw2_n
        xk = _tile_x(x_row, k0, K, GW, NG)
        # the next tile's codes (masked past K: nothing is read), then this one's scales and math
        raw_n = _load_raw(blob, rows, rmask, k0 + BK, K, BITS, WDT, NQ, Q_OFF, GW, NG)
        if TWO:
            if SHARED:
                raw2_n = raw_n
            else:
                raw2_n = _load_raw(blob, rows2, rmask, k0 + BK, K, BITS, WDT, NQ, Q_OFF, GW, NG)
        xf = xk.to(tl.float32)
        acc += _tile_dot(raw, xf, blob, rows, rmask, k0, K, BITS, NQ, S_OFF, Z_OFF, GS, GW, NG)
        if TWO:
            acc2 += _tile_dot(raw2, xf, blob, rows2, rmask, k0, K, BITS, NQ, S_OFF, Z_OFF, GS, GW, NG)
    return acc, acc2


@triton.jit
def _gemv_ring(x_row, blob, rows, rows2, rmask, K: tl.constexpr, R: tl.constexpr, BITS: tl.constexpr,
               WDT: tl.constexpr, NQ: tl.constexpr, Q_OFF: tl.constexpr, S_OFF: tl.constexpr,
               Z_OFF: tl.constexpr, GS: tl.constexpr, GW: tl.constexpr, NG: tl.constexpr, BK: tl.constexpr,
               TWO: tl.constexpr, SHARED: tl.constexpr):
    """Mode 2 (`config.MODES`): `_gemv_prefetch` with three tiles' codes in flight while a tile's
    math runs, not one. Codes wait in registers as stored (a byte a byte at INT8/4/2) and only
    the tile being computed is dequantized, so the bytes a program keeps in flight grow without the
    fp32 tile growing: at batch 1 a layer's programs are too few to fill the device's register
    files, so a low-bit GEMV is bound by reads in flight, not by bytes (docs/benchmarks.md)."""
    acc = tl.full((R,), 0.0, tl.float32)
    acc2 = tl.full((R,), 0.0, tl.float32)
    r0 = _load_raw(blob, rows, rmask, 0, K, BITS, WDT, NQ, Q_OFF, GW, NG)
    r1 = _load_raw(blob, rows, rmask, BK, K, BITS, WDT, NQ, Q_OFF, GW, NG)
    r2 = _load_raw(blob, rows, rmask, 2 * BK, K, BITS, WDT, NQ, Q_OFF, GW, NG)
    u0 = r0
    u1 = r1
    u2 = r2
    if TWO:
        if not SHARED:
            u0 = _load_raw(blob, rows2, rmask, 0, K, BITS, WDT, NQ, Q_OFF, GW, NG)
            u1 = _load_raw(blob, rows2, rmask, BK, K, BITS, WDT, NQ, Q_OFF, GW, NG)
            u2 = _load_raw(blob, rows2, rmask, 2 * BK, K, BITS, WDT, NQ, Q_OFF, GW, NG)
    for k0 in range(0, K, BK):
        raw = r0
        raw2 = u0
        xk = _tile_x(x_row, k0, K, GW, NG)
        r0 = r1
        r1 = r2
        u0 = u1
        u1 = u2
        # three tiles ahead (masked past K: nothing is read), then this tile's scales and math
        r2 = _load_raw(blob, rows, rmask, k0 + 3 * BK, K, BITS, WDT, NQ, Q_OFF, GW, NG)
        if TWO:
            if SHARED:
                u2 = r2
            else:
                u2 = _load_raw(blob, rows2, rmask, k0 + 3 * BK, K, BITS, WDT, NQ, Q_OFF, GW, NG)
        xf = xk.to(tl.float32)
        acc += _tile_dot(raw, xf, blob, rows, rmask, k0, K, BITS, NQ, S_OFF, Z_OFF, GS, GW, NG)
        if TWO:
            acc2 += _tile_dot(raw2, xf, blob, rows2, rmask, k0, K, BITS, NQ, S_OFF, Z_OFF, GS, GW, NG)
    return acc, acc2


@triton.jit
def _gate_up_one(x_row, blob, h_row, b, H: tl.constexpr, I: tl.constexpr, N1: tl.constexpr, M: tl.constexpr,
                 ACT: tl.constexpr, GATED: tl.constexpr, INTERLEAVED: tl.constexpr, alpha, limit,
                 R: tl.constexpr, BK: tl.constexpr, fbits, XQ: tl.constexpr, QH: tl.constexpr):
    """Block b of one pair's gate_up at one precision (meta M, see `experts.kernel_meta`); x in quads
    with XQ (only where every pool of the launch is read as words), h written in quads where QH > 0."""
    if M[26]:  # mode 3 and a layout it takes
        _gate_up_words(x_row, blob, h_row, b, H, I, N1, M, ACT, GATED, alpha, limit, R, fbits, XQ, QH)
    else:
        _gate_up_rows(x_row, blob, h_row, b, H, I, N1, M, ACT, GATED, INTERLEAVED, alpha, limit, R, BK, QH)


@triton.jit
def _gate_up_rows(x_row, blob, h_row, b, H: tl.constexpr, I: tl.constexpr, N1: tl.constexpr, M: tl.constexpr,
                  ACT: tl.constexpr, GATED: tl.constexpr, INTERLEAVED: tl.constexpr, alpha, limit,
                  R: tl.constexpr, BK: tl.constexpr, QH: tl.constexpr):
    """Modes 0-2 (and mode 3's fallback): block b's rows as lanes (`_lanes`), codes a byte at a time."""
    BITS: tl.constexpr = M[0]
    WDT: tl.constexpr = M[1]
    BDT: tl.constexpr = M[2]
    HAS_BIAS: tl.constexpr = M[3]
    Q_OFF: tl.constexpr = M[4]
    S_OFF: tl.constexpr = M[5]
    Z_OFF: tl.constexpr = M[6]
    GS: tl.constexpr = M[7]
    B_OFF: tl.constexpr = M[12]
    GW: tl.constexpr = M[14]
    NG: tl.constexpr = M[15]
    SL: tl.constexpr = M[18]
    SHARED: tl.constexpr = M[20]
    NQ: tl.constexpr = M[22]
    BK1: tl.constexpr = M[23]
    MODE: tl.constexpr = M[25]
    if GATED:
        n, nmask = _lanes(b, SL, I // SL, R)  # the neurons this block computes
        if INTERLEAVED:
            grow = 2 * n
            urow = 2 * n + 1
        else:
            grow = n
            urow = I + n
    else:
        n, nmask = _lanes(b, SL, N1 // SL, R)
        grow = n
        urow = n
    if MODE == 2:
        g, u = _gemv_ring(x_row, blob, grow, urow, nmask, H, R, BITS, WDT, NQ, Q_OFF, S_OFF, Z_OFF, GS, GW, NG,
                          BK1, GATED, SHARED)
    elif MODE == 1:
        g, u = _gemv_prefetch(x_row, blob, grow, urow, nmask, H, R, BITS, WDT, NQ, Q_OFF, S_OFF, Z_OFF, GS, GW, NG,
                              BK1, GATED, SHARED)
    else:
        acc_g = tl.full((R, NG, GW), 0.0, tl.float32)
        acc_u = tl.full((R, NG, GW), 0.0, tl.float32)
        for k0 in range(0, H, BK):
            kk = k0 + tl.arange(0, NG)[None, :, None] * GW + tl.arange(0, GW)[None, None, :]
            xk = tl.load(x_row + kk, mask=kk < H, other=0.0).to(tl.float32)  # [1, NG, GW]
            raw_g = _load_w(blob, grow, nmask, k0, H, BITS, WDT, NQ, Q_OFF, GW, NG)
            acc_g += _dequant(raw_g, blob, grow, nmask, k0, H, BITS, NQ, S_OFF, Z_OFF, GS, GW, NG) * xk
            if GATED:
                if SHARED:  # [gate; up] packed 2+ rows a byte: up's codes are in gate's bytes
                    raw_u = raw_g
                else:
                    raw_u = _load_w(blob, urow, nmask, k0, H, BITS, WDT, NQ, Q_OFF, GW, NG)
                acc_u += _dequant(raw_u, blob, urow, nmask, k0, H, BITS, NQ, S_OFF, Z_OFF, GS, GW, NG) * xk
        g = _sum(_sum(acc_g, 2), 1)  # [R]
        u = _sum(_sum(acc_u, 2), 1)
    _gate_up_out(h_row, blob, g, u, n, grow, urow, nmask, BDT, HAS_BIAS, B_OFF, ACT, GATED, alpha, limit, QH)


@triton.jit
def gate_up_kernel(x, x_stride, pools, strides, ids, h, TK, H: tl.constexpr, I: tl.constexpr, N1: tl.constexpr,
                   W: tl.constexpr, METAS: tl.constexpr, ACT: tl.constexpr, GATED: tl.constexpr,
                   INTERLEAVED: tl.constexpr, alpha, limit, R: tl.constexpr, BK: tl.constexpr, fbits,
                   XQ: tl.constexpr, QH: tl.constexpr):
    """Grid (T*k, blocks): h[q, pair, :W] for every precision q whose slot id for the pair is >= 0
    (x in quads with XQ, h written in quads where QH > 0: `experts.quads_of`)."""
    pair = tl.program_id(0)
    b = tl.program_id(1)
    x_row = x + (pair // TK) * x_stride
    for q in tl.static_range(len(METAS)):
        slot = tl.load(ids[q] + pair)
        if slot >= 0:
            blob = pools[q] + slot.to(tl.int64) * strides[q]
            h_row = h + (q * tl.num_programs(0) + pair).to(tl.int64) * W
            # Named as a constexpr before the call: Triton 3.6 (torch 2.11's) passes a bare tuple of ints as a value.
            M: tl.constexpr = METAS[q]
            _gate_up_one(x_row, blob, h_row, b, H, I, N1, M, ACT, GATED, INTERLEAVED, alpha, limit, R, BK, fbits, XQ,
                         QH)


@triton.jit
def _down_one(h_row, blob, y_row, b, weight, H: tl.constexpr, I: tl.constexpr, M: tl.constexpr,
              R: tl.constexpr, BK: tl.constexpr):
    """Block b of one pair's down projection at one precision, biased and weighted by the routing."""
    BITS: tl.constexpr = M[0]
    WDT: tl.constexpr = M[1]
    BDT: tl.constexpr = M[2]
    HAS_BIAS: tl.constexpr = M[3]
    Q_OFF: tl.constexpr = M[8]
    S_OFF: tl.constexpr = M[9]
    Z_OFF: tl.constexpr = M[10]
    GS: tl.constexpr = M[11]
    B_OFF: tl.constexpr = M[13]
    GW: tl.constexpr = M[16]
    NG: tl.constexpr = M[17]
    SL: tl.constexpr = M[19]
    NQ: tl.constexpr = M[21]
    BK2: tl.constexpr = M[24]
    MODE: tl.constexpr = M[25]
    rows, rmask = _lanes(b, SL, H // SL, R)
    if MODE == 2:
        y, _ = _gemv_ring(h_row, blob, rows, rows, rmask, I, R, BITS, WDT, NQ, Q_OFF, S_OFF, Z_OFF, GS, GW, NG,
                          BK2, False, False)
    elif MODE == 1:
        y, _ = _gemv_prefetch(h_row, blob, rows, rows, rmask, I, R, BITS, WDT, NQ, Q_OFF, S_OFF, Z_OFF, GS, GW, NG,
                              BK2, False, False)
    else:
        acc = tl.full((R, NG, GW), 0.0, tl.float32)
        for k0 in range(0, I, BK):
            kk = k0 + tl.arange(0, NG)[None, :, None] * GW + tl.arange(0, GW)[None, None, :]
            hk = tl.load(h_row + kk, mask=kk < I, other=0.0)  # [1, NG, GW] fp32
            raw = _load_w(blob, rows, rmask, k0, I, BITS, WDT, NQ, Q_OFF, GW, NG)
            acc += _dequant(raw, blob, rows, rmask, k0, I, BITS, NQ, S_OFF, Z_OFF, GS, GW, NG) * hk
        y = _sum(_sum(acc, 2), 1)  # [R]
    _down_out(y_row, blob, y, rows, rmask, weight, BDT, HAS_BIAS, B_OFF)


@triton.jit
def down_kernel(h, w, pools, strides, ids, y, H: tl.constexpr, I: tl.constexpr, METAS: tl.constexpr,
                R: tl.constexpr, BK: tl.constexpr, fbits, XQ: tl.constexpr):
    """Grid (T*k, blocks): y[q, pair, :H] = w[pair] * (down(h[q, pair]) + bias) where the pair has a slot
    (h in quads with XQ: only where every pool of the launch is read as words)."""
    pair = tl.program_id(0)
    b = tl.program_id(1)
    weight = tl.load(w + pair).to(tl.float32)
    for q in tl.static_range(len(METAS)):
        slot = tl.load(ids[q] + pair)
        if slot >= 0:
            blob = pools[q] + slot.to(tl.int64) * strides[q]
            row = (q * tl.num_programs(0) + pair).to(tl.int64)
            M: tl.constexpr = METAS[q]  # a constexpr, as in gate_up_kernel
            if M[30]:  # mode 3 and a layout it takes
                _down_words(h + row * I, blob, y + row * H, b, weight, H, I, M, R, fbits, XQ)
            else:
                _down_one(h + row * I, blob, y + row * H, b, weight, H, I, M, R, BK)


@triton.jit
def combine_kernel(y, ids, out, TK, PAIRS, H: tl.constexpr, NP: tl.constexpr, B: tl.constexpr):
    """Grid (T, blocks): out[t] = the sum of y[q, t*k + j] over the pairs that ran, in out's dtype.
    Pairs without a slot are never read: their rows of y were not written."""
    t = tl.program_id(0)
    cols = tl.program_id(1) * B + tl.arange(0, B)
    cmask = cols < H
    acc = tl.full((B,), 0.0, tl.float32)
    for q in tl.static_range(NP):
        for j in range(TK):
            pair = t * TK + j
            if tl.load(ids[q] + pair) >= 0:
                acc += tl.load(y + (q * PAIRS + pair).to(tl.int64) * H + cols, mask=cmask, other=0.0)
    if out.dtype.element_ty == tl.bfloat16:
        tl.store(out + t * H + cols, _round_bf16(acc), mask=cmask)
    else:
        tl.store(out + t * H + cols, acc.to(out.dtype.element_ty), mask=cmask)


@triton.jit
def _round_bf16(v):
    """fp32 -> bf16 rounded to nearest even, spelled out: what the GPU's conversion does, where
    Triton's CPU interpreter truncates (so both give torch's `.bfloat16()`)."""
    bits = v.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    bits = tl.where(v != v, 0x7FC0, bits)  # NaN stays NaN (its low bits could carry it to inf)
    return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
