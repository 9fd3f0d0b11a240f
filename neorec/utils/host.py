"""Host memory behaviour that matters for speed on CPU.

glibc returns every freed block above 32 MB (and, once the heap shrinks, smaller ones) to the OS,
so the next allocation of that size page-faults its memory in again. A training step allocates the
same large temporaries every step (a [8192, 26 x 64] fp32 pooled output is 54 MB), and on virtual
machines a page fault costs microseconds: on this project's 2-core VM, one fused lookup of that
size took 56-90 ms with the default and 14 ms with freed memory kept for reuse (RESULTS.md).
`keep_freed_memory` tells glibc to serve every allocation from the heap and never trim it, as a
caching allocator would; the process's resident size then stays at its peak. No effect elsewhere.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
# What the benchmarks put in the environment of every process they time (all sides alike).
MALLOC_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}


def keep_freed_memory() -> bool:
    """Ask glibc to keep freed memory for reuse. True if it took effect (Linux with glibc)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok_mmap = libc.mallopt(M_MMAP_MAX, 0)
        ok_trim = libc.mallopt(M_TRIM_THRESHOLD, ctypes.c_int(2**31 - 1))
    except (OSError, AttributeError):
        return False
    return bool(ok_mmap and ok_trim)
