"""Chart helpers for the server's outputs (``server_app.report`` and the methods' ``charts.py``):
figures outside pyplot's global registry, rendered to PNG and written atomically. matplotlib is
the server's: a site's install has none, and no module of the client side imports this one."""

from __future__ import annotations

import io
from pathlib import Path

from matplotlib.figure import Figure
from PIL import Image

from common.files import atomic_write


def new_figure(width: float, height: float):  # noqa: ANN201
    """A figure and its axes outside pyplot's global registry, so that the chart thread can
    draw while the server goes on."""
    fig = Figure(figsize=(width, height))
    return fig, fig.subplots()


def save_figure(fig: Figure, path: Path, palette: bool = False) -> None:
    """Render ``fig`` to PNG and write it atomically; with ``palette``, in 256 colours: a line
    plot kept in the repository (an experiment's report) is then 3 to 4 times smaller and looks
    the same. Not for heatmaps, whose colour bars would band."""
    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png", dpi=110)
    if palette:
        image = Image.open(io.BytesIO(buffer.getvalue())).convert("RGB")
        buffer = io.BytesIO()
        image.convert("P", palette=Image.Palette.ADAPTIVE, colors=256).save(buffer, format="png", optimize=True)
    atomic_write(path, buffer.getvalue())
