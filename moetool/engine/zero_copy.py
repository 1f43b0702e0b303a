"""Host rows read in place from inside the captured step: the blobs of the experts a step misses,
gathered from their host mirror (`engine/mirror.py`) without a host round trip.

`host_rows(src, index)` returns [S, n] uint8: row i is `src[index[i]]`, or zeros where index[i] is -1.
On CUDA `src` is pinned host memory and a Triton kernel reads it over the bus (unified virtual
addressing: a page-locked host address is valid in a kernel, and Triton takes a pinned tensor as a
pointer argument); rows marked -1 are never read, so a step that hits everywhere moves nothing. On
a CPU the host is the device, and the rows are gathered like any tensor's. It is a
`torch.library.custom_op` with a fake implementation, so `torch.compile(fullgraph=True)` and a CUDA
graph take it as one opaque call with a static shape.

    rows = host_rows(mirror_rows, torch.tensor([3, -1, 7]))      # [3, n]: experts 3 and 7, a zero row
"""

from __future__ import annotations

from functools import lru_cache

import torch

WORD = 8  # bytes per load: blobs and mirror rows are 64-byte aligned, so whole int64 words


@lru_cache(maxsize=None)
def kernel(interpret: bool = False):
    """The Triton kernel (built on first use: Triton is imported only where a step reads host rows on
    CUDA); `interpret` gives the same body under Triton's CPU interpreter, for the tests."""
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    def rows(src, index, dst, words, src_stride, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        e = tl.load(index + row)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < words
        # A row marked -1 loads nothing (the mask is false): a hit costs no bus traffic.
        marked = (offs * 0 + e) >= 0  # the row's mark, as a block (a scalar mask is not one)
        value = tl.load(src + e.to(tl.int64) * src_stride + offs, mask=inside & marked, other=0)
        tl.store(dst + row.to(tl.int64) * words + offs, value, mask=inside)

    return InterpretedFunction(rows) if interpret else triton.jit(rows)


def _words(src: torch.Tensor) -> torch.Tensor:
    """[E, n] uint8 rows (any row stride that is a multiple of 8) as [E, n/8] int64 words."""
    return src.view(torch.int64)


def rows_with_triton(src: torch.Tensor, index: torch.Tensor, out: torch.Tensor, block: int = 1024,
                     interpret: bool = False) -> torch.Tensor:
    """The Triton kernel on (src [E, n] uint8, index [S] int64, out [S, n] uint8); `interpret` runs
    it on CPU tensors (tests)."""
    s, d = _words(src), out.view(torch.int64)
    words = s.shape[1]
    grid = (index.shape[0], (words + block - 1) // block)
    kernel(interpret)[grid](s, index, d, words, s.stride(0), BLOCK=block)
    return out


@torch.library.custom_op("moetool::host_rows", mutates_args=())
def host_rows(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    if index.device.type == "cuda":
        out = torch.empty((index.shape[0], src.shape[1]), dtype=torch.uint8, device=index.device)
        return rows_with_triton(src, index, out)
    # The host is the device: a gather (reading a row for every index; the -1 rows are then cleared).
    rows = src.index_select(0, index.clamp(min=0))  # [S, n]
    return rows.masked_fill_((index < 0).unsqueeze(1), 0)


@host_rows.register_fake
def _(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return index.new_empty((index.shape[0], src.shape[1]), dtype=torch.uint8)


@lru_cache(maxsize=None)
def unavailable(device: torch.device) -> str | None:
    """Why a kernel on `device` cannot read pinned host memory in place, or None (checked once, by
    doing it: a pinned tensor's rows gathered by the kernel and compared)."""
    if device.type != "cuda":
        return None
    try:
        import triton  # noqa: F401
    except ImportError:
        return "Triton is not installed (it comes with CUDA builds of torch): the captured step reads missed experts with it"
    try:
        src = torch.arange(4 * 64, dtype=torch.int32).to(torch.uint8).view(4, 64).pin_memory()
        got = host_rows(src, torch.tensor([2, -1, 0], device=device)).cpu()
        want = torch.stack([src[2], torch.zeros(64, dtype=torch.uint8), src[0]])
        if not torch.equal(got, want):
            return "a kernel's read of pinned host memory returned other bytes on this machine"
    except Exception as e:  # noqa: BLE001 - any failure means the path is not there
        return f"a kernel cannot read pinned host memory here ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
    return None
