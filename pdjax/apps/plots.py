"""Training plots: test accuracy against epochs and against training seconds (PNG).

matplotlib is imported lazily (``pip install 'pdjax[plot]'``); figures are drawn on a
bare ``Figure`` with the Agg canvas, so no display or pyplot state is involved. Each PNG
is rendered in memory and written atomically, never through a symbolic link
(:func:`pdjax._jsonio.write_atomic`).
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pdjax._jsonio import write_atomic
from pdjax.errors import PdjaxError

__all__ = ["PLOT_FILES", "plot_training"]

#: The files :func:`plot_training` writes (before its ``prefix``), by x axis.
PLOT_FILES = {"epoch": "accuracy-vs-epochs.png", "elapsed": "accuracy-vs-seconds.png"}


def plot_training(results: Sequence[Any], out: str | Path, prefix: str = "") -> list[Path]:
    """Writes ``accuracy-vs-epochs.png`` and ``accuracy-vs-seconds.png`` into ``out``.

    Args:
      results: :class:`pdjax.apps.train.TrainResult` objects (one line each).
      out: the folder.
      prefix: prepended to the file names.

    Returns:
      The two paths.

    Raises:
      PdjaxError: a file that cannot be written (a symbolic link, a folder, a read-only
        folder), naming it.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("plots need matplotlib: pip install 'pdjax[plot]'") from e
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for axis, xlabel in (("epoch", "epoch"), ("elapsed", "training seconds")):
        fig = Figure(figsize=(6, 4), dpi=120)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        for r in results:
            xs = [getattr(h, axis) for h in r.history]
            ax.plot(xs, [h.test_accuracy for h in r.history], marker="o", label=r.config.label)
        target = results[0].config.target_accuracy if results else None
        if target:
            ax.axhline(target, color="grey", linestyle="--", linewidth=1, label="target")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("test accuracy")
        if results:
            cfg = results[0].config
            ax.set_title(f"{cfg.model} ({cfg.config}) on {cfg.dataset}, {cfg.devices} devices")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = out / f"{prefix}{PLOT_FILES[axis]}"
        png = io.BytesIO()
        fig.savefig(png, format="png")
        write_atomic(path, png.getvalue(), what="plot", error=PdjaxError)
        paths.append(path)
    return paths
