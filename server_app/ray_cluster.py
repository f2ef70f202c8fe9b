"""The simulation on a Ray cluster of several hosts: the run's code travels to every Ray worker.

Flower's simulation runs each ClientApp in a Ray actor, and the actor imports the app's packages
by name. On the head host they come from the app bundle (FAB) that ``flwr run`` submitted; a
worker host has neither that bundle nor this checkout. Ray's runtime environment carries them:
``deploy/simulate.sh`` puts ``RAY_RUNTIME_ENV_HOOK=server_app.ray_cluster.runtime_env_hook`` in
the environment of the local SuperLink, whose simulation process then calls
:func:`runtime_env_hook` from ``ray.init``. With ``RAY_ADDRESS`` naming a cluster, the hook adds
the packages the ClientApp imports, as the driver loaded them, to the job's ``py_modules``
(:func:`ship_app`). Ray uploads them once per run, keyed by their content, and puts them first on
every worker's ``PYTHONPATH``: a worker runs exactly the submitted code, never an older copy that
its host may have installed.

``ray.init`` is also the one point where this project's code runs in the engine's process before
the engine starts handing out messages: the hook installs the engine's faster hand-over there
(``server_app.simulation_engine``), on one host as on a cluster.

A worker host still needs the same third-party environment (``pip install -r
requirements.lock``: Ray refuses a node with another Python or Ray, and torch must match for
equal results) and, for a dataset other than the embedded one, its own copy of the data at the
run's ``data-dir``. The embedded demo dataset (``fedpac_data``, 0.7 MB) travels with the code.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Any

from server_app import simulation_engine

# What a ClientApp imports of this project; server_app and experiments never run on a worker.
SHIPPED_PACKAGES = ("client_app", "common", "fedpac_data")
# Byte-code caches are rebuilt on the worker; leaving them out keeps the upload's content hash
# (and so Ray's cache of it) the same across runs of the same code.
EXCLUDES = ["__pycache__", "*.pyc"]


def shipped_modules() -> list[ModuleType]:
    """The packages of :data:`SHIPPED_PACKAGES`, as this process imports them."""
    return [importlib.import_module(name) for name in SHIPPED_PACKAGES]


def ship_app(runtime_env: dict[str, Any] | None) -> dict[str, Any]:
    """``runtime_env`` with the ClientApp's packages added to ``py_modules``.

    Whatever else the caller set (Flower sets the driver's ``PYTHONPATH``) is kept.
    """
    shipped = dict(runtime_env or {})
    shipped["py_modules"] = [*shipped.get("py_modules", []), *shipped_modules()]
    shipped["excludes"] = [*shipped.get("excludes", []), *EXCLUDES]
    return shipped


def runtime_env_hook(runtime_env: dict[str, Any] | None) -> dict[str, Any] | None:
    """What ``RAY_RUNTIME_ENV_HOOK`` names: installs the engine's faster hand-over, and ships the
    app (:func:`ship_app`) when ``RAY_ADDRESS`` names a cluster rather than a Ray of this host's
    own (``local``, or unset)."""
    simulation_engine.install()
    if os.environ.get("RAY_ADDRESS", "local") in ("", "local"):
        return runtime_env
    return ship_app(runtime_env)
