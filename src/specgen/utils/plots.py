"""Plotting for the PNGs that runs write."""
from __future__ import annotations


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend. Imported on first use, not at the top of a module: it takes a
    second or two, and choosing the backend at import time would change it for a caller's notebook too."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path, dpi: int = 120) -> None:
    """Lay out, write and close a figure (closed, so that a long run's figures do not pile up in memory)."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
