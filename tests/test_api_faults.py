"""The Pipeline and DataParallel APIs refuse wrong inputs with a PipelineError that names
what is wrong: batches whose leaves disagree on their rows, a loss that is not a scalar, a
state made by another pipeline (or runner), inputs of other shapes than the model takes,
bad numeric arguments, and arguments of the wrong type (a string as inputs, an int as the
key, a plain list as the model, float layers in a StagePlan)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from reference import pipeline_kwargs

import pdjax
from pdjax.errors import LayerError, PipelineError, PlanError
from pdjax.partition import StagePlan
from pdjax.pipeline import Pipeline, PipelineState
from pdjax.runners import DataParallel, DPState
from pdjax.schedules import ScheduleSpec


def layers():
    return pdjax.sequential(nn.Dense(16), jnp.tanh, nn.Dense(16), nn.Dense(4))


def mse(y, t):
    return jnp.mean((y - t) ** 2)


def data(n, features=8, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype(np.float32)
    return x, rng.normal(size=(n, 4)).astype(np.float32)


def pipe_of(plan=None, optimizer=None, loss_fn=mse, **kw):
    plan = pdjax.even_stages(4, 2) if plan is None else plan
    kw.setdefault("microbatches", 2)
    return Pipeline(layers(), plan, loss_fn, optimizer or optax.sgd(0.1), **pipeline_kwargs(**kw))


def started(**kw):
    pipe = pipe_of(**kw)
    x, _ = data(4)
    return pipe, pipe.init(jax.random.key(0), x)


# -- rows: every leaf of (inputs, targets) has the same leading dimension -------------------


def test_split_batch_refuses_targets_with_more_rows_than_inputs():
    pipe, _ = started()
    x, t = data(16)
    wrong = np.zeros_like(t)
    with pytest.raises(PipelineError, match=r"targets.*32 rows.*inputs.*16"):
        pipe.split_batch((x, np.concatenate([wrong, t])))


def test_split_batch_refuses_targets_with_fewer_rows_than_inputs():
    pipe, state = started()
    x, t = data(16)
    with pytest.raises(PipelineError, match=r"targets.*8 rows.*inputs.*16"):
        pipe.step(state, (x, t[:8]))


def test_split_batch_names_the_leaf_that_disagrees_in_a_nested_batch():
    pipe, _ = started()
    x, t = data(16)
    with pytest.raises(PipelineError, match=r"targets\['b'\].*12 rows"):
        pipe.split_batch((x, {"a": t, "b": t[:12]}))


def test_split_batch_refuses_a_scalar_leaf():
    pipe, _ = started()
    x, t = data(16)
    with pytest.raises(PipelineError, match=r"targets\[1\].*no leading"):
        pipe.split_batch((x, (t, np.float32(1.0))))


def test_split_batch_still_refuses_rows_that_do_not_divide_into_microbatches():
    pipe, _ = started()
    x, t = data(15)
    with pytest.raises(PipelineError, match="15 samples"):
        pipe.split_batch((x, t))


def test_run_refuses_a_microbatch_whose_targets_have_other_rows():
    pipe, state = started()
    x, t = data(8)
    mbs = [(x[:4], t[:4]), (x[4:], np.concatenate([t[4:], t[4:]]))]
    with pytest.raises(PipelineError, match=r"microbatch 1.*targets.*8 rows.*inputs.*4"):
        pipe.run(state, mbs)
    # the state was not consumed: the right microbatches still run
    state, metrics = pipe.run(state, [(x[:4], t[:4]), (x[4:], t[4:])])
    assert np.isfinite(metrics.loss)


def test_run_refuses_the_whole_batch_in_place_of_microbatches():
    pipe, state = started()
    x, t = data(8)
    with pytest.raises(PipelineError, match=r"\(inputs, targets\) pair.*split_batch"):
        pipe.run(state, (x, t))


def test_evaluate_refuses_targets_with_other_rows():
    pipe, state = started()
    x, t = data(8)
    with pytest.raises(PipelineError, match=r"batch 1.*targets.*16 rows.*inputs.*8"):
        pipe.evaluate(state, [(x, t), (x, np.concatenate([t, t]))])


def test_predict_refuses_input_leaves_with_other_rows():
    first = pdjax.sequential(lambda d: d["a"] + d["b"], nn.Dense(4))
    pipe = Pipeline(first, pdjax.even_stages(2, 2), mse, optax.sgd(0.1))
    a = np.ones((8, 3), np.float32)
    state = pipe.init(jax.random.key(0), {"a": a, "b": a})
    with pytest.raises(PipelineError, match=r"inputs\['b'\].*6 rows.*inputs\['a'\].*8"):
        pipe.predict(state, {"a": a, "b": a[:6]})


@pytest.mark.parametrize("size", [0, 2.5, "4"])
def test_predict_refuses_a_batch_size_that_is_not_a_positive_integer(size):
    pipe, state = started()
    x, _ = data(8)
    with pytest.raises(PipelineError, match="batch_size"):
        pipe.predict(state, x, batch_size=size)


# -- a loss that is not a scalar, under every schedule ------------------------------------

SCHEDULES = {
    "gpipe": dict(schedule="gpipe"),
    "1f1b": dict(schedule="1f1b"),
    "zb-h1": dict(schedule="zb-h1"),
    "zb-h2": dict(schedule="zb-h2"),
    "pipedream": dict(schedule="pipedream"),
    "2bw": dict(schedule="2bw"),
    "interleaved": dict(
        schedule="interleaved",
        chunks=2,
        plan=[StagePlan(i, i, (i % 2,)) for i in range(4)],
    ),
    "zb-v": dict(schedule="zb-v", plan=[StagePlan(i, i, (min(i, 3 - i),)) for i in range(4)]),
    "round-robin": dict(
        schedule="gpipe",
        plan=[StagePlan(0, 1, (0,)), StagePlan(2, 3, (1, 2))],
        replication="round-robin",
    ),
}


@pytest.mark.parametrize("case", sorted(SCHEDULES))
def test_a_vector_loss_is_refused_under_every_schedule(case):
    pipe, state = started(loss_fn=lambda y, t: ((y - t) ** 2).mean(axis=0), **SCHEDULES[case])
    x, t = data(8)
    with pytest.raises(PipelineError, match=r"float32\[4\]: reduce it with \.mean\(\)"):
        pipe.run(state, pipe.split_batch((x, t)))


def test_a_vector_loss_is_refused_by_evaluate():
    pipe, state = started(loss_fn=lambda y, t: ((y - t) ** 2).mean(axis=0))
    x, t = data(8)
    with pytest.raises(PipelineError, match=r"float32\[4\]: reduce it with \.mean\(\)"):
        pipe.evaluate(state, [(x, t)])


def test_targets_the_loss_cannot_take_are_refused_naming_their_shapes():
    pipe, state = started()
    x, _ = data(8)
    t = np.zeros((8, 3), np.float32)  # the model puts out 4 features
    with pytest.raises(PipelineError, match=r"loss_fn.*float32\[4, 4\].*float32\[4, 3\]"):
        pipe.run(state, pipe.split_batch((x, t)))


# -- a state made by another pipeline -----------------------------------------------------


def test_run_refuses_a_state_of_a_plan_with_other_stage_count():
    _, state = started(plan=pdjax.even_stages(4, 3))
    pipe, _ = started()
    x, t = data(8)
    with pytest.raises(PipelineError, match=r"3 stages.*2 stages.*another Pipeline.*init"):
        pipe.run(state, pipe.split_batch((x, t)))


def test_run_refuses_a_state_of_a_plan_with_other_stage_bounds():
    _, state = started(plan=[StagePlan(0, 0, (0,)), StagePlan(1, 3, (1,))])
    pipe, _ = started()
    x, t = data(8)
    with pytest.raises(PipelineError, match=r"stage 0.*1 layers.*2 layers.*another Pipeline"):
        pipe.run(state, pipe.split_batch((x, t)))


def test_run_refuses_a_state_of_another_optimizer():
    _, state = started(optimizer=optax.adam(1e-3))
    pipe, _ = started(optimizer=optax.sgd(0.1))
    x, t = data(8)
    with pytest.raises(PipelineError, match=r"optimizer state.*another.*optimizer.*init"):
        pipe.run(state, pipe.split_batch((x, t)))


def test_run_refuses_a_state_of_a_pipeline_that_never_made_one():
    """The pipeline has not made a state itself: what its init would make is derived."""
    _, state = started(optimizer=optax.adam(1e-3))
    pipe = pipe_of(optimizer=optax.sgd(0.1))
    x, t = data(8)
    with pytest.raises(PipelineError, match=r"optimizer state.*another.*optimizer"):
        pipe.run(state, pipe.split_batch((x, t)))


def test_a_state_of_an_equal_pipeline_runs():
    _, state = started(optimizer=optax.adam(1e-3))
    pipe = pipe_of(optimizer=optax.adam(1e-3))
    x, t = data(8)
    for _ in range(2):
        state, metrics = pipe.run(state, pipe.split_batch((x, t)))
    assert np.isfinite(metrics.loss)


def test_evaluate_refuses_a_state_of_another_plan():
    _, state = started(plan=pdjax.even_stages(4, 3))
    pipe, _ = started()
    x, t = data(8)
    with pytest.raises(PipelineError, match=r"3 stages.*2 stages"):
        pipe.evaluate(state, [(x, t)])


def test_run_refuses_what_is_not_a_pipeline_state():
    pipe, state = started()
    x, t = data(8)
    with pytest.raises(PipelineError, match="PipelineState"):
        pipe.run(tuple(state)[:3], pipe.split_batch((x, t)))


# -- inputs of other shapes than the model takes ------------------------------------------


def test_run_refuses_inputs_of_another_feature_size_naming_the_shapes():
    pipe, state = started()
    x, t = data(8, features=6)  # init saw 8 features
    with pytest.raises(PipelineError, match=r"layer 0.*float32\[4, 6\].*float32\[4, 8\]"):
        pipe.run(state, pipe.split_batch((x, t)))
    x, t = data(8)  # the state was not consumed
    state, metrics = pipe.run(state, pipe.split_batch((x, t)))
    assert np.isfinite(metrics.loss)


def test_predict_refuses_inputs_of_another_feature_size():
    pipe, state = started()
    x, _ = data(8, features=6)
    with pytest.raises(PipelineError, match=r"layer 0.*float32\[8, 6\]"):
        pipe.predict(state, x)


def test_inputs_of_another_batch_size_than_init_saw_run():
    pipe, state = started()  # init saw 4 rows
    x, t = data(16)
    state, metrics = pipe.run(state, pipe.split_batch((x, t)))
    assert np.isfinite(metrics.loss)


# -- numeric constructor arguments ---------------------------------------------------------


@pytest.mark.parametrize("value", [2.5, 0, -1, True, "2", None])
def test_microbatches_must_be_a_positive_integer(value):
    with pytest.raises(
        PipelineError, match=rf"microbatches must be an integer >= 1, got {value!r}"
    ):
        pipe_of(microbatches=value)


def test_microbatches_may_be_a_numpy_integer():
    assert pipe_of(microbatches=np.int64(2)).microbatches == 2


@pytest.mark.parametrize("value", [1.5, 0, False, "2"])
def test_chunks_must_be_a_positive_integer(value):
    with pytest.raises(PipelineError, match="chunks must be an integer >= 1"):
        pipe_of(chunks=value, schedule="interleaved")


@pytest.mark.parametrize("value", [0.5, -1, True, "1"])
def test_extra_in_flight_must_be_a_non_negative_integer(value):
    with pytest.raises(PipelineError, match="extra_in_flight must be an integer >= 0"):
        pipe_of(extra_in_flight=value, schedule="pipedream")


def test_run_refuses_a_state_of_a_wider_model_naming_the_layer_and_shapes():
    wide = pdjax.sequential(nn.Dense(16), jnp.tanh, nn.Dense(32), nn.Dense(4))
    other = Pipeline(
        wide,
        pdjax.even_stages(4, 2),
        mse,
        optax.sgd(0.1),
        schedule=ScheduleSpec("1f1b", microbatches=2),
    )
    x, t = data(8)
    state = other.init(jax.random.key(0), x[:4])
    pipe, _ = started()
    with pytest.raises(PipelineError, match=r"stage 1.*layer 2.*\[32\].*\[16\].*another Pipeline"):
        pipe.run(state, pipe.split_batch((x, t)))


def test_inputs_that_fit_another_state_of_the_same_pipeline_are_refused():
    """A pipeline initialised for two input sizes checks each call's inputs against the
    weights of the state it is given, not against the inputs an earlier call took."""
    pipe = pipe_of()
    x8, t = data(8)
    x6, _ = data(8, features=6)
    state8 = pipe.init(jax.random.key(0), x8[:4])
    state6 = pipe.init(jax.random.key(0), x6[:4])
    state8, _ = pipe.run(state8, pipe.split_batch((x8, t)))
    with pytest.raises(PipelineError, match=r"layer 0.*float32\[4, 8\]"):
        pipe.run(state6, pipe.split_batch((x8, t)))
    state6, metrics = pipe.run(state6, pipe.split_batch((x6, t)))
    assert np.isfinite(metrics.loss)


# -- arguments of the wrong type: refused at the call, before anything compiles -----------


@pytest.fixture(scope="module")
def pipe_and_state():
    """One initialised pipeline for the refusals below (none of them consumes the state)."""
    return started()


def dp_of(**kw):
    return DataParallel(layers(), mse, optax.sgd(0.1), devices=jax.devices()[:2], **kw)


def fake_dp_state():
    """A DPState to reach a DataParallel call's checks (refused before it is read)."""
    return DPState([], [], (), 0, jax.random.key(0))


def test_a_string_as_inputs_is_refused_naming_the_leaf(pipe_and_state):
    pipe, state = pipe_and_state
    _, t = data(8)
    with pytest.raises(PipelineError, match=r"inputs is str 'abc', not an array of numbers"):
        pipe.step(state, ("abc", t))
    with pytest.raises(PipelineError, match=r"inputs\['ids'\] is an array of <U3"):
        pipe.predict(state, {"ids": np.array(["abc"] * 8)})
    with pytest.raises(PipelineError, match=r"batch 0: inputs is str 'abc'"):
        pipe.evaluate(state, [("abc", t)])
    with pytest.raises(PipelineError, match=r"init: sample is str 'abc', not an array"):
        pipe_of().init(jax.random.key(0), "abc")


def test_a_string_as_inputs_is_refused_by_data_parallel():
    dp, state = dp_of(), fake_dp_state()
    _, t = data(8)
    with pytest.raises(PipelineError, match=r"batch\[0\] is str 'abc', not an array"):
        dp.step(state, ("abc", t))
    with pytest.raises(PipelineError, match=r"step takes one \(inputs, targets\) pair, got a str"):
        dp.step(state, "abc")
    with pytest.raises(PipelineError, match=r"inputs is str 'abc'"):
        dp.predict(state, "abc")
    with pytest.raises(PipelineError, match=r"init: sample is str 'abc', not an array"):
        dp.init(jax.random.key(0), "abc")


@pytest.mark.parametrize("make", [pipe_of, lambda **kw: dp_of()], ids=["Pipeline", "DP"])
@pytest.mark.parametrize("key", [0, np.int64(3), 1.5, "0", np.zeros((2, 2), np.uint32)])
def test_init_refuses_what_is_not_one_prng_key(make, key):
    x, _ = data(4)
    with pytest.raises(PipelineError, match=r"init rng must be one PRNG key, e\.g\. jax\.random"):
        make().init(key, x)


def test_init_refuses_a_batch_of_keys():
    x, _ = data(4)
    with pytest.raises(PipelineError, match=r"one PRNG key.*key<fry>\[2\]"):
        pipe_of().init(jax.random.split(jax.random.key(0)), x)


@pytest.mark.parametrize(
    "stage,match",
    [
        (lambda: StagePlan(0.0, 3.0, (0,)), "first_layer must be an integer, got float 0.0"),
        (lambda: StagePlan(0, 3, 0), "devices must be a tuple of device indices"),
        (lambda: StagePlan(0, 3, "01"), "devices must be a tuple of device indices"),
        (lambda: StagePlan(0, 3, (0.5,)), "devices entry must be an integer, got float 0.5"),
        (lambda: StagePlan(0, 3, (1, 1)), r"devices \[1, 1\] must be distinct"),
        (lambda: StagePlan(0, True, (0,)), "last_layer must be an integer, got bool"),
        (lambda: StagePlan(0, 3, (0,), in_flight=0), "in_flight must be >= 1"),
        (lambda: StagePlan(0, 3, (0,), compute_seconds=-1.0), "compute_seconds must be finite"),
    ],
)
def test_stage_plan_refuses_values_that_are_not_what_it_holds(stage, match):
    with pytest.raises(PlanError, match=match):
        stage()


def test_a_stage_plan_of_numpy_integers_is_plain_ints():
    stage = StagePlan(np.int64(0), np.int32(3), np.arange(2))
    assert (stage.first_layer, stage.last_layer, stage.devices) == (0, 3, (0, 1))
    assert all(type(v) is int for v in (stage.first_layer, stage.last_layer, *stage.devices))


@pytest.mark.parametrize("args", [(4.0, 2), (4, "2"), (4, 2, 1.0), (4, 2, 1, -1), (4, 2, True)])
def test_even_stages_refuses_what_is_not_an_integer(args):
    with pytest.raises(PipelineError, match=r"must be an integer|must be >= "):
        pdjax.even_stages(*args)


@pytest.mark.parametrize("runner", ["Pipeline", "DataParallel"])
def test_a_plain_list_of_modules_is_refused_saying_wrap_it(runner):
    modules = [nn.Dense(16), jnp.tanh, nn.Dense(4)]
    with pytest.raises(PipelineError, match=r"plain list of 3 items: wrap them with pdjax\.seq"):
        if runner == "Pipeline":
            Pipeline(modules, pdjax.even_stages(3, 1), mse, optax.sgd(0.1))
        else:
            DataParallel(modules, mse, optax.sgd(0.1))
    with pytest.raises(PipelineError, match=r"got Dense.*pdjax\.sequential"):
        DataParallel(nn.Dense(4), mse, optax.sgd(0.1))


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(loss_fn=3), "loss_fn must be a function.*got int 3"),
        (dict(optimizer=optax.adam), r"optimizer must be an optax.*call it"),
        (dict(optimizer="adam"), r"optimizer must be an optax GradientTransformation"),
    ],
)
def test_loss_fn_and_optimizer_must_be_what_they_are(kw, match):
    optimizer = kw.pop("optimizer", optax.sgd(0.1))
    loss_fn = kw.pop("loss_fn", mse)
    with pytest.raises(PipelineError, match=match):
        Pipeline(layers(), pdjax.even_stages(4, 2), loss_fn, optimizer)
    with pytest.raises(PipelineError, match=match):
        DataParallel(layers(), loss_fn, optimizer)


@pytest.mark.parametrize("value", [10**30, 2**16 + 1])
def test_microbatches_are_bounded(value):
    with pytest.raises(PipelineError, match=r"microbatches must be at most 65536"):
        pipe_of(microbatches=value)


def test_a_batch_smaller_than_the_microbatches_is_refused_saying_so(pipe_and_state):
    pipe = pipe_of(microbatches=8)
    x, t = data(4)
    with pytest.raises(PipelineError, match=r"8 microbatches: every microbatch needs at least one"):
        pipe.split_batch((x, t))


def test_each_runner_refuses_the_others_state(pipe_and_state):
    pipe, _ = pipe_and_state
    x, t = data(8)
    with pytest.raises(PipelineError, match=r"got a DPState \(a DataParallel's state"):
        pipe.step(fake_dp_state(), (x, t))
    pipe_state = PipelineState((), (), (), (), 0, jax.random.key(0))
    dp = dp_of()
    for call in (lambda: dp.step(pipe_state, (x, t)), lambda: dp.run(pipe_state, [(x, t)])):
        with pytest.raises(PipelineError, match=r"must be the DPState.*got a PipelineState"):
            call()
    with pytest.raises(PipelineError, match="batch_size must be an integer >= 1"):
        dp.predict(fake_dp_state(), x, batch_size="4")


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(schedule="pipedream", vertical_sync="yes"), "vertical_sync must be True or False"),
        (dict(schedule="pipedream", weight_stashing=0), "weight_stashing must be True or False"),
        (dict(devices=4), r"devices must be a sequence of jax\.Device, got int 4.*\[:4\]"),
        (dict(devices=[0, 1]), r"devices\[0\] is int 0, not a jax\.Device"),
        (dict(replication=3), "replication must be 'split', 'round-robin'"),
    ],
)
def test_pipeline_options_of_the_wrong_type_are_refused(kw, match):
    with pytest.raises(PipelineError, match=match):
        pipe_of(**kw)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(devices=2), r"devices must be a sequence of jax\.Device, got int 2"),
        (dict(donate="no"), "donate must be True or False"),
    ],
)
def test_data_parallel_options_of_the_wrong_type_are_refused(kw, match):
    with pytest.raises(PipelineError, match=match):
        DataParallel(layers(), mse, optax.sgd(0.1), **kw)


def test_call_arguments_of_the_wrong_type_are_refused(pipe_and_state):
    pipe, state = pipe_and_state
    x, t = data(8)
    mbs = pipe.split_batch((x, t))
    calls = [
        (lambda: pipe.step(state, (x, t), timeline="no"), "timeline must be True or False"),
        (lambda: pipe.run(state, mbs, on_loss=3), r"on_loss must be None or a function"),
        (lambda: pipe.run(state, None), r"run takes a sequence of microbatches.*None"),
        (lambda: pipe.evaluate(state, [(x, t)], metrics=3), "metrics must be None or a func"),
        (lambda: pipe.evaluate(state, {"x": x}), r"evaluate takes a sequence of batches"),
        (lambda: dp_of().run(fake_dp_state(), [(x, t)], on_loss=3), "on_loss must be None"),
        (lambda: dp_of().run(fake_dp_state(), 7), r"run takes a sequence of batches"),
    ]
    for call, match in calls:
        with pytest.raises(PipelineError, match=match):
            call()


@pytest.mark.parametrize(
    "names,match",
    [(3, "names must be a list of strings"), ("ab", "names must be a list"), ([3], "non-empty")],
)
def test_sequential_refuses_names_that_are_not_strings(names, match):
    with pytest.raises(LayerError, match=match):
        pdjax.sequential(nn.Dense(2), names=names)
