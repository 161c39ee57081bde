"""The C allocator set up for a process that moves bytes in buffers of 64 KiB to a few MiB.

glibc's malloc serves each allocation of 128 KiB or more with a fresh ``mmap`` and unmaps it when it
is freed, and hands free memory at the top of its heap back to the kernel once there is more than
128 KiB of it; either way the next buffer of that size faults its pages in again, and the kernel
zeroes every page. A relay allocates such buffers on every read and write (a TLS read joined to
256 KiB, the HTTP/2 frames queued for one write). ``python -m bench.datapath`` measured the tunnel
core receiving 256 KiB reads at 680-970 ms of CPU per GiB with glibc's defaults and at ~170 with the
thresholds below. :func:`tune` sets them for the whole process; it is for programs (the services'
entry points), never done on import.
"""

from __future__ import annotations

import ctypes

M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's <malloc.h>
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 4 << 20  # buffers below this come from the heap and are reused
TRIM_THRESHOLD = 16 << 20  # free heap kept for the next buffers before any goes back to the kernel


def tune() -> bool:
    """Set glibc's thresholds; False (and nothing changed) under another C library."""
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "gnu_get_libc_version"):
        return False  # musl and others: mallopt is absent or does nothing
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
