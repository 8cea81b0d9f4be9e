"""DataParallel on a sharded mesh (FSDP and tensor parallelism, no pipeline): the same
training as the replicated runner from the same seed, the weights and Adam's moments
really split over the mesh, and bad meshes refused before any work."""

import jax
import numpy as np
import optax
import pytest

from pdjax.errors import PipelineError
from pdjax.layers.sharding import ShardingError, ShardingRules
from pdjax.mesh import MeshError
from pdjax.models import get_model
from pdjax.runners import DataParallel

FSDP = {"fsdp": 8}
MIXED = {"data": 2, "fsdp": 2, "tensor": 2}
STEPS = 2


def _close(a, b, rtol=1e-5, atol=1e-6):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=rtol, atol=atol), a, b)


def _batches(spec):
    return [spec.sample_batch(8, rng=k) for k in range(STEPS)]


def _train(spec, optimizer, mesh=None, **kw):
    """``STEPS`` steps from seed 0: (the runner, its last state, the losses, the params)."""
    dp = DataParallel(spec.layers, spec.loss, optimizer, mesh=mesh, **kw)
    state = dp.init(jax.random.key(0), spec.sample_batch(8)[0])
    losses = []
    for batch in _batches(spec):
        state, metrics = dp.step(state, batch)
        losses.append(metrics.loss)
    return dp, state, losses, jax.device_get(dp.params(state))


@pytest.fixture(scope="module")
def llama():
    return get_model("llama", "tiny")


@pytest.fixture(scope="module")
def replicated_sgd(llama):
    return _train(llama, optax.sgd(0.1))


def _shard_bytes(a):
    return a.addressable_shards[0].data.nbytes


def _spec(a):
    """``a``'s partition spec as a tuple, without the trailing ``None`` JAX may drop."""
    spec = tuple(a.sharding.spec)
    while spec and spec[-1] is None:
        spec = spec[:-1]
    return spec


@pytest.mark.parametrize("mesh", [FSDP, MIXED], ids=["fsdp8", "data2-fsdp2-tensor2"])
def test_sharded_sgd_trains_as_replicated(llama, replicated_sgd, mesh):
    ref, ref_state, want_losses, want = replicated_sgd
    dp, state, losses, params = _train(llama, optax.sgd(0.1), mesh)
    assert dp.sharded and dp.num_devices == 8
    assert dp.batch_ways == (8 if mesh is FSDP else 4)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5, atol=1e-6)
    _close(params, want)
    # the step kept the kernels split: 1/(fsdp * tensor) of each on every device
    up = state.params[1]["mlp"]["up"]["kernel"]  # layer 1 is block0, (embed 32, mlp 96)
    assert _spec(up) == (("fsdp",) if mesh is FSDP else ("fsdp", "tensor"))
    assert _shard_bytes(up) * 8 // mesh.get("data", 1) == up.nbytes
    norm = state.params[1]["mlp_norm"]["scale"]
    assert norm.sharding.is_fully_replicated
    assert dp.trace_counts["step"] == 1
    x = llama.sample_batch(8, rng=7)[0]
    _close(dp.evaluate(state, x), ref.evaluate(ref_state, x), atol=1e-5)


def test_sharded_adamw_clipped_trains_as_replicated_with_sharded_moments(llama):
    # lr 1e-3: Adam turns reduction-order noise into a part of each step (8 replicated
    # devices against one differ as much as the sharded mesh against them); at 1e-3 the
    # noise is ~1e-6, and a misplaced moment would be off by a whole step (~1e-3)
    opt = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-3))
    _, _, want_losses, want = _train(llama, opt)
    _, state, losses, params = _train(llama, opt, MIXED)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5, atol=1e-5)
    _close(params, want, rtol=0, atol=1e-5)
    # Adam's moments sit where their parameters do
    kernel = state.params[1]["mlp"]["down"]["kernel"]  # (mlp 96, embed 32)
    assert _spec(kernel) == ("tensor", "fsdp")
    assert _shard_bytes(kernel) * 4 == kernel.nbytes
    moments = [
        leaf
        for path, leaf in jax.tree_util.tree_flatten_with_path(state.opt_state)[0]
        if any(getattr(k, "name", None) in ("mu", "nu") for k in path)
        and jax.tree_util.keystr(path).endswith("['mlp']['down']['kernel']")
    ]
    assert len(moments) == 4  # mu and nu of both blocks
    for m in moments:
        assert _spec(m) == _spec(kernel)
        assert _shard_bytes(m) == _shard_bytes(kernel)


def test_mesh_not_spanning_the_devices_is_refused(llama):
    with pytest.raises(MeshError, match="spans 4 devices, it has 8"):
        DataParallel(llama.layers, llama.loss, optax.sgd(0.1), mesh={"fsdp": 4})
    with pytest.raises(MeshError, match="parse_mesh"):
        DataParallel(llama.layers, llama.loss, optax.sgd(0.1), mesh="fsdp=8")
    with pytest.raises(PipelineError, match="ShardingRules"):
        DataParallel(llama.layers, llama.loss, optax.sgd(0.1), mesh=FSDP, sharding={"fsdp": 1})
    dp = DataParallel(llama.layers, llama.loss, optax.sgd(0.1), mesh=MIXED)
    with pytest.raises(PipelineError, match="4 row blocks of mesh data 2 x fsdp 2 x tensor 2"):
        dp.place_batch(llama.sample_batch(6))


def test_tensor_on_an_unannotated_model_is_refused_naming_auto_fsdp():
    spec = get_model("mlp", "tiny")
    dp = DataParallel(spec.layers, spec.loss, optax.sgd(0.1), mesh={"fsdp": 4, "tensor": 2})
    with pytest.raises(ShardingError, match="fsdp='auto'"):
        dp.init(jax.random.key(0), spec.sample_batch(8)[0])


def _kernels_split_8_ways(params):
    kernels = [
        leaf
        for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
        if getattr(path[-1], "key", None) == "kernel"
    ]
    assert len(kernels) == 4
    for k in kernels:  # (64|32, 32|10): split 8 ways along the input dimension
        assert _spec(k) == ("fsdp",)
        assert _shard_bytes(k) * 8 == k.nbytes


def test_auto_fsdp_shards_an_unannotated_model_from_given_variables():
    spec = get_model("mlp", "tiny")
    ref = DataParallel(spec.layers, spec.loss, optax.sgd(0.1), donate=False)
    ref_state = ref.init(jax.random.key(0), spec.sample_batch(8)[0])
    given = ref.variables(ref_state)
    dp = DataParallel(
        spec.layers, spec.loss, optax.sgd(0.1), mesh=FSDP, sharding=ShardingRules(fsdp="auto")
    )
    state = dp.state_from_variables(given, ref_state.rng)
    _kernels_split_8_ways(state.params)  # placed so from the start
    for batch in _batches(spec):
        state, metrics = dp.step(state, batch)  # donates its state, never the caller's
        ref_state, want = ref.step(ref_state, batch)
        np.testing.assert_allclose(metrics.loss, want.loss, rtol=1e-5, atol=1e-6)
    _close(dp.params(state), ref.params(ref_state))
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(given))
    _kernels_split_8_ways(state.params)
