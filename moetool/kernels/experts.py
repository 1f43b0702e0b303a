"""One MoE layer's experts at small batch, straight from the residency's slot pools: a fused Triton
kernel family for every stored precision (bf16 reference, HQQ INT8/INT4/INT2), in three launches a
layer whatever the precision mix, as `torch.library` custom ops that `torch.compile(fullgraph=True)`
traces and CUDA graphs capture.

    spec = activation_of(block.experts)
    out = experts_forward(hidden, routing_weights,                       # [T, H], [T, k]
                          [SlotPool(pool16, layout16, ids16), SlotPool(pool4, layout4, ids4)], spec)

Contract:
- `hidden` [T, H] (bf16, fp16 or fp32; T small: decode, up to ~16 rows) and `routing_weights`
  [T, k] (any float dtype) on the pools' device. Returns [T, H] in hidden's dtype.
- One `SlotPool` per precision: `data` uint8 [slots, slot_bytes] (rows may be strided, bytes
  contiguous), each row one expert's blob in `layout`; `ids` int32 [T, k], contiguous: the row of
  `data` that holds the expert of (token t, routing slot j) at this precision, or -1 (skipped, or
  held at another precision). Ids must be < slots: they are not checked (that would read them on
  the host).
- Blobs are read in the bundle's own layout (`quant.format`), nothing converted when a slot fills:
  hqq's packing already puts the `per` rows of a byte row in one contiguous run of K bytes, and a
  row's fp16 scales and zeros side by side, so a GEMV reads each byte once, in 16-byte loads; and
  identical bytes on host and device keep zero-copy (UVA) reads of host slots possible later.
- out[t] = sum over precisions and j with ids[t, j] >= 0 of w[t, j] * down(act(gate_up(x[t]) + b) + b):
  a pair with a slot in two pools counts twice; a pair with none adds nothing.
- Every layout of one call has the same gate_up [N1, H] and down [H, I] shapes, hqq axis 1.
- The activation is the block's own (`activation.activation_of`). A recognised one runs in the
  first kernel's epilogue; `Act.NONE` runs the block's function between the first two launches.
- Three launches a layer for all precisions together (gate_up + activation; down, biased and
  weighted; the sum over k and the pools), each pair of (token, slot) read by index (gather, no
  sort): meant for decode batches. Prefill's hundreds of rows belong to grouped GEMMs, which read
  each expert once instead of once per row.
- A layout or activation the kernels cannot take raises ValueError naming why (`supported` asks
  first); nothing falls through to a wrong result.
- Nothing reads the routing on the host and nothing allocates by it: outputs and scratch depend on
  T, k, H, I and the number of pools only. The ops are functional (no argument is mutated).
- Arithmetic is fp32: weights dequantized in fp32 as `quant.format.dequantize_parts` does, fp32
  accumulation, biases and the weighted sum in fp32, one rounding to hidden's dtype at the end.
  So it is not bit-exact against transformers' bf16 kernels (each rounds between steps); against
  the fp32 dequantize reference it differs only by summation order (tests/test_triton_experts.py).

`supported(layout, activation, device)` says why a layout cannot go through, or None; on a CPU the
kernels run only under `TRITON_INTERPRET=1` (tests; the interpreter is a checker, not a timing).
Tiles, warps and loop mode: the caller's `config`, else the device's tuned file (`config.tuned_config`,
written by `scripts/bench_kernels.py --tune`), else `default_config`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch

from moetool.kernels.activation import Act, Activation
from moetool.kernels.config import checked_config, default_config, tuned_config
from moetool.quant.format import PACKING_BY_NAME, Layout

NO_PART = 0  # offset given for a part a layout lacks (never read: its flag is off)


@dataclass(frozen=True)
class SlotPool:
    """One precision's experts for one call: the pool, the layout of the layer's blobs at that
    precision, and the pool row of every (token, routing slot), -1 where there is none."""

    data: torch.Tensor  # uint8 [slots, slot bytes]
    layout: Layout
    ids: torch.Tensor  # int32 [T, k]


def _interpreted() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    from moetool.kernels import triton_experts

    return isinstance(triton_experts.gate_up_kernel, InterpretedFunction)


def supported(layout: Layout, activation: Activation, device: torch.device | str) -> str | None:
    """Why `layout`'s experts cannot run through the kernels on `device` with `activation`, or None."""
    device = torch.device(device)
    try:
        import triton  # noqa: F401
    except ImportError:
        return "Triton is not installed (it comes with CUDA builds of torch; `pip install triton` elsewhere)"
    if device.type != "cuda" and not (device.type == "cpu" and _interpreted()):
        return f"the Triton kernels run on CUDA devices (on a CPU only under TRITON_INTERPRET=1), not {device.type}"
    return _layout_refusal(layout) or _activation_refusal(layout, activation)


def _activation_refusal(layout: Layout, activation: Activation) -> str | None:
    n1, down = layout.projections[0].shape[0], layout.projections[1].shape
    if activation.gated and (n1 % 2 or down[1] != n1 // 2):
        return f"a gated gate_up of {n1} rows does not feed a down projection {list(down)}"
    if not activation.gated and down[1] != n1:
        return f"an ungated gate_up of {n1} rows does not feed a down projection {list(down)}"
    if activation.kind == Act.NONE and activation.fn is None:
        return "an unrecognised activation needs the block's own function (Activation.fn)"
    return None


@lru_cache(maxsize=256)
def _layout_refusal(layout: Layout) -> str | None:
    """Why the kernels cannot read blobs of `layout`, or None (whatever the device and activation)."""
    gate_up, down = layout.projections
    if down.shape[0] != gate_up.shape[1]:
        return f"down's {down.shape[0]} output rows are not gate_up's input width {gate_up.shape[1]}"
    for proj in layout.projections:
        if proj.axis != 1:
            return f"the {proj.name} projection is grouped along hqq axis 0; the kernels read axis 1"
        if proj.packing == "bf16":
            dtype = layout.part(proj.name).dtype
            if dtype not in _wdtypes():
                return f"the {proj.name} projection is stored as {dtype}, not bf16, fp16 or fp32"
            continue
        if proj.packing not in PACKING_BY_NAME:
            return f"the {proj.name} projection's packing {proj.packing} is not hqq's 8/4/2-bit one"
        per = PACKING_BY_NAME[proj.packing].per_byte
        if proj.shape[0] % per:  # the kernels find a row's byte as row % (N / per)
            return f"the {proj.name} projection's {proj.shape[0]} rows do not split into {per} byte slices"
    for name in ("gate_up_bias", "down_bias"):
        if any(p.name == name for p in layout.parts) and layout.part(name).dtype not in _wdtypes():
            return f"the {name} is stored as {layout.part(name).dtype}"
    return None


def _wdtypes() -> dict[str, int]:
    from moetool.kernels.triton_parts import WDTYPES

    return WDTYPES


# ---- per-layout constants: what the ops take as plain ints -------------------------------------

LAYOUT_INTS = 16  # ints per precision in the ops' `layouts` argument


@lru_cache(maxsize=256)
def layout_ints(layout: Layout) -> tuple[int, ...]:
    """The layout as the ops take it: (bits, weight dtype, bias dtype, has bias, then per projection
    codes/scale/zero offsets and group size, then the bias offsets, gate_up rows N1, down's I)."""
    wdt = _wdtypes()
    names = {p.name for p in layout.parts}
    has_bias = "gate_up_bias" in names
    out = [layout.bits, 0, wdt[layout.part("gate_up_bias").dtype] if has_bias else 0, int(has_bias)]
    for proj in layout.projections:
        if proj.packing == "bf16":
            part = layout.part(proj.name)
            out[1] = wdt[part.dtype]
            out += [part.offset, NO_PART, NO_PART, 0]
        else:
            out += [layout.part(f"{proj.name}.{s}").offset for s in ("q", "scale", "zero")] + [proj.group_size]
    out += [layout.part(n).offset if has_bias else NO_PART for n in ("gate_up_bias", "down_bias")]
    out += [layout.projections[0].shape[0], layout.projections[1].shape[1]]
    return tuple(out)


def _pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two that divides n, at most cap."""
    return min(n & -n, cap)


def _slices(bits: int, span: int) -> int:
    """How many of a byte row's slices one program takes (`_lanes`' SL): `per`, or the largest power
    of two under it that divides the `span` rows its lanes are laid over (any SL is correct; `per`
    reads each byte once)."""
    per = 1 if bits == 16 else 8 // bits
    while per > 1 and span % per:
        per //= 2
    return per


@lru_cache(maxsize=256)
def kernel_meta(ints: tuple[int, ...], hidden: int, gated: bool, interleaved: bool, bk1: int, bk2: int,
                mode: int = 0) -> tuple:
    """The kernels' compile-time constants for one precision (`triton_experts`' M[0..30])."""
    bits, wdt, bdt, has_bias, gq, gsc, gz, ggs, dq, dsc, dz, dgs, gb, db, n1, inter = ints
    gw1 = bk1 if bits == 16 else _pow2_divisor(ggs, bk1)
    gw2 = bk2 if bits == 16 else _pow2_divisor(dgs, bk2)
    per = 1 if bits == 16 else 8 // bits
    if gated and not interleaved:
        sl1 = 1 if bits == 16 else max(per // 2, 1)  # a byte row holds gate rows and their up rows
    else:
        sl1 = _slices(bits, inter if gated else n1)
    sl2 = _slices(bits, hidden)
    shared = int(bits != 16 and gated and not interleaved and per >= 2)
    # Mode 3 reads packed codes as 32-bit words in chunks of GW columns of one group (16, 32 or 64:
    # 1-4 sub-tiles of 16 columns a thread), so a projection goes that way only where its codes and
    # rows sit on 4-byte boundaries and whole chunks tile its input; else mode 1's loop reads it.
    # (Interleaved gate_up rows, gpt_oss's, put a neuron's gate and up in two byte rows: mode 1.)
    ww1 = _words_chunk(bits, gq, ggs, hidden, bk1) if mode == 3 and not interleaved else 0
    ww2 = _words_chunk(bits, dq, dgs, inter, bk2) if mode == 3 else 0
    fallback = 1 if mode == 3 else mode
    return (bits, wdt, bdt, has_bias, gq, gsc, gz, ggs or 1, dq, dsc, dz, dgs or 1, gb, db,
            gw1, bk1 // gw1, gw2, bk2 // gw2, sl1, sl2, shared, hidden // per, n1 // per, bk1, bk2, fallback,
            int(ww1 > 0), ww1, ww2, 15, int(ww2 > 0))


def _words_chunk(bits: int, offset: int, group: int, width: int, bk: int) -> int:
    """Mode 3's chunk of input columns for a packed projection at byte `offset` with groups of `group`
    over `width` inputs and K tiles of `bk`: the largest of 64, 32, 16 dividing all three, or 0 (then
    the projection takes mode 1's loop)."""
    if bits == 16 or offset % 4:
        return 0
    return next((gw for gw in (64, 32, 16) if group % gw == 0 and width % gw == 0 and bk % gw == 0), 0)


# ---- the ops -------------------------------------------------------------------------------------


def _metas(layouts: list[int], hidden: int, gated: bool, interleaved: bool, bk1: int, bk2: int, mode: int) -> tuple:
    n = LAYOUT_INTS
    return tuple(kernel_meta(tuple(layouts[i:i + n]), hidden, gated, interleaved, bk1, bk2, mode)
                 for i in range(0, len(layouts), n))


def _config(config: list[int], device: torch.device, layouts: list[int], hidden: int) -> tuple[int, ...]:
    """`config` (six fields, or seven with the mode), else the device's tuned one for this shape and
    precisions (`tuned_config`), else `default_config`."""
    if not config:
        bits = tuple(layouts[i] for i in range(0, len(layouts), LAYOUT_INTS))
        return tuned_config(device, hidden, layouts[15], bits) or default_config(device)
    return checked_config(config)


# 0.5's fp32 bits: mode 3 or-s codes into them (`triton_words._field`). An argument, not a
# constant, so the GPU's and-or is one instruction (a register operand where an immediate would be
# a second one).
HALF_BITS = 0x3F000000


def _aligned_mode(mode: int, pools: list[torch.Tensor]) -> int:
    """Mode 3 reads codes as 4-byte words: a pool whose slots do not start on 4-byte boundaries takes
    mode 1 instead (what the slot addresses are is known here without reading the device)."""
    if mode == 3 and any(p.data_ptr() % 4 or p.stride(0) % 4 for p in pools):
        return 1
    return mode


def quads(metas: tuple, act: int) -> tuple[bool, bool]:
    """(x in quads, h in quads) for a launch's metas: mode 3 reads a thread's x for four words as four
    16-byte loads where x is kept in quads (`triton_parts._quads`: column 4w + b at b K/4 + w), and
    as sixteen 4-byte loads where it is kept as stored. Only where every pool of the launch reads
    that projection as words (the others' loops read x as stored); h only where the first kernel
    writes it (not the block's own activation, `Act.NONE`, which reads and writes it as stored)."""
    return all(m[26] for m in metas), act != Act.NONE and all(m[30] for m in metas)


def _in_quads(x: torch.Tensor) -> torch.Tensor:
    """x [T, K] as fp32 in quads (`quads`): one copy, the conversion to fp32 mode 3 makes anyway."""
    T, K = x.shape
    out = torch.empty((T, 4, K // 4), dtype=torch.float32, device=x.device)
    out.copy_(x.view(T, K // 4, 4).transpose(1, 2))
    return out.view(T, K)


def gate_up_launch(x: torch.Tensor, pools: list[torch.Tensor], ids: list[torch.Tensor], layouts: list[int], topk: int,
                   act: int, gated: bool, interleaved: bool, alpha: float, limit: float, config: list[int],
                   h: torch.Tensor) -> tuple:
    """(kernel, grid, args, options) of the first launch, writing `h` (what `experts_gate_up` runs, and
    what scripts/bench_kernels.py compiles ahead of time for a GPU it does not have)."""
    from moetool.kernels import triton_experts as tk

    hidden, (n1, inter) = x.shape[1], layouts[14:16]
    r1, bk1, _, bk2, _, warps, mode = _config(config, x.device, layouts, hidden)
    mode = _aligned_mode(mode, pools)
    metas = _metas(layouts, hidden, gated, interleaved, bk1, bk2, mode)
    xq, hq = quads(metas, act)
    if mode == 3:  # its x tiles are read in fp32 (one conversion here, not one a thread), in quads where it can
        x = _in_quads(x) if xq else x.float()
    span = inter if gated else n1
    blocks = max(-(-(span // m[18]) // (r1 // m[18])) for m in metas)
    args = (x, x.stride(0), tuple(pools), tuple(p.stride(0) for p in pools), tuple(ids), h, topk, hidden, inter, n1,
            h.shape[-1], metas, act, gated, interleaved, alpha, limit, r1, bk1, HALF_BITS, xq, inter // 4 if hq else 0)
    return tk.gate_up_kernel, (x.shape[0] * topk, blocks), args, {"num_warps": warps}


def down_launches(h: torch.Tensor, routing_weights: torch.Tensor, pools: list[torch.Tensor], ids: list[torch.Tensor],
                  layouts: list[int], hidden: int, config: list[int], y: torch.Tensor, out: torch.Tensor,
                  act: int) -> list[tuple]:
    """(kernel, grid, args, options) of the second and third launches, through `y` into `out` (`act`:
    the first launch's activation, which says whether it wrote h in quads)."""
    from moetool.kernels import triton_experts as tk

    T, topk = routing_weights.shape
    inter = layouts[15]
    _, bk1, r2, bk2, b3, warps, mode = _config(config, h.device, layouts, hidden)
    mode = _aligned_mode(mode, pools)
    metas = _metas(layouts, hidden, False, False, bk1, bk2, mode)  # down's constants do not depend on the gate
    _, hq = quads(metas, act)
    blocks = max(-(-(hidden // m[19]) // (r2 // m[19])) for m in metas)
    pool_args = (tuple(pools), tuple(p.stride(0) for p in pools), tuple(ids))
    return [(tk.down_kernel, (T * topk, blocks),
             (h, routing_weights, *pool_args, y, hidden, inter, metas, r2, bk2, HALF_BITS, hq), {"num_warps": warps}),
            (tk.combine_kernel, (T, -(-hidden // b3)), (y, tuple(ids), out, topk, T * topk, hidden, len(pools), b3),
             {"num_warps": warps})]


def _gate_up_width(layouts: list[int], act: int, gated: bool) -> int:
    n1, inter = layouts[14:16]
    return inter if gated and act != Act.NONE else n1


@torch.library.custom_op("moetool::experts_gate_up", mutates_args=())
def experts_gate_up(x: torch.Tensor, pools: list[torch.Tensor], ids: list[torch.Tensor], layouts: list[int],
                    topk: int, act: int, gated: bool, interleaved: bool, alpha: float, limit: float,
                    config: list[int]) -> torch.Tensor:
    """[P, T*k, W] fp32: for each pool q and pair (t, j) with a slot, act(gate_up(x[t]) + bias) (W = I),
    or gate_up's raw output rows (W = N1) with act = Act.NONE. Rows of pairs without a slot are garbage."""
    h = torch.empty((len(pools), x.shape[0] * topk, _gate_up_width(layouts, act, gated)), dtype=torch.float32,
                    device=x.device)
    if x.shape[0]:
        kernel, grid, args, options = gate_up_launch(x, pools, ids, layouts, topk, act, gated, interleaved, alpha,
                                                     limit, config, h)
        kernel[grid](*args, **options)
    return h


@experts_gate_up.register_fake
def _(x, pools, ids, layouts, topk, act, gated, interleaved, alpha, limit, config):
    return x.new_empty((len(pools), x.shape[0] * topk, _gate_up_width(layouts, act, gated)), dtype=torch.float32)


@torch.library.custom_op("moetool::experts_down", mutates_args=())
def experts_down(h: torch.Tensor, routing_weights: torch.Tensor, pools: list[torch.Tensor], ids: list[torch.Tensor],
                 layouts: list[int], hidden: int, out_dtype: torch.dtype, config: list[int], act: int) -> torch.Tensor:
    """[T, H] in out_dtype: sum over pools and pairs with a slot of w * (down(h[q, pair]) + bias), h as
    `experts_gate_up` wrote it with activation `act`."""
    T, topk = routing_weights.shape
    out = torch.empty((T, hidden), dtype=out_dtype, device=h.device)
    if T:
        y = torch.empty((len(pools), T * topk, hidden), dtype=torch.float32, device=h.device)  # [P, T*k, H]
        for kernel, grid, args, options in down_launches(h, routing_weights.contiguous(), pools, ids, layouts, hidden,
                                                         config, y, out, act):
            kernel[grid](*args, **options)
    return out


@experts_down.register_fake
def _(h, routing_weights, pools, ids, layouts, hidden, out_dtype, config, act):
    return h.new_empty((routing_weights.shape[0], hidden), dtype=out_dtype)


# ---- the call the engine makes -------------------------------------------------------------------


def experts_forward(hidden: torch.Tensor, routing_weights: torch.Tensor, pools: Sequence[SlotPool],
                    activation: Activation, config: Sequence[int] = ()) -> torch.Tensor:
    """The layer's experts on `hidden` [T, H] (see the module docstring): [T, H] in hidden's dtype.
    `config` overrides `default_config` (benchmarks and tests)."""
    if not pools:
        raise ValueError("experts_forward needs at least one slot pool")
    T, k = routing_weights.shape
    layouts: list[int] = []
    compiling = torch.compiler.is_compiling()  # then pure functions are traced once (dynamo looks through lru_cache)
    for p in pools:
        refusal = (_layout_refusal.__wrapped__ if compiling else _layout_refusal)(p.layout) or \
            _activation_refusal(p.layout, activation)
        if refusal:
            raise ValueError(f"the Triton experts kernels cannot take this layer: {refusal}")
        ints = (layout_ints.__wrapped__ if compiling else layout_ints)(p.layout)
        if layouts and (ints[14:] != tuple(layouts[14:LAYOUT_INTS]) or
                        p.layout.projections[0].shape != pools[0].layout.projections[0].shape):
            raise ValueError("the pools of one call must hold experts of one shape")
        if p.ids.shape != (T, k) or p.ids.dtype != torch.int32 or not p.ids.is_contiguous():
            raise ValueError(f"slot ids must be contiguous int32 [{T}, {k}], not {p.ids.dtype} {list(p.ids.shape)}")
        if p.data.dtype != torch.uint8 or p.data.dim() != 2 or p.data.stride(1) != 1:
            raise ValueError("a slot pool is uint8 [slots, slot bytes] with contiguous rows")
        layouts += ints
    if hidden.shape[-1] != pools[0].layout.projections[0].shape[1]:
        raise ValueError(f"hidden rows of {hidden.shape[-1]} do not match the experts' input width "
                         f"{pools[0].layout.projections[0].shape[1]}")
    data, ids, cfg = [p.data for p in pools], [p.ids for p in pools], list(config)
    h = torch.ops.moetool.experts_gate_up(hidden.contiguous(), data, ids, layouts, k, int(activation.kind),
                                          activation.gated, activation.interleaved, activation.alpha,
                                          activation.limit, cfg)  # [P, T*k, I] (or [P, T*k, N1] raw)
    if activation.kind == Act.NONE:  # the block's own function, between the two launches
        h = activation.fn(h).float().contiguous()  # [P, T*k, I]
        if h.shape[-1] != layouts[15]:
            raise ValueError(f"the block's activation gave {h.shape[-1]} columns, not down's input width {layouts[15]}")
    return torch.ops.moetool.experts_down(h, routing_weights, data, ids, layouts, hidden.shape[-1],
                                          hidden.dtype, cfg, int(activation.kind))
