"""PipeDream's round-robin replication run by the runtime: a stage on r devices takes r
whole microbatches at once, one per device. Under flush schedules it equals sequential
training; under ``pipedream`` it equals the delayed-update recurrence of
``docs/semantics.md#round-robin`` with one update per group, written here from the formula
(not from pdjax's schedule code)."""

import math

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from reference import (
    Dense32,
    DenseDropout,
    delayed_training,
    flush_training,
    random_stream,
    replica_plan,
    xent,
)

from pdjax.errors import PipelineError
from pdjax.layers import sequential
from pdjax.partition import StagePlan
from pdjax.pipeline import Pipeline
from pdjax.schedules import ScheduleSpec


class DenseBN(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        return nn.BatchNorm(use_running_average=not train)(nn.Dense(32)(x))


def _close(a, b, rtol=1e-5, atol=1e-6):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=rtol, atol=atol), a, b)


CONFIGS = [
    # (stage layer bounds, replicas, layers): stage s is round-robin when it has r > 1
    (((0, 2), (2, 4)), (2, 1)),
    (((0, 2), (2, 4)), (1, 2)),
    (((0, 1), (1, 3), (3, 4)), (1, 3, 1)),
    (((0, 1), (1, 3), (3, 4)), (2, 1, 3)),
]


@pytest.mark.parametrize(
    "bounds,replicas,opt_name",
    [
        (*CONFIGS[0], "sgd"),
        (*CONFIGS[0], "adam"),
        (*CONFIGS[1], "adam"),
        (*CONFIGS[2], "sgd"),
        (*CONFIGS[3], "adam"),
    ],
)
def test_pipedream_round_robin_equals_its_recurrence(bounds, replicas, opt_name):
    """Group g of stage s (microbatches g n_s .. g n_s + n_s - 1) runs forward and backward
    at version max(0, g - q_s + 1), q_s the groups the stage keeps in flight; each group's
    update applies its mean gradient. A stream of at least 3P groups at every stage;
    dropout draws each microbatch's own masks."""
    layers = sequential(Dense32(), DenseDropout(), Dense32(), nn.Dense(10))
    opt = optax.sgd(0.1) if opt_name == "sgd" else optax.adam(1e-2)
    n = list(replicas)  # every replicated stage here is round-robin
    P = len(n)
    groups = 3 * P
    N = groups * math.lcm(*n)
    stream = random_stream(N)
    pipe = Pipeline(
        layers,
        replica_plan(bounds, replicas),
        xent,
        opt,
        schedule=ScheduleSpec("pipedream", replication="round-robin"),
    )
    state = pipe.init(jax.random.key(0), stream[0][0])
    start = pipe.variables(state)
    state, metrics = pipe.run(state, stream)
    # q_s: the groups in flight the schedule keeps at stage s (at least the least count,
    # chosen for full rate: tests/test_schedule.py); the recurrence holds for any q_s
    sched = pipe.schedule(N)
    q = [sched.in_flight_bound[s] // n[s] for s in range(P)]
    least = [max(math.ceil(sum(n[s:]) / n[s]), 1) for s in range(P)]
    assert all(q[s] >= least[s] for s in range(P)), (q, least)
    assert metrics.peak_versions == tuple(min(q[s], N // n[s]) for s in range(P))
    assert state.updates == tuple(N // n[s] for s in range(P))

    ref = delayed_training(
        layers,
        xent,
        opt,
        start,
        stream,
        bounds=bounds,
        version_of=lambda s, k: max(0, k // n[s] - q[s] + 1),
        rng=state.rng,
        M=n,
    )
    got = [list(p) for p in state.params]
    _close(got, ref)


@pytest.mark.parametrize(
    "schedule,replicas", [("1f1b", (3, 1)), ("gpipe", (1, 2)), ("1f1b", (2, 2))]
)
def test_flush_round_robin_equals_sequential_training(schedule, replicas):
    layers = sequential(Dense32(), DenseDropout(), Dense32(), nn.Dense(10))
    M = 6 if 3 in replicas else 4
    stream = random_stream(2 * M)
    pipe = Pipeline(
        layers,
        replica_plan(((0, 2), (2, 4)), replicas),
        xent,
        optax.adam(1e-2),
        schedule=ScheduleSpec(schedule, microbatches=M, replication="round-robin"),
    )
    state = pipe.init(jax.random.key(0), stream[0][0])
    start = pipe.variables(state)
    losses = []
    for t in range(2):
        state, metrics = pipe.run(state, stream[t * M : (t + 1) * M])
        losses += [float(v) for v in metrics.losses]
    ref, _, ref_losses = flush_training(
        layers, xent, optax.adam(1e-2), start, stream, M=M, rng=state.rng
    )
    np.testing.assert_allclose(losses, [float(v) for v in ref_losses], rtol=1e-5)
    _close([v["params"] for v in pipe.variables(state)], ref)


def test_2bw_round_robin_equals_its_recurrence():
    layers = sequential(Dense32(), Dense32(), Dense32(), nn.Dense(10))
    M, bounds = 4, ((0, 2), (2, 4))
    stream = random_stream(3 * M)
    pipe = Pipeline(
        layers,
        replica_plan(bounds, (2, 1)),
        xent,
        optax.sgd(0.1),
        schedule=ScheduleSpec("2bw", microbatches=M, replication="round-robin"),
    )
    state = pipe.init(jax.random.key(0), stream[0][0])
    start = pipe.variables(state)
    state, _ = pipe.run(state, stream)
    ref = delayed_training(
        layers,
        xent,
        optax.sgd(0.1),
        start,
        stream,
        bounds=bounds,
        version_of=lambda s, k: max(0, k // M - 1),
        rng=state.rng,
        M=M,
    )
    _close([list(p) for p in state.params], ref)


@pytest.mark.parametrize("schedule,M", [("1f1b", 4), ("pipedream", 1)])
def test_round_robin_all_reduces_once_per_update(schedule, M):
    """Counted in the compiled programs run: no all-reduce in a forward or backward of the
    round-robin stage, one per update (per step of M under 1f1b, per group of r under
    pipedream); the single-device stage none."""
    layers = sequential(Dense32(), Dense32(), Dense32(), nn.Dense(10))
    stream = random_stream(8)
    pipe = Pipeline(
        layers,
        replica_plan(((0, 2), (2, 4)), (2, 1)),
        xent,
        optax.sgd(0.1),
        schedule=ScheduleSpec(schedule, microbatches=M, replication="round-robin"),
    )
    state = pipe.init(jax.random.key(0), stream[0][0])
    _, metrics = pipe.run(state, stream, collectives=True)
    counts = metrics.all_reduces
    assert sum(counts.get(k, 0) for k in ("F", "B", "FB", "MOVE")) == 0, counts
    updates = len(stream) // (M if schedule == "1f1b" else 2)
    assert sum(counts.get(k, 0) for k in ("BU", "U", "FBU")) == updates, counts


def test_gather_and_part_do_not_copy():
    """The group a round-robin stage computes on is assembled from the microbatches where
    they arrived (each device's shard is the piece's own buffer), and its outputs leave as
    the shards themselves."""
    from pdjax.pipeline import Stage
    from pdjax.pipeline.executor.interpreter import gather, part

    stage = Stage(0, [], 0, jax.devices()[:2], optax.sgd(0.1), round_robin=True)
    pieces = [jax.device_put(np.full((3, 2), d, np.float32), jax.devices()[d]) for d in range(2)]
    (group,) = gather(stage, *pieces)
    assert group.shape == (6, 2) and group.sharding == stage.batch_sharding
    for sh in group.addressable_shards:
        d = stage.devices.index(sh.device)
        assert sh.data.unsafe_buffer_pointer() == pieces[d].unsafe_buffer_pointer()
    back = part(stage, False, group)
    assert [b.unsafe_buffer_pointer() for b in back] == [p.unsafe_buffer_pointer() for p in pieces]


def test_round_robin_refuses_what_it_cannot_do_exactly():
    layers = sequential(Dense32(), Dense32(), Dense32(), nn.Dense(10))
    plan = replica_plan(((0, 2), (2, 4)), (2, 1))
    with pytest.raises(PipelineError, match="zb-h1"):
        Pipeline(
            layers,
            plan,
            xent,
            optax.sgd(0.1),
            schedule=ScheduleSpec("zb-h1", microbatches=4, replication="round-robin"),
        )
    with pytest.raises(PipelineError, match="multiple of 2"):
        Pipeline(
            layers,
            plan,
            xent,
            optax.sgd(0.1),
            schedule=ScheduleSpec("1f1b", microbatches=3, replication="round-robin"),
        )
    with pytest.raises(PipelineError, match="'split' or 'round-robin'"):
        Pipeline(
            layers, plan, xent, optax.sgd(0.1), schedule=ScheduleSpec("1f1b", replication="rr")
        )
    pipe = Pipeline(
        layers,
        plan,
        xent,
        optax.sgd(0.1),
        schedule=ScheduleSpec("pipedream", replication="round-robin"),
    )
    stream = random_stream(3)
    state = pipe.init(jax.random.key(0), stream[0][0])
    with pytest.raises(PipelineError, match="multiple of 2"):
        pipe.run(state, stream)
    bn = sequential(DenseBN(), Dense32(), nn.Dense(10))
    pipe = Pipeline(
        bn,
        replica_plan(((0, 1), (1, 3)), (2, 1)),
        xent,
        optax.sgd(0.1),
        schedule=ScheduleSpec("pipedream", replication="round-robin"),
    )
    state = pipe.init(jax.random.key(0), stream[0][0])
    with pytest.raises(PipelineError, match="model state"):
        pipe.run(state, stream[:2])


def test_plan_round_robin_falls_back_to_split_where_it_cannot_run():
    """A plan's round-robin choice is a performance choice: a stage whose layers keep
    model state, or a schedule without a round-robin form, runs split (and says so); the
    caller's explicit choice raises instead (above)."""
    bn = sequential(DenseBN(), Dense32(), nn.Dense(10))
    plan = (StagePlan(0, 0, (0, 1), replication="round-robin"), StagePlan(1, 2, (2,)))
    stream = random_stream(4)
    pipe = Pipeline(bn, plan, xent, optax.sgd(0.1), schedule=ScheduleSpec("pipedream"))
    assert pipe.stages[0].round_robin
    state = pipe.init(jax.random.key(0), stream[0][0])
    one, _ = pipe.run(state, stream)
    assert not pipe.stages[0].round_robin and "model state" in pipe.replication_notes[0]
    assert one.updates == (4, 4)  # split: an update per microbatch
    layers = sequential(Dense32(), Dense32(), nn.Dense(10))
    pipe = Pipeline(
        layers, plan, xent, optax.sgd(0.1), schedule=ScheduleSpec("zb-h1", microbatches=2)
    )
    assert not pipe.stages[0].round_robin and "zb-h1" in pipe.replication_notes[0]
    pipe = Pipeline(layers, plan, xent, optax.sgd(0.1), schedule=ScheduleSpec("pipedream"))
    assert pipe.stages[0].round_robin
    state = pipe.init(jax.random.key(0), stream[0][0])
    two, _ = pipe.run(state, stream)
    assert two.updates == (2, 4)  # round-robin: an update per group of 2


def test_train_config_replication():
    from pdjax.apps.train import TrainConfig

    assert TrainConfig(replication="round-robin").label == "pipedream (round-robin)"
    with pytest.raises(PipelineError, match="plan, split or round-robin"):
        TrainConfig(replication="rr")


def test_round_robin_next_to_a_split_replicated_stage_and_retries():
    """A round-robin stage before a split replicated one (the shapes each stage passes on
    are one microbatch's), and a refusal that stays a refusal when the call is retried."""
    layers = sequential(Dense32(), Dense32(), Dense32(), nn.Dense(10))
    stream = random_stream(4)
    pipe = Pipeline(
        layers,
        replica_plan(((0, 2), (2, 4)), (2, 2)),
        xent,
        optax.sgd(0.1),
        schedule=ScheduleSpec("1f1b", microbatches=4, replication=("round-robin", "split")),
    )
    state = pipe.init(jax.random.key(0), stream[0][0])
    start = pipe.variables(state)
    state, _ = pipe.run(state, stream)
    assert pipe.grad_allreduce_at == ("update (round-robin)", "update")
    ref, _, _ = flush_training(layers, xent, optax.sgd(0.1), start, stream, M=4, rng=state.rng)
    _close([v["params"] for v in pipe.variables(state)], ref)

    bn = sequential(DenseBN(), Dense32(), nn.Dense(10))
    pipe = Pipeline(
        bn,
        replica_plan(((0, 1), (1, 3)), (2, 1)),
        xent,
        optax.sgd(0.1),
        schedule=ScheduleSpec("gpipe", microbatches=2, replication="round-robin"),
    )
    state = pipe.init(jax.random.key(0), stream[0][0])
    for _ in range(2):
        with pytest.raises(PipelineError, match="model state"):
            pipe.run(state, stream[:2])
