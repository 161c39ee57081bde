"""The C allocator set up for a process that moves bytes in buffers of 64 KiB to a few MiB.

glibc's malloc serves each allocation of 128 KiB or more with a fresh ``mmap`` and unmaps it when it
is freed, and hands free memory at the top of its heap back to the kernel once there is more than
128 KiB of it; either way the next buffer of that size faults its pages in again, and the kernel
zeroes every page. A relay allocates such buffers on every read and write (a TLS read joined to
256 KiB, the HTTP/2 frames queued for one write). With glibc's defaults, those faults and zeroed pages
cost the tunnel core receiving 256 KiB reads several times the CPU per byte it needs with the
thresholds below (``python -m bench.datapath``; the figures are in docs/benchmarks.md, "Fourth
round"). :func:`tune` sets them for the whole process; it is for programs (the services'
entry points), never done on import.

The other side of keeping buffers: ``free()`` hands back only the top of the heap, so after a burst
(an attack's connections, a storm of handshakes) the freed memory below live objects stays in the
process's RSS. :func:`return_free_memory` checks once a second and, when more than
:data:`FREE_KEPT` is free, hands every free page back (``malloc_trim``).
"""

from __future__ import annotations

import ctypes
import functools

import trio

M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's <malloc.h>
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 4 << 20  # buffers below this come from the heap and are reused
TRIM_THRESHOLD = 16 << 20  # free heap kept for the next buffers before any goes back to the kernel
FREE_KEPT = 8 << 20  # free heap return_free_memory leaves alone
CHECK_PERIOD = 1.0  # seconds


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "gnu_get_libc_version"):
        return None
    if hasattr(libc, "mallinfo2"):
        libc.mallinfo2.restype = _MallInfo2
    return libc


def tune() -> bool:
    """Set glibc's thresholds; False (and nothing changed) under another C library."""
    libc = _glibc()
    if libc is None:
        return False  # musl and others: mallopt is absent or does nothing
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )


def free_heap() -> int | None:
    """Bytes free in glibc's heaps (all arenas), or None under another C library or a glibc < 2.33."""
    libc = _glibc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None
    return int(libc.mallinfo2().fordblks)


def trim() -> bool:
    """Hand every free page of the heaps back to the kernel; whether any was."""
    libc = _glibc()
    return libc is not None and bool(libc.malloc_trim(0))


async def return_free_memory(period: float = CHECK_PERIOD, kept: int = FREE_KEPT) -> None:
    """Forever: every ``period`` seconds, :func:`trim` when more than ``kept`` bytes are free.
    Returns at once where glibc cannot say (another C library)."""
    if free_heap() is None:
        return
    while True:
        await trio.sleep(period)
        free = free_heap()
        if free is not None and free > kept:
            trim()
