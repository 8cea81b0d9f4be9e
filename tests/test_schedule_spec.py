"""The plan is the contract: one typed :class:`~pdjax.schedules.ScheduleSpec` from the
planner to the runtime (docs/schedules.md#the-schedule-spec).

A spec is validated once against what its kind declares and round-trips through JSON
exactly; a ``Plan`` holds one (and old plan files still load); ``Pipeline(layers, plan,
loss_fn, optimizer)`` runs the plan as planned; a schedule read from PyTorch's CSV format
trains bit for bit like its named twin."""

import dataclasses
import inspect
import io
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pdjax
from pdjax.errors import PipelineError, PlanError, ScheduleError
from pdjax.models import get_model
from pdjax.partition import Plan, Topology, auto_choice
from pdjax.pipeline import Pipeline, even_stages
from pdjax.schedules import (
    SCHEDULES,
    ScheduleSpec,
    generate,
    schedule_kind,
)
from pdjax.schedules.torch_csv import read_torch_csv, write_torch_csv

FIXTURES = Path(__file__).parent / "fixtures"


def _specs():
    for name in SCHEDULES:
        kind = schedule_kind(name)
        yield ScheduleSpec(name, microbatches=4)
        if kind.chunks is None:
            yield ScheduleSpec(name, microbatches=4, chunks=3)
        if kind.takes("vertical_sync"):
            yield ScheduleSpec(name, vertical_sync=True, weight_stashing=False)
            yield ScheduleSpec(name, extra_in_flight=2, replication=("round-robin", "split"))
            yield ScheduleSpec(name, in_flight="paper", remat=("full", "dots"))
    yield ScheduleSpec("1f1b", 2, replication="split", grad_allreduce="backward", remat=True)


@pytest.mark.parametrize("spec", list(_specs()), ids=str)
def test_every_spec_round_trips_through_json_exactly(spec):
    text = json.dumps(spec.to_dict())
    back = ScheduleSpec.from_dict(json.loads(text))
    assert back == spec and json.dumps(back.to_dict()) == text


@pytest.mark.parametrize(
    "fields,message",
    [
        (dict(kind="gpipe", vertical_sync=True), "vertical_sync is an option of pipedream"),
        (dict(kind="1f1b", weight_stashing=False), "weight_stashing=False is an option of"),
        (dict(kind="zb-h1", extra_in_flight=1), "extra_in_flight=1 is an option of pipedream"),
        (dict(kind="2bw", in_flight="paper"), "in_flight='paper' is an option of pipedream"),
        (dict(kind="1f1b", chunks=2), "chunks=2 is an option of interleaved, not of 1f1b"),
        (dict(kind="zb-v", chunks=3), "zb-v runs two chunks per device group"),
        (dict(kind="dp"), "unknown schedule 'dp'"),
        (dict(kind="1f1b", microbatches=2.0), "microbatches must be an integer >= 1"),
        (dict(kind="1f1b", microbatches=0), "microbatches must be an integer >= 1"),
        (dict(kind="1f1b", microbatches=2**17), "microbatches must be at most 65536"),
        (dict(kind="pipedream", in_flight="paper", extra_in_flight=1), "pass one of them"),
        (dict(kind="pipedream", vertical_sync=1), "vertical_sync must be True or False"),
        (dict(kind="1f1b", replication="mirror"), "replication must be .split. or .round-robin."),
        (dict(kind="1f1b", grad_allreduce="never"), "grad_allreduce must be 'update'"),
        (dict(kind="1f1b", remat="sometimes"), "remat must be"),
    ],
)
def test_a_setting_the_kind_does_not_have_is_refused_when_the_spec_is_made(fields, message):
    with pytest.raises(ScheduleError, match=message):
        ScheduleSpec(**fields)


def test_from_dict_refuses_fields_it_does_not_know():
    with pytest.raises(ScheduleError, match=r"fields pdjax does not know: \['vsync'\]"):
        ScheduleSpec.from_dict({"kind": "pipedream", "vsync": True})
    with pytest.raises(ScheduleError, match="names no kind"):
        ScheduleSpec.from_dict({"microbatches": 2})
    assert ScheduleSpec.from_dict("gpipe") == ScheduleSpec("gpipe")


def test_generate_reads_the_spec_or_the_name_with_its_settings_alike():
    spec = ScheduleSpec("pipedream", microbatches=1, vertical_sync=True, extra_in_flight=1)
    by_spec = generate(spec, 3, stream=10)
    by_name = generate("pipedream", 3, 1, stream=10, vertical_sync=True, extra_in_flight=1)
    assert by_spec == by_name and by_spec.spec == spec
    with pytest.raises(ScheduleError, match="not both"):
        generate(spec, 3, vertical_sync=False)
    with pytest.raises(ScheduleError, match="differs from the spec's"):
        generate(spec, 3, 4)


def test_the_pipeline_takes_at_most_nine_parameters():
    # eight after the plan became the contract, and sharding= (how a sharded stage's
    # parameters map onto its mesh) since: schedule options never come back one by one
    params = list(inspect.signature(Pipeline.__init__).parameters)[1:]
    assert len(params) <= 9, params
    with pytest.raises(PipelineError, match=r"schedule=ScheduleSpec\('gpipe', microbatches=M\)"):
        Pipeline(get_model("mlp", "tiny").layers, even_stages(4, 2), _mse, optax.sgd(0.1),
                 schedule="gpipe")  # fmt: skip


def _mse(y, t):
    return jnp.mean((y - t) ** 2)


def _data(spec, steps, batch, seed=0):
    key = jax.random.key(seed)
    x = spec.sample_input(steps * batch, key)
    y = spec.sample_target(steps * batch, key)
    return [(x[i * batch : (i + 1) * batch], y[i * batch : (i + 1) * batch]) for i in range(steps)]


def _train(pipe, batches):
    state = pipe.init(jax.random.key(1), batches[0][0][:2])
    losses = []
    for batch in batches:
        state, metrics = pipe.step(state, batch)
        losses.append(np.asarray(metrics.loss))
    return losses, jax.tree.leaves(state.params)


def _same_bits(a, b):
    (la, pa), (lb, pb) = a, b
    assert [x.tobytes() for x in la] == [x.tobytes() for x in lb]
    assert len(pa) == len(pb)
    assert all(
        np.asarray(u).tobytes() == np.asarray(v).tobytes() for u, v in zip(pa, pb, strict=True)
    )


def _plan(spec, stages):
    return Plan(
        stages=tuple(stages),
        num_layers=stages[-1].last_layer + 1,
        topology=Topology.from_devices(jax.devices()[: len(stages)]),
        cost_model="pdjax",
        schedule=spec,
        partitioner="manual",
        microbatch_size=2,
        time_per_microbatch=0.0,
        single_device_time=0.0,
        data_parallel_time=0.0,
        noam=1,
    )


def test_a_plan_runs_as_planned_and_a_given_spec_replaces_its_own():
    model = get_model("mlp", "tiny")
    stages = even_stages(len(model.layers), 2)
    plan = _plan(ScheduleSpec("gpipe", microbatches=4), stages)
    pipe = Pipeline(model.layers, plan, model.loss, optax.adam(1e-2))
    assert pipe.spec == plan.schedule and pipe.schedule(4).name == "gpipe"
    batches = _data(model, 3, 8)
    as_planned = _train(pipe, batches)
    by_hand = Pipeline(model.layers, stages, model.loss, optax.adam(1e-2), schedule=plan.schedule)
    _same_bits(as_planned, _train(by_hand, batches))
    other = Pipeline(model.layers, plan, model.loss, optax.adam(1e-2),
                     schedule=ScheduleSpec("1f1b", microbatches=2))  # fmt: skip
    assert other.spec.kind == "1f1b" and other.microbatches == 2
    # plain stages without a schedule run 1F1B, one microbatch per step
    assert Pipeline(model.layers, stages, model.loss, optax.sgd(0.1)).spec == ScheduleSpec()


@pytest.mark.parametrize("source", ["torch fixture", "written by pdjax"])
def test_a_schedule_read_from_a_torch_csv_trains_bit_for_bit_like_its_named_twin(source):
    model = get_model("mlp", "tiny")
    stages = even_stages(len(model.layers), 2)
    if source == "torch fixture":  # torch's own 1F1B order, 2 ranks, 4 microbatches
        name, text = "1f1b", (FIXTURES / "torch_schedules" / "1f1b_2rank_4mb.csv").read_text()
    else:
        name, out = "gpipe", io.StringIO()
        write_torch_csv(generate("gpipe", 2, 4), out)
        text = out.getvalue()
    read = read_torch_csv(io.StringIO(text), name=name)
    assert read.name == name and read.num_microbatches == 4
    batches = _data(model, 3, 8)
    from_csv = Pipeline(model.layers, stages, model.loss, optax.adam(1e-2), schedule=read)
    assert from_csv.programs.fixed is read
    twin = Pipeline(model.layers, stages, model.loss, optax.adam(1e-2),
                    schedule=ScheduleSpec(name, microbatches=4))  # fmt: skip
    assert twin.programs.fixed is None
    _same_bits(_train(from_csv, batches), _train(twin, batches))


def test_a_given_schedule_is_refused_for_other_stages_or_another_call_length():
    model = get_model("mlp", "tiny")
    read = read_torch_csv(FIXTURES / "torch_schedules" / "1f1b_2rank_4mb.csv", name="1f1b")
    three = even_stages(len(model.layers), 3)
    with pytest.raises(PipelineError, match="has stages 2, the pipeline's stages 3"):
        Pipeline(model.layers, three, model.loss, optax.sgd(0.1), schedule=read)
    pipe = Pipeline(model.layers, even_stages(len(model.layers), 2), model.loss,
                    optax.sgd(0.1), schedule=read)  # fmt: skip
    ((x, y),) = _data(model, 1, 16)
    state = pipe.init(jax.random.key(0), x[:2])
    stream = [(x[2 * i : 2 * i + 2], y[2 * i : 2 * i + 2]) for i in range(8)]
    with pytest.raises(PipelineError, match="4 microbatches long; got a call of 8"):
        pipe.run(state, stream)  # two steps of 4: not the schedule given
    bad = dataclasses.replace(read, version_bound=(0, 0))
    with pytest.raises(ScheduleError):
        Pipeline(model.layers, even_stages(len(model.layers), 2), model.loss,
                 optax.sgd(0.1), schedule=bad)  # fmt: skip


def test_a_plan_holds_a_spec_and_says_what_to_write_for_a_name():
    stages = even_stages(4, 2)
    with pytest.raises(PlanError, match=r"write schedule=ScheduleSpec\('1f1b', microbatches=M\)"):
        _plan("1f1b", stages)
    plan = _plan(ScheduleSpec("pipedream", in_flight="full-rate", remat=("full", "none")), stages)
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.to_json() == plan.to_json()
    assert json.loads(plan.to_json())["format"] == "pdjax.plan/2"


def test_format_1_plan_without_a_choice_loads_with_its_spec():
    data = json.loads(_plan(ScheduleSpec("1f1b"), even_stages(4, 2)).to_json())
    data.update(format="pdjax.plan/1", schedule="pipedream", num_microbatches=3)
    data["options"] = {"in_flight": "paper", "optimizer_state_factor": 2.0}
    plan = Plan.from_dict(data)
    assert plan.schedule == ScheduleSpec("pipedream", microbatches=3, in_flight="paper")
    assert plan.options == {"optimizer_state_factor": 2.0} and auto_choice(plan) is None
    data["schedule"] = "gpipe"  # a format-1 in_flight on a schedule without it
    with pytest.raises(PlanError, match="schedule: in_flight='paper' is an option of pipedream"):
        Plan.from_dict(data)


def test_format_1_plan_of_plan_auto_loads_its_choice_into_the_spec():
    """A plan file written by an earlier pdjax (``pdjax plan --schedule auto``, kept among
    the committed benchmark results): the choice moves into the spec, the diagnostics stay
    in the options, and :func:`auto_choice` gives both as before."""
    path = FIXTURES / "plans" / "v1-plan-auto.json"
    raw = json.loads(path.read_text())
    assert raw["format"] == "pdjax.plan/1"
    plan = Plan.load(path)
    chosen = raw["options"]["auto"]
    assert plan.schedule == ScheduleSpec("pipedream", microbatches=4, remat=(False, False))
    assert set(plan.options["auto"]) == {"time_per_sample", "peak_memory", "fits", "calibrated"}
    record = auto_choice(plan)
    assert record is not None
    for key, value in chosen.items():
        assert record[key] == value, key
    assert Plan.from_json(plan.to_json()) == plan


def test_plan_auto_writes_its_choice_into_the_spec():
    from pdjax.profile import LayerProfile, Profile

    rng = np.random.default_rng(3)
    layers = [
        LayerProfile(
            f"l{i}",
            forward_seconds=float(rng.uniform(0.5, 3)) * 1e-3,
            backward_seconds=float(rng.uniform(1, 6)) * 1e-3,
            param_bytes=int(rng.integers(1, 50)) * 10**6,
            output_bytes=int(rng.integers(1, 20)) * 10**5,
            residual_bytes=int(rng.integers(1, 40)) * 10**6,
        )
        for i in range(8)
    ]
    plan = pdjax.partition.plan_auto(
        Profile.chain(layers, batch_size=8),
        Topology.from_devices(jax.devices()[:4]),
        batch_size=16,
        schedules=["gpipe", "1f1b", "pipedream"],
        allow_stale=True,
    )
    record = auto_choice(plan)
    assert record is not None
    spec = plan.schedule
    assert (spec.kind, spec.microbatches) == (record["schedule"], record["microbatches"])
    assert not set(plan.options["auto"]) & {"schedule", "microbatches", "policies", "stages"}
    assert record["stages"] == [[s.first_layer, s.last_layer, s.replicas] for s in plan.stages]
