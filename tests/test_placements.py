"""``even_stages(..., placement=...)``: equal stages placed as a chunked schedule runs them
(``interleaved``: stage s on group s % P; ``zb-v``: the V), so that such a pipeline needs
no hand-placed devices, and trains as 1F1B does."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from reference import pipeline_kwargs

import pdjax
from pdjax.errors import PipelineError
from pdjax.pipeline import Pipeline, even_stages
from pdjax.schedules import ScheduleSpec, schedule_kind


def _devices(stages):
    return [s.devices for s in stages]


def test_zb_v_places_the_v():
    stages = even_stages(8, 4, placement="zb-v")
    assert _devices(stages) == [(0,), (1,), (1,), (0,)]
    assert [(s.first_layer, s.last_layer) for s in stages] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    groups = schedule_kind("zb-v").stage_groups(3, 2)
    assert [d[0] for d in _devices(even_stages(6, 6, placement="zb-v"))] == list(groups)


def test_interleaved_places_modulo_with_replicas_and_first_device():
    stages = even_stages(12, 6, replicas=2, first_device=1, placement="interleaved", chunks=3)
    assert _devices(stages) == [(1, 2), (3, 4)] * 3
    assert _devices(even_stages(8, 4, placement="interleaved", chunks=2)) == [(0,), (1,)] * 2


def test_one_stage_per_group_places_as_without_placement():
    for name in ("1f1b", "gpipe", "pipedream", "zb-h1"):
        assert even_stages(7, 3, placement=name) == even_stages(7, 3)
    assert even_stages(7, 3, placement="1f1b", chunks=1) == even_stages(7, 3)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        (dict(placement="v"), ["placement must be a schedule name", "zb-v"]),
        (dict(placement=2), ["placement must be a schedule name", "2"]),
        (dict(placement="interleaved"), ["chunks=v"]),
        (dict(chunks=2), ["chunks=2 goes with a chunked placement"]),
        (dict(placement="zb-v", chunks=3), ["chunks must be 2 or None"]),
        (dict(placement="1f1b", chunks=2), ["chunks must be 1 or None"]),
        (dict(placement="interleaved", chunks=0), ["chunks must be an integer >= 1"]),
        (dict(placement="interleaved", chunks=2.0), ["chunks must be an integer >= 1"]),
        (dict(placement="interleaved", chunks=True), ["chunks must be an integer >= 1"]),
    ],
)
def test_bad_placements_are_refused(kwargs, words):
    with pytest.raises(PipelineError) as e:
        even_stages(8, 4, **kwargs)
    for w in words:
        assert w in str(e.value)


def test_a_stage_count_not_a_multiple_of_the_chunks_is_refused():
    with pytest.raises(PipelineError, match="multiple of 2, got 3"):
        even_stages(8, 3, placement="zb-v")
    with pytest.raises(PipelineError, match="multiple of 3, got 4"):
        even_stages(8, 4, placement="interleaved", chunks=3)


def _layers():
    return pdjax.sequential(
        nn.Dense(16), jnp.tanh, nn.Dense(16), jnp.tanh, nn.Dense(16), jnp.tanh, nn.Dense(16),
        nn.Dense(4),
    )  # fmt: skip


def _loss(y, t):
    return optax.softmax_cross_entropy_with_integer_labels(y, t).mean()


def _losses(plan, schedule, **kw):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 8)).astype(np.float32)
    t = rng.integers(0, 4, 32).astype(np.int32)
    kw = pipeline_kwargs(schedule=schedule, microbatches=4, **kw)
    pipe = Pipeline(_layers(), plan, _loss, optax.adam(1e-2), **kw)
    state = pipe.init(jax.random.key(0), x[:8])
    losses = []
    for _ in range(3):
        state, metrics = pipe.run(state, pipe.split_batch((x, t)))
        losses += [float(v) for v in metrics.losses]
    return np.array(losses)


def test_zb_v_and_interleaved_pipelines_built_by_placement_train_as_1f1b():
    """Flush schedules compute sequential training: a ``zb-v`` and an ``interleaved``
    pipeline placed by ``even_stages`` give 1F1B's losses on the same stages' cuts."""
    reference = _losses(even_stages(8, 4), "1f1b")
    zb_v = _losses(even_stages(8, 4, placement="zb-v"), "zb-v")
    interleaved = _losses(
        even_stages(8, 4, placement="interleaved", chunks=2), "interleaved", chunks=2
    )
    assert np.all(np.isfinite(reference)) and reference[-1] < reference[0]
    np.testing.assert_allclose(zb_v, reference, rtol=1e-6)
    np.testing.assert_allclose(interleaved, reference, rtol=1e-6)


def test_plain_even_stages_are_refused_by_zb_v_naming_the_placement():
    with pytest.raises(PipelineError, match="must use the devices of stage"):
        Pipeline(_layers(), even_stages(8, 4), _loss, optax.sgd(0.1), schedule=ScheduleSpec("zb-v"))
