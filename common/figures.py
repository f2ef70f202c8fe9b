"""Chart helpers for the server's outputs (``server_app.report`` and the methods' ``charts.py``):
figures outside pyplot's global registry, rendered to PNG and written atomically. matplotlib is
the server's: a site's install has none, and no module of the client side imports this one."""

from __future__ import annotations

import io
from pathlib import Path

from matplotlib.figure import Figure

from common.files import atomic_write


def new_figure(width: float, height: float):  # noqa: ANN201
    """A figure and its axes outside pyplot's global registry, so that the chart thread can
    draw while the server goes on."""
    fig = Figure(figsize=(width, height))
    return fig, fig.subplots()


def save_figure(fig: Figure, path: Path) -> None:
    """Render ``fig`` to PNG and write it atomically."""
    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png", dpi=110)
    atomic_write(path, buffer.getvalue())
