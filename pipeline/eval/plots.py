"""The evaluation's PNGs: matplotlib is optional (`pip install 'alrira[plot]'`). Without it every CSV
and JSON is still written and one line, once per process, says the plots were skipped and how to
get them."""

from __future__ import annotations

import sys
from pathlib import Path

PLOTS_SKIPPED = "plots skipped: matplotlib is not installed (pip install 'alrira[plot]', or pip install matplotlib)"
_said_skipped = False


def say_plots_skipped() -> None:
    """Print PLOTS_SKIPPED to stderr, the first time only."""
    global _said_skipped
    if not _said_skipped:
        _said_skipped = True
        print(PLOTS_SKIPPED, file=sys.stderr)


def plot_figure(path: Path, draw, *, size: tuple[float, float]) -> bool:
    """draw(axes) on a new figure saved to `path`; False (nothing written, say_plots_skipped) without
    matplotlib. An Agg canvas directly, no pyplot: the process-wide backend is left alone."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        say_plots_skipped()
        return False
    figure = Figure(figsize=size)
    FigureCanvasAgg(figure)
    draw(figure.add_subplot())
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    return True


def legend(axes) -> None:
    """A legend of the labelled artists; none when nothing is labelled (matplotlib would warn)."""
    if axes.get_legend_handles_labels()[0]:
        axes.legend()
