"""The Pipeline API refuses wrong inputs with a PipelineError that names what is wrong:
batches whose leaves disagree on their rows, a loss that is not a scalar, a state made by
another pipeline, inputs of other shapes than the model takes, bad numeric arguments."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pdjax
from pdjax.errors import PipelineError
from pdjax.partition import StagePlan
from pdjax.pipeline import Pipeline


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
    return Pipeline(layers(), plan, loss_fn, optimizer or optax.sgd(0.1), **kw)


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
    other = Pipeline(wide, pdjax.even_stages(4, 2), mse, optax.sgd(0.1), microbatches=2)
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
