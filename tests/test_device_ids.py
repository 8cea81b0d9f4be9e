"""Plan device ids: a plan made on real devices (``Topology.from_devices``) names them by
``jax.Device.id``; the pipeline finds them by id among its devices, in any order. Plans on
topology positions (``Topology.flat``) and hand-written stages keep index semantics."""

import jax
import optax
import pytest

import pdjax
from pdjax.errors import PipelineError
from pdjax.models import get_model
from pdjax.partition import Plan, Topology, evaluate_partition
from pdjax.pipeline import Pipeline
from pdjax.profile import profile
from pdjax.schedules import ScheduleSpec

MB, M = 4, 2  # samples per microbatch, microbatches per step


@pytest.fixture(scope="module")
def model():
    spec = get_model("mlp", "tiny")  # 4 layers
    x, y = spec.sample_batch(MB * M, 0)
    prof = profile(spec.layers, x[:MB], device_model="v100")  # a roofline: no timing runs
    return spec, prof, (x, y)


def _plan(prof, devices, stages=((0, 1, 1), (2, 2, 2), (3, 3, 1))):
    return evaluate_partition(
        prof,
        Topology.from_devices(devices),
        list(stages),
        schedule="1f1b",
        num_microbatches=M,
        microbatch_size=MB,
    )


def _run(spec, batch, plan, devices):
    """The pipeline on ``devices``, after one 1F1B step; checks the step's arrays are on
    the stages' devices. Returns the device ids per stage."""
    pipe = Pipeline(
        spec.layers,
        plan,
        spec.loss,
        optax.sgd(0.1),
        schedule=ScheduleSpec("1f1b", microbatches=M),
        devices=devices,
    )
    state = pipe.init(jax.random.key(0), batch[0][:MB])
    state, _ = pipe.step(state, batch)
    ids = [[d.id for d in st.devices] for st in pipe.stages]
    for s, stage in enumerate(pipe.stages):
        for leaf in jax.tree.leaves((state.params[s], state.opt_state[s])):
            assert leaf.devices() == set(stage.devices), (s, leaf.devices())
        assert list(pipe.placement.stages[s].devices) == ids[s]
    return ids


def test_plan_on_devices_4_to_7_lands_there(model):
    spec, prof, batch = model
    devs = jax.devices()
    planned = pdjax.plan_pipedream(
        prof,
        Topology.from_devices(devs[4:8]),
        schedule="1f1b",
        straight=True,
        num_microbatches=M,
        microbatch_size=MB,
    )
    assert {d for st in planned.stages for d in st.devices} <= {4, 5, 6, 7}
    assert _run(spec, batch, planned, devs) == [list(st.devices) for st in planned.stages]
    manual = _plan(prof, devs[4:8])
    assert [st.devices for st in manual.stages] == [(4,), (5, 6), (7,)]
    assert _run(spec, batch, manual, None) == [[4], [5, 6], [7]]  # default jax.devices()


def test_any_device_order_lands_by_id_also_after_json(model):
    spec, prof, batch = model
    devs = jax.devices()
    plan = _plan(prof, [devs[6], devs[2], devs[5], devs[0]])
    assert [st.devices for st in plan.stages] == [(6,), (2, 5), (0,)]
    reverse = list(reversed(devs))  # index d is id 7 - d: index semantics would miss
    assert _run(spec, batch, plan, reverse) == [[6], [2, 5], [0]]
    loaded = Plan.from_json(plan.to_json())
    assert loaded.topology.device_ids == (6, 2, 5, 0)
    assert loaded == plan
    assert _run(spec, batch, loaded, reverse) == [[6], [2, 5], [0]]


def test_unknown_device_id_says_which_and_what_to_do(model):
    spec, prof, _ = model
    devs = jax.devices()
    plan = _plan(prof, devs[4:8])
    with pytest.raises(PipelineError) as err:
        Pipeline(spec.layers, plan, spec.loss, optax.sgd(0.1), devices=devs[:4])
    msg = str(err.value)
    assert "device ids [4-7]" in msg and "visible devices (ids [0-3])" in msg
    assert "devices=" in msg and "re-plan" in msg and "Topology.from_devices" in msg
    remote = Topology.flat(4, 1e10)  # e.g. planned on another host's devices 9, 11, 12, 10
    remote = Topology(remote.levels, name="local", device_ids=(9, 11, 12, 10))
    foreign = evaluate_partition(
        prof, remote, [(0, 1, 1), (2, 2, 2), (3, 3, 1)], schedule="1f1b", num_microbatches=M
    )
    assert [st.devices for st in foreign.stages] == [(9,), (11, 12), (10,)]
    with pytest.raises(PipelineError, match=r"ids \[9-12\].*ids \[0-7\].*\[9, 11-12, 10\]"):
        Pipeline(spec.layers, foreign, spec.loss, optax.sgd(0.1))


def test_flat_topology_plan_keeps_index_semantics(model):
    spec, prof, batch = model
    plan = evaluate_partition(
        prof,
        Topology.flat(4, 1e10),
        [(0, 1, 1), (2, 2, 2), (3, 3, 1)],
        schedule="1f1b",
        num_microbatches=M,
        microbatch_size=MB,
    )
    assert plan.topology.device_ids is None
    assert [st.devices for st in plan.stages] == [(0,), (1, 2), (3,)]
    reverse = list(reversed(jax.devices()))
    assert _run(spec, batch, plan, reverse) == [[7], [6, 5], [4]]
    with pytest.raises(PipelineError, match="up to 3 but only 2 devices"):
        Pipeline(spec.layers, plan, spec.loss, optax.sgd(0.1), devices=reverse[:2])
