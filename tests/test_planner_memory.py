"""The planner's ``pdjax`` memory terms against the simulator's ``runtime`` memory model
(what pdjax's runtime holds: the call's inputs placed up front, values in transit, the
step's gradient sum, the call's starting weights, zero bubble's cotangents): the plan's
memory per device is never below the simulated peak of its call, and within 10% of it
(where activations dominate behind slow links, only never below); and a memory cap
between the former estimate and that peak refuses the plan that would not fit.

``interleaved`` and ``zb-v`` are left out: their plans' stages are not what runs (the
simulator cuts each into chunks)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pdjax.errors import PlanError
from pdjax.partition import Topology, costs_from_plan, evaluate_partition, plan_pipedream
from pdjax.partition.pricing import cost
from pdjax.profile import LayerProfile, Profile
from pdjax.schedules import ROUND_ROBIN, STREAMING, generate
from pdjax.simulator import simulate

# the schedules plan_pipedream plans whose plan stages are the device groups that run
SCHEDULES = ["pipedream", "1f1b", "gpipe", "2bw", "zb-h1", "zb-h2"]


def _profile(L: int = 8, seed: int = 0, weights: int = 10**6, data: int = 0) -> Profile:
    """Weights of a few times ``weights`` bytes per layer, activations and residuals of a
    few hundred kB (for the profile's 8 samples), and ``data`` more bytes of the model's
    input: with the defaults every term of the memory model matters."""
    rng = np.random.default_rng(seed)
    return Profile.chain(
        [
            LayerProfile(
                f"l{i}",
                kind="Dense",
                forward_seconds=float(rng.uniform(1, 3)) * 1e-3,
                backward_seconds=float(rng.uniform(2, 6)) * 1e-3,
                param_bytes=int(rng.integers(2, 6)) * weights,
                input_bytes=int(rng.integers(1, 4)) * 10**5 + (data if i == 0 else 0),
                output_bytes=int(rng.integers(1, 4)) * 10**5,
                residual_bytes=int(rng.integers(1, 4)) * 10**5,
            )
            for i in range(L)
        ],
        batch_size=8,
    )


def _runtime_peak(plan, profile: Profile) -> tuple[float, ...]:
    """The simulator's ``runtime``-model peak bytes per device group of ``plan``'s call
    (``plan.options["microbatches_per_call"]`` microbatches): its costs with the inputs
    and targets placed up front at the first and last stage and zero bubble's cotangents
    (each stage's layer outputs, per replica), as ``benchmarks/bench_runtime.py`` fills
    them in."""
    scale = plan.microbatch_size / profile.batch_size
    first, last = profile.layers[0], profile.layers[-1]
    inputs = first.input_bytes * scale
    targets = min(last.output_bytes, first.input_bytes) * scale  # (the planner's guess)
    costs = costs_from_plan(plan, profile)
    P, M = plan.num_stages, plan.num_microbatches
    N = plan.options.get("microbatches_per_call", 2 * M)  # (the former plans: no call)
    stages = []
    for s, (st, spec) in enumerate(zip(costs.stages, plan.stages, strict=True)):
        placed = (inputs if s == 0 else 0.0) + (targets if s == P - 1 else 0.0)
        outputs = sum(profile.layers[i].output_bytes for i in spec.layers) * scale
        stages.append(
            dataclasses.replace(
                st, input_bytes=round(placed), cotangent_bytes=round(outputs / spec.replicas)
            )
        )
    runtime = dataclasses.replace(costs, stages=tuple(stages), memory_model="runtime")
    kwargs: dict = {"replicas": plan.replicas}
    if plan.schedule.kind in ROUND_ROBIN:
        kwargs["replication"] = plan.replication
    if plan.schedule.kind in STREAMING:
        schedule = generate(plan.schedule.kind, P, M, stream=N, **kwargs)
    else:
        assert N % M == 0
        schedule = generate(plan.schedule.kind, P, M, steps=N // M, **kwargs)
    return simulate(schedule, runtime).peak_memory


def _old_estimate(plan, profile: Profile) -> list[float]:
    """The planner's former ``pdjax`` figure: weights x (versions + optimizer state +
    accumulator + the update's transient new weights and state) + stash x the planner's
    in-flight count, nothing of the call."""
    arrays = cost.model_arrays(profile, plan.microbatch_size)
    k = plan.options["optimizer_state_factor"]
    # the accumulator (none under pipedream) and the update's new weights and state
    accumulator = 0.0 if cost.schedule_traits(plan.schedule.kind).update_per_microbatch else 1.0
    copies = accumulator + 1.0 + k
    out = []
    for st in plan.stages:
        sl = slice(st.first_layer, st.last_layer + 1)
        versions = cost.versions_kept(plan.schedule.kind, st.in_flight)
        w, stash = float(arrays.params[sl].sum()), float(arrays.stash[sl].sum())
        out.append(w * (versions + k + copies) + stash * st.in_flight / st.replicas)
    return out


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("devices", [2, 3, 4])
@pytest.mark.parametrize("bandwidth", [1e9, 3e7])  # links faster, and slower, than stages
def test_planned_memory_covers_the_runtime_peak_within_ten_percent(schedule, devices, bandwidth):
    profile = _profile()
    plan = plan_pipedream(profile, Topology.flat(devices, bandwidth), schedule=schedule)
    peak = _runtime_peak(plan, profile)
    assert len(peak) == plan.num_stages
    for planned, simulated in zip(plan.memory_per_device, peak, strict=True):
        assert planned >= simulated
        assert planned <= 1.10 * simulated


@pytest.mark.parametrize("schedule", ["pipedream", "1f1b", "gpipe", "2bw", "zb-h1"])
def test_activations_queued_behind_slow_links_are_charged(schedule):
    """Activations dominate and the links are slower than the stages: what a stage sends
    waits on its device until the link takes it, up to its in-flight count. The planner
    charges it (never below the runtime's peak; it may be well above it here)."""
    profile = _profile(weights=10**4)
    plan = plan_pipedream(profile, Topology.flat(4, 3e7), schedule=schedule, straight=True)
    peak = _runtime_peak(plan, profile)
    for planned, simulated in zip(plan.memory_per_device, peak, strict=True):
        assert planned >= simulated


@pytest.mark.parametrize(
    ("schedule", "stages", "replication"),
    [
        ("pipedream", [(0, 3, 2), (4, 7, 1)], "round-robin"),
        ("pipedream", [(0, 3, 2), (4, 7, 1)], "split"),
        ("1f1b", [(0, 2, 1), (3, 7, 2)], "split"),
        ("gpipe", [(0, 5, 2), (6, 7, 1)], "round-robin"),
        ("2bw", [(0, 3, 1), (4, 7, 2)], "round-robin"),
    ],
)
def test_replicated_stages_cover_the_runtime_peak(schedule, stages, replication):
    profile = _profile()
    plan = evaluate_partition(
        profile,
        Topology.flat(3, 1e9),
        stages,
        schedule=schedule,
        num_microbatches=4,
        replication=replication,
    )
    peak = _runtime_peak(plan, profile)
    for planned, simulated in zip(plan.memory_per_device, peak, strict=True):
        assert simulated <= planned <= 1.10 * simulated


@pytest.mark.parametrize("schedule", ["1f1b", "pipedream"])
def test_a_cap_below_the_runtime_peak_refuses_the_plan_that_would_not_fit(schedule):
    """A cap between the former estimate and the runtime's peak: the former terms admitted
    the unconstrained plan, which does not fit; the planner now refuses it. The model's
    input is large: a call places it up front, once per microbatch, on the first stage."""
    profile = _profile(weights=10**5, data=4 * 10**6)
    topology = Topology.flat(4, 1e9)
    free = plan_pipedream(profile, topology, schedule=schedule, straight=True)
    peak = max(_runtime_peak(free, profile))
    old = max(_old_estimate(free, profile))
    assert old < peak  # the former terms missed what the runtime holds
    cap = (old + peak) / 2
    # the input sits on the first stage whatever the partition: no plan fits
    with pytest.raises(PlanError, match="no configuration fits"):
        plan_pipedream(profile, topology, schedule=schedule, straight=True, memory_limit=cap)
    # a cap at the planner's own figure (at most 10% above the peak) admits the plan
    planned = max(free.memory_per_device)
    assert peak <= planned <= 1.10 * peak
    fits = plan_pipedream(profile, topology, schedule=schedule, straight=True, memory_limit=planned)
    assert fits.fits_memory and max(_runtime_peak(fits, profile)) <= planned


def test_the_call_length_is_what_the_inputs_cost():
    """Every microbatch of a call is placed up front: a longer call holds more inputs on
    the first stage (and targets on the last), not on the stages between."""
    profile = _profile()
    arrays = cost.model_arrays(profile)
    flat = [(0, 2, [0]), (3, 5, [1]), (6, 7, [2])]
    modes = ["split"] * 3

    from pdjax.partition.search.evaluate import stage_memory_bytes  # (new with the call's terms)

    def memory(calls: int) -> list[float]:
        return stage_memory_bytes(
            arrays,
            flat,
            modes,
            topology=Topology.flat(3, 1e9),
            cost_model="pdjax",
            schedule="1f1b",
            num_microbatches=4,
            optimizer_state_factor=2.0,
            microbatches_per_call=calls,
        )

    short, long = memory(8), memory(12)
    grown = [b - a for a, b in zip(short, long, strict=True)]
    assert grown == pytest.approx([4 * arrays.inputs, 0.0, 4 * arrays.targets])
    assert arrays.inputs == profile.layers[0].input_bytes
    assert arrays.targets == min(profile.layers[-1].output_bytes, arrays.inputs)


def test_plan_pipedream_prices_the_call_it_is_given():
    """``plan_pipedream(microbatches_per_call=N)``: the plan's memory holds the inputs of a
    call of ``N`` microbatches (recorded in its options), and a cap that the default call
    fits but the longer one does not refuses the longer call's plan."""
    profile, topo = _profile(), Topology.flat(3, 1e9)
    common = dict(schedule="1f1b", num_microbatches=4, straight=True)
    short = plan_pipedream(profile, topo, **common)
    long = plan_pipedream(profile, topo, microbatches_per_call=40, **common)
    assert short.options["microbatches_per_call"] == 8
    assert long.options["microbatches_per_call"] == 40
    inputs = cost.model_arrays(profile).inputs
    assert long.stages[0].memory_bytes == pytest.approx(short.stages[0].memory_bytes + 32 * inputs)
    cap = max(short.memory_per_device) * 1.0001
    assert max(long.memory_per_device) > cap  # the longer call's inputs do not fit
    with pytest.raises(PlanError):
        plan_pipedream(profile, topo.with_memory(cap), microbatches_per_call=40, **common)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_costs_from_plan_fill_in_what_the_runtime_model_counts(schedule):
    """``costs_from_plan`` places the call's inputs, targets and cotangents, so that the
    simulator's ``runtime`` model needs only to be switched on."""
    profile = _profile()
    plan = plan_pipedream(profile, Topology.flat(3, 1e9), schedule=schedule, straight=True)
    costs = dataclasses.replace(costs_from_plan(plan, profile), memory_model="runtime")
    M = plan.num_microbatches
    N = plan.options.get("microbatches_per_call", 2 * M)
    schedule_ = generate(schedule, plan.num_stages, M, steps=N // M)
    assert simulate(schedule_, costs).peak_memory == _runtime_peak(plan, profile)
