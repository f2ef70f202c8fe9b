"""Print the app's pip requirements from pyproject.toml, for the images and the offline wheelhouse.

    python requirements.py PYPROJECT [--flwr-only] [--cpu] [--torch-version VERSION]

The app image runs the SuperNodes' ClientApps and the ServerApp: the project's base requirements
(a site's) and its ``server`` extra, never ``simulation`` (Ray): containers run in deployment mode.
``--flwr-only``: Flower alone (the SuperLink image). ``--cpu`` is accepted for the CPU image and
changes nothing any more: the app declares no torchvision (which PyTorch's CPU index lacks for
some torch versions). ``--torch-version`` pins torch (for example ``2.13.0+cpu``, a build a
wheelhouse holds).
"""

from __future__ import annotations

import argparse
import re
import tomllib

IMAGE_EXTRAS = ("server",)  # what the app image adds to the base requirements


def _name(requirement: str) -> str:
    return re.split(r"[\[<>=!~; ]", requirement, maxsplit=1)[0].lower()


def _extras(requirement: str) -> list[str]:
    found = re.match(r"[^\[<>=!~; ]+\[([^\]]*)\]", requirement)
    return [e.strip() for e in found.group(1).split(",")] if found else []


def declared(project: dict, extras: tuple[str, ...]) -> list[str]:
    """The base requirements and those of ``extras``, with the project's references to its own
    extras (``fedpac[server]``) replaced by what they list, each line once."""
    chosen: list[str] = list(project["dependencies"])
    pending, seen = list(extras), set()
    while pending:
        extra = pending.pop(0)
        if extra in seen:
            continue
        seen.add(extra)
        for requirement in project.get("optional-dependencies", {}).get(extra, []):
            if _name(requirement) == project["name"].lower():
                pending.extend(_extras(requirement))
            elif requirement not in chosen:
                chosen.append(requirement)
    return chosen


def requirements(pyproject: str, flwr_only: bool = False, cpu: bool = False, torch_version: str = "") -> list[str]:
    with open(pyproject, "rb") as stream:
        project = tomllib.load(stream)["project"]
    chosen = declared(project, IMAGE_EXTRAS)
    if flwr_only:
        return [d for d in chosen if _name(d) == "flwr"]
    if cpu:  # kept for build-images.sh's --cpu: torchvision is no longer declared
        chosen = [d for d in chosen if _name(d) != "torchvision"]
    if torch_version:
        chosen = [f"torch=={torch_version}" if _name(d) == "torch" else d for d in chosen]
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("pyproject")
    parser.add_argument("--flwr-only", action="store_true", help="Flower alone (the SuperLink image)")
    parser.add_argument("--cpu", action="store_true", help="the CPU image (no change: no torchvision)")
    parser.add_argument("--torch-version", default="", help="pin torch to this version")
    args = parser.parse_args()
    print("\n".join(requirements(args.pyproject, args.flwr_only, args.cpu, args.torch_version)))


if __name__ == "__main__":
    main()
