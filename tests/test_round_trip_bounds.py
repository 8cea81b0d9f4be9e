"""The planner's round-trip search per schedule: each kind's in-flight counts come from the
schedule (``cost.exact_in_flight``, as the plan's exact period takes them), and on one
level the plan of least period, round trip included, equals brute force over every stage
cut and replica count priced by ``evaluate_partition`` (the same cost model), for every
schedule the planner plans.
"""

from __future__ import annotations

import math
import random

import pytest
from chains import chain_profile
from test_planner import partitions

from pdjax.errors import PlanError
from pdjax.partition import Topology, evaluate_partition, plan_pipedream
from pdjax.partition.pricing import cost
from pdjax.partition.search.pipedream import solve
from pdjax.partition.search.round_trip import (
    Prober,
    round_trip_exact,
    round_trip_passes,
    split_counts,
)
from pdjax.profile import Profile

SCHEDULES = ("pipedream", "2bw", "1f1b", "zb-h1", "zb-h2", "zb-v", "gpipe", "interleaved")


def _chain(times, params, outputs) -> Profile:
    return chain_profile(times, params, outputs)


def _random_case(seed: int) -> tuple[Profile, Topology]:
    """4-5 layers on 2-4 devices: compute, all-reduce and transfers of comparable size."""
    rng = random.Random(seed)
    L, N = rng.choice([4, 5]), rng.choice([2, 3, 4])
    profile = _chain(
        [rng.uniform(0.1, 1.0) for _ in range(L)],
        [rng.choice([0, 10**7, 10**8, 10**9]) for _ in range(L)],
        [rng.choice([10**6, 3 * 10**8, 10**9]) for _ in range(L - 1)] + [0],
    )
    return profile, Topology.from_levels([N], [1e9], latencies=[rng.choice([0.0, 0.01])])


def _brute(profile, topo, schedule, M, *, straight=False, fewer=False) -> float:
    """The least period over every partition (tests/test_planner.py's ``partitions``: every
    stage cut and replica count), priced by evaluate_partition with split stages."""
    best = math.inf
    L, N = len(profile.layers), topo.num_devices
    for stages in partitions(0, L - 1, N, straight, fewer):
        try:
            plan = evaluate_partition(
                profile, topo, stages, schedule=schedule, replication="split", num_microbatches=M
            )
        except PlanError:  # 2bw: more stages than microbatches per step
            continue
        best = min(best, plan.time_per_microbatch)
    return best


def _counts(schedule: str, M: int, most: int) -> list[list[int]]:
    return [
        [c for c, _ in cost.exact_in_flight(schedule, [1] * P, ("split",) * P, M)]
        for P in range(1, most + 1)
    ]


def test_each_kind_takes_its_counts_from_the_schedule():
    inf = math.inf
    # P - s: additive, as before (pipedream, 2bw; 1f1b and zb-h1 while M >= P)
    for schedule, M in (("pipedream", 1), ("2bw", 8), ("1f1b", 8), ("zb-h1", 8)):
        ((bound,),) = [round_trip_passes(_counts(schedule, M, 8))]
        assert (bound.per_stage, bound.keys, bound.suffix, bound.final) == (1.0, 1, (0.0,), (inf,))
    # min(P - s, M), M below the stages: every suffix's count, keyed up to M stages
    (bound,) = round_trip_passes(_counts("1f1b", 3, 8))
    assert (bound.keys, bound.suffix) == (3, (1.0, 2.0, 3.0))
    # zb-h2: 2P - 1 at every stage, only the whole pipeline's round trip binds
    (bound,) = round_trip_passes(_counts("zb-h2", 15, 8))
    assert (bound.per_stage, bound.keys, bound.suffix, bound.final) == (2.0, 1, (inf,), (-1.0,))
    (bound,) = round_trip_passes(_counts("zb-h2", 6, 8))  # min(2P - 1, 6)
    assert (bound.keys, bound.final) == (4, (1.0, 3.0, 5.0, 6.0))
    # zb-v: P at every stage
    (bound,) = round_trip_passes(_counts("zb-v", 8, 8))
    assert (bound.per_stage, bound.keys, bound.suffix, bound.final) == (1.0, 1, (inf,), (0.0,))
    # the general form: one pass per pipeline length, the last key alone a whole pipeline
    passes = round_trip_passes(_counts("1f1b", 3, 4), general=True)
    assert [b.keys for b in passes] == [1, 2, 3, 4]
    assert passes[3].suffix == (1.0, 2.0, 3.0, 3.0) and passes[3].final[-1] == inf


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("seed", range(4))
def test_plan_equals_brute_force(schedule, seed):
    profile, topo = _random_case(seed)
    Ms = (None, 8) if schedule == "2bw" else (None, 2, 3, 8)
    for M in Ms:
        plan = plan_pipedream(
            profile, topo, schedule=schedule, replication="split", num_microbatches=M
        )
        expected = _brute(profile, topo, schedule, M)
        assert plan.time_per_microbatch == pytest.approx(expected, rel=1e-9), (M, plan.config)
        if cost.has_round_trip(schedule) and "round_trip" in plan.options:
            assert plan.options["round_trip"] == "optimal"


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h2", "zb-v", "pipedream"])
@pytest.mark.parametrize("straight,fewer", [(True, True), (False, True), (True, False)])
def test_options_equal_brute_force(schedule, straight, fewer):
    for seed in range(3):
        profile, topo = _random_case(10 + seed)
        if straight and not fewer and topo.num_devices > len(profile.layers):
            continue
        for M in (2, 8):
            plan = plan_pipedream(
                profile,
                topo,
                schedule=schedule,
                replication="split",
                num_microbatches=M,
                straight=straight,
                fewer_machines=fewer,
            )
            expected = _brute(profile, topo, schedule, M, straight=straight, fewer=fewer)
            assert plan.time_per_microbatch == pytest.approx(expected, rel=1e-9), (seed, M)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h2", "zb-v", "2bw"])
@pytest.mark.parametrize("seed", range(3))
def test_the_general_pass_decides_as_the_simple_forms(schedule, seed):
    # One pass per pipeline length (the form a count of no simpler shape gets) and the
    # schedule's own form: at the optimum both find a plan of that period, just below it
    # neither finds any.
    profile, topo = _random_case(20 + seed)
    M = 3 if schedule != "2bw" else topo.num_devices
    expected = _brute(profile, topo, schedule, M)
    search, _ = solve(profile, topo, schedule=schedule, num_microbatches=M)
    assert round_trip_exact(search)
    for general in (False, True):
        prober = Prober.of(search, general=general)
        found = prober.probe(expected * (1 + 1e-9))
        assert found is not None
        priced = evaluate_partition(
            profile, topo, found, schedule=schedule, replication="split", num_microbatches=M
        )
        assert priced.time_per_microbatch <= expected * (1 + 1e-9)
        assert prober.probe(expected * (1 - 1e-6)) is None


def test_zb_h2_runs_a_plan_the_p_minus_s_bound_pruned():
    # Three stages of 2, 3 and 3 s, cuts of 1 and 2 s: the slowest term is 3 s, and with
    # zb-h2's 2P - 1 = 5 in flight at every stage the round trip (2 + 3 + 3 + 2 (1 + 2)) / 5
    # = 2.8 s is below it: 1-1-1 runs at 3 s. With P - s in flight (the old probe) its
    # stage 1 takes (3 + 3 + 2 x 2) / 2 = 5 s, so the search settled for 2-1 at 3.17 s.
    profile = _chain([2, 3, 3], [0, 0, 4 * 10**9], [10**9, 2 * 10**9, 0])
    topo = Topology.flat(3, 1e9)
    plan = plan_pipedream(profile, topo, schedule="zb-h2", num_microbatches=8)
    assert plan.config == "1-1-1" and plan.options["round_trip"] == "optimal"
    assert plan.time_per_microbatch == pytest.approx(3.0)
    assert plan.time_per_microbatch == pytest.approx(_brute(profile, topo, "zb-h2", 8))
    assert split_counts(solve(profile, topo, schedule="zb-h2", num_microbatches=8)[0])[2] == [5] * 3
    old = evaluate_partition(
        profile, topo, [(0, 1, 2), (2, 2, 1)], schedule="zb-h2", num_microbatches=8
    )
    assert old.time_per_microbatch == pytest.approx(3 + 1 / 6)
    # under 1f1b the same plan's round trip is the old bound's: 5 s, and 1-1-1 is not chosen
    f1b = evaluate_partition(profile, topo, [(0, 0, 1), (1, 1, 1), (2, 2, 1)], schedule="1f1b")
    assert f1b.time_per_microbatch == pytest.approx(5.0)


@pytest.mark.parametrize("seed", range(3))
def test_round_robin_stays_a_documented_relaxation(seed):
    # pipedream with round-robin stages: the probe takes n_s + ... + n_{P-1} for q_s n_s,
    # so its plan is evaluated exactly and never beats the brute-force optimum.
    profile, topo = _random_case(30 + seed)
    plan = plan_pipedream(profile, topo, schedule="pipedream", replication="round-robin")
    if "round_trip" in plan.options:
        assert plan.options["round_trip"] == "relaxed"
    best = math.inf
    L, N = len(profile.layers), topo.num_devices
    for stages in partitions(0, L - 1, N, False, False):
        priced = evaluate_partition(profile, topo, stages, replication="round-robin")
        best = min(best, priced.time_per_microbatch)
    assert plan.time_per_microbatch >= best * (1 - 1e-9)
