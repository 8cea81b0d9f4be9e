"""The cluster benchmark's results: the rows measured and predicted, and their report as
Markdown tables, plots and files."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pdjax._jsonio import write_atomic


@dataclasses.dataclass(frozen=True)
class Row:
    """One measured run and its predictions (seconds per microbatch).

    Attributes:
      experiment: ``"a"`` or ``"b"``.
      model: a :data:`CLUSTER_MODELS` name.
      link_mbit: the link's configured rate (Mbit/s), or None for unshaped loopback.
      runner: ``single``, ``dp``, ``pipedream``, ``pipedream+1`` (one more microbatch in
        flight at the first stage: latency hiding), ``.../coll`` (transfers through a gloo
        collective instead of ``jax.device_put``) or ``1f1b``.
      stages: the layout (``"1 worker"``, ``"DP x2"``, ``"0-6 | 7-15"``).
      measured: median seconds per microbatch.
      planner: the planner's steady-state prediction (no fill/drain, no update).
      simulated: the simulator's prediction for the schedule that ran (fill, drain and the
        measured update time included).
      speedup: measured throughput over one worker's (same model).
      predicted_speedup: simulated, over one worker's simulated.
      repeats: every measured seconds per microbatch.
      allreduce: ``dp``: measured seconds of the gradient all-reduce alone (the same
        arrays summed over the 2 workers with JAX's collectives, in a program of its own).
      allreduce_predicted: ``dp``: the all-reduce the simulator uses: the calibrated one
        (measured in the same launch, alone), or the ring at the link rate without a
        calibration.
      simulated_profile: the simulator's prediction from the per-layer profile alone (no
        calibration; the ring all-reduce at the link rate): what calibration corrects.
      simulated_posted: the simulator's prediction from the same calibrated costs, but
        with each receive posted when the receiving stage reaches it
        (``PipelineCosts.posted_receives``): the other receive model, to say which one the
        runs follow.
      cpu: per worker process, ``(driver, other threads, wall)`` seconds per microbatch in
        the timed calls: the CPU time of the thread that dispatches (pdjax's driver) and
        of every other thread (XLA's programs, its transfers), from Linux's per-thread
        accounting; empty where unavailable. A worker has one core: wall minus both is
        the time it sat idle.
    """

    experiment: str
    model: str
    link_mbit: float | None
    runner: str
    stages: str
    measured: float
    planner: float
    simulated: float
    speedup: float = math.nan
    predicted_speedup: float = math.nan
    repeats: tuple[float, ...] = ()
    allreduce: float = math.nan
    allreduce_predicted: float = math.nan
    simulated_profile: float = math.nan
    simulated_posted: float = math.nan
    cpu: tuple[tuple[float, float, float], ...] = ()


@dataclasses.dataclass(frozen=True)
class ClusterResult:
    """What :func:`run_cluster` measured and predicted.

    Attributes:
      rows: every run.
      choices: per (model, link): the planner's choice, the measured best runner, and the
        planner's predicted and the measured seconds per microbatch of both.
      network: how the workers were connected (one line).
      curves: predicted speedup over one worker per bandwidth (Mbit/s) for the plot:
        ``{model: {runner: [(mbit, simulated speedup, planner speedup), ...]}}``.
      microbatch: samples per microbatch, per model.
      seconds: the benchmark's wall time.
      rankings: per (model, link): every candidate plan (each 2-stage cut, DP, one worker)
        with measured, planner and simulated seconds per microbatch, Kendall's tau of the
        planner's and the simulator's order against the measured one, the planner's pick
        and the measured best.
      links: per launch, the calibrated links (both directions) and all-reduce.
    """

    rows: tuple[Row, ...]
    choices: tuple[dict[str, Any], ...]
    network: str
    curves: dict[str, dict[str, list[tuple[float, float, float]]]]
    microbatch: dict[str, int]
    seconds: float
    rankings: tuple[dict[str, Any], ...] = ()
    links: tuple[dict[str, Any], ...] = ()

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)


def link_label(mbit: float | None) -> str:
    if mbit is None:
        return "-"
    return f"{mbit / 1000:g} Gbit/s" if mbit >= 1000 else f"{mbit:g} Mbit/s"


def _err(pred: float, measured: float) -> str:
    return f"{100 * (pred / measured - 1):+.0f}%"


def format_markdown(result: ClusterResult) -> str:
    """The result as Markdown tables (runs, then the planner's choices)."""
    lines = [
        f"Network: {result.network}. Samples per microbatch: "
        + ", ".join(f"{m} {b}" for m, b in result.microbatch.items())
        + ". "
        f"Wall time: {result.seconds:.0f} s.",
        "",
        "Predictions from calibrated costs (stages measured as programs on a pinned worker, "
        "the link and the all-reduce measured in the run's launch); the last column is the "
        "simulator from the per-layer profile alone, as before calibration.",
        "",
        *_runs_table(result.rows),
        *_prediction_errors(result.rows),
        *_cpu_table(result.rows),
        *_allreduce_table(result.rows),
        *_links_table(result.links),
        *_choices_table(result.choices),
    ]
    for rk in result.rankings:
        lines += _ranking_table(rk)
    return "\n".join(lines) + "\n"


def _runs_table(rows: Sequence[Row]) -> list[str]:
    """Every run: measured, simulated and planner's seconds per microbatch, and speedups."""
    lines = [
        "| exp | model | link | runner | stages | measured ms/mb | speedup vs 1 worker "
        "| simulated ms/mb (err) | predicted speedup | planner ms/mb (err) "
        "| profile-only simulated (err) |",
        "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.experiment} | {r.model} | {link_label(r.link_mbit)} | {r.runner} | {r.stages} | "
            f"{1e3 * r.measured:.1f} | {r.speedup:.2f}x | "
            f"{1e3 * r.simulated:.1f} ({_err(r.simulated, r.measured)}) | "
            f"{r.predicted_speedup:.2f}x | {1e3 * r.planner:.1f} ({_err(r.planner, r.measured)}) "
            f"| {_ms_err(r.simulated_profile, r.measured)} |"
        )
    return lines


def _prediction_errors(rows: Sequence[Row]) -> list[str]:
    """How many rows the simulator (within 10%) and the planner (within 15%) predict."""
    errs = [(abs(r.simulated / r.measured - 1), abs(r.planner / r.measured - 1)) for r in rows]
    if not errs:
        return []
    return [
        "",
        f"Rows with the simulator within 10%: {sum(e[0] <= 0.10 for e in errs)} of "
        f"{len(errs)} (largest error {100 * max(e[0] for e in errs):.0f}%); the planner "
        f"within 15%: {sum(e[1] <= 0.15 for e in errs)} of {len(errs)} (largest "
        f"{100 * max(e[1] for e in errs):.0f}%).",
        *_receive_models(rows),
    ]


def _cpu_table(rows: Sequence[Row]) -> list[str]:
    """Where each worker's time goes, per run: its driver thread, its other threads, idle."""
    timed = [r for r in rows if r.cpu]
    if not timed:
        return []
    lines = [
        "",
        "Where each worker's time goes (ms per microbatch of the timed calls, from Linux's "
        "per-thread CPU accounting; one core per worker: idle is wall minus both):",
        "",
        "| model | link | runner | stages | worker | driver thread | XLA and transfer "
        "threads | idle | busy |",
        "|---|---|---|---|---|---:|---:|---:|---:|",
    ]
    for r in timed:
        for p, (driver, others, wall) in enumerate(r.cpu):
            idle = max(0.0, wall - driver - others)
            busy = (driver + others) / wall if wall > 0 else math.nan
            lines.append(
                f"| {r.model} | {link_label(r.link_mbit)} | {r.runner} | {r.stages} | {p} "
                f"| {1e3 * driver:.2f} | {1e3 * others:.2f} | {1e3 * idle:.2f} | {busy:.0%} |"
            )
    return lines


def _receive_models(rows: Sequence[Row]) -> list[str]:
    """The rows within 10% under each of the simulator's receive models."""
    both = [r for r in rows if math.isfinite(r.simulated_posted)]
    if not both:
        return []

    def within(attr: str) -> int:
        return sum(abs(getattr(r, attr) / r.measured - 1) <= 0.10 for r in both)

    return [
        "",
        f"The simulator's receive models, rows within 10%: transfers starting once sent "
        f"(the default) {within('simulated')} of {len(both)}, receives posted when the "
        f"receiving stage reaches them {within('simulated_posted')} of {len(both)}.",
    ]


def _allreduce_table(rows: Sequence[Row]) -> list[str]:
    """Data parallelism's measured all-reduce against the ring at the link's rate."""
    dp = [r for r in rows if r.runner == "dp" and not math.isnan(r.allreduce)]
    if not dp:
        return []
    lines = [
        "",
        "Data parallelism's gradient all-reduce alone (JAX's CPU collectives, gloo over "
        "TCP), measured by the calibration, against the ring all-reduce at the link's "
        "rate that the uncalibrated model assumes:",
        "",
        "| model | link | measured all-reduce ms | ring at link rate ms |",
        "|---|---|---:|---:|",
    ]
    lines += [
        f"| {r.model} | {link_label(r.link_mbit)} | {1e3 * r.allreduce:.1f} | "
        f"{1e3 * r.allreduce_predicted:.1f} |"
        for r in dp
    ]
    return lines


def _links_table(links: Sequence[Mapping[str, Any]]) -> list[str]:
    """Per launch: the calibrated links both ways and the model's all-reduce."""
    if not links:
        return []
    lines = [
        "",
        "Calibrated links (through `jax.device_put` between the workers, fitted to "
        "latency + bytes / bandwidth) and the model's all-reduce:",
        "",
        "| model | link | 0 -> 1 latency us, MB/s | 1 -> 0 latency us, MB/s | sender host us "
        "| all-reduce ms |",
        "|---|---|---|---|---:|---:|",
    ]
    for cal in links:
        by = {(ln["src"], ln["dst"]): ln for ln in cal["links"]}
        cells = [
            f"{1e6 * by[k]['latency']:.0f}, {by[k]['bandwidth'] / 1e6:.1f}" if k in by else "-"
            for k in [(0, 1), (1, 0)]
        ]
        host = [ln["send_seconds"] for ln in cal["links"]]
        lines.append(
            f"| {cal['model']} | {link_label(cal['link_mbit'])} | {cells[0]} | {cells[1]} | "
            f"{1e6 * statistics.mean(host) if host else math.nan:.0f} | "
            f"{1e3 * cal['allreduce_model']:.1f} |"
        )
    return lines


def _choices_table(choices: Sequence[Mapping[str, Any]]) -> list[str]:
    """Per model and link: the planner's choice against the measured best."""
    lines = [
        "",
        "| model | link | planner's choice | its predicted ms/mb | measured best | measured ms/mb "
        "| measured of the choice | within 5% |",
        "|---|---|---|---:|---|---:|---:|---|",
    ]
    for c in choices:
        lines.append(
            f"| {c['model']} | {link_label(c['link_mbit'])} | "
            f"{c['planner']} ({c['planner_layout']}) "
            f"| {1e3 * c['planner_seconds']:.1f} | {c['measured_best']} | "
            f"{1e3 * c['measured_best_seconds']:.1f} | "
            f"{1e3 * (c['measured_of_choice'] or math.nan):.1f} | "
            f"{'yes' if c['agree'] else 'NO'} |"
        )
    return lines


def _ranking_table(rk: Mapping[str, Any]) -> list[str]:
    """One model and link's plans ranked: Kendall's taus, the picks, every plan."""
    lines = [
        "",
        f"Plans ranked, {rk['model']} at {link_label(rk['link_mbit'])}: Kendall tau (planner vs "
        f"measured) {rk['tau_planner']:.2f}, (simulator vs measured) "
        f"{rk['tau_simulated']:.2f}; planner's pick {rk['pick']} measured "
        f"{1e3 * rk['pick_measured']:.1f} ms/mb against the best, {rk['best']}, "
        f"{1e3 * rk['best_measured']:.1f} ms/mb; the simulator's pick (the refinement "
        f"loop's) {rk.get('refined', '-')} measured "
        f"{1e3 * rk.get('refined_measured', math.nan):.1f} ms/mb.",
        "",
        "| plan | stages | measured ms/mb | planner ms/mb (err) | simulated ms/mb (err) |",
        "|---|---|---:|---:|---:|",
    ]
    for q in sorted(rk["plans"], key=lambda q: q["measured"]):
        lines.append(
            f"| {q['runner']} | {q['layout']} | {1e3 * q['measured']:.1f} | "
            f"{_ms_err(q['planner'], q['measured'])} | "
            f"{_ms_err(q['simulated'], q['measured'])} |"
        )
    return lines


def _ms_err(pred: float, measured: float) -> str:
    if pred is None or math.isnan(pred):
        return "-"
    return f"{1e3 * pred:.1f} ({_err(pred, measured)})"


def plot_ranking(result: ClusterResult, path: str | os.PathLike[str]) -> Path:
    """Predicted (planner) against measured seconds per microbatch, one point per plan, one
    panel per model and link."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = max(1, len(result.rankings))
    fig, axes = plt.subplots(1, n, figsize=(3.4 * n, 3.4), squeeze=False)
    for ax, rk in zip(axes[0], result.rankings, strict=False):
        xs = [1e3 * q["measured"] for q in rk["plans"]]
        for key, colour, marker in [("planner", "tab:blue", "o"), ("simulated", "tab:orange", "x")]:
            ax.scatter(xs, [1e3 * q[key] for q in rk["plans"]], s=18, color=colour,
                       marker=marker, label=key)  # fmt: skip
        for q, x in zip(rk["plans"], xs, strict=True):
            if q["runner"] in (rk["pick"], rk["best"]):
                ax.annotate(q["runner"].replace("pipedream@", "cut "), (x, 1e3 * q["planner"]),
                            fontsize=6)  # fmt: skip
        lo = min(xs + [1e3 * q["planner"] for q in rk["plans"]]) * 0.8
        hi = max(xs + [1e3 * q["planner"] for q in rk["plans"]]) * 1.2
        ax.plot([lo, hi], [lo, hi], color="grey", lw=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"{rk['model']}, {link_label(rk['link_mbit'])}: tau {rk['tau_planner']:.2f}",
                     fontsize=8)  # fmt: skip
        ax.set_xlabel("measured ms / microbatch", fontsize=7)
        ax.set_ylabel("predicted ms / microbatch", fontsize=7)
        ax.legend(fontsize=6)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def plot_cluster(result: ClusterResult, path: str | os.PathLike[str]) -> Path:
    """Speedup over one worker vs link bandwidth for the parameter-heavy model: predicted
    lines (simulator solid, planner dashed) and measured dots, for DP and PipeDream."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    model = "vgg-fc"
    fig, ax = plt.subplots(figsize=(7, 4.2))
    colours = {"pipedream": "tab:blue", "dp": "tab:red"}
    labels = {"pipedream": "PipeDream (2 stages)", "dp": "data parallel (2 workers)"}
    for name, points in result.curves.get(model, {}).items():
        mbit = [p[0] for p in points]
        ax.plot(mbit, [p[1] for p in points], color=colours[name], label=f"{labels[name]}: "
                "simulated")  # fmt: skip
        ax.plot(mbit, [p[2] for p in points], color=colours[name], ls="--", lw=1,
                label=f"{labels[name]}: planner")  # fmt: skip
        # measured: DP, and per link the best 2-stage cut
        dots = [r for r in result.rows if r.model == model and r.runner == name]
        if name == "pipedream":
            cut = [r for r in result.rows if r.model == model and r.runner.startswith("pipedream@")]
            best: dict[Any, Row] = {}
            for r in cut:
                if r.link_mbit not in best or r.measured < best[r.link_mbit].measured:
                    best[r.link_mbit] = r
            dots += list(best.values())
        xs = [r.link_mbit if r.link_mbit is not None else 2e9 * 8 / 1e6 for r in dots]
        ax.scatter(xs, [r.speedup for r in dots], color=colours[name], zorder=3, s=40,
                   edgecolor="black", label=f"{labels[name]}: measured")  # fmt: skip
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("link bandwidth, each way (Mbit/s)")
    ax.set_ylabel("throughput / one worker's")
    ax.set_title(f"{model}: 2 workers, microbatch {result.microbatch[model]}")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def write_results(result: ClusterResult, out: str | os.PathLike[str]) -> list[Path]:
    """Writes ``cluster.json``, ``cluster.md`` and (with matplotlib) ``cluster.png`` into
    the folder ``out``; returns the paths."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / "cluster.json", folder / "cluster.md"]
    write_atomic(paths[0], result.to_json(), what="cluster results")
    write_atomic(paths[1], format_markdown(result), what="cluster report")
    try:
        paths.append(plot_cluster(result, folder / "cluster.png"))
        if result.rankings:
            paths.append(plot_ranking(result, folder / "cluster-ranking.png"))
    except ImportError:  # matplotlib is the [plot] extra
        pass
    return paths
