"""Checkpoints of sharded state (stages on a mesh, data parallelism over ``fsdp``): orbax
writes each device's shards and pdjax checksums them shard by shard, nothing gathered
whole on the host; a restore reads every array onto the template's shardings, into the
same plan (a resume bit for bit), into other cuts and other meshes (weights and Adam's
moments moved layer by layer), and into ``DataParallel(mesh={"fsdp": 8})``.

Llama tiny (4 layers, dropout 0.1), AdamW, 1F1B with M = 4 microbatches of 4 rows. Saved
under 2 x (fsdp 2 x tensor 2) after 2 steps; the run that never stopped goes on for 2 more
steps. Into data parallelism, Llama tiny without dropout: a DP step draws its dropout from
its step count, a pipeline from its microbatch count, so only then do the two continue
the same training. Under another plan or under data parallelism the same training computes its sums
in another order, so those continuations are compared to the uninterrupted run with
rtol / atol 1e-5 (AdamW turns reduction-order noise in near-zero gradients into
differences of about 1e-5: see tests/test_sharded_stages.py); a sharding or moving mistake
would be off by a whole update (1e-2).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pdjax.errors import CheckpointError
from pdjax.models import get_model
from pdjax.models.llama import LlamaConfig, make_spec
from pdjax.pipeline import Pipeline
from pdjax.plan import StagePlan
from pdjax.runners import Checkpointer, DataParallel
from pdjax.runners.checkpoint.format import array_checksum
from pdjax.schedules import ScheduleSpec

LLAMA = get_model("llama", "tiny")
NO_DROPOUT = make_spec(dataclasses.replace(LlamaConfig.tiny(), dropout=0.0))
N = len(LLAMA.layers)
ADAMW = optax.adamw(1e-2)
M, ROWS = 4, 4
QUAD = {"fsdp": 2, "tensor": 2}


def _two_quads():
    h = N // 2
    return (
        StagePlan(0, h - 1, (0, 1, 2, 3), mesh=QUAD),
        StagePlan(h, N - 1, (4, 5, 6, 7), mesh=QUAD),
    )


def _four_pairs():
    """4 one-layer stages x (tensor 2)."""
    return tuple(StagePlan(s, s, (2 * s, 2 * s + 1), mesh={"tensor": 2}) for s in range(N))


def _pipeline(plan, spec=LLAMA):
    return Pipeline(
        spec.layers, plan, spec.loss, ADAMW, schedule=ScheduleSpec("1f1b", microbatches=M)
    )


def _steps(n):
    """``n`` steps of M microbatches."""
    key = jax.random.key(0)
    x, y = LLAMA.sample_input(n * M * ROWS, key), LLAMA.sample_target(n * M * ROWS, key)
    mbs = [jax.tree.map(lambda a, k=k: a[k * ROWS : (k + 1) * ROWS], (x, y)) for k in range(n * M)]
    return [mbs[t * M : (t + 1) * M] for t in range(n)]


def _host(tree):
    return jax.tree.map(lambda a: np.array(a), tree)


def _bits(a, b):
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


def _close(a, b):
    jax.tree.map(
        lambda x, y: np.testing.assert_allclose(np.asarray(x), y, rtol=1e-5, atol=1e-5), a, b
    )


def _kernel(layer_params):
    """A layer's attention query kernel (the blocks') or its first leaf."""
    attn = layer_params.get("attn")
    return attn["q"]["kernel"] if attn else jax.tree.leaves(layer_params)[0]


def _per_layer(state, field):
    """A pipeline state's per-layer entries of ``params`` or of Adam's ``mu`` / ``nu``,
    over the stages, in model order."""
    if field == "params":
        return [p for stage in state.params for p in stage]
    return [m for stage in state.opt_state for m in getattr(stage[0], field)]


def _train_and_save(spec, directory):
    """Training under 2 x (fsdp 2 x tensor 2): saved after 2 steps, then 2 more steps.
    Returns the directory, the state saved (host copies of params and Adam's moments),
    the steps' microbatches, and the uninterrupted run's steps 3-4 (losses, params,
    moments), on the host."""
    steps = _steps(4)
    pipe = _pipeline(_two_quads(), spec)
    state = pipe.init(jax.random.key(3), steps[0][0][0])
    for t in range(2):
        state, _ = pipe.run(state, steps[t])
    at_2 = {f: _host(_per_layer(state, f)) for f in ("params", "mu", "nu")}
    with Checkpointer(directory) as ckpt:
        # nothing gathered whole: a sharded array converted to one host array would call
        # its __array__ (the checksums, the dedup of equal parameters did)
        whole = []
        cls = type(state.params[0][1]["attn"]["q"]["kernel"])
        real = cls.__array__

        def spy(self, *args, **kwargs):
            if not self.sharding.is_fully_replicated:
                whole.append(self.shape)
            return real(self, *args, **kwargs)

        mp = pytest.MonkeyPatch()
        mp.setattr(cls, "__array__", spy)
        try:
            ckpt.save(2, state, extra={"seen": 2})
        finally:
            mp.undo()
        assert whole == [], whole
    losses = []
    for t in range(2, 4):
        state, metrics = pipe.run(state, steps[t])
        losses += [float(v) for v in metrics.losses]
    after = {f: _host(_per_layer(state, f)) for f in ("params", "mu", "nu")}
    return directory, at_2, steps, losses, after


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return _train_and_save(LLAMA, tmp_path_factory.mktemp("sharded"))


@pytest.fixture(scope="module")
def saved_without_dropout(tmp_path_factory):
    return _train_and_save(NO_DROPOUT, tmp_path_factory.mktemp("no_dropout"))


def test_shard_wise_checksums_equal_the_whole_arrays():
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 2, 2), ("a", "b", "c"))
    P = jax.sharding.PartitionSpec
    x = np.arange(8 * 12 * 6, dtype=np.float32).reshape(8, 12, 6) * 0.37
    for dtype in (np.float32, jnp.bfloat16, np.int8):
        value = x.astype(dtype)
        whole = array_checksum(value)
        for spec in (
            P("a"),
            P(None, "b"),
            P("a", "b"),
            P(("c", "a"), None, "b"),
            P("c", None, "a"),
        ):
            sharded = jax.device_put(value, jax.sharding.NamedSharding(mesh, spec))
            assert array_checksum(sharded) == whole, (dtype, spec)


def test_a_sharded_resume_is_bit_identical(saved):
    directory, at_2, steps, losses, after = saved
    pipe = _pipeline(_two_quads())  # a fresh pipeline, its own template
    template = pipe.init(jax.random.key(9), steps[0][0][0])
    cls = type(template.params[0][1]["attn"]["q"]["kernel"])
    whole = []
    real = cls.__array__

    def spy(self, *args, **kwargs):
        if not self.sharding.is_fully_replicated:
            whole.append(self.shape)
        return real(self, *args, **kwargs)

    with Checkpointer(directory) as ckpt, pytest.MonkeyPatch.context() as mp:
        mp.setattr(cls, "__array__", spy)
        state, extra = ckpt.restore(template)
    assert whole == [] and extra == {"seen": 2}, whole
    assert state.updates == (2, 2) and state.microbatches == 2 * M
    for f in ("params", "mu", "nu"):
        _bits(_per_layer(state, f), at_2[f])
    # on the template's shardings: split over fsdp and tensor, as the template is
    kernel, want = _kernel(state.params[0][1]), _kernel(template.params[0][1])
    assert kernel.sharding == want.sharding and tuple(kernel.sharding.spec) == ("fsdp", "tensor")
    for a, t in zip(
        jax.tree.leaves(state.opt_state), jax.tree.leaves(template.opt_state), strict=True
    ):
        assert a.sharding == t.sharding
    got = []
    for t in range(2, 4):
        state, metrics = pipe.run(state, steps[t])
        got += [float(v) for v in metrics.losses]
    assert got == losses
    for f in ("params", "mu", "nu"):
        _bits(_per_layer(state, f), after[f])


def test_a_sharded_checkpoint_restores_into_four_stages_of_tensor_2(saved):
    # Compared with the old plan's own continuation: both plans compute the same exact
    # gradient accumulation of the same model from the same values, in other orders.
    directory, at_2, steps, losses, after = saved
    pipe4 = _pipeline(_four_pairs())
    template = pipe4.init(jax.random.key(9), steps[0][0][0])
    with Checkpointer(directory) as ckpt:
        state, _ = ckpt.restore(template, pipeline=pipe4)
    assert state.updates == (2,) * N and state.microbatches == 2 * M
    for f in ("params", "mu", "nu"):
        _bits(_per_layer(state, f), at_2[f])  # moved, not recomputed: the same bits
    # each on its new stage's mesh: the q kernel split over tensor alone, its moments too
    kernel = _kernel(state.params[1][0])
    assert kernel.sharding == _kernel(template.params[1][0]).sharding
    assert {d.id for d in kernel.sharding.device_set} == {2, 3}
    assert {s.data.shape for s in kernel.addressable_shards} == {(32, 16)}  # halves
    for a, t in zip(
        jax.tree.leaves(state.opt_state), jax.tree.leaves(template.opt_state), strict=True
    ):
        assert a.sharding == t.sharding
    got = []
    for t in range(2, 4):
        state, metrics = pipe4.run(state, steps[t])
        got += [float(v) for v in metrics.losses]
    np.testing.assert_allclose(got, losses, rtol=1e-5)
    for f in ("params", "mu", "nu"):
        _close(_per_layer(state, f), after[f])


def test_a_sharded_checkpoint_restores_into_data_parallel_fsdp_8(saved_without_dropout):
    # A DP step on a batch and a pipeline step on the same rows as M microbatches compute
    # the same mean gradient (the loss is the mean over equal microbatches; no dropout
    # here): DP's steps 3-4, each on the pipeline step's microbatches concatenated, are
    # compared with the pipeline's steps 3-4 (their losses with the microbatches' mean).
    directory, at_2, steps, losses, after = saved_without_dropout
    dp = DataParallel(NO_DROPOUT.layers, NO_DROPOUT.loss, ADAMW, mesh={"fsdp": 8})
    template = dp.init(jax.random.key(9), steps[0][0][0])
    with Checkpointer(directory) as ckpt:
        state, extra = ckpt.restore(template)
    assert state.step == 2 and extra == {"seen": 2}
    _bits(state.params, at_2["params"])
    _bits(state.opt_state[0].mu, at_2["mu"])
    _bits(state.opt_state[0].nu, at_2["nu"])
    assert int(state.opt_state[0].count) == 2
    kernel = _kernel(state.params[1])
    assert kernel.sharding == _kernel(template.params[1]).sharding
    assert {s.data.shape for s in kernel.addressable_shards} == {(4, 32)}  # eighths
    for a, t in zip(
        jax.tree.leaves(state.opt_state), jax.tree.leaves(template.opt_state), strict=True
    ):
        assert a.sharding == t.sharding
    got = []
    for t in range(2, 4):
        batch = jax.tree.map(lambda *a: jnp.concatenate(a), *steps[t])
        state, metrics = dp.step(state, batch)
        got.append(metrics.loss)
    want = [float(np.mean(losses[:M])), float(np.mean(losses[M:]))]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    _close(state.params, after["params"])
    _close(state.opt_state[0].mu, after["mu"])
    _close(state.opt_state[0].nu, after["nu"])


def test_an_optimizer_state_not_per_parameter_is_refused_into_data_parallel(tmp_path):
    # optax.masked keeps Adam's moments for the masked parameters only: its state is not
    # shaped like the parameters, so no leaf of it can be moved with its layer
    spec = get_model("mlp")
    x, _ = spec.sample_batch(8)
    masked = optax.masked(optax.adam(1e-2), lambda p: jax.tree.map(lambda a: a.ndim > 1, p))
    pipe = Pipeline(
        spec.layers,
        [StagePlan(0, 1, (0,)), StagePlan(2, len(spec.layers) - 1, (1,))],
        spec.loss,
        masked,
    )
    dp = DataParallel(spec.layers, spec.loss, masked, devices=jax.devices()[:2])
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, pipe.init(jax.random.key(0), x))
        with pytest.raises(
            CheckpointError, match=r"not kept per parameter \(e\.g\. optax\.masked\)"
        ):
            ckpt.restore(dp.init(jax.random.key(1), x))
