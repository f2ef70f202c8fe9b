"""Print the app's pip requirements from pyproject.toml, for the images and the offline wheelhouse.

    python requirements.py PYPROJECT [--flwr-only] [--cpu] [--torch-version VERSION]

Flower's ``simulation`` extra (Ray) is dropped: containers run in deployment mode. ``--cpu``
drops torchvision, which the app never imports (its image code uses Pillow): PyTorch's CPU
index has no torchvision for every torch, and the CPU image should carry torch alone.
``--torch-version`` pins torch (for example ``2.13.0+cpu``, a build a wheelhouse holds).
"""

from __future__ import annotations

import argparse
import re
import tomllib


def _name(requirement: str) -> str:
    return re.split(r"[\[<>=!~; ]", requirement, maxsplit=1)[0].lower()


def requirements(pyproject: str, flwr_only: bool = False, cpu: bool = False, torch_version: str = "") -> list[str]:
    with open(pyproject, "rb") as stream:
        dependencies = tomllib.load(stream)["project"]["dependencies"]
    chosen = [re.sub(r"^flwr\[simulation\]", "flwr", d) for d in dependencies]
    if flwr_only:
        return [d for d in chosen if _name(d) == "flwr"]
    if cpu:
        chosen = [d for d in chosen if _name(d) != "torchvision"]
    if torch_version:
        chosen = [f"torch=={torch_version}" if _name(d) == "torch" else d for d in chosen]
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("pyproject")
    parser.add_argument("--flwr-only", action="store_true", help="Flower alone (the SuperLink image)")
    parser.add_argument("--cpu", action="store_true", help="leave torchvision out (the CPU image)")
    parser.add_argument("--torch-version", default="", help="pin torch to this version")
    args = parser.parse_args()
    print("\n".join(requirements(args.pyproject, args.flwr_only, args.cpu, args.torch_version)))


if __name__ == "__main__":
    main()
