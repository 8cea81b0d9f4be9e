"""Chrome traces and Gantt charts of timelines."""

from __future__ import annotations

import json
import sys

import pytest

from pdjax.schedules import interleaved, one_f_one_b, zb_h1
from pdjax.simulator import (
    PipelineCosts,
    StageCosts,
    Timeline,
    chrome_trace,
    plot_gantt,
    simulate,
    unit_costs,
    write_chrome_trace,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _timeline() -> Timeline:
    costs = PipelineCosts.build(
        [StageCosts(1.0, 1.0, 1.0, activation_bytes=1)] * 2 + [StageCosts(1.0, 1.0, 1.0)],
        link_bandwidth=4.0,
    )
    return simulate(one_f_one_b(3, 4), costs).timeline


def test_chrome_trace_has_one_event_per_span_and_transfer():
    tl = _timeline()
    trace = chrome_trace(tl)
    events = trace["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == len(tl.spans) + len(tl.transfers)
    names = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert names == {
        "group 0",
        "group 1",
        "group 2",
        "link 0->1",
        "link 1->0",
        "link 1->2",
        "link 2->1",
    }
    first = next(e for e in complete if e["name"] == "0F0")
    assert (first["ts"], first["dur"], first["tid"]) == (0.0, 1e6, 0)  # microseconds
    assert first["args"] == {"stage": 0, "mb": 0, "version": 0}
    moves = [e for e in complete if e["cat"] == "transfer"]
    assert {e["dur"] for e in moves} == {0.25e6}
    assert moves[0]["name"] == "activation 0F0"


def test_chrome_trace_of_several_timelines_uses_one_process_each(tmp_path):
    sims = [simulate(s, unit_costs(2)) for s in (one_f_one_b(2, 4), zb_h1(2, 4))]
    path = tmp_path / "trace.json"
    write_chrome_trace([s.timeline for s in sims], path)
    events = json.loads(path.read_text())["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert processes == {0: "1f1b", 1: "zb-h1"}
    assert {e["cat"] for e in events if e["ph"] == "X" and e["pid"] == 1} == {
        "forward",
        "input grad",
        "weight grad",
        "update",
    }


def test_gantt_chart_is_a_png(tmp_path):
    path = tmp_path / "one.png"
    plot_gantt(_timeline(), path)
    assert path.read_bytes()[:8] == PNG_MAGIC
    tls = [simulate(interleaved(2, 4, 2), unit_costs(2, chunks=2)).timeline, _timeline()]
    many = tmp_path / "many.png"
    plot_gantt(tls, many, titles=["interleaved", "1f1b"], dpi=60)
    assert many.read_bytes()[:8] == PNG_MAGIC
    with pytest.raises(ValueError, match="1 titles for 2 timelines"):
        plot_gantt(tls, many, titles=["one"])


def test_gantt_chart_draws_transfers_and_picks_a_time_unit(tmp_path):
    from matplotlib.quiver import Quiver

    # microsecond stages: the axis reads in \u00b5s, not in 0.00001 s
    costs = PipelineCosts.build(
        [StageCosts(2e-6, 2e-6, 2e-6, activation_bytes=1)] * 2 + [StageCosts(2e-6, 2e-6, 2e-6)],
        link_bandwidth=2e6,
    )
    tl = simulate(one_f_one_b(3, 4), costs).timeline
    assert tl.transfers and tl.makespan < 1e-3
    path = tmp_path / "us.png"
    fig = plot_gantt(tl, path, dpi=60)
    assert path.read_bytes()[:8] == PNG_MAGIC
    (ax,) = fig.axes
    assert ax.get_xlabel() == "time (\u00b5s)"
    assert ax.get_xlim()[1] == pytest.approx(tl.makespan * 1e6)
    # one arrow per transfer: activations down the rows, gradients up
    arrows = [c for c in ax.collections if isinstance(c, Quiver)]
    assert sum(q.N for q in arrows) == len(tl.transfers)
    forward = next(q for q in arrows if q.get_label() == "activation transfer")
    assert all(v > 0 for v in forward.V) and all(u >= 0 for u in forward.U)
    legend = {t.get_text() for t in fig.legends[0].get_texts()}
    assert {"activation transfer", "gradient transfer"} <= legend
    # panels of different spans get units of their own, each named
    fig = plot_gantt([tl, _timeline()], tmp_path / "two.png", dpi=60)
    assert [a.get_xlabel() for a in fig.axes] == ["time (\u00b5s)", "time (s)"]
    # milliseconds; one shared label when the panels agree
    slow = simulate(one_f_one_b(2, 2), unit_costs(2)).timeline
    ms = Timeline(
        "ms",
        slow.num_groups,
        tuple(s._replace(start=s.start * 1e-3, end=s.end * 1e-3) for s in slow.spans),
    )
    fig = plot_gantt([ms, ms], tmp_path / "ms.png", dpi=60)
    assert [a.get_xlabel() for a in fig.axes] == ["", "time (ms)"]


def test_gantt_chart_without_matplotlib_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"pip install 'pdjax\[plot\]'"):
        plot_gantt(_timeline(), tmp_path / "x.png")
