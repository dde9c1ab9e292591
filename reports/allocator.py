"""Large buffers go back to the system when freed, and free pages after a large step.

A million-request report makes many short-lived numpy arrays of a few megabytes beside the
long-lived table columns. glibc raises its mmap threshold each time such a buffer is freed,
so later ones come from the heap, where the freed space stays in the process (RSS) between
live columns: at 10^6 requests that held ~100 MB above the tables' own size. Fixing the
threshold (at 1 MiB: a chunk's small temporaries still reuse heap space, the column-sized
ones do not) stops the raising, so every large buffer is its own mapping, returned when
freed (glibc only; elsewhere nothing changes). `release_free_memory` hands back what
Arrow's pool and the heap hold free after a large step. Both are process-wide and only
change when memory goes back to the system, never what is computed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

import pyarrow as pa

M_MMAP_THRESHOLD = -3
"""glibc's `mallopt` parameter number (malloc.h)."""
MMAP_THRESHOLD_BYTES = 1024 << 10


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.gnu_get_libc_version  # noqa: B018 (glibc's own symbol: not musl, not macOS)
        libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
        libc.mallopt.restype = ctypes.c_int
        libc.malloc_trim.argtypes = (ctypes.c_size_t,)
        libc.malloc_trim.restype = ctypes.c_int
    except (OSError, AttributeError, TypeError):
        return None
    return libc


@functools.cache
def return_large_buffers() -> bool:
    """Fix glibc's mmap threshold (once); False where the C library is not glibc."""
    libc = _glibc()
    return libc is not None and bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))


def release_free_memory() -> None:
    """Give free pages back to the system after a step that freed much (the journal
    parsed, the request table built): Arrow's memory pool keeps the pages of the buffers
    it parsed into (~100 MB at 10^6 requests) until told, and glibc's heap its free ones
    (`malloc_trim`)."""
    pa.default_memory_pool().release_unused()
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
