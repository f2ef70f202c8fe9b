"""The one Flower release the runtime patches of deploy/ were written for, and the guard they call.

``fast_supernode.py``, ``patient_superlink.py``, ``warm_executor.py`` and ``long_poll.py`` replace
or wrap private parts of Flower (the SuperNode's loop and state, the SuperLink's SQLite pragmas and
handlers, the ClientApp task protocol, the object stores). Such code fits the release it was read
from and may misbehave silently on another, so each of them calls :func:`require_flower` before it
imports Flower's internals, and refuses to load on any other release.

The release is the exact pin of ``pyproject.toml`` (``flwr==FLOWER_VERSION``, checked by
tests/test_dependencies.py). This module lives in deploy/, next to the patches, because the
container images carry those files alone (``/opt/fedpac``), without the project's packages.
"""

from __future__ import annotations

import importlib.metadata

FLOWER_VERSION = "1.39.0"


class FlowerVersionError(RuntimeError):
    """A runtime patch was loaded with a Flower release it was not written for."""


def installed_flower() -> str | None:
    """The installed ``flwr`` distribution's version, None when there is none."""
    try:
        return importlib.metadata.version("flwr")
    except importlib.metadata.PackageNotFoundError:
        return None


def require_flower(patch: str) -> None:
    """Return if the installed Flower is ``FLOWER_VERSION``, else raise :class:`FlowerVersionError`
    naming ``patch`` (the module that patches Flower), both versions and the ways out."""
    installed = installed_flower()
    if installed == FLOWER_VERSION:
        return
    found = "no flwr is installed" if installed is None else f"flwr {installed} is installed"
    raise FlowerVersionError(
        f"{patch} patches private internals of Flower {FLOWER_VERSION} and was written for exactly "
        f"flwr=={FLOWER_VERSION}, but {found}. Install flwr=={FLOWER_VERSION} (pip install -r "
        "requirements.lock, or make install), or run Flower's own flower-superlink / flower-supernode "
        "/ flower-superexec instead of this launcher. Moving to another Flower release means porting "
        f"the patch, then changing the pin in pyproject.toml and FLOWER_VERSION in deploy/flower_pin.py."
    )
