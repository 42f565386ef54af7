"""Host memory on Linux (glibc): reuse a step's temporaries, and give freed memory back between chunks.

XLA's CPU runtime allocates program temporaries with malloc. Two glibc behaviours pull against each other:
- By default glibc raises its mmap threshold each time a large mmapped block is freed (up to 32 MiB), after
  which such buffers come from the heap, and a fragmented heap is not returned. A long run that executes
  many program shapes (continuous batching refills prefill a varying number of rows) then grew without
  bound: `dflax make-data` reached 15 GB and a batch-16 MT-Bench bench 11 GB on a 24 GB machine before
  the OOM killer ended them.
- Buffers that are mmapped, or heap tops that are trimmed, when freed come back as fresh zeroed pages on
  the next allocation. A 1 MiB threshold (fixed: glibc then also stops raising its 128 KiB trim threshold)
  made a decode step at batch 64 page-fault its temporaries in again every step: SmolLM2's step took 381
  ms against 176 ms with glibc's defaults, 2.2x (batch 16: 77 against 40 ms; batch 8: 28 against 23 ms).

So the thresholds are fixed where the step's temporaries stay on the heap (mmap at 32 MiB, trim at 1 GiB:
the defaults' speed), and `release_free_memory` gives every free heap page back (malloc_trim) at points
where a run changes program shapes, such as each refill of continuous batching; a chunk of decode steps
then pays the page faults once.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20
"""Freed buffers of at least this size are unmapped at once (larger than a decode step's temporaries)."""
TRIM_THRESHOLD_BYTES = 1 << 30
"""Free memory at the top of the heap is kept up to this size (so a step's temporaries are reused)."""


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
    except (OSError, TypeError):
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None  # glibc's own


@functools.cache
def configure_malloc() -> bool:
    """Fixes glibc's mmap and trim thresholds for this process (once; see the module docstring).

    Returns:
      True when the settings took effect; False where the C library is not glibc (nothing to do).
    """
    libc = _glibc()
    if libc is None:
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )


def release_free_memory() -> bool:
    """Gives the heap's free pages back to the system (glibc's malloc_trim(0), every arena).

    Returns:
      True when some memory was released; False when none was or the C library is not glibc.
    """
    libc = _glibc()
    return bool(libc.malloc_trim(0)) if libc is not None else False
