"""Is this machine busy? Thread counts for parallel numerics on a shared host.

Thread pools (OpenBLAS's, torch's OpenMP pool) synchronise at every operation: when another
process holds one of the cores, every operation waits for the thread that shares that core,
and throughput collapses (measured on 2 cores: the collaboration QPs 31x slower, FedPAC's local
update 7x). One thread does not wait for anybody, so the server's collaboration QPs run on one
thread whenever another process is running, and on the library's default only on an idle
machine (OpenBLAS's products give the same bits on any thread count, so this keeps runs exact).
"""

from __future__ import annotations

import glob
import os
import time


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

