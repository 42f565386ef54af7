"""dflax.host_memory: a step's temporaries are reused from the heap, and `release_free_memory` gives freed
buffers back (in a fresh process each, since the settings are process-wide). The default case shows
the release test can fail: glibc alone keeps the freed blocks."""

from __future__ import annotations

import subprocess
import sys

import pytest

# Free one 16 MiB mmapped block (glibc then raises its mmap threshold to 16 MiB), allocate 40 blocks of
# 8 MiB, keep only the last, free the rest: the retained megabytes are what RSS does not give back.
RELEASE_PROBE = """
import sys
import numpy as np
from dflax.host_memory import configure_malloc, release_free_memory
if sys.argv[1] == "configured":
    assert configure_malloc()
def rss_mb():
    return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) / 1024
first = np.ones(16 << 18, np.float32); del first
before = rss_mb()
blocks = [np.ones(8 << 18, np.float32) for _ in range(40)]
last = blocks[-1]; del blocks
if sys.argv[1] == "configured":
    release_free_memory()
print(rss_mb() - before)
"""

# Allocate, touch and free one 8 MiB buffer, as a decode step does with its temporaries: the megabytes that
# stay in RSS after the free are what the next step reuses instead of faulting fresh pages in.
REUSE_PROBE = """
import sys
import numpy as np
from dflax.host_memory import configure_malloc
if sys.argv[1] == "configured":
    assert configure_malloc()
else:  # the setting dflax had before: every buffer of 1 MiB or more mmapped, unmapped when freed
    import ctypes
    assert ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)
def rss_mb():
    return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) / 1024
before = rss_mb()
buffer = np.ones(8 << 18, np.float32); del buffer
print(rss_mb() - before)
"""


def _probe(code: str, mode: str) -> float:
    done = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return float(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_released_buffers_leave_the_process():
    assert _probe(RELEASE_PROBE, "default") > 200  # glibc's heap kept ~320 MB of the freed blocks here
    assert _probe(RELEASE_PROBE, "configured") < 40  # only the live 8 MB block (and noise)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_freed_temporary_stays_for_reuse():
    assert _probe(REUSE_PROBE, "mmap-1mib") < 2  # unmapped: the next step faults 8 MB in again
    assert _probe(REUSE_PROBE, "configured") > 6  # kept on the heap for the next step
