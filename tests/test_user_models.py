"""Models written the way Flax users write them, trained through pdjax and checked against
plain single-device loops of the same model.

* an nnx transformer in the style of Flax's own examples: token and position embeddings,
  pre-norm blocks with dropout whose ``__call__`` takes ``deterministic``, and an output
  head that calls ``embed.attend`` on the *same* ``nnx.Embed`` (a tied embedding);
* a linen CNN with BatchNorm and Dropout whose ``__call__`` takes ``train``.

The nnx reference is the user's own model trained with ``nnx.grad`` (the tied embedding is
one ``nnx.Param`` there), each layer reseeded as pdjax seeds it (layer ``i`` of microbatch
``k``: ``fold_in(fold_in(rng, k), i)``). The trained values go back into the user's module
(:func:`pdjax.export.update_nnx`, :func:`pdjax.export.linen_variables`), and the user's
module evaluates to what :meth:`Pipeline.evaluate` computes through the stages.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from reference import delayed_training, flush_training, mean_update

import pdjax
from pdjax.errors import PipelineError
from pdjax.partition import StagePlan
from pdjax.pipeline import Pipeline
from pdjax.runners import Checkpointer
from pdjax.schedules import ScheduleSpec

V, D, T, HEADS = 32, 16, 8, 2  # vocabulary, width, tokens, attention heads
DROP = 0.1  # dropout rate


# -- an nnx transformer, tutorial style ------------------------------------------------------


class Embedding(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.tok = nnx.Embed(V, D, rngs=rngs)
        self.pos = nnx.Embed(T, D, rngs=rngs)
        self.dropout = nnx.Dropout(DROP, rngs=rngs)

    def __call__(self, ids, *, deterministic: bool = False):
        x = self.tok(ids) + self.pos(jnp.arange(ids.shape[1]))[None]
        return self.dropout(x, deterministic=deterministic)


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.ln1 = nnx.LayerNorm(D, rngs=rngs)
        # no biases: a key bias has an exactly zero gradient (softmax ignores it), whose
        # rounding noise Adam would blow up to full-size steps, differently in each loop
        self.attn = nnx.MultiHeadAttention(
            num_heads=HEADS, in_features=D, decode=False, use_bias=False, rngs=rngs
        )
        self.ln2 = nnx.LayerNorm(D, rngs=rngs)
        self.up = nnx.Linear(D, 4 * D, rngs=rngs)
        self.down = nnx.Linear(4 * D, D, rngs=rngs)
        self.dropout = nnx.Dropout(DROP, rngs=rngs)

    def __call__(self, x, *, deterministic: bool = False):
        mask = nnx.make_causal_mask(jnp.ones(x.shape[:2]))
        h = self.attn(self.ln1(x), mask=mask, deterministic=True)
        x = x + self.dropout(h, deterministic=deterministic)
        h = self.down(nnx.gelu(self.up(self.ln2(x))))
        return x + self.dropout(h, deterministic=deterministic)


class Head(nnx.Module):
    """Logits from the embedding matrix itself: ``embed.attend`` (weights tied)."""

    def __init__(self, embed: nnx.Embed, rngs: nnx.Rngs):
        self.ln = nnx.LayerNorm(D, rngs=rngs)
        self.embed = embed

    def __call__(self, x):
        return self.embed.attend(self.ln(x))


class Transformer(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, depth: int = 2):
        self.embedding = Embedding(rngs)
        self.blocks = nnx.List([Block(rngs) for _ in range(depth)])
        self.head = Head(self.embedding.tok, rngs)

    def parts(self):
        """The model as pdjax layers (one per stage-able part), in order."""
        return [self.embedding, *self.blocks, self.head]

    def __call__(self, ids, *, deterministic: bool = False):
        x = self.embedding(ids, deterministic=deterministic)
        for block in self.blocks:
            x = block(x, deterministic=deterministic)
        return self.head(x)


def lm_loss(logits, targets):
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
    return loss, {"accuracy": (logits.argmax(-1) == targets).mean()}


def transformer_layers(model):
    names = ["embed", "block0", "block1", "head"]
    return pdjax.sequential(
        *model.parts(), names=names, tied={"wte": ["embed/tok/embedding", "head/embed/embedding"]}
    )


def token_batches(steps, size, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        ids = rng.integers(0, V, (size, T + 1)).astype(np.int32)
        out.append((ids[:, :-1], ids[:, 1:]))
    return out


def _streams(module):
    return sorted(
        {v.tag for _, v in nnx.iter_graph(module) if isinstance(v, nnx.RngStream)} - {None}
    )


def nnx_reference(model, optimizer, batches, M, rng):
    """Gradient accumulation over ``M`` microbatches per step with the user's model itself:
    ``nnx.grad`` of the loss, the tied embedding one parameter. Part ``i`` of the model is
    reseeded for microbatch ``k`` as pdjax seeds layer ``i``. Each microbatch's gradient and
    each step's update (mean, optimizer, apply) are one jitted program."""
    params = nnx.state(model, nnx.Param)
    opt_state = optimizer.init(params)
    update = mean_update(optimizer)

    @nnx.jit
    def grad(model, x, y, rng, k):
        key = jax.random.fold_in(rng, k)

        def loss(model):
            for i, part in enumerate(model.parts()):
                ki = jax.random.fold_in(key, i)
                nnx.reseed(
                    part,
                    policy="match_shape",
                    **{s: jax.random.fold_in(ki, j) for j, s in enumerate(_streams(part))},
                )
            return lm_loss(model(x), y)[0]

        return nnx.grad(loss)(model)

    k = 0
    for x, y in batches:
        grads = []
        size = x.shape[0] // M
        for m in range(M):
            rows = slice(m * size, (m + 1) * size)
            g = grad(model, x[rows], y[rows], rng, k)
            grads.append(nnx.state(g, nnx.Param) if not isinstance(g, nnx.State) else g)
            k += 1
        params, opt_state = update(grads, opt_state, params)
        nnx.update(model, params)
    return model


@nnx.jit
def _eval_forward(model, x, y):
    """The user's model in eval mode on ``x``: its logits and ``lm_loss`` against ``y``."""
    logits = model(x, deterministic=True)
    return logits, lm_loss(logits, y)


def _bits(a):
    if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
        a = jax.random.key_data(a)
    return np.asarray(a).tobytes()


def _params(model):
    return jax.device_get(jax.tree.leaves(nnx.state(model, nnx.Param)))


def test_nnx_transformer_1f1b_equals_the_users_own_training_loop():
    model = Transformer(nnx.Rngs(0))
    reference_model = nnx.clone(model)
    layers = transformer_layers(model)
    stages = [StagePlan(0, 0, (0,)), StagePlan(1, 2, (1, 2)), StagePlan(3, 3, (3,))]
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(3e-3))
    M = 2
    pipe = Pipeline(layers, stages, lm_loss, opt, schedule=ScheduleSpec("1f1b", microbatches=M))
    batches = token_batches(3, 8)
    state = pipe.init(jax.random.key(0), batches[0][0][:4])
    rng = state.rng
    accuracy = []
    for batch in batches:
        state, metrics = pipe.step(state, batch)
        assert len(metrics.aux) == M
        accuracy.append(metrics.mean_aux()["accuracy"])
    assert all(0.0 <= a <= 1.0 for a in accuracy)

    nnx_reference(reference_model, opt, batches, M, rng)
    assert pipe.update_nnx(state, model) is model  # the trained values, in the user's model
    for got, want in zip(_params(model), _params(reference_model), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # one parameter: the head's embedding is the embedding's own array
    assert model.head.embed is model.embedding.tok

    # the user's module, in eval mode, evaluates as pdjax does through the stages
    x, y = token_batches(1, 16, seed=1)[0]
    got = pipe.evaluate(state, [(x[:8], y[:8]), (x[8:], y[8:])])
    want_logits, (want_loss, want_aux) = _eval_forward(model, jnp.asarray(x), jnp.asarray(y))
    assert got["samples"] == 16
    np.testing.assert_allclose(got["loss"], float(want_loss), rtol=1e-5)
    np.testing.assert_allclose(got["accuracy"], float(want_aux["accuracy"]), rtol=1e-6)
    logits = pipe.predict(state, x, batch_size=8)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(want_logits), atol=1e-5)


def test_nnx_dropout_is_on_in_training_and_off_in_evaluation():
    model = Transformer(nnx.Rngs(0))
    layers = transformer_layers(model)
    pipe = Pipeline(
        layers,
        pdjax.even_stages(4, 2),
        lm_loss,
        optax.sgd(0.0),
        schedule=ScheduleSpec("1f1b", microbatches=1),
    )
    x, y = token_batches(1, 4)[0]
    state = pipe.init(jax.random.key(0), x)
    a = pipe.evaluate(state, [(x, y)])["loss"]
    b = pipe.evaluate(state, [(x, y)])["loss"]
    assert a == b  # eval: deterministic
    state, m1 = pipe.step(state, (x, y))  # lr 0: the weights stay, the masks change
    state, m2 = pipe.step(state, (x, y))
    assert m1.loss != m2.loss != a


def test_nnx_transformer_with_tied_embedding_refuses_pipedream():
    """PipeDream's stages update at their own times, so the embedding's copies on the first
    and last stage cannot stay one parameter: pdjax raises instead of untying them."""
    model = Transformer(nnx.Rngs(0))
    with pytest.raises(PipelineError, match="tied"):
        Pipeline(
            transformer_layers(model),
            pdjax.even_stages(4, 2),
            lm_loss,
            optax.sgd(0.1),
            schedule=ScheduleSpec("pipedream"),
        )


def test_nnx_transformer_untied_under_pipedream_equals_the_delayed_update_recurrence():
    class OwnHead(nnx.Module):
        def __init__(self, rngs):
            self.ln = nnx.LayerNorm(D, rngs=rngs)
            self.out = nnx.Linear(D, V, rngs=rngs)

        def __call__(self, x):
            return self.out(self.ln(x))

    rngs = nnx.Rngs(0)
    layers = pdjax.sequential(Embedding(rngs), Block(rngs), Block(rngs), OwnHead(rngs))
    P = 2
    pipe = Pipeline(
        layers,
        pdjax.even_stages(4, P),
        lambda y, t: lm_loss(y, t)[0],
        optax.sgd(0.05),
        schedule=ScheduleSpec("pipedream"),
    )
    stream = [(x, y) for x, y in token_batches(6, 4)]
    state = pipe.init(jax.random.key(0), stream[0][0])
    variables = jax.device_get(pipe.variables(state))
    rng = state.rng
    state, _ = pipe.run(state, stream)
    ref = delayed_training(
        layers,
        lambda y, t: lm_loss(y, t)[0],
        optax.sgd(0.05),
        variables,
        stream,
        bounds=[(0, 2), (2, 4)],
        version_of=lambda s, k: max(0, k - (P - s) + 1),
        rng=rng,
    )
    got = jax.device_get(list(state.params))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_checkpoint_from_four_stages_resumes_under_two(tmp_path):
    """Saved under a 4-stage plan, restored under a 2-stage plan (other cuts and devices):
    the same weights, model state and optimizer state, bit for bit, and training goes on
    as a 2-stage run of the same model that was never interrupted."""
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(3e-3))
    batches = token_batches(4, 8)
    four = [StagePlan(i, i, (i,)) for i in range(4)]
    two = [StagePlan(0, 1, (4, 5)), StagePlan(2, 3, (6,))]

    def pipeline(stages):
        model = Transformer(nnx.Rngs(0))
        return Pipeline(
            transformer_layers(model),
            stages,
            lm_loss,
            opt,
            schedule=ScheduleSpec("1f1b", microbatches=2),
        )

    p4, p2 = pipeline(four), pipeline(two)
    s4 = p4.init(jax.random.key(0), batches[0][0][:4])
    sw = p2.init(jax.random.key(0), batches[0][0][:4])  # the uninterrupted 2-stage run
    for batch in batches[:2]:
        s4, _ = p4.step(s4, batch)
        sw, _ = p2.step(sw, batch)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(2, s4, extra={"epoch": 1})
        s2, extra = ckpt.restore(p2.init(jax.random.key(5), batches[0][0][:4]), pipeline=p2)
    assert extra == {"epoch": 1}
    assert s2.updates == (2, 2) and s2.microbatches == s4.microbatches
    saved = jax.device_get(p4.variables(s4))
    for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(p2.variables(s2)), strict=True):
        assert _bits(a) == _bits(b)
    # adam's moments moved with their layers (stage 0 of the 2-stage plan: layers 0 and 1)
    mu4 = [s[1][0].mu[0] for s in s4.opt_state[:2]]
    mu2 = s2.opt_state[0][1][0].mu[0]
    for a, b in zip(jax.tree.leaves(mu4), jax.tree.leaves(mu2), strict=True):
        assert _bits(a) == _bits(b)
    for batch in batches[2:]:
        s2, m2 = p2.step(s2, batch)
        sw, mw = p2.step(sw, batch)
        np.testing.assert_allclose(m2.loss, mw.loss, rtol=1e-5)
    got, want = jax.device_get(p2.variables(s2)), jax.device_get(p2.variables(sw))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            assert _bits(a) == _bits(b)
        else:
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


# -- a linen CNN with BatchNorm and Dropout ---------------------------------------------------


class ConvBlock(nn.Module):
    features: int

    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Conv(self.features, (3, 3), use_bias=False)(x)  # BatchNorm has the bias
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        return nn.max_pool(nn.relu(x), (2, 2), (2, 2))


class Classifier(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = x.reshape((x.shape[0], -1))
        x = nn.relu(nn.Dense(32)(x))
        x = nn.Dropout(0.2, deterministic=not train)(x)
        return nn.Dense(10)(x)


class CNN(nn.Module):
    """The user's own model: what linen_variables fills."""

    def setup(self):
        self.block1 = ConvBlock(8)
        self.block2 = ConvBlock(16)
        self.classify = Classifier()

    def __call__(self, x, train: bool = False):
        return self.classify(self.block2(self.block1(x, train), train), train)


def cnn_loss(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def cnn_layers():
    return pdjax.sequential(
        ConvBlock(8), ConvBlock(16), Classifier(), names=["block1", "block2", "classify"]
    )


def image_batches(steps, size, seed=0):
    rng = np.random.default_rng(seed)
    return [
        (
            rng.normal(size=(size, 8, 8, 1)).astype(np.float32),
            rng.integers(0, 10, size).astype(np.int32),
        )
        for _ in range(steps)
    ]


def test_linen_cnn_1f1b_equals_sequential_training_and_comes_back_as_the_users_tree():
    layers = cnn_layers()
    M = 2
    pipe = Pipeline(
        layers,
        [StagePlan(0, 1, (0, 1)), StagePlan(2, 2, (2,))],
        cnn_loss,
        optax.adam(1e-2),
        schedule=ScheduleSpec("1f1b", microbatches=M),
    )
    batches = image_batches(3, 8)
    state = pipe.init(jax.random.key(0), batches[0][0][:4])
    variables = jax.device_get(pipe.variables(state))
    rng = state.rng
    for batch in batches:
        state, _ = pipe.step(state, batch)
    mbs = [mb for batch in batches for mb in pipe.split_batch(batch)]
    ref_params, ref_state, _ = flush_training(
        layers, cnn_loss, optax.adam(1e-2), variables, mbs, M=M, rng=rng
    )
    got = jax.device_get(pipe.variables(state))
    for a, b in zip(
        jax.tree.leaves([v["params"] for v in got]), jax.tree.leaves(ref_params), strict=True
    ):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    got_stats = [{k: a for k, a in v.items() if k != "params"} for v in got]
    for a, b in zip(jax.tree.leaves(got_stats), jax.tree.leaves(ref_state), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

    tree = pipe.linen_variables(state)  # names: the layers' names, as the user's CNN's
    assert sorted(tree) == ["batch_stats", "params"]
    assert sorted(tree["params"]) == ["block1", "block2", "classify"]
    x, y = image_batches(1, 16, seed=1)[0]
    want = float(jax.jit(lambda v, x, y: cnn_loss(CNN().apply(v, x), y))(tree, x, y))
    np.testing.assert_allclose(pipe.evaluate(state, [(x, y)])["loss"], want, rtol=1e-5)


def test_linen_cnn_under_pipedream_equals_the_delayed_update_recurrence():
    layers = cnn_layers()
    P = 3
    pipe = Pipeline(
        layers,
        pdjax.even_stages(3, P),
        cnn_loss,
        optax.sgd(0.05),
        schedule=ScheduleSpec("pipedream"),
    )
    stream = image_batches(6, 4)
    state = pipe.init(jax.random.key(0), stream[0][0])
    variables = jax.device_get(pipe.variables(state))
    rng = state.rng
    state, _ = pipe.run(state, stream)
    ref = delayed_training(
        layers,
        cnn_loss,
        optax.sgd(0.05),
        variables,
        stream,
        bounds=[(0, 1), (1, 2), (2, 3)],
        version_of=lambda s, k: max(0, k - (P - s) + 1),
        rng=rng,
    )
    got = jax.device_get(list(state.params))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
