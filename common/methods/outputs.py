"""What a method adds to a run's outputs (``server_app.report``): its columns of ``rounds.csv``
and ``clients.csv``, its fragment of the per-round log line, its own tables and its charts.

A method's server part declares them (``ServerPart.outputs``, an :class:`Outputs`); the report
computes every value from the round's record (``server_app.report.RoundRecord``): what the
method's server step recorded (``method``, a dict) and the clients' reply metrics (``train``).
``rounds.csv`` and ``clients.csv`` have one schema for every method, so that runs concatenate:
the generic columns, then the columns every registered method declares; a run writes ``""`` in
the columns its method does not declare. Nothing here imports matplotlib: a chart is a callable
that draws to a path, defined next to its method (``common/methods/<family>/charts.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol


class RoundData(Protocol):
    """One finished round as a method's outputs see it (``server_app.report.RoundRecord``)."""

    @property
    def round(self) -> int: ...

    @property
    def train(self) -> dict[int, dict[str, float]]:
        """The valid training replies' metrics by partition-id."""

    @property
    def method(self) -> dict[str, Any]:
        """What the method's server part recorded this round (``StepResult.record`` and
        ``ServerPart.closing_record``)."""


@dataclass(frozen=True)
class RoundColumn:
    """A column of ``rounds.csv``: its value for a round (``""``: none). ``in_metrics``: the
    value also goes into the round's entry of ``metrics.json`` (where it is not ``""``)."""

    name: str
    value: Callable[[RoundData], object]
    in_metrics: bool = False


@dataclass(frozen=True)
class ClientColumn:
    """A column of ``clients.csv``: its value for a round and a partition-id (``""``: none)."""

    name: str
    value: Callable[[RoundData, int], object]


def reply_metric(name: str, key: str) -> ClientColumn:
    """The client column ``name``: the reply metric ``key`` of the client's training reply."""
    return ClientColumn(name, lambda r, pid: r.train.get(pid, {}).get(key, ""))


@dataclass(frozen=True)
class Table:
    """A table of the method's own, ``file`` in the run folder (written once a round has rows)."""

    file: str
    columns: tuple[str, ...]
    rows: Callable[[RoundData], list[dict[str, object]]]


@dataclass(frozen=True)
class ChartContext:
    """What a chart may show besides the rounds: each partition's group, the run config, and
    the first rounds of a new concept (concept drift; none without)."""

    group_of: Callable[[int], int]
    config: Mapping[str, Any]
    drift_rounds: tuple[int, ...]


@dataclass(frozen=True)
class Chart:
    """A chart of the method's own, ``file`` in the run folder: ``draw(rounds, context, path)``
    draws it, once ``shown(rounds)`` says the rounds so far have something to show."""

    file: str
    draw: Callable[[Sequence[RoundData], ChartContext, Path], None]
    shown: Callable[[Sequence[RoundData]], bool]


def _no_log(record: RoundData) -> str:
    del record
    return ""


@dataclass(frozen=True)
class Outputs:
    """Everything a method adds to the outputs; the base declares nothing."""

    round_columns: tuple[RoundColumn, ...] = ()
    client_columns: tuple[ClientColumn, ...] = ()
    tables: tuple[Table, ...] = ()
    charts: tuple[Chart, ...] = ()
    # The method's part of the per-round log line, after the training replies (" | ..."; "": none)
    log: Callable[[RoundData], str] = _no_log


def schema(generic: Sequence[str], declared: Sequence[Sequence[str]]) -> tuple[str, ...]:
    """The columns of a table: ``generic``, then each declaration's in order, every name once."""
    return tuple(dict.fromkeys([*generic, *(name for names in declared for name in names)]))


__all__ = ["Chart", "ChartContext", "ClientColumn", "Outputs", "RoundColumn", "RoundData", "Table", "reply_metric",
           "schema"]
