"""Writing output files so that a crash or a full disk never leaves a half-written one."""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np


def atomic_write(path: Path, data: bytes) -> None:
    """Write, flush to disk, then rename: readers see the old file or the new one, never half.

    A failed write (a full disk, say) leaves no temporary file behind and names the file.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as stream:
            stream.write(data)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise OSError(err.errno, f"could not write {path} ({len(data):,} bytes): {err.strerror}") from err


def npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    """An .npz archive of ``arrays``, in memory (for :func:`atomic_write`)."""
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()
