"""Uniform, balanced-by-time and balanced-by-parameters partitioners, and evaluation."""

from __future__ import annotations

import itertools

import pytest
from chains import chain_profile
from hypothesis import given, settings
from hypothesis import strategies as st

from pdjax.errors import PlanError
from pdjax.partition import (
    Topology,
    balanced_split,
    evaluate_partition,
    plan_balanced_params,
    plan_balanced_time,
    plan_pipedream,
    plan_uniform,
    uniform_split,
)
from pdjax.profile import Profile


def _profile(times, params=None, outputs=None) -> Profile:
    params = params or [0] * len(times)
    outputs = outputs or [1000] * len(times)
    return chain_profile(times, params, outputs, batch_size=8)


def test_uniform_split():
    assert uniform_split(8, 4) == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert uniform_split(5, 2) == ((0, 2), (3, 4))
    assert uniform_split(3, 3) == ((0, 0), (1, 1), (2, 2))
    with pytest.raises(PlanError, match="4 stages requested but the profile has only 3"):
        uniform_split(3, 4)
    with pytest.raises(PlanError, match="at least 1"):
        uniform_split(3, 0)


def _all_splits(n, p):
    for cuts in itertools.combinations(range(1, n), p - 1):
        bounds = (0, *cuts, n)
        yield tuple((bounds[i], bounds[i + 1] - 1) for i in range(p))


@given(
    weights=st.lists(st.integers(0, 20) | st.floats(0, 5), min_size=1, max_size=8),
    data=st.data(),
)
@settings(max_examples=150, deadline=None)
def test_balanced_split_is_the_min_max_split(weights, data):
    p = data.draw(st.integers(1, len(weights)))
    got = balanced_split(weights, p)
    assert len(got) == p and got[0][0] == 0 and got[-1][1] == len(weights) - 1
    assert all(a <= b for a, b in got)
    assert all(got[i][1] + 1 == got[i + 1][0] for i in range(p - 1))

    def worst(split):
        return max(sum(weights[a : b + 1]) for a, b in split)

    best = min(worst(s) for s in _all_splits(len(weights), p))
    assert worst(got) == pytest.approx(best, rel=1e-12, abs=1e-12)


def test_partitioners_make_straight_plans():
    profile = _profile([1, 1, 1, 1, 5, 1], params=[0, 0, 0, 0, 10**6, 10**8])
    topo = Topology.flat(2, 1e9)
    uni = plan_uniform(profile, topo)
    assert [(s.first_layer, s.last_layer) for s in uni.stages] == [(0, 2), (3, 5)]
    assert uni.partitioner == "uniform" and uni.config == "1-1"
    bal = plan_balanced_time(profile, topo)
    assert [(s.first_layer, s.last_layer) for s in bal.stages] == [(0, 3), (4, 5)]
    par = plan_balanced_params(profile, topo)
    assert [(s.first_layer, s.last_layer) for s in par.stages] == [(0, 4), (5, 5)]
    assert par.partitioner == "balanced-params"
    replicated = plan_uniform(profile, Topology.flat(4, 1e9), replicas=2)
    assert replicated.config == "2rr-2rr"  # pipedream: round-robin where cheaper ("auto")
    split = plan_uniform(profile, Topology.flat(4, 1e9), replicas=2, replication="split")
    assert split.config == "2-2"
    assert replicated.stages[1].devices == (2, 3)
    three = plan_balanced_time(profile, Topology.flat(4, 1e9), 3, schedule="1f1b")
    assert three.num_stages == 3 and three.num_devices == 3 and three.schedule.kind == "1f1b"


def test_partitioners_bad_input():
    profile = _profile([1, 1, 1])
    with pytest.raises(PlanError, match="4 stages requested but the profile has only 3"):
        plan_uniform(profile, Topology.flat(8, 1e9), 4)
    with pytest.raises(PlanError, match=r"3 stages x 2 replicas need 6 devices"):
        plan_balanced_time(profile, Topology.flat(4, 1e9), 3, replicas=2)
    with pytest.raises(PlanError, match="replicas must be at least 1"):
        plan_uniform(profile, Topology.flat(4, 1e9), replicas=0)
    with pytest.raises(PlanError, match="5 replicas per stage"):
        plan_uniform(profile, Topology.flat(4, 1e9), replicas=5)


def test_evaluate_partition_terms():
    # Stage times 0.3 and 0.6 s; the cut carries 1e8 bytes at 1e9 B/s both ways: 0.2 s.
    profile = _profile([0.1, 0.2, 0.6], params=[0, 10**8, 0], outputs=[0, 10**8, 0])
    topo = Topology.flat(3, 1e9)
    plan = evaluate_partition(profile, topo, [(0, 1, 2), (2, 2, 1)], schedule="pipedream")
    allreduce = 2 * (2 - 1) / 2 * 1e8 / 1e9
    assert plan.time_per_microbatch == pytest.approx(max(0.3 / 2 + allreduce, 0.6, 0.2))
    paper = evaluate_partition(profile, topo, [(0, 1, 2), (2, 2, 1)], cost_model="paper")
    assert paper.time_per_microbatch == pytest.approx(0.6)
    code = evaluate_partition(profile, topo, [(0, 1, 1), (2, 2, 2)], cost_model="pipedream-code")
    assert code.time_per_microbatch == pytest.approx(max(0.3, 0.6 / 2, 2 * 1e8 / (1e9 * 2)))
    assert plan.partitioner == "manual" and plan.num_devices == 3
    assert plan.single_device_time == pytest.approx(0.9)


def test_evaluate_partition_uses_the_slow_link_across_servers():
    profile = _profile([1.0, 1.0], outputs=[10**9, 0])
    topo = Topology.from_levels([2, 2], [1e10, 1e9])
    inside = evaluate_partition(profile, topo, [(0, 0, 1), (1, 1, 1)])
    across = evaluate_partition(profile, topo, [(0, 0, 2), (1, 1, 2)])
    # One transfer each way; stage 0 keeps 2 microbatches in flight, so the period is at
    # least the round trip (both stages' compute and the cut twice) over 2.
    assert inside.time_per_microbatch == pytest.approx(max(1.0, 1e9 / 1e10, (2.0 + 0.2) / 2))
    # Across (round-robin under "auto"): 2 groups of 2 in flight at stage 0, and a
    # microbatch spends a whole group's action (2 x 0.5 s) at each stage.
    assert across.in_flight == (4, 2)
    assert across.time_per_microbatch == pytest.approx(max(0.5, 1e9 / 1e9, (2.0 + 2.0) / 4))
    split = evaluate_partition(profile, topo, [(0, 0, 2), (1, 1, 2)], replication="split")
    assert split.time_per_microbatch == pytest.approx(max(0.5, 1e9 / 1e9, (1.0 + 2.0) / 2))


def test_evaluate_partition_matches_the_optimizer_on_one_level():
    profile = Profile.load("pipedream:vgg16")
    for model in ("pdjax", "paper", "pipedream-code"):
        topo = Topology.flat(8, 1.25e9)
        plan = plan_pipedream(profile, topo, cost_model=model)
        stages = [(s.first_layer, s.last_layer, s.replicas) for s in plan.stages]
        again = evaluate_partition(profile, topo, stages, cost_model=model)
        assert again.time_per_microbatch == pytest.approx(plan.time_per_microbatch, rel=1e-12)
        assert again.data_parallel_time == plan.data_parallel_time
        assert again.stages == plan.stages


@pytest.mark.parametrize(
    "stages,match",
    [
        ([(0, 1, 1), (3, 4, 1)], "does not continue"),
        ([(0, 1, 1), (2, 3, 1)], "the stages end at layer 3"),
        ([(0, 4, 0)], "at least one"),
        ([(0, 1, 3), (2, 4, 2)], "need 5 devices but the topology has 4"),
        ([(i, i, 1) for i in range(5)], "5 stages requested but the topology has only 4"),
        ([], "no stages"),
    ],
)
def test_evaluate_partition_bad_input(stages, match):
    with pytest.raises(PlanError, match=match):
        evaluate_partition(_profile([1] * 5), Topology.flat(4, 1e9), stages)
