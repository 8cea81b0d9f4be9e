"""Replicated stages on 4 in-process CPU devices: a 3-1 hybrid plan, side by side.

One ``pdjax bench`` run (:func:`pdjax.apps.bench.bench`, rounds interleaved so the machine's
noise falls on every runner alike) of the same model and 3-1 plan (stage 0 on devices
0-2, stage 1 on device 3) three ways per schedule:

* ``<schedule>/backward``: a replicated stage all-reduces its gradient in every backward
  (XLA's data parallelism inside each program: the runtime before per-device sums);
* ``<schedule>``: split replication, gradients summed per device and all-reduced once per
  update (``Pipeline(grad_allreduce="update")``, the default);
* ``<schedule>/rr``: PipeDream's round-robin replication (``replication="round-robin"``):
  3 whole microbatches at once on stage 0, one all-reduce per group (``pipedream``) or
  per step (``1f1b``);

and data parallelism on all 4 devices. Each row carries the all-reduces per optimizer
step counted by the runtime in the compiled programs it ran.

    python benchmarks/bench_replication.py [--model vgg16] [--rounds 5] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", 4)

import numpy as np  # noqa: E402

from pdjax.apps.bench import bench, format_table  # noqa: E402
from pdjax.models import get_model  # noqa: E402
from pdjax.partition import Topology, evaluate_partition  # noqa: E402
from pdjax.profile import profile  # noqa: E402

RUNNERS = (
    "1f1b/backward",
    "1f1b",
    "1f1b/rr",
    "pipedream/backward",
    "pipedream",
    "pipedream/rr",
    "dp",
)


def hybrid_plan(model: str, microbatch: int, microbatches: int, path: Path) -> str:
    """The 3-1 plan: the cut that best balances stage 0's compute / 3 against stage 1's,
    on a profile measured here; written to ``path``."""
    spec = get_model(model, "tiny")
    x = jax.tree.map(np.asarray, spec.sample_batch(microbatch, 0)[0])
    prof = profile(spec.layers, x, measure=True, repeats=3)
    compute = np.asarray(prof.forward_seconds()) + np.asarray(prof.backward_seconds())
    L = len(spec.layers)
    best = min(range(L - 1), key=lambda c: max(compute[: c + 1].sum() / 3, compute[c + 1 :].sum()))
    plan = evaluate_partition(
        prof,
        Topology.from_devices(jax.devices()[:4]),
        [(0, best, 3), (best + 1, L - 1, 1)],
        schedule="1f1b",
        num_microbatches=microbatches,
        microbatch_size=microbatch,
        partitioner="uniform",
    )
    plan.save(path)
    return plan.describe().splitlines()[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="vgg16")
    ap.add_argument("--microbatch", type=int, default=6, help="samples per microbatch")
    ap.add_argument("--microbatches", type=int, default=6, help="M (a multiple of 3)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None, help="also write the result as JSON")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "plan-3-1.json"
        described = hybrid_plan(args.model, args.microbatch, args.microbatches, path)
        result = bench(
            args.model,
            "tiny",
            devices=4,
            batch_size=args.microbatch * args.microbatches,
            microbatches=args.microbatches,
            plan=str(path),
            steps=args.steps,
            repeats=args.rounds,
            schedules=RUNNERS,
        )
    from rich.console import Console

    console = Console(width=200)
    console.print(result.header())
    console.print(f"3-1 plan: {described}")
    console.print(format_table(result))
    for base in ("1f1b", "pipedream"):
        ref = result.row(f"{base}/backward").samples_per_second
        ratios = ", ".join(
            f"{name} {result.row(name).samples_per_second / ref:.2f}x"
            for name in (base, f"{base}/rr")
        )
        console.print(f"{base}: throughput over all-reduce-in-every-backward: {ratios}")
    if args.out:
        args.out.write_text(json.dumps(result.to_dict(), indent=1))


if __name__ == "__main__":
    main()
