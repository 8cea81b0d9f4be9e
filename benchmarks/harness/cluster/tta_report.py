"""The report of time to accuracy on the cluster (:mod:`benchmarks.harness.cluster.tta`'s runs):
one row per study, link and runner over the seeds, as ``tta.md``, ``tta.json`` and
accuracy-vs-seconds plots."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.harness.cluster.tta import (
    ALONE,
    RUNNERS,
    STUDIES,
    M,
    TTAStudy,
    link_key,
    link_text,
    load_results,
)
from pdjax._jsonio import write_atomic

__all__ = ["markdown", "plot", "report", "summarize"]


def _samples_per_second(res: Mapping[str, Any] | None) -> float | None:
    """Training samples per second over the run's epochs (None without any)."""
    hist = (res or {}).get("history") or []
    if not hist:
        return None
    samples = sum(h["samples_per_second"] * h["seconds"] for h in hist)
    return float(samples / sum(h["seconds"] for h in hist))


def _over(a: float | None, b: float | None) -> float | None:
    """``a / b``, None where either is missing, zero or NaN."""
    if a is None or b is None or not a or not b or a != a or b != b:
        return None
    return a / b


def _links_of(results: Sequence[Mapping[str, Any]]) -> list[float | None]:
    links = {r["link_mbit"] for r in results if r["runner"] not in ALONE}
    return sorted(links, key=lambda x: -1.0 if x is None else x)


def summarize(results: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per (study, link, runner), each field a list over the seeds: seconds and
    epochs to target, samples per second, accuracy at stop, and the speedups over data
    parallelism and over one worker of the same seed (time to target, measured); next to
    them the measured and the predicted throughput over data parallelism's."""
    runs = {(r["study"], r["link_mbit"], r["runner"], r["seed"]): r for r in results}
    rows = []
    order = {name: i for i, name in enumerate(STUDIES)}
    studies = sorted(dict.fromkeys(r["study"] for r in results), key=lambda s: order.get(s, 99))
    for study in studies:
        mine = [r for r in results if r["study"] == study]
        seeds = sorted({r["seed"] for r in mine})
        for rate in _links_of(mine):
            for runner in RUNNERS:
                link = None if runner in ALONE else rate
                got = [runs.get((study, link, runner, s)) for s in seeds]
                present = [r for r in got if r is not None]
                if not present:
                    continue
                dps = [runs.get((study, rate, "dp", s)) for s in seeds]
                ones = [runs.get((study, None, "single", s)) for s in seeds]
                tta = [r.get("time_to_target") if r else None for r in got]
                sps = [_samples_per_second(r) for r in got]
                pred = present[0]["predicted_seconds_per_sample"]
                pred_dp = next((r["predicted_seconds_per_sample"] for r in dps if r), None)
                pred_one = next((r["predicted_seconds_per_sample"] for r in ones if r), None)
                rows.append(
                    {
                        "study": study,
                        "settings": present[0]["settings"],
                        "link_mbit": rate,
                        "runner": runner,
                        "seeds": seeds,
                        "stages": present[0]["stages"],
                        "time_to_target": tta,
                        "epochs_to_target": [r.get("target_epoch") if r else None for r in got],
                        "samples_per_second": sps,
                        "accuracy_at_stop": [
                            r["history"][-1]["test_accuracy"] if r and r.get("history") else None
                            for r in got
                        ],
                        "errors": [r.get("error") if r else "not run (yet)" for r in got],
                        "speedup_vs_dp": [
                            _over(d.get("time_to_target") if d else None, t)
                            for d, t in zip(dps, tta, strict=True)
                        ],
                        "speedup_vs_single": [
                            _over(o.get("time_to_target") if o else None, t)
                            for o, t in zip(ones, tta, strict=True)
                        ],
                        "throughput_vs_dp": [
                            _over(a, _samples_per_second(d)) for a, d in zip(sps, dps, strict=True)
                        ],
                        "predicted_throughput_vs_dp": _over(pred_dp, pred),
                        "predicted_throughput_vs_single": _over(pred_one, pred),
                    }
                )
    return rows


def _cell(values: Sequence[Any], fmt: str) -> str:
    return " / ".join("-" if v is None or v != v else format(v, fmt) for v in values)


def markdown(
    rows: Sequence[Mapping[str, Any]],
    seconds: float | None = None,
    launched: float | None = None,
) -> str:
    """The report's tables, one per study (``seconds``: this invocation's wall time;
    ``launched``: the seconds of every run's launch together, resumed runs included)."""
    lines: list[str] = []
    for study in dict.fromkeys(r["study"] for r in rows):
        first = next(r for r in rows if r["study"] == study)
        s = TTAStudy(**first["settings"])
        lines += [
            f"## {study} on {s.dataset}",
            "",
            f"Target: {s.why}; budget {s.epochs} epochs; batch {s.batch_size} ({M} "
            f"microbatches of {s.microbatch}), Adam at {s.learning_rate:g}. Seeds: "
            f"{', '.join(map(str, first['seeds']))} (a cell reads `seed a / seed b`; `-`: "
            "the target was not reached). One worker alone (`single`, and `single-mb`: an "
            "update per microbatch, like `pipedream`) uses no link: its rows repeat under "
            "each link, against that link's DP.",
            "",
            "| link | runner | stages | time to target (s) | epochs to target | samples/s | "
            "**TTA speedup vs DP** | TTA speedup vs 1 worker | samples/s vs DP | predicted "
            "samples/s vs DP | predicted vs 1 worker | accuracy at stop |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in (r for r in rows if r["study"] == study):
            cells = [
                link_text(r["link_mbit"]),
                r["runner"],
                r["stages"] + (", no link" if r["runner"] in ALONE else ""),
                _cell(r["time_to_target"], ".1f"),
                _cell(r["epochs_to_target"], "d"),
                _cell(r["samples_per_second"], ".0f"),
                f"**{_cell(r['speedup_vs_dp'], '.2f')}**",
                _cell(r["speedup_vs_single"], ".2f"),
                _cell(r["throughput_vs_dp"], ".2f"),
                _cell([r["predicted_throughput_vs_dp"]], ".2f"),
                _cell([r["predicted_throughput_vs_single"]], ".2f"),
                _cell(r["accuracy_at_stop"], ".3f"),
            ]
            lines.append("| " + " | ".join(cells) + " |")
        failed = [(r, e) for r in rows if r["study"] == study for e in r["errors"] if e]
        lines += [""] + [f"* {r['runner']} at {link_text(r['link_mbit'])}: {e.splitlines()[-1]}"
                         for r, e in failed]  # fmt: skip
        lines.append("")
    if launched is not None:
        lines.append(f"Runs: {launched / 60:.0f} min of launches in all (each run: starting the "
                     "workers, compiling, training, evaluating).")  # fmt: skip
    if seconds is not None:
        lines.append(f"Wall time of the invocation that wrote this: {seconds / 60:.0f} min.")
    return "\n".join(lines)


def plot(
    results: Sequence[Mapping[str, Any]], out: str | os.PathLike[str], seed: int = 0
) -> list[Path]:
    """One accuracy-vs-training-seconds plot per study and link (``seed``'s runs; one
    worker alone on each), ``tta-<study>-<link>.png`` in ``out``; returns the paths."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    mine = [r for r in results if r["seed"] == seed and r.get("history")]
    for study in dict.fromkeys(r["study"] for r in mine):
        theirs = [r for r in mine if r["study"] == study]
        for rate in _links_of(theirs):
            fig = Figure(figsize=(6, 4), dpi=110)
            FigureCanvasAgg(fig)
            ax = fig.add_subplot()
            for r in theirs:
                if r["link_mbit"] == rate or r["runner"] in ALONE:
                    xs = [h["elapsed"] for h in r["history"]]
                    ys = [h["test_accuracy"] for h in r["history"]]
                    ax.plot(xs, ys, marker="o", label=r["runner"])
            ax.axhline(theirs[0]["settings"]["target"], color="grey", linestyle=":",
                       label="target")  # fmt: skip
            ax.set_xlabel("training seconds")
            ax.set_ylabel("test accuracy")
            ax.set_title(f"{study}, {link_text(rate)} (seed {seed})")
            ax.legend()
            fig.tight_layout()
            path = folder / f"tta-{study}-{link_key(rate)}.png"
            fig.savefig(path)
            paths.append(path)
    return paths


def report(
    out: str | os.PathLike[str],
    dest: str | os.PathLike[str] | None = None,
    seconds: float | None = None,
) -> list[Path]:
    """Writes ``tta.md``, ``tta.json`` and the plots of the results under ``out`` into
    ``dest`` (default: ``out``); returns the paths."""
    results = load_results(out)
    rows = summarize(results)
    folder = Path(dest if dest is not None else out)
    folder.mkdir(parents=True, exist_ok=True)
    md, js = folder / "tta.md", folder / "tta.json"
    launched = sum(r.get("launch_seconds", 0.0) for r in results)
    write_atomic(md, markdown(rows, seconds, launched) + "\n", what="report")
    write_atomic(js, json.dumps(rows, indent=1), what="report")
    paths = [md, js]
    try:
        paths += plot(results, folder)
    except ImportError:  # matplotlib is the [plot] extra
        pass
    return paths
