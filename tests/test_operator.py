"""What an operator meets when something is wrong on disk (issue 14): certificates made with the
CA key kept offline, a full disk at the end of a round, and unreadable client data. Each error
names the file and what is wrong, and nothing is left half-written."""

from __future__ import annotations

import csv
import errno
import gzip
import io
import json
import logging
import os
import shutil
import struct
import subprocess
import threading
import sys
import time
import tomllib
from pathlib import Path

import numpy as np
import pytest
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat, load_ssh_public_key

from flwr.app import MessageType

import common.figures
import common.files
import server_app.checkpoint
import server_app.report
from common import protocol as p
from common.averaging import capped_sample_weights, weighted_average
from common.config import parse_run_config
from common.data import DataError, load_client_directory, load_idx_dataset, read_idx
from common.methods.fedpac.server import CENTROIDS
from common.methods.server import EXTRACTOR, HEAD, ServerState
from common.files import atomic_write
from common.sites import fingerprint
from federation import InProcessGrid
from prerequisites import require_tools
from server_app.app import run_fedpac, write_round_outputs
from server_app.checkpoint import Checkpoint, load_checkpoint
from server_app.report import ChartPainter, RoundRecord, RunReport

ROOT = Path(__file__).resolve().parents[1]
CERTS = ROOT / "deploy" / "certs.sh"


@pytest.fixture
def _openssl_and_ssh_keygen() -> None:
    require_tools("openssl", "ssh-keygen")


needs_tools = pytest.mark.usefixtures("_openssl_and_ssh_keygen")


# ---------------------------------------------------------------------------- deploy/certs.sh


def certs(out: Path, *args: str, clients: int = 1) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(CERTS), "create", "--out", str(out), "--clients", str(clients), *args],
                          capture_output=True, text=True, timeout=120, check=False)


def listing(directory: Path) -> dict[str, bytes]:
    return {str(f.relative_to(directory)): f.read_bytes() for f in sorted(directory.rglob("*")) if f.is_file()}


def sans(cert: Path) -> str:
    return subprocess.run(["openssl", "x509", "-in", str(cert), "-noout", "-ext", "subjectAltName"],
                          capture_output=True, text=True, check=True).stdout


def verifies(out: Path) -> bool:
    return subprocess.run(["openssl", "verify", "-CAfile", str(out / "ca.crt"), str(out / "superlink.crt")],
                          capture_output=True, check=False).returncode == 0


def no_leftovers(out: Path) -> None:
    names = {f.name for f in out.rglob("*")}
    assert not {"ca.srl", "superlink.csr"} & names
    assert not [n for n in names if n.startswith(".certs.") or n.endswith(".tmp")]


@needs_tools
def test_certs_create_makes_a_verified_set_and_nothing_else(tmp_path):
    out = tmp_path / "certs"
    result = certs(out, "--san", "fedpac.example.org", "--san", "203.0.113.7", clients=2)
    assert result.returncode == 0, result.stderr
    for name in ("ca.crt", "ca.key", "superlink.crt", "superlink.key", "superexec.secret",
                 "keys/supernode-0", "keys/supernode-1.pub", "keys/supernode-1.secret"):
        assert (out / name).stat().st_size > 0, name
    assert verifies(out)
    assert "DNS:fedpac.example.org" in sans(out / "superlink.crt")
    assert "IP Address:203.0.113.7" in sans(out / "superlink.crt")
    assert (out / "superlink.key").stat().st_mode & 0o077 == 0
    # P-256 node keys: each node signs, and the SuperLink verifies, every request (P-384: 7x the CPU)
    for pid in range(2):
        assert (out / "keys" / f"supernode-{pid}.pub").read_text().startswith("ecdsa-sha2-nistp256 ")
    no_leftovers(out)
    # a re-run with the same names (any order, IPs in any spelling) changes nothing
    before = listing(out)
    again = certs(out, "--san", "203.0.113.7", "--san", "fedpac.example.org", clients=2)
    assert again.returncode == 0, again.stderr
    assert listing(out) == before
    assert "nothing to create" in again.stdout


@needs_tools
def test_certs_without_the_ca_key_fail_clearly_and_write_nothing(tmp_path):
    out = tmp_path / "certs"
    assert certs(out).returncode == 0
    (out / "ca.key").rename(tmp_path / "ca.key")  # kept offline, as the README advises
    (out / "superlink.crt").unlink()
    (out / "superlink.key").unlink()
    before = listing(out)
    for _ in range(2):  # the second call used to claim success over a 0-byte superlink.crt
        result = certs(out)
        assert result.returncode == 1
        assert "ca.key not found" in result.stderr and str(out) in result.stderr
        assert "put the ca key back" in result.stderr.lower()
        assert "created" not in result.stdout
        assert listing(out) == before  # no 0-byte superlink.crt, no .csr, no ca.srl
        no_leftovers(out)
    # SuperNode keys need no CA key: adding clients works with it offline
    (out / "superlink.crt").write_bytes(b"")  # what the old script left behind
    result = certs(out, clients=3)
    assert result.returncode == 1 and "not a readable certificate" in result.stderr
    (out / "superlink.crt").unlink()
    (tmp_path / "ca.key").rename(out / "ca.key")
    assert certs(out).returncode == 0
    (out / "ca.key").rename(tmp_path / "ca.key")
    result = certs(out, clients=3)
    assert result.returncode == 0, result.stderr
    assert "keys/supernode-2" in result.stdout and "superlink.crt" not in result.stdout.split("kept")[0]
    assert (out / "keys" / "supernode-2.pub").is_file()


@needs_tools
def test_a_damaged_server_certificate_is_reissued(tmp_path):
    out = tmp_path / "certs"
    assert certs(out).returncode == 0
    (out / "superlink.crt").write_bytes(b"")
    result = certs(out)
    assert result.returncode == 0, result.stderr
    assert "re-issued" in result.stderr and verifies(out)


@needs_tools
def test_a_new_san_reissues_the_certificate_or_says_why_it_cannot(tmp_path):
    out = tmp_path / "certs"
    assert certs(out, "--san", "old.example.org").returncode == 0
    old = (out / "superlink.crt").read_bytes()
    (out / "ca.key").rename(tmp_path / "ca.key")
    result = certs(out, "--san", "new.example.org")
    assert result.returncode == 1
    assert "ca.key not found" in result.stderr and "new.example.org" in result.stderr
    assert "differ" in result.stderr
    assert (out / "superlink.crt").read_bytes() == old
    # without --san the existing certificate is kept as it is
    assert certs(out).returncode == 0 and (out / "superlink.crt").read_bytes() == old
    (tmp_path / "ca.key").rename(out / "ca.key")
    result = certs(out, "--san", "new.example.org")
    assert result.returncode == 0, result.stderr
    assert "re-issued" in result.stderr
    assert "DNS:new.example.org" in sans(out / "superlink.crt")
    assert "old.example.org" not in sans(out / "superlink.crt")
    assert verifies(out)
    no_leftovers(out)


@needs_tools
def test_openssl_errors_are_shown_and_leave_no_files(tmp_path):
    out = tmp_path / "certs"
    result = certs(out, "--san", "999.1.1.1")
    assert result.returncode == 1
    assert "openssl req failed" in result.stderr and "bad ip address" in result.stderr.lower()
    assert not (out / "superlink.crt").exists() and not (out / "superlink.key").exists()
    no_leftovers(out)
    assert certs(out).returncode == 0 and verifies(out)  # the CA made before is used


def site_key(out: Path, name: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(CERTS), "site-key", "--out", str(out), "--name", name],
                          capture_output=True, text=True, timeout=60, check=False)


@needs_tools
def test_a_site_makes_its_own_key_pair_and_sends_only_the_public_key(tmp_path):
    """The operator's set has no site keys (--clients 0); a site's pair is made on its machine,
    the private key readable by its owner only, and the printed fingerprint is the one the server
    will see for the registered public key. A second run keeps the registered pair."""
    assert certs(tmp_path / "certs", clients=0).returncode == 0
    assert not list((tmp_path / "certs" / "keys").iterdir())
    made = site_key(tmp_path / "site", "supernode-3")
    assert made.returncode == 0, made.stderr
    private, public = tmp_path / "site" / "supernode-3", tmp_path / "site" / "supernode-3.pub"
    assert private.stat().st_mode & 0o077 == 0 and sorted(p.name for p in (tmp_path / "site").iterdir()) == [
        "supernode-3", "supernode-3.pub"]
    assert f"send to the operator: {public}" in made.stdout
    printed = subprocess.run(["ssh-keygen", "-lf", str(public)], capture_output=True, text=True, check=True)
    assert f"fingerprint (tell it to the operator over another channel): {printed.stdout.split()[1]}" in made.stdout
    pem = load_ssh_public_key(public.read_bytes()).public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo)
    assert fingerprint(pem) == printed.stdout.split()[1]  # what the server sees once it is registered
    before = listing(tmp_path / "site")
    again = site_key(tmp_path / "site", "supernode-3")
    assert again.returncode == 0 and "kept the key pair" in again.stdout
    assert listing(tmp_path / "site") == before
    private.unlink()  # a lone public key is not silently paired with a new private key
    orphan = site_key(tmp_path / "site", "supernode-3")
    assert orphan.returncode == 1 and "exists without its private key" in orphan.stderr
    assert site_key(tmp_path / "site", "../x").returncode == 1


def connect(home: Path, name: str, address: str, ca: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(CERTS), "connect", name, "--address", address, "--ca", str(ca)],
                          env={**os.environ, "FLWR_HOME": str(home), "PYTHON": sys.executable},
                          capture_output=True, text=True, timeout=60, check=False)


def test_the_federation_connection_is_written_the_same_however_often_it_runs(tmp_path):
    """`certs.sh connect` run twice leaves the file as once; another entry and the user's comments
    stay; Flower itself reads the result; a broken file is refused and left as it was."""
    ca = tmp_path / "ca.crt"
    ca.write_text("a CA certificate")
    home = tmp_path / "flwr"
    home.mkdir()
    config = home / "config.toml"
    config.write_text('# my own\n[superlink]\ndefault = "other"\n\n[superlink.other]\naddress = "10.1.1.1:9093"\n'
                      'insecure = true\n')
    first = connect(home, "fedpac-remote", "127.0.0.1:9093", ca)
    assert first.returncode == 0 and "(added)" in first.stdout, first.stderr
    once = config.read_text()
    second = connect(home, "fedpac-remote", "127.0.0.1:9093", ca)
    assert second.returncode == 0 and "already points to 127.0.0.1:9093" in second.stdout
    assert config.read_text() == once
    assert connect(home, "fedpac-remote", "127.0.0.1:9094", ca).returncode == 0
    parsed = tomllib.loads(config.read_text())["superlink"]
    assert parsed == {"default": "other", "other": {"address": "10.1.1.1:9093", "insecure": True},
                      "fedpac-remote": {"address": "127.0.0.1:9094", "root-certificates": str(ca)}}
    assert config.read_text().startswith("# my own\n")
    listed = subprocess.run([str(Path(sys.executable).parent / "flwr"), "config", "list"], capture_output=True,
                            text=True, env={**os.environ, "FLWR_HOME": str(home)}, timeout=60, check=False)
    assert "fedpac-remote" in listed.stdout and "other (default)" in listed.stdout, listed.stdout + listed.stderr
    config.write_text("broken = [\n")
    refused = connect(home, "fedpac-remote", "127.0.0.1:9093", ca)
    assert refused.returncode == 1 and "not valid TOML" in refused.stderr and config.read_text() == "broken = [\n"
    config.unlink()
    bad = connect(home, "fedpac-remote", "no-port", ca)
    assert bad.returncode == 1 and "expected HOST:PORT" in bad.stderr and not config.exists()


@needs_tools
def test_a_ca_key_without_its_certificate_is_not_replaced(tmp_path):
    out = tmp_path / "certs"
    assert certs(out).returncode == 0
    key = (out / "ca.key").read_bytes()
    (out / "ca.crt").unlink()
    result = certs(out)
    assert result.returncode == 1 and "ca.crt" in result.stderr
    assert (out / "ca.key").read_bytes() == key


# ---------------------------------------------------------------------------- full disk


def _enospc(*_args, **_kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_atomic_write_on_a_full_disk_names_the_file_and_leaves_no_temp(tmp_path, monkeypatch):
    path = tmp_path / "rounds.csv"
    path.write_bytes(b"old")
    monkeypatch.setattr(common.files.os, "fsync", _enospc)
    with pytest.raises(OSError) as caught:
        atomic_write(path, b"x" * 12345)
    assert caught.value.errno == errno.ENOSPC
    assert str(path) in str(caught.value) and "12,345 bytes" in str(caught.value)
    assert path.read_bytes() == b"old"
    assert sorted(f.name for f in tmp_path.iterdir()) == ["rounds.csv"]


def test_atomic_write_removes_its_temp_file_on_any_failure(tmp_path, monkeypatch):
    def interrupted(_fd):
        raise KeyboardInterrupt

    monkeypatch.setattr(common.files.os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        atomic_write(tmp_path / "a.json", b"{}")
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    (tmp_path / "a.json").mkdir()  # the rename fails
    with pytest.raises(OSError) as caught:
        atomic_write(tmp_path / "a.json", b"{}")
    assert str(tmp_path / "a.json") in str(caught.value) and caught.value.errno is not None
    assert [f.name for f in tmp_path.iterdir()] == ["a.json"]


def _record(round_number: int) -> RoundRecord:
    return RoundRecord(round=round_number, started=0.0, seconds=1.0, accuracy={0: 0.5, 1: 0.75},
                       method={"alpha_partitions": [0, 1], "alpha": [[0.5, 0.5], [0.5, 0.5]],
                               "solver_status": ["ok", "ok"]})


def _checkpoint(rounds: list[RoundRecord]) -> Checkpoint:
    state = ServerState(
        shared={EXTRACTOR: {"w": np.zeros(3, np.float32)},
                CENTROIDS: {p.CENTROID_VALUES: np.zeros((10, 4), np.float32), p.CENTROID_MASK: np.zeros(10, bool)}},
        personal={HEAD: {0: {"b": np.zeros(10, np.float32)}}},
    )
    return Checkpoint(completed_rounds=rounds[-1].round, state=state, rounds=rounds, model_shape=(10, 28, 1), seed=0)


def _report(directory: Path, strategy: str = "fedpac") -> RunReport:
    return RunReport(directory, 3, lambda pid: pid % 2, {"strategy": strategy})


def _end_round(report: RunReport, number: int) -> None:
    record = _record(number)
    write_round_outputs(report, record, _checkpoint([*report.rounds, record]))


def _csv_rounds(directory: Path) -> list[str]:
    return [line.split(",")[0] for line in (directory / "rounds.csv").read_text().splitlines()[1:]]


def test_round_outputs_checkpoint_first_then_tables_then_charts(tmp_path, monkeypatch):
    written: list[str] = []

    def recording(path, data):
        written.append(Path(path).name)
        atomic_write(path, data)

    monkeypatch.setattr(server_app.checkpoint, "atomic_write", recording)
    monkeypatch.setattr(server_app.report, "atomic_write", recording)
    report = _report(tmp_path)
    written.clear()  # config.json
    _end_round(report, 1)
    report.close()
    assert written[:4] == ["checkpoint.npz", "metrics.json", "rounds.csv", "clients.csv"]
    assert set(written[4:]) == {"accuracy.png", "alpha.png"}


def test_confidences_are_charted_only_for_methods_that_report_them(tmp_path):
    report = _report(tmp_path, "pfedvem")
    for number in (1, 2):
        record = _record(number)
        record.train = {pid: {"train-loss": 0.5, "num-examples": 6.0, "rho": 0.1 * (pid + number)} for pid in (0, 1)}
        write_round_outputs(report, record, _checkpoint([*report.rounds, record]))
    report.close()
    assert (tmp_path / "confidence.png").read_bytes().startswith(b"\x89PNG")
    other = tmp_path / "fedpac"
    other.mkdir()
    other_report = _report(other)
    _end_round(other_report, 1)
    other_report.close()
    assert (other / "accuracy.png").exists() and not (other / "confidence.png").exists()


def _varied_record(number: int) -> RoundRecord:
    """A round with every kind of table content: a NaN metric, clusters, a sample, a rejection."""
    record = _record(number)
    record.train = {0: {"train-loss": float("nan"), "num-examples": 6.0, "v": 0.5},
                    1: {"train-loss": 0.25 * number, "num-examples": 8.0, "rho": 0.5}}
    record.generalized = {0: 0.5, 1: 0.25}
    record.method.update(cluster_partitions=[0, 1], clusters=[[0, 0], [0, 1]], sampled=[0, 1], aggregated=[1])
    record.rejected = number % 2
    return record


@pytest.mark.parametrize("strategy", ["fedccfa", "pfedvem", "fedpac"])
def test_tables_serialize_each_round_once_and_equal_the_whole_history_written_at_once(tmp_path, monkeypatch,
                                                                                     strategy):
    report = _report(tmp_path, strategy)
    serialized: list[int] = []
    real = RunReport.tables_of
    monkeypatch.setattr(RunReport, "tables_of", lambda self, r: serialized.append(r.round) or real(self, r))
    for number in (1, 2, 3):
        record = _varied_record(number)
        write_round_outputs(report, record, _checkpoint([*report.rounds, record]))
    report.close()
    assert serialized == [1, 2, 3]  # not 1, 1, 2, 1, 2, 3

    def whole(columns, rows):
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
        return buffer.getvalue()

    def raw(name):  # as written, \r\n line ends and all
        return (tmp_path / name).read_bytes().decode()

    rounds = report.rounds
    assert raw("clients.csv") == whole(
        server_app.report.client_columns(), [row for r in rounds for row in report.client_rows(r)])
    assert raw("rounds.csv") == whole(
        server_app.report.round_columns(), [report.round_row(r) for r in rounds])
    tables = ["rounds.csv", "clients.csv"]
    for table in report.outputs.tables:  # FedCCFA's clusters.csv
        assert raw(table.file) == whole(table.columns, [row for r in rounds for row in table.rows(r)])
        tables.append(table.file)
    assert (tmp_path / "clusters.csv").exists() == (strategy == "fedccfa")
    document = json.loads((tmp_path / "metrics.json").read_text())
    assert document["config"] == {"strategy": strategy}
    assert document["rounds"] == json.loads(json.dumps(
        [server_app.report.finite_json(report.metrics_entry(r)) for r in rounds]))
    assert document["rounds"][0]["train"]["0"]["train-loss"] is None

    # A resume replaces the records (read back from the checkpoint): they are serialized anew.
    before = {name: raw(name) for name in tables}
    report.rounds = list(load_checkpoint(tmp_path).rounds)
    serialized.clear()
    report.write()
    report.close()
    assert serialized == [1, 2, 3]
    assert {name: raw(name) for name in before} == before


def test_charts_are_drawn_off_the_round_and_end_showing_the_last_round(tmp_path, monkeypatch):
    drawn: list[tuple[str, int]] = []
    rounds_over = threading.Event()
    waited: list[bool] = []

    def slow_plot(self, records, path):
        drawn.append((threading.current_thread().name, len(records)))
        # the first chart is still being drawn when the rounds are over (the newest history then
        # wins); a round that waited for it would hold the rounds up, and this wait would time out
        waited.append(not rounds_over.wait(timeout=10))
        path.write_bytes(b"chart")

    monkeypatch.setattr(RunReport, "plot_accuracy", slow_plot)
    threads_before = set(threading.enumerate())
    report = _report(tmp_path)
    for number in (1, 2, 3, 4):
        _end_round(report, number)
    rounds_over.set()
    report.close()
    assert not any(waited)  # no round waited for a chart
    assert drawn[-1][1] == 4 and len(drawn) < 4  # an outdated history was skipped
    assert all(thread == "chart-painter" for thread, _ in drawn)
    assert (tmp_path / "accuracy.png").read_bytes() == b"chart"
    assert set(threading.enumerate()) <= threads_before  # the painter's thread ended with the run


def test_charts_are_drawn_at_most_once_an_interval_and_the_last_one_at_close():
    starts: list[tuple[float, int]] = []
    painter = ChartPainter(lambda rounds: starts.append((time.monotonic(), len(rounds))), interval=0.4)
    history: list = []
    began = time.monotonic()
    while time.monotonic() - began < 1.0:  # a round every 20 ms, as fast as rounds on a GPU and more
        history.append(len(history))
        painter.submit(list(history))
        time.sleep(0.02)
    closing = time.monotonic()
    painter.close()
    assert time.monotonic() - closing < 0.3  # close draws at once, without waiting for its turn
    assert starts[-1][1] == len(history)  # the last drawing shows every round
    assert 2 <= len(starts) <= 5  # 1 s of rounds: the first at once, then every 0.4 s, then close
    gaps = [later - earlier for (earlier, _), (later, _) in zip(starts, starts[1:-1])]
    assert all(gap >= 0.4 for gap in gaps)  # never two drawings within the interval (close aside)


def test_metrics_json_stays_standard_json_when_a_client_reports_nan(tmp_path):
    report = _report(tmp_path)
    record = _record(1)
    record.train = {0: {"head-loss": float("nan"), "train-loss": 0.5, "num-examples": 6.0},
                    1: {"head-loss": float("inf"), "train-loss": 0.25, "num-examples": 6.0}}
    write_round_outputs(report, record, _checkpoint([record]))

    def refuse(constant):
        raise ValueError(f"non-standard JSON constant {constant}")

    document = json.loads((tmp_path / "metrics.json").read_text(), parse_constant=refuse)
    train = document["rounds"][0]["train"]
    assert train["0"]["head-loss"] is None and train["1"]["head-loss"] is None and train["0"]["train-loss"] == 0.5


@pytest.mark.parametrize("failure", ["disk full", "plot error"])
def test_a_chart_that_fails_is_a_warning_and_the_run_goes_on(tmp_path, monkeypatch, caplog, failure):
    if failure == "disk full":
        real = server_app.report.atomic_write

        def no_space_for_png(path, data):
            # what atomic_write raises on a full disk (its own clean-up is tested above); not a
            # failing os.fsync, which the charts' background thread would share with the
            # checkpoint written at the same time
            if Path(path).suffix == ".png":
                _enospc()
            real(path, data)

        monkeypatch.setattr(server_app.report, "atomic_write", no_space_for_png)
    else:
        def broken(*_args, **_kwargs):
            raise ValueError("cannot render")

        monkeypatch.setattr(RunReport, "plot_accuracy", broken)
        monkeypatch.setattr(common.figures, "new_figure", broken)  # the methods' charts
    report = _report(tmp_path)
    with caplog.at_level(logging.WARNING):
        _end_round(report, 1)
        _end_round(report, 2)
        report.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("accuracy.png" in w and "the run goes on" in w for w in warnings)
    assert load_checkpoint(tmp_path).completed_rounds == 2
    assert _csv_rounds(tmp_path) == ["1", "2"]
    assert not [f for f in tmp_path.iterdir() if f.name.endswith(".tmp")]


def test_a_full_disk_for_the_tables_stops_the_run_with_the_checkpoint_up_to_date(tmp_path, monkeypatch):
    report = _report(tmp_path)
    _end_round(report, 1)
    real = server_app.report.atomic_write

    def full(path, data):
        with monkeypatch.context() as inner:
            if Path(path).name == "rounds.csv":
                inner.setattr(common.files.os, "fsync", _enospc)
            real(path, data)

    monkeypatch.setattr(server_app.report, "atomic_write", full)
    with pytest.raises(OSError) as caught:
        _end_round(report, 2)
    assert caught.value.errno == errno.ENOSPC and str(tmp_path / "rounds.csv") in str(caught.value)
    assert load_checkpoint(tmp_path).completed_rounds == 2  # written before the tables
    assert _csv_rounds(tmp_path) == ["1"]
    report.close()  # the charts are drawn in the background: a chart being written has its .tmp
    assert not [f for f in tmp_path.iterdir() if f.name.endswith(".tmp")]


def test_a_full_disk_for_the_checkpoint_writes_nothing_of_the_round(tmp_path, monkeypatch):
    report = _report(tmp_path)
    _end_round(report, 1)
    monkeypatch.setattr(common.files.os, "fsync", _enospc)
    with pytest.raises(OSError) as caught:
        _end_round(report, 2)
    assert str(tmp_path / "checkpoint.npz") in str(caught.value)
    monkeypatch.undo()
    assert load_checkpoint(tmp_path).completed_rounds == 1
    assert _csv_rounds(tmp_path) == ["1"]


# ---------------------------------------------------------------------------- client data


def _split(n: int = 6, shape: tuple[int, ...] = (28, 28)) -> tuple[np.ndarray, np.ndarray]:
    return np.zeros((n, *shape), np.uint8), np.arange(n) % 10


def _npz(directory: Path, train: dict | None = None, test: dict | None = None) -> None:
    x, y = _split()
    np.savez(directory / "train.npz", **(train if train is not None else {"x": x, "y": y}))
    np.savez(directory / "test.npz", **(test if test is not None else {"x": x, "y": y}))


def _valid_npz_bytes() -> bytes:
    buffer = io.BytesIO()
    x, y = _split(50)
    np.savez_compressed(buffer, x=x, y=y)
    return buffer.getvalue()


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda d: (d / "train.npz").write_bytes(b""), "train.npz: the file is empty"),
        (lambda d: (d / "train.npz").write_bytes(b"not numpy at all"), "train.npz: not an .npz archive"),
        (lambda d: (d / "train.npz").write_bytes(_valid_npz_bytes()[:300]), "train.npz: a corrupt or truncated"),
        (lambda d: np.save(d / "x.npy", _split()[0]) or (d / "x.npy").rename(d / "train.npz"),
         "train.npz: a single array"),
        (lambda d: np.savez(d / "train.npz", x=_split()[0], y=_split()[1]), "test.npz does not exist"),
        (lambda d: _npz(d, train={"x": _split()[0].astype(np.float32), "y": _split()[1]}),
         "train.npz: images must be uint8"),
        (lambda d: _npz(d, train={"x": _split()[0], "y": _split()[1].astype(np.float64)}),
         "train.npz: labels must be integers"),
        (lambda d: _npz(d, train={"x": _split()[0], "y": _split()[1][:, None]}),
         r"train.npz: labels must be a 1-D array"),
        (lambda d: _npz(d, train={"x": np.zeros((6, 784), np.uint8), "y": _split()[1]}),
         r"train.npz: images must be an array of shape \(N, H, W\)"),
        (lambda d: _npz(d, test={"x": _split()[0], "y": _split()[1][:4]}), "test.npz: 6 images but 4 labels"),
        (lambda d: _npz(d, test={"x": _split(0)[0], "y": _split(0)[1]}), "test.npz: no images"),
        (lambda d: _npz(d, train={"x": _split()[0], "y": -_split()[1]}), r"train.npz: labels outside \[0, 10\)"),
        (lambda d: _npz(d, test={"x": _split()[0], "y": _split()[1] + 5}),
         r"test.npz: labels outside \[0, 10\), num-classes 10: found labels 5..10"),
    ],
    ids=["empty", "not-npz", "truncated", "npy", "no-test", "float-images", "float-labels", "2d-labels",
         "flat-images", "length", "no-images", "negative-label", "label-too-large"],
)
def test_client_npz_files_that_are_wrong_are_named(tmp_path, make, message):
    make(tmp_path)
    with pytest.raises(DataError, match=message) as caught:
        load_client_directory(tmp_path, num_classes=10)
    assert str(tmp_path) in str(caught.value)


def _png(path: Path, array: np.ndarray | None = None, mode: str | None = None) -> None:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    image = Image.fromarray(np.zeros((28, 28), np.uint8) if array is None else array)
    (image.convert(mode) if mode else image).save(path)


def _image_folders(directory: Path) -> None:
    for split in ("train", "test"):
        for label in (0, 1):
            _png(directory / split / str(label) / "a.png")


def _truncate(path: Path) -> None:
    _png(path, np.random.default_rng(0).integers(0, 256, (28, 28), dtype=np.uint8))
    path.write_bytes(path.read_bytes()[:400])


@pytest.mark.parametrize(
    "make, culprit, message",
    [
        (lambda d: (d / "train/1/a.png").write_bytes(b"garbage"), "train/1/a.png", "not a readable image"),
        (lambda d: _truncate(d / "train/1/a.png"), "train/1/a.png", "not a readable image"),
        (lambda d: _png(d / "train/1/a.png", np.zeros((28, 28), np.uint16) + 1000, "I;16"), "train/1/a.png",
         "I;16 image; save it as 8-bit"),
        (lambda d: _png(d / "test/0/a.png", np.zeros((28, 28), np.uint8), "P"), "test/0/a.png", "P image"),
        (lambda d: _png(d / "train/1/b.png", np.zeros((32, 32), np.uint8)), "train/1/b.png",
         "must have the same size"),
        (lambda d: _png(d / "train/12/a.png"), "train/12", r"class 12 is outside \[0, 10\), num-classes 10"),
        (lambda d: shutil.rmtree(d / "test"), "test", "does not exist"),
        (lambda d: shutil.rmtree(d / "test/0") or shutil.rmtree(d / "test/1"), "test", "no .png"),
    ],
    ids=["garbage", "truncated", "16-bit", "palette", "sizes", "class-range", "no-test", "empty-test"],
)
def test_client_image_folders_that_are_wrong_are_named(tmp_path, make, culprit, message):
    _image_folders(tmp_path)
    make(tmp_path)
    with pytest.raises(DataError, match=message) as caught:
        load_client_directory(tmp_path, num_classes=10)
    assert str(tmp_path / culprit) in str(caught.value)


def _idx(path: Path, array: np.ndarray) -> None:
    raw = bytes([0, 0, 8, array.ndim]) + b"".join(struct.pack(">I", s) for s in array.shape) + array.tobytes()
    path.write_bytes(gzip.compress(raw) if path.suffix == ".gz" else raw)


def _idx_folder(directory: Path, train_labels: np.ndarray | None = None) -> None:
    x, y = _split(8)
    _idx(directory / "train-images-idx3-ubyte", x)
    _idx(directory / "train-labels-idx1-ubyte", y.astype(np.uint8) if train_labels is None else train_labels)
    _idx(directory / "t10k-images-idx3-ubyte", x)
    _idx(directory / "t10k-labels-idx1-ubyte", y.astype(np.uint8))


@pytest.mark.parametrize(
    "make, culprit, message",
    [
        (lambda d: (d / "train-labels-idx1-ubyte").write_bytes(b""), "train-labels-idx1-ubyte", "the file is empty"),
        (lambda d: (d / "t10k-images-idx3-ubyte").write_bytes(bytes([0, 0, 8, 3, 0, 0])),
         "t10k-images-idx3-ubyte", "truncated IDX header"),
        (lambda d: (d / "t10k-images-idx3-ubyte").write_bytes(bytes([0, 0, 0x0D, 3]) + bytes(12)),
         "t10k-images-idx3-ubyte", r"not an unsigned-byte IDX file \(type code 0x0d\)"),
        (lambda d: _idx(d / "train-images-idx3-ubyte", np.zeros((8, 784), np.uint8)),
         "train-images-idx3-ubyte", "must have 3 dimensions"),
        (lambda d: _idx(d / "train-labels-idx1-ubyte", np.zeros(5, np.uint8)),
         "train-images-idx3-ubyte", "8 images but 5 labels"),
        (lambda d: _idx(d / "train-labels-idx1-ubyte", np.full(8, 10, np.uint8)),
         "train-labels-idx1-ubyte", r"labels outside \[0, 10\), num-classes 10"),
        (lambda d: (d / "t10k-labels-idx1-ubyte").rename(d / "t10k-labels-idx1-ubyte.gz"),
         "t10k-labels-idx1-ubyte.gz", "cannot read it"),
    ],
    ids=["empty", "short-header", "float-idx", "flat-images", "count", "label-range", "not-gzip"],
)
def test_client_idx_files_that_are_wrong_are_named(tmp_path, make, culprit, message):
    _idx_folder(tmp_path)
    make(tmp_path)
    with pytest.raises(DataError, match=message) as caught:
        load_client_directory(tmp_path, num_classes=10)
    assert str(tmp_path / culprit) in str(caught.value)


def test_read_idx_names_an_unreadable_file(tmp_path):
    with pytest.raises(DataError, match="cannot read it") as caught:
        read_idx(tmp_path)  # a directory
    assert str(tmp_path) in str(caught.value)
    (tmp_path / "a.gz").write_bytes(gzip.compress(b"\x00\x00\x08\x01\x00\x00\x00\x05abcde")[:-6])
    with pytest.raises(DataError, match="a.gz: cannot read it"):
        read_idx(tmp_path / "a.gz")


def test_good_client_data_still_loads(tmp_path):
    for kind, make in (("npz", _npz), ("png", _image_folders), ("idx", _idx_folder)):
        (tmp_path / kind).mkdir()
        make(tmp_path / kind)
        data = load_client_directory(tmp_path / kind, num_classes=10)
        assert data.train_images.shape[1:] == (28, 28, 1) and len(data.test_labels) > 0
    assert load_idx_dataset("mnist", tmp_path / "idx").num_classes == 8  # largest training label + 1


# ---------------------------------------------------------------------------- bounded influence


def test_capped_sample_weights_bound_one_client_by_the_median_of_the_others():
    # 120,000 against the others' median 95
    np.testing.assert_array_equal(capped_sample_weights(np.array([120_000, 100, 90]), 10.0), [950, 100, 90])
    np.testing.assert_array_equal(capped_sample_weights(np.array([120_000, 100, 90]), 0.0), [120_000, 100, 90])
    np.testing.assert_array_equal(capped_sample_weights(np.array([300, 100, 200]), 10.0), [300, 100, 200])
    np.testing.assert_array_equal(capped_sample_weights(np.array([500]), 10.0), [500])


@pytest.mark.parametrize("honest", [[100], [100, 90, 110], [60, 600, 3000, 50]])
def test_no_claim_buys_more_than_the_ratio_of_the_others_median(honest):
    """The cap is the others' median, so a liar's claim cannot raise its own cap: with the
    median over all claims, one of two clients could claim any n and own the average."""
    others = np.median(honest)
    for claim in [10**3, 10**6, 10**12]:
        weights = capped_sample_weights(np.array([claim, *honest], dtype=np.float64), 10.0)
        assert weights[0] == min(claim, 10.0 * others)
        # honest clients within the ratio of each other keep their counts
        if max(honest) <= 10 * min(honest):
            np.testing.assert_array_equal(weights[1:], honest)


def _inflate(pid_to_inflate: int, claimed: int):
    """A tamper hook: that partition's training reply claims ``claimed`` samples (FedAvg: the
    count travels only as a metric) and the recorded replies are kept."""
    seen = {}

    def tamper(reply, pid):
        if reply.metadata.message_type == MessageType.TRAIN and reply.has_content():
            if pid == pid_to_inflate:
                reply.content[p.METRICS][p.NUM_EXAMPLES] = claimed
            seen[pid] = reply.content
        return reply

    return tamper, seen


def test_a_client_claiming_far_more_samples_is_weighted_at_most_ten_times_the_median(tmp_path, caplog):

    config = {"strategy": "fedavg", "num-server-rounds": 1, "samples-per-client": 60,
              "test-samples-per-client": 20, "local-epochs": 1, "output-dir": str(tmp_path)}
    tamper, seen = _inflate(0, 120_000)
    with caplog.at_level(logging.WARNING):
        strategy, _ = run_fedpac(InProcessGrid(config, 3, tamper=tamper), parse_run_config(config), 1)
    assert any("partition 0 reports 120000 training samples" in r.getMessage() for r in caplog.records)
    extractors = [{k: v for k, v in p.sections_of(seen[pid])[p.MODEL].items() if k.startswith("extractor.")}
                  for pid in range(3)]
    expected = weighted_average(extractors, [600, 60, 60])  # 10 x the median 60, not 120,000
    for key, value in expected.items():
        np.testing.assert_allclose(strategy.extractor[key], value, rtol=1e-6)


def test_max_samples_per_client_rejects_the_reply_and_stops_a_preflight(tmp_path, caplog):

    config = {"strategy": "fedavg", "num-server-rounds": 1, "samples-per-client": 60,
              "test-samples-per-client": 20, "local-epochs": 1, "max-samples-per-client": 1000,
              "output-dir": str(tmp_path)}
    tamper, _ = _inflate(1, 120_000)
    with caplog.at_level(logging.WARNING):
        _, report = run_fedpac(InProcessGrid(config, 3, tamper=tamper), parse_run_config(config), 1)
    assert sorted(report.rounds[0].train) == [0, 2]
    assert any("above max-samples-per-client = 1000" in r.getMessage() for r in caplog.records)
    small = {**config, "max-samples-per-client": 50, "output-dir": str(tmp_path / "small")}
    with pytest.raises(RuntimeError, match="above max-samples-per-client = 50"):
        run_fedpac(InProcessGrid(small, 3), parse_run_config(small), 2)
