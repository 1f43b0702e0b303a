"""Host rows read in place from inside the captured step: the blobs of the experts a step misses,
gathered from their host mirror (`engine/mirror.py`) without a host round trip.

`host_rows(src, index)` returns [S, n] uint8: row i is `src[index[i]]`, or zeros where index[i] is -1.
`blob_rows(pool, slot, src, index)` is the same beside a device pool, for a precision whose experts
can miss: row i is `src[index[i]]` where index[i] >= 0 (a miss), else the first n bytes of
`pool[slot[i]]` where slot[i] >= 0 (a hit), else zeros; each row's bytes are read once, from where
they are, not gathered from both and merged.

On CUDA `src` is pinned host memory and a Triton kernel reads it over the bus (unified virtual
addressing: a page-locked host address is valid in a kernel, and Triton takes a pinned tensor as a
pointer argument); rows marked -1 are never read, so a step that hits everywhere moves nothing. On
a CPU the host is the device, and the rows are gathered like any tensor's, each from its one
source. Both are `torch.library.custom_op`s with a fake implementation, so
`torch.compile(fullgraph=True)` and a CUDA graph take each as one opaque call with a static shape.

    rows = host_rows(mirror_rows, torch.tensor([3, -1, 7]))      # [3, n]: experts 3 and 7, a zero row
    rows = blob_rows(pool, torch.tensor([5, 0, -1]), mirror_rows, torch.tensor([-1, -1, 7]))
    # [3, n]: slot 5's blob, slot 0's, expert 7's from host memory
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

    def rows(src, index, pool, slot, dst, words, src_stride, pool_stride, POOL: tl.constexpr,
             BLANK: tl.constexpr, BLOCK: tl.constexpr):
        # Blocks of words on grid axis 0 (up to 2^31 - 1 programs), rows on axis 1 (CUDA caps it at 65535):
        # a 16-bit expert of Mixtral-8x22B is over 512 MiB, more blocks of 8 KiB than axis 1 holds.
        row = tl.program_id(1)
        e = tl.load(index + row)
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < words
        # A row marked -1 loads nothing (the mask is false): a hit costs no bus traffic.
        marked = (offs * 0 + e) >= 0  # the row's mark, as a block (a scalar mask is not one)
        value = tl.load(src + e.to(tl.int64) * src_stride + offs, mask=inside & marked, other=0)
        if POOL:  # an unmarked row with a slot reads it from the device pool instead: one load either way
            s = tl.load(slot + row)
            here = ((offs * 0 + s) >= 0) & ~marked
            held = tl.load(pool + s.to(tl.int64) * pool_stride + offs, mask=inside & here, other=0)
            value = tl.where(here, held, value)
            marked = marked | here
        # BLANK writes a row with no source as zeros; without it such a row is left as it was (a fused
        # kernel given -1 for it never reads it, and a step then writes no zeros over k blobs a layer).
        keep = inside if BLANK else inside & marked
        tl.store(dst + row.to(tl.int64) * words + offs, value, mask=keep)

    return InterpretedFunction(rows) if interpret else triton.jit(rows)


def _words(src: torch.Tensor) -> torch.Tensor:
    """[E, n] uint8 rows (any row stride that is a multiple of 8) as [E, n/8] int64 words."""
    return src.view(torch.int64)


def rows_with_triton(src: torch.Tensor, index: torch.Tensor, out: torch.Tensor, block: int = 1024,
                     interpret: bool = False, pool: torch.Tensor | None = None,
                     slot: torch.Tensor | None = None, blank: bool = True) -> torch.Tensor:
    """The Triton kernel on (src [E, n] uint8, index [S] int64, out [S, n] uint8) and, where given, a
    pool beside it (pool [P, >= n] uint8, slot [S] int64); `interpret` runs it on CPU tensors (tests).
    `blank`: a row with no source is written as zeros; off, it is not written."""
    s, d = _words(src), out.view(torch.int64)
    p = _words(pool) if pool is not None else s  # without a pool, never read (POOL is off)
    words = s.shape[1]
    grid = ((words + block - 1) // block, index.shape[0])
    kernel(interpret)[grid](s, index, p, slot if slot is not None else index, d, words, s.stride(0), p.stride(0),
                            POOL=pool is not None, BLANK=blank, BLOCK=block)
    return out


@torch.library.custom_op("moetool::host_rows", mutates_args=())
def host_rows(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    out = torch.empty((index.shape[0], src.shape[1]), dtype=torch.uint8, device=index.device)
    if index.device.type == "cuda":
        return rows_with_triton(src, index, out)
    return _rows_on_cpu(src, index, out)


@host_rows.register_fake
def _(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return index.new_empty((index.shape[0], src.shape[1]), dtype=torch.uint8)


@torch.library.custom_op("moetool::missed_rows", mutates_args=())
def missed_rows(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`host_rows` for a fused kernel's `SlotPool`: the marked rows only. A row marked -1 is left as
    allocated, never read (the kernel is given -1 for it): on CUDA a step writes no zeros over the k
    blobs of a layer that hit. On a CPU, `host_rows`'s rows."""
    out = torch.empty((index.shape[0], src.shape[1]), dtype=torch.uint8, device=index.device)
    if index.device.type == "cuda":
        return rows_with_triton(src, index, out, blank=False)
    return _rows_on_cpu(src, index, out)


@missed_rows.register_fake
def _(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return index.new_empty((index.shape[0], src.shape[1]), dtype=torch.uint8)


@torch.library.custom_op("moetool::blob_rows", mutates_args=())
def blob_rows(pool: torch.Tensor, slot: torch.Tensor, src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    out = torch.empty((index.shape[0], src.shape[1]), dtype=torch.uint8, device=index.device)
    if index.device.type == "cuda":
        return rows_with_triton(src, index, out, pool=pool, slot=slot)
    return _rows_on_cpu(src, index, out, pool, slot)


@blob_rows.register_fake
def _(pool: torch.Tensor, slot: torch.Tensor, src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return index.new_empty((index.shape[0], src.shape[1]), dtype=torch.uint8)


def _rows_on_cpu(src: torch.Tensor, index: torch.Tensor, out: torch.Tensor, pool: torch.Tensor | None = None,
                 slot: torch.Tensor | None = None) -> torch.Tensor:
    """Both ops on a CPU, where the host is the device and a shape may follow the data inside an op:
    the missed rows gathered from `src` and the hit rows from `pool` into one buffer (a zero row after
    them), then each row of `out` taken from it. Every source row is read once, by memcpy-fast gathers
    of whole words and no scalar read; gathering every row from both and merging them reads each twice
    and merges byte by byte (a uint8 `masked_fill_` or `where` runs at ~1 GB/s on a 2-core CPU)."""
    words = out.view(torch.int64)  # [S, n/8]
    m = (index >= 0).nonzero().squeeze(1)  # the rows read from each source, in order
    h = ((index < 0) & (slot >= 0)).nonzero().squeeze(1) if slot is not None else m[:0]
    read = torch.cat([m, h])
    buf = words.new_empty((len(read) + 1, words.shape[1]))
    torch.index_select(_words(src), 0, index[m], out=buf[:len(m)])
    if pool is not None:
        torch.index_select(_words(pool)[:, :words.shape[1]], 0, slot[h], out=buf[len(m):-1])
    buf[-1].zero_()
    at = torch.full_like(index, len(read)).index_put_((read,), torch.arange(len(read)))  # out row -> buffer row
    torch.index_select(buf, 0, at, out=words)
    return out


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
        pool = (src.flip(0) + 1).to(device)  # and beside a device pool: rows from the pool, the host, neither
        got_both = blob_rows(pool, torch.tensor([1, 3, -1], device=device), src,
                             torch.tensor([-1, 2, -1], device=device)).cpu()
        want_both = torch.stack([pool[1].cpu(), src[2], torch.zeros(64, dtype=torch.uint8)])
        if not torch.equal(got, want) or not torch.equal(got_both, want_both):
            return "a kernel's read of pinned host memory returned other bytes on this machine"
    except Exception as e:  # noqa: BLE001 - any failure means the path is not there
        return f"a kernel cannot read pinned host memory here ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
    return None
