"""Sharded stages (a stage's devices as a mesh: data x fsdp x tensor): every schedule keeps
its exact semantics, against the same independent references as replicated stages
(``tests/reference.py``), and bad meshes, rules and annotations are refused before
anything compiles.

Tolerances. Under SGD a sharded pipeline equals the one-device loop to about 4e-9 (the
reductions' order); the comparisons use rtol 1e-5 / atol 1e-6. Under Adam(W) a few
elements of near-zero gradient turn reduction-order noise into differences of the order of
the learning rate's thousandth (Adam divides by the gradient's own scale: at lr 1e-2,
7.5e-6 to 1.6e-5 on one to four of 28,832 elements for Llama tiny, 2 x (fsdp 2 x tensor 2);
a replicated, unsharded data-parallel stage shows the same effect, 3e-6), so AdamW runs at
lr 1e-3 with atol 1e-5: a sharding mistake (a missed reduction, a wrong slice) is off by
the size of a whole update, 1e-3.
"""

import dataclasses
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from reference import delayed_training, flush_training

from pdjax.errors import PipelineError, PlanError
from pdjax.layers.sharding import ShardingError, ShardingRules
from pdjax.mesh import MeshError, parse_mesh
from pdjax.models import get_model
from pdjax.models.llama import LlamaConfig, make_spec
from pdjax.pipeline import Pipeline
from pdjax.plan import StagePlan
from pdjax.schedules import ScheduleSpec

SGD = optax.sgd(0.1)
ADAMW_CLIP = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-3))
QUAD = {"fsdp": 2, "tensor": 2}


def _close(a, b, rtol=1e-5, atol=1e-6):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=rtol, atol=atol), a, b)


def _two_quads(n):
    """2 stages x (fsdp 2 x tensor 2) over ``n`` layers."""
    h = n // 2
    return (
        StagePlan(0, h - 1, (0, 1, 2, 3), mesh=QUAD),
        StagePlan(h, n - 1, (4, 5, 6, 7), mesh=QUAD),
    )


def _four_pairs(n):
    """4 one-layer stages x (tensor 2)."""
    assert n == 4
    return tuple(StagePlan(s, s, (2 * s, 2 * s + 1), mesh={"tensor": 2}) for s in range(4))


def _microbatches(spec, n, mb, seed=0):
    key = jax.random.key(seed)
    x, y = spec.sample_input(n * mb, key), spec.sample_target(n * mb, key)
    return [jax.tree.map(lambda a, k=k: a[k * mb : (k + 1) * mb], (x, y)) for k in range(n)]


def _flush(spec, plan, kind, optimizer, M=4, steps=2, mb=4, chunks=None):
    pipe = Pipeline(
        spec.layers,
        plan,
        spec.loss,
        optimizer,
        schedule=ScheduleSpec(kind, microbatches=M, chunks=chunks),
    )
    mbs = _microbatches(spec, M * steps, mb)
    state = pipe.init(jax.random.key(3), mbs[0][0])
    variables = pipe.variables(state)
    losses = []
    for t in range(steps):
        state, metrics = pipe.run(state, mbs[t * M : (t + 1) * M])
        losses += [float(v) for v in metrics.losses]
    ref, _, ref_losses = flush_training(
        spec.layers, spec.loss, optimizer, variables, mbs, M=M, rng=state.rng
    )
    np.testing.assert_allclose(losses, [float(v) for v in ref_losses], rtol=1e-5)
    return pipe, state, [v["params"] for v in pipe.variables(state)], ref


LLAMA = get_model("llama", "tiny")


@pytest.mark.parametrize(
    "kind,layout,optimizer",
    [
        ("gpipe", "two_quads", "sgd"),
        ("1f1b", "two_quads", "adamw_clip"),
        ("zb-h1", "four_pairs", "adamw_clip"),
        ("1f1b", "four_pairs", "sgd"),
    ],
)
def test_flush_schedules_on_sharded_stages_equal_sequential_training(kind, layout, optimizer):
    n = len(LLAMA.layers)
    plan = _two_quads(n) if layout == "two_quads" else _four_pairs(n)
    opt, atol = (SGD, 1e-6) if optimizer == "sgd" else (ADAMW_CLIP, 1e-5)
    pipe, state, got, ref = _flush(LLAMA, plan, kind, opt)
    _close(got, ref, atol=atol)
    # the weights and the optimizer's moments really are split over the mesh
    s0 = pipe.stages[0]
    assert s0.sharded and not s0.per_device
    specs = {str(a.sharding.spec) for a in jax.tree.leaves(state.params[0])}
    assert any("tensor" in s for s in specs), specs
    if optimizer == "adamw_clip":
        moments = [a for a in jax.tree.leaves(state.opt_state[0]) if a.ndim == 2]
        assert moments and all(not a.sharding.is_fully_replicated for a in moments)


def test_interleaved_on_sharded_device_groups_equals_sequential_training():
    # 4 stages on 2 device groups of (data 2 x tensor 2): stage s on group s % 2
    n = len(LLAMA.layers)
    mesh = {"data": 2, "tensor": 2}
    groups = [(0, 1, 2, 3), (4, 5, 6, 7)]
    plan = tuple(StagePlan(s, s, groups[s % 2], mesh=mesh) for s in range(n))
    _, _, got, ref = _flush(LLAMA, plan, "interleaved", SGD, M=4, chunks=2)
    _close(got, ref)


@pytest.mark.parametrize("kind", ["2bw", "pipedream"])
def test_streaming_schedules_on_sharded_stages_equal_the_delayed_recurrence(kind):
    n = len(LLAMA.layers)
    plan = _two_quads(n)
    P, M, steps = 2, 2, 3
    # pipedream runs the optimizer per stage: no global-norm clipping there
    opt = ADAMW_CLIP if kind == "2bw" else optax.adamw(1e-3)
    pipe = Pipeline(
        LLAMA.layers,
        plan,
        LLAMA.loss,
        opt,
        schedule=ScheduleSpec(kind, microbatches=M if kind == "2bw" else 1),
    )
    stream = _microbatches(LLAMA, M * steps, 4)
    state = pipe.init(jax.random.key(1), stream[0][0])
    variables = pipe.variables(state)
    state, metrics = pipe.run(state, stream)
    bounds = [(st.first_layer, st.last_layer + 1) for st in pipe.stage_specs]
    if kind == "2bw":  # M microbatches per update, the optimizer over the whole model
        versions = {"version_of": lambda s, k: max(0, k // M - 1), "M": M, "whole_model": True}
    else:  # an update per microbatch, stage s P - s microbatches behind
        versions = {"version_of": lambda s, k: max(0, k - (P - s) + 1)}
    ref = delayed_training(
        LLAMA.layers, LLAMA.loss, opt, variables, stream, bounds=bounds, rng=state.rng, **versions
    )
    _close(list(state.params), ref, atol=1e-5)
    assert max(metrics.peak_versions) >= 2  # weight versions were stashed, sharded


def _train(spec, plan, M=4, steps=2, mb=4):
    pipe = Pipeline(
        spec.layers, plan, spec.loss, SGD, schedule=ScheduleSpec("1f1b", microbatches=M)
    )
    mbs = _microbatches(spec, M * steps, mb)
    state = pipe.init(jax.random.key(3), mbs[0][0])
    losses = []
    for t in range(steps):
        state, metrics = pipe.run(state, mbs[t * M : (t + 1) * M])
        losses += [float(v) for v in metrics.losses]
    return losses, pipe.variables(state)


def test_tied_embedding_across_stages_with_different_meshes():
    # the tied pipeline on one device per stage is checked against an independent
    # one-array-per-parameter reference in test_tied.py; sharded, it must compute the same
    config = dataclasses.replace(LlamaConfig.tiny(), tie_embeddings=True)
    spec = make_spec(config, "tiny-tied")
    n = len(spec.layers)
    sharded = (
        StagePlan(0, n // 2 - 1, (0, 1, 2, 3), mesh=QUAD),
        StagePlan(n // 2, n - 1, (4, 5, 6, 7), mesh={"data": 2, "tensor": 2}),
    )
    plain = (StagePlan(0, n // 2 - 1, (0,)), StagePlan(n // 2, n - 1, (4,)))
    losses, got = _train(spec, sharded)
    want_losses, want = _train(spec, plain)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    _close([v["params"] for v in got], [v["params"] for v in want])
    table = np.asarray(got[0]["params"]["embedding"])
    np.testing.assert_array_equal(table, np.asarray(got[-1]["params"]["embedding"]))


def test_unannotated_model_shards_with_fsdp_auto():
    spec = get_model("mlp", "tiny")
    n = len(spec.layers)
    plan = (StagePlan(0, n - 1, tuple(range(8)), mesh={"fsdp": 4, "data": 2}),)
    pipe = Pipeline(
        spec.layers,
        plan,
        spec.loss,
        SGD,
        schedule=ScheduleSpec("1f1b", microbatches=2),
        sharding=ShardingRules(fsdp="auto"),
    )
    mbs = _microbatches(spec, 4, 8)
    state = pipe.init(jax.random.key(0), mbs[0][0])
    variables = pipe.variables(state)
    state, _ = pipe.run(state, mbs[:2])
    state, _ = pipe.run(state, mbs[2:])
    ref, _, _ = flush_training(spec.layers, spec.loss, SGD, variables, mbs, M=2, rng=state.rng)
    _close([v["params"] for v in pipe.variables(state)], ref)
    kernels = [a for a in jax.tree.leaves(state.params[0]) if a.ndim == 2]
    assert kernels and all("fsdp" in str(a.sharding.spec) for a in kernels)


def _device_bytes(tree, device):
    return sum(
        sh.data.nbytes
        for a in jax.tree.leaves(tree)
        for sh in a.addressable_shards
        if sh.device == device
    )


def test_per_device_bytes_of_a_sharded_stage_are_a_quarter_of_the_replicated():
    """Weights and Adam's moments, measured from live buffers on one device of a stage
    of (fsdp 2 x tensor 2) against the same stage replicated on 4 devices; the leaves the
    rules keep replicated (RMSNorm scales) are counted apart."""
    spec = get_model("llama", "small")
    n = len(spec.layers)
    x = spec.sample_input(8, jax.random.key(0))
    held = {}
    for name, mesh in (("replicated", None), ("sharded", QUAD)):
        plan = (
            StagePlan(0, n // 2 - 1, (0, 1, 2, 3), mesh=mesh),
            StagePlan(n // 2, n - 1, (4, 5, 6, 7), mesh=mesh),
        )
        pipe = Pipeline(
            spec.layers, plan, spec.loss, optax.adamw(1e-3), schedule=ScheduleSpec("1f1b")
        )
        state = pipe.init(jax.random.key(0), x)
        dev = pipe.stages[0].devices[0]
        per_leaf = []
        for tree in (state.params[0], state.opt_state[0]):
            for a in jax.tree.leaves(tree):
                mine = sum(sh.data.nbytes for sh in a.addressable_shards if sh.device == dev)
                per_leaf.append((a.sharding.is_fully_replicated, a.nbytes, mine))
        held[name] = per_leaf
    total_replicated = sum(mine for _, _, mine in held["replicated"])
    kept_whole = sum(mine for rep, _, mine in held["sharded"] if rep)
    split = sum(mine for rep, _, mine in held["sharded"] if not rep)
    # the same leaves, replicated: all of them less those the rules keep whole
    expected = (total_replicated - kept_whole) / 4
    assert abs(split - expected) <= 0.05 * expected, (split, expected, kept_whole)
    assert kept_whole < 0.01 * total_replicated  # norms and step counts only


# -- the plan records the mesh ------------------------------------------------------------


def test_the_plan_records_each_stage_mesh_and_round_trips_it():
    from pdjax.partition import Topology, evaluate_partition
    from pdjax.profile import profile

    spec = get_model("mlp", "tiny")
    prof = profile(spec.layers, spec.sample_input(4, jax.random.key(0)), device_model="h100")
    n = len(spec.layers)
    plan = evaluate_partition(
        prof, Topology.flat(8, 1e10), [(0, n // 2 - 1, 4), (n // 2, n - 1, 4)], schedule="1f1b"
    )
    sharded = dataclasses.replace(
        plan,
        stages=(
            dataclasses.replace(plan.stages[0], mesh={"tensor": 2, "fsdp": 2}),
            dataclasses.replace(plan.stages[1], mesh={"data": 4}),
        ),
    )
    assert sharded.stages[0].mesh == (("fsdp", 2), ("tensor", 2))  # tensor innermost
    assert sharded.stages[1].mesh is None  # {data: r} is the replicated stage
    assert "x4 (fsdp 2 x tensor 2)" in sharded.describe()
    data = json.loads(sharded.to_json())
    assert data["stages"][0]["mesh"] == {"fsdp": 2, "tensor": 2}
    assert "mesh" not in data["stages"][1]  # an unsharded stage's record is as before
    back = type(plan).from_json(sharded.to_json())
    assert back == sharded
    assert type(plan).from_json(plan.to_json()).stages[0].mesh is None


def test_bad_meshes_are_refused_with_what_to_do():
    with pytest.raises(PlanError, match="spans 8 devices, the stage has 4"):
        StagePlan(0, 1, (0, 1, 2, 3), mesh={"fsdp": 4, "tensor": 2})
    with pytest.raises(PlanError, match="round-robin"):
        StagePlan(0, 1, (0, 1), replication="round-robin", mesh={"tensor": 2})
    with pytest.raises(MeshError, match="AXIS=SIZE"):
        parse_mesh("tensor:2")
    with pytest.raises(MeshError, match="identifier"):
        parse_mesh("2=2")
    with pytest.raises(MeshError, match="twice"):
        parse_mesh("tensor=2,tensor=2")
    assert parse_mesh("tensor=2,data=2,fsdp=1") == (("data", 2), ("tensor", 2))


class _Named(nn.Module):
    names: tuple
    width: int = 6

    @nn.compact
    def __call__(self, x):
        init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), self.names)
        return nn.Dense(self.width, kernel_init=init, use_bias=False)(x)


def _refused(layers, mesh, match, rules=None, devices=4):
    from pdjax.layers import sequential

    plan = (StagePlan(0, len(layers) - 1, tuple(range(devices)), mesh=mesh),)
    seq = layers if hasattr(layers, "layers") else sequential(*layers)
    pipe = Pipeline(
        seq,
        plan,
        lambda y, t: jnp.mean((y - t) ** 2),
        SGD,
        schedule=ScheduleSpec("1f1b"),
        sharding=rules,
    )
    compiles = jax.config.jax_log_compiles
    with pytest.raises(ShardingError, match=match):
        pipe.init(jax.random.key(0), jnp.ones((4, 8)))
    assert not any(st._programs for st in pipe.stages)  # nothing was built
    del compiles


def test_bad_annotations_are_refused_before_anything_compiles():
    # an annotation naming an axis the rules lack: the leaf and the axis
    _refused(
        [_Named(("embed", "experts"))],
        QUAD,
        r"00__Named/Dense_0/kernel: logical axis 'experts' has no rule",
    )
    # a mesh axis that no rule uses and that does not split the batch
    rules = ShardingRules(rules=(("embed", "fsdp"), ("mlp", "tensor")))
    _refused(
        [_Named(("embed", "mlp"))],
        {"fsdp": 2, "expert": 2},
        r"mesh axis 'expert' \(size 2\) splits neither the batch nor any parameter",
        rules,
    )
    # a dimension its mesh axis does not divide: path, dimension, size, axis size
    _refused(
        [_Named(("embed", "mlp"), width=3)],
        QUAD,
        r"kernel: dimension 1 has size 3, which mesh axis tensor \(size 2\)",
    )
    # tensor > 1 and nothing annotated: says what to annotate, or fsdp='auto'
    _refused([nn.Dense(8)], {"tensor": 4}, r"tensor 4 but none of its parameters.*fsdp='auto'")
    # a name count that is not the leaf's rank
    _refused([_Named(("embed",))], QUAD, r"1 axis names .* shape \(8, 6\)")


def test_a_large_replicated_leaf_on_a_sharded_stage_warns_with_its_bytes():
    from pdjax.layers import sequential

    plan = (StagePlan(0, 0, (0, 1, 2, 3), mesh={"fsdp": 4}),)
    pipe = Pipeline(
        sequential(nn.Dense(64)),
        plan,
        lambda y, t: jnp.mean((y - t) ** 2),
        SGD,
        schedule=ScheduleSpec("1f1b"),
        sharding=ShardingRules(warn_bytes=1024),
    )
    with pytest.warns(UserWarning, match=r"00_Dense/kernel \(2,048 bytes\) stays replicated"):
        pipe.init(jax.random.key(0), jnp.ones((4, 8)))


def test_round_robin_on_a_sharded_stage_is_refused_with_its_reason():
    n = len(LLAMA.layers)
    with pytest.raises(PipelineError, match=r"round-robin .* sharded \(fsdp 2 x tensor 2\)"):
        Pipeline(
            LLAMA.layers,
            _two_quads(n),
            LLAMA.loss,
            SGD,
            schedule=ScheduleSpec("pipedream", replication="round-robin"),
        )


def test_a_memory_policy_on_sharded_stages_equals_sequential_training():
    n = len(LLAMA.layers)
    pipe = Pipeline(
        LLAMA.layers,
        _two_quads(n),
        LLAMA.loss,
        SGD,
        schedule=ScheduleSpec("1f1b", microbatches=2, remat=("full", "dots")),
    )
    mbs = _microbatches(LLAMA, 4, 4)
    state = pipe.init(jax.random.key(3), mbs[0][0])
    variables = pipe.variables(state)
    for t in range(2):
        state, _ = pipe.run(state, mbs[2 * t : 2 * t + 2])
    ref, _, _ = flush_training(LLAMA.layers, LLAMA.loss, SGD, variables, mbs, M=2, rng=state.rng)
    _close([v["params"] for v in pipe.variables(state)], ref)


def test_float16_loss_scaling_on_sharded_stages_skips_and_updates_as_unsharded():
    from pdjax.layers import sequential
    from pdjax.precision import loss_scaled

    layers = sequential(*LLAMA.layers.layers, names=LLAMA.layers.names, precision="f16")
    n = len(layers)
    runs = []
    for plan in (_two_quads(n), (StagePlan(0, 1, (0,)), StagePlan(2, 3, (4,)))):
        opt = loss_scaled(optax.sgd(0.1))
        pipe = Pipeline(
            layers, plan, LLAMA.loss, opt, schedule=ScheduleSpec("gpipe", microbatches=2)
        )
        mbs = _microbatches(LLAMA, 4, 4)
        state = pipe.init(jax.random.key(3), mbs[0][0])
        losses = []
        for t in range(2):
            state, metrics = pipe.run(state, mbs[2 * t : 2 * t + 2])
            losses += [float(v) for v in metrics.losses]
        scales = [(float(o.loss_scale), int(o.counter)) for o in state.opt_state]
        runs.append((losses, scales, [v["params"] for v in pipe.variables(state)]))
    (losses, scales, params), (want_losses, want_scales, want) = runs
    assert scales == want_scales  # the same steps skipped, the same scale
    # float16 sums in another order: rounded apart by float16's precision, not more
    np.testing.assert_allclose(losses, want_losses, rtol=2e-3)
    _close(params, want, rtol=2e-3, atol=1e-4)


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        up = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
        down = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("mlp", "embed"))
        h = nn.tanh(nn.Dense(32, kernel_init=up, use_bias=False)(x))
        return x + nn.Dense(x.shape[-1], kernel_init=down, use_bias=False)(h)


class _Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        for _ in range(4):
            x = _Block()(x)
        return x


def test_split_model_keeps_a_linen_model_annotations_on_sharded_stages():
    from pdjax import split_model

    model = _Net()
    xs = jax.random.normal(jax.random.key(0), (16, 8))
    ys = jax.random.normal(jax.random.key(1), (16, 8))
    layers = split_model(model, xs[:4])
    n = len(layers)

    def loss(o, t):
        return jnp.mean((o - t) ** 2)

    plan = (
        StagePlan(0, n // 2 - 1, (0, 1, 2, 3), mesh=QUAD),
        StagePlan(n // 2, n - 1, (4, 5, 6, 7), mesh={"tensor": 4}),
    )
    pipe = Pipeline(layers, plan, loss, SGD, schedule=ScheduleSpec("1f1b", microbatches=4))
    state = pipe.init(jax.random.key(3), xs[:4])
    variables = pipe.variables(state)
    state, _ = pipe.step(state, (xs, ys))
    mbs = [(xs[4 * k : 4 * k + 4], ys[4 * k : 4 * k + 4]) for k in range(4)]
    ref, _, _ = flush_training(layers, loss, SGD, variables, mbs, M=4, rng=state.rng)
    _close([v["params"] for v in pipe.variables(state)], ref)
    # the annotations reached the stages: every kernel of stage 1 split 4 ways over tensor
    for a in jax.tree.leaves(state.params[1]):
        assert a.addressable_shards[0].data.size * 4 == a.size, a.sharding


def test_train_config_mesh_shapes_the_runner_and_refuses_what_it_cannot_shape():
    from pdjax.apps.train import TrainConfig
    from pdjax.apps.train.runner import make_runner

    common = dict(model="llama", config="tiny", dataset="text", devices=8, batch_size=16)
    x = LLAMA.sample_input(4, jax.random.key(0))
    cfg = TrainConfig(**common, schedule="1f1b", plan="even", mesh="fsdp=2,tensor=2")
    pipe, text = make_runner(cfg, LLAMA, x)
    assert [st.mesh_axes for st in pipe.stages] == [(("fsdp", 2), ("tensor", 2))] * 2
    assert "2 stages of 4 layers, each on 4 devices (fsdp 2 x tensor 2)" in text
    per_stage = TrainConfig(**common, schedule="1f1b", plan="even", mesh="tensor=4;fsdp=4")
    pipe, _ = make_runner(per_stage, LLAMA, x)
    assert [st.mesh_axes for st in pipe.stages] == [(("tensor", 4),), (("fsdp", 4),)]
    dp, text = make_runner(TrainConfig(**common, schedule="dp", mesh="fsdp=8"), LLAMA, x)
    assert dp.sharded and text == "data parallel on 8 devices (fsdp 8)"
    bad = [
        (dict(schedule="1f1b", plan="auto", mesh="tensor=2"), r"planner chooses meshes itself"),
        (dict(schedule="auto", mesh="tensor=2"), r"planner chooses meshes itself"),
        (dict(schedule="1f1b", plan="even", mesh="tensor=3"), r"does not divide devices=8"),
        (dict(schedule="dp", mesh="fsdp=4"), r"one mesh whose sizes multiply to 8"),
        (dict(schedule="1f1b", plan="even", mesh="tensor=2;fsdp=4"), r"equal sizes"),
        (dict(schedule="1f1b", plan="even", mesh="tensor:2"), r"AXIS=SIZE"),
        (dict(schedule="1f1b", plan="even", fsdp_auto=True), r"give one, e.g. mesh='fsdp=4'"),
    ]
    for settings, match in bad:
        with pytest.raises(PipelineError, match=match):
            TrainConfig(**{**common, **settings})


def test_a_sharded_stage_initialises_the_weights_a_replicated_one_does_layer_by_layer():
    """``init`` on a sharded stage makes one layer at a time on one device and places it
    on its shardings (never the whole stage on every device): the same values."""
    n = len(LLAMA.layers)
    x = LLAMA.sample_input(4, jax.random.key(0))
    got = []
    for plan in (_two_quads(n), (StagePlan(0, n // 2 - 1, (0,)), StagePlan(n // 2, n - 1, (4,)))):
        pipe = Pipeline(LLAMA.layers, plan, LLAMA.loss, SGD, schedule=ScheduleSpec("1f1b"))
        state = pipe.init(jax.random.key(7), x)
        got.append(pipe.variables(state))
        if plan[0].sharded:
            kernel = state.params[0][1]["mlp"]["up"]["kernel"]
            assert kernel.addressable_shards[0].data.size * 4 == kernel.size
    jax.tree.map(np.testing.assert_array_equal, got[0], got[1])
