"""Host memory behaviour that matters for speed on CPU.

glibc returns every freed block above 32 MB (and, once the heap shrinks, smaller ones) to the OS,
so the next allocation of that size page-faults its memory in again. A training step allocates the
same large temporaries every step (a [8192, 26 x 64] fp32 pooled output is 54 MB), and on virtual
machines a page fault costs microseconds: on this project's 2-core VM, one fused lookup of that
size took 56-90 ms with the default and 14 ms with freed memory kept for reuse (RESULTS.md).
`keep_freed_memory` tells glibc to serve every allocation from the heap and never trim it, as a
caching allocator would; the process's resident size then stays at its peak. No effect elsewhere.

Embedding tables are read and written at random rows, so with 4 KiB pages nearly every row touched
is a TLB miss and a page-table walk (two-level on a virtual machine). `advise_huge_pages` asks Linux
to back a large buffer with 2 MiB pages (transparent huge pages, which most distributions grant on
request: `madvise` mode), which cuts those walks by 512x in reach. The table buffers of the fused
engine use it (RESULTS.md: random row gathers and scatters on a 6.6 GB table).

Long-lived large buffers (table weights and optimizer state) come from `mapped_empty`: memory mapped
for them alone, outside malloc's heap. With freed memory kept in the heap, a table buffer allocated
after the initialisation windows of an earlier one were freed may not fit in the hole they left, so
the heap grows past the hole and the process keeps both: peak memory then depended on the order and
timing of allocations (up to a window more, measured: RESULTS.md, planner validation). Outside the
heap, tables cost exactly their bytes and the heap holds only temporaries, which reuse each other.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import sys
import warnings

import torch

from neorec.utils.malloc import M_MMAP_MAX, M_TRIM_THRESHOLD, keep_freed_memory  # noqa: F401

# What the benchmarks put in the environment of every process they time (all sides alike).
MALLOC_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}


MADV_HUGEPAGE = 14
HUGE_PAGE = 2 << 20
_libc = None


def advise_huge_pages(tensor: torch.Tensor, min_bytes: int = 16 * HUGE_PAGE) -> bool:
    """Ask for 2 MiB pages under a large host tensor, before its pages are first touched. True if
    the kernel took the advice for some of it; False (and nothing done) for small or GPU tensors,
    outside Linux, when transparent huge pages are off, or with NEOREC_HUGE_PAGES=0 in the environment.
    Values and results are never affected."""
    global _libc
    if os.environ.get("NEOREC_HUGE_PAGES", "1") == "0":
        return False
    nbytes = tensor.numel() * tensor.element_size()
    if tensor.device.type != "cpu" or nbytes < min_bytes or not sys.platform.startswith("linux"):
        return False
    try:
        if _libc is None:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        start = tensor.data_ptr()
        first = (start + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE  # madvise wants page-aligned ranges
        last = (start + nbytes) // HUGE_PAGE * HUGE_PAGE
        return last > first and _libc.madvise(first, last - first, MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False


MAPPED_MIN_BYTES = 32 << 20


def mapped_empty(
    shape: tuple[int, ...], dtype: torch.dtype, min_bytes: int = MAPPED_MIN_BYTES
) -> torch.Tensor:
    """An uninitialised CPU tensor in an anonymous memory map of its own (see the module doc) when it
    is at least `min_bytes`; a plain torch.empty otherwise or where maps are not available. The map
    lives as long as the tensor (and its views); pages are faulted in when first written."""
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    if nbytes > sys.maxsize:  # more than the address space: mmap would raise OverflowError
        raise MemoryError(f"a tensor of {nbytes:,} bytes is larger than the address space")
    if nbytes < min_bytes or not hasattr(mmap, "MAP_ANONYMOUS"):
        return torch.empty(shape, dtype=dtype)
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with warnings.catch_warnings():  # frombuffer warns about non-writable buffers; a map is writable
        warnings.simplefilter("ignore")
        return torch.frombuffer(buffer, dtype=dtype, count=numel).view(shape)
