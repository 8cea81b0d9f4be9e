"""The mesh search against the runtime on 8 in-process CPU devices: each unit's best plan
measured, side by side in one run.

For a model (Llama small, annotated; the MLP, without annotations: ``fsdp="auto"``), this
profiles it (measured), compiles its layers on every unit mesh 8 devices allow
(``search_meshes``), measures the host's costs (the driver's seconds per action and the
shared pool's concurrency: 8 CPU devices share this machine's cores), and asks
``plan_auto`` for the best plan of each unit alone (``search.only(unit)``, the flush
schedules ``gpipe``, ``1f1b``, ``zb-h1``). Each plan then trains a few steps with the
runtime (rounds interleaved, so the machine's noise falls on every plan alike), and the
script reports per plan the simulated and the measured seconds per sample, their ratio,
the Kendall tau between the two rankings, and where the planner's pick (the fastest
simulated) ranks measured, with its time against the measured best.

    python benchmarks/bench_mesh_ranking.py [--models llama,mlp] [--rounds 3] [--steps 2]
        [--collectives links|measured]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

jax.config.update("jax_num_cpu_devices", 8)

import optax  # noqa: E402

from pdjax.apps.bench_host import host_costs  # noqa: E402
from pdjax.calibrate.links import collective_level  # noqa: E402
from pdjax.errors import PlanError  # noqa: E402
from pdjax.layers.sharding import ShardingRules  # noqa: E402
from pdjax.models import get_model  # noqa: E402
from pdjax.partition import Topology, auto_choice, plan_auto  # noqa: E402
from pdjax.partition.choosing.meshes import (  # noqa: E402
    coarsen,
    describe_unit,
    search_meshes,
    sharded_costs,
    unit_of,
)
from pdjax.pipeline import Pipeline  # noqa: E402
from pdjax.pipeline.executor.interpreter import live_bytes_per_device  # noqa: E402
from pdjax.profile import profile  # noqa: E402
from pdjax.schedules import generate  # noqa: E402
from pdjax.simulator import simulate  # noqa: E402

CONFIGS = {"llama": "small", "mlp": "paper"}


def kendall_tau(a: list[float], b: list[float]) -> float:
    """Kendall's tau-a between two orderings of the same items."""
    pairs = list(itertools.combinations(range(len(a)), 2))
    score = sum(
        (1 if (a[i] - a[j]) * (b[i] - b[j]) > 0 else -1)
        for i, j in pairs
        if a[i] != a[j] and b[i] != b[j]
    )
    return score / len(pairs) if pairs else 1.0


def _memory(
    spec: Any, plan: Any, search: Any, prof: Any, rules: Any, x: Any, y: Any, batch: int
) -> tuple[list[int], list[float]]:
    """Per stage, the live bytes one of its devices held at its peak over one step (what
    lived there before the pipeline left out), and the simulator's ``runtime`` memory
    model's prediction for that step from the plan's unit profile (``sharded_costs``)."""
    pipe = Pipeline(spec.layers, plan, spec.loss, optax.adamw(1e-3), sharding=rules)
    M = plan.schedule.microbatches
    size = batch // M
    mbs = [jax.tree.map(lambda a, k=k: a[k * size : (k + 1) * size], (x, y)) for k in range(M)]
    state = pipe.init(jax.random.key(1), mbs[0][0])
    # every array on a buffer of its own (an array placed where it already was shares
    # its buffer, which the live-array list would count twice), then what lived on each
    # device besides this state left out of the run's peaks
    state = jax.tree.map(
        lambda a: (
            jnp.array(a, copy=True)
            if isinstance(a, jax.Array) and not jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key)
            else a
        ),
        state,
    )
    others = live_bytes_per_device()
    for device, used in live_bytes_per_device(jax.tree.leaves(state)).items():
        others[device] -= used
    _, metrics = pipe.run(state, mbs, timeline=True)
    assert metrics.peak_bytes is not None
    measured = [
        peak - others.get(pipe.stages[g].devices[0], 0) for g, peak in enumerate(metrics.peak_bytes)
    ]
    coarse, _ = coarsen(plan)
    costs = dataclasses.replace(sharded_costs(plan, prof, search), memory_model="runtime")
    spec_ = plan.schedule
    # no memory cap on CPU devices: the search chose no recomputation (checked)
    assert not spec_.remat or all(p == "none" for p in spec_.remat), spec_.remat
    sched = generate(spec_.kind, coarse.num_stages, M, steps=1, replicas=list(coarse.replicas))
    predicted = list(simulate(sched, costs).peak_memory)
    del state, metrics
    return measured, predicted


def run(model: str, batch: int, rounds: int, steps: int, collectives: str) -> dict[str, Any]:
    spec = get_model(model, CONFIGS[model])
    devices = jax.devices()[:8]
    topo = Topology.from_devices(devices)
    mb = batch // 8
    x, y = spec.sample_batch(batch, jax.random.key(0))
    prof = profile(spec.layers, x[:mb], measure=True, device=devices[0])
    # the collectives inside a stage: priced on the topology's link, or on a level
    # measured from a chain of all-reduces in one program (memory copies on shared cores)
    level = collective_level(devices) if collectives == "measured" else topo.levels[0]
    links = [level] if collectives == "measured" else None
    search = search_meshes(spec.layers, x[:mb], topo, devices=devices, collectives=links)
    host = host_costs(spec, (x[:mb], y[:mb]), devices)
    rules = ShardingRules(fsdp=search.fsdp)
    plans: dict[str, Any] = {}
    for unit in search.units():
        try:
            plan = plan_auto(
                prof,
                topo,
                batch_size=batch,
                schedules=["gpipe", "1f1b", "zb-h1"],
                host=host,
                meshes=search.only(unit),
            )
        except PlanError as e:
            print(f"  {describe_unit(unit)}: no plan ({e})")
            continue
        plans[describe_unit(unit_of(plan.stages[0]))] = plan
    memory = {
        name: _memory(spec, plan, search, prof, rules, x, y, batch) for name, plan in plans.items()
    }
    runners: dict[str, Any] = {}
    states: dict[str, Any] = {}
    batches: dict[str, Any] = {}
    for name, plan in plans.items():
        pipe = Pipeline(spec.layers, plan, spec.loss, optax.adamw(1e-3), sharding=rules)
        M = plan.schedule.microbatches
        size = batch // M
        batches[name] = [
            jax.tree.map(lambda a, k=k, s=size: a[k * s : (k + 1) * s], (x, y)) for k in range(M)
        ]
        runners[name] = pipe
        states[name] = pipe.init(jax.random.key(1), batches[name][0][0])
        states[name], m = pipe.run(states[name], batches[name])  # compiles
        jax.block_until_ready(m.losses)
    seconds: dict[str, list[float]] = {name: [] for name in plans}
    for _ in range(rounds):
        for name, pipe in runners.items():
            t0 = time.perf_counter()
            for _ in range(steps):
                states[name], m = pipe.run(states[name], batches[name])
            jax.block_until_ready(m.losses)
            seconds[name].append((time.perf_counter() - t0) / (steps * batch))
    rows = []
    for name, plan in plans.items():
        a = auto_choice(plan)
        assert a is not None
        measured = statistics.median(seconds[name])
        rows.append(
            {
                "unit": name,
                "plan": plan.config,
                "schedule": f"{a['schedule']} M={a['microbatches']}",
                "simulated": a["time_per_sample"],
                "measured": measured,
                "ratio": measured / a["time_per_sample"],
                "memory_measured": memory[name][0],
                "memory_predicted": memory[name][1],
                "memory_ratio": [m / p for m, p in zip(*memory[name], strict=True)],
            }
        )
    sim = [r["simulated"] for r in rows]
    meas = [r["measured"] for r in rows]
    pick = min(range(len(rows)), key=lambda k: sim[k])
    best = min(meas)
    return {
        "model": f"{model} {CONFIGS[model]}",
        "batch": batch,
        "rows": rows,
        "kendall_tau": kendall_tau(sim, meas),
        "collectives": collectives,
        "collective_level": {"bandwidth": level.bandwidth, "latency": level.latency},
        "pick": rows[pick]["unit"],
        "pick_vs_measured_best": meas[pick] / best,
        "within_15_percent": sum(1 for r in rows if abs(r["ratio"] - 1) <= 0.15),
        "memory_within_10_percent": sum(
            1 for r in rows if all(abs(q - 1) <= 0.10 for q in r["memory_ratio"])
        ),
    }


def report(results: list[dict[str, Any]]) -> str:
    lines = []
    for r in results:
        lines += [f"### {r['model']}, batch {r['batch']}, 8 CPU devices", ""]
        lines += [
            "| unit | plan | schedule | simulated | measured | measured / simulated "
            "| peak bytes measured / predicted, per stage |"
        ]
        lines += ["|---|---|---|---|---|---|---|"]
        for row in r["rows"]:
            mem = " / ".join(f"{q:.2f}" for q in row["memory_ratio"])
            lines.append(
                f"| {row['unit']} | {row['plan']} | {row['schedule']} "
                f"| {row['simulated'] * 1e6:.1f} us | {row['measured'] * 1e6:.1f} us "
                f"| {row['ratio']:.2f} | {mem} |"
            )
        lines += [
            "",
            f"Kendall tau {r['kendall_tau']:.2f}; the planner's pick ({r['pick']}) measured "
            f"{r['pick_vs_measured_best']:.2f}x the measured best; "
            f"{r['within_15_percent']} of {len(r['rows'])} plans within 15% of simulated; "
            f"memory within 10% on every stage of {r['memory_within_10_percent']} of "
            f"{len(r['rows'])}. "
            f"Collectives priced ({r['collectives']}) at "
            f"{r['collective_level']['bandwidth']:.3g} B/s and "
            f"{r['collective_level']['latency'] * 1e6:.1f} us per message.",
            "",
        ]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="llama,mlp")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument(
        "--collectives",
        choices=("links", "measured"),
        default="links",
        help="price a stage's collectives on the topology's link (the default), or on a "
        "level measured from all-reduces inside one program (collective_level)",
    )
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    results = [
        run(m, args.batch, args.rounds, args.steps, args.collectives)
        for m in args.models.split(",")
    ]
    print(report(results))
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
