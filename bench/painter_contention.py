"""What the chart painter costs the ServerApp's transport: request round trips while it draws.

A deployed ServerApp talks to the SuperLink in blocking requests, one per object (about 140 a
round with 20 clients). After each, its thread needs the interpreter lock back; while the chart
painter (``server_app.report.ChartPainter``) draws in the same process, it holds that lock for up
to the switch interval (``sys.getswitchinterval()``, 5 ms) at a time, and the request code's own
Python work shares the lock with it. This bench times requests from the main thread to a server
in another process (``--work-ms`` of Python work, as a client builds and parses a request, then a
64 kB body each way, as an object push), alternately with the painter idle and with it drawing a
long run's charts without pause (``bench/report_writes.history``: 200 rounds, 20 clients: what a
chart per round did to a GPU deployment, whose rounds are shorter than a drawing), and reports
the medians, the means and their ratios.

    python bench/painter_contention.py [--requests 300] [--repeats 4] [--work-ms 1]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import socket
import statistics
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from report_writes import history  # noqa: E402

from server_app.report import RunReport  # noqa: E402

BODY = 64 * 1024


def _receive(conn: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = conn.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError("closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def echo_server(listener: socket.socket) -> None:
    """Answer every length-prefixed body with a body of the same length."""
    conn, _ = listener.accept()
    with conn:
        while True:
            try:
                (size,) = struct.unpack("!I", _receive(conn, 4))
            except ConnectionError:
                return
            body = _receive(conn, size)
            conn.sendall(struct.pack("!I", len(body)) + body)


def python_work(seconds: float) -> None:
    """Interpreted work for about ``seconds`` (holding the interpreter lock, as request code does)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        sum(range(200))


def round_trip(conn: socket.socket, body: bytes) -> None:
    conn.sendall(struct.pack("!I", len(body)) + body)
    (size,) = struct.unpack("!I", _receive(conn, 4))
    _receive(conn, size)


class Drawing:
    """A thread drawing a run's charts again and again until stopped, as a busy painter does."""

    def __init__(self, report: RunReport) -> None:
        self.report = report
        self.stop = threading.Event()
        self.drawings = 0
        self.thread = threading.Thread(target=self._loop, name="chart-painter")

    def _loop(self) -> None:
        while not self.stop.is_set():
            self.report.paint(self.report.rounds)
            self.drawings += 1

    def __enter__(self) -> Drawing:
        self.thread.start()
        time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cli.add_argument("--requests", type=int, default=300)
    cli.add_argument("--repeats", type=int, default=4)
    cli.add_argument("--rounds", type=int, default=200)
    cli.add_argument("--clients", type=int, default=20)
    cli.add_argument("--work-ms", type=float, default=1.0, help="Python work per request, in ms")
    cli.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "painter_contention.json")
    args = cli.parse_args()

    listener = socket.create_server(("127.0.0.1", 0))
    server = multiprocessing.get_context("fork").Process(target=echo_server, args=(listener,), daemon=True)
    server.start()
    conn = socket.create_connection(listener.getsockname())
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    body = bytes(BODY)
    times: dict[str, list[float]] = {"painter idle": [], "painter drawing": []}
    drawings = 0
    with tempfile.TemporaryDirectory() as directory:
        report = RunReport(Path(directory), args.rounds, lambda pid: pid % 5, {"strategy": "fedpac"})
        report.rounds = history(args.rounds, args.clients)
        for repeat in range(args.repeats + 1):  # repeat 0 warms up (imports, fonts, sockets)
            for condition, samples in times.items():
                painter = Drawing(report) if condition == "painter drawing" else None
                with painter or contextlib.nullcontext():
                    took = []
                    for _ in range(args.requests):
                        started = time.perf_counter()
                        python_work(args.work_ms / 1000)
                        round_trip(conn, body)
                        took.append(time.perf_counter() - started)
                drawings += painter.drawings if painter else 0
                if repeat:
                    samples.extend(took)
    conn.close()
    server.join(timeout=5)
    idle, busy = times["painter idle"], times["painter drawing"]
    result = {
        "requests_per_condition": len(idle), "body_bytes": BODY,
        "python_work_ms": args.work_ms, "switch_interval_s": sys.getswitchinterval(),
        "history": {"rounds": args.rounds, "clients": args.clients}, "drawings": drawings,
        "median_ms": {k: 1000 * statistics.median(v) for k, v in times.items()},
        "mean_ms": {k: 1000 * statistics.fmean(v) for k, v in times.items()},
        "median_ratio": statistics.median(busy) / statistics.median(idle),
        "mean_ratio": statistics.fmean(busy) / statistics.fmean(idle),
    }
    print(json.dumps(result, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
