"""The planner chooses meshes (issue 47): units, their per-device profiles, the search,
plans on the devices, the simulator's pricing of them, and bad input."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from measured import measured_peaks, megatron_dense

from benchmarks.bench_planner import megatron_costs
from pdjax.errors import PlanError
from pdjax.layers import sequential
from pdjax.mesh import mesh_size
from pdjax.partition import Topology, auto_choice, evaluate_partition, plan_auto
from pdjax.partition.choosing.meshes import (
    MeshSearch,
    coarse_topology,
    coarsen,
    expand,
    search_meshes,
    sharded_costs,
    unit_meshes,
    unit_profile,
)
from pdjax.partition.pricing import cost
from pdjax.partition.pricing.sharded import collective_seconds
from pdjax.pipeline import Pipeline
from pdjax.plan import StagePlan
from pdjax.profile import LayerProfile, Profile, profile
from pdjax.schedules import ScheduleSpec, generate
from pdjax.simulator import simulate

FSDP2, TENSOR2, QUAD = (("fsdp", 2),), (("tensor", 2),), (("fsdp", 2), ("tensor", 2))


# -- units and their topologies --------------------------------------------------------


def test_units_tile_the_topology_and_keep_tensor_within_its_innermost_level():
    two_nodes = Topology.from_levels([4, 2], [1e11, 1e9])
    units = unit_meshes(two_nodes, annotated=True)
    assert all(8 % mesh_size(u) == 0 for u in units)
    assert (("tensor", 8),) not in units  # tensor would cross the nodes' links
    assert (("fsdp", 2), ("tensor", 4)) in units and (("fsdp", 8),) in units
    assert all(dict(u).get("tensor", 1) <= 4 for u in units)
    assert unit_meshes(two_nodes, annotated=False) == [
        (("fsdp", 2),),
        (("fsdp", 4),),
        (("fsdp", 8),),
    ]
    # units of 2 devices: 2 per node, the nodes' link between node groups
    coarse = coarse_topology(two_nodes, 2)
    assert [(lvl.workers, lvl.bandwidth) for lvl in coarse.levels] == [(2, 1e11), (2, 1e9)]
    assert [(lvl.workers, lvl.bandwidth) for lvl in coarse_topology(two_nodes, 4).levels] == [
        (2, 1e9)
    ]
    assert coarse_topology(two_nodes, 8).num_devices == 1
    assert coarse_topology(two_nodes, 3) is None
    assert coarse_topology(Topology.from_levels([6, 2], [1e11, 1e9]), 4) is None  # 4 splits a node


def _chain(layers: int = 4, param: int = 8 << 20, act: int = 1 << 20) -> Profile:
    return Profile.chain(
        [
            LayerProfile(
                f"l{i}",
                forward_flops=1e9,
                backward_flops=2e9,
                forward_seconds=1e-3,
                backward_seconds=2e-3,
                input_grad_seconds=1e-3,
                weight_grad_seconds=1e-3,
                param_bytes=param,
                input_bytes=act,
                output_bytes=act,
                residual_bytes=2 * act,
            )
            for i in range(layers)
        ],
        batch_size=8,
    )


def _search(prof: Profile, units) -> MeshSearch:
    return MeshSearch({u: megatron_costs(prof, u) for u in units}, annotated=True)


def test_a_unit_profile_is_one_devices_share_plus_the_collectives_priced_on_their_links():
    prof, topo = _chain(), Topology.from_levels([4, 2], [1e10, 1e9])
    for unit in (FSDP2, TENSOR2, QUAD, (("fsdp", 8),)):
        f, t = dict(unit).get("fsdp", 1), dict(unit).get("tensor", 1)
        mine = unit_profile(prof, megatron_costs(prof, unit), topo, unit)
        lp, up = prof.layers[0], mine.layers[0]
        c = megatron_costs(prof, unit)[0]
        positions = list(range(f * t))
        comm_f = sum(collective_seconds(k, unit, positions, topo) for k in c.forward_collectives)
        comm_b = sum(collective_seconds(k, unit, positions, topo) for k in c.backward_collectives)
        assert up.forward_seconds == pytest.approx(lp.forward_seconds / (f * t) + comm_f)
        assert up.backward_seconds == pytest.approx(lp.backward_seconds / (f * t) + comm_b)
        assert up.param_bytes == lp.param_bytes // (f * t)
        # a microbatch's rows split over fsdp; tensor keeps the values between layers whole
        assert (
            up.output_bytes == lp.output_bytes // f and up.residual_bytes == lp.residual_bytes // f
        )
    # fsdp 8 spans both nodes: its gathers run on the slow link
    far = unit_profile(prof, megatron_costs(prof, (("fsdp", 8),)), topo, (("fsdp", 8),)).layers[0]
    near = unit_profile(prof, megatron_costs(prof, (("fsdp", 4),)), topo, (("fsdp", 4),)).layers[0]
    assert far.forward_seconds > near.forward_seconds
    # costs compiled for more rows are scaled back to the profile's batch
    doubled = tuple(
        dataclasses.replace(
            c, forward_flops=2 * c.forward_flops, backward_flops=2 * c.backward_flops
        )
        for c in megatron_costs(prof, TENSOR2)
    )
    a = unit_profile(prof, megatron_costs(prof, TENSOR2), topo, TENSOR2)
    b = unit_profile(prof, doubled, topo, TENSOR2, rows=16)
    assert b.layers[0].forward_seconds < a.layers[0].forward_seconds  # collectives halved too
    assert b.layers[0].forward_flops == a.layers[0].forward_flops
    with pytest.raises(PlanError, match="layers"):
        unit_profile(prof, megatron_costs(prof, TENSOR2)[:2], topo, TENSOR2)


def test_collectives_are_priced_on_their_own_links_where_given():
    """In-process CPU devices run a stage's collectives as memory copies on shared cores:
    measured (collective_level) and given to the search, they price the collectives in
    place of the transfer links."""
    from pdjax.calibrate.links import collective_level
    from pdjax.plan import Level

    prof, topo = _chain(), Topology.flat(8, 1e10)
    slow = [Level(8, 1e9, "collective", 1e-5)]
    plain = unit_profile(prof, megatron_costs(prof, TENSOR2), topo, TENSOR2)
    priced = unit_profile(prof, megatron_costs(prof, TENSOR2), topo, TENSOR2, collectives=slow)
    (k,) = megatron_costs(prof, TENSOR2)[0].forward_collectives
    extra = collective_seconds(k, TENSOR2, [0, 1], Topology((slow[0],))) - collective_seconds(
        k, TENSOR2, [0, 1], topo
    )
    assert priced.layers[0].forward_seconds == pytest.approx(
        plain.layers[0].forward_seconds + extra
    )
    with pytest.raises(PlanError, match="workers"):
        unit_profile(
            prof, megatron_costs(prof, TENSOR2), topo, TENSOR2, collectives=[Level(4, 1e9)]
        )
    level = collective_level(jax.devices()[:2], sizes=(4096, 1 << 16, 1 << 20), chain=4, repeats=3)
    assert level.workers == 2 and level.bandwidth > 0 and level.latency >= 0


def test_expand_and_coarsen_are_inverse_and_the_mesh_is_data_times_the_unit():
    prof, topo = _chain(), Topology.flat(8, 1e10, memory_per_device=1e12)
    search = _search(prof, [QUAD])
    plan = plan_auto(prof, topo, batch_size=16, meshes=search.only(QUAD), schedules=["1f1b"])
    assert {st.mesh for st in plan.stages} <= {QUAD, (("data", 2), *QUAD)}
    assert sorted(d for st in plan.stages for d in st.devices) == list(range(8))
    assert all(st.replicas % 4 == 0 for st in plan.stages)
    coarse, unit = coarsen(plan)
    assert unit == QUAD and coarse.topology.num_devices == 2
    assert expand(coarse, topo, unit).stages == plan.stages
    two = evaluate_partition(prof, topo, [(0, 1, 4), (2, 3, 4)], meshes=[QUAD, QUAD])
    shifted = tuple(
        dataclasses.replace(st, devices=tuple((d + 2) % 8 for d in st.devices)) for st in two.stages
    )
    with pytest.raises(PlanError, match="whole units"):
        coarsen(dataclasses.replace(two, stages=shifted))


def test_the_search_picks_a_sharded_plan_where_no_replicated_stage_fits():
    """A layer of 6 GB and Adam: no stage holding it whole fits 16 GB, so every replicated
    plan exceeds the cap; the planner returns a sharded plan that fits, records each unit's
    best, and prices its choice as the simulator does (sharded_costs)."""
    prof = _chain(layers=4, param=6 << 30, act=1 << 20)
    topo = Topology.flat(8, 1e11, memory_per_device=16e9)
    search = _search(prof, unit_meshes(topo, annotated=True))
    with pytest.raises(PlanError, match="over"):
        plan_auto(prof, topo, batch_size=16, meshes=search.only(()), schedules=["1f1b"])
    plan = plan_auto(prof, topo, batch_size=16, meshes=search, schedules=["1f1b", "gpipe"])
    chosen = auto_choice(plan)
    assert chosen is not None and chosen["peak_memory"] <= 16e9
    assert all(st.mesh is not None for st in plan.stages)
    record = plan.options["meshes"]["searched"]
    assert record[0]["unit"] == "replicated" and "none" in record[0]
    fitting = [r for r in record if "time_per_sample" in r]
    assert chosen["time_per_sample"] == min(r["time_per_sample"] for r in fitting)
    # the simulator prices the plan on the devices as the search did
    costs = sharded_costs(plan, prof, search)
    M = plan.schedule.microbatches
    sim = simulate(
        generate("1f1b", plan.num_stages, M, steps=1, replicas=[1] * plan.num_stages), costs
    )
    assert sim.step_time / (16) == pytest.approx(chosen["time_per_sample"], rel=1e-6)
    # after a JSON round trip too
    again = type(plan).from_json(plan.to_json())
    assert sharded_costs(again, prof, search).stages == costs.stages


def test_the_search_equals_the_best_of_each_unit_searched_alone():
    """The search is the best over its units (each searched alone, as plan_auto does
    without meshes on that unit's topology), not a heuristic over them."""
    prof = _chain(layers=3)
    topo = Topology.from_levels([2, 2], [1e10, 1e9], memory_per_device=1e12)
    units = unit_meshes(topo, annotated=True)
    search = _search(prof, units)
    kwargs = dict(batch_size=8, schedules=["1f1b", "zb-h1"])
    best = auto_choice(plan_auto(prof, topo, meshes=search, **kwargs))
    alone = [
        auto_choice(plan_auto(prof, topo, meshes=search.only(u), **kwargs)) for u in [(), *units]
    ]
    assert best["time_per_sample"] == min(a["time_per_sample"] for a in alone)
    # the replicated unit alone is plan_auto without meshes
    plain = auto_choice(plan_auto(prof, topo, **kwargs))
    assert alone[0]["time_per_sample"] == plain["time_per_sample"]


def test_no_mesh_fits_names_each_units_closest_per_stage():
    prof = _chain(layers=2, param=64 << 30)
    topo = Topology.flat(4, 1e11, memory_per_device=16e9)
    search = _search(prof, unit_meshes(topo, annotated=True))
    with pytest.raises(PlanError) as err:
        plan_auto(prof, topo, batch_size=8, meshes=search, schedules=["1f1b"])
    text = str(err.value)
    assert "no plan on any mesh fits" in text and "closest" in text
    for unit in ("replicated", "fsdp 4", "fsdp 2 x tensor 2", "tensor 4"):
        assert f"{unit}: " in text
    assert "stage 0" in text and "GiB over" in text
    with pytest.raises(PlanError, match="no costs for tensor 8"):
        search.only({"tensor": 8})
    with pytest.raises(PlanError, match="calibration"):
        plan_auto(prof, topo, meshes=search, calibration=object())


# -- from XLA, against the runtime -------------------------------------------------------


def test_an_unannotated_model_searches_data_and_fsdp_auto_and_the_plan_says_so():
    layers = sequential(nn.Dense(32), nn.relu, nn.Dense(32))
    x = jnp.zeros((8, 32))
    topo = Topology.flat(4, 1e10)
    search = search_meshes(layers, x, topo)
    assert not search.annotated and search.fsdp == "auto"
    assert list(search.costs) == [(("fsdp", 2),), (("fsdp", 4),)]
    # the weights are split (fsdp="auto"), the 8 rows over fsdp
    assert search.costs[(("fsdp", 4),)][0].param_bytes * 4 == pytest.approx(
        32 * 32 * 4 + 32 * 4, abs=64
    )
    prof = profile(layers, x, device_model="h100")
    plan = plan_auto(prof, topo, batch_size=16, meshes=search, schedules=["1f1b"])
    assert "only data and fsdp='auto'" in plan.options["meshes"]["note"]


@pytest.mark.parametrize(
    ("schedule", "unit"), [("1f1b", QUAD), ("gpipe", (("fsdp", 4),)), ("1f1b", TENSOR2)]
)
def test_the_unit_profiles_memory_predicts_the_runtimes_peak_per_device(schedule, unit):
    """A plan the search could return (two stages of data x unit on 8 devices, the unit's
    costs compiled by XLA): the simulator's runtime memory from the unit's profile within
    10% of the live bytes the runtime holds on each stage's devices."""
    width, num_layers, M, mb = 64, 4, 4, 8
    layers = sequential(*[megatron_dense(i, width) for i in range(num_layers)])
    topo = Topology.from_devices(jax.devices())
    xs = np.random.default_rng(0).standard_normal((8, mb, width)).astype(np.float32)
    search = search_meshes(layers, jnp.asarray(xs[0]), topo, max_size=mesh_size(unit)).only(unit)
    g = mesh_size(unit)
    d = 4 // g
    mesh = dict((("data", d), *unit)) if d > 1 else dict(unit)
    stages = (
        StagePlan(0, 1, tuple(range(4)), mesh=mesh),
        StagePlan(2, 3, tuple(range(4, 8)), mesh=mesh),
    )
    pipe = Pipeline(
        layers,
        stages,
        lambda out, y: jnp.mean((out - y) ** 2),
        optax.adam(1e-3),
        schedule=ScheduleSpec(schedule, microbatches=M),
    )
    n = cost.microbatches_per_call(schedule, M)
    microbatches = [(xs[k % 8], xs[k % 8] * 0.5) for k in range(n)]
    measured = measured_peaks(pipe, pipe.init(jax.random.key(1), xs[0]), microbatches)

    prof = profile(layers, jnp.asarray(xs[0]), device_model="h100")
    planned = evaluate_partition(
        prof,
        topo,
        [(0, 1, 4), (2, 3, 4)],
        schedule=schedule,
        num_microbatches=M,
        meshes=[mesh, mesh],
    )
    costs = dataclasses.replace(sharded_costs(planned, prof, search), memory_model="runtime")
    # the simulator plays the plan on its units: each stage on d of them
    predicted = simulate(generate(schedule, 2, M, steps=n // M, replicas=[d, d]), costs).peak_memory
    for s in range(2):
        assert 0.9 * predicted[s] <= measured[s] <= 1.1 * predicted[s], (measured, predicted)


# -- the command line ----------------------------------------------------------------------


def test_pdjax_plan_mesh_auto_prints_each_stages_mesh_and_every_unit(capsys):
    from pdjax.apps.cli import main

    args = ["plan", "--model", "llama", "--config", "tiny", "--device-model", "h100"]
    args += ["--workers", "4", "--bandwidths", "1e11", "--schedule", "auto", "--mesh", "auto"]
    args += ["--microbatch-size", "4", "--batch-size", "16", "--memory-limit", "1.2e5", "--json"]
    assert main(args) == 0
    plan = __import__("pdjax.plan", fromlist=["Plan"]).Plan.from_json(capsys.readouterr().out)
    searched = {r["unit"]: r for r in plan.options["meshes"]["searched"]}
    assert set(searched) == {
        "replicated",
        "fsdp 2",
        "tensor 2",
        "fsdp 4",
        "fsdp 2 x tensor 2",
        "tensor 4",
    }
    assert "none" in searched["replicated"]  # 120 kB: the weights must be split
    assert all(st.mesh is not None for st in plan.stages)
    from pdjax.apps.commands.plan import render_auto, render_plan

    render_plan(plan)  # the tables `pdjax plan` prints without --json
    render_auto(plan)
    out = capsys.readouterr().out
    stages_table, _, units_table = out.partition("meshes searched")
    assert "replication / mesh" in stages_table and units_table
    from pdjax.mesh import describe_mesh

    assert describe_mesh(plan.stages[0].mesh) in stages_table  # each stage's mesh
    assert "fsdp 2 x tensor 2" in units_table  # every unit's best


def test_pdjax_plan_mesh_auto_refuses_what_it_cannot_search(capsys):
    from pdjax.apps.cli import main

    base = ["plan", "--workers", "4", "--mesh", "auto"]
    cases = [
        (["--model", "mlp"], "add --schedule auto"),
        (["--profile", "pipedream:vgg16", "--schedule", "auto"], "give --model, not --profile"),
    ]
    for extra, message in cases:
        assert main(base + extra) == 2
        assert message in capsys.readouterr().err


# -- pdjax train ---------------------------------------------------------------------------


def test_train_mesh_auto_is_refused_where_the_planner_does_not_plan():
    from pdjax.apps.train import TrainConfig
    from pdjax.errors import PipelineError

    common = dict(model="llama", config="tiny", dataset="text", devices=8, batch_size=16)
    TrainConfig(**common, schedule="auto", mesh="auto")  # accepted
    TrainConfig(**common, schedule="1f1b", plan="auto", mesh="auto")
    for settings in (
        dict(schedule="1f1b", plan="even", mesh="auto"),
        dict(schedule="dp", mesh="auto"),
        dict(schedule="interleaved", mesh="auto"),
    ):
        with pytest.raises(PipelineError, match="lets the planner choose each stage's mesh"):
            TrainConfig(**common, **settings)


def test_pdjax_train_plan_auto_mesh_auto_runs_the_sharded_plan_it_chose(
    monkeypatch, tmp_path, capsys
):
    """``--plan auto --schedule 1f1b --mesh auto`` on the MLP (no annotations: fsdp="auto"),
    the search held to fsdp 2 units, as a memory cap would force: the plan's stages are
    meshes, the runner shards them with the rules the search used, the run trains, and the
    plan file records the search."""
    import json

    from pdjax.apps.cli import main
    from pdjax.apps.train import runner
    from pdjax.partition.choosing import meshes

    real = meshes.search_meshes

    def only_fsdp(*args, **kwargs):
        return real(*args, **{**kwargs, "max_size": 2}).only(FSDP2)

    built = []
    real_rules = runner._rules
    monkeypatch.setattr(meshes, "search_meshes", only_fsdp)
    monkeypatch.setattr(runner, "_rules", lambda *a: built.append(real_rules(*a)) or built[-1])
    args = ["train", "--model", "mlp", "--dataset", "digits", "--devices", "4", "--epochs", "1"]
    args += ["--schedule", "1f1b", "--plan", "auto", "--mesh", "auto", "--microbatches", "2"]
    args += ["--batch-size", "16", "--no-plots", "--progress", "lines", "--out", str(tmp_path)]
    assert main(args) == 0
    assert "fsdp 2" in capsys.readouterr().out
    plan = json.loads((tmp_path / "1f1b" / "plan.json").read_text())
    searched = plan["options"]["meshes"]
    assert [r["unit"] for r in searched["searched"]] == ["fsdp 2"] and searched["fsdp"] == "auto"
    assert all(dict(st["mesh"]).get("fsdp") == 2 for st in plan["stages"])
    assert built and built[-1].fsdp == "auto"  # the runner split the unannotated weights
    (summary,) = json.loads((tmp_path / "summary.json").read_text())
    assert "fsdp 2)" in summary["plan"]
    (epoch,) = summary["history"]
    assert np.isfinite(epoch["train_loss"]) and epoch["updates"] > 0
