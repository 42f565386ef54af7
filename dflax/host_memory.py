"""Host memory on Linux (glibc): give freed large buffers back to the system.

XLA's CPU runtime allocates every program's temporaries with malloc. glibc raises its mmap threshold each
time a large mmapped block is freed (up to 32 MiB), after which such buffers come from the heap, and a
fragmented heap is not returned. A long run that executes many program shapes (continuous batching
refills prefill a varying number of rows) then grows without bound: `dflax make-data` reached 15 GB and a
batch-16 MT-Bench bench 11 GB on this 24 GB machine before the OOM killer ended them. With the threshold
fixed at 1 MiB, every buffer of 1 MiB or more is an mmap that goes back to the system when freed: the same
refill run stays at about half the memory (the rest is compiled programs, bounded by the shapes).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
MMAP_THRESHOLD_BYTES = 1 << 20


@functools.cache
def return_large_buffers() -> bool:
    """Fixes glibc's mmap threshold at 1 MiB for this process (once; see the module docstring).

    Returns:
      True when the setting took effect; False where the C library is not glibc (nothing to do).
    """
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
