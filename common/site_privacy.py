"""What a site keeps of its differential privacy on its own disk: the secret its noise is drawn
from and the ledger of everything it ever released. Both belong to the site, not to a run.

Nothing a message carries may decide either, because the party DP protects against is the
server, and the server writes every message:

* **The secret.** Every random draw of a private release (DP-SGD's Poisson batches and noise, the
  statistics' and counts' noise, a sample drawn from the data) comes from a generator seeded by
  a keyed hash of the site's secret (32 bytes of OS entropy, made the first time the site needs
  it and kept readable by its owner only) and of the release's inputs. A server that knows the
  run config, the round and the partition cannot regenerate the noise and subtract it. Keyed by
  the inputs, the same request (a resumed server asking again for a round with the same model)
  gets the same release, bit for bit, which tells nothing new and is not charged again; any
  other request gets noise independent of every earlier release's.
* **The ledger.** One append-only file per site and dataset, charged for every release whatever
  run key, lineage or round the message names: a fresh run key, a new lineage or a round far
  ahead starts nothing over. The budget is the site's, for its data, across runs; only the site
  starts a new ledger (by moving the file away).

Nothing here knows Flower: the ClientApp says where the site's folder is and what a release's
inputs are.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common.privacy import Ledger, PrivacySettings

SECRET_BYTES = 32
SECRET_FILE = "noise-secret"
_HEX_SECRET = re.compile(rf"[0-9a-fA-F]{{{2 * SECRET_BYTES}}}")


def privacy_folder(root: Path, partition_id: int) -> Path:
    """The folder of one site's (one partition's) privacy state under the site's state root."""
    return Path(root) / "privacy" / f"partition-{partition_id}"


def parse_secret(text: str) -> bytes:
    """A secret written as 64 hex digits (node config ``dp-noise-secret``); ValueError otherwise."""
    if not _HEX_SECRET.fullmatch(text.strip()):
        raise ValueError(f"a noise secret is {2 * SECRET_BYTES} hex digits ({SECRET_BYTES} bytes)")
    return bytes.fromhex(text.strip())


def site_secret(folder: Path) -> bytes:
    """The site's secret in ``folder``, made from OS entropy the first time (owner-only file).

    Made with O_EXCL: two processes of one site that start at once agree on one secret (the
    loser reads the winner's). A file that is not exactly a secret is an error, not replaced:
    the noise of every release after it would no longer be what the ledger assumes."""
    path = Path(folder) / SECRET_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return _read_secret(path)
    with os.fdopen(fd, "w") as stream:
        stream.write(secrets.token_hex(SECRET_BYTES) + "\n")
        stream.flush()
        os.fsync(stream.fileno())
    return _read_secret(path)


def _read_secret(path: Path) -> bytes:
    try:
        return parse_secret(path.read_text())
    except ValueError as err:
        raise ValueError(f"the site's noise secret {path} is damaged ({err}): restore it, or move it "
                         "away to start a new one") from err


def digest_arrays(named: Mapping[str, Mapping[str, np.ndarray]], digest: hashlib._Hash) -> None:
    """Feed ``named``'s arrays (names, shapes, dtypes and bytes, in sorted order) into ``digest``."""
    for name in sorted(named):
        for key in sorted(named[name]):
            value = np.ascontiguousarray(named[name][key])
            digest.update(f"{name}/{key}:{value.shape}:{value.dtype};".encode())
            digest.update(value.tobytes())


def release_id(partition_id: int, server_round: int, inputs: Iterable[bytes]) -> str:
    """A release's identity: the partition, the round and everything that shapes what the site
    computes (the received model and sections, what the site kept, the settings): equal ids are
    equal releases."""
    digest = hashlib.sha256(f"fedpac-release:{partition_id}:{server_round};".encode())
    for part in inputs:
        digest.update(len(part).to_bytes(8, "big"))
        digest.update(part)
    return digest.hexdigest()


def noise_seed(secret: bytes, release: str, stream: str) -> int:
    """The seed of one random stream (``"noise"``, ``"sampling"``) of one release: a keyed hash
    (HMAC-like, BLAKE2b's key) of the release id, so without the secret it is unpredictable, and
    the streams of two releases are independent."""
    digest = hashlib.blake2b(f"{release}:{stream}".encode(), key=secret, digest_size=8)
    return int.from_bytes(digest.digest(), "big") >> 1  # torch seeds are signed 64-bit


@dataclass(frozen=True)
class Entry:
    """One line of the ledger: a release (its id, the run and round that asked for it, what it
    released), or, with ``refused``, a round's releases the site computed and withheld (over its
    budget): not charged, but the next round's look-ahead."""

    release: str
    run: str
    round: int
    released: Ledger
    refused: bool = False

    def to_json(self) -> str:
        return json.dumps({"release": self.release, "run": self.run, "round": self.round,
                           "mechanisms": self.released.history, "refused": self.refused}, sort_keys=True)

    @classmethod
    def from_json(cls, line: str) -> Entry:
        data = json.loads(line)
        return cls(str(data["release"]), str(data["run"]), int(data["round"]),
                   Ledger.from_array(np.asarray(data["mechanisms"], dtype=np.float64)), bool(data.get("refused")))


class SiteLedger:
    """The site's append-only privacy ledger of one dataset: one JSON line per release."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def entries(self) -> list[Entry]:
        """Every entry, oldest first. A last line cut short (a crash while appending, before the
        release it would charge left the site) is ignored; any other damage is an error: a site
        whose ledger cannot be read must not release anything more."""
        if not self.path.exists():
            return []
        text = self.path.read_text()
        lines = text.split("\n")
        complete, tail = lines[:-1], lines[-1]
        entries = []
        for number, line in enumerate(complete, 1):
            try:
                entries.append(Entry.from_json(line))
            except (ValueError, KeyError, TypeError) as err:
                raise ValueError(f"the site's privacy ledger {self.path} is damaged at line {number} ({err}): "
                                 "restore it from a copy; a site whose spending is unknown releases nothing") from err
        del tail  # a line without its newline was never completed
        return entries

    def spent(self, entries: list[Entry] | None = None) -> Ledger:
        """Everything the site released with this dataset: each distinct charged release once."""
        seen: set[str] = set()
        total = Ledger()
        for entry in self.entries() if entries is None else entries:
            if not entry.refused and entry.release not in seen:
                seen.add(entry.release)
                total = total.then(entry.released)
        return total

    def find(self, release: str, entries: list[Entry] | None = None) -> Entry | None:
        """The charged entry of ``release``, if the site released it before."""
        return next((e for e in (self.entries() if entries is None else entries)
                     if e.release == release and not e.refused), None)

    def append(self, entry: Entry) -> None:
        """Add ``entry``, flushed to disk before this returns: a release is charged before it
        leaves the site. A cut-short last line is dropped first."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a+b") as stream:
            size = stream.seek(0, os.SEEK_END)
            if size:
                stream.seek(0)
                keep = stream.read().rfind(b"\n") + 1
                if keep != size:
                    stream.truncate(keep)
            stream.seek(0, os.SEEK_END)
            stream.write((entry.to_json() + "\n").encode())
            stream.flush()
            os.fsync(stream.fileno())


class PolicyRefusal(ValueError):
    """A run asks a site for less privacy than the site's own policy allows: the site refuses."""


@dataclass(frozen=True)
class SitePolicy:
    """What a site requires of every run, from its own node config, whatever the run config
    says: the server's operator sets the run config, so only the site can hold this line.

    ``required``: DP on (``dp-required``); ``epsilon_budget``: the site's own budget over its
    ledger (``dp-epsilon-budget``, 0: none), which a run's budget can only lower;
    ``min_noise_multiplier`` / ``min_statistics_noise_multiplier``: floors on the noise in force
    (after any calibration); ``max_delta``: the largest delta it accepts; ``withhold_metrics``:
    its evaluations' accuracy and loss stay at the site (``withhold-metrics``), since they
    describe its test records, which DP does not cover."""

    required: bool = False
    epsilon_budget: float = 0.0
    min_noise_multiplier: float = 0.0
    min_statistics_noise_multiplier: float = 0.0
    max_delta: float = 0.0
    withhold_metrics: bool = False

    KEYS = ("dp-required", "dp-epsilon-budget", "dp-min-noise-multiplier", "dp-min-statistics-noise-multiplier",
            "dp-max-delta", "withhold-metrics")

    @classmethod
    def from_node_config(cls, node_config: Mapping[str, object]) -> SitePolicy:
        """The policy in ``node_config`` (absent keys: no requirement); ValueError names a bad value."""
        def number(key: str) -> float:
            value = node_config.get(key, 0.0)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"node config {key} = {value!r}: a number >= 0")
            return float(value)

        def flag(key: str) -> bool:
            value = node_config.get(key, False)
            if not isinstance(value, bool):
                raise ValueError(f"node config {key} = {value!r}: true or false")
            return value

        return cls(flag("dp-required"), number("dp-epsilon-budget"), number("dp-min-noise-multiplier"),
                   number("dp-min-statistics-noise-multiplier"), number("dp-max-delta"), flag("withhold-metrics"))

    def budget(self, run_budget: float) -> float:
        """The budget in force: the tighter of the site's and the run's (0: neither has one)."""
        budgets = [b for b in (self.epsilon_budget, run_budget) if b > 0]
        return min(budgets) if budgets else 0.0

    def check(self, settings: PrivacySettings | None) -> None:
        """Raise :class:`PolicyRefusal`, naming the key, when ``settings`` (None: DP off) ask
        for less than this policy."""
        if settings is None:
            if self.required:
                raise PolicyRefusal("the site requires differential privacy (node config dp-required = true) and "
                                    "the run has dp = false")
            return
        floors = (("dp-noise-multiplier", settings.noise_multiplier, self.min_noise_multiplier,
                   "dp-min-noise-multiplier"),
                  ("dp-statistics-noise-multiplier", settings.statistics_noise_multiplier,
                   self.min_statistics_noise_multiplier, "dp-min-statistics-noise-multiplier"))
        for key, value, floor, policy_key in floors:
            if value < floor:
                raise PolicyRefusal(f"the run's {key} is {value:.4g} (after calibration), below the site's "
                                    f"{policy_key} = {floor:g}")
        if self.max_delta and settings.delta > self.max_delta:
            raise PolicyRefusal(f"the run's dp-delta = {settings.delta:g} is above the site's dp-max-delta = "
                                f"{self.max_delta:g}")
