"""A busy machine for benchmarks: another CPU-bound job holding one core, as on a shared server."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator

_BUSY_LOOP = "import os\nos.sched_setaffinity(0, {0})\nwhile True:\n    pass\n"


@contextlib.contextmanager
def one_core_taken() -> Iterator[None]:
    """A CPU-bound process pinned to core 0 while inside the block."""
    process = subprocess.Popen([sys.executable, "-c", _BUSY_LOOP])
    time.sleep(1.0)  # let it start spinning
    try:
        yield
    finally:
        process.kill()
        process.wait()
