"""The bench scripts, for tests that check them or reuse their measurements."""

import importlib.util
import sys
from pathlib import Path


def load_bench(name: str):  # noqa: ANN201
    """bench/<name>.py, loaded by path: bench/ is not a package, and the scripts put their folder
    on sys.path, where it would shadow the test helpers of the same names (federation.py)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", Path(__file__).resolve().parents[1] / "bench"
                                                  / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    saved = list(sys.path)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = saved
    return module
