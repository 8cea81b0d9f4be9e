"""Round-robin replication in the simulator, the plan data, the planner and the commands.

A round-robin stage on ``r`` devices takes ``r`` consecutive microbatches at once, one per
device: each of its actions takes the time of one whole microbatch on one device (``r``
times the per-replica cost the simulator is given), its all-reduce runs once per group
under ``pipedream``, and each device stashes whole microbatches.
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdjax.apps.cli import main
from pdjax.errors import PlanError
from pdjax.partition import (
    Plan,
    StagePlan,
    Topology,
    costs_from_plan,
    evaluate_partition,
    plan_pipedream,
)
from pdjax.partition.pricing import cost
from pdjax.profile import LayerProfile, Profile
from pdjax.schedules import ScheduleSpec, generate, pipedream
from pdjax.simulator import PipelineCosts, StageCosts, simulate, stream_length

# ----------------------------------------------------------------------------- simulator

#: Per replica: F = 1 s, B = 2 s; 100 B of weights all-reduced at 100 B/s (r = 2: a ring of
#: 2 (r - 1) / r * 100 / 100 = 1 s); 10 B stashed per microbatch in flight.
STAGE = StageCosts(1.0, 1.0, 1.0, param_bytes=100, stash_bytes=10)
COSTS = PipelineCosts.build([STAGE, STAGE], allreduce_bandwidth=100.0)


def _two_stages(mode: str, N: int = 24):
    return simulate(pipedream(2, N, replicas=[2, 1], replication=mode), COSTS)


def test_round_robin_time_per_microbatch_by_hand():
    # Split, stage 0 on 2 devices: each microbatch costs F + B = 3 s per device, then its
    # 1 s all-reduce: 4 s per microbatch, the bottleneck (stage 1: 3 s).
    split = _two_stages("split")
    assert split.steady_state and split.time_per_microbatch == pytest.approx(4.0)
    # Round-robin: one F (2 s: a whole microbatch on each device) and one B (4 s) per group
    # of 2, one all-reduce per group: 7 s per 2 microbatches.
    rr = _two_stages("round-robin")
    assert rr.steady_state and rr.time_per_microbatch == pytest.approx(3.5)
    # Stage 1 works 3 s of every 3.5: idle 1/7 of its time, stage 0 never.
    assert rr.bubble_fraction == pytest.approx(0.5 / 7)
    spans = [s for s in rr.timeline.spans if s.group == 0 and s.action.kind in "FB"]
    assert {(s.action.kind, s.end - s.start) for s in spans} == {("F", 2.0), ("B", 4.0)}


def test_round_robin_memory_by_hand():
    # Stage 0 keeps 2 versions either way (q_0 = 2 groups under round-robin, P - s = 2
    # microbatches under split); a device stashes its share (10 B = half a microbatch) of
    # every microbatch in flight: 2 of them split, 2 groups of 2 round-robin.
    split, rr = _two_stages("split"), _two_stages("round-robin")
    assert split.peak_in_flight == (2, 1) and rr.peak_in_flight == (4, 1)
    assert split.peak_memory == (2 * 100 + 2 * 10, 100 + 10)
    assert rr.peak_memory == (2 * 100 + 4 * 10, 100 + 10)


def test_round_robin_all_reduces_once_per_group():
    N = 24
    for mode, count in [("split", N), ("round-robin", N // 2)]:
        sim = _two_stages(mode, N)
        updates = [s for s in sim.timeline.spans if s.group == 0 and s.action.kind == "U"]
        assert len(updates) == count == sim.schedule.updates_of(0)
        assert math.fsum(s.end - s.start for s in updates) == pytest.approx(count * 1.0)


@pytest.mark.parametrize(
    "replicas", [(2, 1), (15, 1), (2, 2), (3, 2, 1), (1, 2), (12, 2, 1, 1), (2, 1, 3, 1)]
)
def test_steady_state_of_round_robin_streams(replicas):
    """The steady-state window spans whole periods: over a stream twice as long the rate is
    the same, and no faster than the slowest stage (3 s per microbatch here)."""
    P = len(replicas)
    costs = PipelineCosts.build([StageCosts(1.0, 1.0, 1.0)] * P)
    N = stream_length("pipedream", P, replicas=replicas, replication="round-robin")
    assert all(N % r == 0 for r in replicas)
    rates = []
    for stream in (N, 2 * N):
        sched = generate(
            "pipedream", P, 1, stream=stream, replicas=replicas, replication="round-robin"
        )
        sim = simulate(sched, costs)
        assert sim.steady_state
        rates.append(sim.time_per_microbatch)
    assert rates[0] == pytest.approx(rates[1])
    assert rates[0] >= 3.0 - 1e-9


def test_stream_length():
    assert stream_length("pipedream", 4) == 8
    assert stream_length("2bw", 4, 3) == 12
    N = stream_length("2bw", 2, 4, replicas=(2, 1), replication="round-robin")
    assert N % 4 == 0 and N >= 4 * 3 + 4 * 4


# ----------------------------------------------------------------------------- plan data


def _plan(**kw) -> Plan:
    stages = (
        StagePlan(
            0,
            1,
            (0, 1, 2),
            in_flight=6,
            compute_seconds=1.0,
            memory_bytes=10.0,
            replication="round-robin",
        ),
        StagePlan(2, 3, (3,), in_flight=1, compute_seconds=1.0, memory_bytes=10.0),
    )
    fields = dict(
        stages=stages,
        num_layers=4,
        topology=Topology.flat(4, 1e9),
        cost_model="pdjax",
        schedule=ScheduleSpec("pipedream", microbatches=4),
        partitioner="manual",
        microbatch_size=4,
        time_per_microbatch=1.0,
        single_device_time=2.0,
        data_parallel_time=1.5,
        noam=2,
    )
    fields.update(kw)
    return Plan(**fields)


def test_plan_records_replication_and_round_trips():
    plan = _plan()
    assert plan.replication == ("round-robin", "split")
    assert plan.config == "3rr-1"
    assert "stage 0 = layers 0-1 x3 round-robin, stage 1 = layers 2-3 x1" in plan.describe()
    data = json.loads(plan.to_json())
    assert [s["replication"] for s in data["stages"]] == ["round-robin", "split"]
    assert Plan.from_json(plan.to_json()) == plan
    # A plan written before the field existed loads with every stage split.
    for stage in data["stages"]:
        del stage["replication"]
    old = Plan.from_dict(data)
    assert old.replication == ("split", "split") and old.config == "3-1"


def test_stage_replication_is_checked():
    with pytest.raises(PlanError, match="replication must be one of"):
        StagePlan(
            0,
            1,
            (0, 1),
            in_flight=2,
            compute_seconds=1.0,
            memory_bytes=1.0,
            replication="roundrobin",
        )
    with pytest.raises(PlanError, match="one device"):
        StagePlan(
            0,
            1,
            (0,),
            in_flight=1,
            compute_seconds=1.0,
            memory_bytes=1.0,
            replication="round-robin",
        )


# ----------------------------------------------------------------------------- planner


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=1, max_size=6))
def test_groups_in_flight_match_the_generated_schedules(replicas):
    """cost.exact_in_flight (the planner's) against the generators' own bounds."""
    P = len(replicas)
    modes = tuple("round-robin" if r > 1 else "split" for r in replicas)
    units = cost.stage_units(replicas, modes)
    M = math.lcm(*units) * 2
    for name in ("pipedream", "1f1b", "2bw", "gpipe"):
        N = stream_length(name, P, M, replicas=replicas, replication=modes)
        if name == "pipedream":
            N = max(N, 2 * sum(replicas) * max(units))
            N -= N % math.lcm(*units)
        if name == "2bw" and M < P:
            continue
        sched = generate(name, P, M, stream=N, replicas=replicas, replication=modes)
        counts = cost.exact_in_flight(name, replicas, modes, M)
        assert tuple(c for c, _ in counts) == sched.in_flight_bound, name
        assert tuple(v for _, v in counts) == sched.version_bound, name


@pytest.fixture(scope="module")
def vgg16() -> Profile:
    return Profile.load("pipedream:vgg16")


@pytest.mark.parametrize("workers", [4, 8, 16])
def test_planner_simulator_and_memory_agree_for_round_robin(vgg16, workers):
    """On one level with free links, the simulated steady state of a round-robin plan is
    the planner's time; its peak memory and in-flight counts are the plan's."""
    plan = plan_pipedream(vgg16, Topology.flat(workers, 1.25e9))
    assert plan.replicas[-1] == 1 and plan.replication[0] == "round-robin"
    assert plan.config.startswith(f"{workers - 1}rr-")
    costs = costs_from_plan(plan, vgg16)
    free = dataclasses.replace(costs, link_bandwidth=(math.inf,) * (plan.num_stages - 1))
    P, rep = plan.num_stages, plan.replication
    N = stream_length("pipedream", P, replicas=plan.replicas, replication=rep)
    sim = simulate(
        generate("pipedream", P, 1, stream=N, replicas=plan.replicas, replication=rep), free
    )
    assert sim.time_per_microbatch == pytest.approx(plan.time_per_microbatch, rel=1e-9)
    assert sim.peak_in_flight == plan.in_flight
    # The plan charges what the runtime holds for a call of its microbatches_per_call;
    # this stream is longer: without the inputs placed up front, the plan covers the
    # simulator's runtime model of it, within 10%.
    unplaced = [dataclasses.replace(st, input_bytes=0) for st in free.stages]
    runtime = dataclasses.replace(free, stages=tuple(unplaced), memory_model="runtime")
    sched = generate("pipedream", P, 1, stream=N, replicas=plan.replicas, replication=rep)
    peak = simulate(sched, runtime).peak_memory
    for planned, simulated in zip(plan.memory_per_device, peak, strict=True):
        assert simulated <= planned <= 1.10 * simulated


def test_round_robin_all_reduces_less_than_split(vgg16):
    topo = Topology.flat(16, 1.25e9)
    rr = plan_pipedream(vgg16, topo)  # auto
    split = plan_pipedream(vgg16, topo, replication="split")
    assert rr.options["replication"] == "auto" and rr.replication == ("round-robin", "split")
    assert set(split.replication) == {"split"}
    assert rr.time_per_microbatch < split.time_per_microbatch
    # Same stages priced both ways: the all-reduce term is divided by r under round-robin.
    stages = [(s.first_layer, s.last_layer, s.replicas) for s in rr.stages]
    as_split = evaluate_partition(vgg16, topo, stages, replication="split")
    first = stages[0]
    w = float(cost.model_arrays(vgg16).params[first[0] : first[1] + 1].sum())
    ring = 2 * (first[2] - 1) / first[2] * w / 1.25e9
    c = rr.stages[0].compute_seconds
    assert rr.time_per_microbatch == pytest.approx(c + ring / first[2])
    # Split, stage 0 holds only P - s = 2 microbatches in flight: its round trip (both
    # stages and the cut's transfer both ways) over 2 binds here.
    arrays = cost.model_arrays(vgg16)
    c1 = rr.stages[1].compute_seconds
    transfer = float(arrays.cut[first[1]]) / 1.25e9
    trip = (c + ring + c1 + 2 * transfer) / 2
    assert trip > c + ring
    assert as_split.time_per_microbatch == pytest.approx(trip)
    # Round-robin holds q n = 2 x 15 microbatches: its round trip, a whole microbatch on
    # one device of stage 0 (n times its term), does not bind.
    assert (first[2] * (c + ring / first[2]) + c1 + 2 * transfer) / 30 < rr.time_per_microbatch


def test_data_parallelism_is_one_round_robin_stage(vgg16):
    """The planner's DP baseline all-reduces once per round of N microbatches: on two
    servers a whole-model round-robin stage over all 16 devices is exactly it."""
    topo = Topology.preset("2x8-v100-25gbps")
    plan = plan_pipedream(vgg16, topo, num_microbatches=16)
    assert plan.config == "16rr" and plan.stages[0].devices == tuple(range(16))
    assert plan.speedup_over_data_parallel == pytest.approx(1.0)
    arrays = cost.model_arrays(vgg16)
    w, c = float(arrays.params.sum()), float(arrays.compute.sum())
    rings = 2 * 7 / 8 * w / topo.levels[0].bandwidth + 2 * 1 / 2 * w / topo.levels[1].bandwidth
    assert plan.data_parallel_time == pytest.approx((c + rings) / 16)


def test_auto_keeps_split_when_round_robin_does_not_fit():
    # Stage-0 activations are large: round-robin stashes whole microbatches per device.
    layers = [
        LayerProfile(
            "a",
            forward_seconds=0.3,
            backward_seconds=0.6,
            param_bytes=10**8,
            output_bytes=10**3,
            input_bytes=10**3,
            residual_bytes=4 * 10**9,
        ),
        LayerProfile("b", forward_seconds=0.05, backward_seconds=0.1, param_bytes=10**6),
    ]
    profile = Profile.chain(layers, batch_size=8)
    topo = Topology.flat(4, 1e9)
    free = plan_pipedream(profile, topo)
    assert "round-robin" in free.replication
    assert max(free.memory_per_device) > 3e9  # one whole stash (4 GB) per device
    limited = plan_pipedream(profile, topo, memory_limit=3e9)
    assert "round-robin" not in limited.replication and limited.fits_memory
    forced = plan_pipedream(profile, topo, memory_limit=3e9, replication="split")
    assert limited.time_per_microbatch == forced.time_per_microbatch


def test_replication_options_are_checked(vgg16):
    topo = Topology.flat(4, 1e9)
    with pytest.raises(PlanError, match="pipedream only"):
        plan_pipedream(vgg16, topo, schedule="1f1b", replication="round-robin")
    with pytest.raises(PlanError, match="replication must be one of"):
        plan_pipedream(vgg16, topo, replication="rr")
    with pytest.raises(PlanError, match="round-robin replication runs with"):
        evaluate_partition(
            vgg16, topo, [(0, 20, 2), (21, 40, 2)], schedule="zb-h1", replication="round-robin"
        )
    with pytest.raises(PlanError, match="multiple of 3"):
        evaluate_partition(
            vgg16,
            topo,
            [(0, 20, 3), (21, 40, 1)],
            schedule="1f1b",
            num_microbatches=4,
            replication="round-robin",
        )
    with pytest.raises(PlanError, match="2 entries for 1 stages"):
        evaluate_partition(vgg16, topo, [(0, 40, 4)], replication=["split", "split"])
    # Flush schedules plan split under "auto"; a hand-made round-robin flush plan
    # all-reduces as split does (once per step) and keeps whole microbatches per device.
    flush = plan_pipedream(vgg16, topo, schedule="1f1b")
    assert set(flush.replication) == {"split"}
    stages = [(0, 17, 3), (18, 40, 1)]
    a = evaluate_partition(
        vgg16,
        topo,
        stages,
        schedule="1f1b",
        num_microbatches=6,
        replication=["round-robin", "split"],
    )
    b = evaluate_partition(
        vgg16, topo, stages, schedule="1f1b", num_microbatches=6, replication="split"
    )
    # The same all-reduce per step; round-robin holds more in flight, so its round-trip
    # bound is lower.
    assert a.in_flight == (6, 1) and b.in_flight == (2, 1)
    assert a.time_per_microbatch < b.time_per_microbatch
    # Paper and pipedream-code record the mode only: their time does not change.
    paper = [plan_pipedream(vgg16, topo, cost_model="paper", replication=m) for m in REPS]
    assert paper[0].time_per_microbatch == paper[1].time_per_microbatch
    assert paper[0].replication[0] == "split" and paper[1].replication[0] == "round-robin"


REPS = ("auto", "round-robin")


# ----------------------------------------------------------------------------- commands


def test_cli_plan_and_simulate_take_replication(tmp_path, capsys):
    path = tmp_path / "plan.json"
    argv = ["plan", "--profile", "pipedream:vgg16", "--workers", "4", "--out", str(path)]
    assert main([*argv, "--json"]) == 0
    capsys.readouterr()
    plan = Plan.load(path)
    assert plan.replication == ("round-robin", "split")
    assert main([*argv[:-2], "--replication", "split", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["config"] == "3-1"

    sim = ["simulate", "--plan", str(path), "--profile", "pipedream:vgg16", "--json"]
    rows = {}
    for mode in ("auto", "split", "round-robin"):
        assert main([*sim, "--schedule", "pipedream", "--replication", mode]) == 0
        (row,) = json.loads(capsys.readouterr().out)["schedules"]
        rows[mode] = row
    assert rows["auto"]["replication"] == ["round-robin", "split"]
    assert rows["auto"]["num_microbatches"] % 3 == 0
    assert rows["split"]["replication"] == ["split", "split"]
    assert rows["auto"]["peak_in_flight"] == list(plan.in_flight)
    assert rows["auto"]["time_per_microbatch"] < rows["split"]["time_per_microbatch"]
    # auto: flush schedules split (the plan was made for pipedream).
    assert main([*sim, "--schedule", "1f1b", "--microbatches", "6"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["schedules"]
    assert row["replication"] == ["split", "split"]
    assert main([*sim[:-1], "--schedule", "pipedream"]) == 0
    assert "pipedream rr" in capsys.readouterr().out


def test_model_arrays_kept_per_profile_are_handed_out_as_copies(vgg16):
    """The planner asks for the same arrays thousands of times, so they are computed once
    per profile and microbatch size; a caller that changes its copy changes nothing else,
    and a profile made by ``dataclasses.replace`` gets its own."""
    first = cost.model_arrays(vgg16)
    expected = first.compute.copy()
    first.compute[:] = -1.0
    first.cut_ok[:] = False
    again = cost.model_arrays(vgg16)
    np.testing.assert_array_equal(again.compute, expected)
    assert again.cut_ok[:-1].any()
    halved = cost.model_arrays(vgg16, vgg16.batch_size // 2)
    assert halved.scale == pytest.approx(0.5) and again.scale == pytest.approx(1.0)
    faster = dataclasses.replace(
        vgg16,
        layers=tuple(
            dataclasses.replace(layer, forward_seconds=layer.forward_seconds / 2)
            for layer in vgg16.layers
        ),
    )
    assert cost.model_arrays(faster).compute.sum() < again.compute.sum()
