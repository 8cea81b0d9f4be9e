"""Mixed precision: parameters float32, compute (and activations between layers and stages)
bfloat16, the model's output float32; the backward recomputes the casts instead of keeping
bfloat16 weight copies; replicated stages sum float32 gradients; float16 only with loss
scaling (tests/test_loss_scaling.py)."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
import pytest
from flax import nnx
from reference import flush_training, random_stream, xent

import pdjax
from pdjax.errors import LayerError, PipelineError
from pdjax.layers import Fn, PrecisionLayer, sequential
from pdjax.models import get_model
from pdjax.partition import StagePlan
from pdjax.pipeline import Pipeline, even_stages
from pdjax.pipeline.executor import interpreter
from pdjax.precision import Policy, get_policy
from pdjax.schedules import ScheduleSpec

F32, BF16 = np.dtype(jnp.float32), np.dtype(jnp.bfloat16)
MIXED = Policy(jnp.float32, jnp.bfloat16, jnp.float32)


def _mse(y, t):
    return jnp.mean((y - t) ** 2)


def _linen_mlp(precision="bf16"):
    return sequential(
        nn.Dense(32), nn.relu, nn.Dense(32), jnp.tanh, nn.Dense(4), precision=precision
    )


def _nnx_model(precision="bf16"):
    return sequential(
        lambda rngs: nnx.Linear(6, 32, rngs=rngs),
        lambda rngs: nnx.BatchNorm(32, rngs=rngs),
        nnx.relu,
        lambda rngs: nnx.Linear(32, 4, rngs=rngs),
        precision=precision,
    )


def _xy(n=16, seed=1):
    kx, ky = jax.random.split(jax.random.key(seed))
    return jax.random.normal(kx, (n, 6)), jax.random.normal(ky, (n, 4))


def _dtypes(tree):
    return [np.dtype(a.dtype) for a in jax.tree.leaves(tree)]


# -- policies ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec",
    [
        "bf16",
        "bfloat16",
        " BF16 ",
        "params=float32,compute=bfloat16,output=float32",
        "c=bf16,o=f32",
    ],
)
def test_policy_strings(spec):
    assert get_policy(spec) == MIXED
    assert sequential(nn.Dense(2), precision=spec).precision == MIXED


def test_policy_objects_and_jmp_grammar():
    assert get_policy(MIXED) is MIXED
    assert get_policy(jmp.get_policy("p=f32,c=bf16,o=f32")) == MIXED
    # jmp's defaults for what a key=value string leaves out: output follows compute
    assert get_policy("compute=bfloat16") == Policy(jnp.float32, jnp.bfloat16, jnp.bfloat16)
    assert get_policy("float32") == Policy(jnp.float32, jnp.float32, jnp.float32)
    assert sequential(nn.Dense(2)).precision is None


@pytest.mark.parametrize(
    "spec, match",
    [
        ("bfloat17", "precision 'bfloat17' is not a policy .*'bf16'"),
        ("params=float32,cmpute=bf16", "Unknown key 'cmpute'.*params=float32,compute=bfloat16"),
        ("p=f32=c", "is not a policy"),
        ("compute=int8", "Unknown dtype 'int8'"),
        (3, "a jmp.Policy or a string, got int"),
        (Policy(jnp.float32, jnp.int32, jnp.float32), "compute_dtype is int32, not a float"),
    ],
)
def test_bad_policies_say_what_to_write(spec, match):
    with pytest.raises(LayerError, match=match):
        sequential(nn.Dense(2), precision=spec)


@pytest.mark.parametrize(
    "spec, policy",
    [
        ("f16", Policy(jnp.float32, jnp.float16, jnp.float32)),
        ("float16", Policy(jnp.float32, jnp.float16, jnp.float32)),
        ("p=f16,c=bf16", Policy(jnp.float16, jnp.bfloat16, jnp.bfloat16)),
    ],
)
def test_float16_trains_only_loss_scaled(spec, policy):
    """float16 policies parse; a pipeline refuses them without a loss-scaled optimizer
    (tests/test_loss_scaling.py trains them with one)."""
    seq = sequential(nn.Dense(2), precision=spec)
    assert seq.precision == policy
    with pytest.raises(PipelineError, match=r"float16.*loss_scaled"):
        Pipeline(seq, even_stages(len(seq), 1), _mse, optax.sgd(0.1))


def test_precision_is_given_once():
    seq = _linen_mlp()
    assert all(isinstance(layer, PrecisionLayer) for layer in seq)
    assert [layer.final for layer in seq] == [False] * 4 + [True]
    assert [layer.kind for layer in seq] == ["Dense", "relu", "Dense", "tanh", "Dense"]
    with pytest.raises(LayerError, match="already computes under precision"):
        sequential(*seq.layers, precision="bf16")
    # the layers as they are: the same policy, the same last layer
    again = sequential(*seq.layers)
    assert again.precision == MIXED and again.names == seq.names


# -- dtypes and gradients ---------------------------------------------------------------------


def _by_hand(seq, variables, x, train=False):
    """The model run fully in bfloat16 by hand: the wrapped layers fed bfloat16 copies of
    the parameters and input, each output cast to bfloat16 (nnx's BatchNorm returns float32
    from a bfloat16 input: its statistics are float32), the last one to float32."""

    def f(params):
        h = x.astype(jnp.bfloat16)
        states = []
        for layer, v, p in zip(seq.layers, variables, params, strict=True):
            h, s = layer.layer.apply({**v, "params": p}, h, train=train)
            h = h.astype(jnp.bfloat16)
            states.append(s)
        return h.astype(jnp.float32), states

    params = [
        jax.tree.map(lambda a: a.astype(jnp.bfloat16), v.get("params", {})) for v in variables
    ]
    return f, params


@pytest.mark.parametrize("build, train", [(_linen_mlp, False), (_nnx_model, True)])
def test_params_f32_activations_bf16_output_f32_grads_f32(build, train):
    seq = build()
    x, t = _xy()
    # each computation one jitted program (op by op, every operation would compile its own)
    variables = jax.jit(seq.init)(jax.random.key(0), x)
    # (a) parameters (and BatchNorm statistics) float32 in the variables
    assert set(_dtypes(variables)) == {F32}
    # (b) activations between layers bfloat16, (c) the output float32
    specs = seq.boundary_specs(variables, x)
    assert [_dtypes(s) for s in specs] == [[F32]] + [[BF16]] * (len(seq) - 1) + [[F32]]
    y, states = jax.jit(lambda v, x: seq.apply(v, x, train=train))(variables, x)
    assert y.dtype == F32
    h = x
    for layer, v in zip(seq.layers[:-1], variables, strict=False):
        h, _ = jax.eval_shape(lambda v, h, layer=layer: layer.apply(v, h, train=train), v, h)
        assert h.dtype == BF16
    # BatchNorm statistics stay float32 after a training-mode call
    assert set(_dtypes(states)) <= {F32}

    # (d) gradients float32, equal to the same model run in bfloat16 by hand
    def loss(params):
        vs = [{**v, "params": p} for v, p in zip(variables, params, strict=True)]
        out, _ = seq.apply(vs, x, train=train)
        return _mse(out, t)

    params = [v.get("params", {}) for v in variables]
    grads = jax.jit(jax.grad(loss))(params)
    assert set(_dtypes(grads)) == {F32}
    f, bf16_params = _by_hand(seq, variables, x, train=train)
    hand = jax.jit(jax.grad(lambda p: _mse(f(p)[0], t)))(bf16_params)
    assert set(_dtypes(hand)) == {BF16}
    for g, e in zip(jax.tree.leaves(grads), jax.tree.leaves(hand), strict=True):
        np.testing.assert_allclose(g, np.asarray(e, np.float32), rtol=1e-2, atol=1e-3)
    np.testing.assert_allclose(y, jax.jit(lambda p: f(p)[0])(bf16_params), rtol=1e-2, atol=1e-3)
    # and it did compute in bfloat16: the float32 model's gradients differ past its rounding
    f32 = sequential(*(layer.layer for layer in seq.layers), names=seq.names)

    def loss32(params):
        vs = [{**v, "params": p} for v, p in zip(variables, params, strict=True)]
        return _mse(f32.apply(vs, x, train=train)[0], t)

    g32 = jax.jit(jax.grad(loss32))(params)
    pairs = zip(jax.tree.leaves(grads), jax.tree.leaves(g32), strict=True)
    diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in pairs)
    assert 1e-5 < diff < 0.1


def test_params_dtype_of_the_policy():
    seq = sequential(nn.Dense(8), nn.Dense(2), precision="params=bf16,compute=bf16,output=f32")
    x, _ = _xy()
    variables = jax.jit(seq.init)(jax.random.key(0), x)
    assert set(_dtypes(variables)) == {BF16}
    assert jax.eval_shape(seq.apply, variables, x)[0].dtype == F32


def test_integer_and_key_inputs_are_never_cast():
    ids = jnp.asarray(np.array([[0, 257, 299], [1, 2, 259]], np.int32))  # not bfloat16s: 257, 259
    seen = []

    def record(tree):
        seen.append([a.dtype for a in jax.tree.leaves(tree)])
        return tree[0]

    seq = sequential(
        nn.Embed(300, 8),
        lambda h: h.mean(axis=1),
        nn.Dense(3),
        precision="bf16",
    )
    variables = jax.jit(seq.init)(jax.random.key(0), ids)
    specs = seq.boundary_specs(variables, ids)
    assert [_dtypes(s) for s in specs] == [[np.dtype(jnp.int32)], [BF16], [BF16], [F32]]
    rows, _ = jax.jit(seq.layers[0].apply)(variables[0], ids)
    table = np.asarray(variables[0]["params"]["embedding"]).astype(jnp.bfloat16)
    np.testing.assert_array_equal(rows, table[np.asarray(ids)])  # row 257, not row 256
    # a pytree input: float leaves cast, integer and key leaves as they are
    layer = sequential(Fn(record), precision="bf16").layers[0]
    key = jax.random.key(0)
    layer.apply({}, (jnp.ones(2), ids, key))
    assert seen[-1][:2] == [BF16, np.dtype(jnp.int32)]
    assert jax.dtypes.issubdtype(seen[-1][2], jax.dtypes.prng_key)


def test_tied_and_shared_checks_see_through_the_policy():
    tied = {"k": ["00_Dense/kernel", "01_Dense/kernel"]}
    seq = sequential(nn.Dense(4), nn.Dense(4), tied=tied, precision="bf16")
    v = jax.jit(seq.init)(jax.random.key(0), np.ones((2, 4), np.float32))
    np.testing.assert_array_equal(v[0]["params"]["kernel"], v[1]["params"]["kernel"])
    dense = nn.Dense(4)
    with pytest.raises(LayerError, match="share the Dense module instance"):
        sequential(dense, dense, precision="bf16")
    with pytest.raises(LayerError, match="function without parameters"):
        sequential(
            nn.relu, nn.Dense(2), tied={"g": ["00_relu/x", "01_Dense/kernel"]}, precision="bf16"
        )


def test_profile_costs_the_bf16_computation():
    x, _ = _xy(n=8)
    f32 = pdjax.profile(_linen_mlp(None), x)
    bf16 = pdjax.profile(_linen_mlp(), x)
    assert [lp.kind for lp in bf16.layers] == [lp.kind for lp in f32.layers]
    # what crosses a cut after each hidden layer: half the bytes; the output stays float32
    assert [lp.output_bytes for lp in bf16.layers[:-1]] == [
        lp.output_bytes // 2 for lp in f32.layers[:-1]
    ]
    assert bf16.layers[-1].output_bytes == f32.layers[-1].output_bytes
    assert "bfloat16" in bf16.layers[0].output_shape
    assert [lp.param_bytes for lp in bf16.layers] == [lp.param_bytes for lp in f32.layers]


# -- through the pipeline ---------------------------------------------------------------------


@pytest.mark.parametrize("build", [_linen_mlp, _nnx_model])
def test_pipeline_1f1b_equals_a_single_device_loop(build):
    seq = build()
    M, mb, steps = 2, 4, 3
    x, t = _xy(n=M * mb, seed=2)  # the same batch every step: its loss goes down
    x, t = jnp.concatenate([x] * steps), jnp.concatenate([t] * steps)
    optimizer = optax.sgd(0.1)
    pipe = Pipeline(
        seq,
        even_stages(len(seq), 2),
        _mse,
        optimizer,
        schedule=ScheduleSpec("1f1b", microbatches=M),
    )
    state = pipe.init(jax.random.key(3), x[:mb])
    variables = pipe.variables(state)
    assert set(_dtypes(variables)) == {F32}
    # the activation crossing the cut is bfloat16: half the bytes of float32
    cut = jax.eval_shape(
        pipe.stages[0].microbatch_output,
        state.params[0],
        state.model_state[0],
        x[:mb],
        jax.random.key(0),
    )
    assert _dtypes(cut) == [BF16]
    losses = []
    for s in range(steps):
        batch = (x[s * M * mb : (s + 1) * M * mb], t[s * M * mb : (s + 1) * M * mb])
        state, metrics = pipe.step(state, batch)
        losses += [float(v) for v in metrics.losses]
    microbatches = [(x[k * mb : (k + 1) * mb], t[k * mb : (k + 1) * mb]) for k in range(M * steps)]
    ref_params, ref_state, ref_losses = flush_training(
        seq, _mse, optimizer, variables, microbatches, M=M, rng=state.rng
    )
    np.testing.assert_allclose(losses, [float(v) for v in ref_losses], rtol=1e-5)
    got = pipe.variables(state)
    assert set(_dtypes(got)) == {F32}
    for a, b in zip(
        jax.tree.leaves([v["params"] for v in got]), jax.tree.leaves(ref_params), strict=True
    ):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    ref_stats = jax.tree.leaves(ref_state)
    for a, b in zip(
        jax.tree.leaves([{k: s for k, s in v.items() if k != "params"} for v in got]),
        ref_stats,
        strict=True,
    ):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert np.mean(losses[-M:]) < np.mean(losses[:M])


# -- the backward keeps no compute-dtype weight copy -----------------------------------------


def _residuals(f, *args):
    """``(shape, dtype)`` of each residual of ``jax.vjp(f, *args)`` that is not an argument."""
    found = []

    def probe(*args):
        y, pullback = jax.vjp(f, *args)
        given = {id(a) for a in jax.tree.leaves(args)}
        found.extend(
            (a.shape, np.dtype(a.dtype)) for a in jax.tree.leaves(pullback) if id(a) not in given
        )
        return y

    jax.eval_shape(probe, *args)
    return found


def _cast_by_hand(layer):
    """``layer`` (a PrecisionLayer) as it was: its casts differentiated directly, so the
    VJP keeps their compute-dtype copies."""
    policy = layer.policy
    out = policy.cast_to_output if layer.final else policy.cast_to_compute

    def apply(variables, x, **kw):
        cast = {**variables, "params": policy.cast_to_compute(variables.get("params", {}))}
        y, state = layer.layer.apply(cast, policy.cast_to_compute(x), **kw)
        return out(y), state

    return apply


def _llama_bf16():
    spec = get_model("llama", num_layers=1)
    x, _ = spec.sample_batch(2, jax.random.key(0))
    return sequential(*spec.layers.layers, precision="bf16"), x


@pytest.mark.parametrize("build", [lambda: (_linen_mlp(), _xy(n=8)[0]), _llama_bf16])
def test_backward_recomputes_the_casts_instead_of_keeping_bf16_weights(build):
    seq, x = build()
    variables = jax.jit(seq.init)(jax.random.key(0), x)
    x0, removed = x, 0
    for layer, v in zip(seq.layers, variables, strict=True):
        if not v.get("params"):
            x, _ = jax.eval_shape(layer.apply, v, x)
            continue
        kw = {"train": True, "rng": jax.random.key(5)}
        by_hand = _cast_by_hand(layer)

        def new(p, h, v=v, layer=layer, kw=kw):
            return layer.apply({**v, "params": p}, h, **kw)[0]

        def old(p, h, v=v, by_hand=by_hand, kw=kw):
            return by_hand({**v, "params": p}, h, **kw)[0]

        # the residuals are the casts' by hand less the compute-dtype copies of the weights
        # (and of a float32 input)
        cast_x = [a for a in jax.tree.leaves(x) if a.dtype == F32]
        copies = {a.shape for a in jax.tree.leaves((v["params"], cast_x))}
        kept_by_hand = _residuals(old, v["params"], x)
        expected = [r for r in kept_by_hand if not (r[1] == BF16 and r[0] in copies)]
        removed += len(kept_by_hand) - len(expected)
        assert sorted(_residuals(new, v["params"], x), key=str) == sorted(expected, key=str)

        x, _ = jax.eval_shape(layer.apply, v, x)
    assert removed >= 2  # the test can fail: the casts by hand kept copies

    # and the values are those of differentiating the casts: bit for bit, the whole model
    def run(by_hand, params, x):
        def f(params, x):
            for layer, v, p in zip(seq.layers, variables, params, strict=True):
                apply = _cast_by_hand(layer) if by_hand else layer.apply
                x, _ = apply({**v, "params": p}, x, train=True, rng=jax.random.key(5))
            return x

        y, pullback = jax.vjp(f, params, x)
        ct = jnp.cos(jnp.arange(y.size, dtype=jnp.float32)).reshape(y.shape).astype(y.dtype)
        return y, pullback(ct)

    params = [v.get("params", {}) for v in variables]
    got = jax.jit(run, static_argnums=0)(False, params, x0)
    want = jax.jit(run, static_argnums=0)(True, params, x0)
    assert _dtypes(got) == _dtypes(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        if a.dtype != jax.dtypes.float0:
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_profile_residuals_have_no_bf16_weight_copy():
    x, _ = _xy(n=8)
    seq = sequential(nn.Dense(64), precision="bf16")
    variables = seq.init(jax.random.key(0), x)
    (layer,) = seq.layers
    by_hand = _residuals(
        lambda p, h: _cast_by_hand(layer)({"params": p}, h)[0], variables[0]["params"], x
    )
    # by hand: the bfloat16 kernel and input; now neither
    kernel = variables[0]["params"]["kernel"]
    assert sorted(by_hand, key=str) == sorted([(kernel.shape, BF16), (x.shape, BF16)], key=str)
    assert pdjax.profile(seq, x).layers[0].residual_bytes == 0


# -- replicated stages sum gradients in float32 ----------------------------------------------

_ALL_REDUCE_LINE = re.compile(r"=\s*(.*?)\ball-reduce(?:-start)?\(")


def test_replicated_bf16_stage_all_reduces_float32_gradients(monkeypatch):
    """A bfloat16 stage replicated on two devices, its gradients summed per device and
    all-reduced at the update: the all-reduce carries float32 (each device's partial sum is
    cast back to float32 through the parameter cast before the sum), and the result is
    that of a plain loop computing the same: each microbatch's stage-0 weight gradient as
    the float32 sum of its two halves' (each from the whole microbatch's cotangent)."""
    texts = []
    real = interpreter._ALL_REDUCE

    class Recorder:
        def findall(self, text):
            texts.append(text)
            return real.findall(text)

    monkeypatch.setattr(interpreter, "_ALL_REDUCE", Recorder())
    layers = sequential(nn.Dense(32), nn.tanh, nn.Dense(32), nn.Dense(10), precision="bf16")
    stream = random_stream(4, 12)
    opt = optax.sgd(0.05)
    plan = (StagePlan(0, 1, (0, 1)), StagePlan(2, 3, (2,)))
    pipe = Pipeline(layers, plan, xent, opt, schedule=ScheduleSpec("1f1b", microbatches=2))
    state = pipe.init(jax.random.key(0), stream[0][0])
    start = pipe.variables(state)
    state, metrics = pipe.run(state, stream, collectives=True)
    assert pipe.grad_allreduce_at[0] == "update"
    assert metrics.all_reduces["BU"] == 2  # one per update of the replicated stage
    types = [m.group(1) for t in texts for m in _ALL_REDUCE_LINE.finditer(t)]
    assert len(types) == 1  # one compiled update program holds it
    dtypes = set(re.findall(r"\b([a-z]+\d+)\[", types[0]))
    assert dtypes == {"f32"}, types
    ref = _halves_reference(layers, opt, [v["params"] for v in start], stream, M=2)
    got = [v["params"] for v in pipe.variables(state)]
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _halves_reference(layers, opt, params, stream, M):
    """Plain single-device training of layers 0-1 | 2-3 where layers 0-1's weight gradient
    of each microbatch is the float32 sum of its two halves' (what two replicas compute)."""

    def head(p, x):
        for layer, q in zip(layers.layers[:2], p, strict=True):
            x, _ = layer.apply({"params": q}, x)
        return x

    def tail(p, h, y):
        for layer, q in zip(layers.layers[2:], p, strict=True):
            h, _ = layer.apply({"params": q}, h)
        return xent(h, y)

    @jax.jit
    def grad(params, x, y):
        h, _ = jax.vjp(head, params[:2], x)
        g_tail, ct = jax.grad(tail, argnums=(0, 1))(params[2:], h, y)
        n = x.shape[0] // 2
        halves = [jax.vjp(head, params[:2], x[k : k + n])[1](ct[k : k + n])[0] for k in (0, n)]
        return jax.tree.map(jnp.add, *halves) + g_tail

    @jax.jit
    def update(grads, opt_state, params):
        acc = jax.tree.map(lambda *g: sum(g[1:], g[0]) * jnp.float32(1 / len(g)), *grads)
        updates, opt_state = opt.update(acc, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    params = jax.device_put(params, jax.devices()[0])
    opt_state = opt.init(params)
    for t in range(0, len(stream), M):
        grads = [grad(params, jnp.asarray(x), jnp.asarray(y)) for x, y in stream[t : t + M]]
        params, opt_state = update(grads, opt_state, params)
    return params
