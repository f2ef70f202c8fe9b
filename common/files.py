"""Writing output files so that a crash or a full disk never leaves a half-written one."""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

import numpy as np


def temporary_path(path: Path) -> Path:
    """Where :func:`atomic_write` writes ``path`` before renaming it: a hidden sibling."""
    return path.with_name(f".{path.name}.tmp")


def is_write_in_progress(path: Path) -> bool:
    """Whether ``path`` is :func:`atomic_write`'s temporary file, not a file of its own."""
    return path.name.startswith(".") and path.suffix == ".tmp"


def atomic_write(path: Path, data: bytes) -> None:
    """Write, flush to disk, then rename: readers see the old file or the new one, never half.

    Any failure (a full disk, say, or an interrupt) removes the temporary file; an OSError is
    raised again with the same errno and a message naming ``path`` and the bytes it tried to write.
    """
    path = Path(path)
    tmp = temporary_path(path)
    try:
        with open(tmp, "wb") as stream:
            stream.write(data)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(tmp, path)
        _sync_directory(path.parent)
    except BaseException as err:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        if not isinstance(err, OSError):
            raise
        message = f"could not write {path} ({len(data):,} bytes): {err.strerror or err}"
        if err.errno is None:
            raise OSError(message) from err
        raise OSError(err.errno, message) from err


def _sync_directory(directory: Path) -> None:
    """Flush a directory's entries: without it a power cut after the rename may bring back the
    old file. Best effort: where a directory cannot be opened or synced (Windows, some network
    file systems) the file is written all the same, and the rename is all there is."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


def npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    """An .npz archive of ``arrays``, in memory (for :func:`atomic_write`)."""
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)  # type: ignore[arg-type]  # numpy's stub types **kwds as allow_pickle
    return buffer.getvalue()
