"""What a test needs from the machine beyond the project's Python packages.

`make test` runs on any Linux or macOS machine with Python: a test whose prerequisite is missing
(a Docker engine, root for network namespaces, the full Fashion-MNIST) is skipped, with the
reason and the way to provide it in pytest's summary. CI provisions everything first
(`make provision`), so there, with ``CI`` set, a missing prerequisite is a failure: a skip would
hide a test that stopped running.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_FILES = ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
                       "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")


def in_ci() -> bool:
    """Whether this is a CI run (``CI`` set to anything but empty, 0, false or no)."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def require(available: bool, needs: str, provide: str) -> None:
    """Skip the calling test when ``available`` is false (fail it in CI), saying what it
    ``needs`` and how to ``provide`` it."""
    if available:
        return
    message = f"needs {needs} ({provide})"
    if in_ci():
        pytest.fail(f"{message}: CI provisions it with `make provision`, so its absence is a failure",
                    pytrace=False)
    pytest.skip(message)


def require_tools(*names: str) -> None:
    """Commands the test runs."""
    missing = [name for name in names if shutil.which(name) is None]
    require(not missing, " and ".join(missing), "install them with the system's package manager")


def require_linux() -> None:
    """Linux's /proc (process states, listening sockets)."""
    require(sys.platform.startswith("linux") and Path("/proc/net/tcp").exists(), "Linux's /proc",
            "this test reads the kernel's process and socket tables")


def require_root_networking() -> None:
    """Network namespaces, a bridge and iptables: root on Linux."""
    require_linux()
    require(os.geteuid() == 0, "root (network namespaces)", "run `sudo make test`")
    require_tools("ip", "iptables")


def docker_engine_running() -> bool:
    return shutil.which("docker") is not None and subprocess.run(
        ["docker", "info"], capture_output=True, check=False).returncode == 0


def require_docker() -> None:
    """A Docker engine that runs (or root and dockerd, to start one), `docker compose`, and
    debootstrap for the local base image."""
    require_linux()
    startable = shutil.which("dockerd") is not None and os.geteuid() == 0
    require(shutil.which("docker") is not None and (docker_engine_running() or startable), "a Docker engine",
            "start Docker, or run `sudo make provision` on Debian/Ubuntu to install one")
    require(subprocess.run(["docker", "compose", "version"], capture_output=True, check=False).returncode == 0,
            "the docker compose plugin", "`sudo make provision` installs it")
    require_tools("debootstrap", "ip")


def require_fashion_mnist() -> None:
    """The full Fashion-MNIST (70,000 images) where Debian's dataset-fashion-mnist puts it."""
    require(all((FASHION_MNIST / name).is_file() for name in FASHION_MNIST_FILES),
            f"Fashion-MNIST in {FASHION_MNIST}", "`sudo make provision` installs it on Debian/Ubuntu")
