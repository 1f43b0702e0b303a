"""Host-to-device copies: a dedicated copy stream and events on CUDA, plain copies on CPU.

The same calls run on both: `copy` returns an event on CUDA (None on CPU, where the copy is done
when it returns); `wait` makes the compute stream wait for that event without a host sync.

    copier = Copier(torch.device("cuda")); ev = copier.copy(slot_view, host_blob); copier.wait(ev)
"""

from __future__ import annotations

import torch


class Copier:
    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None

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

    def wait(self, event: torch.cuda.Event | None) -> None:
        """Make the compute stream wait for `event` (no host sync)."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    @staticmethod
    def done(event: torch.cuda.Event | None) -> bool:
        """Whether a copy has completed; a non-blocking query, used to publish background loads."""
        return event is None or event.query()
