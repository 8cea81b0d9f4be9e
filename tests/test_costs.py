"""Plan + Profile -> simulator costs: hand-computed numbers, agreement with the planner,
and ``pdjax simulate --plan --profile`` end to end."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from pdjax.apps.cli import main
from pdjax.apps.commands import simulate as simulate_command
from pdjax.errors import PlanError, ScheduleError
from pdjax.partition import (
    Plan,
    StagePlan,
    Topology,
    costs_from_plan,
    plan_pipedream,
    weight_grad_fraction,
)
from pdjax.profile import LayerProfile, Profile
from pdjax.schedules import ScheduleSpec, generate
from pdjax.simulator import simulate

# ------------------------------------------------------------------------------ hand-made


def _profile() -> Profile:
    """Four layers, batch 8; layer 2 has no parameters, layer 1 has FLOPs."""
    layers = [
        LayerProfile(
            "l0",
            forward_seconds=1.0,
            backward_seconds=2.0,
            param_bytes=100,
            input_bytes=40,
            residual_bytes=8,
            output_bytes=80,
        ),
        LayerProfile(
            "l1",
            forward_seconds=2.0,
            backward_seconds=4.0,
            forward_flops=10.0,
            backward_flops=40.0,
            param_bytes=200,
            input_bytes=80,
            output_bytes=60,
        ),
        LayerProfile(
            "l2", forward_seconds=0.5, backward_seconds=1.0, input_bytes=60, output_bytes=20
        ),
        LayerProfile(
            "l3",
            forward_seconds=3.0,
            backward_seconds=6.0,
            param_bytes=400,
            input_bytes=20,
            residual_bytes=4,
            output_bytes=4,
        ),
    ]
    return Profile.chain(layers, batch_size=8)


def _plan(topology: Topology, stages: list[tuple[int, int, tuple[int, ...]]], **kw) -> Plan:
    fields = dict(
        num_layers=4,
        topology=topology,
        cost_model="pdjax",
        schedule=ScheduleSpec("1f1b", microbatches=4),
        partitioner="manual",
        microbatch_size=4,
        time_per_microbatch=1.0,
        single_device_time=1.0,
        data_parallel_time=1.0,
        noam=1,
        options={"optimizer_state_factor": 3.0},
    )
    fields.update(kw)
    return Plan(
        stages=tuple(
            StagePlan(a, b, d, in_flight=1, compute_seconds=0.0, memory_bytes=0.0)
            for a, b, d in stages
        ),
        **fields,
    )


def test_weight_grad_fraction():
    # l0: params, no FLOPs -> 1/2; l1: forward / backward FLOPs; l2: no params; l3: 1/2.
    assert weight_grad_fraction(_profile()).tolist() == [0.5, 0.25, 0.0, 0.5]


def test_weight_grad_fraction_prefers_measured_then_counted_then_heuristic():
    heuristic = LayerProfile("d", param_bytes=4, forward_flops=10.0, backward_flops=40.0)
    counted = dataclasses.replace(heuristic, input_grad_flops=10.0, weight_grad_flops=30.0)
    measured = dataclasses.replace(counted, input_grad_seconds=3.0, weight_grad_seconds=1.0)

    def fraction(*layers: LayerProfile) -> list[float]:
        return weight_grad_fraction(Profile.chain(layers, batch_size=1)).tolist()

    assert fraction(heuristic, counted, measured) == [0.25, 0.75, 0.25]
    # only seconds of both halves count; a half alone, or an empty split, falls through
    assert fraction(
        dataclasses.replace(counted, input_grad_seconds=3.0),
        dataclasses.replace(measured, input_grad_seconds=0.0, weight_grad_seconds=0.0),
        dataclasses.replace(heuristic, input_grad_flops=0.0, weight_grad_flops=0.0),
        dataclasses.replace(measured, input_grad_seconds=0.0),
    ) == [0.75, 0.75, 0.25, 1.0]
    # no parameters: no weight gradient, whatever the split says
    assert fraction(dataclasses.replace(measured, param_bytes=0)) == [0.0]


def test_costs_split_the_backward_by_the_measured_share():
    # the simulator's I and W follow the profile's split, and sum to the measured backward
    split = {"input_grad_seconds": 0.9, "weight_grad_seconds": 0.1}  # measured: w = 0.1
    base = _profile()
    layers = list(base.layers)
    layers[3] = dataclasses.replace(layers[3], **split)  # heuristic would say 1/2
    layers[1] = dataclasses.replace(layers[1], input_grad_flops=1.0, weight_grad_flops=3.0)
    topo = Topology.from_levels([2, 2], [10.0, 1.0])
    plan = _plan(topo, [(0, 1, (0, 1)), (2, 2, (2,)), (3, 3, (3,))])
    st0, _, st2 = costs_from_plan(plan, dataclasses.replace(base, layers=tuple(layers))).stages
    s = 0.5
    assert (st2.input_grad, st2.weight_grad) == pytest.approx((6.0 * 0.9 * s, 6.0 * 0.1 * s))
    # layer 1 counted: w = 3/4 instead of the heuristic's 1/4
    assert st0.weight_grad == pytest.approx((2.0 * 0.5 + 4.0 * 0.75) * s / 2)
    assert st0.input_grad + st0.weight_grad == pytest.approx((2.0 + 4.0) * s / 2)


def test_costs_of_a_hand_made_plan():
    # 2 servers of 2 devices: 10 B/s inside a server, 1 B/s between servers.
    topo = Topology.from_levels([2, 2], [10.0, 1.0])
    plan = _plan(topo, [(0, 1, (0, 1)), (2, 2, (2,)), (3, 3, (3,))])
    costs = costs_from_plan(plan, _profile())
    s = 0.5  # microbatch 4 of a profiled batch of 8
    st0, st1, st2 = costs.stages
    # Stage 0: layers 0-1 on 2 devices.
    assert st0.forward == pytest.approx((1.0 + 2.0) * s / 2)
    assert st0.input_grad == pytest.approx((2.0 * 0.5 + 4.0 * 0.75) * s / 2)
    assert st0.weight_grad == pytest.approx((2.0 * 0.5 + 4.0 * 0.25) * s / 2)
    assert st0.activation_bytes == 60 * s
    assert st0.param_bytes == 300
    assert st0.stash_bytes == (48 + 80) * s / 2
    assert st0.optimizer_bytes == 300 * 3
    # Stage 1: the parameter-free layer 2: all backward is input gradient.
    assert (st1.forward, st1.input_grad, st1.weight_grad) == (0.25, 0.5, 0.0)
    assert (st1.activation_bytes, st1.param_bytes, st1.stash_bytes) == (10, 0, 30)
    # Stage 2: the last one sends nothing.
    assert (st2.forward, st2.input_grad, st2.weight_grad) == (1.5, 1.5, 1.5)
    assert (st2.activation_bytes, st2.param_bytes, st2.stash_bytes) == (0, 400, 12)
    assert all(st.update == 0.0 for st in costs.stages)
    # Devices {0,1} -> {2}: between servers; {2} -> {3}: inside server 1.
    assert costs.link_bandwidth == (1.0, 10.0)
    # Stage 0's replicas share server 0.
    assert costs.allreduce_bandwidth == (10.0, 10.0, 10.0)


def test_server_replicated_stages_use_parallel_links_and_the_slow_allreduce():
    # Stage 0 on device 0 of both servers, stage 1 on device 1 of both: two sub-pipelines,
    # each cut inside a server (2 links of 10 B/s), all-reduces across servers (1 B/s).
    topo = Topology.from_levels([2, 2], [10.0, 1.0])
    plan = _plan(topo, [(0, 1, (0, 2)), (2, 3, (1, 3))], options={})
    costs = costs_from_plan(plan, _profile())
    assert costs.link_bandwidth == (20.0,)
    assert costs.allreduce_bandwidth == (1.0, 1.0)
    assert costs.stages[0].optimizer_bytes == 300 * 2  # default factor: Adam's 2


def test_device_ids_are_mapped_to_topology_positions():
    topo = dataclasses.replace(Topology.from_levels([2, 2], [10.0, 1.0]), device_ids=(7, 5, 3, 1))
    plan = _plan(topo, [(0, 1, (7, 5)), (2, 3, (3,))])
    costs = costs_from_plan(plan, _profile())
    assert costs.link_bandwidth == (1.0,)
    assert costs.allreduce_bandwidth == (10.0, 10.0)


def test_interleaved_chunks_recut_the_model_into_virtual_stages():
    topo = Topology.flat(2, 1e12)
    plan = _plan(topo, [(0, 1, (0,)), (2, 3, (1,))], microbatch_size=8)
    costs = costs_from_plan(plan, _profile(), chunks=2)
    # 4 layers, 4 virtual stages: one layer each; virtual stage k on group k % 2.
    assert [st.forward for st in costs.stages] == [1.0, 2.0, 0.5, 3.0]
    assert [st.activation_bytes for st in costs.stages] == [80, 60, 20, 0]
    assert len(costs.link_bandwidth) == 3
    sim = simulate(generate("interleaved", 2, 4, chunks=2), costs)
    assert sim.peak_in_flight  # it plays


def test_interleaved_balances_compute_over_virtual_stages():
    layers = [LayerProfile(f"l{i}", forward_seconds=1.0, backward_seconds=1.0) for i in range(8)]
    profile = Profile.chain(layers, batch_size=1)
    plan = _plan(
        Topology.flat(2, 1e12), [(0, 6, (0,)), (7, 7, (1,))], num_layers=8, microbatch_size=1
    )
    costs = costs_from_plan(plan, profile, chunks=2)
    assert [st.forward for st in costs.stages] == [2.0, 2.0, 2.0, 2.0]


def test_mismatches_are_named():
    plan = _plan(Topology.flat(2, 1.0), [(0, 1, (0,)), (2, 3, (1,))])
    short = Profile.chain(_profile().layers[:3], batch_size=8)
    with pytest.raises(PlanError, match="covers 4 layers but the profile has 3"):
        costs_from_plan(plan, short)
    with pytest.raises(ScheduleError, match=r"needs 6 virtual stages .* only 3 cuts"):
        costs_from_plan(plan, _profile(), chunks=3)
    with pytest.raises(ScheduleError, match="chunks must be an integer >= 1"):
        costs_from_plan(plan, _profile(), chunks=0)


# ------------------------------------------------------------------ planner vs simulator


@pytest.fixture(scope="module")
def vgg16() -> Profile:
    return Profile.load("pipedream:vgg16")


def _steady(plan: Plan, costs) -> float:
    schedule = generate("pipedream", plan.num_stages, 1, stream=48, replicas=plan.replicas)
    sim = simulate(schedule, costs)
    assert sim.steady_state
    return sim.time_per_microbatch


def _round_trip_bound(plan: Plan, costs) -> float:
    """Little's law: stage ``s`` keeps ``P - s`` microbatches in flight, so its period is at
    least one microbatch's round trip from ``s`` to the last stage and back over ``P - s``."""
    P, out = plan.num_stages, []
    for s in range(P):
        trip = sum(st.forward + st.backward for st in costs.stages[s:])
        trip += sum(
            2 * costs.stages[t].activation_bytes / costs.link_bandwidth[t] for t in range(s, P - 1)
        )
        r = plan.replicas[s]
        trip += 2 * (r - 1) / r * costs.stages[s].param_bytes / costs.allreduce_bandwidth[s]
        out.append(trip / (P - s))
    return max(out)


def test_planner_and_simulator_agree_on_vgg16(vgg16):
    # Split replication: stage s holds P - s microbatches (round-robin: see
    # tests/test_round_robin_plan.py).
    plan = plan_pipedream(
        vgg16, Topology.flat(4, 1.25e9), schedule="pipedream", replication="split"
    )
    assert plan.config == "3-1"
    costs = costs_from_plan(plan, vgg16)
    # The planner's bottleneck is stage 0 (compute / 3 + all-reduce); without transfer
    # latency the simulator's steady state is exactly that stage.
    free = dataclasses.replace(costs, link_bandwidth=(math.inf,) * (plan.num_stages - 1))
    assert _steady(plan, free) == pytest.approx(plan.time_per_microbatch, rel=0.01)
    # At 10 Gbit/s a 100 MB activation takes as long as the compute, and P - s microbatches
    # in flight cannot hide it: the simulator is slower than the planner by the round-trip
    # bound (the systematic difference documented in pdjax.partition.choosing.simulator_costs).
    real = _steady(plan, costs)
    # the planner now carries the round-trip bound: it equals the simulator's steady state
    assert real == pytest.approx(plan.time_per_microbatch, rel=0.01)
    assert real >= 0.98 * _round_trip_bound(plan, costs)
    # With fast links the two agree again.
    fast = plan_pipedream(
        vgg16, Topology.flat(4, 1.25e11), schedule="pipedream", replication="split"
    )
    assert _steady(fast, costs_from_plan(fast, vgg16)) == pytest.approx(
        fast.time_per_microbatch, rel=0.01
    )


@pytest.mark.parametrize("schedule", ["pipedream", "1f1b", "gpipe", "2bw"])
def test_simulated_memory_is_the_planners(vgg16, schedule):
    """The plan's memory per device covers the simulator's runtime model of the call it
    prices (never below any device's peak), within 10% on the fullest device."""
    import dataclasses

    from pdjax.schedules import STREAMING

    plan = plan_pipedream(vgg16, Topology.flat(4, 1.25e9), schedule=schedule, straight=True)
    N, M, P = plan.options["microbatches_per_call"], plan.num_microbatches, plan.num_stages
    if schedule in STREAMING:
        sched = generate(schedule, P, M, stream=N)
    else:
        sched = generate(schedule, P, M, steps=N // M)
    costs = costs_from_plan(plan, vgg16)
    assert simulate(sched, costs).peak_in_flight == plan.in_flight
    runtime = simulate(sched, dataclasses.replace(costs, memory_model="runtime")).peak_memory
    assert all(s <= p for s, p in zip(runtime, plan.memory_per_device, strict=True))
    assert max(plan.memory_per_device) <= 1.10 * max(runtime)


# ------------------------------------------------------------------------------------ CLI


def test_cli_simulates_a_saved_plan_end_to_end(vgg16, tmp_path, capsys):
    plan = plan_pipedream(vgg16, Topology.flat(4, 1.25e9), schedule="1f1b")
    plan_path, png = tmp_path / "plan.json", tmp_path / "out.png"
    plan.save(plan_path)
    argv = ["simulate", "--plan", str(plan_path), "--profile", "pipedream:vgg16"]
    code = main([*argv, "--schedule", "all", "--microbatches", "8", "--png", str(png), "--json"])
    assert code == 0
    rows = {row["schedule"]: row for row in json.loads(capsys.readouterr().out)["schedules"]}
    assert set(rows) == {"gpipe", "1f1b", "pipedream", "2bw", "interleaved"} | {
        "zb-h1",
        "zb-h2",
        "zb-v",
    }
    for name, row in rows.items():
        assert "error" not in row, (name, row)
        assert row["num_groups"] == plan.num_stages
    assert rows["interleaved"]["num_stages"] == 2 * plan.num_stages
    assert rows["1f1b"]["peak_in_flight"] == list(plan.in_flight)
    assert png.stat().st_size > 10_000

    # The seam returns the plan's costs and replicas.
    costs, replicas = simulate_command.costs_from_files(str(plan_path), "pipedream:vgg16")
    assert replicas == plan.replicas and len(costs.stages) == plan.num_stages

    # A schedule/plan disagreement on P names both numbers.
    assert main([*argv, "--stages", "3"]) == 2
    assert "--stages 3 disagrees with the plan's 2 stages (P)" in capsys.readouterr().err
    # A profile that is not the plan's is refused.
    assert main(["simulate", "--plan", str(plan_path), "--profile", "pipedream:alexnet"]) == 2
    assert "covers 41 layers but the profile" in capsys.readouterr().err
