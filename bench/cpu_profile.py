"""Where a host's CPU goes while a deployment runs: CPU seconds by kind of Flower process.

A sampler thread reads every process's CPU time from ``/proc`` each ``interval`` seconds (a
process that ends between two reads loses at most one interval of its time) and sorts it by
what the process is, from its command line and its parent's: the SuperLink, the ServerApp (and
the SuperExec that starts it), the SuperNodes, their ClientApp executors, the executors' warm
workers (the ClientApps: training, evaluation, (de)serialization) and everything else on the host.
The host's idle time comes from ``/proc/stat``.

    with ProcessCpu() as cpu:
        ...                       # the rounds to measure
    cpu.seconds                   # {"superlink": 3.1, "supernodes": 2.0, ..., "idle": 4.2}
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

KINDS = ("superlink", "serverapp", "supernodes", "executors", "clientapp workers", "other")
_TICKS = os.sysconf("SC_CLK_TCK")


def _command_line(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _cpu_and_parent(pid: str) -> tuple[float, str] | None:
    """A process's user + system CPU seconds and its parent's pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state, ppid, ...
    return (int(fields[11]) + int(fields[12])) / _TICKS, fields[1]


def kind_of(command: str, parent_command: str) -> str:
    """What a process is, from its command line and its parent's."""
    if "patient_superlink" in command or "flower-superlink" in command:
        return "superlink"
    if "flwr-serverapp" in command or "flower-superexec" in command:
        return "serverapp"
    if "fast_supernode" in command or "flower-supernode" in command:
        return "supernodes"
    if "warm_executor" in command:
        return "executors"
    if "multiprocessing" in command and "warm_executor" in parent_command:
        return "clientapp workers"
    if "flwr-clientapp" in command:  # Flower's own executor: a process per message
        return "clientapp workers"
    return "other"


def _idle_seconds() -> float:
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    return (int(fields[3]) + int(fields[4])) / _TICKS  # idle + iowait, all cores


class ProcessCpu:
    """CPU seconds by process kind between ``__enter__`` and ``__exit__``."""

    def __init__(self, interval: float = 0.5) -> None:
        self.interval = interval
        self.seconds: dict[str, float] = {}
        self._last: dict[str, float] = {}
        self._kinds: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="process-cpu", daemon=True)
        self._idle_start = 0.0

    def __enter__(self) -> ProcessCpu:
        self.seconds = dict.fromkeys(KINDS, 0.0)
        self._sample(count=False)
        self._idle_start = _idle_seconds()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample(count=True)
        self.seconds["idle"] = _idle_seconds() - self._idle_start

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample(count=True)

    def _sample(self, count: bool) -> None:
        pids = [name for name in os.listdir("/proc") if name.isdigit()]
        readings = {pid: reading for pid in pids if (reading := _cpu_and_parent(pid)) is not None}
        for pid, (cpu, parent) in readings.items():
            if pid not in self._kinds:
                self._kinds[pid] = kind_of(_command_line(pid), _command_line(parent))
            if count:
                self.seconds[self._kinds[pid]] += cpu - self._last.get(pid, 0.0)
            self._last[pid] = cpu
