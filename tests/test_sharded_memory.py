"""Sharded stages' memory (issue 46): the planner and the simulator price a stage on a
mesh per device (its parameter-sized terms over its weight ways, its per-microbatch terms
over its batch ways: ``pdjax.partition.pricing.cost.mesh_ways``), and the simulator's
``runtime`` memory model predicts the live bytes the runtime holds per device."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from measured import measured_peaks, megatron_dense

from pdjax.errors import PlanError
from pdjax.layers import sequential
from pdjax.partition import Topology, costs_from_plan, evaluate_partition
from pdjax.partition.pricing import cost
from pdjax.partition.search.evaluate import stage_memory_bytes
from pdjax.pipeline import Pipeline
from pdjax.plan import Plan, StagePlan
from pdjax.profile import LayerProfile, Profile, profile
from pdjax.schedules import ScheduleSpec, generate
from pdjax.simulator import simulate

MESH = {"fsdp": 2, "tensor": 2}
AXES = (("fsdp", 2), ("tensor", 2))


def _chain(param_bytes: int, output_bytes: int, layers: int = 4) -> Profile:
    return Profile.chain(
        [
            LayerProfile(
                f"l{i}",
                forward_seconds=1.0,
                backward_seconds=2.0,
                param_bytes=param_bytes,
                input_bytes=output_bytes,
                output_bytes=output_bytes,
            )
            for i in range(layers)
        ],
        batch_size=8,
    )


def _plan(prof: Profile, schedule: str, meshes: list | None) -> Plan:
    return evaluate_partition(
        prof,
        Topology.flat(8, 1e9),
        [(0, 1, 4), (2, 3, 4)],
        schedule=schedule,
        num_microbatches=4,
        replication="split",
        meshes=meshes,
    )


@pytest.mark.parametrize("schedule", ["1f1b", "pipedream"])
def test_a_sharded_stage_divides_weights_by_its_weight_ways_and_rows_by_its_batch_ways(
    schedule,
):
    """fsdp 2 x tensor 2 on 4 devices: the weights split 4 ways (not replicated: 1), the
    rows of a microbatch 2 ways (data x fsdp; replicated: 4)."""
    weights_only, rows_only = _chain(4096, 0), _chain(0, 4096)
    for prof, ratio in ((weights_only, 1 / 4), (rows_only, 2.0)):
        whole = _plan(prof, schedule, None)
        sharded = _plan(prof, schedule, [MESH, None])
        assert [st.mesh for st in sharded.stages] == [AXES, None]
        assert sharded.stages[0].memory_bytes == pytest.approx(ratio * whole.stages[0].memory_bytes)
        assert sharded.stages[1].memory_bytes == whole.stages[1].memory_bytes
        # the time stays the replicated stage's: the collectives are not priced yet
        assert sharded.time_per_microbatch == whole.time_per_microbatch
        assert [st.compute_seconds for st in sharded.stages] == [
            st.compute_seconds for st in whole.stages
        ]
    # a mesh with only data is the replicated stage
    data = _plan(rows_only, schedule, [{"data": 4}, {"data": 4}])
    assert [st.mesh for st in data.stages] == [None, None]
    assert [st.memory_bytes for st in data.stages] == [
        st.memory_bytes for st in _plan(rows_only, schedule, None).stages
    ]


def test_the_plan_records_its_meshes_and_the_simulator_reads_them():
    prof = _chain(4096, 2048)
    whole, sharded = _plan(prof, "1f1b", None), _plan(prof, "1f1b", [MESH, MESH])
    again = Plan.from_json(sharded.to_json())
    assert [st.mesh for st in again.stages] == [AXES, AXES]
    plain, split = costs_from_plan(whole, prof), costs_from_plan(again, prof)
    for a, b in zip(plain.stages, split.stages, strict=True):
        assert b.param_bytes == a.param_bytes / 4 and b.optimizer_bytes == a.optimizer_bytes / 4
        assert b.stash_bytes == 2 * a.stash_bytes  # rows / 2, not / 4
        assert b.cotangent_bytes == 2 * a.cotangent_bytes
        assert (b.forward, b.input_grad, b.weight_grad) == (a.forward, a.input_grad, a.weight_grad)
        assert b.activation_bytes == a.activation_bytes  # the link's bytes, as before
    # the simulator divides inputs by the devices: each row block is on 2 of them
    assert split.stages[0].input_bytes == 2 * plain.stages[0].input_bytes
    # the all-reduce is the replicated stage's (the whole weights over the 4 devices)
    for s in range(2):
        assert split.allreduce(s, 4) == pytest.approx(plain.allreduce(s, 4))
    for model in ("planner", "runtime"):
        runs = [
            simulate(
                generate("1f1b", 2, 4, steps=2, replicas=[4, 4]),
                dataclasses.replace(c, memory_model=model),
            )
            for c in (plain, split)
        ]
        assert runs[1].step_time == pytest.approx(runs[0].step_time)
        assert all(b < a for a, b in zip(runs[0].peak_memory, runs[1].peak_memory, strict=True))


def test_meshes_are_checked():
    prof = _chain(4096, 2048)
    with pytest.raises(PlanError, match="2 stages"):
        _plan(prof, "1f1b", [MESH])
    with pytest.raises(PlanError, match="spans 8 devices, the stage has 4"):
        _plan(prof, "1f1b", [{"fsdp": 2, "tensor": 4}, None])
    with pytest.raises(PlanError, match="round-robin"):
        evaluate_partition(
            prof,
            Topology.flat(8, 1e9),
            [(0, 1, 4), (2, 3, 4)],
            schedule="pipedream",
            num_microbatches=4,
            replication="round-robin",
            meshes=[MESH, None],
        )
    flat = [(0, 1, [0, 1, 2, 3]), (2, 3, [4, 5, 6, 7])]
    with pytest.raises(PlanError, match="mesh axis"):
        stage_memory_bytes(
            cost.model_arrays(prof),
            flat,
            ("split", "split"),
            topology=Topology.flat(8, 1e9),
            cost_model="pdjax",
            schedule="1f1b",
            num_microbatches=4,
            optimizer_state_factor=2.0,
            meshes=[{"fsdp": 0}, None],
        )


# -- against the runtime ---------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1", "2bw", "pipedream"])
def test_runtime_memory_model_predicts_a_sharded_stage(schedule):
    """Two stages of fsdp 2 x tensor 2 on 8 devices: the simulator's ``runtime`` memory
    model within 10% of the live bytes the runtime holds on each stage's devices (measured
    after each operation), and the planner's figure no lower than the simulator's."""
    width, num_layers, M, mb = 64, 4, 4, 8
    layers = sequential(*[megatron_dense(i, width) for i in range(num_layers)])
    plan = (StagePlan(0, 1, (0, 1, 2, 3), mesh=MESH), StagePlan(2, 3, (4, 5, 6, 7), mesh=MESH))
    pipe = Pipeline(
        layers,
        plan,
        lambda out, y: jnp.mean((out - y) ** 2),
        optax.adam(1e-3),
        schedule=ScheduleSpec(schedule, microbatches=M),
    )
    n = cost.microbatches_per_call(schedule, M)  # the call the planner's figure is for
    xs = np.random.default_rng(0).standard_normal((n, mb, width)).astype(np.float32)
    microbatches = [(xs[k], xs[k] * 0.5) for k in range(n)]
    measured = measured_peaks(pipe, pipe.init(jax.random.key(1), xs[0]), microbatches)

    prof = profile(layers, jnp.asarray(xs[0]), device_model="h100")  # times: not used
    planned = evaluate_partition(
        prof,
        Topology.from_devices(jax.devices()),
        [(0, 1, 4), (2, 3, 4)],
        schedule=schedule,
        num_microbatches=M,
        meshes=[MESH, MESH],
    )
    costs = dataclasses.replace(costs_from_plan(planned, prof), memory_model="runtime")
    predicted = simulate(pipe.schedule(n), costs).peak_memory
    for g in range(2):
        expected = predicted[g]
        if schedule == "pipedream" and g == 0:
            # its B reads a weight version for the last time and frees it: the simulator
            # counts it during the B, the runtime's live bytes are read after it (one-device
            # stages show the same, tests/test_memory.py)
            expected -= costs.stages[g].param_bytes
        assert 0.9 * expected <= measured[g] <= 1.1 * expected, (measured, predicted)
        assert planned.stages[g].memory_bytes >= predicted[g], (planned.stages, predicted)
