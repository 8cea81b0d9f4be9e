"""Tied parameters (``sequential(..., tied=...)``): an embedding shared with the output head
trains in a pipeline as one parameter, as in sequential training with one shared array;
the copies stay bit for bit equal; what cannot stay exact is refused."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from reference import mean_update, pipeline_kwargs

from pdjax.errors import LayerError, PipelineError
from pdjax.layers import sequential
from pdjax.partition import StagePlan
from pdjax.pipeline import Pipeline
from pdjax.pipeline.lowering import Placement, lower
from pdjax.runners import Checkpointer
from pdjax.schedules import ScheduleSpec, generate

V, D = 16, 8  # vocabulary, width
WTE = ["00_Embed/embedding", "04_Head/embedding"]
KERNELS = ["01_Dense/kernel", "03_Dense/kernel"]


class Head(nn.Module):
    """The output head: logits ``x @ E.T`` with its own copy ``E`` of the embedding."""

    @nn.compact
    def __call__(self, x):
        e = self.param("embedding", nn.initializers.normal(1.0), (V, D))
        return x @ e.T


def _layers(wte=True, kernels=False):
    tied = {}
    if wte:
        tied["wte"] = WTE
    if kernels:
        tied["kernel"] = KERNELS
    return sequential(nn.Embed(V, D), nn.Dense(D), jnp.tanh, nn.Dense(D), Head(), tied=tied)


def _loss(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _batches(steps, size, seed=0):
    rng = np.random.default_rng(seed)
    return [
        (rng.integers(0, V, size).astype(np.int32), rng.integers(0, V, size).astype(np.int32))
        for _ in range(steps)
    ]


# -- the independent reference: one array per tied parameter ------------------------------


def _forward(p, x):
    """The tied model written out: the head multiplies by the embedding's own matrix."""
    h = jnp.take(p["E"], x, axis=0)
    h = jnp.tanh(h @ p["k1"] + p["b1"][None])
    h = h @ p.get("k3", p["k1"]) + p["b3"][None]
    return h @ p["E"].T


def _reference_params(variables, kernels):
    v = [x.get("params", {}) for x in variables]
    p = {"E": v[0]["embedding"], "k1": v[1]["kernel"], "b1": v[1]["bias"], "b3": v[3]["bias"]}
    if not kernels:
        p["k3"] = v[3]["kernel"]
    return jax.device_put(p, jax.devices()[0])


def _reference(optimizer, params, batches, M):
    """Sequential training: per step, the mean of M microbatch gradients, one update (each
    gradient and each update one jitted program)."""
    grad = jax.jit(jax.value_and_grad(lambda p, x, y: _loss(_forward(p, x), y)))
    update = mean_update(optimizer)
    opt_state = jax.device_put(optimizer.init(params), jax.devices()[0])  # beside params
    losses, history = [], []
    for x, y in batches:
        size = len(x) // M
        grads = []
        for k in range(M):
            loss, g = grad(params, x[k * size : (k + 1) * size], y[k * size : (k + 1) * size])
            losses.append(float(loss))
            grads.append(g)
        params, opt_state = update(grads, opt_state, params)
        history.append(params)
    return losses, history


def _as_reference(params, kernels):
    """A pipeline's merged params in the reference's layout (the first copy of each)."""
    p = {
        "E": params["00_Embed"]["embedding"],
        "k1": params["01_Dense"]["kernel"],
        "b1": params["01_Dense"]["bias"],
        "b3": params["03_Dense"]["bias"],
    }
    if not kernels:
        p["k3"] = params["03_Dense"]["kernel"]
    return p


def _assert_copies_identical(params, kernels=False, wte=True):
    pairs = [(params["00_Embed"]["embedding"], params["04_Head"]["embedding"])] if wte else []
    if kernels:
        pairs.append((params["01_Dense"]["kernel"], params["03_Dense"]["kernel"]))
    for a, b in pairs:
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()


def _assert_close(got, want):
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=1e-6),
        got,
        want,
    )


def _train(layers, stages, optimizer, *, schedule, M, batches, **kwargs):
    """Trains step by step; returns the initial variables, losses, params after each step."""
    pipe = Pipeline(
        layers,
        stages,
        _loss,
        optimizer,
        **pipeline_kwargs(schedule=schedule, microbatches=M, **kwargs),
    )
    state = pipe.init(jax.random.key(1), batches[0][0][: len(batches[0][0]) // M])
    variables = pipe.variables(state)
    losses, history = [], []
    for batch in batches:
        state, metrics = pipe.step(state, batch)
        losses += [float(v) for v in metrics.losses]
        history.append(pipe.params(state))
    return pipe, state, variables, losses, history


def _check_against_reference(layers, stages, optimizer, schedule, M, kernels=False, **kwargs):
    batches = _batches(3, 4 * M)
    pipe, _, variables, losses, history = _train(
        layers, stages, optimizer(), schedule=schedule, M=M, batches=batches, **kwargs
    )
    _assert_copies_identical(_merged(pipe, variables), kernels)  # from the start
    ref_losses, ref_history = _reference(
        optimizer(), _reference_params(variables, kernels), batches, M
    )
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for params, ref in zip(history, ref_history, strict=True):
        _assert_copies_identical(params, kernels)
        _assert_close(_as_reference(params, kernels), ref)
    return pipe


def _merged(pipe, variables):
    return pipe.layers.merge(variables)["params"]


P2 = [StagePlan(0, 2, (0,)), StagePlan(3, 4, (1,))]
P3 = [StagePlan(0, 1, (0,)), StagePlan(2, 3, (1,)), StagePlan(4, 4, (2,))]
# interleaved: 2 device groups x 2 chunks; the embedding on stage 0, the head on stage 3
I4 = [StagePlan(0, 0, (0,)), StagePlan(1, 2, (1,)), StagePlan(3, 3, (0,)), StagePlan(4, 4, (1,))]
R2 = [StagePlan(0, 2, (0, 1)), StagePlan(3, 4, (2,))]  # the embedding's stage on 2 devices
SAME = [StagePlan(0, 3, (0,)), StagePlan(4, 4, (1,))]  # both Dense layers on stage 0
ONE = [StagePlan(0, 4, (0,))]

CASES = {
    "1f1b-P2-M2": (P2, "1f1b", 2, {}),
    "1f1b-P3-M4": (P3, "1f1b", 4, {}),
    "gpipe-P2-M3": (P2, "gpipe", 3, {}),
    "gpipe-P3-M2": (P3, "gpipe", 2, {}),
    "interleaved": (I4, "interleaved", 2, {"chunks": 2}),
    "zb-h1": (P2, "zb-h1", 2, {}),
    "split-replicas": (R2, "1f1b", 2, {}),
    "round-robin": (R2, "gpipe", 2, {"replication": "round-robin"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_tied_embedding_across_stages_equals_sequential_training(case):
    stages, schedule, M, kwargs = CASES[case]
    pipe = _check_against_reference(
        _layers(), stages, lambda: optax.adam(1e-2), schedule, M, **kwargs
    )
    holders = dict(pipe.tied_stages)["wte"]
    assert holders[0] == 0 and len(holders) == 2


@pytest.mark.parametrize("stages", [SAME, ONE], ids=["two-stages", "one-stage"])
def test_tied_copies_on_one_stage(stages):
    # the kernels tie on stage 0 (summed inside its update, fused or not); the embedding
    # ties across stages (or, on one stage, inside it too)
    _check_against_reference(
        _layers(kernels=True), stages, lambda: optax.adam(1e-2), "1f1b", 2, kernels=True
    )


def test_tied_copies_on_one_stage_under_pipedream():
    layers = _layers(wte=False, kernels=True)
    pipe = Pipeline(layers, SAME, _loss, optax.sgd(0.1), schedule=ScheduleSpec("pipedream"))
    stream = _batches(5, 4)
    state = pipe.init(jax.random.key(1), stream[0][0])
    before = _merged(pipe, pipe.variables(state))
    _assert_copies_identical(before, kernels=True, wte=False)
    state, _ = pipe.run(state, stream)
    after = pipe.params(state)
    _assert_copies_identical(after, kernels=True, wte=False)
    assert not np.allclose(after["01_Dense"]["kernel"], before["01_Dense"]["kernel"])


@pytest.mark.parametrize("stages", [P2, P3, ONE], ids=["P2", "P3", "one-stage"])
def test_global_norm_clipping_counts_a_tied_parameter_once(stages):
    def optimizer():
        return optax.chain(optax.clip_by_global_norm(0.05), optax.sgd(0.5))

    pipe = _check_against_reference(_layers(), stages, optimizer, "1f1b", 2)
    if len(stages) > 1:
        assert pipe.coupled  # the norm is exchanged between the stages

    # counting the embedding twice in the norm would be visibly different
    def twice():
        inner = optimizer()

        def with_copy(t):
            return None if t is None else {**t, "E_copy": t["E"]}

        def update(g, s, p=None):
            u, s = inner.update(with_copy(g), s, with_copy(p))
            return {k: v for k, v in u.items() if k != "E_copy"}, s

        return optax.GradientTransformation(lambda p: inner.init(with_copy(p)), update)

    batches = _batches(3, 8)
    variables = jax.jit(pipe.layers.init)(jax.random.key(5), batches[0][0][:4])
    p0 = _reference_params(variables, False)
    _, once = _reference(optimizer(), p0, batches, 2)
    _, double = _reference(twice(), p0, batches, 2)
    assert np.max(np.abs(np.asarray(once[-1]["E"]) - np.asarray(double[-1]["E"]))) > 1e-4


def test_async_schedules_refuse_ties_across_stages():
    for schedule in ("pipedream", "2bw"):
        with pytest.raises(PipelineError, match=r"'wte' has copies on stages \[0, 1\].*1f1b"):
            Pipeline(
                _layers(),
                P2,
                _loss,
                optax.sgd(0.1),
                schedule=ScheduleSpec(schedule, microbatches=2),
            )
    with pytest.raises(PipelineError, match="optimizer_scope='stage'"):
        Pipeline(_layers(), P2, _loss, optax.sgd(0.1), optimizer_scope="stage")
    # ties on one stage are fine under any schedule
    Pipeline(
        _layers(wte=False, kernels=True),
        SAME,
        _loss,
        optax.sgd(0.1),
        schedule=ScheduleSpec("pipedream"),
    )


def test_bad_tied_specs_are_refused():
    layers = (nn.Embed(V, D), nn.Dense(D), jnp.tanh, nn.Dense(D), Head())
    x = jnp.zeros((4,), jnp.int32)
    with pytest.raises(LayerError, match="no layer is called that"):
        sequential(*layers, tied={"wte": ["nope/embedding", "04_Head/embedding"]})
    with pytest.raises(LayerError, match="at least two"):
        sequential(*layers, tied={"wte": ["00_Embed/embedding"]})
    with pytest.raises(LayerError, match="listed in groups 'a' and 'b'"):
        sequential(*layers, tied={"a": WTE, "b": ["00_Embed/embedding", "01_Dense/bias"]})
    with pytest.raises(LayerError, match="function without parameters"):
        sequential(*layers, tied={"a": ["02_tanh/x", "01_Dense/bias"]})
    with pytest.raises(LayerError, match="map a group name"):
        sequential(*layers, tied=["00_Embed/embedding"])
    # linen shapes are known at init: unknown path, mismatched shapes
    seq = sequential(*layers, tied={"wte": ["00_Embed/embeddings", "04_Head/embedding"]})
    with pytest.raises(LayerError, match=r"no parameter at 'embeddings'.*\['embedding'\]"):
        seq.init(jax.random.key(0), x)
    with pytest.raises(LayerError, match="no parameter at"):
        Pipeline(seq, P2, _loss, optax.sgd(0.1)).init(jax.random.key(0), x)
    seq = sequential(*layers, tied={"w": ["00_Embed/embedding", "01_Dense/kernel"]})
    with pytest.raises(LayerError, match=r"float32\[8, 8\].*float32\[16, 8\].*one shape"):
        seq.init(jax.random.key(0), x)
    # nnx shapes are known at construction
    with pytest.raises(LayerError, match="one shape and dtype"):
        sequential(
            nnx.Linear(D, D, rngs=nnx.Rngs(0)),
            nnx.Linear(D, 4, rngs=nnx.Rngs(1)),
            tied={"k": ["00_Linear/kernel", "01_Linear/kernel"]},
        )


class NnxEmbed(nnx.Module):
    def __init__(self, rngs):
        self.embedding = nnx.Param(jax.random.normal(rngs.params(), (V, D)))

    def __call__(self, x):
        return jnp.take(self.embedding.get_value(), x, axis=0)


class NnxHead(nnx.Module):
    """Holds the embedding module itself (the nnx way to tie)."""

    def __init__(self, embed):
        self.embed = embed

    def __call__(self, x):
        return x @ self.embed.embedding.get_value().T


def test_an_nnx_variable_shared_by_two_layers_trains_as_one_when_declared():
    embed = NnxEmbed(nnx.Rngs(0))
    linear = nnx.Linear(D, D, rngs=nnx.Rngs(1))
    head = NnxHead(embed)
    with pytest.raises(LayerError, match=r"tied=\{'embedding': \['e/embedding', 'h/embed/embed"):
        sequential(embed, linear, head, names=["e", "l", "h"])
    layers = sequential(
        embed,
        linear,
        head,
        names=["e", "l", "h"],
        tied={"wte": ["e/embedding", "h/embed/embedding"]},
    )
    stages = [StagePlan(0, 1, (0,)), StagePlan(2, 2, (1,))]
    batches = _batches(3, 8)
    _, _, variables, losses, history = _train(
        layers, stages, optax.adam(1e-2), schedule="1f1b", M=2, batches=batches
    )

    def forward(p, x):
        return (jnp.take(p["E"], x, axis=0) @ p["k"] + p["b"][None]) @ p["E"].T

    grad = jax.jit(jax.value_and_grad(lambda p, x, y: _loss(forward(p, x), y)))
    v = [x["params"] for x in variables]
    p = {"E": v[0]["embedding"], "k": v[1]["kernel"], "b": v[1]["bias"]}
    p = jax.device_put(p, jax.devices()[0])
    opt = optax.adam(1e-2)
    update = mean_update(opt)  # the mean of the two gradients, adam, apply: one program
    o = jax.device_put(opt.init(p), jax.devices()[0])
    for (x, y), got in zip(batches, history, strict=True):
        grads = [grad(p, x[4 * k : 4 * k + 4], y[4 * k : 4 * k + 4])[1] for k in range(2)]
        p, o = update(grads, o, p)
        a, b = np.asarray(got["e"]["embedding"]), np.asarray(got["h"]["embed"]["embedding"])
        assert a.tobytes() == b.tobytes()
        _assert_close({"E": a, "k": got["l"]["kernel"], "b": got["l"]["bias"]}, p)
    assert np.isfinite(losses).all()


def test_checkpoint_restores_tied_copies_identical(tmp_path):
    def pipeline():
        return Pipeline(
            _layers(), P3, _loss, optax.adam(1e-2), schedule=ScheduleSpec("1f1b", microbatches=2)
        )

    batches = _batches(3, 8)
    pipe = pipeline()
    state = pipe.init(jax.random.key(1), batches[0][0][:4])
    state, _ = pipe.step(state, batches[0])
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, state)
        other = pipeline()
        restored, _ = ckpt.restore(other.init(jax.random.key(2), batches[0][0][:4]))
        # the tied embedding is stored once: its head copy names the embedding's array
        meta = ckpt._read_meta(1)["arrays"]
        assert meta["params.2.0.embedding"]["same_as"] == "params.0.0.embedding"
        assert "same_as" not in meta["params.0.0.embedding"]
    want = pipe.params(state)
    got = other.params(restored)
    _assert_copies_identical(got)
    jax.tree.map(
        lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), got, want
    )
    # training goes on alike, copies still one
    restored, _ = other.step(restored, batches[1])
    state, _ = pipe.step(state, batches[1])
    got, want = other.params(restored), pipe.params(state)
    _assert_copies_identical(got)
    jax.tree.map(
        lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), got, want
    )


@pytest.mark.parametrize(
    "wte,saved,restored",
    [(True, "P3", "P1"), (False, "P1", "P3")],
    ids=["tied-3-to-1-stage", "untied-1-to-3-stages"],
)
def test_a_global_norm_checkpoint_moves_between_one_stage_and_several(
    tmp_path, wte, saved, restored
):
    """With clip_by_global_norm, stages of a cut plan keep their optimizer state over
    (parameters, phantom scalar) and a single stage does not: the state moves both ways
    and training goes on as the run that was never cut differently (the tied embedding's
    state with its group)."""
    plans = {"P1": [StagePlan(0, 4, (0,))], "P3": P3}
    opt = optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-2))
    batches = _batches(4, 8)

    def run(plan):
        pipe = Pipeline(
            _layers(wte=wte), plans[plan], _loss, opt, schedule=ScheduleSpec("1f1b", microbatches=2)
        )
        state = pipe.init(jax.random.key(1), batches[0][0][:4])
        for batch in batches[:2]:
            state, _ = pipe.step(state, batch)
        return pipe, state

    _, before = run(saved)
    pipe, uncut = run(restored)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(2, before)
        state, _ = ckpt.restore(pipe.init(jax.random.key(2), batches[0][0][:4]), pipeline=pipe)
    for batch in batches[2:]:
        state, got = pipe.step(state, batch)
        uncut, want = pipe.step(uncut, batch)
        np.testing.assert_allclose(got.loss, want.loss, rtol=1e-6)
    _assert_close(pipe.params(state), jax.device_get(pipe.params(uncut)))
    _assert_copies_identical(pipe.params(state), wte=wte)


def test_lowering_exchanges_tied_gradients_and_values():
    place = Placement.local([(0,), (1,), (2,)])
    prog = lower(generate("1f1b", 3, 2), place, tied=((0, 2),))
    ops = prog.ops[0]
    assert not any(op.kind in ("BU", "FBU") and op.stage in (0, 2) for op in ops)
    (tg,) = [op for op in ops if op.kind == "TG"]
    assert (tg.stage, tg.ins, tg.outs) == (2, ("g2.1",), ("pg2.0:0",))
    u = {op.stage: op for op in ops if op.kind == "U"}
    assert u[0].ins == ("g0.1", "w0v0", "o0v0", "pg2.0@0") and u[0].outs[2:] == ("nw0.0:2",)
    assert u[2].ins[3:] == ("nw0.0:2@2",) and u[2].outs == ("w2v1", "o2v1")
    moves = [(op.stage, op.peer, op.ins, op.outs) for op in ops if op.kind == "MOVE"]
    assert (2, 0, ("pg2.0:0",), ("pg2.0@0",)) in moves
    assert (0, 2, ("nw0.0:2",), ("nw0.0:2@2",)) in moves
    # stage 1 holds no copy: its update is fused as before
    assert any(op.kind in ("BU", "FBU") and op.stage == 1 for op in ops)
    # with the global norm exchanged, the owner's sum of squares waits for the gradients
    prog = lower(generate("1f1b", 3, 2), place, tied=((0, 2),), coupled=True)
    (sq,) = [op for op in prog.ops[0] if op.kind == "SQ" and op.stage == 0]
    assert sq.ins == ("g0.1", "pg2.0@0")
    with pytest.raises(PipelineError, match="update once per step"):
        lower(generate("pipedream", 3, 4), place, tied=((0, 2),))


def test_data_parallel_refuses_tied_parameters():
    """DataParallel would train each copy apart: it refuses, naming what does tie them."""
    from pdjax.runners import DataParallel

    with pytest.raises(PipelineError, match=r"tied parameters.*Pipeline with one stage"):
        DataParallel(_layers(), _loss, optax.sgd(0.1))
