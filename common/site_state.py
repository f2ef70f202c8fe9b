"""What a site keeps between rounds on its own disk, and never sends: the parts of the model its
method keeps at home (FedPer's and FedRep's head, Local-only's whole model) and a method's own
state (Ditto's personal model).

A site writes one file per round it trained, ``<root>/<run>/partition-<pid>/round-<t>.npz``, each
holding everything it keeps as it stood after round t. Files are named by round, not replaced,
because a server that resumes from its checkpoint after round c asks again for round c + 1,
which the site may already have trained: the site then starts from what it kept after round c,
exactly as the interrupted run did, and not from the round the server never heard of.

A resumed run is a new run to Flower, and its own folder here. The server sends each message
the run's *lineage* (:data:`Lineage`): the run it is and the runs it continues, each with the
first round it trained. What a site kept in an earlier run counts up to the round where the next
run of the lineage took over; anything later in that run's folder is the interrupted round's.

Nothing here knows Flower: the ClientApp says where the root is and which lineage a message names.
"""

from __future__ import annotations

import os
import re
import zipfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from common.files import atomic_write, npz_bytes

NDArrays = dict[str, np.ndarray]
# (run key, the first round that run trained), oldest first: the last entry is the run now.
Lineage = tuple[tuple[str, int], ...]

# A run key becomes a folder name at the site: a hostile server must not name a path outside it.
RUN_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
ROUND_FILE = re.compile(r"round-(\d+)\.npz")
# Round files kept per run folder. A server resumes from its last checkpoint c, and a site may be
# two rounds past it: with fused evaluation round c + 1 is checkpointed only once round c + 2's
# training replies are in, so a server stopped during round c + 2 resumes after round c while
# its sites already saved c + 1 and c + 2. The three newest always include c (or whatever the
# site kept last before it, when it did not train in round c).
KEPT_ROUNDS = 3
SEPARATOR = "/"


def check_lineage(runs: Sequence[object], starts: Sequence[object]) -> Lineage:
    """A lineage from its two lists as they travel (run keys, first rounds), checked: keys that
    are plain folder names, rounds that are positive integers and increase. Raises ``ValueError``."""
    if len(runs) != len(starts) or not runs:
        raise ValueError(f"lineage of {len(runs)} run(s) and {len(starts)} first round(s)")
    lineage: list[tuple[str, int]] = []
    for run, start in zip(runs, starts):
        if not isinstance(run, str) or not RUN_KEY.fullmatch(run):
            raise ValueError(f"lineage run key {run!r} is not a plain name ({RUN_KEY.pattern})")
        if not isinstance(start, int) or isinstance(start, bool) or start < 1:
            raise ValueError(f"lineage first round {start!r} of run {run} is not a positive integer")
        if lineage and start <= lineage[-1][1]:
            raise ValueError(f"lineage first rounds do not increase ({lineage[-1][1]}, then {start})")
        lineage.append((run, start))
    if len({run for run, _ in lineage}) != len(lineage):
        raise ValueError("lineage names a run twice")
    return tuple(lineage)


OWNER_FILE = ".owner"


class SiteStore:
    """A site's kept state for one partition across a lineage of runs, on disk under ``root``.

    ``owner`` is who the site itself knows is asking (its Flower run id), never what a message
    says: the first run to write a run folder owns it, and another run that names the same run
    key (a server that wants the site to overwrite, or prune, the rounds of an earlier run) is
    refused. Earlier runs of a lineage are only ever read."""

    def __init__(self, root: Path, partition_id: int, lineage: Lineage, owner: str = "") -> None:
        self.root = Path(root)
        self.partition_id = partition_id
        self.lineage = lineage
        self.owner = owner

    def _folder(self, run: str) -> Path:
        return self.root / run / f"partition-{self.partition_id}"

    def _rounds(self, run: str) -> list[int]:
        folder = self._folder(run)
        if not folder.is_dir():
            return []
        return sorted(int(m.group(1)) for f in folder.iterdir() if (m := ROUND_FILE.fullmatch(f.name)))

    def newest_round(self, up_to: int) -> tuple[str, int] | None:
        """(run, round) of the newest state this lineage kept after a round <= ``up_to``."""
        ends = [start - 1 for _, start in self.lineage[1:]] + [up_to]
        for (run, start), end in reversed(list(zip(self.lineage, ends))):
            valid = [t for t in self._rounds(run) if start <= t <= min(end, up_to)]
            if valid:
                return run, valid[-1]
        return None

    def check_round(self, server_round: int) -> None:
        """Refuse a round before the newest this run kept (``ValueError``): within one run the
        rounds only go forward, so a message naming an earlier round is not the server's run
        going on, and answering it would write state out of order. The same round again (an
        honest repeat gets the same release) and any later one of the run pass."""
        rounds = self._rounds(self.lineage[-1][0])
        if rounds and server_round < rounds[-1]:
            raise ValueError(f"round {server_round} goes back: this run's site state is already at round "
                             f"{rounds[-1]} (a run's rounds only go forward)")

    def load(self, up_to: int) -> dict[str, NDArrays]:
        """Everything kept after the newest round <= ``up_to``, by name ({} before the first)."""
        found = self.newest_round(up_to)
        if found is None:
            return {}
        path = self._folder(found[0]) / f"round-{found[1]}.npz"
        try:
            with np.load(path, allow_pickle=False) as archive:
                flat = {key: archive[key] for key in archive.files}
        except (OSError, ValueError, zipfile.BadZipFile) as err:
            raise OSError(f"site state {path} is unreadable: {err}") from err
        kept: dict[str, NDArrays] = {}
        for key, value in flat.items():
            name, _, array = key.rpartition(SEPARATOR)
            kept.setdefault(name, {})[array] = value
        return kept

    def save(self, server_round: int, kept: dict[str, NDArrays]) -> Path:
        """Write what the site keeps after ``server_round`` (atomically) in the run's folder, and
        drop that folder's older rounds but the newest :data:`KEPT_ROUNDS`."""
        run = self.lineage[-1][0]
        folder = self._folder(run)
        folder.mkdir(parents=True, exist_ok=True)
        self._claim(folder)
        path = folder / f"round-{server_round}.npz"
        atomic_write(path, npz_bytes({f"{name}{SEPARATOR}{key}": value
                                      for name, arrays in kept.items() for key, value in arrays.items()}))
        for old in self._rounds(run)[:-KEPT_ROUNDS]:
            (folder / f"round-{old}.npz").unlink(missing_ok=True)
        return path

    def _claim(self, folder: Path) -> None:
        """Make ``folder`` this store's owner's, or refuse when another run owns it."""
        if not self.owner:
            return
        marker = folder / OWNER_FILE
        try:
            fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            holder = marker.read_text().strip()
            if holder != self.owner:
                raise ValueError(f"run {folder.parent.name} belongs to another run ({holder}) at this site: a "
                                 f"run may only write its own folder, never an earlier one's") from None
            return
        with os.fdopen(fd, "w") as stream:
            stream.write(self.owner + "\n")
