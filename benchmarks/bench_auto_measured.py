"""``plan_auto``'s choice, measured against the best plan of every fixed schedule.

Run as ``python benchmarks/bench_auto_measured.py`` (about 10 minutes on 2 cores; run it on
a quiet machine). For each model (default: the cluster benchmark's ``mlp-512`` and
``vgg-fc``) on ``--devices`` in-process CPU devices and ``--batch-size`` samples per step:

1. the model is profiled (measured) at the microbatch size ``B / devices``; the driver's
   host seconds per action are measured on a model with next to no compute
   (:func:`pdjax.apps.bench.driver_seconds_per_action`), and the devices' shared thread pool's
   concurrency with :func:`pdjax.apps.bench.pool_concurrency`;
2. ``plan_auto`` searches the schedules the runtime runs exactly as planned (``gpipe``,
   ``1f1b``, ``zb-h1``, ``zb-h2``; with ``--stale`` also ``pipedream`` and ``2bw``):
   stages and ``M`` (straight pipelines; ``--replicate`` allows replication); and
   ``plan_auto(schedules=[S])`` gives every fixed schedule's best plan the same way. Both
   are done twice: ranked by the simulator alone, and with
   :class:`pdjax.partition.HostCosts` (no faster than the driver and the shared pool
   allow). ``interleaved`` and ``zb-v`` are priced as what-ifs over balanced chunks, not as
   layer ranges the runtime can place, and are left out;
3. every distinct plan runs as a :class:`pdjax.Pipeline` with Adam on synthetic data,
   round-robin over the plans (a warm-up call each, then ``--repeats`` rounds of
   ``--steps`` optimizer steps each; medians), so the ratios compare runs made side by side;
4. the table prints, per plan, the measured samples per second, its ratio to the measured
   best, and both predictions.

The goal: the chosen plan within 5% of the measured best. ``--json PATH`` writes the rows.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

# run as a file, Python puts benchmarks/ on sys.path: the repository's root holds the
# benchmarks package (its harness: the cluster's models)
_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)


def _runner(spec: Any, plan: Any, x: Any, y: Any, *, steps: int, seed: int) -> dict[str, Any]:
    """A Pipeline for ``plan`` (its chosen schedule, M, in-flight depth) and a timed call."""
    import jax
    import optax

    from pdjax import Pipeline

    name = plan.schedule.kind
    pipe = Pipeline(spec.layers, plan, spec.loss, optax.adam(1e-3), devices=jax.devices())
    batch = pipe.split_batch((x, y))
    streaming = name in ("pipedream", "2bw")
    calls, stream = (1, batch * steps) if streaming else (steps, batch)
    state = pipe.init(jax.random.key(seed), batch[0][0])
    pipe.schedule(len(stream))  # refused here, before compiling, if it cannot run
    samples = calls * len(stream) * (len(jax.tree.leaves(x)[0]) // plan.num_microbatches)

    def call() -> float:
        nonlocal state
        t0 = time.perf_counter()
        for _ in range(calls):
            state, _ = pipe.run(state, stream)
        jax.block_until_ready(state)
        return time.perf_counter() - t0

    return {"call": call, "samples": samples}


def _best_plans(
    prof: Any, topo: Any, names: list[str], *, stale: list[str], common: dict[str, Any], log: Any
) -> tuple[Any, dict[str, Any], float]:
    """``plan_auto`` over ``names``, and per schedule ``plan_auto(schedules=[S])``."""
    from pdjax.errors import PdjaxError
    from pdjax.partition import plan_auto

    t0 = time.monotonic()
    auto = plan_auto(prof, topo, schedules=names, allow_stale=bool(stale), **common)
    search = time.monotonic() - t0
    plans = {}
    for name in names:
        try:
            plans[name] = plan_auto(
                prof, topo, schedules=[name], allow_stale=name in stale, **common
            )
        except PdjaxError as e:
            log(f"{name}: no plan ({e})")
    return auto, plans, search


def _key(plan: Any) -> str:
    return f"{plan.options['auto']['schedule']} {_label(plan)}"


def measure_model(model: str, args: argparse.Namespace, spa: float, log: Any) -> dict[str, Any]:
    """Plans ``model`` both ways, runs every distinct plan side by side; the report."""
    import jax
    import numpy as np

    from benchmarks.harness.cluster import MICROBATCH
    from pdjax.apps.bench import pool_concurrency
    from pdjax.errors import PdjaxError
    from pdjax.partition import HostCosts, Topology, plan_auto
    from pdjax.profile import profile

    devs = jax.devices()[: args.devices]
    spec = _model(model)
    B = args.batch_size or 4 * MICROBATCH.get(model, 16)
    x, y = jax.tree.map(np.asarray, spec.sample_batch(B, args.seed))
    b0 = B // args.devices
    prof = profile(spec.layers, x[:b0], measure=True, device=devs[0], repeats=5)
    concurrency = pool_concurrency(spec, (x[:b0], y[:b0]), devs)
    host = HostCosts(seconds_per_action=spa, concurrency=concurrency)
    topo = Topology.from_devices(devs)
    stale = ["pipedream", "2bw"] if args.stale else []
    names = ["gpipe", "1f1b", "zb-h1", "zb-h2", *stale]
    common: dict[str, Any] = dict(batch_size=B, memory_limit=None, straight=args.straight)
    free = plan_auto(prof, topo, schedules=names, allow_stale=bool(stale), batch_size=B)
    auto, plans, search = _best_plans(prof, topo, names, stale=stale, common=common, log=log)
    auto_h, plans_h, search_h = _best_plans(
        prof, topo, names, stale=stale, common={**common, "host": host}, log=log
    )
    choices = {"sim": _key(auto), "host": _key(auto_h)}
    candidates: dict[str, dict[str, Any]] = {}  # every schedule's best by either ranking
    for ranking, best in (("sim", plans), ("host", plans_h)):
        for plan in best.values():
            entry = candidates.setdefault(_key(plan), {"plan": plan, "best_by": []})
            entry["best_by"].append(ranking)
    runners = {}
    for key, cand in candidates.items():
        log(f"{model}: compiling {key}")
        try:
            runners[key] = _runner(spec, cand["plan"], x, y, steps=args.steps, seed=args.seed)
            runners[key]["call"]()  # compile and warm up
        except PdjaxError as e:
            log(f"{model}: {key}: cannot run ({e})")
            runners.pop(key, None)
    times: dict[str, list[float]] = {k: [] for k in runners}
    for k in range(args.repeats):
        for key, r in runners.items():
            times[key].append(r["call"]())
        log(f"{model}: round {k + 1}/{args.repeats} done")
    rows = [
        _row(candidates[key], runners[key], times[key], choices=choices, prof=prof, B=B, host=host)
        for key in runners
    ]
    best_sps = max(row["measured_sps"] for row in rows)
    for row in rows:
        row["vs_best"] = row["measured_sps"] / best_sps
    return {
        "model": model,
        "devices": args.devices,
        "batch_size": B,
        "choices": choices,
        "unrestricted_choice": _key(free),
        "search_seconds": {"sim": search, "host": search_h},
        "host": dataclasses.asdict(host),
        "rows": rows,
    }


def _row(
    cand: dict[str, Any],
    runner: dict[str, Any],
    times: list[float],
    *,
    choices: dict[str, str],
    prof: Any,
    B: int,
    host: Any,
) -> dict[str, Any]:
    from pdjax.partition import auto_choice
    from pdjax.partition.choosing.auto import evaluate_candidate

    plan = cand["plan"]
    a = auto_choice(plan)
    predicted = {}
    for ranking, h in (("sim", None), ("host", host)):
        seconds, _ = evaluate_candidate(
            plan, prof, a["schedule"], extra_in_flight=a["extra_in_flight"], batch_size=B, host=h
        )
        predicted[ranking] = 1.0 / seconds
    sps = [runner["samples"] / t for t in times]
    return {
        "schedule": a["schedule"],
        "plan": _label(plan),
        "best_by": cand["best_by"],
        "chosen_by": [k for k, c in choices.items() if c == _key(plan)],
        "measured_sps": statistics.median(sps),
        "rounds_sps": sps,
        "predicted_sps": predicted["sim"],
        "host_predicted_sps": predicted["host"],
    }


def _model(name: str) -> Any:
    """A bundled model (tiny), or one of the cluster benchmark's (``mlp-512``, ``vgg-fc``)."""
    from benchmarks.harness.cluster import CLUSTER_MODELS
    from pdjax.models import get_model

    if name in CLUSTER_MODELS:
        family, overrides = CLUSTER_MODELS[name]
        return get_model(family, "tiny", **overrides)
    return get_model(name, "tiny")


def _label(plan: Any) -> str:
    from pdjax.partition import auto_choice

    a = auto_choice(plan)
    stages = "-".join(f"{s.first_layer}..{s.last_layer}x{s.replicas}" for s in plan.stages)
    extra = f" +{a['extra_in_flight']}" if a["extra_in_flight"] else ""
    return f"M={a['microbatches']}{extra} {stages}"


def markdown(results: list[dict[str, Any]]) -> str:
    lines = [
        "| model | schedule | its best plan by | plan | measured samples/s | vs measured best "
        "| predicted: simulator | predicted: with host costs |",
        "|---|---|---|---|---:|---:|---:|---:|",
    ]
    for res in results:
        for row in sorted(res["rows"], key=lambda r: -r["measured_sps"]):
            mark = "".join(f" **(plan_auto, {c})**" for c in row["chosen_by"])
            lines.append(
                f"| {res['model']} | {row['schedule']}{mark} | {', '.join(row['best_by'])} | "
                f"{row['plan']} | {row['measured_sps']:,.0f} | {row['vs_best']:.2f} | "
                f"{row['predicted_sps']:,.0f} | {row['host_predicted_sps']:,.0f} |"
            )
    return "\n".join(lines)


def verdicts(res: dict[str, Any]) -> list[str]:
    out = []
    for ranking in ("sim", "host"):
        row = next((r for r in res["rows"] if ranking in r["chosen_by"]), None)
        if row is None:
            out.append(f"{res['model']}: plan_auto ({ranking}) chose a plan that did not run")
            continue
        within = "within" if row["vs_best"] >= 0.95 else "NOT within"
        out.append(
            f"{res['model']}: plan_auto ({ranking}) chose {row['schedule']} {row['plan']}: "
            f"{row['vs_best']:.2f} of the measured best ({within} 5%)"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--models", default="mlp-512,vgg-fc")
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="samples per step (default: 4 of the cluster benchmark's microbatches: 512 for "
        "mlp-512, 128 for vgg-fc; 64 otherwise)",
    )
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stale", action="store_true", help="search pipedream and 2bw too")
    parser.add_argument(
        "--replicate",
        dest="straight",
        action="store_false",
        help="let the plans replicate stages (default: straight pipelines; with replication "
        "every schedule's best plan for these small models is one stage on every device)",
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    t0 = time.monotonic()

    def log(line: str) -> None:
        print(f"[{time.monotonic() - t0:5.0f} s] {line}", flush=True)

    from pdjax.apps.bench import driver_seconds_per_action

    spa = driver_seconds_per_action(jax.devices()[: args.devices])
    log(f"driver: {spa * 1e6:.0f} us per action")
    results = [measure_model(m, args, spa, log) for m in args.models.split(",")]
    print(markdown(results))
    for res in results:
        print("\n".join(verdicts(res)))
        print(
            f"{res['model']}: unrestricted (replication allowed): {res['unrestricted_choice']}; "
            f"host costs {res['host']}"
        )
    print(f"wall time {time.monotonic() - t0:.0f} s")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
