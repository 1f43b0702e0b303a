"""Moving data between host and device: expert copies on a dedicated copy stream with events on
CUDA (plain copies on CPU), a layer's routing to the host in one transfer, index arrays to the
device through pinned memory, a layer's rows to pinned host memory for the host's experts.

The same calls run on both: `copy` returns an event on CUDA (None on CPU, where the copy is done
when it returns); `wait` makes the compute stream wait for that event without a host sync (and,
given a layer's stats, times the wait on the device).

    copier = Copier(torch.device("cuda")); ev = copier.copy(slot_view, host_blob); copier.wait(ev)
    index, weights, logits = routing_to_host(top_k_index, top_k_weights, router_logits)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


class Copier:
    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self._stalls: list[tuple[Any, torch.cuda.Event, torch.cuda.Event]] = []  # (stats, before, after) a wait

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> torch.cuda.Event | None:
        """Start copying `src` (host) into `dst` (device); return the event that marks completion."""
        if not self.cuda:
            dst.copy_(src)
            return None
        # The slot may still be read by kernels already queued on the compute stream (an evicted
        # expert's last use): the copy stream must wait for them before overwriting it.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return event

    def wait(self, event: torch.cuda.Event | None, stats: Any = None) -> None:
        """Make the compute stream wait for `event` (no host sync). With `stats` (a layer's), the time
        the compute stream stands still there is added to its `stall_s` at the step's end (`settle`):
        timing events on each side of the wait, so the host never blocks to measure it."""
        if event is None:
            return
        stream = torch.cuda.current_stream(self.device)
        if stats is None:
            stream.wait_event(event)
            return
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record(stream)
        stream.wait_event(event)
        after.record(stream)
        self._stalls.append((stats, before, after))

    def settle(self) -> None:
        """Add this step's measured device stalls to their layers' stats (after the step's work)."""
        for stats, before, after in self._stalls:
            after.synchronize()
            stats.stall_s += before.elapsed_time(after) / 1e3
        self._stalls.clear()

    @staticmethod
    def done(event: torch.cuda.Event | None) -> bool:
        """Whether a copy has completed; a non-blocking query, used to publish background loads."""
        return event is None or event.query()


def routing_to_host(index: torch.Tensor, weights: torch.Tensor,
                    logits: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A layer's routing ([T, k] indices and weights) and router logits ([T, E], or None) copied to
    the host in one float32 transfer, so a layer waits for the device once, not three times
    (indices below 2**24 are exact in float32). Logits of another shape travel on their own."""
    if not index.is_cuda:  # on the host already: no transfer to save
        return index.long(), weights.float(), None if logits is None else logits.float()
    k = index.shape[-1]
    parts = [index.reshape(-1, k).float(), weights.reshape(-1, k).float()]
    packed = logits is not None and logits.dim() == 2 and logits.shape[0] == parts[0].shape[0]
    if packed:
        parts.append(logits.float())
    host = torch.cat(parts, 1).cpu()
    if not packed and logits is not None:
        logits = logits.cpu()
    return (host[:, :k].long().view(index.shape), host[:, k:2 * k].reshape(weights.shape),
            host[:, 2 * k:] if packed else logits)


def upload(values, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A small host array (a list, a numpy array or a CPU tensor) on `device`. On a GPU it goes
    through pinned memory without a host sync: a copy from pageable memory waits for the device
    (torch.cuda.set_sync_debug_mode flags it); torch keeps the pinned block until the copy is done."""
    t = values if isinstance(values, torch.Tensor) else torch.as_tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


@dataclass(frozen=True, slots=True)
class HostRows:
    """A layer's hidden rows [T, H] on the host, and the event that marks their copy done (None on
    CPU, where they are the layer's own tensor)."""

    hidden: torch.Tensor
    copied: torch.cuda.Event | None

    def wait(self) -> torch.Tensor:
        if self.copied is not None:
            self.copied.synchronize()  # this copy only: device work queued after it runs on
        return self.hidden


def rows_to_host(hidden: torch.Tensor) -> HostRows:
    """Start copying `hidden` to pinned host memory (queued on the compute stream after the work
    that produced it); on CPU, the tensor itself."""
    if not hidden.is_cuda:
        return HostRows(hidden, None)
    rows = torch.empty(hidden.shape, dtype=hidden.dtype, pin_memory=True)
    rows.copy_(hidden, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    return HostRows(rows, copied)
