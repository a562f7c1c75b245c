"""A rank's allocator, held steady: glibc's malloc thresholds fixed, so a step's time does not depend
on what the process allocated before it (docs/measuring.md#the-allocator).

glibc serves a large allocation by a fresh ``mmap`` (page faults at its first touch) until a large
block is freed, then raises that threshold and serves such sizes from its heap. Which side of the
threshold a step's buffers fall on then depends on what was built and freed before: stock row_wise
alone measured 47.8 ms a step in the microbenchmark, 29.6 ms with the thresholds fixed.
"""

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
STEADY_BYTES = 1 << 28  # allocations below 256 MB come from the heap, freed memory stays with it
ENV = "MALLOC_MMAP_THRESHOLD_"  # glibc's own setting: a user who set it keeps it


def _mallopt():
    if ENV in os.environ:
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc
        return None


def steady_allocator_available() -> bool:
    """Whether :func:`hold_allocator_steady` fixes the thresholds here (glibc, and not set by the user)."""
    return _mallopt() is not None


def hold_allocator_steady() -> bool:
    """Fixes glibc's mmap and trim thresholds at :data:`STEADY_BYTES` for this process; True where it did."""
    mallopt = _mallopt()
    if mallopt is None:
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, STEADY_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, STEADY_BYTES))
