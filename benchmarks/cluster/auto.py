"""``plan_auto`` on the 2-worker cluster: its choice against every fixed schedule's best plan.

    python benchmarks/cluster/auto.py      # as root: emulated links; else loopback

Per model and link (the cluster benchmark's, :data:`benchmarks.harness.cluster.RATES`), on 2
pinned single-core workers joined by ``jax.distributed`` (see
:mod:`benchmarks.harness.cluster`):

1. one pinned worker profiles the model and times every stage a 2-stage cut can make, as
   the runtime's own programs (the cluster benchmark's calibration);
2. a first launch of both workers measures the link both ways and the all-reduce;
3. ``plan_auto`` on those calibrated costs (straight 2-stage pipelines, microbatches of
   the cluster's size, ``M = 4`` per step; stale schedules allowed) picks the schedule and
   the cut; ``plan_auto(schedules=[S])`` gives each fixed schedule's best plan
   (``gpipe``, ``1f1b``, ``zb-h1``, ``zb-h2``, ``pipedream``, ``2bw``);
4. a second launch runs every one of those plans, data parallelism and (in its own launch)
   one worker alone, round-robin, ``repeats`` timed rounds after two warm-ups.

It prints, per model and link, each plan's measured and predicted seconds per microbatch
and whether the choice is within 5% of the measured best, and writes
``benchmarks/results/cluster-auto.{json,md}``. About 10 minutes here.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# run as a file, Python puts benchmarks/cluster/ on sys.path: the repository's root holds
# the benchmarks package
_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks.cluster.options import parse_no_options  # noqa: E402
from pdjax.partition import auto_choice  # noqa: E402

RESULTS = Path(__file__).resolve().parent.parent / "results"
SCHEDULES = ("gpipe", "1f1b", "zb-h1", "zb-h2", "pipedream", "2bw")
M = 4


def _plans(prof: Any, topo: Any, cal: Any, microbatch: int) -> tuple[Any, dict[str, Any]]:
    from pdjax.errors import PdjaxError
    from pdjax.partition import plan_auto

    common: dict[str, Any] = dict(
        batch_size=M * microbatch,
        microbatches=[M],
        straight=True,
        allow_stale=True,
        memory_limit=None,
        calibration=cal,
    )
    auto = plan_auto(prof, topo, schedules=list(SCHEDULES), **common)
    best = {}
    for name in SCHEDULES:
        try:
            best[name] = plan_auto(prof, topo, schedules=[name], **common)
        except PdjaxError as e:
            print(f"  {name}: no plan ({e})", flush=True)
    return auto, best


def _runner(name: str, plan: Any, units: int) -> dict[str, Any]:
    return {
        "name": name,
        "label": name,
        "units": units,
        "stages": [(st.first_layer, st.last_layer) for st in plan.stages],
        "microbatches": M,
        "extra": auto_choice(plan)["extra_in_flight"],
    }


def run(models: tuple[str, ...], repeats: int, units: int, seed: int, log: Any) -> list[dict]:
    from benchmarks.harness.cluster import (
        MICROBATCH,
        RATES,
        cluster_model,
        launch,
        profile_on_workers,
        stage_calibration,
        topology,
    )
    from benchmarks.harness.netem import network_support
    from pdjax.distributed import ending_on_signals

    emulate = network_support() is None
    out = []
    with ending_on_signals(), tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for model in models:
            mb, L = MICROBATCH[model], len(cluster_model(model).layers)
            wanted = [(0, L - 1, 1, "split"), (0, L - 1, 2, "round-robin")]
            wanted += [
                st for c in range(L - 1) for st in [(0, c, 1, "split"), (c + 1, L - 1, 1, "split")]
            ]
            log(f"{model}: profiling and calibrating {len(wanted)} stages on one pinned worker")
            prof, _, stages = profile_on_workers(model, mb, seed, work, wanted)
            base = {"model": model, "microbatch": mb, "seed": seed, "repeats": repeats}
            alone = launch({**base, "runners": [{"name": "single", "units": units}]}, 1, None,
                            False, work)  # fmt: skip
            single = statistics.median(alone["single"]) / units
            for rate in RATES[model] if emulate else [None]:
                where = "loopback" if rate is None else f"{rate:g} Mbit/s"
                log(f"{model} on {where}: measuring the link")
                got = launch({**base, "runners": [], "calibrate": True}, 2, rate, emulate, work)
                cal = stage_calibration(prof, model, mb, stages, got["_calibration"])
                auto, best = _plans(prof, topology(cal, 2, rate), cal, mb)
                runners = [_runner(name, plan, units) for name, plan in best.items()]
                runners.append({"name": "dp", "label": "dp",
                                "units": units if rate is None or rate >= 1000 else 8})  # fmt: skip
                log(f"{model} on {where}: running {len(runners)} runners")
                got = launch({**base, "runners": runners}, 2, rate, emulate, work)
                out.append(
                    _report(model, rate, auto, best=best, runners=runners, got=got, single=single)
                )
                log(_verdict(out[-1]))
    return out


def _report(
    model: str,
    rate: float | None,
    auto: Any,
    *,
    best: dict[str, Any],
    runners: list[dict[str, Any]],
    got: dict[str, Any],
    single: float,
) -> dict[str, Any]:
    rows = []
    for r in runners:
        measured = statistics.median(got[r["label"]]) / r["units"]
        plan = best.get(r["name"])
        a = auto_choice(plan) if plan is not None else None
        rows.append(
            {
                "runner": r["name"],
                "plan": "DP x2"
                if plan is None
                else " / ".join(f"{f}-{last}" for f, last in r["stages"])
                + (f" +{a['extra_in_flight']}" if a and a["extra_in_flight"] else ""),
                "measured": measured,
                # plan_auto's seconds per sample, per microbatch
                "predicted": a["time_per_sample"] * plan.microbatch_size if a else None,
            }
        )
    rows.append({"runner": "single", "plan": "1 worker", "measured": single, "predicted": None})
    schedules = [row for row in rows if row["runner"] in best]
    best_measured = min(schedules, key=lambda row: row["measured"])
    choice = auto_choice(auto)["schedule"]
    of_choice = next(row for row in rows if row["runner"] == choice)
    return {
        "model": model,
        "link_mbit": rate,
        "choice": choice,
        "rows": rows,
        "best": best_measured["runner"],
        "choice_vs_best": best_measured["measured"] / of_choice["measured"],
        "best_overall": min(rows, key=lambda row: row["measured"])["runner"],
    }


def _verdict(res: dict[str, Any]) -> str:
    link = "loopback" if res["link_mbit"] is None else f"{res['link_mbit']:g} Mbit/s"
    ok = "within" if res["choice_vs_best"] >= 1 / 1.05 else "NOT within"
    return (
        f"{res['model']} on {link}: plan_auto chose {res['choice']}; measured best schedule "
        f"{res['best']}; the choice runs at {res['choice_vs_best']:.2f} of its speed ({ok} 5%); "
        f"fastest of all runners: {res['best_overall']}"
    )


def markdown(results: list[dict[str, Any]], seconds: float) -> str:
    lines = [
        "| model | link | runner | plan (cut) | measured ms / microbatch | plan_auto ms |",
        "|---|---|---|---|---:|---:|",
    ]
    for res in results:
        link = "loopback" if res["link_mbit"] is None else f"{res['link_mbit']:g} Mbit/s"
        for row in sorted(res["rows"], key=lambda r: r["measured"]):
            mark = " **(plan_auto)**" if row["runner"] == res["choice"] else ""
            pred = "-" if row["predicted"] is None else f"{row['predicted'] * 1e3:.2f}"
            lines.append(
                f"| {res['model']} | {link} | {row['runner']}{mark} | {row['plan']} | "
                f"{row['measured'] * 1e3:.2f} | {pred} |"
            )
    lines += ["", *(f"* {_verdict(res)}" for res in results), "",
              f"(`python benchmarks/cluster/auto.py`, {seconds:.0f} s)"]  # fmt: skip
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parse_no_options(__doc__, argv)
    t0 = time.monotonic()

    def log(line: str) -> None:
        print(f"[{time.monotonic() - t0:5.0f} s] {line}", flush=True)

    results = run(("mlp-512", "vgg-fc"), repeats=3, units=24, seed=0, log=log)
    text = markdown(results, time.monotonic() - t0)
    print(text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "cluster-auto.json").write_text(json.dumps(results, indent=1))
    (RESULTS / "cluster-auto.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
