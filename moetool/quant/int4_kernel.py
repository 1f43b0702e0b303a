"""INT4 and INT2 experts through torch's packed-int4 CPU matmul (`aten._weight_int4pack_mm_for_cpu`,
the tinygemm layout torchao's int4 weight-only quantization uses), without dequantizing the weights.

A bundle's INT4 blob (hqq codes, fp16 scale and zero per group of input columns) is rewritten in
place, once, when it lands in a CPU pool slot: the codes become the kernel's packed layout (the same
N*K/2 bytes), and the scale and zero parts become the kernel's bf16 scale and zero point, each
[K/g, N] in the same 2 bytes per group. The kernel computes w = (q - 8) * s + zp; hqq's
w = (q - z) * s gives zp = (8 - z) * s. The blob keeps its size, so pools, staging buffers and the
budget are unchanged.

INT2 codes (0..3) are INT4 codes too, so the same kernel computes an INT2 expert; only the packing
differs (four codes a byte instead of two). An INT2 blob keeps its N*K/4 code bytes: they are
reordered once, as it lands, so that each byte expands to two bytes of the kernel's layout (each
code raised by INT2_BASE, see there) by a table lookup per two bytes (`expand`, per use, into a
[N, K/2] scratch the size of an INT4 expert's codes, a sixteenth of a bf16 expert's bytes: inside the budget's decode
workspace, which is sized for dequantized experts). Scale and zero are converted as for INT4. The
kernel's packed order is not documented: `_pack_order` reads it off the conversion op itself, so
it holds on any CPU build (AVX2 and AVX-512 pack differently).

Measured (scripts/bench_engine.py, kernels section, 2-core CPU): the kernel's fast path takes bf16
activations; with fp32 ones it is ~10x slower than its bf16 path. Under fp32 compute the engine
hands the kernel the activations rounded to bf16 and takes its bf16 output back to fp32 (what
torchao's int4 weight-only path does for a bf16 model): within the tolerance stated in
tests/test_int4_kernel.py of the fp32 dequantize path, and far inside the INT4/INT2 weights' own
error. Used on a CPU only, and only where the shape rules hold (output rows a multiple of 16, groups
of 32/64/128/256 input columns, hqq axis 1, scale and zero back to back).

    reason = unsupported(layout, torch.device("cpu"), torch.bfloat16)   # None: usable
    convert_(blob, layout)                                               # once, in place
    y = expert_forward(x, kernel_weights(blob, layout), act)             # x [n, H]
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import torch

from moetool.quant.format import PACKING_BY_NAME, Layout, views

GROUPS = (32, 64, 128, 256)  # the group sizes the kernel takes
SERVED_DTYPES = (torch.bfloat16, torch.float32)  # compute dtypes it serves (fp32: activations rounded to bf16)
PACKINGS = ("4bit_u8", "2bit_u8")  # hqq's INT4 and INT2 packings
_INNER_K_TILES = 8  # the packing's inner K tiles (what torchao's CPU int4 layout uses)
# INT2 codes 0..3 enter the kernel as 6..9, around its own offset of 8: its bf16 zero point
# zp = (8 - 6 - z) * s then stays under one step, as INT4's does. With 0..3 it would be ~6 steps and
# its bf16 rounding alone ~3% of the weights' range (measured), against ~0.7% this way.
INT2_BASE = 6


def cpu_kernel_unsupported(device: torch.device, dtype: torch.dtype, op: str, kernel: str) -> str | None:
    """Why torch's CPU op `op` (the `kernel` one) cannot serve `dtype` compute on `device`, or None:
    the rules this module and `int8_kernel` share (CPU, bf16 or fp32 compute, the op in this torch)."""
    if device.type != "cpu":
        return f"the {kernel} kernel here is the CPU one"
    if dtype not in SERVED_DTYPES:
        return f"the kernel serves bf16 and fp32 compute, not {dtype}"
    if not hasattr(torch.ops.aten, op):
        return f"this torch has no {kernel} CPU kernel"
    return None


def unsupported(layout: Layout, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the kernel cannot run experts of this INT4 or INT2 layout on `device` in `dtype`, or None."""
    reason = cpu_kernel_unsupported(device, dtype, "_weight_int4pack_mm_for_cpu", "packed-int4")
    if reason:
        return reason
    if sys.byteorder != "little" and layout.bits == 2:
        return "INT2 codes are expanded for a little-endian host"
    for proj in layout.projections:
        n, k = proj.shape
        if proj.packing not in PACKINGS or proj.axis != 1:
            return f"the {proj.name} projection is not hqq INT4 or INT2 grouped along its input columns"
        if proj.group_size not in GROUPS or k % proj.group_size:
            return f"the {proj.name} projection's group size {proj.group_size} is not one of {GROUPS}"
        if n % 16:
            return f"the {proj.name} projection has {n} output rows, not a multiple of 16"
        scale, zero = layout.part(f"{proj.name}.scale"), layout.part(f"{proj.name}.zero")
        if scale.offset + scale.nbytes != zero.offset:  # the kernel reads (scale, zero point) interleaved
            return f"the {proj.name} projection's scale and zero are not back to back in the blob"
    return None


@dataclass(frozen=True)
class KernelWeights:
    """A converted blob's tensors, as views of it: per projection (codes, group size, scales and zero
    points [K/g, N, 2] bf16), then the biases (None without), and whether the codes are INT2 bytes
    [N, K/4] that `expert_forward` expands per use, or the kernel's packed INT4 [N, K/2] already."""

    gate_up: tuple[torch.Tensor, int, torch.Tensor]
    down: tuple[torch.Tensor, int, torch.Tensor]
    gate_up_bias: torch.Tensor | None
    down_bias: torch.Tensor | None
    int2: bool = False


def _scales_and_zeros(blob: torch.Tensor, layout: Layout, proj) -> torch.Tensor:
    n, k = proj.shape
    scale = layout.part(f"{proj.name}.scale")
    return blob[scale.offset:scale.offset + 2 * scale.nbytes].view(torch.bfloat16).view(k // proj.group_size, n, 2)


@lru_cache(maxsize=64)
def _pack_order(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the conversion op puts each weight: for every byte of the packed [N, K/2], the flat
    (row-major [N, K]) index of the weight in its low and in its high nibble. Read off the op by
    packing the indices four bits at a time (the packing moves codes, it never mixes them)."""
    index = torch.arange(n * k, dtype=torch.int64).view(n, k)
    lo = torch.zeros(n * k // 2, dtype=torch.int64)
    hi = torch.zeros_like(lo)
    for shift in range(0, max(1, (n * k - 1).bit_length()), 4):
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(((index >> shift) & 15).to(torch.int32),
                                                                    _INNER_K_TILES).view(-1).to(torch.int64)
        lo |= (packed & 15) << shift
        hi |= (packed >> 4) << shift
    return lo, hi


_NIBBLE_BASE = int("0x" + f"{INT2_BASE:x}" * 8, 16)  # INT2_BASE in every nibble of an int32


def _spread(pairs: torch.Tensor) -> torch.Tensor:
    """Two INT2 code bytes (eight 2-bit codes, as int32 values 0..65535) -> the four kernel bytes they
    stand for, as an int32: each 2-bit code spread into its own nibble (the usual bit-interleave by
    shifts and masks) and raised by INT2_BASE. Little-endian: code j lands in nibble j, byte j // 2."""
    x = (pairs | (pairs << 8)) & 0x00FF00FF
    x = (x | (x << 4)) & 0x0F0F0F0F
    x = (x | (x << 2)) & 0x33333333
    return x + _NIBBLE_BASE


# Every pair of code bytes, spread once (256 KiB): per use, expanding is a table lookup per pair,
# two ops whatever the size, where spreading takes ten (measured: scripts/bench_engine.py kernels).
_PAIRS = _spread(torch.arange(1 << 16, dtype=torch.int32))


def expand(codes: torch.Tensor) -> torch.Tensor:
    """Reordered INT2 code bytes [..., M] (uint8, M even) -> the kernel's packed INT4 bytes [..., 2M]
    (a new tensor), one table lookup per two bytes."""
    pairs = codes.view(torch.uint16).reshape(-1).to(torch.int32)
    return _PAIRS.index_select(0, pairs).view(torch.uint8).view(*codes.shape[:-1], 2 * codes.shape[-1])


@torch.no_grad()
def convert_(blob: torch.Tensor, layout: Layout) -> None:
    """Rewrite one INT4 or INT2 blob (uint8, on the CPU) from hqq's layout into the kernel's, in place."""
    v = views(blob, layout)
    for proj in layout.projections:
        n, k = proj.shape
        g = proj.group_size
        codes = torch.empty(proj.grouped_shape(), dtype=torch.uint8)  # [N*K/g, g]
        PACKING_BY_NAME[proj.packing].unpack(v[f"{proj.name}.q"], codes)
        if proj.packing == "4bit_u8":
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.view(n, k).to(torch.int32), _INNER_K_TILES)
            v[f"{proj.name}.q"].view(-1).copy_(packed.view(-1))  # N*K/2 bytes either way
        else:  # INT2: the byte t holds what expands to kernel bytes 2t and 2t+1 (`expand`)
            lo, hi = _pack_order(n, k)
            flat = codes.view(-1)
            c = [flat.index_select(0, order[j::2]) for j in (0, 1) for order in (lo, hi)]  # c0, c1, c2, c3
            v[f"{proj.name}.q"].view(-1).copy_(c[0] | c[1] << 2 | c[2] << 4 | c[3] << 6)  # N*K/4 bytes
        base = 0 if proj.packing == "4bit_u8" else INT2_BASE  # the kernel sees code + base
        scale = v[f"{proj.name}.scale"].float().view(n, k // g)
        zero = v[f"{proj.name}.zero"].float().view(n, k // g) + base
        # hqq's (scale, zero) -> the kernel's interleaved (scale, zero point), over the same bytes.
        _scales_and_zeros(blob, layout, proj).copy_(torch.stack((scale.T, ((8 - zero) * scale).T), -1))


def kernel_weights(blob: torch.Tensor, layout: Layout) -> KernelWeights:
    """Views of a converted blob for `expert_forward` (no copy: they stay valid while the slot holds
    an expert of this layout, so a caller may keep them per slot)."""
    v = views(blob, layout)
    per = []
    for proj in layout.projections:
        n, k = proj.shape
        per_byte = PACKING_BY_NAME[proj.packing].per_byte
        per.append((v[f"{proj.name}.q"].reshape(-1).view(n, k // per_byte), proj.group_size,
                    _scales_and_zeros(blob, layout, proj)))
    return KernelWeights(per[0], per[1], v.get("gate_up_bias"), v.get("down_bias"),
                         int2=layout.projections[0].packing == "2bit_u8")


def expert_forward(x: torch.Tensor, w: KernelWeights, act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """One expert on rows `x` [T, H]: down(act(gate_up(x))), biases added, in bf16 (fp32 rows are
    rounded to bf16 on the way in; the caller takes the bf16 result into its own dtype)."""
    gate_up, down = w.gate_up, w.down
    if w.int2:  # per use: the [N, K/2] kernel codes of this expert, a scratch the caller drops
        gate_up = (expand(gate_up[0]), *gate_up[1:])
        down = (expand(down[0]), *down[1:])
    x = x.to(torch.bfloat16)
    h = torch.ops.aten._weight_int4pack_mm_for_cpu(x, *gate_up)  # [T, 2I]
    if w.gate_up_bias is not None:
        h = h + w.gate_up_bias.to(torch.bfloat16)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(act(h), *down)  # [T, H]
    if w.down_bias is not None:
        y = y + w.down_bias.to(torch.bfloat16)
    return y


# ---- one token, many experts: one kernel call per projection ------------------------------------


def _packed_nibbles(nib: torch.Tensor, n: int, k: int, axis: int) -> torch.Tensor:
    """What the conversion op makes of an [n, k] weight whose codes are `nib` [n or k] along `axis`
    (the same code across each row, or down each column): the packed bytes, flat [n*k/2]."""
    codes = (nib.view(-1, 1) if axis == 0 else nib.view(1, -1)).expand(n, k).contiguous()  # [n, k] int32
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, _INNER_K_TILES).view(-1)


@lru_cache(maxsize=64)
def block_rows(n: int, k: int) -> int | None:
    """B where the kernel packs [n, k] weights as [n/B, k, B/2] bytes (row block, then input column,
    then the block's rows in pairs: low nibble row j, high nibble row j + B/2), else None. In that
    form experts stack along the rows by concatenation and along the input columns by concatenating
    each row block's bytes, which `fused_forward` relies on.

    Read off the op, as `_pack_order`, but without its [n*k] index tensors (8 bytes a weight, and
    `fusable` asks about several experts stacked): the op packs weights whose code is four bits of
    their row index, then four bits of their column index, a pass for each; each nibble's source row
    and column are then known, and are compared with the block form's. The op moves codes and never
    mixes them, so this is exact. Holds [n, k] int32 codes and their packing for one pass at a time."""
    candidates = [b for b in (16, 32, 64, 128) if n % b == 0]
    for axis, size in ((0, n), (1, k)):
        index = torch.arange(size, dtype=torch.int32)
        for shift in range(0, max(1, (size - 1).bit_length()), 4):
            nib = (index >> shift) & 15  # [size]: the code of every weight in that row (column)
            packed = _packed_nibbles(nib, n, k, axis)  # [n*k/2] uint8
            kept = []
            for b in candidates:
                if axis == 0:  # byte (block, col, j): rows block*B + j (low) and block*B + j + B/2 (high)
                    rows = nib.view(n // b, 2, b // 2)
                    want = (rows[:, 0] | rows[:, 1] << 4).to(torch.uint8).unsqueeze(1)  # [n/B, 1, B/2]
                else:  # both nibbles of byte (block, col, j) come from column col
                    want = (nib * 17).to(torch.uint8).view(1, k, 1)  # [1, K, 1]
                if bool((packed.view(n // b, k, b // 2) == want).all()):
                    kept.append(b)
            candidates = kept
            if not candidates:
                return None
    return candidates[0] if candidates else None


def fusable(layout: Layout, experts: int) -> bool:
    """Whether up to `experts` experts of this layout run as one kernel call per projection for a
    single token (`fused_forward`): no biases, and the packing in the block form for each projection
    alone and stacked `experts` times (rows for gate_up, input columns for down). `experts` is the
    most a call stacks, the layer's top-k: asked of all the model's experts, the check's own
    tensors would grow with the model (issue 46: 2.3 GiB at 64 experts of 1024x1024 and 1024x512)."""
    if any(p.name.endswith("bias") for p in layout.parts):
        return False
    (gn, gk), (dn, dk) = (p.shape for p in layout.projections)
    b = block_rows(gn, gk)
    return b is not None and b == block_rows(dn, dk) == block_rows(gn * experts, gk) == block_rows(dn, dk * experts)


def fused_forward(x: torch.Tensor, gate_up: tuple[torch.Tensor, int, torch.Tensor],
                  down: tuple[torch.Tensor, int, torch.Tensor], weight: torch.Tensor,
                  act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """n experts on one token, summed with their routing weights: sum_i w_i down_i(act(gate_up_i(x))).

    x [1, H]; gate_up (codes [n, 2I, H/2] uint8 in the kernel's packing, group, scales and zero
    points [n, H/g, 2I, 2] bf16); down (codes [n, H, I/2], group, [n, I/g, H, 2]); weight [n].
    Gate_up stacks the experts' rows: one [n*2I, H] weight. Down stacks their input columns: one
    [H, n*I] weight, so the kernel's own accumulation sums the experts. Returns [1, H] bf16.
    """
    codes, group, sz = gate_up
    n, rows, half = codes.shape
    sz = sz.transpose(0, 1).reshape(sz.shape[1], n * rows, 2)  # [H/g, n*2I, 2]
    h = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), codes.reshape(n * rows, half), group, sz)
    a = act(h.view(n, rows)).mul_(weight.to(torch.bfloat16).unsqueeze(1))  # [n, I], weighted
    codes, group, sz = down
    hidden, ihalf = codes.shape[1:]
    b = block_rows(hidden, 2 * ihalf)
    # [n, H/B, I*B/2] -> [H/B, n, I*B/2]: each row block's bytes for every expert's columns, in turn.
    codes = codes.view(n, hidden // b, ihalf * b).transpose(0, 1).reshape(hidden, n * ihalf)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(a.reshape(1, -1), codes, group, sz.reshape(-1, hidden, 2))


# ---- several tokens: the converted experts decoded for a grouped GEMM ---------------------------


def decode(codes: torch.Tensor, group: int, sz: torch.Tensor, dtype: torch.dtype, int2: bool = False) -> torch.Tensor:
    """Weights [n, N, K] in `dtype` from n experts' kernel tensors for one projection (codes
    [n, N, K/2] in the kernel's packing, or with `int2` the reordered INT2 bytes [n, N, K/4]; scales
    and zero points [n, K/g, N, 2]): w = (q - 8) * s + zp, the kernel's own formula. For several
    tokens, where one grouped GEMM over decoded weights beats two kernel calls per expert (measured:
    a 256-token prompt on the demo, 1.16x slower per expert for INT4, 1.26x for INT2, in fp32).
    Unpacks by the block form (`block_rows`) where it holds, INT2 straight from its 2-bit codes,
    else scatters by `_pack_order` (INT2 expanded first)."""
    n, rows = codes.shape[:2]
    cols = codes.shape[2] * (4 if int2 else 2)
    b = block_rows(rows, cols)
    if b is not None and int2:  # [n, N/B, K, B/4] bytes: byte t's codes are rows 2t, B/2 + 2t, 2t + 1, B/2 + 2t + 1
        packed = codes.reshape(n, rows // b, cols, b // 4)
        c = [(packed >> shift) & 3 for shift in (0, 2, 4, 6)]
        low = torch.stack((c[0], c[2]), dim=-1).flatten(-2)  # rows 0..B/2 of each block
        high = torch.stack((c[1], c[3]), dim=-1).flatten(-2)  # rows B/2..B
        q = torch.cat((low, high), dim=-1).transpose(-2, -1)  # [n, N/B, B, K], codes without INT2_BASE
        base = 8 - INT2_BASE
    elif b is not None:  # [n, N/B, K, B/2] bytes: low nibbles rows j, high nibbles rows j + B/2 of each block
        packed = codes.reshape(n, rows // b, cols, b // 2)
        q = torch.cat((packed & 15, packed >> 4), dim=-1).transpose(-2, -1)  # [n, N/B, B, K]
        base = 8
    else:  # any other packing: scatter by the order read off the op
        packed = (expand(codes) if int2 else codes).reshape(n, -1)
        lo, hi = _pack_order(rows, cols)
        q = torch.empty(n, rows * cols, dtype=torch.uint8, device=codes.device)
        q.index_copy_(1, lo, packed & 15)
        q.index_copy_(1, hi, packed >> 4)
        base = 8
    w = q.reshape(n, rows, cols // group, group).to(dtype)
    sz = sz.to(dtype).permute(0, 2, 1, 3).unsqueeze(3)  # [n, N, K/g, 1, 2]
    return w.sub_(base).mul_(sz[..., 0]).add_(sz[..., 1]).view(n, rows, cols)
