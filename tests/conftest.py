import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
# one thread per pytest-xdist worker (make test-fast runs one worker per core), two otherwise
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _task_identity():
    from federation import set_task_identity

    set_task_identity()
    yield
