"""What the engine copies onto the device and when: the policy's start-up set, demand loads and
prefetches (admitted by the policy, into a pool slot, or streamed through a staging buffer when not
cached), and publishing copies once they have landed. A mixin of `Engine` (`engine/runtime.py`);
the captured decode step's host half fills slots through the same calls (`engine/decode.py`), from
the host mirror's rows.

    handle = engine._start_load(Fetch(3, 7, 4), shield=set(), demand=True)
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import torch

from moetool.engine.groups import Group
from moetool.engine.residency import Handle
from moetool.errors import MoetoolError
from moetool.policies.base import Fetch
from moetool.quant.kernels import MODULES as KERNELS

_ISSUED = itertools.count(1)  # copies in the order they were issued (`Handle.seq`), across engines


class Loads:
    def _warm(self) -> int:
        """Load the policy's start-up set and wait for it; its bytes are reported apart from per-token
        traffic and take no time on the clock."""
        moved = 0
        for f in self.policy.warm():
            self._held(f)
            victims = self.policy.admit(f, self.residency, set(), False)
            if victims is None or self.residency.get(f.layer, f.expert, f.bits) is not None:
                continue
            self.residency.check_victims(self.policy.name, f, victims, set())
            handle, dst = self.residency.begin_load(f, victims)
            event, nbytes, _ = self._copy_in(f, dst)
            self.copier.wait(event)
            self.residency.publish(f.layer, f.expert, f.bits)
            moved += nbytes
        return moved

    def _held(self, want: Fetch) -> None:
        """One sentence for a policy's fetch of an expert the store lacks (layer 999, expert -1, bits it never
        stored): a KeyError deep in the store, or a sentence blaming the bundle."""
        if not self.store.holds(want.layer, want.expert, want.bits):
            raise MoetoolError(f"policy '{self.policy.name}' asked to load expert {want.expert} of layer {want.layer} at "
                               f"{want.bits} bits, which the experts it runs from do not hold (a MoE layer's expert, at "
                               "a precision they store): a bug in its prefetch(), warm() or end_step().")

    def _start_load(self, want: Fetch, shield: set, *, demand: bool = False, prefetched: bool = False,
                    staged: bool = True, source: torch.Tensor | None = None) -> Handle | None:
        """Admit (policy + residency), take a slot, start the copy (from `source`, else where the store
        keeps the blob). A demand load the policy does not admit gets a staged handle, copied when its
        turn comes (`_copy_staged`), unless `staged` is off (the captured step has read it already);
        another load that is not admitted, or whose copy exists already, returns None."""
        self._held(want)
        if (not demand or not staged) and self.residency.get(want.layer, want.expert, want.bits) is not None:
            return None
        victims = self.policy.admit(want, self.residency, shield, demand)
        if victims is None:
            return Handle(slot=None) if demand and staged else None
        self.residency.check_victims(self.policy.name, want, victims, shield)
        handle, dst = self.residency.begin_load(want, victims, prefetched=prefetched)
        self._copy(handle, dst, want, demand and source is None, source)
        return handle

    def _prefetch(self, view: Any, shield: set) -> None:
        """The policy's fetches for later layers (`view`: the layer's LayerView), asked once this layer's
        own loads have started, so it sees the residency they leave; `shield`: the experts this layer runs
        on the device."""
        for f in self.policy.prefetch(view):
            if self._start_load(f, shield, prefetched=True) is not None:
                self.stats.layer(f.layer).prefetch_issued += 1  # counted where the copy will be used

    def _copy_staged(self, layer: int, x: Group) -> None:
        x.handle.data = self.residency.staging_slot(x.bits)
        self._copy(x.handle, x.handle.data, Fetch(layer, x.expert, x.bits), demand=True)

    def _copy_in(self, want: Fetch, dst: torch.Tensor, source: torch.Tensor | None = None) -> tuple[Any, int, bool]:
        """Start copying `want`'s blob into `dst`: (the copy's event, its bytes, whether it went through
        the host's staging ring)."""
        src, ring_slot = (source, None) if source is not None else self.store.source(want.layer, want.expert,
                                                                                     want.bits)
        event = self.copier.copy(dst[: src.numel()], src)
        self.store.release(ring_slot, event)
        if self.on_kernel(want.layer, want.bits):
            self.copier.wait(event)  # a CPU copy: already done
            KERNELS[want.bits].convert_(dst[: src.numel()], self.store.layout(want.layer, want.bits))
        return event, src.numel(), ring_slot is not None

    def _copy(self, handle: Handle, dst: torch.Tensor, want: Fetch, demand: bool,
              source: torch.Tensor | None = None) -> None:
        t0 = time.perf_counter()
        handle.event, nbytes, through_ring = self._copy_in(want, dst, source)
        if handle.staged:
            handle.data = dst[:nbytes]
        st = self.stats.layer(want.layer)
        if demand and self.device.type == "cpu" and self.clock.kind == "wall":
            st.stall_s += time.perf_counter() - t0  # a synchronous copy blocks compute: it is a stall
        handle.ready_at = self.clock.copy(nbytes, staged=through_ring)
        handle.seq = next(_ISSUED)
        st.bytes_h2d += nbytes

    def _publish_ready(self) -> None:
        """Publish copies that have completed, without waiting for any (background migrations)."""
        for key, h in self.residency.loading():
            if self.copier.done(h.event) and self.clock.ready(h.ready_at):
                self.residency.publish(*key)
