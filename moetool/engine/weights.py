"""The expert weights a grouped GEMM reads from the residency's slot pools, without a per-expert call.

The reference precision in the compute dtype is read in place: the pool's uint8 rows viewed as a
strided [slots, out, in] tensor (made once per layer), sliced to the slot range a batch spans, its
unused slots being empty groups. Anything else (quantized experts, bf16 blobs under fp32 compute),
or a range mostly empty on the host where each empty group costs a kernel call, is gathered with
one index op per blob part (from typed views of the whole pool, made once) and decoded for the n
experts at once (`quant.format.dequantize_parts`).

    weights = PoolWeights(store, residency, device)
    stack, group_sizes, order = weights.for_slots(layer, bits, slots=[7, 2], rows=[3, 1])
"""

from __future__ import annotations

import torch

from moetool.engine.residency import Residency, State
from moetool.engine.store import HostStore
from moetool.engine.transfer import upload
from moetool.quant import int4_kernel, int8_kernel
from moetool.quant.format import Bits, ExpertStack, stack_views
from moetool.quant.kernels import MODULES as KERNELS

VIEW_CACHE = 4096  # converted INT4/INT2 slots whose kernel views are kept before the memo is reset


class PoolWeights:
    def __init__(self, store: HostStore, residency: Residency, device: torch.device):
        self.store, self.residency, self.device = store, residency, device
        self._stacks: dict[tuple[int, int], ExpertStack] = {}  # (layer, bits) -> the whole pool as views
        self._parts: dict[tuple[int, int], dict[str, torch.Tensor]] = {}  # (layer, bits) -> its part views
        self._kviews: dict[tuple[int, int, int], object] = {}  # (layer, bits, slot address) -> a kernel's views
        self._kpools: dict[tuple[int, int], list] = {}  # (layer, bits) -> the converted pool's kernel views
        self.kernel: set[tuple[int, int]] = set()  # (layer, bits) whose slots hold a low-bit kernel's layout (the engine's)

    def for_slots(self, layer: int, bits: int, slots: list[int],
                  rows: list[int]) -> tuple[ExpertStack, list[int], list[int] | None]:
        """Weights of the experts in `slots` (one per group, in the caller's order; `rows[i]` rows in
        group i), stacked for one grouped GEMM: (the stack, the group sizes its GEMM takes, and the
        order of the caller's groups it expects, None for the caller's own)."""
        if (layer, bits) in self.kernel:  # slots in a kernel's layout: decode that
            dtype = self.store.compute_dtype
            weights = [int8_kernel.decode(*p, dtype) for p in self.int8_stack(layer, slots)] if bits == 8 else \
                [int4_kernel.decode(*p, dtype, int2=bits == 2) for p in self.kernel_stack(layer, bits, slots, expand=False)]
            parts, biases = self.pool_parts(layer, bits), {}
            if "gate_up_bias" in parts:  # biases stay as stored (bf16): only the weights were converted
                at = upload(slots, parts["gate_up_bias"].device)
                biases = {n: parts[n].index_select(0, at).to(dtype) for n in ("gate_up_bias", "down_bias")}
            return ExpertStack(*weights, **biases), rows, None
        first, last = min(slots), max(slots)
        if self.in_place(layer, bits, slots):
            stack = self.pool_stack(layer, bits).slice(first, last + 1)  # views: no copy
            sizes = [0] * (last - first + 1)
            for s, n in zip(slots, rows):
                sizes[s - first] = n
            ascending = all(a < b for a, b in zip(slots, slots[1:]))  # a resident pool: slots in expert order
            return stack, sizes, None if ascending else sorted(range(len(slots)), key=slots.__getitem__)
        if self.device.type == "cpu" and bits == Bits.BF16:
            # The reference precision in another dtype (bf16 blobs under fp32 compute): each expert
            # cast straight into the stack, one pass, where a gather then a cast is two (measured: lru
            # at 25% on qwen-moe-tiny in fp32, the gather and the cast took 4.5 ms of a 22 ms step).
            # On a GPU the two ops stay: there a call per expert costs more than a second pass.
            dtype = self.store.compute_dtype
            out = {}
            for name, v in self.pool_parts(layer, bits).items():
                out[name] = torch.empty((len(slots), *v.shape[1:]), dtype=dtype, device=v.device)
                for i, s in enumerate(slots):
                    out[name][i].copy_(v[s])
            return ExpertStack(**out), rows, None
        at = upload(slots, self.residency.pool_bytes(bits).device)
        parts = {name: v.index_select(0, at) for name, v in self.pool_parts(layer, bits).items()}
        return self.store.decode_stack(parts, layer, bits), rows, None

    def layer_stack(self, layer: int, bits: int, num_experts: int) -> ExpertStack | None:
        """All of `layer`'s experts at `bits` as one stack in expert order (views of the pool) where they are
        all resident at `bits`, in consecutive slots, in the compute dtype: what `device_layers` reads
        for a policy that never evicts (resident, static). None where that does not hold."""
        handles = [self.residency.table.get((layer, e, bits)) for e in range(num_experts)]
        if not all(h is not None and h.state == State.RESIDENT for h in handles):
            return None
        slots = [h.slot for h in handles]
        if slots != list(range(slots[0], slots[0] + num_experts)) or not self.in_place(layer, bits, slots):
            return None
        return self.pool_stack(layer, bits).slice(slots[0], slots[-1] + 1)

    def pool_stack(self, layer: int, bits: int) -> ExpertStack:
        """The whole `bits` pool as `layer`'s experts ([slots, out, in] per projection; views where the
        pool holds the compute dtype), made once per layer."""
        key = (layer, bits)
        stack = self._stacks.get(key)
        if stack is None:
            stack = self._stacks[key] = self.store.decode_stack(self.pool_parts(layer, bits), layer, bits)
        return stack

    def pool_parts(self, layer: int, bits: int) -> dict[str, torch.Tensor]:
        """Every part of the `bits` pool's slots, typed as `layer`'s layout ([slots, *shape] views), made once."""
        key = (layer, bits)
        parts = self._parts.get(key)
        if parts is None:
            parts = self._parts[key] = stack_views(self.residency.pool_bytes(bits), self.store.layout(layer, bits))
        return parts

    def kernel_weights(self, layer: int, bits: int, blob: torch.Tensor):
        """Views of a converted slot for its kernel's `expert_forward`; they alias the slot, so each
        slot's are made once."""
        key = (layer, bits, blob.data_ptr())
        w = self._kviews.get(key)
        if w is None:
            if len(self._kviews) >= VIEW_CACHE:
                self._kviews.clear()
            w = self._kviews[key] = KERNELS[bits].kernel_weights(blob, self.store.layout(layer, bits))
        return w

    def kernel_stack(self, layer: int, bits: int, slots: list[int], expand: bool = True) -> tuple[tuple, tuple]:
        """(gate_up, down) of the converted INT4/INT2 experts in `slots` for `int4_kernel.fused_forward`:
        per projection (codes [n, N, K/2] in the kernel's packing, INT2's expanded unless not `expand`:
        `int4_kernel.decode` reads its 2-bit codes as they are; group; scales and zero points
        [n, K/g, N, 2]), gathered from typed views of the whole pool (made once)."""
        key = (layer, bits)
        pool = self._kpools.get(key)
        if pool is None:
            blobs, layout = self.residency.pool_bytes(bits), self.store.layout(layer, bits)
            pool = []
            for proj in layout.projections:
                (n, k), q, sz = proj.shape, layout.part(f"{proj.name}.q"), layout.part(f"{proj.name}.scale")
                codes = blobs[:, q.offset:q.offset + q.nbytes].view(-1, n, q.nbytes // n)
                sz = blobs[:, sz.offset:sz.offset + 2 * sz.nbytes].view(torch.bfloat16).view(-1, k // proj.group_size, n, 2)
                pool.append((codes, proj.group_size, sz))
            self._kpools[key] = pool
        at = torch.tensor(slots)
        out = []
        for codes, group, sz in pool:
            c = codes.index_select(0, at)
            out.append((int4_kernel.expand(c) if bits == 2 and expand else c, group, sz.index_select(0, at)))
        return out[0], out[1]

    def int8_stack(self, layer: int, slots: list[int]) -> tuple[tuple, tuple]:
        """(gate_up, down) of the converted per-channel INT8 experts in `slots` for `int8_kernel.decode`:
        per projection (int8 codes [n, N, K], scales [n, N], offsets [n, N]), gathered from the pool."""
        parts = self.pool_parts(layer, 8)  # typed as hqq's layout: the same bytes, reinterpreted below
        at = upload(slots, self.residency.pool_bytes(8).device)
        out = []
        for name in ("gate_up", "down"):
            out.append((parts[f"{name}.q"].index_select(0, at).view(torch.int8),
                        parts[f"{name}.scale"].index_select(0, at).view(torch.bfloat16).flatten(1),
                        parts[f"{name}.zero"].index_select(0, at).flatten(1)))
        return out[0], out[1]

    def in_place(self, layer: int, bits: int, slots: list[int]) -> bool:
        """Whether the experts in `slots` can be read in place from the pool (else gathered and decoded)."""
        if not self.store.stack_is_view(layer, bits):
            return False
        n, span = len(slots), max(slots) - min(slots) + 1
        if self.device.type == "cuda":
            return True  # the device kernel skips empty groups within one launch
        # On the host each empty group costs ~2.5 us of kernel overhead and gathering an expert costs
        # its bytes at memory speed (~10 GB/s): measured on the 2-core CI machine, scripts/bench_engine.py.
        return (span - n) * 2.5e-6 <= n * self.store.slot_bytes(bits) / 10e9
