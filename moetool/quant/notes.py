"""What `moetool quantize` tells its user about a bundle's settings: a group too small to save
bytes (before the work) and what storing the checkpoint rounds (once it is done)."""

from __future__ import annotations

import math
from typing import Any

import torch

from moetool.model import MoeLayer
from moetool.quant.format import Bits, Layout, make_layout


def gate_up_shape(layer: MoeLayer) -> tuple[int, int]:
    """The [out, in] shape of a layer's gate_up projection (gate and up stacked where gated)."""
    return (2 * layer.intermediate_size if layer.gated else layer.intermediate_size, layer.hidden_size)


# Safetensors dtypes a bundle's bf16 reference and --dtype weights round (fewer mantissa bits).
_ROUNDED = {"F16": "float16", "F32": "float32", "F64": "float64", "F8_SCALED": "FP8 times float32 block scales"}


def precision_note(stored: set[str], dtype: str, reference: bool = True) -> str | None:
    """What storing a checkpoint whose experts are in `stored` (safetensors dtype names) as a bundle
    does to its numbers, or None where nothing is rounded: a bundle keeps its 16-bit experts in
    bfloat16 (`format.REF_DTYPE`, the papers' reference precision) and its other weights in
    `dtype`, so an fp16 or fp32 checkpoint's lossless runs over the bundle decode the model rounded
    to those, not the checkpoint's own numbers."""
    rounded = sorted(_ROUNDED[d] for d in stored if d in _ROUNDED)
    if not rounded:
        return None
    if not reference:  # --no-reference: no 16-bit experts to round; the other weights still are
        return (f"the checkpoint's weights are {' and '.join(rounded)}; the bundle keeps its non-expert weights in "
                f"{dtype}, as plain transformers does with dtype={dtype}.") if dtype not in rounded else None
    return (f"the checkpoint's experts are {' and '.join(rounded)}; the bundle keeps its 16-bit experts in "
            f"bfloat16 and its other weights in {dtype}, so runs over it (lossless ones included) decode the "
            f"model rounded to those, as plain transformers does with dtype={dtype}, not the checkpoint's own "
            "numbers.")


# A quantized precision is worth a note when its blobs keep over 0.9 of bf16's bytes, or take over
# 2.9x what its codes alone take (scales and zeros twice the codes: INT4 at group 4, INT2 at group 8).
WORTH, OVERHEAD = 0.9, 2.9


def size_note(layers: list[MoeLayer], layouts: dict[int, dict[Bits, Layout]], group_size: int) -> str | None:
    """What a low-bit precision fails to save, or None: at a small group (widths with few factors of
    two, `auto_group_size`) each group's scale and zero can outweigh its codes, so a blob may keep most
    of the bf16 expert's bytes, or exceed them, while still losing precision."""
    def total(bits: Bits) -> int:
        return sum(g.num_experts * (layouts[g.index][bits] if bits in layouts[g.index] else make_layout(
            bits, gate_up_shape(g), (g.hidden_size, g.intermediate_size), g.has_bias)).nbytes for g in layers)

    ref = total(Bits.BF16)
    share = {b: total(b) / ref for b in layouts[layers[0].index] if b != Bits.BF16}
    poor = sorted((b for b, r in share.items() if r > WORTH or r > OVERHEAD * int(b) / 16), reverse=True)
    if not poor:
        return None
    said = ", ".join(f"INT{int(b)} {share[b]:.2f}x where its codes alone are {int(b) / 16:.3g}x" for b in poor)
    widths = math.gcd(*(w for g in layers for w in (g.hidden_size, g.intermediate_size)))
    larger = max(d for d in range(1, min(widths, 128) + 1) if widths % d == 0)  # groups must divide every width
    fix = (f"--group-size {larger} (the largest group up to 128 that divides every expert's input width) saves more"
           if larger > group_size else f"no larger group divides the experts' input widths; --bits without "
           f"{', '.join(str(int(b)) for b in poor)} skips what saves little")
    each = "each input column" if group_size == 1 else f"each group of {group_size} input columns"
    return (f"at group size {group_size} the quantized experts keep much of the bf16 experts' bytes ({said}), "
            f"since {each} stores a scale and a zero beside its codes; {fix}.")


# The largest relative error of one output row a precision's own rounding gives, with room: a Gaussian
# row at min-max rounding is off by ~1.36 / (2^b - 1) of its norm (0.005 at INT8, 0.09 at INT4, 0.45 at
# INT2), ten times that at INT8, five at INT4, and at INT2 a row worse than storing zeros.
ROW_BOUND = {8: 0.05, 4: 0.5, 2: 1.0}


def row_error(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """The largest ||w - w_hat|| / ||w|| over the output rows of a weight [N, K] (rows of zeros: exact
    or not, they have no scale to be relative to and are left out), in fp64."""
    ref = reference.double()
    norms = torch.linalg.vector_norm(ref, dim=1)
    errors = torch.linalg.vector_norm(ref - approx.double(), dim=1)
    keep = norms > 0
    return float((errors[keep] / norms[keep]).max()) if bool(keep.any()) else 0.0


def coarse_note(entries: Any) -> str | None:
    """Experts stored far coarser than their bits (`ROW_BOUND`), or None. hqq caps a group's inverse
    scale at 2e4 and takes a scale of 1 for a range under 1e-4, so a group of small weights (spanning
    under ~0.013 at INT8) is rounded by a step its bits do not say: "INT8" experts of weights near 1e-4
    were no better than INT4, and below 1e-5 worse than zeros, with nothing said."""
    coarse = [(e.row_error[p], e, p) for e in entries if e.row_error and e.bits in ROW_BOUND
              for p in e.row_error if e.row_error[p] > ROW_BOUND[e.bits]]
    if not coarse:
        return None
    worst, e, proj = max(coarse, key=lambda c: c[0])
    bits = sorted({c[1].bits for c in coarse}, reverse=True)
    return (f"{len({(c[1].layer, c[1].expert, c[1].bits) for c in coarse})} expert(s) are stored coarser than their "
            f"bits allow at {', '.join(f'INT{b}' for b in bits)} (worst: layer {e.layer} expert {e.expert}'s {proj} "
            f"at INT{e.bits}, a row off by {worst:.2g} of its norm, past {ROW_BOUND[e.bits]:g}); hqq's scale stops "
            "shrinking for groups of very small weights, so runs at those precisions compute far from the model "
            "(bundle.json records each entry's row_error).")
