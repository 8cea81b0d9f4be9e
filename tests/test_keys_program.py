"""The ``KEYS`` program (each microbatch's PRNG key) is shared by every stage and pipeline
of a process on the same devices: it reads nothing of a stage's layers, so a process
compiles it once per device set and microbatch count."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from reference import pipeline_kwargs

import pdjax
from pdjax.partition import StagePlan
from pdjax.pipeline import Pipeline


def _pipeline(width, stages, **kw):
    layers = pdjax.sequential(nn.Dense(width), jnp.tanh, nn.Dense(3))
    return Pipeline(
        layers, stages, lambda y, t: jnp.mean((y - t) ** 2), optax.sgd(0.1), **pipeline_kwargs(**kw)
    )


def _bits(key):
    return np.asarray(jax.random.key_data(key))


def test_stages_and_pipelines_on_the_same_devices_share_one_keys_program():
    a = _pipeline(5, [StagePlan(0, 1, (0,)), StagePlan(2, 2, (1,))], microbatches=2)
    b = _pipeline(7, [StagePlan(0, 0, (1,)), StagePlan(1, 2, (0,))], microbatches=4)
    assert a.stages[0].program("KEYS") is b.stages[1].program("KEYS")  # device 0
    assert a.stages[1].program("KEYS") is b.stages[0].program("KEYS")  # device 1
    assert a.stages[0].program("KEYS") is not a.stages[1].program("KEYS")


def test_keys_are_the_microbatches_fold_ins_on_the_stages_devices():
    rng = jax.random.key(7)
    for stages, kw in (
        ([StagePlan(0, 2, (2, 3))], {}),  # replicated on two devices
        ([StagePlan(0, 2, (2, 3))], {"replication": "round-robin"}),  # a key per device
    ):
        pipe = _pipeline(5, stages, schedule="pipedream", **kw)
        stage = pipe.stages[0]
        assert stage.round_robin == ("replication" in kw)
        keys = stage.program("KEYS")(stage.place_weights(rng), 6, 4)
        if stage.round_robin:  # two groups of two: microbatches 6, 7 and 8, 9
            assert len(keys) == 2 and all(k.shape == (2,) for k in keys)
            keys = [k[i] for k in keys for i in range(2)]
        assert len(keys) == 4
        for k, key in enumerate(keys):
            np.testing.assert_array_equal(_bits(key), _bits(jax.random.fold_in(rng, 6 + k)))
        assert all(k.sharding.device_set == set(stage.devices) for k in keys)
