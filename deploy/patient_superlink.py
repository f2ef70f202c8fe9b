"""``flower-superlink`` whose state database waits up to a minute for a lock instead of 5 s.

Flower 1.39 keeps the SuperLink's state in SQLite with ``busy_timeout = 5000`` ms. On a busy
host (many SuperNodes pushing replies at once while training holds the cores, or a SuperLink
sharing its machine with other jobs) a thread can hold the write lock for longer than that, and
the request that waited fails with "database is locked": the SuperNode's pull or push of that
message is lost, and the round waits for it until ``round-timeout``. This launcher runs the
unchanged ``flower-superlink`` (same arguments) with the wait raised to
``FEDPAC_SUPERLINK_BUSY_TIMEOUT_MS`` (default 60000).

    python deploy/patient_superlink.py --ssl-ca-certfile ... # flower-superlink's arguments

``deploy/superlink.sh`` and the compose cluster start the SuperLink this way. A test checks that
Flower's pragma list still has the entry this replaces.
"""

from __future__ import annotations

import os
import sys

import flwr.supercore.sql_mixin as sql_mixin
from flwr.superlink.cli.flower_superlink import flower_superlink


def with_busy_timeout(pragmas: tuple[tuple[str, str], ...], milliseconds: int) -> tuple[tuple[str, str], ...]:
    """``pragmas`` with ``busy_timeout`` set to ``milliseconds`` (an error if it has none)."""
    if not any(name == "busy_timeout" for name, _ in pragmas):
        raise RuntimeError("Flower's SQLite pragmas have no busy_timeout: this launcher does not fit this Flower")
    return tuple((name, str(milliseconds) if name == "busy_timeout" else value) for name, value in pragmas)


def main() -> None:
    raw = os.environ.get("FEDPAC_SUPERLINK_BUSY_TIMEOUT_MS", "60000")
    if not raw.isdigit() or not 1000 <= int(raw) <= 600_000:
        sys.exit(f"patient_superlink: FEDPAC_SUPERLINK_BUSY_TIMEOUT_MS must be 1000..600000, got {raw!r}")
    sql_mixin.SQLITE_PRAGMAS = with_busy_timeout(sql_mixin.SQLITE_PRAGMAS, int(raw))  # type: ignore[attr-defined]
    sys.argv[0] = "flower-superlink"
    flower_superlink()


if __name__ == "__main__":
    main()
