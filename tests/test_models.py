"""Tests for ``pdjax.models``: every family's tiny config, and the paper configs' sizes.

The headline check: each layer sequence, fed the variables of the independently written
monolithic module (``spec.layers.split``), computes what the monolith computes.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pdjax.errors import LayerError
from pdjax.layers import LayerSequence
from pdjax.models import CONFIGS, MODELS, GPTConfig, ModelSpec, get_model

BATCH = 8

# Dropout-rate fields per family. Train mode is compared with these set to 0: the sequence
# gives layer i the key fold_in(rng, i), while linen derives a submodule's key by hashing
# its name into the parent's key, and linen has no public way to hand a submodule a key of
# the caller's choosing, so the two forms cannot draw the same masks. With rate 0 the
# train-mode code paths still run; that dropout is active is checked separately.
DROPOUT_FIELDS = {
    "vgg16": ("dropout",),
    "alexnet": ("dropout",),
    "gnmt": ("dropout",),
    "gpt": ("dropout",),
    "llama": ("dropout",),
    "awd_lm": ("dropout_e", "dropout_i", "dropout_h", "dropout_o"),
}

LAYER_COUNTS = {  # name: (tiny, paper)
    "mlp": (4, 4),
    "cnn": (5, 5),
    "vgg16": (21, 21),
    "alexnet": (8, 8),
    "resnet50": (6, 18),
    "gnmt": (10, 10),
    "awd_lm": (5, 5),
    "gpt": (4, 14),
    "llama": (4, 26),
}


def _key(seed: int) -> jax.Array:
    # RBG keys: with the default (partitionable) threefry keys XLA:CPU spends up to ~1 s
    # compiling each random draw of a rank >= 3 shape, here every dropout mask. The models
    # do not depend on the PRNG implementation.
    return jax.random.key(seed, impl="rbg")


def _random_variables(abstract: Any, seed: int) -> Any:
    """Random values for a tree of ``ShapeDtypeStruct``, drawn with numpy.

    Compiling the models' real initialisers costs XLA:CPU seconds per model (every kernel
    is a separate random draw); equality and gradient checks need only reasonable values.
    Non-default values (BatchNorm statistics, biases) also make the comparison stricter.
    """
    rng = np.random.default_rng(seed)

    def draw(path: tuple, a: jax.ShapeDtypeStruct) -> jax.Array:
        leaf = str(getattr(path[-1], "key", path[-1]))
        if leaf == "var":  # BatchNorm running variance
            value = rng.uniform(0.5, 1.5, a.shape)
        elif leaf == "scale":  # BatchNorm / LayerNorm / attention scale
            value = 1.0 + 0.1 * rng.standard_normal(a.shape)
        elif len(a.shape) >= 2:  # kernels and embeddings: unit-variance outputs
            value = rng.standard_normal(a.shape) / np.sqrt(np.prod(a.shape[:-1]))
        else:  # biases, running means, attention vectors
            value = 0.1 * rng.standard_normal(a.shape)
        return jnp.asarray(value, a.dtype)

    return jax.tree_util.tree_map_with_path(draw, abstract)


def _with_params(variables: list[dict], params: list[dict]) -> list[dict]:
    return [
        {**v, "params": p} if "params" in v else v for v, p in zip(variables, params, strict=True)
    ]


@functools.cache
def _abstract(name: str) -> dict[str, Any]:
    """The tiny spec, a batch, and both forms' variables as shape trees (no compilation)."""
    spec = get_model(name)
    x, y = spec.sample_batch(BATCH, 0)
    mono = jax.eval_shape(spec.monolith.init, _key(0), x)
    seq = jax.eval_shape(spec.layers.init, _key(0), x)
    return {"spec": spec, "x": x, "y": y, "mono": mono, "seq": seq}


@functools.cache
def _run(name: str) -> dict[str, Any]:
    """Everything the numeric tests inspect, computed in one compiled call per model."""
    spec, x, y = (_abstract(name)[k] for k in ("spec", "x", "y"))
    quiet = get_model(name, **dict.fromkeys(DROPOUT_FIELDS.get(name, ()), 0.0))
    mono_vars = _random_variables(_abstract(name)["mono"], seed=0)

    def compute(mono_vars: dict, x: Any, y: jax.Array, rng: jax.Array) -> dict[str, Any]:
        per_layer = spec.layers.split(mono_vars)
        out: dict[str, Any] = {}
        out["seq_eval"], _ = spec.layers.apply(per_layer, x)
        out["mono_eval"] = spec.monolith.apply(mono_vars, x)
        out["seq_train"], out["seq_states"] = quiet.layers.apply(per_layer, x, train=True, rng=rng)
        out["mono_train"], out["mono_state"] = quiet.monolith.apply(
            mono_vars, x, train=True, rngs={"dropout": rng}, mutable=["batch_stats"]
        )

        def loss_fn(params: list[dict]) -> tuple[jax.Array, jax.Array]:
            variables = _with_params(per_layer, params)
            logits, _ = spec.layers.apply(variables, x, train=True, rng=rng)
            return spec.loss(logits, y), logits

        params = [v.get("params", {}) for v in per_layer]
        (out["loss"], out["seq_dropout"]), out["grads"] = jax.value_and_grad(loss_fn, has_aux=True)(
            params
        )
        return out

    results = jax.jit(compute)(mono_vars, x, y, _key(1))
    return {"spec": spec, "x": x, "y": y, "mono_vars": mono_vars, **results}


def _assert_trees_close(a: Any, b: Any, **tol: float) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), **tol)


def _expected_output_shape(spec: ModelSpec, batch: int) -> tuple[int, ...]:
    if spec.task == "classification":
        return (batch, spec.num_classes)
    target = spec.sample_target(batch)
    return (*target.shape, spec.num_classes)


@pytest.mark.parametrize("name", MODELS)
def test_layer_counts(name: str) -> None:
    tiny, paper = LAYER_COUNTS[name]
    assert len(get_model(name, "tiny").layers) == tiny
    assert len(get_model(name, "paper").layers) == paper


@pytest.mark.parametrize("name", MODELS)
def test_layers_hold_exactly_the_monolith_variables(name: str) -> None:
    spec, mono, seq = (_abstract(name)[k] for k in ("spec", "mono", "seq"))
    # Every top-level submodule of the monolith is a layer: nothing is lost by split.
    for collection in mono.values():
        assert set(collection) <= set(spec.layers.names)
    shapes = functools.partial(jax.tree.map, lambda a: (a.shape, a.dtype))
    assert shapes(spec.layers.split(mono)) == shapes(seq)
    assert shapes(spec.layers.merge(seq)) == shapes(mono)


@pytest.mark.parametrize("name", MODELS)
def test_output_shapes(name: str) -> None:
    spec, x, variables = (_abstract(name)[k] for k in ("spec", "x", "seq"))
    boundaries = spec.layers.boundary_specs(variables, x)
    assert len(boundaries) == len(spec.layers) + 1
    assert boundaries[-1].shape == _expected_output_shape(spec, BATCH)
    assert boundaries[-1].dtype == jnp.float32
    run = _run(name)
    assert run["seq_eval"].shape == _expected_output_shape(spec, BATCH)


@pytest.mark.parametrize("name", MODELS)
def test_sample_batch_is_deterministic_and_valid(name: str) -> None:
    spec = get_model(name)
    x, y = spec.sample_batch(4, 3)
    _assert_trees_close((x, y), spec.sample_batch(4, jax.random.key(3)), rtol=0, atol=0)
    _assert_trees_close(x, spec.sample_input(4, 3), rtol=0, atol=0)
    _assert_trees_close(y, spec.sample_target(4, 3), rtol=0, atol=0)
    other = jax.tree.leaves(spec.sample_batch(4, 4))
    assert not all(
        np.array_equal(a, b) for a, b in zip(jax.tree.leaves((x, y)), other, strict=True)
    )
    assert y.dtype == jnp.int32
    assert 0 <= int(y.min()) and int(y.max()) < spec.num_classes
    for tokens in jax.tree.leaves(x) if spec.task != "classification" else []:
        assert tokens.dtype == jnp.int32
        assert 0 <= int(tokens.min()) and int(tokens.max()) < spec.num_classes
    if spec.task == "language_model":
        np.testing.assert_array_equal(x[:, 1:], y[:, :-1])  # next-token targets
    if spec.task == "seq2seq":
        np.testing.assert_array_equal(x[1][:, 1:], y[:, :-1])  # teacher forcing
    with pytest.raises(LayerError, match="batch_size"):
        spec.sample_batch(0)


@pytest.mark.parametrize("name", MODELS)
def test_sequence_equals_monolith_eval(name: str) -> None:
    run = _run(name)
    np.testing.assert_allclose(run["seq_eval"], run["mono_eval"], rtol=1e-5, atol=1e-5)


def test_sequence_equals_monolith_with_real_initialisation() -> None:
    # The other checks use numpy-drawn variables (see _random_variables); this one runs the
    # monolith's own initialisers, on the one model where compiling them is cheap.
    spec = get_model("mlp")
    x, y = spec.sample_batch(BATCH, 0)
    variables = spec.monolith.init(_key(0), x)
    logits, _ = spec.layers.apply(spec.layers.split(variables), x)
    np.testing.assert_allclose(logits, spec.monolith.apply(variables, x), rtol=1e-6)
    assert float(spec.loss(logits, y)) == pytest.approx(np.log(10), rel=0.25)


@pytest.mark.parametrize("name", MODELS)
def test_sequence_equals_monolith_train(name: str) -> None:
    run = _run(name)
    spec = run["spec"]
    np.testing.assert_allclose(run["seq_train"], run["mono_train"], rtol=1e-5, atol=1e-5)
    # BatchNorm statistics: the sequence's per-layer states equal the monolith's update.
    expected = spec.layers.split(run["mono_state"])
    _assert_trees_close(run["seq_states"], expected, rtol=1e-5, atol=1e-6)
    if name == "resnet50":
        before = spec.layers.split({"batch_stats": run["mono_vars"]["batch_stats"]})
        moved = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), run["seq_states"], before)
        assert all(jax.tree.leaves(moved))
        assert not np.allclose(run["seq_train"], run["seq_eval"], atol=1e-3)


@pytest.mark.parametrize("name", MODELS)
def test_dropout_only_in_train_mode(name: str) -> None:
    run = _run(name)
    config = run["spec"].model_config
    has_dropout = any(getattr(config, f) > 0 for f in DROPOUT_FIELDS.get(name, ()))
    if has_dropout:
        assert not np.allclose(run["seq_dropout"], run["seq_eval"], atol=1e-3)
    elif name != "resnet50":  # BatchNorm makes train mode differ, see above
        np.testing.assert_allclose(run["seq_dropout"], run["seq_eval"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["gnmt", "awd_lm", "gpt", "llama"])
def test_dropout_needs_an_rng_in_train_mode(name: str) -> None:
    spec, x, variables = (_abstract(name)[k] for k in ("spec", "x", "seq"))
    with pytest.raises(LayerError, match="rng"):
        jax.eval_shape(lambda v: spec.layers.apply(v, x, train=True), variables)


@pytest.mark.parametrize("name", MODELS)
def test_loss_and_gradients_are_finite_and_reach_every_parameter(name: str) -> None:
    run = _run(name)
    assert np.isfinite(float(run["loss"]))
    # Near-uniform predictions at initialisation: roughly log(num_classes).
    assert (
        0.2 * np.log(run["spec"].num_classes)
        < float(run["loss"])
        < 3 * np.log(run["spec"].num_classes)
    )
    flat = jax.tree_util.tree_flatten_with_path(run["grads"])[0]
    assert flat
    for path, g in flat:
        g = np.asarray(g)
        assert np.all(np.isfinite(g)), jax.tree_util.keystr(path)
        assert np.any(g != 0), f"no gradient reaches {jax.tree_util.keystr(path)}"


def test_loss_and_accuracy() -> None:
    spec = get_model("mlp")
    logits = jnp.array([[2.0, 0.0, 0.0], [0.0, 3.0, 0.0]])
    targets = jnp.array([0, 2], jnp.int32)
    expected = np.mean([np.log(2 + np.e**2) - 2, np.log(2 + np.e**3)])
    np.testing.assert_allclose(spec.loss(logits, targets), expected, rtol=1e-6)
    assert float(spec.accuracy(logits, targets)) == 0.5


def test_registry() -> None:
    assert MODELS == (
        "mlp",
        "cnn",
        "vgg16",
        "alexnet",
        "resnet50",
        "gnmt",
        "awd_lm",
        "gpt",
        "llama",
    )
    assert CONFIGS == ("tiny", "paper")
    spec = get_model("awd-lm")
    assert spec.name == "awd_lm" and spec.config == "tiny"
    assert isinstance(spec.layers, LayerSequence)
    assert spec == get_model("awd_lm") and hash(spec) == hash(get_model("awd_lm"))
    gpt = get_model("gpt", "paper", num_layers=2, dropout=0.0)
    assert gpt.config == "paper"
    assert gpt.model_config == GPTConfig(num_layers=2, dropout=0.0)
    assert len(gpt.layers) == 4
    assert get_model("mlp").num_params() == 64 * 32 + 32 + 2 * (32 * 32 + 32) + 32 * 10 + 10


@pytest.mark.parametrize(
    ("args", "overrides", "match"),
    [
        (("bert",), {}, "unknown model 'bert'; give a bundled model, one of mlp, cnn"),
        (("vgg16", "huge"), {}, r"unknown config 'huge'.*'tiny', 'paper'"),
        (("gpt",), {"n_layers": 2}, r"no field\(s\) \['n_layers'\].*num_layers"),
        (("gpt",), {"num_heads": 3}, "not divisible by num_heads"),
        (("vgg16",), {"image_size": 40}, "divisible by 2 \\*\\* 5"),
        (("awd_lm",), {"dropout_h": 1.0}, r"\[0, 1\)"),
        (("gnmt",), {"num_encoder_layers": 1}, "at least 2 encoder"),
        (("cnn",), {"pool": (True,)}, "one pool flag per convolution layer"),
    ],
)
def test_get_model_errors(args: tuple[str, ...], overrides: dict, match: str) -> None:
    with pytest.raises(LayerError, match=match):
        get_model(*args, **overrides)


def test_gpt_rejects_sequences_longer_than_its_context() -> None:
    spec = get_model("gpt")
    tokens = jnp.zeros((1, spec.model_config.context + 1), jnp.int32)
    with pytest.raises(LayerError, match="exceeds the model's context"):
        jax.eval_shape(spec.layers.init, _key(0), tokens)


def _lstm_params(fan_in: int, hidden: int) -> int:
    return 4 * hidden * (fan_in + hidden + 1)  # flax's LSTM cell: one bias per gate


def _gnmt_params(v: int, h: int) -> int:
    embeddings = 2 * v * h  # separate source and target tables
    encoder = 2 * _lstm_params(h, h) + _lstm_params(2 * h, h) + 2 * _lstm_params(h, h)
    attention = 2 * h * h + 2 * h + 1  # query, key, bias, v, scale
    decoder = _lstm_params(h, h) + attention + 3 * _lstm_params(2 * h, h)
    return embeddings + encoder + decoder + h * v + v


def _awd_params(v: int, e: int, h: int) -> int:
    lstms = _lstm_params(e, h) + _lstm_params(h, h) + _lstm_params(h, e)
    return v * e + lstms + e * v + v


# Published totals: torchvision's vgg16, alexnet and resnet50; GPT-2 small (124,439,808,
# tied) plus pdjax's untied vocab x d_model head. GNMT and AWD-LM from their layer sizes.
PAPER_PARAMS = {
    "vgg16": 138_357_544,
    "alexnet": 61_100_840,
    "resnet50": 25_557_032,
    "gpt": 124_439_808 + 50257 * 768,
    "gnmt": _gnmt_params(32000, 1024),
    "awd_lm": _awd_params(33278, 400, 1150),
    "mlp": 784 * 1024 + 1024 + 2 * (1024 * 1024 + 1024) + 1024 * 10 + 10,
    # untied 32000 x 1024 embedding and head; 24 blocks of q, o 1024^2, k, v 1024 x 256,
    # SwiGLU 3 x 1024 x 2816 and two norms; the final norm
    "llama": 2 * 32000 * 1024 + 24 * (2 * 1024**2 + 2 * 1024 * 256 + 3 * 1024 * 2816 + 2048) + 1024,
}


@pytest.mark.parametrize("name", sorted(PAPER_PARAMS))
def test_paper_parameter_counts(name: str) -> None:
    spec = get_model(name, "paper")
    variables = jax.eval_shape(spec.layers.init, _key(0), spec.sample_input(1))
    count = sum(a.size for v in variables for a in jax.tree.leaves(v.get("params", {})))
    assert count == PAPER_PARAMS[name]


def test_awd_lm_size_matches_the_paper() -> None:
    # AWD-LSTM reports 33M parameters on WikiText-2 with the decoder tied to the embedding.
    assert PAPER_PARAMS["awd_lm"] - 33278 * 400 == pytest.approx(33e6, rel=0.03)
