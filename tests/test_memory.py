"""Memory: live device bytes reach a steady level and stay there; no weight copies."""

import gc

import jax
import jax.numpy as jnp
import optax
import pytest
from measured import measured_peaks

from pdjax.models import get_model
from pdjax.pipeline import Pipeline, even_stages
from pdjax.schedules import ScheduleSpec


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
        schedule=ScheduleSpec(schedule, microbatches=M),
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


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_runtime_memory_model_predicts_the_measured_peak(schedule):
    """The simulator's runtime memory model against the live bytes the runtime holds after
    each operation (flush schedules peak after a forward, where nothing is freed, so the
    two views agree), and the planner's model below both by the gradient sum and the
    weights the call started from."""
    import dataclasses

    import flax.linen as nn
    import numpy as np

    from pdjax.layers import sequential
    from pdjax.partition import Topology, costs_from_plan, evaluate_partition
    from pdjax.profile import profile
    from pdjax.simulator import simulate

    width, num_layers, M, mb, steps = 64, 4, 4, 8, 2
    layers = sequential(*[nn.Dense(width) for _ in range(num_layers)])
    rng = np.random.default_rng(0)
    n = M * steps
    xs = rng.standard_normal((n, mb, width)).astype(np.float32)
    microbatches = [(xs[k], xs[k] * 0.5) for k in range(n)]
    pipe = Pipeline(
        layers,
        even_stages(num_layers, 2),
        lambda out, y: jnp.mean((out - y) ** 2),
        optax.adam(1e-3),
        schedule=ScheduleSpec(schedule, microbatches=M),
    )
    measured = measured_peaks(pipe, pipe.init(jax.random.key(1), xs[0]), microbatches)

    prof = profile(layers, jnp.asarray(xs[0]), device_model="h100")  # times: not used
    stages = [(s.first_layer, s.last_layer, 1) for s in pipe.stage_specs]
    plan = evaluate_partition(
        prof, Topology.from_devices(jax.devices()), stages, schedule=schedule, num_microbatches=M
    )
    planner = costs_from_plan(plan, prof)
    placed = xs[0].nbytes  # inputs at stage 0, targets (the same size) at stage 1
    runtime = dataclasses.replace(
        planner,
        stages=tuple(dataclasses.replace(st, input_bytes=placed) for st in planner.stages),
        memory_model="runtime",
    )
    sched = pipe.schedule(n)
    predicted = simulate(sched, runtime).peak_memory
    old = simulate(sched, planner).peak_memory
    for g in range(2):
        assert 0.9 * predicted[g] <= measured[g] <= 1.1 * predicted[g], (measured, predicted)
        params = planner.stages[g].param_bytes
        # the planner's model misses the gradient sum and the starting weights
        assert predicted[g] - old[g] >= 2 * params, (predicted, old)
        assert measured[g] > 1.3 * old[g], (measured, old)


@pytest.mark.parametrize("mesh", [None, {"fsdp": 8}])
def test_a_replicated_attention_stage_keeps_its_stash_split_by_rows(mesh):
    """One stage of Llama tiny on 8 devices, each microbatch split by rows (replicated, or
    a mesh of fsdp 8): the residuals the backward keeps are split by rows too (XLA left
    the attention's probabilities and masks whole on every device: 1.39x the runtime
    memory model replicated at this size, 2x on fsdp 8 for Llama small), so the measured
    peak per device is within 10% of the model's."""
    import dataclasses

    from pdjax.partition import Topology, costs_from_plan, evaluate_partition
    from pdjax.profile import profile
    from pdjax.schedules import generate
    from pdjax.simulator import simulate

    spec = get_model("llama", "tiny")
    x, y = spec.sample_batch(32, jax.random.key(0))
    n = len(spec.layers)
    prof = profile(spec.layers, x, device_model="h100")  # times: not used
    plan = evaluate_partition(
        prof, Topology.from_devices(jax.devices()), [(0, n - 1, 8)], schedule="gpipe",
        num_microbatches=1, meshes=None if mesh is None else [mesh],
    )  # fmt: skip
    pipe = Pipeline(
        spec.layers,
        plan,
        spec.loss,
        optax.adam(1e-3),
        schedule=ScheduleSpec("gpipe", microbatches=1),
    )
    (measured,) = measured_peaks(pipe, pipe.init(jax.random.key(1), x), [(x, y)])
    costs = dataclasses.replace(costs_from_plan(plan, prof), memory_model="runtime")
    (predicted,) = simulate(generate("gpipe", 1, 1, steps=1, replicas=[8]), costs).peak_memory
    assert 0.85 * predicted <= measured <= 1.1 * predicted, (measured, predicted)
