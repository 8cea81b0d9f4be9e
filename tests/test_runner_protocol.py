"""The Runner protocol: ``Pipeline`` and ``DataParallel`` both implement it, and code
written against the protocol alone (init, run, step, variables, a checkpoint round trip)
takes either; checkpoints store any runner state, with no registry of state types; the
pipeline package never imports the runners."""

import ast
import json
from pathlib import Path
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pdjax
from pdjax.errors import CheckpointError, PipelineError
from pdjax.layers import sequential
from pdjax.pipeline import Pipeline, PipelineState, even_stages
from pdjax.runners import (
    ARRAY_FIELDS,
    Checkpointer,
    DataParallel,
    DPState,
    Runner,
    RunnerState,
    RunResult,
    counter_fields,
)
from pdjax.schedules import ScheduleSpec


def _layers():
    return sequential(nn.Dense(8), nn.Dropout(0.2), nn.Dense(8), nn.Dense(3), names=list("abcd"))


def _mse(y, t):
    return ((y - t) ** 2).mean()


def _batches(n, rows, seed=0):
    rng = np.random.default_rng(seed)
    return [
        (
            rng.normal(size=(rows, 5)).astype(np.float32),
            rng.normal(size=(rows, 3)).astype(np.float32),
        )
        for _ in range(n)
    ]


def _pipeline(schedule="1f1b"):
    layers = _layers()
    return Pipeline(
        layers,
        even_stages(len(layers), 2),
        _mse,
        optax.adam(1e-2),
        schedule=ScheduleSpec(schedule, microbatches=2),
    )


def _dp():
    return DataParallel(_layers(), _mse, optax.adam(1e-2), devices=jax.devices()[:2])


def _leaves(tree):
    """The arrays of a state or variables as host bytes (a PRNG key as its key data); a
    state's int counters are left out."""
    out = []
    for a in jax.tree.leaves(tree):
        if isinstance(a, int):
            continue
        if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
            a = jax.random.key_data(a)
        out.append(np.asarray(a).tobytes())
    return out


def _train_save_resume(runner: Runner[Any], directory: Path, batch_size: int) -> list[str]:
    """Written against the protocol alone: init, a stream of two updates through ``run``,
    one ``step``, the counters, the variables, a checkpoint round trip into a fresh
    template, and one more step from both the state and its restored copy (which must
    agree bit for bit). Returns the checks it made, for the caller to count."""
    mb = batch_size // runner.microbatches
    data = _batches(4, batch_size)
    stream = [
        (x[k * mb : (k + 1) * mb], y[k * mb : (k + 1) * mb])
        for x, y in data[:2]
        for k in range(runner.microbatches)
    ]
    state = runner.init(jax.random.key(0), stream[0][0])
    assert isinstance(state, RunnerState)
    assert state.updates == (0,) * len(state.updates) and state.microbatches == 0
    seen: list[int] = []
    state, metrics = runner.run(state, stream, on_loss=lambda k, loss: seen.append(k))
    assert isinstance(metrics, RunResult)
    assert seen == list(range(len(stream))) and len(metrics.losses) == len(stream)
    assert np.isfinite(metrics.loss) and metrics.actions >= len(stream)
    state, metrics = runner.step(state, data[2])
    assert set(state.updates) == {3} and state.microbatches == 3 * runner.microbatches
    variables = runner.variables(state)
    assert len(variables) == len(runner.layers)
    assert {"a", "c", "d"} <= set(runner.params(state))

    with Checkpointer(directory) as ckpt:
        ckpt.save(3, state, extra={"epoch": 1})
        template = runner.init(jax.random.key(1), stream[0][0])  # other values, same layout
        restored, extra = ckpt.restore(template)
    assert type(restored) is type(state) and extra == {"epoch": 1}
    assert restored.updates == state.updates and restored.microbatches == state.microbatches
    assert _leaves(restored) == _leaves(state)

    # the restored run goes on exactly as the one that never stopped
    went_on, _ = runner.step(restored, data[3])
    never_stopped, _ = runner.step(state, data[3])
    assert _leaves(runner.variables(went_on)) == _leaves(runner.variables(never_stopped))
    outputs = runner.predict(never_stopped, data[3][0], batch_size=batch_size // 2)
    assert np.shape(outputs) == (batch_size, 3)
    return ["run", "step", "counters", "variables", "checkpoint", "resume", "predict"]


@pytest.mark.parametrize("make", [_pipeline, _dp], ids=["pipeline", "dp"])
def test_both_runners_satisfy_the_protocol_and_one_function_trains_either(tmp_path, make):
    runner = make()
    assert isinstance(runner, Runner)
    assert len(_train_save_resume(runner, tmp_path, batch_size=8)) == 7


def test_what_is_not_a_runner_is_not_one():
    assert not isinstance(object(), Runner)
    assert not isinstance({"params": 1}, RunnerState)


def test_states_name_their_arrays_and_counters():
    assert ARRAY_FIELDS == ("params", "model_state", "opt_state", "rng")
    dp_state = DPState([], [], (), 7, jax.random.key(0))
    assert counter_fields(dp_state) == ("step",)
    assert dp_state.updates == (7,) and dp_state.microbatches == 7  # as a 1-stage pipeline's
    pipe_state = PipelineState(
        params=(),
        model_state=(),
        opt_state=(),
        updates=(2, 2),
        microbatches=4,
        rng=jax.random.key(0),
    )
    assert counter_fields(pipe_state) == ("updates", "microbatches")
    assert isinstance(dp_state, RunnerState) and isinstance(pipe_state, RunnerState)
    assert pdjax.Runner is Runner and pdjax.DataParallel is DataParallel


def test_data_parallel_run_is_its_steps_in_order():
    """``DataParallel.run`` over a stream is one step per batch: the same weights, losses
    and dropout draws as the steps one by one (the counters seed the dropout)."""
    dp = DataParallel(_layers(), _mse, optax.sgd(0.1), devices=jax.devices()[:2], donate=False)
    data = _batches(3, 4, seed=1)
    start = dp.init(jax.random.key(0), data[0][0])
    by_run, metrics = dp.run(start, data)
    by_steps, losses = start, []
    for batch in data:
        by_steps, m = dp.step(by_steps, batch)
        losses += m.losses
    assert by_run.step == by_steps.step == 3
    assert _leaves(by_run) == _leaves(by_steps)
    assert [float(a) for a in metrics.losses] == [float(a) for a in losses]
    assert metrics.actions == 3 and metrics.aux is None
    with pytest.raises(PipelineError, match="at least one"):
        dp.run(start, [])


def test_data_parallel_predict_is_its_evaluation_in_batches():
    dp = _dp()
    x = _batches(1, 8)[0][0]
    state = dp.init(jax.random.key(0), x)
    whole = np.asarray(dp.evaluate(state, x))
    np.testing.assert_array_equal(np.asarray(dp.predict(state, x)), whole)
    np.testing.assert_allclose(np.asarray(dp.predict(state, x, batch_size=4)), whole, rtol=1e-6)
    with pytest.raises(PipelineError, match="multiple of 2"):
        dp.predict(state, x, batch_size=3)


class _OtherState(NamedTuple):
    """A runner state pdjax does not know: arrays in ARRAY_FIELDS, two counters."""

    params: list[Any]
    model_state: list[Any]
    opt_state: Any
    rng: jax.Array
    epoch: int
    updates: tuple[int, ...]

    @property
    def microbatches(self) -> int:
        return self.updates[0]


def test_a_checkpoint_stores_any_runner_state_by_the_protocol(tmp_path):
    """No registry: a new runner's state checkpoints by its fields (arrays in
    ARRAY_FIELDS, the rest int counters); a state whose counter is not an int is refused,
    and a template of another type is told apart by name."""
    state = _OtherState(
        params=[{"w": jnp.arange(3.0)}],
        model_state=[{}],
        opt_state=(jnp.ones(2),),
        rng=jax.random.key(3),
        epoch=2,
        updates=(5, 5),
    )
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, state)
        meta = json.loads((tmp_path / "1" / "meta" / "metadata").read_text())
        assert meta["state"] == "_OtherState" and meta["ints"] == {"epoch": 2, "updates": [5, 5]}
        assert sorted(meta["arrays"]) == ["opt_state.0", "params.0.w", "rng"]
        template = state._replace(params=[{"w": jnp.zeros(3)}], epoch=0, updates=(0, 0))
        restored, _ = ckpt.restore(template)
        assert restored.epoch == 2 and restored.updates == (5, 5)
        assert _leaves(restored) == _leaves(state)
        with pytest.raises(CheckpointError, match=r"epoch is a float; a _OtherState holds"):
            ckpt.save(2, state._replace(epoch=2.5))
        dp_template = DPState([{"w": jnp.zeros(3)}], [{}], (jnp.ones(2),), 0, jax.random.key(0))
        with pytest.raises(CheckpointError, match="holds a _OtherState, the template is a DPState"):
            ckpt.restore(dp_template)


def test_a_dp_checkpoint_keeps_its_format(tmp_path):
    """What a DPState's checkpoint holds is what it held before the protocol: its
    ``step`` as the one counter, no stage level in the array names."""
    dp = _dp()
    x, y = _batches(1, 4)[0]
    state, _ = dp.step(dp.init(jax.random.key(0), x), (x, y))
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, state)
    meta = json.loads((tmp_path / "1" / "meta" / "metadata").read_text())
    assert meta["state"] == "DPState" and meta["ints"] == {"step": 1}
    assert "params.0.kernel" in meta["arrays"] and "stage_layers" not in meta


def test_the_pipeline_package_does_not_import_the_runners():
    """The package order is profile -> partition -> pipeline -> runners: no module of
    pdjax/pipeline imports pdjax.runners at module level."""
    root = Path(pdjax.__file__).parent / "pipeline"
    offenders = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            if any(n == "pdjax.runners" or n.startswith("pdjax.runners.") for n in names):
                offenders.append(str(path.relative_to(root)))
    assert offenders == []
