"""The byte format of one expert at one precision: one contiguous, aligned uint8 blob.

A blob holds every tensor an expert needs at that precision back to back (gate_up codes, scales,
zeros, then down's, then biases), so moving an expert to the device is one host-to-device copy and
reading it back is a handful of zero-copy views. A `Layout` records where each part lies; it is
the same for every expert of a layer at a given precision, so the bundle stores it once.

    layout = make_layout(Bits.INT4, gate_up_shape=(32, 16), down_shape=(16, 16), has_bias=False, group_size=8)
    blob = encode(layout, weights, {"gate_up": q_gu, "down": q_down})   # uint8 [layout.nbytes]
    w = dequantize(blob, layout)                                         # ExpertWeights, fp32

Quantized weights use HQQ's affine grid, W ~ (q - zero) * scale per group, and HQQ's bit packing
(rows split into 8/bits slices, the first slice in the high bits), so a packed part can be handed
to hqq's own `Quantizer.dequantize` and kernels unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from moetool.bits import Bits
from moetool.errors import MoetoolError
from moetool.model import ExpertWeights
from moetool.schema import SchemaError

ALIGN = 64  # bytes; every part and every blob starts on a cache-line boundary (aligned typed views, fast DMA)
META_DTYPE = "float16"  # scales and zeros: what hqq keeps on the GPU; 2 bytes per group instead of 4
REF_DTYPE = "bfloat16"  # the 16-bit reference precision and every bias

DTYPES = {"uint8": torch.uint8, "float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
PROJECTIONS = ("gate_up", "down")


@dataclass(frozen=True)
class QTensor:
    """One projection quantized on the affine grid, before packing: W ~ (codes - zero) * scale."""

    codes: torch.Tensor  # uint8 in 0..2^b-1, grouped shape ([G, gs] for axis 1, [gs, G] for axis 0)
    scale: torch.Tensor  # [G, 1] or [1, G]; multiplies (codes - zero)
    zero: torch.Tensor  # same shape as scale


# ---- bit packing: hqq's layout, our code -------------------------------------------------------


def _pack_u8(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, C] codes -> [R * bits / 8, C] bytes; slice i of the rows goes to bits 8-bits*(i+1)."""
    per = 8 // bits
    step = codes.shape[0] // per
    codes = codes.to(torch.uint8)
    packed = codes[:step] << (8 - bits)  # [R/per, C]
    for i in range(1, per):
        packed |= codes[i * step:(i + 1) * step] << (8 - bits * (i + 1))
    return packed


def _unpack_u8(packed: torch.Tensor, bits: int, out: torch.Tensor) -> torch.Tensor:
    """Inverse of `_pack_u8`, writing (and casting) into `out` of shape [R, C]."""
    per = 8 // bits
    step = packed.shape[0]
    mask = (1 << bits) - 1
    for i in range(per):
        shift = 8 - bits * (i + 1)
        out[i * step:(i + 1) * step] = (packed >> shift) & mask if shift else packed & mask
    return out


def pack_8bit_u8(codes: torch.Tensor) -> torch.Tensor:
    return codes.to(torch.uint8)


def pack_4bit_u8(codes: torch.Tensor) -> torch.Tensor:
    return _pack_u8(codes, 4)


def pack_2bit_u8(codes: torch.Tensor) -> torch.Tensor:
    return _pack_u8(codes, 2)


def unpack_8bit_u8(packed: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    return out.copy_(packed)


def unpack_4bit_u8(packed: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    return _unpack_u8(packed, 4, out)


def unpack_2bit_u8(packed: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    return _unpack_u8(packed, 2, out)


@dataclass(frozen=True)
class Packing:
    name: str  # hqq's name for the same layout
    per_byte: int  # codes per byte
    pack: Callable[[torch.Tensor], torch.Tensor]  # codes [R, C] -> packed [R / per_byte, C]
    unpack: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (packed, out [R, C]) -> out


PACKINGS: dict[Bits, Packing] = {
    Bits.INT8: Packing("8bit_u8", 1, pack_8bit_u8, unpack_8bit_u8),
    Bits.INT4: Packing("4bit_u8", 2, pack_4bit_u8, unpack_4bit_u8),
    Bits.INT2: Packing("2bit_u8", 4, pack_2bit_u8, unpack_2bit_u8),
}
PACKING_BY_NAME = {p.name: p for p in PACKINGS.values()}


PREFERRED_GROUP = 64  # HQQ's and GPTQ's usual group; the bundle sizes quoted in the README are at 64


def auto_group_size(layers) -> int:
    """64, or the largest power of two under it that divides every expert's input widths.

    A projection's input width must split into whole groups: the demo model's experts are 16
    neurons wide, so its `down` projection takes group 16 (a real model's widths are multiples of 64).
    """
    widths = {w for g in layers for w in (g.hidden_size, g.intermediate_size)}
    return math.gcd(PREFERRED_GROUP, *widths)


# ---- layout -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Part:
    """One tensor inside a blob."""

    name: str  # "gate_up" / "down" (reference), "<proj>.q" / ".scale" / ".zero", "gate_up_bias", "down_bias"
    offset: int  # bytes from the start of the blob, a multiple of ALIGN
    nbytes: int
    dtype: str  # key of DTYPES
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Projection:
    """How one weight matrix is stored."""

    name: str  # "gate_up" or "down"
    shape: tuple[int, ...]  # the weight's own [out, in]
    packing: str  # "bf16" or a key of PACKING_BY_NAME
    group_size: int  # 0 for the reference
    axis: int  # hqq's axis: 1 groups consecutive input columns of a row, 0 strides over the flattened weight

    def grouped_shape(self) -> tuple[int, int]:
        groups = self.shape[0] * self.shape[1] // self.group_size
        return (groups, self.group_size) if self.axis == 1 else (self.group_size, groups)

    def meta_shape(self) -> tuple[int, int]:
        rows, cols = self.grouped_shape()
        return (rows, 1) if self.axis == 1 else (1, cols)


@dataclass(frozen=True)
class Layout:
    """Where every part of one expert at one precision lies in its blob."""

    bits: int
    nbytes: int  # padded to ALIGN so blobs can sit back to back
    projections: tuple[Projection, ...]
    parts: tuple[Part, ...]

    @property
    def per_channel(self) -> bool:
        """An INT8 layout with one scale and zero per output row (see `make_layout`)."""
        return self.bits == Bits.INT8 and all(len(p.shape) == 2 and p.group_size == p.shape[1] for p in self.projections)

    def part(self, name: str) -> Part:
        for p in self.parts:
            if p.name == name:
                return p
        raise KeyError(name)

    def validate(self) -> None:
        """On read: the layout must be the one `make_layout` gives for its own shapes and settings.

        A part's offset, dtype and shape decide which bytes `views` reinterprets; recomputing the
        layout is the one check that catches every hand edit before it misreads a blob (or fails
        inside a generation as a misaligned view).
        """
        choices = ", ".join(str(int(b)) for b in Bits)
        if self.bits not in {int(b) for b in Bits}:
            raise SchemaError("bits", f"is {self.bits}, not a stored precision ({choices})")
        if tuple(p.name for p in self.projections) != PROJECTIONS:
            raise SchemaError("projections", f"must be the {' and '.join(PROJECTIONS)} projections, in that order")
        gate_up, down = self.projections
        for i, proj in enumerate(self.projections):
            if len(proj.shape) != 2 or min(proj.shape) < 1:
                raise SchemaError(f"projections[{i}].shape", f"is {list(proj.shape)}, not a matrix shape [out, in]")
        has_bias = any(p.name == "gate_up_bias" for p in self.parts)
        try:
            expected = make_layout(self.bits, gate_up.shape, down.shape, has_bias, gate_up.group_size or 64, gate_up.axis,
                                   int8_per_channel=self.per_channel)
        except MoetoolError as e:
            raise SchemaError("projections", f"cannot be stored at {self.bits} bits ({str(e).rstrip('.')})") from None
        for i, (mine, theirs) in enumerate(zip(self.projections, expected.projections)):
            if mine != theirs:
                raise SchemaError(f"projections[{i}]", f"is not what this format stores for a {list(mine.shape)} "
                                                       f"projection at {self.bits} bits (packing {theirs.packing}, "
                                                       f"group size {theirs.group_size})")
        for i, (mine, theirs) in enumerate(zip(self.parts, expected.parts)):
            if mine != theirs:
                raise SchemaError(f"parts[{i}]", f"is not where this format puts {theirs.name} (offset "
                                                 f"{theirs.offset}, {theirs.nbytes} bytes of {theirs.dtype} "
                                                 f"{list(theirs.shape)})")
        if len(self.parts) != len(expected.parts):
            raise SchemaError("parts", f"lists {len(self.parts)} parts, not the {len(expected.parts)} of this layout")
        if self.nbytes != expected.nbytes:
            raise SchemaError("nbytes", f"is {self.nbytes}, not the {expected.nbytes} bytes this layout takes")


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _packable(packing: Packing, gate_up_shape: tuple[int, ...], down_shape: tuple[int, ...], axis: int) -> list[int]:
    """The group sizes up to PREFERRED_GROUP that divide both projections' input widths and pack both
    `packing.per_byte` codes to a byte, smallest first (a width with an odd factor can leave none)."""
    both = math.gcd(gate_up_shape[1], down_shape[1])
    return [g for g in range(1, min(both, PREFERRED_GROUP) + 1) if both % g == 0 and all(
        Projection("", tuple(shape), packing.name, g, axis).grouped_shape()[0] % packing.per_byte == 0
        for shape in (gate_up_shape, down_shape))]


def make_layout(bits: Bits | int, gate_up_shape: tuple[int, ...], down_shape: tuple[int, ...], has_bias: bool,
                group_size: int = 64, axis: int = 1, int8_per_channel: bool = False) -> Layout:
    """The layout of an expert with these shapes at `bits`; refuses shapes the grid cannot tile.

    `int8_per_channel`: at 8 bits, one scale and zero per output row (each projection's group is its
    whole input width), the layout torch's int8 weight-only matmul takes (`quant.int8_kernel`)."""
    bits = Bits.parse(bits)
    if axis not in (0, 1):
        raise MoetoolError(f"axis {axis} is not an hqq quantization axis; use 0 or 1.")
    if int8_per_channel and axis != 1:
        raise MoetoolError("per-channel INT8 groups each row's input columns (axis 1); drop the axis 0 setting.")
    projections, specs = [], []  # specs: (name, dtype, shape)
    for name, shape in (("gate_up", tuple(gate_up_shape)), ("down", tuple(down_shape))):
        if bits == Bits.BF16:
            proj = Projection(name, shape, "bf16", 0, axis)
            specs.append((name, REF_DTYPE, shape))
        else:
            packing = PACKINGS[bits]
            if bits == Bits.INT8 and int8_per_channel:
                group_size = shape[1]
            if group_size <= 0 or shape[1] % group_size:
                both = math.gcd(64, gate_up_shape[1], down_shape[1])  # divides both projections' widths
                raise MoetoolError(f"group size {group_size} does not divide the {name} projection's input width "
                                   f"{shape[1]}; pick one that divides both input widths, {gate_up_shape[1]} and "
                                   f"{down_shape[1]} (e.g. {both}).")
            proj = Projection(name, shape, packing.name, group_size, axis)
            rows, cols = proj.grouped_shape()
            if rows % packing.per_byte:
                fits = _packable(packing, gate_up_shape, down_shape, axis)
                how = (f"group size {fits[-1]} packs both projections" if fits else
                       f"no group size dividing both input widths ({gate_up_shape[1]} and {down_shape[1]}) packs "
                       f"these experts at {int(bits)} bits; leave {int(bits)} out of --bits")
                raise MoetoolError(f"the {name} projection {list(shape)} with group size {group_size} cannot be "
                                   f"packed {packing.per_byte} codes per byte: {how}.")
            specs += [(f"{name}.q", "uint8", (rows // packing.per_byte, cols)),
                      (f"{name}.scale", META_DTYPE, proj.meta_shape()),
                      (f"{name}.zero", META_DTYPE, proj.meta_shape())]
        projections.append(proj)
    if has_bias:
        specs += [("gate_up_bias", REF_DTYPE, (gate_up_shape[0],)), ("down_bias", REF_DTYPE, (down_shape[0],))]
    parts, offset = [], 0
    for name, dtype, shape in specs:
        nbytes = DTYPES[dtype].itemsize
        for d in shape:
            nbytes *= d
        parts.append(Part(name, offset, nbytes, dtype, tuple(shape)))
        offset = _align(offset + nbytes)
    return Layout(bits=int(bits), nbytes=offset, projections=tuple(projections), parts=tuple(parts))


# ---- encode / decode ----------------------------------------------------------------------------


def views(blob: torch.Tensor, layout: Layout) -> dict[str, torch.Tensor]:
    """Zero-copy typed views of every part of `blob` (uint8 [layout.nbytes], any device)."""
    if blob.dtype != torch.uint8 or blob.numel() < layout.nbytes:
        raise ValueError(f"blob of {blob.numel()} {blob.dtype} does not hold a {layout.nbytes}-byte layout")
    return {p.name: blob[p.offset:p.offset + p.nbytes].view(DTYPES[p.dtype]).view(p.shape) for p in layout.parts}


def encode(layout: Layout, weights: ExpertWeights, quantized: dict[str, QTensor] | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """Write one expert into a blob: the reference weights for 16 bits, else `quantized[proj]`."""
    blob = torch.zeros(layout.nbytes, dtype=torch.uint8) if out is None else out  # zeroed: padding is deterministic
    v = views(blob, layout)
    for proj in layout.projections:
        if proj.packing == "bf16":
            v[proj.name].copy_(getattr(weights, proj.name))
            continue
        q = quantized[proj.name]
        v[f"{proj.name}.q"].copy_(PACKING_BY_NAME[proj.packing].pack(q.codes))
        v[f"{proj.name}.scale"].copy_(q.scale)
        v[f"{proj.name}.zero"].copy_(q.zero)
    if "gate_up_bias" in v:
        v["gate_up_bias"].copy_(weights.gate_up_bias)
        v["down_bias"].copy_(weights.down_bias)
    return blob


def empty_weights(layout: Layout, dtype: torch.dtype = torch.float32,
                  device: torch.device | str = "cpu") -> ExpertWeights:
    """Preallocated output buffers for `dequantize_into`."""
    shapes = {p.name: p.shape for p in layout.projections}
    has_bias = any(p.name == "gate_up_bias" for p in layout.parts)

    def new(*shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=device)

    return ExpertWeights(gate_up=new(*shapes["gate_up"]), down=new(*shapes["down"]),
                         gate_up_bias=new(shapes["gate_up"][0]) if has_bias else None,
                         down_bias=new(shapes["down"][0]) if has_bias else None)


def dequantize_into(blob: torch.Tensor, layout: Layout, out: ExpertWeights) -> ExpertWeights:
    """Reconstruct an expert into preallocated, contiguous `out` buffers (same device as `blob`).

    Matches hqq's `Quantizer.dequantize` with compute_dtype = out's dtype and scale/zero cast to it,
    bit for bit: unpack, subtract zero, multiply by scale, in that order and that dtype.
    """
    v = views(blob, layout)
    for proj in layout.projections:
        target = getattr(out, proj.name)  # [out, in]
        if proj.packing == "bf16":
            target.copy_(v[proj.name])
            continue
        grouped = target.view(proj.grouped_shape())  # [G, gs] (axis 1) or [gs, G] (axis 0)
        PACKING_BY_NAME[proj.packing].unpack(v[f"{proj.name}.q"], grouped)
        grouped.sub_(v[f"{proj.name}.zero"].to(target.dtype)).mul_(v[f"{proj.name}.scale"].to(target.dtype))
    if out.gate_up_bias is not None:
        out.gate_up_bias.copy_(v["gate_up_bias"])
        out.down_bias.copy_(v["down_bias"])
    return out


def dequantize(blob: torch.Tensor, layout: Layout, dtype: torch.dtype = torch.float32) -> ExpertWeights:
    """An expert's weights rebuilt from its blob alone."""
    return dequantize_into(blob, layout, empty_weights(layout, dtype, blob.device))


def dequantize_qtensor(q: QTensor, proj: Projection, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """What `dequantize` will give for `q` once stored (scale and zero pass through META_DTYPE)."""
    meta = DTYPES[META_DTYPE]
    w = q.codes.to(dtype).sub_(q.zero.to(meta).to(dtype)).mul_(q.scale.to(meta).to(dtype))  # grouped
    return w.reshape(proj.shape)  # [out, in]


def relative_error(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """||W - W_hat||_F / ||W||_F, in fp64: a finite weight's square (1e30 ** 2) overflows fp32's norm to
    inf, and inf / inf would record a NaN error that the bundle's own reader then refuses."""
    ref = reference.double()
    denom = torch.linalg.vector_norm(ref).item()
    return torch.linalg.vector_norm(ref - approx.double()).item() / denom if denom else 0.0


# ---- many experts at once (the engine's grouped path) ---------------------------------------------

@dataclass(frozen=True)
class ExpertStack:
    """n experts' weights stacked for a grouped GEMM: [n, out, in] per projection (views or a scratch)."""

    gate_up: torch.Tensor  # [n, 2I, H] (or [n, I, H] without a gate)
    down: torch.Tensor  # [n, H, I]
    gate_up_bias: torch.Tensor | None = None  # [n, 2I]
    down_bias: torch.Tensor | None = None  # [n, H]

    def slice(self, start: int, stop: int) -> "ExpertStack":
        """Experts start..stop-1 of the stack, as views."""
        return ExpertStack(*(None if t is None else t[start:stop]
                             for t in (self.gate_up, self.down, self.gate_up_bias, self.down_bias)))


def _stack_views(blobs: torch.Tensor, part: Part) -> torch.Tensor:
    """The part of every blob in `blobs` ([n, >= nbytes] uint8) as an [n, *shape] typed view (no copy)."""
    n = blobs.shape[0]
    return blobs[:, part.offset:part.offset + part.nbytes].view(DTYPES[part.dtype]).view(n, *part.shape)


def stack_views(blobs: torch.Tensor, layout: Layout) -> dict[str, torch.Tensor]:
    """Every part of n blobs ([n, >= layout.nbytes] uint8, rows may be strided) as an [n, *shape]
    typed view (no copy). Over a whole slot pool these are made once; `index_select` on each part
    then gathers a batch's experts in one op per part."""
    return {p.name: _stack_views(blobs, p) for p in layout.parts}


def dequantize_stack(blobs: torch.Tensor, layout: Layout, dtype: torch.dtype) -> ExpertStack:
    """`dequantize` for n blobs of one layout at once ([n, >= layout.nbytes] uint8, rows may be strided)."""
    return dequantize_parts(stack_views(blobs, layout), layout, dtype)


def dequantize_parts(parts: dict[str, torch.Tensor], layout: Layout, dtype: torch.dtype) -> ExpertStack:
    """`dequantize` for n experts given as their parts ([n, *shape] each, as `stack_views` gives them).

    Bit for bit what `dequantize_into` gives for each blob (codes exact in `dtype`, then subtract
    the zero and multiply by the scale in `dtype`), in a constant number of ops for the n experts:
    on the decode path each op costs more than the work in it, so the count is what matters. A
    reference-precision projection already in `dtype` is returned as is (a view of the blobs).
    """
    out = {}
    for proj in layout.projections:
        if proj.packing not in PACKING_BY_NAME:  # the reference precision: a view, cast if needed
            w = parts[proj.name]
            out[proj.name] = w if w.dtype == dtype else w.to(dtype)
            continue
        per = PACKING_BY_NAME[proj.packing].per_byte
        bits = 8 // per
        q = parts[f"{proj.name}.q"]  # [n, R / per, C] uint8
        n = q.shape[0]
        if per > 1:
            # Slice i of the rows sits in bits 8 - bits*(i+1) of each byte (hqq's order): one
            # broadcast shift and one mask unpack every slice. Same-dtype ops throughout: mixed-dtype
            # arithmetic (uint8 - float) takes torch's unvectorised promotion path, ~10x slower.
            q = torch.bitwise_and(q.unsqueeze(1) >> _shifts(bits, q.device), (1 << bits) - 1)  # [n, per, R/per, C]
        w = q.reshape(n, *proj.grouped_shape()).to(dtype)  # [n, R, C]: small integers, exact in `dtype`
        zero = parts[f"{proj.name}.zero"].to(dtype)
        scale = parts[f"{proj.name}.scale"].to(dtype)
        out[proj.name] = w.sub_(zero).mul_(scale).view(n, *proj.shape)
    if "gate_up_bias" in parts:
        for name in ("gate_up_bias", "down_bias"):
            out[name] = parts[name].to(dtype)
    return ExpertStack(**out)


_SHIFTS: dict[tuple[int, str], torch.Tensor] = {}


def _shifts(bits: int, device: torch.device) -> torch.Tensor:
    """[1, 8/bits, 1, 1] uint8: the right shift that brings slice i of a packed byte to the bottom."""
    key = (bits, str(device))
    if key not in _SHIFTS:
        per = 8 // bits
        _SHIFTS[key] = torch.tensor([8 - bits * (i + 1) for i in range(per)], dtype=torch.uint8,
                                    device=device).view(1, per, 1, 1)
    return _SHIFTS[key]
