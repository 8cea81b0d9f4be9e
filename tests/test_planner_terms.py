"""The pdjax cost model's terms as the runtime and the simulator see them: full-duplex cuts,
per-message latency, the round-trip bound, exact memory, the data-parallel baseline once
per step, and calibration hooks."""

from __future__ import annotations

import itertools
import math

import pytest
from chains import chain_profile

from pdjax.errors import PlanError
from pdjax.partition import Topology, evaluate_partition, plan_pipedream
from pdjax.partition.pricing import cost
from pdjax.partition.search.pipedream import solve
from pdjax.profile import Profile


def _chain(times, params=None, outputs=None, batch_size=1) -> Profile:
    params = params or [0] * len(times)
    outputs = outputs or [0] * len(times)
    return chain_profile(times, params, outputs, batch_size)


def test_cut_is_one_transfer_each_way_plus_latency():
    # 3 straight stages of 1 s; cuts of 1e8 B at 1e9 B/s (0.1 s) + 0.05 s latency.
    profile = _chain([1.0, 1.0, 1.0], outputs=[10**8, 10**8, 0])
    topo = Topology.from_levels([3], [1e9], latencies=[0.05])
    plan = evaluate_partition(profile, topo, [(0, 0, 1), (1, 1, 1), (2, 2, 1)])
    cut = 1e8 / 1e9 + 0.05
    # Round trip of stage 0: 3 stages + 2 cuts both ways, over P - s = 3 in flight.
    assert plan.time_per_microbatch == pytest.approx(max(1.0, (3.0 + 4 * cut) / 3))
    assert cost.cut_time("pdjax", 1e8, 0.0, 1, bandwidth=1e9, latency=0.05) == pytest.approx(cut)
    # The published models keep 2 a / B and know no latency.
    assert cost.cut_time("paper", 1e8, 0.0, 1, bandwidth=1e9, latency=0.05) == pytest.approx(0.2)


def test_allreduce_latency_is_charged_per_ring_message():
    profile = _chain([0.4], params=[10**9])
    topo = Topology.from_levels([4], [1e10], latencies=[1e-3])
    plan = evaluate_partition(
        profile, topo, [(0, 0, 4)], schedule="1f1b", num_microbatches=2, replication="split"
    )
    ring = 2 * 3 / 4 * 1e9 / 1e10 + 2 * 3 * 1e-3
    assert plan.time_per_microbatch == pytest.approx(0.4 / 4 + ring / 2)
    # The planner's hierarchical program charges the same.
    best = plan_pipedream(profile, topo, schedule="1f1b", num_microbatches=2)
    assert best.time_per_microbatch == pytest.approx(plan.time_per_microbatch)


def _brute_period(profile, topo, schedule="pipedream", replication="split", M=None):
    """Every one-level partition, priced by evaluate_partition (round trip included)."""
    L, N = len(profile.layers), topo.num_devices
    best = math.inf
    for P in range(1, min(L, N) + 1):
        for cuts in itertools.combinations(range(1, L), P - 1):
            bounds = (0, *cuts, L)
            for reps in itertools.product(range(1, N + 1), repeat=P):
                if sum(reps) != N:
                    continue
                stages = [(bounds[i], bounds[i + 1] - 1, reps[i]) for i in range(P)]
                plan = evaluate_partition(
                    profile,
                    topo,
                    stages,
                    schedule=schedule,
                    replication=replication,
                    num_microbatches=M,
                )
                best = min(best, plan.time_per_microbatch)
    return best


@pytest.mark.parametrize("schedule", ["pipedream", "1f1b", "2bw", "zb-h1"])
def test_round_trip_decides_the_plan_on_a_slow_link(schedule):
    # Big activations on a slow link: the min-max program splits 1-1 (each stage 1 s, the
    # cut 0.8 s), but stage 0 holds 2 microbatches and their round trip is
    # (1 + 1 + 2 x 0.8) / 2 = 1.8 s; one stage on both devices (data parallelism, 1 s of
    # compute per device and a small all-reduce) is faster.
    profile = _chain([1.0, 1.0], params=[10**6, 10**6], outputs=[8 * 10**8, 0])
    topo = Topology.flat(2, 1e9)
    search, tables = solve(profile, topo, schedule=schedule)
    plain = search.flatten(search.tree(tables))
    assert [len(pos) for _, _, pos in plain] == [1, 1]
    plan = plan_pipedream(profile, topo, schedule=schedule, replication="split")
    assert plan.config == "2"
    assert plan.options["round_trip"] == "optimal"
    assert plan.time_per_microbatch == pytest.approx(_brute_period(profile, topo, schedule))
    one_one = evaluate_partition(profile, topo, [(0, 0, 1), (1, 1, 1)], schedule=schedule)
    assert one_one.time_per_microbatch == pytest.approx((2.0 + 2 * 0.8) / 2)
    assert plan.time_per_microbatch < one_one.time_per_microbatch


@pytest.mark.parametrize("seed", range(6))
def test_round_trip_search_equals_brute_force_on_three_devices(seed):
    import random

    rng = random.Random(seed)
    L = 4
    profile = _chain(
        [rng.uniform(0.1, 1.0) for _ in range(L)],
        params=[rng.choice([0, 10**7, 10**8]) for _ in range(L)],
        outputs=[rng.choice([10**6, 3 * 10**8, 10**9]) for _ in range(L)],
    )
    topo = Topology.from_levels([3], [1e9], latencies=[rng.choice([0.0, 0.01])])
    for schedule in ("pipedream", "1f1b"):
        plan = plan_pipedream(profile, topo, schedule=schedule, replication="split")
        expected = _brute_period(profile, topo, schedule)
        assert plan.time_per_microbatch == pytest.approx(expected, rel=1e-9)
        stages = [(s.first_layer, s.last_layer, s.replicas) for s in plan.stages]
        again = evaluate_partition(profile, topo, stages, schedule=schedule, replication="split")
        assert again.time_per_microbatch == pytest.approx(plan.time_per_microbatch, rel=1e-12)


def test_round_trip_is_exact_in_evaluate_partition_for_round_robin():
    profile = _chain([1.0, 1.0], outputs=[10**9, 0])
    topo = Topology.flat(3, 1e9)
    plan = evaluate_partition(profile, topo, [(0, 0, 2), (1, 1, 1)])  # auto: round-robin
    assert plan.replication == ("round-robin", "split")
    (c0, _), (c1, _) = cost.exact_in_flight("pipedream", [2, 1], plan.replication, 3)
    # A microbatch spends a whole group's action (2 x 0.5 s) at stage 0.
    trip = (2 * 0.5 + 1.0 + 2 * 1.0) / c0
    assert plan.time_per_microbatch == pytest.approx(max(1.0, trip))
    assert c1 == 1


def test_vgg16_4x4_under_16gb_is_verified_not_data_parallel():
    """The sound memory bound used to reject every pipeline here and return data
    parallelism; the optimistic bound, verified exactly, finds the unconstrained plan."""
    profile = Profile.load("pipedream:vgg16")
    topo = Topology.preset("4x4-v100-10gbps")
    free = plan_pipedream(profile, topo, schedule="2bw")
    assert max(free.memory_per_device) < 8e9
    limited = plan_pipedream(profile, topo, schedule="2bw", memory_limit=16e9)
    assert limited.options["memory_check"] == "verified"
    assert limited.fits_memory and limited.num_stages > 1
    assert limited.config == free.config
    assert limited.time_per_microbatch == pytest.approx(free.time_per_microbatch)
    # The sound bound alone still falls back to a single stage.
    search, tables = solve(profile, topo, schedule="2bw", memory_limit=16e9)
    assert len(search.flatten(search.tree(tables))) == 1


def test_memory_counts_the_gradient_sum_and_the_starting_weights():
    profile = _chain([1.0], params=[1000])
    topo = Topology.flat(1, 1e9)
    for schedule in ("pipedream", "1f1b", "gpipe", "2bw"):
        plan = plan_pipedream(profile, topo, schedule=schedule, optimizer_state_factor=2.0)
        versions = 2 if schedule == "2bw" else 1
        # versions + Adam state (2) + the gradient sum (the update donates it: the new
        # weights take its buffers) + the weights the call started from (the runtime's)
        assert plan.stages[0].memory_bytes == pytest.approx(1000 * (versions + 2 + 1 + 1))


def test_data_parallel_baseline_all_reduces_once_per_step_of_n():
    # A step of DP is one microbatch per device, then one all-reduce, for every schedule.
    profile = _chain([0.4], params=[10**9])
    topo = Topology.from_levels([2, 2], [1e10, 1e9], latencies=[1e-4, 1e-3])
    rings = (2 * 1 / 2 * 1e9 / 1e10 + 2 * 1e-4) + (2 * 1 / 2 * 1e9 / 1e9 + 2 * 1e-3)
    for schedule in ("pipedream", "1f1b", "gpipe", "2bw"):
        plan = evaluate_partition(profile, topo, [(0, 0, 1)], schedule=schedule)
        assert plan.data_parallel_time == pytest.approx((0.4 + rings) / 4), schedule


def test_calibration_hooks_replace_the_profile_and_are_recorded():
    profile = _chain([1.0, 1.0, 1.0], params=[10**8, 0, 0], outputs=[10**6, 10**6, 0])
    topo = Topology.flat(2, 1e9)
    calls = []

    def stage_seconds(first, last, replicas, replication):
        calls.append((first, last, replicas, replication))
        if first == 0:
            return (last + 1 + 4.0) / replicas  # layer 0 is really 5 s, not 1
        return None

    def allreduce_seconds(param_bytes, devices):
        count = devices if isinstance(devices, int) else len(devices)
        return 0.0 if count > 1 else None

    plan = plan_pipedream(
        profile,
        topo,
        replication="split",
        stage_seconds=stage_seconds,
        allreduce_seconds=allreduce_seconds,
    )
    assert plan.options["calibrated"] == ["stage_seconds", "allreduce_seconds"]
    # At most one call per range and replica count in the program.
    program_calls = [c for c in calls if isinstance(c[2], int)]
    assert len(program_calls) <= 2 * (3 * 4 // 2) + 4
    stages = [(s.first_layer, s.last_layer, s.replicas) for s in plan.stages]
    again = evaluate_partition(
        profile,
        topo,
        stages,
        replication="split",
        stage_seconds=stage_seconds,
        allreduce_seconds=allreduce_seconds,
    )
    assert again.time_per_microbatch == pytest.approx(plan.time_per_microbatch)
    assert again.options["calibrated"] == ["stage_seconds", "allreduce_seconds"]
    # Without the hooks layer 0 costs 1 s: a different optimum.
    plain = plan_pipedream(profile, topo, replication="split")
    assert plain.time_per_microbatch < plan.time_per_microbatch
    # Layer 0 measured at 5 s: the whole model on both devices with a free all-reduce is
    # (5 + 2) / 2 = 3.5 s; any split leaves layer 0's stage at >= 5 s on one device.
    assert plan.time_per_microbatch == pytest.approx(3.5)


def test_calibration_bad_input():
    profile = _chain([1.0, 1.0])
    topo = Topology.flat(2, 1e9)
    with pytest.raises(PlanError, match="stage_seconds must return"):
        plan_pipedream(profile, topo, stage_seconds=lambda *a: "fast")
    with pytest.raises(PlanError, match="finite seconds"):
        evaluate_partition(profile, topo, [(0, 1, 2)], allreduce_seconds=lambda *a: -1.0)
    with pytest.raises(PlanError, match="callable"):
        plan_pipedream(profile, topo, stage_seconds=3.0)
    with pytest.raises(PlanError, match="pdjax cost model only"):
        plan_pipedream(profile, topo, cost_model="paper", stage_seconds=lambda *a: None)
