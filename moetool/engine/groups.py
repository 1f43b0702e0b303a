"""A layer's work once planned: its (token, slot) rows grouped by expert and precision, the grouped
expert MLP over them, and the combine that sums a token's k outputs as transformers does.

    groups = group_plan(plan, idx, num_experts, stats, grouped=True, max_bits=16, device=cpu)  # [Group]
    y = grouped_mlp(module, hidden.index_select(0, rows.tok), stack, offs, counts)
    out = Combine(hidden, weight, grouped=True); out.add(y, rows.pos); out.result()
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import numpy as np
import torch
from torch import nn
from transformers.integrations.moe import _grouped_mm  # the dispatcher transformers' grouped_mm experts use

from moetool.engine.residency import Handle
from moetool.engine.stats import LayerStats
from moetool.engine.transfer import upload
from moetool.errors import MoetoolError
from moetool.policies.base import LayerPlan, Where, valid_slots
from moetool.quant.format import ExpertStack

_WHERE = tuple(Where)  # Where(i) without the enum call (a few us each, per group and layer)


def _aligned(t: torch.Tensor, itemsize: int) -> bool:
    """Whether torch's grouped_mm takes `t` as an operand: its leading stride (row- or column-major in the
    last two dimensions) a multiple of 16 bytes, as torch's own check (`_meta_grouped_mm_common`) asks."""
    a, s = 16 // itemsize, t.stride()
    return (s[-1] == 1 and s[-2] % a == 0) or (s[-2] == 1 and s[-1] % a == 0)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """x [n, K] @ w[g] [K, N] per group of rows (group g's rows ending at `offs[g]`): transformers'
    grouped GEMM dispatcher, as its `grouped_mm` experts call it; for a geometry torch's grouped_mm
    refuses (an expert intermediate or hidden size whose rows are not a multiple of 16 bytes: 1, 2 or
    6 in fp32, 4 in bf16), transformers' own per-group fallback, one GEMM a group. Plain transformers'
    `grouped_mm` experts fail on such a model; the eager loop, which moetool then matches, runs."""
    size = w.element_size()
    if _aligned(x, size) and _aligned(w, size):
        return _grouped_mm(x, w, offs)
    return torch.ops.transformers.grouped_mm_fallback(x.to(w.dtype), w, offs=offs)


class Status(IntEnum):
    """Where a device-side group's expert copy stands when the layer is scheduled (the compute order)."""

    HIT = 0  # resident: computes first
    IN_FLIGHT = 1  # a prefetch still copying: computes when its own copy lands
    MISS = 2  # a demand load started now: into a cached slot, or streamed through a staging buffer


@dataclass(slots=True)
class Rows:
    """A layer's running (token, slot) pairs, grouped: group after group, each group's rows in the
    order its GEMM takes them. Host arrays, and the same rows as index tensors on the compute device."""

    tok_host: torch.Tensor  # [n] token rows
    slot_host: torch.Tensor  # [n] routing slots
    pos_host: torch.Tensor  # [n] flat (token * k + slot) positions, what the grouped combine writes
    tok: torch.Tensor  # the same three on the compute device
    slot: torch.Tensor
    pos: torch.Tensor


@dataclass(slots=True)
class Routed:
    """A routed plan no policy changed, grouped as transformers' grouped_mm groups it: `experts` in
    ascending order, `counts[i]` rows each, the rows in grouped_mm's own order; all at `bits`."""

    bits: int
    experts: list[int]
    counts: list[int]
    rows: Rows


@dataclass(slots=True)
class Group:
    """The (token, slot) pairs of one layer that run one expert at one precision in one place:
    rows `start:end` of the layer's `Rows`."""

    expert: int
    bits: int
    where: Where
    rows: Rows
    start: int
    end: int
    status: Status = Status.HIT
    handle: Handle | None = None

    def __len__(self) -> int:
        return self.end - self.start

    # Sliced on demand: the grouped path reads the layer's rows whole, only the per-expert paths
    # (eager, host, staged) need a group's own, and a slice is a torch call.
    @property
    def tok(self) -> torch.Tensor:
        return self.rows.tok[self.start:self.end]

    @property
    def slot(self) -> torch.Tensor:
        return self.rows.slot[self.start:self.end]

    @property
    def pos(self) -> torch.Tensor:
        return self.rows.pos[self.start:self.end]

    @property
    def tok_host(self) -> torch.Tensor:
        return self.rows.tok_host[self.start:self.end]

    @property
    def slot_host(self) -> torch.Tensor:
        return self.rows.slot_host[self.start:self.end]


class Combine:
    """A layer's output [T, H]: each group's routing-weighted expert rows, summed as the matching
    transformers kernel sums them, so a lossless policy stays bit-exact.

    fp32 addition is not associative, and with k = 16 a different order moves logits by ~1e-5, enough
    to flip a near-tied routing decision downstream. `grouped_mm` writes each (token, slot)'s row at
    its flat position and sums over the k slots in slot order (a skipped slot adds an exact 0); the
    eager loop adds whole experts in ascending expert order. Both hold T*k*H activations until the
    sum, which the budget's margin counts (`kv_margin`).
    """

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, grouped: bool):
        self.hidden, self.weight, self.grouped = hidden, weight, grouped  # weight [T, k], hidden's dtype
        T, k = weight.shape
        self.summed: torch.Tensor | None = None  # `add_sum`'s rows
        if grouped:
            self.flat = hidden.new_zeros(T * k, hidden.shape[-1])  # [T*k, H]
            self.flat_weight = weight.reshape(-1)  # [T*k]
        else:
            self.outputs: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []  # (expert, bits, tok, y)

    def add(self, y: torch.Tensor, pos: torch.Tensor, tok: torch.Tensor | None = None,
            slot: torch.Tensor | None = None, expert: int = 0, bits: int = 0) -> None:
        """Rows `y` [n, H] of the (token, slot) pairs at flat positions `pos` (token `tok`, slot `slot`);
        `y` is a fresh output the caller hands over (the grouped path weights it in place)."""
        if self.grouped:
            w = self.flat_weight.index_select(0, pos).unsqueeze_(1)  # [n, 1]
            y = y.mul_(w) if y.dtype == w.dtype else y * w  # in place: y is the caller's fresh output
            self.flat.index_copy_(0, pos, y if y.dtype == self.flat.dtype else y.to(self.flat.dtype))
        else:
            self.outputs.append((expert, bits, tok, (y * self.weight[tok, slot, None]).to(self.hidden.dtype)))

    def add_sum(self, y: torch.Tensor) -> None:
        """A single token's experts already weighted and summed, [1, H] (a low-bit kernel's fused
        call, `quant.kernels`): added to the token's sum over its slots (grouped path only)."""
        self.summed = y if self.summed is None else self.summed + y

    def result(self) -> torch.Tensor:
        if self.grouped:
            T, k = self.weight.shape
            out = self.flat.view(T, k, -1).sum(1)
            if self.summed is not None:
                out += self.summed.to(out.dtype)
            return out.to(self.hidden.dtype)
        out = torch.zeros_like(self.hidden)  # [T, H]
        for _, _, tok, y in sorted(self.outputs, key=lambda o: o[:2]):
            out.index_add_(0, tok, y)
        return out


def grouped_mlp(module: nn.Module, x: torch.Tensor, stack: ExpertStack, offs: torch.Tensor,
                counts: list[int]) -> torch.Tensor:
    """The experts' MLP (`module`: the engine's experts module) on rows `x` [n, H] sorted by group, group i's rows ending at `offs[i]`:
    transformers' own grouped GEMM dispatcher and the model's own activation, so the result is the
    `grouped_mm` implementation's, row for row."""
    h = grouped_mm(x, stack.gate_up.transpose(-2, -1), offs)  # [n, 2I]
    group_of_row = None
    if stack.gate_up_bias is not None:
        group_of_row = upload(np.repeat(np.arange(len(counts)), counts), x.device)
        h.add_(stack.gate_up_bias.index_select(0, group_of_row))
    h = module.impl._apply_gate(h) if module.layer.gated else module.impl.act_fn(h)  # [n, I]
    y = grouped_mm(h, stack.down.transpose(-2, -1), offs)  # [n, H]
    if group_of_row is not None:
        y.add_(stack.down_bias.index_select(0, group_of_row))
    return y


def counted_uses(idx: torch.Tensor, num_experts: int, real: torch.Tensor | None) -> torch.Tensor:
    """[T, k] bool: the (token, slot) pairs a run's precision mix, skips and substitutions count: a
    slot the router routed (not one it dropped, -1 or E, which no policy skipped) of a request's
    token (not a batch's left padding, `LayerView.real_rows`). On `idx`'s device."""
    mask = valid_slots(idx, num_experts)
    return mask if real is None else mask & real.to(mask.device)[:, None]


def taken_plan(plan: Any, policy: str, view: Any) -> LayerPlan:
    """`plan`, once it is a LayerPlan of the routing's [T, k] shape with integer ids, bits and wheres: a
    policy's `plan()` returning None, arrays of another shape or float ids failed deep in the engine
    (an AttributeError, a numpy broadcast, a tuple index), read as moetool's bugs. Arrays the plan has
    not made yet (`_Made`) stay unmade: reading them would take the routed plan's fast path away."""
    if not isinstance(plan, LayerPlan):
        raise MoetoolError(f"policy '{policy}' plan() returned {type(plan).__name__}, not a LayerPlan "
                           "(LayerPlan.routed(view, bits) makes one).")
    want = tuple(view.top_k_index.shape)
    for name in ("expert", "bits", "where", "weight"):
        array = getattr(plan, "_" + name)
        if array is not None and (tuple(array.shape) != want or (name != "weight" and array.is_floating_point())):
            raise MoetoolError(f"policy '{policy}' plan() gave its {name} as {tuple(array.shape)} {array.dtype}, where "
                               f"the layer's routing is {want}{'' if name == 'weight' else ' integers'}.")
    return plan


def check_plan(expert: np.ndarray, bits: np.ndarray, where: np.ndarray, num_experts: int, policy: str,
               stored: frozenset[int], layer: int | None, hook: str = "plan") -> None:
    """One sentence for a plan no engine can run as written: a `Where` that is none of GPU, CPU and SKIP,
    or a running slot's expert or precision the store does not hold. The plan's key packs the three
    into one number (`group_plan`), so such a value aliased into another group: where 7 ran as a skip,
    -1 ran uncounted, a substitute id past the experts as a skip."""
    at, there = f"policy '{policy}' planned", "" if layer is None else f" at layer {layer}"
    if where.size and not np.isin(where, (int(Where.GPU), int(Where.CPU), int(Where.SKIP))).all():
        bad = int(where[~np.isin(where, (0, 1, 2))][0])
        raise MoetoolError(f"{at} where={bad}{there} (Where is GPU 0, CPU 1 or SKIP 2): a bug in its {hook}().")
    running = where != int(Where.SKIP)
    if running.any() and not ((expert[running] >= 0) & (expert[running] < num_experts)).all():
        bad = int(expert[running][(expert[running] < 0) | (expert[running] >= num_experts)][0])
        raise MoetoolError(f"{at} expert {bad} to run{there}, and the layer has experts 0 to {num_experts - 1}: a bug in its "
                           f"{hook}() (a slot it does not run is Where.SKIP).")
    if running.any() and not np.isin(bits[running], tuple(stored)).all():
        bad = int(bits[running][~np.isin(bits[running], tuple(stored))][0])
        raise MoetoolError(f"{at} an expert at {bad} bits{there}, and the store holds {', '.join(map(str, sorted(stored)))}: "
                           f"a bug in its {hook}() (its precisions() name the bits it may plan).")


def group_plan(plan: LayerPlan, idx: torch.Tensor, num_experts: int, st: LayerStats, *, grouped: bool,
               max_bits: int, device: torch.device, routed: Routed | None = None,
               real: torch.Tensor | None = None, checked: tuple[str, frozenset[int]] | None = None) -> list[Group]:
    """The plan's running (token, slot) pairs grouped by (where, bits, expert), counting skips,
    substitutions and the precision mix of the `counted_uses` (`real`: the rows of requests' tokens).
    Vectorised (numpy on the host arrays, a constant number of calls whatever T x k is); one index
    upload for the layer.

    Within a group, rows keep the order the matching transformers kernel gives them, so a
    lossless policy matches it bit for bit: `grouped_mm`'s own `torch.sort` of the flattened
    experts (not a stable sort: a CPU GEMM's result for a row depends on where the row sits in
    its tile, so the order inside a group matters), slot-major as the eager loop. Where every
    group has one row (a decode step of distinct experts) any sort gives that order, so the
    torch sort runs only when some group has several.
    """
    T, k = idx.shape
    counted = counted_uses(idx, num_experts, real).numpy()  # [T, k]
    if routed is None and grouped:
        routed = routed_rows(plan, idx, num_experts, device)
    if routed is not None:  # every slot as routed, on the device, at one precision
        st.precision_mix[routed.bits] += int(np.count_nonzero(counted))
        groups, start, where = [], 0, _WHERE[int(Where.GPU)]
        for e, n in zip(routed.experts, routed.counts):
            groups.append(Group(e, routed.bits, where, routed.rows, start, start + n))
            start += n
        return groups if real is None else _requested(groups, real[routed.rows.tok_host].numpy())  # see below
    expert, bits, where = (t.numpy() for t in (plan.expert, plan.bits, plan.where))  # [T, k] each
    if checked is not None:
        check_plan(expert, bits, where, num_experts, *checked, getattr(plan._view, "layer", None))
    subst = expert != idx.numpy()
    if subst.any():
        st.substitutions += int(np.count_nonzero(subst & (where != int(Where.SKIP)) & counted))
    pos = np.arange(T * k)  # flat position t * k + s of every (token, slot)
    if not grouped:
        expert, bits, where, pos = (a.T for a in (expert, bits, where, pos.reshape(T, k)))  # slot-major
    expert, bits, where, pos = (a.reshape(-1) for a in (expert, bits, where, pos))
    # One key per (where, bits, expert): skipped slots (Where.SKIP, the largest) sort last.
    span = max_bits + 1
    key = (where * span + bits) * num_experts + expert
    order = np.argsort(key, kind="stable")  # stable: the eager loop's slot-major order within a group
    skey = key[order]
    change = skey[1:] != skey[:-1]
    if grouped and not change.all():  # some group has several rows: grouped_mm's own order
        first = torch.sort(torch.from_numpy(expert.astype(np.int64, copy=False))).indices.numpy()
        order = first[np.argsort(key[first], kind="stable")]  # the same sorted keys, ties as grouped_mm
    n = int(np.searchsorted(skey, int(Where.SKIP) * span * num_experts))  # rows that run
    tally = counted.reshape(-1)[pos[order]]  # [T*k] in `order`: whether the row is counted
    st.skips += int(np.count_nonzero(tally[n:]))
    if not n:
        return []
    upto = np.concatenate(([0], np.cumsum(tally[:n])))  # counted rows before each sorted position
    bounds = [0, *(np.flatnonzero(change[:n - 1]) + 1).tolist(), n]
    tok, slot = np.divmod(pos[order[:n]], k)
    rows = _rows(torch.from_numpy(tok), torch.from_numpy(slot), torch.from_numpy(pos[order[:n]]), device)
    w_b, e = np.divmod(skey[bounds[:-1]], num_experts)
    w, b = np.divmod(w_b, span)
    groups, on_device, mix = [], int(Where.GPU), st.precision_mix
    for e, b, w, start, end in zip(e.tolist(), b.tolist(), w.tolist(), bounds[:-1], bounds[1:]):
        if w == on_device:
            mix[b] += int(upto[end] - upto[start])
        groups.append(Group(e, b, _WHERE[w], rows, start, end))
    return groups if real is None else _requested(groups, real.numpy()[tok])


def _requested(groups: list[Group], real: np.ndarray) -> list[Group]:
    """The groups a request's token is in (`real`: whether each grouped row is one). An expert only a
    batch's left padding routes to is not run: a pad row is no request's token (its output reaches none
    through the masked attention), and loading the expert for it counted a miss, bytes and a wait no
    request caused. Experts the requests use run their pad rows too, in the order transformers runs
    them, so the requests' rows are computed as it computes them."""
    upto = np.concatenate(([0], np.cumsum(real)))
    return [x for x in groups if upto[x.end] > upto[x.start]]


def routed_rows(plan: LayerPlan, idx: torch.Tensor, num_experts: int, device: torch.device) -> Routed | None:
    """A routed plan no policy changed (every lossless policy, static precision), grouped as
    transformers' `grouped_mm` groups it, in a handful of torch calls (the grouped path's shortcut);
    None for any other plan, or if the router marked a slot dropped (an id out of range: the general
    path skips it)."""
    bits = plan.uniform_bits()
    if bits is None:
        return None
    T, k = idx.shape
    sorted_expert, perm = torch.sort(idx.reshape(-1))  # [T*k]: grouped_mm's own order
    experts, counts = torch.unique_consecutive(sorted_expert, return_counts=True)
    experts, counts = experts.tolist(), counts.tolist()
    if not experts or experts[0] < 0 or experts[-1] >= num_experts:
        return None
    rows = _rows(perm.div(k, rounding_mode="floor"), perm.remainder(k), perm, device)
    return Routed(bits, experts, counts, rows)


def _rows(tok: torch.Tensor, slot: torch.Tensor, pos: torch.Tensor, device: torch.device) -> Rows:
    """Host row indices, and the same on the compute device (one upload for the layer)."""
    if device.type == "cpu":
        return Rows(tok, slot, pos, tok, slot, pos)
    both = upload(torch.stack((tok, slot, pos)), device)
    return Rows(tok, slot, pos, both[0], both[1], both[2])
