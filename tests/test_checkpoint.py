"""Checkpoints: a save restores bit for bit, a resumed run equals the run that never
stopped, a save killed midway leaves the previous step, and errors say what is wrong."""

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pdjax.errors import CheckpointError
from pdjax.layers import sequential
from pdjax.models import get_model
from pdjax.partition import StagePlan
from pdjax.pipeline import Pipeline, even_stages
from pdjax.runners import Checkpointer, DataParallel
from pdjax.schedules import ScheduleSpec

K = 3  # steps before the save; the resumed run trains K more


def _assert_same(got, want):
    """Same tree (types included: optax states are NamedTuples, not lists), and every
    leaf bit for bit equal, of the same dtype, on the same sharding."""
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        if not isinstance(b, jax.Array):  # the state's Python ints
            assert type(a) is type(b) and a == b, (a, b)
            continue
        assert a.sharding == b.sharding, (a.sharding, b.sharding)
        assert a.committed == b.committed  # jit may move only uncommitted arrays
        if jax.dtypes.issubdtype(b.dtype, jax.dtypes.prng_key):
            assert str(jax.random.key_impl(a)) == str(jax.random.key_impl(b))
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
        assert a.tobytes() == b.tobytes()  # bitwise: -0.0 and NaN payloads too


def _mlp_pipeline(specs=None):
    spec = get_model("mlp")
    return spec, Pipeline(
        spec.layers,
        even_stages(len(spec.layers), 2) if specs is None else specs,
        spec.loss,
        optax.adam(1e-2),
        schedule=ScheduleSpec("1f1b", microbatches=2),
    )


def _bn_dropout_layers():
    # BatchNorm statistics and dropout: the resumed run needs model_state, the PRNG key
    # and the microbatch / step counters back exactly. Small, so it compiles fast.
    return sequential(nn.Dense(16), nn.BatchNorm(momentum=0.9), nn.Dropout(0.25), nn.Dense(4))


def _mse(y, t):
    return jnp.mean((y - t) ** 2)


def _batches(n, size, seed=0):
    key = jax.random.key(seed)
    x = jax.random.normal(key, (n * size, 6))
    t = jax.random.normal(jax.random.fold_in(key, 1), (n * size, 4))
    return [(x[i * size : (i + 1) * size], t[i * size : (i + 1) * size]) for i in range(n)]


# -- round trips --------------------------------------------------------------------------


def test_pipeline_round_trip_with_replication_and_adam(tmp_path):
    spec, pipe = _mlp_pipeline([StagePlan(0, 1, (0, 1)), StagePlan(2, 3, (2,))])
    x, y = spec.sample_batch(8)
    state = pipe.init(jax.random.key(0), x[:4])
    state, metrics = pipe.step(state, (x, y))
    extra = {"epoch": 2, "batch": 5, "losses": [metrics.loss, 1.5], "seed": 7, "note": None}
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.save(1, state, extra=extra)
        assert ckpt.all_steps() == [1] and ckpt.latest_step() == 1

    with Checkpointer(tmp_path / "ckpt") as ckpt:  # a template with other values
        restored, got_extra = ckpt.restore(pipe.init(jax.random.key(5), x[:4]))
    _assert_same(restored, state)
    assert got_extra == extra
    assert isinstance(restored.opt_state[0][0], optax.ScaleByAdamState)
    assert restored.updates == (1, 1) and restored.microbatches == 2
    kernel = jax.tree.leaves(restored.params[0])[0]
    assert kernel.sharding.device_set == set(jax.devices()[:2])

    # The template's shardings decide where the arrays go: an abstract template puts the
    # stages on other devices (a restart on another slice of the machine).
    def moved(tree, devices):
        sharding = NamedSharding(Mesh(np.array(devices), ("r",)), PartitionSpec())
        return jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree
        )

    devs = jax.devices()
    abstract = state._replace(
        params=(moved(state.params[0], devs[4:6]), moved(state.params[1], devs[6:7])),
        model_state=(
            moved(state.model_state[0], devs[4:6]),
            moved(state.model_state[1], devs[6:7]),
        ),
        opt_state=(moved(state.opt_state[0], devs[4:6]), moved(state.opt_state[1], devs[6:7])),
        rng=moved(state.rng, devs[7:8]),
        updates=None,  # an abstract template's ints are not read
        microbatches=None,
    )
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        there, _ = ckpt.restore(abstract)
    assert jax.tree.leaves(there.params[0])[0].sharding.device_set == set(devs[4:6])
    assert jax.tree.leaves(there.opt_state[1])[0].sharding.device_set == {devs[6]}
    assert there.rng.sharding.device_set == {devs[7]}
    assert there.updates == state.updates and there.microbatches == state.microbatches
    for a, b in zip(jax.tree.leaves(there), jax.tree.leaves(state), strict=True):
        if isinstance(b, int):
            continue
        if jax.dtypes.issubdtype(b.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        np.testing.assert_array_equal(a, b)


# -- resuming -----------------------------------------------------------------------------


def _runner(kind, layers):
    if kind == "dp":
        return DataParallel(layers, _mse, optax.adam(1e-2), devices=jax.devices()[:2])
    return Pipeline(
        layers,
        even_stages(len(layers), 2),
        _mse,
        optax.adam(1e-2),
        schedule=ScheduleSpec(kind, microbatches=2),
    )


def _train(kind, runner, state, data):
    for batch in data:
        # pipedream streams: each call runs (and drains) a list of microbatches
        state, _ = runner.run(state, batch) if kind == "pipedream" else runner.step(state, batch)
    return state


@pytest.mark.parametrize("kind", ["1f1b", "pipedream", "dp"])
def test_round_trip_and_resume_are_bit_identical(tmp_path, kind):
    """Train K steps, save, restore into a new runner (as a restarted process would) and
    train K more: bit for bit the run that never stopped. ``pipedream`` runs a fixed list
    of microbatches per call; ``dp`` is on 2 devices. The model has BatchNorm and dropout."""
    layers = _bn_dropout_layers()
    if kind == "pipedream":
        data = [_batches(3, 4, seed=t) for t in range(2 * K)]
    else:
        data = _batches(2 * K, 8)
    sample = jax.tree.leaves(data[0])[0][:4]

    # The uninterrupted run saves at K on its way, as a real run does; saving reads the
    # arrays and changes nothing.
    full = _runner(kind, layers)
    state = _train(kind, full, full.init(jax.random.key(0), sample), data[:K])
    extra = {"epoch": 0, "next_batch": K, "losses": [0.5, float("nan")], "seed": 0}
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(K, state, extra=extra)

    restarted = _runner(kind, layers)
    with Checkpointer(tmp_path) as ckpt:  # the template's values differ (another key)
        restored, got = ckpt.restore(restarted.init(jax.random.key(1), sample))
    _assert_same(restored, state)
    assert got["next_batch"] == K and np.isnan(got["losses"][1]) and got["losses"][0] == 0.5
    adam = restored.opt_state if kind == "dp" else restored.opt_state[0]
    assert isinstance(adam[0], optax.ScaleByAdamState)
    bn = restored.model_state[1] if kind == "dp" else restored.model_state[0][1]
    assert float(jnp.abs(bn["batch_stats"]["mean"]).max()) > 0  # trained, not the initial 0

    # state is not used again: the DP steps below may donate its buffers.
    uninterrupted = _train(kind, full, state, data[K:])
    resumed = _train(kind, restarted, restored, data[got["next_batch"] :])
    _assert_same(resumed, uninterrupted)


# -- crash safety -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained():
    """A 2-stage 1f1b MLP pipeline with Adam, its initial state and the state after a step."""
    spec, pipe = _mlp_pipeline()
    x, y = spec.sample_batch(8)
    template = pipe.init(jax.random.key(1), x[:4])
    state, _ = pipe.step(template, (x, y))
    return pipe, (x, y), template, state


# Saves step 2 and is SIGKILLed midway: after half the arrays are written, or with every
# file written (commit_success.txt included) just before the rename that commits the step.
# The state is built by hand: what is saved does not matter, only that the save dies.
_KILLED_SAVE = textwrap.dedent(
    """
    import os, signal, sys
    import jax
    import jax.numpy as jnp
    from orbax.checkpoint import type_handlers
    from orbax.checkpoint._src.path import async_path
    from pdjax.pipeline import PipelineState
    from pdjax.runners import Checkpointer

    directory, where = sys.argv[1], sys.argv[2]

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    if where == "arrays":
        serialize = type_handlers.ArrayHandler.serialize

        async def half_then_die(self, values, infos, args=None):
            n = len(values) // 2
            for f in await serialize(self, values[:n], infos[:n], args and args[:n]):
                f.result()
            die()

        type_handlers.ArrayHandler.serialize = half_then_die
    else:
        rename = async_path.rename

        async def die_at_commit(src, dst):
            if os.path.dirname(str(dst)) == directory:  # the step, not an item inside it
                die()
            return await rename(src, dst)

        async_path.rename = die_at_commit

    state = PipelineState(
        params=([{"w": jnp.full((64, 32), 2.0)}], [{"w": jnp.full((32, 10), 3.0)}]),
        model_state=([{}], [{}]),
        opt_state=((), ()),
        updates=(9, 9),
        microbatches=18,
        rng=jax.random.key(2),
    )
    Checkpointer(directory).save(2, state, extra={"epoch": 1})
    sys.exit("the save finished: the kill hook never ran")
    """
)


@pytest.mark.parametrize("where", ["arrays", "commit"])
def test_a_save_killed_midway_leaves_the_previous_step(tmp_path, trained, where):
    pipe, batch, template, state = trained
    directory = tmp_path / "ckpt"
    with Checkpointer(directory) as ckpt:
        ckpt.save(1, state, extra={"epoch": 0})

    proc = subprocess.run(
        [sys.executable, "-c", _KILLED_SAVE, str(directory), where],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    # the killed writer's lock file stays (its lock went with it)
    leftovers = [p.name for p in directory.iterdir() if p.name not in ("1", "pdjax.lock")]
    assert len(leftovers) == 1 and leftovers[0].startswith("2.orbax-checkpoint-tmp"), leftovers
    tmp = directory / leftovers[0]
    assert (tmp / "pdjax-step.json").exists()  # marked as pdjax's before anything is written
    if where == "commit":  # the data is all there; only the commit (the rename) is missing
        assert (tmp / "commit_success.txt").exists()

    ckpt = Checkpointer(directory)
    assert ckpt.all_steps() == [1] and ckpt.latest_step() == 1
    restored, extra = ckpt.restore(template)
    _assert_same(restored, state)
    assert extra == {"epoch": 0}
    with pytest.raises(CheckpointError, match=r"step 2 .*available steps: \[1\]"):
        ckpt.restore(template, step=2)
    assert tmp.exists()  # a reader leaves other processes' temporary directories alone

    # The run goes on from step 1; its next save (a writer, taking over the dead one's
    # lock) clears the debris.
    later, _ = pipe.step(restored, batch)
    ckpt.save(2, later)
    assert sorted(p.name for p in directory.iterdir()) == ["1", "2", "pdjax.lock"]
    _assert_same(ckpt.restore(template)[0], later)
    ckpt.close()
    assert sorted(p.name for p in directory.iterdir()) == ["1", "2"]


# -- errors -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mlp_state(trained):
    return get_model("mlp"), trained[3]


def test_restore_from_an_empty_or_missing_directory_names_it(tmp_path, mlp_state):
    _, state = mlp_state
    missing = tmp_path / "no-such-run"
    with (
        Checkpointer(missing) as ckpt,
        pytest.raises(CheckpointError, match=r"no checkpoint in .*no-such-run .*does not exist"),
    ):
        ckpt.restore(state)
    assert not missing.exists()  # reading creates nothing
    with Checkpointer(tmp_path) as ckpt, pytest.raises(CheckpointError, match="no checkpoint in"):
        ckpt.restore(state)
    assert ckpt.latest_step() is None and ckpt.all_steps() == []


def test_missing_step_lists_the_available_ones_and_max_to_keep_prunes(tmp_path, mlp_state):
    _, state = mlp_state
    with Checkpointer(tmp_path, max_to_keep=2) as ckpt:
        for step in (10, 20, 30):
            ckpt.save(step, state._replace(microbatches=step))
        assert ckpt.all_steps() == [20, 30]
        with pytest.raises(CheckpointError, match=r"step 10 .*available steps: \[20, 30\]"):
            ckpt.restore(state, step=10)
        assert ckpt.restore(state, step=20)[0].microbatches == 20
        with pytest.raises(CheckpointError, match=r"steps must increase"):
            ckpt.save(30, state)


def test_a_template_of_another_model_or_plan_names_the_first_mismatch(tmp_path, mlp_state):
    spec, state = mlp_state
    x, _ = spec.sample_batch(4)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, state)
        wider = get_model("mlp", hidden=(32, 48, 32))
        pipe = Pipeline(wider.layers, even_stages(4, 2), wider.loss, optax.adam(1e-2))
        with pytest.raises(
            CheckpointError,
            match=r"params\.0\.1\.dense\.bias is float32\[32\] in the checkpoint and "
            r"float32\[48\] in the template; the model, the plan",
        ):
            ckpt.restore(pipe.init(jax.random.key(0), x))

        # The same model split 1 + 3 instead of 2 + 2: another plan, which restores only
        # with the pipeline given (tests/test_user_models.py moves one between plans)
        _, resplit = _mlp_pipeline([StagePlan(0, 0, (0,)), StagePlan(1, 3, (1,))])
        with pytest.raises(
            CheckpointError,
            match=r"saved under another plan \(layers per stage \[2, 2\]; the template's "
            r"\[1, 3\]\): pass pipeline=",
        ):
            ckpt.restore(resplit.init(jax.random.key(0), x))
        moved, _ = ckpt.restore(resplit.init(jax.random.key(0), x), pipeline=resplit)
        want = jax.tree.leaves(jax.device_get(state.params))
        got = jax.tree.leaves(jax.device_get(moved.params))
        assert [a.tobytes() for a in map(np.asarray, got)] == [
            a.tobytes() for a in map(np.asarray, want)
        ]
        # another model under another plan: no source for its arrays
        wider_pipe = Pipeline(wider.layers, even_stages(4, 4), wider.loss, optax.adam(1e-2))
        with pytest.raises(CheckpointError, match=r"params\.\S+ .*would come from"):
            ckpt.restore(wider_pipe.init(jax.random.key(0), x), pipeline=wider_pipe)

        # into data parallelism: one stage of every layer (tests/test_sharded_checkpoint.py)
        dp = DataParallel(spec.layers, spec.loss, optax.adam(1e-2), devices=jax.devices()[:1])
        into_dp, _ = ckpt.restore(dp.init(jax.random.key(0), x))
        got = jax.tree.leaves(jax.device_get(into_dp.params))
        assert [a.tobytes() for a in map(np.asarray, got)] == [
            a.tobytes() for a in map(np.asarray, want)
        ]
        assert into_dp.step == state.updates[0]


def test_a_replan_into_another_optimizer_is_refused_as_under_the_same_plan(tmp_path, mlp_state):
    """An Adam checkpoint moved into another plan whose optimizer is SGD would lose its
    moments: refused with the message a template of the same plan gets."""
    spec, state = mlp_state
    x, _ = spec.sample_batch(4)

    def sgd_pipe(stages):
        return Pipeline(
            spec.layers,
            stages,
            spec.loss,
            optax.sgd(1e-2),
            schedule=ScheduleSpec("1f1b", microbatches=2),
        )

    same_plan, other_plan = sgd_pipe(even_stages(4, 2)), sgd_pipe(even_stages(4, 3))
    message = (
        r"does not match the template: the checkpoint has opt_state\.0\.0\.count "
        r"\(int32\[\]\), the template has no such array; the model, the plan"
    )
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, state)
        with pytest.raises(CheckpointError, match=message):
            ckpt.restore(same_plan.init(jax.random.key(0), x))
        with pytest.raises(CheckpointError, match=message):
            ckpt.restore(other_plan.init(jax.random.key(0), x), pipeline=other_plan)


def test_save_rejects_what_it_cannot_store(tmp_path, mlp_state):
    _, state = mlp_state
    with Checkpointer(tmp_path) as ckpt:
        with pytest.raises(CheckpointError, match=r"extra\['loss'\] is a ArrayImpl.*float\(x\)"):
            ckpt.save(1, state, extra={"loss": jnp.ones(2)})
        with pytest.raises(CheckpointError, match=r"must be a PipelineState .* or a DPState"):
            ckpt.save(1, {"params": state.params})
        with pytest.raises(CheckpointError, match="step must be an int >= 0"):
            ckpt.save(-1, state)
        donated = jnp.ones(3)
        donated.delete()  # what a donating DataParallel.step does to the state it is given
        with pytest.raises(CheckpointError, match=r"params\.0\.0\.w has been deleted"):
            ckpt.save(1, state._replace(params=([{"w": donated}], *state.params[1:])))
        ckpt.save(1, state, extra={"loss": np.float32(0.5), "epoch": np.int64(3)})
        assert ckpt.restore(state)[1] == {"loss": 0.5, "epoch": 3}
    assert Path(tmp_path, "1", "meta", "metadata").is_file()
    assert os.listdir(tmp_path) == ["1"]
