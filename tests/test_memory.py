"""Memory: live device bytes reach a steady level and stay there; no weight copies."""

import gc

import jax
import optax
import pytest

from pdjax.models import get_model
from pdjax.pipeline.executor import Pipeline, even_stages


def _live_bytes():
    gc.collect()
    return sum(a.nbytes for a in jax.live_arrays() if not a.is_deleted())


@pytest.mark.parametrize("schedule", ["1f1b", "pipedream"])
def test_no_leak_over_50_steps(schedule):
    base = _live_bytes()  # whatever earlier tests in this process left alive
    spec = get_model("mlp", "tiny")
    key = jax.random.key(0)
    M, mb = 4, 4
    x, y = spec.sample_input(M * mb, key), spec.sample_target(M * mb, key)
    pipe = Pipeline(
        spec.layers,
        even_stages(len(spec.layers), 2),
        spec.loss,
        optax.adam(1e-3),
        schedule=schedule,
        microbatches=M,
    )
    state = pipe.init(jax.random.key(1), x[:mb])
    microbatches = pipe.split_batch((x, y))
    levels = []
    for step in range(50):
        if schedule == "pipedream":
            state, metrics = pipe.run(state, microbatches)
        else:
            state, metrics = pipe.step(state, (x, y))
        del metrics
        jax.block_until_ready(state)
        if step in (4, 49):
            levels.append(_live_bytes())
    assert levels[1] == levels[0], levels
    state_bytes = sum(a.nbytes for a in jax.tree.leaves(state) if hasattr(a, "nbytes"))
    # what is alive is the state plus the caller's inputs, nothing per microbatch or step
    inputs = sum(a.nbytes for a in jax.tree.leaves((x, y, microbatches)))
    assert levels[1] - base <= state_bytes + inputs + 1024, (levels, base, state_bytes, inputs)
