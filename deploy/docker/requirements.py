"""Print the app's pip requirements from pyproject.toml, for the images and the offline wheelhouse.

    python requirements.py PYPROJECT [--flwr-only]

Flower's ``simulation`` extra (Ray) is dropped: containers run in deployment mode.
"""

from __future__ import annotations

import re
import sys
import tomllib


def requirements(pyproject: str, flwr_only: bool = False) -> list[str]:
    with open(pyproject, "rb") as stream:
        dependencies = tomllib.load(stream)["project"]["dependencies"]
    without_simulation = [re.sub(r"^flwr\[simulation\]", "flwr", d) for d in dependencies]
    if flwr_only:
        return [d for d in without_simulation if re.match(r"^flwr\b(?!-)", d)]
    return without_simulation


if __name__ == "__main__":
    print("\n".join(requirements(sys.argv[1], "--flwr-only" in sys.argv[2:])))
