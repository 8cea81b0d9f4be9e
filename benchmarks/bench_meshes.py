"""The planner's mesh search on absent accelerators: Llama (paper and 7B shapes) on H100s.

For each model and cluster, profiled from XLA's cost analysis of abstract shapes (nothing
of the model's size is allocated) and priced by the ``h100`` roofline, this prints:

* the plan ``plan_auto(..., meshes=search_meshes(...))`` chooses (cuts, each stage's mesh,
  schedule, ``M``, memory policies), its simulated seconds per sample and peak bytes per
  device;
* the best plan with replicated stages only (``data`` meshes: pdjax before meshes), or
  how far the closest misses the cap;
* Megatron-style defaults: ``tensor 8`` within each node, one pipeline stage per node
  (``straight`` on the units), the rest (schedule, ``M``, memory policies) chosen by the
  same search;
* each searched unit's best plan.

Every figure is the simulator's, from one run of this script (the same profile and costs
for every row). Clusters: one node of 8 x 80 GB (NVLink, 450 GB/s per GPU) and two such
nodes (400 Gbit/s InfiniBand per GPU between them).

    python benchmarks/bench_meshes.py [--models paper,7b] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import jax

jax.config.update("jax_num_cpu_devices", 16)

from pdjax.errors import PlanError  # noqa: E402
from pdjax.models import get_model  # noqa: E402
from pdjax.partition import Topology, auto_choice, plan_auto  # noqa: E402
from pdjax.partition.choosing.meshes import describe_unit, search_meshes, unit_of  # noqa: E402
from pdjax.profile import get_device_model, profile  # noqa: E402

NVLINK, IB = 4.5e11, 5e10  # bytes/s per GPU
CAP = 80e9

CLUSTERS = {
    "1 node x 8 x 80 GB": Topology.from_levels([8], [NVLINK], memory_per_device=CAP),
    "2 nodes x 8 x 80 GB": Topology.from_levels([8, 2], [NVLINK, IB], memory_per_device=CAP),
}


def _layout(plan: Any) -> str:
    parts = []
    for st in plan.stages:
        mesh = st.mesh if st.mesh is not None else (("data", st.replicas),)
        text = " x ".join(f"{n} {s}" for n, s in mesh if s > 1) or "1 device"
        parts.append(f"{st.first_layer}-{st.last_layer}: {text}")
    return "; ".join(parts)


def _row(plan: Any) -> dict[str, Any]:
    a = auto_choice(plan)
    assert a is not None
    return {
        "layout": _layout(plan),
        "unit": describe_unit(unit_of(plan.stages[0])),
        "schedule": a["schedule"],
        "microbatches": a["microbatches"],
        "policies": a["policies"],
        "time_per_sample": a["time_per_sample"],
        "peak_memory": a["peak_memory"],
        "group_peak_memory": a["group_peak_memory"],
    }


def run(model: str, config: str, microbatch: int, batch: int) -> dict[str, Any]:
    spec = get_model(model, config)
    x = spec.sample_input(microbatch)
    t0 = time.perf_counter()
    prof = profile(spec.layers, x, measure=False, device_model=get_device_model("h100"))
    out: dict[str, Any] = {"model": f"{model} {config}", "microbatch": microbatch, "batch": batch}
    out["profile_seconds"] = time.perf_counter() - t0
    out["clusters"] = {}
    for name, topo in CLUSTERS.items():
        t0 = time.perf_counter()
        search = search_meshes(spec.layers, x, topo)
        compiled = time.perf_counter() - t0
        t0 = time.perf_counter()
        common = dict(batch_size=batch, memory_limit=CAP)
        best = plan_auto(prof, topo, meshes=search, **common)
        planned = time.perf_counter() - t0
        res: dict[str, Any] = {
            "compile_seconds": compiled,
            "plan_seconds": planned,
            "chosen": _row(best),
            "units": best.options["meshes"]["searched"],
        }
        try:
            res["replicated"] = _row(plan_auto(prof, topo, meshes=search.only(()), **common))
        except PlanError as e:
            res["replicated"] = {"none": str(e)}
        tensor = {"tensor": topo.levels[0].workers}
        try:
            megatron = plan_auto(prof, topo, meshes=search.only(tensor), straight=True, **common)
            res["megatron"] = _row(megatron)
        except PlanError as e:
            res["megatron"] = {"none": str(e)}
        out["clusters"][name] = res
    return out


def _gb(b: float) -> str:
    return f"{b / 1e9:.1f} GB"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


_WHO = {
    "chosen": "pdjax (--mesh auto)",
    "megatron": "Megatron-style: tensor 8 per node, a stage per node",
    "replicated": "replicated stages only",
}


def _remat(policies: list[str]) -> str:
    kinds = sorted(set(policies))
    return "/".join(kinds)


def report(results: list[dict[str, Any]]) -> str:
    lines = []
    for r in results:
        lines += [f"## {r['model']}: microbatch {r['microbatch']}, batch {r['batch']}", ""]
        lines.append(
            "| cluster | layout | by | schedule, M, remat | per sample | vs pdjax | peak |"
        )
        lines.append("|---|---|---|---|---|---|---|")
        for name, c in r["clusters"].items():
            base = c["chosen"]["time_per_sample"]
            for who, label in _WHO.items():
                row = c[who]
                if "none" in row:
                    lines.append(f"| {name} | none fits | {label} | {row['none'][:200]} | | | |")
                    continue
                spec = f"{row['schedule']}, {row['microbatches']}, {_remat(row['policies'])}"
                t = row["time_per_sample"]
                lines.append(
                    f"| {name} | {row['layout']} | {label} | {spec} | {_ms(t)} "
                    f"| {t / base:.2f}x | {_gb(row['peak_memory'])} |"
                )
        lines.append("")
        for name, c in r["clusters"].items():
            took = f"compiled in {c['compile_seconds']:.0f} s, planned in {c['plan_seconds']:.1f} s"
            lines += [f"{name} ({took}), each unit's best:", ""]
            lines += ["| unit | best plan | per sample | peak |", "|---|---|---|---|"]
            for u in c["units"]:
                if "none" in u:
                    lines.append(f"| {u['unit']} | none fits: {u['none'][:160]} | | |")
                    continue
                t, peak = _ms(u["time_per_sample"]), _gb(u["peak_memory"])
                lines.append(f"| {u['unit']} | {u['label']} | {t} | {peak} |")
            lines.append("")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="paper,7b", help="Llama configs, comma-separated")
    p.add_argument("--microbatch", type=int, default=2, help="sequences per profiled microbatch")
    p.add_argument("--batch", type=int, default=16, help="sequences per step")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    args = p.parse_args()
    results = [run("llama", c, args.microbatch, args.batch) for c in args.models.split(",")]
    print(report(results))
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
