"""PipeDream's own in-flight count against pdjax's full-rate one, on a round-robin plan.

    python benchmarks/bench_in_flight.py [--seeds 0,1] [--epochs 20]

``pipedream`` on replicas 1-3-1 (stage 1 round-robin over 3 devices): ``in_flight="paper"``
keeps NOAM = 5 microbatches in flight at the input stage (stage 0 four updates stale),
``"full-rate"`` keeps 9 (eight updates stale). Both train the digits CNN to 0.95 test
accuracy on 5 in-process CPU devices, side by side per seed; the table gives epochs to the
target (statistical efficiency), seconds per epoch as measured here (5 devices share this
machine's cores, so read the ratio only), the simulator's time per microbatch for the
same plan and schedule from the model's profile (hardware efficiency where each device is
its own), and simulated seconds to the target (epochs x simulated seconds per epoch).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", 5)

from pdjax.apps.train import TrainConfig, train  # noqa: E402

BOUNDS = ((0, 0), (1, 2), (3, 4))  # the CNN's layers per stage (inclusive)
REPLICAS = (1, 3, 1)
# microbatches of 19: an epoch of the 1437 training digits is 75 of them, whole groups of 3
BATCH, MICROBATCHES, LR, TARGET = 57, 3, 1e-3, 0.95


def _plan_and_profile(folder: Path) -> tuple[Path, object, object]:
    """The CNN's measured profile, and the 1-3-1 round-robin plan for it as a plan JSON
    (what ``pdjax train --plan`` reads) and as a :class:`~pdjax.partition.Plan`."""
    import numpy as np

    from pdjax.models import get_model
    from pdjax.partition import Topology, evaluate_partition
    from pdjax.profile import profile

    spec = get_model("cnn", "tiny")
    x = np.asarray(spec.sample_input(BATCH // MICROBATCHES, jax.random.key(0)))
    prof = profile(spec.layers, x, measure=True, repeats=5)
    layout = [(lo, hi, r) for (lo, hi), r in zip(BOUNDS, REPLICAS, strict=True)]
    plan = evaluate_partition(
        prof, Topology.flat(sum(REPLICAS), 1e10), layout, schedule="pipedream",
        partitioner="manual", replication="round-robin",
        microbatch_size=BATCH // MICROBATCHES,
    )  # fmt: skip
    path = folder / "plan-1-3-1.json"
    plan.save(path)
    return path, plan, prof


def _simulated(plan: object, prof: object, in_flight: str, microbatches: int) -> float:
    """Seconds per microbatch the simulator gives ``plan`` under ``in_flight``, from the
    measured profile, each device its own."""
    from pdjax.partition import costs_from_plan
    from pdjax.schedules import generate
    from pdjax.simulator import simulate

    sched = generate("pipedream", 3, microbatches, replicas=REPLICAS,
                     replication=("round-robin",) * 3, in_flight=in_flight)  # fmt: skip
    return simulate(sched, costs_from_plan(plan, prof)).makespan / microbatches


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--epochs", type=int, default=20)
    args = ap.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        plan_path, plan, prof = _plan_and_profile(Path(tmp))
        sim = {f: _simulated(plan, prof, f, 75) for f in ("full-rate", "paper")}
        print("simulated seconds per microbatch", sim, flush=True)
        for seed in seeds:
            for in_flight in ("full-rate", "paper"):
                cfg = TrainConfig(
                    model="cnn", config="tiny", dataset="digits", schedule="pipedream",
                    devices=5, plan=str(plan_path), epochs=args.epochs,
                    batch_size=BATCH, microbatches=MICROBATCHES, learning_rate=LR,
                    optimizer="adam", seed=seed, target_accuracy=TARGET,
                    replication="round-robin", options={"in_flight": in_flight},
                )  # fmt: skip
                result = train(cfg)
                epoch_s = statistics.median(r.seconds for r in result.history)
                rows.append((seed, in_flight, result.target_epoch, epoch_s,
                             result.final_accuracy, result.time_to_target))  # fmt: skip
                print(rows[-1], flush=True)
    n = 1437 // (BATCH // MICROBATCHES)  # microbatches per epoch
    lines = [
        "| in flight | q (groups per stage) | stage 0 stale by | epochs to 0.95, per seed "
        "| mean | simulated ms / microbatch | simulated s to 0.95 (mean epochs) "
        "| measured s / epoch here | measured s to 0.95 here (mean) |",
        "|---|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for f, q in (("full-rate", "(9, 2, 1)"), ("paper", "(5, 1, 1)")):
        mine = [r for r in rows if r[1] == f]
        epochs = [r[2] for r in mine]
        reached = [e for e in epochs if e is not None]
        mean = sum(reached) / len(reached) if len(reached) == len(epochs) else math.nan
        stale = int(q[1]) - 1
        lines.append(
            f"| {f} | {q} | {stale} updates | {', '.join(str(e) for e in epochs)} | {mean:.1f} "
            f"| {1e3 * sim[f]:.3f} | {mean * n * sim[f]:.3f} "
            f"| {statistics.median(r[3] for r in mine):.3f} "
            f"| {statistics.mean(r[5] if r[5] is not None else math.nan for r in mine):.2f} |"
        )
    text = "\n".join(lines)
    print(text)
    out = Path(__file__).resolve().parent / "results" / "in-flight.md"
    out.write_text(
        f"`python benchmarks/bench_in_flight.py --seeds {args.seeds}`: the digits CNN, "
        f"pipedream on replicas 1-3-1 (stage 1 round-robin), microbatches of "
        f"{BATCH // MICROBATCHES}, adam {LR:g}, target {TARGET} test accuracy.\n\n{text}\n"
    )
    print("wrote", out)
    print(json.dumps({"rows": rows, "simulated": sim}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
