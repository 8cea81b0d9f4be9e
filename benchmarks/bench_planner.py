"""Planner time: PipeDream's dynamic program on random layer chains, two-level topologies.

Run as ``python benchmarks/bench_planner.py`` (``--quick`` skips the 1000-layer rows). Prints
one row per (layers, topology, cost model): the wall time of ``plan_pipedream`` and the
configuration it picks. The goal is under 5 s for 200 layers on 64 workers, with meshes
too (``--meshes-only``: the dynamic program once per unit mesh, as ``plan_auto`` searches
them).

It also prints the VGG-16 configurations of PipeDream's published profile under each cost
model, on 4, 8 and 16 workers at 10 Gbit/s and on the SOSP'19 paper's 16-GPU clusters.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np
from rich.console import Console
from rich.table import Table

from pdjax.mesh import mesh_size
from pdjax.partition import Topology, evaluate_partition, plan_pipedream
from pdjax.partition.choosing.meshes import (
    MeshSearch,
    coarse_topology,
    describe_unit,
    unit_meshes,
    unit_profile,
)
from pdjax.profile import LayerProfile, Profile
from pdjax.profile.sharded import Collective, ShardedCost


def random_chain(num_layers: int, seed: int = 0) -> Profile:
    """A chain with VGG-like spreads: times 0.1-50 ms, params 0-400 MB, activations 1-400 MB."""
    rng = np.random.default_rng(seed)
    layers = []
    for i in range(num_layers):
        fwd = float(rng.uniform(1e-4, 2e-2))
        layers.append(
            LayerProfile(
                name=f"layer{i}",
                forward_seconds=fwd,
                backward_seconds=2 * fwd,
                param_bytes=int(rng.choice([0, 1e5, 1e7, 4e8], p=[0.4, 0.3, 0.25, 0.05])),
                output_bytes=int(rng.uniform(1e6, 4e8)),
                input_bytes=int(rng.uniform(1e6, 4e8)),
            )
        )
    return Profile.chain(layers, batch_size=32)


def bench(console: Console, sizes: list[int]) -> None:
    topologies = {
        "16 = 4x4": Topology.from_levels([4, 4], [1e10, 1.25e9]),
        "64 = 8x8": Topology.from_levels([8, 8], [1e11, 3.125e9]),
        "64 = 4x16": Topology.from_levels([4, 16], [1e10, 1.25e9]),
    }
    table = Table(title="plan_pipedream wall time (random chains, two levels)")
    for col in ("layers", "workers", "cost model", "seconds", "config"):
        table.add_column(col, justify="right" if col in ("layers", "seconds") else "left")
    for n in sizes:
        profile = random_chain(n)
        for label, topo in topologies.items():
            for model in ("pdjax", "pipedream-code"):
                if n >= 1000 and model != "pdjax":
                    continue
                t0 = time.perf_counter()
                plan = plan_pipedream(profile, topo, cost_model=model)
                dt = time.perf_counter() - t0
                config = plan.config if len(plan.config) <= 40 else plan.config[:37] + "..."
                table.add_row(str(n), label, model, f"{dt:.2f}", config)
                console.print(f"  {n} layers, {label}, {model}: {dt:.2f} s", highlight=False)
    console.print(table)


def vgg(console: Console) -> None:
    profile = Profile.load("pipedream:vgg16")  # PipeDream's published profile, shipped
    topologies = {
        "4 x 10 Gbit/s": Topology.flat(4, 1.25e9),
        "8 x 10 Gbit/s": Topology.flat(8, 1.25e9),
        "16 x 10 Gbit/s (flat)": Topology.flat(16, 1.25e9),
        "Cluster-A 4x4 (10 GB/s, 10 Gbit/s)": Topology.preset("cluster-a"),
        "Cluster-B 2x8 (100 GB/s, 25 Gbit/s)": Topology.preset("cluster-b"),
    }
    table = Table(title="VGG-16 (PipeDream's graph.txt, batch 128): configuration per cost model")
    table.add_column("topology")
    for model in ("pipedream-code", "paper", "pdjax"):
        table.add_column(model)
    table.add_column("15-1 under paper / pdjax")
    for label, topo in topologies.items():
        row = [label]
        for model in ("pipedream-code", "paper", "pdjax"):
            plan = plan_pipedream(profile, topo, cost_model=model)
            first = plan.stages[0]
            row.append(
                f"{plan.config} (stage 0 = 0-{first.last_layer}), "
                f"{plan.time_per_microbatch * 1e3:.1f} ms"
            )
        if topo.num_devices == 16:
            ref = [
                evaluate_partition(profile, topo, [(0, 24, 15), (25, 40, 1)], cost_model=m)
                for m in ("paper", "pdjax")
            ]
            row.append(" / ".join(f"{p.time_per_microbatch * 1e3:.1f} ms" for p in ref))
        else:
            row.append("")
        table.add_row(*row)
    console.print(table)


def megatron_costs(profile: Profile, unit: tuple[tuple[str, int], ...]) -> tuple[ShardedCost, ...]:
    """What XLA would report for a Megatron-style layer on ``unit``, without compiling
    (the planner's time is measured here, not the costs'; ``tests/test_mesh_search.py``
    prices with them too): the profile's FLOPs and weights split over every axis, the
    weights gathered over fsdp and their gradients reduce-scattered, the activations
    all-reduced over tensor."""
    f, t = dict(unit).get("fsdp", 1), dict(unit).get("tensor", 1)
    out = []
    for i, lp in enumerate(profile.layers):
        fwd, bwd = [], []
        if f > 1:
            fwd.append(Collective("all-gather", lp.param_bytes // t, ("fsdp",)))
            bwd.append(Collective("reduce-scatter", lp.param_bytes // (f * t), ("fsdp",)))
        if t > 1:
            fwd.append(Collective("all-reduce", lp.output_bytes // f, ("tensor",)))
            bwd.append(Collective("all-reduce", lp.input_bytes // f, ("tensor",)))
        out.append(
            ShardedCost(
                index=i,
                name=lp.name,
                mesh=unit,
                forward_flops=(lp.forward_flops or 0.0) / (f * t),
                backward_flops=(lp.backward_flops or 0.0) / (f * t),
                forward_bytes=0.0,
                backward_bytes=0.0,
                temp_bytes=0,
                param_bytes=lp.param_bytes // (f * t),
                replicated_param_bytes=0,
                forward_collectives=tuple(fwd),
                backward_collectives=tuple(bwd),
            )
        )
    return tuple(out)


def meshes(console: Console, sizes: list[int]) -> None:
    """The dynamic program with meshes: once per unit the topology allows (every
    fsdp x tensor tiling it, tensor within a server), on the topology of units with the
    unit's per-device profile, as ``plan_auto(meshes=...)`` searches; the fastest wins."""
    topo = Topology.from_levels([8, 8], [1e11, 3.125e9])
    units = unit_meshes(topo, annotated=True)
    table = Table(title=f"the dynamic program over meshes, 64 = 8x8 ({len(units) + 1} units)")
    for col in ("layers", "seconds (all units)", "replicated alone", "best unit", "config"):
        table.add_column(col)
    for n in sizes:
        profile = dataclasses.replace(
            random_chain(n),
            layers=tuple(dataclasses.replace(lp, forward_flops=1.0, backward_flops=2.0)
                         for lp in random_chain(n).layers),
        )  # fmt: skip
        search = MeshSearch({u: megatron_costs(profile, u) for u in units}, annotated=True)
        t0 = time.perf_counter()
        plain = plan_pipedream(profile, topo)
        alone = time.perf_counter() - t0
        best = (plain.time_per_microbatch, "replicated", plain.config)
        for unit in units:
            coarse = coarse_topology(topo, mesh_size(unit))
            assert coarse is not None
            mine = unit_profile(profile, search.costs[unit], topo, unit)
            plan = plan_pipedream(mine, coarse, replication="split")  # a mesh: split only
            best = min(best, (plan.time_per_microbatch, describe_unit(unit), plan.config))
        dt = time.perf_counter() - t0
        table.add_row(str(n), f"{dt:.2f}", f"{alone:.2f}", best[1], best[2][:40])
        console.print(f"  {n} layers with meshes: {dt:.2f} s", highlight=False)
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="skip the 1000-layer rows")
    parser.add_argument("--meshes-only", action="store_true", help="only the mesh rows")
    args = parser.parse_args()
    console = Console()
    if not args.meshes_only:
        vgg(console)
        bench(console, [50, 200] if args.quick else [50, 200, 1000])
    meshes(console, [50, 200])


if __name__ == "__main__":
    main()
