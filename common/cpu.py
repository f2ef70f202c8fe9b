"""Is this machine busy? Thread counts for parallel numerics on a shared host.

Thread pools (OpenBLAS's, torch's OpenMP pool) synchronise at every operation: when another
process holds one of the cores, every operation waits for the thread that shares that core,
and throughput collapses (measured on 2 cores: the collaboration QPs 31x slower, FedPAC's local
update 7x). One thread does not wait for anybody, so the server's collaboration QPs run on one
thread whenever another process is running, and on the library's default only on an idle
machine (OpenBLAS's products give the same bits on any thread count, so this keeps runs exact).

The training processes also keep the memory they free (``keep_freed_memory``): see there.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import glob
import os
import sys
import time

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Blocks up to this size come from the heap, not from a mapping of their own: above any
# activation batch of the models here (a 64-sample batch of 32 x 28 x 28 floats is 6.4 MB).
MMAP_THRESHOLD = 32 << 20
# Free memory at the top of the heap is given back to the kernel only above this much.
TRIM_THRESHOLD = 64 << 20


def others_running(samples: int = 3) -> bool:
    """Whether a thread of another process is running or runnable now (Linux: the states in
    /proc/<pid>/task/<tid>/stat; this process's own BLAS threads spin after a call and do not
    count). True where /proc cannot be read: one thread is the safe answer."""
    own = str(os.getpid())
    try:
        for _ in range(samples):
            for stat in glob.glob("/proc/[0-9]*/task/[0-9]*/stat"):
                if stat.split("/")[2] == own:
                    continue
                try:
                    with open(stat, encoding="ascii", errors="replace") as stream:
                        state = stream.read().rsplit(")", 1)[1].split()[0]
                except (OSError, IndexError):
                    continue  # the task ended while we looked
                if state == "R":
                    return True
            time.sleep(0.005)
    except OSError:
        return True
    return not os.path.isdir("/proc/self/task")


@functools.lru_cache(maxsize=1)
def keep_freed_memory() -> bool:
    """Let this process keep the memory it frees for its next allocations (glibc only; a no-op
    returning False elsewhere). Returns whether the setting took.

    By default glibc gives every block of 128 kB or more a mapping of its own and unmaps it on
    free, and hands freed heap tops back to the kernel; the kernel must then zero every page
    again on first touch. A local update allocates and frees its activations and gradients at
    every batch: FedPAC's update of 600 Fashion-MNIST images caused about 21,000 page faults
    (some 85 MB zeroed), 6-8 % of its time on one core, and the same again in every message of a
    warm ClientApp. With both thresholds raised the same update causes almost none; the
    process's memory stays at its working set (tens of MB) instead of shrinking between batches.
    """
    name = ctypes.util.find_library("c")
    if not name or not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):  # musl and other libcs without mallopt
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
