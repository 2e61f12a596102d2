"""Process-wide settings a node (or broker) applies once at start, before it allocates big buffers.

ZeroMQ's I/O thread allocates every received frame with ``malloc``, and Python frees it in the event
loop's thread when the tensor made over it goes away.  glibc serves blocks above its mmap threshold
(128 KiB, raised dynamically up to 32 MiB) with a fresh ``mmap`` and returns freed heap above its trim
threshold to the kernel, so a stream of 1 MiB or 16 MiB frames keeps touching fresh memory: one page
fault and one kernel page clear per 4 KiB, in the I/O thread, plus an ``munmap`` per frame in the
event loop.  On loopback that was a third of a receiver's CPU time.  Keeping such blocks in the heap
makes a frame's buffer a recycled one.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20
"""Blocks below this come from the heap; glibc refuses more than 32 MiB (HEAP_MAX_SIZE / 2) on 64-bit."""
TRIM_THRESHOLD_BYTES = 1 << 30
"""Freed heap kept for reuse instead of being returned to the kernel."""

_tuned = False


def tune_process() -> bool:
    """Keep large freed blocks for reuse and move start-up objects out of the garbage collector's way.

    Idempotent; returns whether glibc's malloc accepted the settings (False elsewhere, e.g. musl).
    ``gc.freeze`` moves everything made so far (torch's import is ~10^5 objects) to a generation that
    full collections skip, so a node's periodic collections stay cheap.
    """
    global _tuned
    if _tuned:
        return True
    gc.freeze()
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
            libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
    except (OSError, AttributeError):
        ok = False
    if not ok:
        log.info("malloc tuning not applied (not glibc?); large messages will cost more page faults")
    _tuned = ok
    return ok
