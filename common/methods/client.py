"""What every method's client part is: one round of local training on the site's data, and
what the client does to a received model before evaluating it.

A method's package (``common/methods/<family>/``) holds its client part in ``client.py``, a
:class:`ClientRoutine` named ``Routine``; :func:`client_routine` finds it for any method, so the
ClientApp names no method. The client part is loaded only where it runs (a ClientApp, a test):
the server's math (the QP's solver) is no dependency of a site.
"""

from __future__ import annotations

import copy
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from common import protocol as p
from common.config import FedPACConfig
from common.methods.base import Method
from common.model import FedPACNet, part_of
from common.training import to_numpy


class SiteState:
    """What a method keeps at the site from one round to the next (Ditto's personal model), by
    name: read from the site's own disk as it stood after the previous round and written back
    after this one (``common.site_state``); it never travels."""

    def __init__(self, kept: Mapping[str, p.NDArrays] | None = None) -> None:
        self.kept: dict[str, p.NDArrays] = dict(kept or {})

    def get(self, name: str) -> p.NDArrays | None:
        """The arrays kept under ``name``, or None before the first :meth:`put`."""
        return self.kept.get(name)

    def put(self, name: str, arrays: p.NDArrays) -> None:
        self.kept[name] = arrays


def with_arrays(model: FedPACNet, arrays: Mapping[str, Any]) -> FedPACNet:
    """A copy of ``model`` holding ``arrays`` (numpy or torch, by state-dict key) on its device."""
    copied = copy.deepcopy(model)
    device = next(copied.parameters()).device
    copied.load_state_dict({key: torch.as_tensor(value, device=device) for key, value in arrays.items()})
    return copied


def kept_model(received: FedPACNet, state: SiteState, name: str) -> FedPACNet:
    """The whole model the site kept under ``name`` (Ditto's personal model, APFL's local one),
    or, before it first kept one, a copy of the model it received."""
    kept = state.get(name)
    return copy.deepcopy(received) if kept is None else with_arrays(received, kept)


def keep_model(state: SiteState, name: str, model: torch.nn.Module) -> None:
    """Keep ``model``'s whole state at the site under ``name``, as numpy arrays."""
    state.put(name, {key: to_numpy(value) for key, value in model.state_dict().items()})


# The name under which a site keeps the model parts its method never sends (``Method.site_parts``).
SITE_PARTS = "model"


def only_parts(state: p.NDArrays, parts: tuple[str, ...]) -> p.NDArrays:
    """The arrays of ``state`` that belong to ``parts``."""
    return {key: value for key, value in state.items() if part_of(key) in parts}


def site_model_state(method: Method, received: p.NDArrays, kept: p.NDArrays | None,
                     initial: Callable[[], p.NDArrays]) -> p.NDArrays:
    """The model a site works with: the parts its method shares as the server sent them, and the
    parts it keeps at home as it kept them (the run's round-0 ones, ``initial()``, before it first
    trained). Raises ``ValueError`` when the server's message lacks a shared part."""
    shared = only_parts(received, method.shared_parts)
    missing = [part for part in method.shared_parts if not only_parts(shared, (part,))]
    if missing:
        raise ValueError(f"the server's model lacks the {' and '.join(missing)} that {method.name} shares")
    home = only_parts(kept if kept is not None else initial(), method.site_parts)
    return {**shared, **home}


@dataclass(frozen=True)
class LocalData:
    """A client's data on the training device, labels in its concept of this round, and what its
    method keeps at the site."""

    x: torch.Tensor
    y: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    state: SiteState = field(default_factory=SiteState)


@dataclass(frozen=True)
class Received:
    """What the server sent this round besides the model: the message's other sections, as
    numpy arrays (``common.protocol``), and its config record."""

    server_round: int = 1
    sections: p.Sections = field(default_factory=dict)
    config: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ClientResult:
    """What one round of local training sends back besides the trained model: n_i, the last
    phase's loss, the arrays of the reply's ``statistics`` section and the method's own metrics
    (``common.protocol`` keys). A method sends only what its server step uses."""

    num_examples: int
    train_loss: float
    statistics: p.NDArrays = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    # The keys of ``metrics`` the method's server step reads. The others are diagnostics (losses,
    # flags) that depend on the training records: with differential privacy on, a reply carries
    # only these, each a private release, made of one, or of the site's test split.
    for_server: tuple[str, ...] = ()


class ClientRoutine:
    """A method's client part: one round of local training, and what a client does to the
    received model before evaluating it (nothing, but for FedAvg-FT)."""

    def __init__(self, method: Method) -> None:
        self.method = method

    def local_update(self, model: FedPACNet, data: LocalData, received: Received, cfg: FedPACConfig,
                     generator: torch.Generator) -> ClientResult:
        """Train ``model`` (as received: the global extractor and the client's head) in place."""
        raise NotImplementedError

    def before_evaluation(self, model: FedPACNet, data: LocalData, cfg: FedPACConfig,
                          generator: torch.Generator) -> FedPACNet:
        """The model the client evaluates: by default the one it received."""
        del data, cfg, generator
        return model


def client_routine(method: Method) -> ClientRoutine:
    """The client part of ``method``: ``Routine`` in ``client.py`` next to its class's module."""
    package = type(method).__module__
    module = importlib.import_module(f"{package}.client")
    return module.Routine(method)
