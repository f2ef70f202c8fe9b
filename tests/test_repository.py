"""A clone stays small: git holds code, docs and published results (summaries, per-round tables,
plots), not grid state, checkpoints or per-client raw outputs, which every clone would carry
forever."""

import fnmatch
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_TREE_BYTES = 15 * 1024 * 1024
MAX_FILE_BYTES = 1024 * 1024
# What a grid, a run or a build leaves that must stay on the machine that made it.
NEVER_TRACKED = ("experiments/state/*", "*/clients.csv*", "*.npz", "*.pt", "*.tgz", "*.whl")


def tracked_files() -> list[Path]:
    listing = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=False)
    if listing.returncode:
        pytest.skip("not a git checkout")
    return [ROOT / name for name in listing.stdout.decode().split("\0") if name]


def test_the_tracked_tree_is_at_most_15_mb_and_no_file_over_1_mb():
    sizes = {path.relative_to(ROOT).as_posix(): path.stat().st_size for path in tracked_files() if path.is_file()}
    assert sum(sizes.values()) <= MAX_TREE_BYTES, f"tracked files: {sum(sizes.values()) / 2**20:.1f} MB"
    large = {name: size for name, size in sizes.items() if size > MAX_FILE_BYTES}
    assert not large, f"files over 1 MB: {large}"


def test_no_grid_state_checkpoint_or_raw_per_client_output_is_tracked():
    names = [path.relative_to(ROOT).as_posix() for path in tracked_files()]
    offending = [name for name in names if any(fnmatch.fnmatch(name, pattern) for pattern in NEVER_TRACKED)]
    assert not offending, f"keep these out of git (.gitignore): {offending}"
