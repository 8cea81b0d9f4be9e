"""Part 2 of the time-to-accuracy benchmark: every schedule planned on PipeDream's published
profiles and clusters, simulated, against data parallelism on the same devices."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from pdjax.errors import PlanError
from pdjax.partition import Topology, costs_from_plan, evaluate_partition, plan_pipedream
from pdjax.profile import Profile
from pdjax.schedules import generate
from pdjax.simulator import simulate, stream_length

from .paper import PAPER_PLANS

SIM_MODELS = ("vgg16", "alexnet", "resnet50", "gnmt")
SIM_CLUSTERS = ("4x4-v100-10gbps", "2x8-v100-25gbps")
V100_BYTES = 16e9


@dataclasses.dataclass(frozen=True)
class SimVariant:
    """One row of a model/cluster: a schedule, planned (or the paper's hand-made plan)."""

    label: str
    schedule: str
    replication: str  # the planner's option ("auto", "split") or the hand-made plan's mode
    paper_plan: bool = False  # PipeDream's own 15-1, evaluated rather than planned


SIM_VARIANTS = (
    SimVariant("pipedream", "pipedream", "auto"),
    SimVariant("pipedream, split only", "pipedream", "split"),
    SimVariant("1f1b", "1f1b", "auto"),
    SimVariant("gpipe", "gpipe", "auto"),
    SimVariant("2bw", "2bw", "auto"),
    SimVariant("paper's plan, pipedream", "pipedream", "round-robin", paper_plan=True),
    SimVariant("paper's plan, 1f1b", "1f1b", "split", paper_plan=True),
)


@dataclasses.dataclass
class SimRow:
    model: str
    cluster: str
    label: str
    config: str
    planned: float  # the planner's (or evaluate_partition's) seconds per microbatch
    simulated: float  # the simulator's seconds per microbatch
    bubble: float
    speedup: float  # over the simulated data parallelism
    planner_speedup: float  # the plan's own speedup_over_data_parallel
    peak_memory: float  # bytes, the simulator's largest per device
    limited: str  # config and speedup when planned under 16 GB per device


def simulate_plan(name: str, plan: Any, prof: Profile) -> Any:
    P, M = plan.num_stages, plan.num_microbatches
    mode = plan.replication
    if name in ("pipedream", "2bw"):
        N = stream_length(name, P, M, replicas=plan.replicas, replication=mode)
        sched = generate(name, P, M, stream=N, replicas=plan.replicas, replication=mode)
    else:
        sched = generate(name, P, M, replicas=plan.replicas, replication=mode)
    return simulate(sched, costs_from_plan(plan, prof))


def data_parallel_seconds(prof: Profile, topo: Topology) -> float:
    """Seconds per microbatch (of the profile's batch) of data parallelism on all devices:
    each of the ``n`` devices runs one microbatch, then one all-reduce. As a plan: one stage
    replicated ``n`` ways whose microbatch is ``n`` profile batches, through the simulator."""
    n, L = topo.num_devices, len(prof.layers)
    plan = evaluate_partition(
        prof,
        topo,
        [(0, L - 1, n)],
        schedule="1f1b",
        num_microbatches=1,
        microbatch_size=n * prof.batch_size,
        partitioner="uniform",
    )
    sim = simulate(generate("1f1b", 1, 1, replicas=(n,)), costs_from_plan(plan, prof))
    return sim.makespan / n


def make_plan(variant: SimVariant, model: str, prof: Profile, topo: Topology, **kw: Any) -> Any:
    M = topo.num_devices
    if variant.paper_plan:
        return evaluate_partition(
            prof,
            topo,
            PAPER_PLANS[model],
            schedule=variant.schedule,
            num_microbatches=M,
            replication=variant.replication,
            partitioner="manual",
            **kw,
        )
    return plan_pipedream(
        prof,
        topo,
        schedule=variant.schedule,
        num_microbatches=M,
        replication=variant.replication,
        **kw,
    )


def _limited(variant: SimVariant, model: str, prof: Profile, topo: Topology, dp: float) -> str:
    """The plan made under 16 GB per device, and its simulated speedup."""
    if variant.paper_plan:
        return "-"
    try:
        small = make_plan(variant, model, prof, topo, memory_limit=V100_BYTES)
    except PlanError as e:
        return "no plan fits" if "fits" in str(e) else f"error: {e}"
    t = simulate_plan(variant.schedule, small, prof).time_per_microbatch
    return f"{small.config}: {dp / t:.2f}x"


def simulated_rows(log: Callable[[str], None]) -> tuple[list[SimRow], dict[tuple[str, str], float]]:
    rows, dp = [], {}
    for model in SIM_MODELS:
        prof = Profile.load(f"pipedream:{model}")
        for cluster in SIM_CLUSTERS:
            topo = Topology.preset(cluster)
            dp_time = data_parallel_seconds(prof, topo)
            dp[model, cluster] = dp_time
            for variant in SIM_VARIANTS:
                if variant.paper_plan and model not in PAPER_PLANS:
                    continue
                plan = make_plan(variant, model, prof, topo)
                sim = simulate_plan(variant.schedule, plan, prof)
                rows.append(
                    SimRow(
                        model=model,
                        cluster=cluster,
                        label=variant.label,
                        config=plan.config,
                        planned=plan.time_per_microbatch,
                        simulated=sim.time_per_microbatch,
                        bubble=sim.bubble_fraction,
                        speedup=dp_time / sim.time_per_microbatch,
                        planner_speedup=plan.speedup_over_data_parallel,
                        peak_memory=max(sim.peak_memory),
                        limited=_limited(variant, model, prof, topo, dp_time),
                    )
                )
            log(f"  simulated {model} on {cluster}")
    return rows, dp


def profile_batch(model: str) -> int:
    """The batch size behind a published profile (pdjax's reader infers it)."""
    return Profile.load(f"pipedream:{model}").batch_size


HEADLINE = ("vgg16", "4x4-v100-10gbps")


def flat_planning(model: str, cluster: str) -> dict[str, tuple[str, float]]:
    """Plans on a flat view of the cluster (all devices on one level at the slowest
    bandwidth, which lets a stage span servers), simulated on the real cluster: per
    schedule, the plan and its speedup over DP."""
    prof = Profile.load(f"pipedream:{model}")
    topo = Topology.preset(cluster)
    flat = Topology.flat(topo.num_devices, min(level.bandwidth for level in topo.levels))
    dp = data_parallel_seconds(prof, topo)
    out = {}
    for name in ("pipedream", "1f1b", "gpipe", "2bw"):
        plan = plan_pipedream(prof, flat, schedule=name, num_microbatches=topo.num_devices)
        stages = [(st.first_layer, st.last_layer, st.replicas) for st in plan.stages]
        real = evaluate_partition(
            prof,
            topo,
            stages,
            schedule=name,
            num_microbatches=topo.num_devices,
            replication=list(plan.replication),
        )
        out[name] = (real.config, dp / simulate_plan(name, real, prof).time_per_microbatch)
    # The hierarchical plan again, with one group more in flight per stage.
    plan = plan_pipedream(prof, topo, schedule="pipedream", num_microbatches=topo.num_devices)
    P, rep = plan.num_stages, plan.replication
    N = 2 * stream_length("pipedream", P, replicas=plan.replicas, replication=rep)
    sched = generate(
        "pipedream", P, 1, stream=N, replicas=plan.replicas, replication=rep, extra_in_flight=1
    )
    sim = simulate(sched, costs_from_plan(plan, prof))
    out["extra"] = (f"{max(sim.peak_memory) / 1e9:.1f} GB", dp / sim.time_per_microbatch)
    return out
