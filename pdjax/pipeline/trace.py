"""Pictures of timelines: Chrome-trace / Perfetto JSON and a PNG Gantt chart.

Both take one :class:`~pdjax.pipeline.timeline.Timeline` or several (several schedules side
by side: one trace process, or one chart panel, each).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from pdjax.pipeline.timeline import Timeline

__all__ = ["KIND_COLORS", "chrome_trace", "plot_gantt", "write_chrome_trace"]

KIND_COLORS = {
    "F": "#4c78a8",
    "B": "#54a24b",
    "I": "#f58518",
    "W": "#e45756",
    "U": "#9d9d9d",
}
"""Colour of each action kind in the Gantt chart."""

_KIND_NAMES = {
    "F": "forward",
    "B": "backward",
    "I": "input grad",
    "W": "weight grad",
    "U": "update",
}


def _as_list(timelines: Timeline | Sequence[Timeline]) -> list[Timeline]:
    return [timelines] if isinstance(timelines, Timeline) else list(timelines)


def chrome_trace(timelines: Timeline | Sequence[Timeline]) -> dict[str, Any]:
    """The Chrome trace-event JSON object (open in Perfetto or ``chrome://tracing``).

    Each timeline is a process; each device group a thread (``group d``) and each link
    that carried a transfer a thread of its own (``link a->b``). Times are microseconds.

    Args:
        timelines: one timeline or several.

    Returns:
        ``{"traceEvents": [...], "displayTimeUnit": "ms"}``.

    >>> from pdjax.pipeline.schedule import one_f_one_b
    >>> from pdjax.pipeline.simulate import simulate, unit_costs
    >>> trace = chrome_trace(simulate(one_f_one_b(2, 2), unit_costs(2)).timeline)
    >>> [e["name"] for e in trace["traceEvents"] if e["ph"] == "X"][:3]
    ['0F0', '0F1', '0B0']
    """
    events: list[dict[str, Any]] = []
    for pid, tl in enumerate(_as_list(timelines)):
        events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": tl.name}})
        events.append(
            {"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}}
        )
        for g in range(tl.num_groups):
            events.append(
                {
                    "name": "thread_name",
                    "ph": "M",
                    "pid": pid,
                    "tid": g,
                    "args": {"name": f"group {g}"},
                }
            )
            events.append(
                {
                    "name": "thread_sort_index",
                    "ph": "M",
                    "pid": pid,
                    "tid": g,
                    "args": {"sort_index": g},
                }
            )
        for span in sorted(tl.spans, key=lambda s: (s.group, s.start)):
            a = span.action
            events.append(
                {
                    "name": str(a),
                    "cat": _KIND_NAMES[a.kind],
                    "ph": "X",
                    "pid": pid,
                    "tid": span.group,
                    "ts": span.start * 1e6,
                    "dur": (span.end - span.start) * 1e6,
                    "args": {"stage": a.stage, "mb": a.mb, "version": a.version},
                }
            )
        links = sorted({(t.src, t.dst) for t in tl.transfers})
        for number, (src, dst) in enumerate(links):
            tid = tl.num_groups + number
            events.append(
                {
                    "name": "thread_name",
                    "ph": "M",
                    "pid": pid,
                    "tid": tid,
                    "args": {"name": f"link {src}->{dst}"},
                }
            )
            events.append(
                {
                    "name": "thread_sort_index",
                    "ph": "M",
                    "pid": pid,
                    "tid": tid,
                    "args": {"sort_index": tid},
                }
            )
            for t in sorted(tl.transfers, key=lambda t: t.start):
                if (t.src, t.dst) != (src, dst):
                    continue
                what = "activation" if t.action.kind == "F" else "gradient"
                events.append(
                    {
                        "name": f"{what} {t.action}",
                        "cat": "transfer",
                        "ph": "X",
                        "pid": pid,
                        "tid": tid,
                        "ts": t.start * 1e6,
                        "dur": (t.end - t.start) * 1e6,
                        "args": {"from": t.src, "to": t.dst, "mb": t.action.mb},
                    }
                )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(
    timelines: Timeline | Sequence[Timeline], path: str | os.PathLike[str]
) -> None:
    """Writes :func:`chrome_trace` to ``path``.

    Args:
        timelines: one timeline or several.
        path: output file (``.json``).
    """
    with open(path, "w") as f:
        json.dump(chrome_trace(timelines), f)


def _tint(color: str, amount: float) -> tuple[float, float, float]:
    """``color`` mixed with white by ``amount`` in [0, 1]."""
    rgb = [int(color[i : i + 2], 16) / 255 for i in (1, 3, 5)]
    return (
        rgb[0] + (1 - rgb[0]) * amount,
        rgb[1] + (1 - rgb[1]) * amount,
        rgb[2] + (1 - rgb[2]) * amount,
    )


def plot_gantt(
    timelines: Timeline | Sequence[Timeline],
    path: str | os.PathLike[str],
    *,
    titles: Sequence[str] | None = None,
    dpi: int = 150,
) -> None:
    """Saves a Gantt chart: one panel per timeline, one row per device group.

    Boxes are coloured by action kind (:data:`KIND_COLORS`; later chunks of an interleaved
    schedule lighter) and show the microbatch number (the step for ``U``) when they are wide
    enough to read.

    Args:
        timelines: one timeline or several.
        path: output image (``.png``).
        titles: one title per timeline (default: the timelines' names).
        dpi: resolution.

    Raises:
        ImportError: if matplotlib is not installed (``pip install 'pdjax[plot]'``).
    """
    try:
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as e:
        raise ImportError(
            "plot_gantt needs matplotlib: pip install 'pdjax[plot]' (or pip install matplotlib)"
        ) from e

    tls = _as_list(timelines)
    titles = [tl.name for tl in tls] if titles is None else list(titles)
    if len(titles) != len(tls):
        raise ValueError(f"plot_gantt: {len(titles)} titles for {len(tls)} timelines")
    width_in = 14.0
    heights = [0.42 * tl.num_groups + 0.9 for tl in tls]
    total_height = sum(heights) + 0.6
    # A bare Figure renders with Agg and touches no pyplot state.
    fig = Figure(figsize=(width_in, total_height), dpi=dpi)
    axes = fig.subplots(len(tls), 1, squeeze=False, gridspec_kw={"height_ratios": heights})
    fontsize = 7
    for ax, tl, title in zip(axes[:, 0], tls, titles, strict=True):
        span_end = tl.makespan or 1.0
        stages_of: dict[int, list[int]] = {}
        for s in tl.spans:
            stages_of.setdefault(s.group, []).append(s.action.stage)
        chunk_rank = {g: sorted(set(v)) for g, v in stages_of.items()}
        points_per_second = width_in * 0.86 * 72 / span_end
        rows, widths, lefts, colors = [], [], [], []
        for s in tl.spans:
            a = s.action
            ranks = chunk_rank[s.group]
            chunk = ranks.index(a.stage)
            shade = 0.55 * chunk / (len(ranks) - 1) if len(ranks) > 1 else 0.0
            width = s.end - s.start
            rows.append(s.group)
            widths.append(width)
            lefts.append(s.start)
            colors.append(_tint(KIND_COLORS[a.kind], shade))
            label = "U" if a.kind == "U" else str(a.mb)
            if width * points_per_second >= 0.62 * fontsize * len(label) + 2:
                ax.text(
                    s.start + width / 2,
                    s.group,
                    label,
                    ha="center",
                    va="center",
                    fontsize=fontsize,
                    color="black" if a.kind == "U" or shade else "white",
                )
        ax.barh(
            rows, widths, left=lefts, height=0.8, color=colors, edgecolor="white", linewidth=0.4
        )
        ax.set_ylim(tl.num_groups - 0.5, -0.5)
        ax.set_yticks(range(tl.num_groups))
        ax.set_yticklabels([f"group {g}" for g in range(tl.num_groups)], fontsize=8)
        ax.set_xlim(0, span_end)
        ax.set_title(title, fontsize=9, loc="left")
        ax.tick_params(axis="x", labelsize=8)
        ax.grid(axis="x", linewidth=0.3, alpha=0.5)
        ax.set_axisbelow(True)
    axes[-1, 0].set_xlabel("time (s)", fontsize=8)
    kinds = sorted({s.action.kind for tl in tls for s in tl.spans}, key="FBIWU".index)
    handles = [Patch(color=KIND_COLORS[k], label=_KIND_NAMES[k]) for k in kinds]
    if any(len(set(s.action.stage for s in tl.spans if s.group == 0)) > 1 for tl in tls):
        handles.append(Patch(color=_tint("#808080", 0.55), label="lighter: later model chunk"))
    fig.legend(handles=handles, loc="upper right", ncol=len(handles), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / total_height))
    fig.savefig(path)
