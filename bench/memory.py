"""What processes take in memory, from /proc: RSS, PSS, a process's descendants, a session's
processes, and the host's memory in use.

PSS (proportional set size) counts a page shared by k processes as 1/k in each: the sum of the
PSS of many processes is what they take together, where the sum of their RSS counts the shared
libraries (torch's are about 300 MB) once per process.
"""

from __future__ import annotations

import threading
from pathlib import Path


def _status_kb(path: Path, field: str) -> float:
    try:
        for line in path.read_text().splitlines():
            if line.startswith(field):
                return float(line.split()[1])
    except OSError:
        pass
    return 0.0


def rss_mb(pid: int) -> float:
    """Resident memory of process ``pid`` (0 if it is gone)."""
    return _status_kb(Path(f"/proc/{pid}/status"), "VmRSS:") / 1024


def pss_mb(pid: int) -> float:
    """Proportional set size of process ``pid`` (0 if it is gone)."""
    return _status_kb(Path(f"/proc/{pid}/smaps_rollup"), "Pss:") / 1024


def _stat_fields() -> dict[int, list[str]]:
    """Every process's /proc/<pid>/stat fields after the command name (state, ppid, pgrp, ...)."""
    fields = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields[int(stat.parent.name)] = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
    return fields


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (for the simulation: Ray's raylet, GCS and workers)."""
    children: dict[int, list[int]] = {}
    for child, fields in _stat_fields().items():
        children.setdefault(int(fields[1]), []).append(child)
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def process_group(pgid: int) -> list[int]:
    """The processes of process group ``pgid`` (a SuperNode started in a session of its own:
    its launcher, the SuperNode, its executor and the executor's ClientApp worker)."""
    return [pid for pid, fields in _stat_fields().items() if int(fields[2]) == pgid]


def host_used_mb() -> float:
    """Memory in use on the host: MemTotal - MemAvailable."""
    meminfo = Path("/proc/meminfo")
    return (_status_kb(meminfo, "MemTotal:") - _status_kb(meminfo, "MemAvailable:")) / 1024


def host_total_mb() -> float:
    return _status_kb(Path("/proc/meminfo"), "MemTotal:") / 1024


def group_pss_mb(pgid: int) -> float:
    """What process group ``pgid`` takes together."""
    return sum(pss_mb(pid) for pid in process_group(pgid))


class GroupPeaks(threading.Thread):
    """The peak PSS of each process group in ``groups`` (label: pgid) and the peak of the host's
    memory in use, sampled every ``interval`` seconds until :meth:`stop`."""

    def __init__(self, groups: dict[str, int], interval: float = 2.0) -> None:
        super().__init__(daemon=True)
        self.groups, self.interval = groups, interval
        self.peak_pss = dict.fromkeys(groups, 0.0)
        self.peak_host_used = 0.0
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            for label, pgid in self.groups.items():
                self.peak_pss[label] = max(self.peak_pss[label], group_pss_mb(pgid))
            self.peak_host_used = max(self.peak_host_used, host_used_mb())
            self._stop_event.wait(self.interval)

    def stop(self) -> None:
        self._stop_event.set()
        self.join()
