"""Pictures of timelines: Chrome-trace / Perfetto JSON and a PNG Gantt chart.

Both take one :class:`~pdjax.schedules.timeline.Timeline` or several (several schedules side
by side: one trace process, or one chart panel, each).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pdjax._jsonio import write_atomic
from pdjax.schedules.timeline import Timeline, Transfer

if TYPE_CHECKING:
    from matplotlib.figure import Figure

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

    >>> from pdjax.schedules import one_f_one_b
    >>> from pdjax.simulator.engine import simulate, unit_costs
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
            events += _thread(pid, g, f"group {g}")
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
            events += _thread(pid, tid, f"link {src}->{dst}")
            for t in sorted(tl.transfers, key=lambda t: t.start):
                if (t.src, t.dst) == (src, dst):
                    events.append(_transfer_event(pid, tid, t))
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _thread(pid: int, tid: int, name: str) -> list[dict[str, Any]]:
    """The metadata events that name a trace thread and keep the threads in ``tid`` order."""
    return [
        {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}},
        {
            "name": "thread_sort_index",
            "ph": "M",
            "pid": pid,
            "tid": tid,
            "args": {"sort_index": tid},
        },
    ]


def _transfer_event(pid: int, tid: int, t: Transfer) -> dict[str, Any]:
    what = "activation" if t.action.kind == "F" else "gradient"
    return {
        "name": f"{what} {t.action}",
        "cat": "transfer",
        "ph": "X",
        "pid": pid,
        "tid": tid,
        "ts": t.start * 1e6,
        "dur": (t.end - t.start) * 1e6,
        "args": {"from": t.src, "to": t.dst, "mb": t.action.mb},
    }


def write_chrome_trace(
    timelines: Timeline | Sequence[Timeline], path: str | os.PathLike[str]
) -> None:
    """Writes :func:`chrome_trace` to ``path``.

    Args:
        timelines: one timeline or several.
        path: output file (``.json``).
    """
    # json.dumps encodes in C; json.dump streams through the pure-Python encoder (tens of
    # times slower on a long run's events)
    # through a temporary file and a rename: a link or a FIFO at ``path`` is refused, never
    # written through, and a crash never leaves half a trace where a whole one was
    write_atomic(os.fspath(path), json.dumps(chrome_trace(timelines)), what="trace")


_TIME_UNITS = ((1.0, "s"), (1e-3, "ms"), (1e-6, "\u00b5s"))
"""Units of the Gantt chart's time axis: seconds per unit, name; the largest that fits."""


def _time_unit(span: float) -> tuple[float, str]:
    """The unit to show a time axis of ``span`` seconds in: ``(seconds per unit, name)``,
    the largest of s, ms and \u00b5s in which the span is at least 1.

    >>> _time_unit(2.5), _time_unit(0.004), _time_unit(3e-5)
    ((1.0, 's'), (0.001, 'ms'), (1e-06, '\u00b5s'))
    """
    for seconds, name in _TIME_UNITS:
        if span >= seconds:
            return seconds, name
    return _TIME_UNITS[-1]


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
) -> Figure:
    """Saves a Gantt chart: one panel per timeline, one row per device group.

    Boxes are coloured by action kind (:data:`KIND_COLORS`; a group's later chunks lighter:
    ``interleaved``'s, and ``zb-v``'s way back up the V) and show the microbatch number (the
    step for ``U``) when they are wide enough to read. Each transfer is an arrow from the
    sending group's row, where it starts, to the receiving group's, where it ends:
    activations in the forward's colour, gradients in the backward's. Each panel's time axis
    is in s, ms or \u00b5s, whichever suits its timeline, named in the axis label (the bottom
    panel's only, where all agree).

    Args:
        timelines: one timeline or several.
        path: output image (``.png``).
        titles: one title per timeline (default: the timelines' names).
        dpi: resolution.

    Returns:
        The matplotlib figure, already saved (a bare ``Figure``: no pyplot state).

    Raises:
        ImportError: if matplotlib is not installed (``pip install 'pdjax[plot]'``).
    """
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError(
            "plot_gantt needs matplotlib: pip install 'pdjax[plot]' (or pip install matplotlib)"
        ) from e

    tls = _as_list(timelines)
    titles = [tl.name for tl in tls] if titles is None else list(titles)
    if len(titles) != len(tls):
        raise ValueError(f"plot_gantt: {len(titles)} titles for {len(tls)} timelines")
    units = [_time_unit(tl.makespan or 1.0) for tl in tls]
    moves = any(tl.transfers for tl in tls)
    # with transfers, thinner boxes leave room between the rows for their arrows
    bar_height, row_in = (0.66, 0.5) if moves else (0.8, 0.42)
    width_in = 14.0
    heights = [row_in * tl.num_groups + 0.9 for tl in tls]
    total_height = sum(heights) + 0.6
    # A bare Figure renders with Agg and touches no pyplot state.
    fig = Figure(figsize=(width_in, total_height), dpi=dpi)
    axes = fig.subplots(len(tls), 1, squeeze=False, gridspec_kw={"height_ratios": heights})
    for ax, tl, title, (scale, unit) in zip(axes[:, 0], tls, titles, units, strict=True):
        _draw_panel(ax, tl, scale=scale, bar_height=bar_height, width_in=width_in)
        ax.set_title(title, fontsize=9, loc="left")
        if ax is axes[-1, 0] or len(set(units)) > 1:  # one label where all panels agree
            ax.set_xlabel(f"time ({unit})", fontsize=8)
    handles = _legend(tls)
    fig.legend(handles=handles, loc="upper right", ncol=len(handles), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / total_height))
    fig.savefig(path)
    return fig


def _draw_panel(ax: Any, tl: Timeline, *, scale: float, bar_height: float, width_in: float) -> None:
    """One timeline on ``ax``: a row per device group, its boxes, labels and transfers,
    times in units of ``scale`` seconds."""
    fontsize = 7
    span_end = (tl.makespan or scale) / scale
    stages_of: dict[int, list[int]] = {}
    for s in tl.spans:
        stages_of.setdefault(s.group, []).append(s.action.stage)
    chunk_rank = {g: sorted(set(v)) for g, v in stages_of.items()}
    points_per_unit = width_in * 0.86 * 72 / span_end
    rows, widths, lefts, colors = [], [], [], []
    for s in tl.spans:
        a = s.action
        ranks = chunk_rank[s.group]
        chunk = ranks.index(a.stage)
        shade = 0.55 * chunk / (len(ranks) - 1) if len(ranks) > 1 else 0.0
        start, width = s.start / scale, (s.end - s.start) / scale
        rows.append(s.group)
        widths.append(width)
        lefts.append(start)
        colors.append(_tint(KIND_COLORS[a.kind], shade))
        label = "U" if a.kind == "U" else str(a.mb)
        if width * points_per_unit >= 0.62 * fontsize * len(label) + 2:
            ax.text(
                start + width / 2,
                s.group,
                label,
                ha="center",
                va="center",
                fontsize=fontsize,
                color="black" if a.kind == "U" or shade else "white",
            )
    ax.barh(
        rows,
        widths,
        left=lefts,
        height=bar_height,
        color=colors,
        edgecolor="white",
        linewidth=0.4,
    )
    _draw_transfers(ax, tl, scale, bar_height / 2)
    ax.set_ylim(tl.num_groups - 0.5, -0.5)
    ax.set_yticks(range(tl.num_groups))
    ax.set_yticklabels([f"group {g}" for g in range(tl.num_groups)], fontsize=8)
    ax.set_xlim(0, span_end)
    ax.tick_params(axis="x", labelsize=8)
    ax.grid(axis="x", linewidth=0.3, alpha=0.5)
    ax.set_axisbelow(True)


def _legend(tls: Sequence[Timeline]) -> list[Any]:
    """The legend's entries: the action kinds shown, the lighter later chunks, transfers."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    kinds = sorted({s.action.kind for tl in tls for s in tl.spans}, key="FBIWU".index)
    handles: list[Any] = [Patch(color=KIND_COLORS[k], label=_KIND_NAMES[k]) for k in kinds]
    if any(len(set(s.action.stage for s in tl.spans if s.group == 0)) > 1 for tl in tls):
        handles.append(Patch(color=_tint("#808080", 0.55), label="lighter: later model chunk"))
    sent = {_is_activation(t) for tl in tls for t in tl.transfers}
    for activation in sorted(sent, reverse=True):
        color, what = _transfer_style(activation)
        handles.append(Line2D([], [], color=color, linewidth=1.0, label=f"{what} transfer"))
    return handles


def _is_activation(transfer: Transfer) -> bool:
    """An activation going forward (else a gradient going backward)."""
    return transfer.action.kind == "F"


def _transfer_style(activation: bool) -> tuple[tuple[float, float, float], str]:
    """Arrow colour (the producing kind's, darker) and name of a kind of transfer."""
    color = KIND_COLORS["F" if activation else "B"]
    rgb = [int(color[i : i + 2], 16) / 255 * 0.7 for i in (1, 3, 5)]
    return (rgb[0], rgb[1], rgb[2]), "activation" if activation else "gradient"


def _draw_transfers(ax: Any, tl: Timeline, scale: float, half_height: float) -> None:
    """Arrows from ``(start, edge of the sender's row)`` to ``(end, edge of the
    receiver's)``, one quiver per kind of transfer."""
    for activation in (True, False):
        moves = [t for t in tl.transfers if _is_activation(t) == activation and t.src != t.dst]
        if not moves:
            continue
        xs, ys, us, vs = [], [], [], []
        for t in moves:
            down = 1.0 if t.dst > t.src else -1.0  # rows grow downwards
            y0 = t.src + down * half_height
            y1 = t.dst - down * half_height
            xs.append(t.start / scale)
            ys.append(y0)
            us.append((t.end - t.start) / scale)
            vs.append(y1 - y0)
        color, what = _transfer_style(activation)
        ax.quiver(
            xs,
            ys,
            us,
            vs,
            angles="xy",
            scale_units="xy",
            scale=1,
            color=color,
            width=0.0012,
            headwidth=4.0,
            headlength=5.0,
            headaxislength=4.5,
            zorder=3,
            label=f"{what} transfer",
        )
