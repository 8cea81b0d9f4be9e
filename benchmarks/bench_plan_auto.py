"""``plan_auto`` against the best plan of every fixed schedule, on PipeDream's profiles.

Run as ``python benchmarks/bench_plan_auto.py`` (``--quick``: VGG-16 on one cluster). For
each published profile (VGG-16, ResNet-50, GNMT-8, AlexNet) on the SOSP'19 clusters (4x4
V100 at 10 Gbit/s, 2x8 V100 at 25 Gbit/s) with 16 GB per device and ``B`` samples per step,
it prints the simulated seconds per sample of:

* ``dp plan``: for each fixed schedule, the best plan ``pdjax plan --schedule S
  --microbatches M`` gives over ``M`` (PipeDream's dynamic program, no recomputation),
  simulated; ``-`` when none fits, or none the runtime could run (a split stage whose
  devices do not divide the microbatch);
* ``searched``: for each fixed schedule, ``plan_auto(schedules=[S])`` (M, stages and
  recomputation searched for that schedule);
* ``auto``: ``plan_auto`` over the flush schedules, and with ``--stale`` over
  ``pipedream`` and ``2bw`` too;

and the ratio of the best fixed schedule's dp plan to ``auto`` (above 1: ``auto`` is faster).
Everything is one simulator's prediction (no device runs here).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from pdjax.errors import PlanError, ScheduleError
from pdjax.partition import Topology, auto_choice, plan_auto, plan_pipedream
from pdjax.partition.choosing.auto import evaluate_candidate
from pdjax.profile import Profile
from pdjax.schedules import FLUSHING, SCHEDULES

MODELS = ("vgg16", "resnet50", "gnmt", "alexnet")
CLUSTERS = ("4x4-v100-10gbps", "2x8-v100-25gbps")
LIMIT = 16e9


def dp_plan_time(profile: Profile, topology: Topology, name: str, B: int) -> float:
    """The fixed schedule's best plan as ``pdjax plan --schedule S --microbatches M``
    makes it, over the ``M`` that divide ``B`` from 1 to 4x the devices, simulated (inf:
    none fits or runs)."""
    counts = [m for m in range(1, 4 * topology.num_devices + 1) if B % m == 0]
    return min(_dp_plan_time(profile, topology, name, B, M) for M in counts)


def _dp_plan_time(profile: Profile, topology: Topology, name: str, B: int, M: int) -> float:
    try:
        plan = plan_pipedream(
            profile,
            topology,
            schedule=name if name not in ("zb-h2", "zb-v") else "zb-h1",
            num_microbatches=M,
            microbatch_size=B // M,
            memory_limit=LIMIT,
        )
        v = 2 if name == "interleaved" else 1
        seconds, peaks = evaluate_candidate(plan, profile, name, chunks=v, batch_size=B)
    except (PlanError, ScheduleError):
        return math.inf
    if any(st.replication == "split" and plan.microbatch_size % st.replicas for st in plan.stages):
        return math.inf  # the runtime cannot split its microbatches over a stage's devices
    return seconds if max(peaks) <= LIMIT else math.inf


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="VGG-16 on one cluster")
    parser.add_argument("--stale", action="store_true", help="also pipedream and 2bw")
    parser.add_argument(
        "--batch",
        type=int,
        default=1680,
        help="samples per step (1680 = 2^4 3 5 7: microbatches that most replica counts divide)",
    )
    parser.add_argument("--out", default="benchmarks/results/plan_auto.json")
    args = parser.parse_args()
    models = MODELS[:1] if args.quick else MODELS
    clusters = CLUSTERS[:1] if args.quick else CLUSTERS
    fixed = [s for s in FLUSHING if s in SCHEDULES]
    if args.stale:
        fixed += ["pipedream", "2bw"]
    rows = []
    for model in models:
        profile = Profile.load(f"pipedream:{model}")
        for cluster in clusters:
            topology = Topology.preset(cluster, memory_per_device=LIMIT)
            t0 = time.perf_counter()
            auto = plan_auto(profile, topology, batch_size=args.batch, allow_stale=args.stale)
            seconds = time.perf_counter() - t0
            row = {
                "model": model,
                "cluster": cluster,
                "auto": auto_choice(auto),
                "plan_seconds": seconds,
                "dp_plan": {s: dp_plan_time(profile, topology, s, args.batch) for s in fixed},
                "searched": {},
            }
            for s in fixed:
                try:
                    one = plan_auto(
                        profile, topology, batch_size=args.batch, schedules=[s], allow_stale=True
                    )
                    row["searched"][s] = auto_choice(one)["time_per_sample"]
                except PlanError:
                    row["searched"][s] = math.inf
            rows.append(row)

    def us(x: float) -> str:
        return "-" if math.isinf(x) else f"{x * 1e6:.1f}"

    # one markdown row per model and cluster (docs/results.md#choosing-everything-plan_auto)
    head = ["model, cluster", *fixed, "auto (choice)", "best dp plan / auto"]
    print(f"simulated us per sample (dp plan / searched), B = {args.batch}, 16 GB per device")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for row in rows:
        a = row["auto"]
        best_fixed = min(row["dp_plan"].values())
        choice = f"{a['schedule']} M={a['microbatches']}"
        choice += f" v={a['chunks']}" if a["chunks"] > 1 else ""
        choice += f" +{a['extra_in_flight']}" if a["extra_in_flight"] else ""
        choice += " " + "-".join(str(r) for _, _, r in a["stages"])
        choice += (
            " remat " + "".join("r" if r else "-" for r in a["remat"]) if any(a["remat"]) else ""
        )
        cells = [f"{us(row['dp_plan'][s])} / {us(row['searched'][s])}" for s in fixed]
        print(
            f"| {row['model']}, {row['cluster'].split('-')[0]} | "
            + " | ".join(cells)
            + f" | **{us(a['time_per_sample'])}** ({choice}) | "
            + f"{best_fixed / a['time_per_sample']:.2f}x |"
        )
    worse = [
        r for r in rows if r["auto"]["time_per_sample"] > min(r["searched"].values()) * (1 + 1e-9)
    ]
    print(f"auto worse than a fixed schedule's searched plan: {len(worse)} of {len(rows)}")
    print("planner seconds: " + ", ".join(f"{r['plan_seconds']:.1f}" for r in rows))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1, default=str))


if __name__ == "__main__":
    main()
