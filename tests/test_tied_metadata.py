"""Tied parameters with partitioning metadata: an embedding created the way Flax's lm1b and
wmt examples create it (``nn.with_logical_partitioning``, a boxed leaf) and shared with the
output head through ``attend`` trains as one array would, named by either spelling of its
path, with the user's sharding annotations kept in what pdjax hands back; nnx variables'
metadata likewise."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from reference import mean_update

from pdjax.errors import LayerError
from pdjax.export import linen_variables, update_nnx
from pdjax.layers import sequential
from pdjax.partition import StagePlan
from pdjax.pipeline import Pipeline
from pdjax.schedules import ScheduleSpec

V, D = 16, 8  # vocabulary, width
M = 2  # microbatches

# as in flax/examples/lm1b/models.py
EMBED_INIT = nn.with_logical_partitioning(nn.initializers.normal(stddev=1.0), ("vocab", "embed"))
KERNEL_INIT = nn.with_logical_partitioning(nn.initializers.xavier_uniform(), ("embed", "mlp"))
BIAS_INIT = nn.with_logical_partitioning(nn.initializers.normal(0.1), ("mlp",))


class Embed(nn.Module):
    """The decoder's input side: ``output_embed(y)``."""

    @nn.compact
    def __call__(self, y):
        return nn.Embed(V, D, embedding_init=EMBED_INIT, name="Embed_0")(y.astype("int32"))


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + jnp.tanh(nn.Dense(D, kernel_init=KERNEL_INIT, bias_init=BIAS_INIT)(x))


class Logits(nn.Module):
    """The output side: ``output_embed.attend(y)``, scaled as lm1b's logits_via_embedding."""

    @nn.compact
    def __call__(self, y):
        embed = nn.Embed(V, D, embedding_init=EMBED_INIT, name="Embed_0")
        return embed.attend(y.astype(jnp.float32)) / jnp.sqrt(y.shape[-1])


NAMES = ["embed", "block_0", "block_1", "logits"]
WTE = ["embed/Embed_0/embedding", "logits/Embed_0/embedding"]
KERNELS = ["block_0/Dense_0/kernel", "block_1/Dense_0/kernel"]


def _layers(wte=WTE, kernels=False):
    tied = {"embedding": wte}
    if kernels:
        tied["kernel"] = KERNELS
    return sequential(Embed(), Block(), Block(), Logits(), names=NAMES, tied=tied)


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
    h = jnp.take(p["E"], x, axis=0)
    h = h + jnp.tanh(h @ p["k0"] + p["b0"][None])
    h = h + jnp.tanh(h @ p.get("k1", p["k0"]) + p["b1"][None])
    return (h @ p["E"].T) / jnp.sqrt(D)


def _value(box):
    assert isinstance(box, nn.LogicallyPartitioned), type(box)
    return box.value


def _as_reference(params, kernels=False):
    """Per-layer params (boxed) in the reference's layout: the first copy of each."""
    p = {
        "E": _value(params["embed"]["Embed_0"]["embedding"]),
        "k0": _value(params["block_0"]["Dense_0"]["kernel"]),
        "b0": _value(params["block_0"]["Dense_0"]["bias"]),
        "b1": _value(params["block_1"]["Dense_0"]["bias"]),
    }
    if not kernels:
        p["k1"] = _value(params["block_1"]["Dense_0"]["kernel"])
    return p


def _reference(params, batches):
    optimizer = optax.adam(1e-2)
    grad = jax.jit(jax.value_and_grad(lambda p, x, y: _loss(_forward(p, x), y)))
    update = mean_update(optimizer)
    params = jax.device_put(params, jax.devices()[0])
    opt_state = jax.device_put(optimizer.init(params), jax.devices()[0])
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


def _assert_metadata(params, kernels=False):
    """Every parameter keeps its box and names; tied copies hold one value, bit for bit."""
    for layer in ("embed", "logits"):
        box = params[layer]["Embed_0"]["embedding"]
        assert isinstance(box, nn.LogicallyPartitioned) and box.names == ("vocab", "embed")
    for layer in ("block_0", "block_1"):
        dense = params[layer]["Dense_0"]
        assert dense["kernel"].names == ("embed", "mlp") and dense["bias"].names == ("mlp",)
    pairs = [(params["embed"]["Embed_0"]["embedding"], params["logits"]["Embed_0"]["embedding"])]
    if kernels:
        pairs.append(
            (params["block_0"]["Dense_0"]["kernel"], params["block_1"]["Dense_0"]["kernel"])
        )
    for a, b in pairs:
        assert np.asarray(a.value).tobytes() == np.asarray(b.value).tobytes()


P2 = [StagePlan(0, 1, (0,)), StagePlan(2, 3, (1,))]
P3 = [StagePlan(0, 0, (0,)), StagePlan(1, 2, (1,)), StagePlan(3, 3, (2,))]
SAME = [StagePlan(0, 2, (0,)), StagePlan(3, 3, (1,))]  # both blocks on stage 0
ONE = [StagePlan(0, 3, (0,))]

CASES = {
    "across-2-stages": (P2, WTE, False),
    "across-3-stages/value": (P3, [f"{w}/value" for w in WTE], False),
    "one-stage": (ONE, WTE, False),
    "kernels-in-one-stage": (SAME, [WTE[0], f"{WTE[1]}/value"], True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_partitioned_tied_embedding_trains_as_one_array(case):
    stages, wte, kernels = CASES[case]
    layers = _layers(wte, kernels)
    pipe = Pipeline(
        layers, stages, _loss, optax.adam(1e-2), schedule=ScheduleSpec("1f1b", microbatches=M)
    )
    batches = _batches(3, 4 * M)
    state = pipe.init(jax.random.key(1), batches[0][0][:4])
    variables = pipe.variables(state)
    start = pipe.layers.merge(variables)["params"]
    _assert_metadata(start, kernels)  # tied from the start, boxes kept
    losses, history = [], []
    for batch in batches:
        state, metrics = pipe.step(state, batch)
        losses += [float(v) for v in metrics.losses]
        history.append(pipe.params(state))
    ref_losses, ref_history = _reference(_as_reference(start, kernels), batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for params, ref in zip(history, ref_history, strict=True):
        _assert_metadata(params, kernels)
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=1e-6),
            _as_reference(params, kernels),
            ref,
        )
    _assert_metadata(pipe.layers.merge(pipe.variables(state))["params"], kernels)
    if len(stages) > 1:
        assert dict(pipe.tied_stages)["embedding"] == (0, len(stages) - 1)


class LM(nn.Module):
    """The user's whole model, lm1b-like: one embedding for the input and the logits."""

    @nn.compact
    def __call__(self, y):
        embed = nn.Embed(V, D, embedding_init=EMBED_INIT, name="embed")
        h = embed(y)
        h = Block(name="block_0")(h)
        h = Block(name="block_1")(h)
        return embed.attend(h) / jnp.sqrt(D)


def test_export_keeps_the_boxes_and_drops_the_heads_copy():
    layers = sequential(Embed(), Block(), Block(), Logits(), names=NAMES, tied={"embedding": WTE})
    pipe = Pipeline(
        layers, P2, _loss, optax.adam(1e-2), schedule=ScheduleSpec("1f1b", microbatches=M)
    )
    (batch,) = _batches(1, 4 * M)
    state = pipe.init(jax.random.key(1), batch[0][:4])
    state, _ = pipe.step(state, batch)
    variables = pipe.variables(state)
    # the user's model holds the embedding once: its head (no name) holds only the copy
    names = {"embed": "embed", "block_0": "block_0", "block_1": "block_1"}
    tree = linen_variables(layers, variables, names)
    assert sorted(tree["params"]) == ["block_0", "block_1", "embed"]
    assert tree["params"]["embed"]["Embed_0"]["embedding"].names == ("vocab", "embed")
    tree["params"]["embed"] = tree["params"]["embed"]["Embed_0"]  # LM's own nesting
    assert nn.get_partition_spec(tree)["params"]["block_0"]["Dense_0"]["kernel"] == (
        jax.sharding.PartitionSpec("embed", "mlp")
    )
    y = LM().apply(tree, batch[0][:4])
    want, _ = layers.apply(jax.device_put(variables, jax.devices()[0]), batch[0][:4])
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-5, atol=1e-6)
    # a layer with parameters of its own still needs a name
    with pytest.raises(LayerError, match="'block_1' has variables but no name"):
        linen_variables(layers, variables, {"embed": "embed", "block_0": "block_0"})


def test_path_spellings_are_checked_as_one_parameter():
    x = jnp.zeros((4,), jnp.int32)
    # both spellings of one leaf in one group: listed twice
    seq = _layers([WTE[0], f"{WTE[0]}/value", WTE[1]])
    with pytest.raises(LayerError, match=r"name one parameter, listed twice"):
        seq.init(jax.random.key(0), x)
    # a missing parameter names the parameters by their own paths (no '/value')
    seq = _layers(["embed/Embed_0/embeddings", WTE[1]])
    with pytest.raises(LayerError, match=r"its parameters are \['Embed_0/embedding'\]$"):
        seq.init(jax.random.key(0), x)
    # '/value' is a box's field only: not a key below it
    seq = _layers([f"{WTE[0]}/value/x", WTE[1]])
    with pytest.raises(LayerError, match="no parameter at 'Embed_0/embedding/value/x'"):
        seq.init(jax.random.key(0), x)


# -- nnx: the metadata lives on the variables ---------------------------------------------


class NnxModel(nnx.Module):
    def __init__(self, rngs):
        init = nnx.with_partitioning(nnx.initializers.normal(1.0), ("vocab", "embed"))
        self.embed = nnx.Embed(V, D, embedding_init=init, rngs=rngs)
        self.linear = nnx.Linear(D, D, rngs=rngs)
        self.head = nnx.Embed(V, D, embedding_init=init, rngs=rngs)


class Attend(nnx.Module):
    def __init__(self, embed):
        self.embed = embed

    def __call__(self, x):
        return self.embed.attend(x)


@pytest.mark.parametrize("suffix", ["", "/value"])
def test_nnx_partitioned_ties_keep_their_metadata(suffix):
    with nnx.use_eager_sharding(False):  # no mesh here: keep the annotations as metadata
        model = NnxModel(nnx.Rngs(0))
    tied = {"wte": ["e/embedding", f"h/embed/embedding{suffix}"]}
    layers = sequential(
        model.embed, model.linear, Attend(model.head), names=["e", "l", "h"], tied=tied
    )
    assert layers.tied_leaves[0][1][1] == (2, ("embed", "embedding"))  # one spelling
    stages = [StagePlan(0, 1, (0,)), StagePlan(2, 2, (1,))]
    pipe = Pipeline(
        layers, stages, _loss, optax.adam(1e-2), schedule=ScheduleSpec("1f1b", microbatches=M)
    )
    (batch,) = _batches(1, 4 * M)
    state = pipe.init(jax.random.key(1), batch[0][:4])
    state, _ = pipe.step(state, batch)
    params = pipe.params(state)
    e, h = np.asarray(params["e"]["embedding"]), np.asarray(params["h"]["embed"]["embedding"])
    assert e.tobytes() == h.tobytes()
    update_nnx(layers, pipe.variables(state))
    for var in (model.embed.embedding, model.head.embedding):
        assert var.get_metadata()["out_sharding"] == ("vocab", "embed")
        assert np.asarray(var.get_value()).tobytes() == e.tobytes()
