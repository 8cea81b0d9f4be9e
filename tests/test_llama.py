"""The Llama family (``pdjax.models.llama``, written with ``flax.nnx``): its parts against
hand-written math, its layers against an independent reference, and pipelines with the
flush schedules against a plain nnx + optax training loop on one device."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from reference import mean_update

from pdjax.errors import LayerError
from pdjax.models import LlamaConfig, get_model
from pdjax.models.llama import (
    LlamaAttention,
    LlamaBlock,
    LlamaEmbedding,
    LlamaHead,
    build_layers,
    causal_attention,
    make_spec,
    rotary,
)
from pdjax.partition import StagePlan
from pdjax.pipeline import Pipeline
from pdjax.profile import profile
from pdjax.schedules import ScheduleSpec

TINY = LlamaConfig.tiny()  # 2 blocks, d=32, 4 heads over 2 kv heads, dropout 0.1


def _tokens(shape, seed=0, vocab=TINY.vocab_size):
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, shape), jnp.int32)


def _close(got, want, rtol=1e-5, atol=1e-6):
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol),
        got,
        want,
    )


# -- configurations ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config",
    [TINY, LlamaConfig.small(), LlamaConfig(**{**vars(TINY), "tie_embeddings": True})],
    ids=["tiny", "small", "tiny-tied"],
)
def test_parameter_count_formula_matches_the_layers(config):
    spec = make_spec(config)
    # the layers hold a tied head's copy of the embedding too: one parameter, two arrays
    copies = config.vocab_size * config.d_model if config.tie_embeddings else 0
    assert spec.num_params() == config.num_params() + copies
    assert len(spec.layers) == config.num_layers + 2


def test_configs():
    paper = LlamaConfig.paper()
    assert paper == LlamaConfig.gpu_350m()
    assert paper.num_params() == 336_118_784
    assert paper.hidden_dim == 2816 and paper.head_dim == 64
    assert LlamaConfig.small().num_params() == 853_120
    assert LlamaConfig(**{**vars(paper), "tie_embeddings": True}).num_params() == (
        336_118_784 - 32000 * 1024
    )
    assert get_model("llama").model_config == TINY
    assert get_model("llama") == get_model("llama") and hash(get_model("llama")) == hash(
        get_model("llama")
    )
    assert get_model("llama", ffn_dim=40).model_config.hidden_dim == 40


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"num_kv_heads": 3}, "not divisible by num_kv_heads"),
        ({"num_heads": 5}, "not divisible by num_heads"),
        ({"num_heads": 32}, "must be even"),
        ({"seq_len": 17}, "exceeds the context"),
        ({"dropout": 1.0}, r"\[0, 1\)"),
        ({"rope_theta": 0.0}, "must be positive"),
        ({"ffn_dim": -1}, "ffn_dim"),
    ],
)
def test_bad_configs_are_refused(overrides, match):
    with pytest.raises(LayerError, match=match):
        get_model("llama", **overrides)


# -- parts ---------------------------------------------------------------------------------


def test_rotary_scores_depend_on_the_position_difference_only():
    rng = np.random.default_rng(0)
    q, k = (jnp.asarray(rng.standard_normal((1, 1, 16)), jnp.float32) for _ in range(2))

    def score(m, n):
        qm = rotary(q, jnp.array([m]), 100.0)
        kn = rotary(k, jnp.array([n]), 100.0)
        return float(jnp.sum(qm * kn))

    for m, n in [(3, 1), (7, 7), (2, 9)]:
        for shift in (1, 5, 40):
            assert score(m + shift, n + shift) == pytest.approx(score(m, n), rel=1e-5, abs=1e-5)
    assert score(5, 1) != pytest.approx(score(5, 2), rel=1e-3)
    # a rotation: norms are kept, position 0 is the identity, all heads turn alike
    x = jnp.asarray(rng.standard_normal((2, 6, 3, 16)), jnp.float32)
    y = rotary(x, jnp.arange(6))
    _close(jnp.linalg.norm(y, axis=-1), jnp.linalg.norm(x, axis=-1))
    _close(y[:, 0], x[:, 0])
    _close(y[:, :, 1], rotary(x[:, :, 1:2], jnp.arange(6))[:, :, 0])


def _attention_reference(q, k, v):
    """Causal attention by explicit loops over heads and positions (numpy, float64)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    _, t, h, d = q.shape
    group = h // k.shape[2]
    out = np.zeros_like(q)
    for head in range(h):
        kh, vh = k[:, :, head // group], v[:, :, head // group]
        for i in range(t):
            s = np.einsum("bd,bkd->bk", q[:, i, head], kh[:, : i + 1]) / np.sqrt(d)
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            out[:, i, head] = np.einsum("bk,bkd->bd", p, vh[:, : i + 1])
    return out


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_causal_attention_equals_an_explicit_reference(kv_heads):
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((2, 5, 4, 8)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((2, 5, kv_heads, 8)), jnp.float32) for _ in range(2))
    _close(causal_attention(q, k, v), _attention_reference(q, k, v), rtol=1e-5, atol=1e-5)


def test_grouped_query_attention_equals_multi_head_with_repeated_key_value_weights():
    gqa = LlamaAttention(TINY, rngs=nnx.Rngs(0))  # 4 heads over 2 kv heads
    mha = LlamaAttention(LlamaConfig(**{**vars(TINY), "num_kv_heads": 4}), rngs=nnx.Rngs(1))
    hd = TINY.head_dim
    for name in ("k", "v"):
        kernel = getattr(gqa, name).kernel.get_value()  # (d, 2 * hd)
        heads = kernel.reshape(TINY.d_model, 2, hd)
        getattr(mha, name).kernel.set_value(jnp.repeat(heads, 2, axis=1).reshape(-1, 4 * hd))
    for name in ("q", "o"):
        getattr(mha, name).kernel.set_value(getattr(gqa, name).kernel.get_value())
    x = jnp.asarray(np.random.default_rng(2).standard_normal((2, 8, TINY.d_model)), jnp.float32)
    _close(mha(x), gqa(x), rtol=1e-5, atol=1e-6)


# -- the layers against hand-written math ---------------------------------------------------


def _rms(x, scale, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def _rope_complex(x, theta):
    """Rotary positions as complex multiplication: features (i, i + D/2) are one complex
    number, turned by ``exp(1j * t * theta ** (-2 i / D))`` at position ``t``."""
    t, d = x.shape[1], x.shape[-1]
    z = x[..., : d // 2] + 1j * x[..., d // 2 :]
    freqs = theta ** (-np.arange(d // 2) * 2.0 / d)
    z = z * np.exp(1j * np.arange(t)[:, None] * freqs)[None, :, None, :]
    return np.concatenate([z.real, z.imag], axis=-1)


def _reference_logits(config, params, tokens):
    """The whole model in numpy (float64) from the layers' params, eval mode."""
    c = config
    p = [jax.tree.map(lambda a: np.asarray(a, np.float64), v) for v in params]
    x = p[0]["embedding"][np.asarray(tokens)]
    b, t, _ = x.shape
    for blk in p[1:-1]:
        a = blk["attn"]
        h = _rms(x, blk["attn_norm"]["scale"], c.rms_norm_eps)
        q = (h @ a["q"]["kernel"]).reshape(b, t, c.num_heads, c.head_dim)
        k = (h @ a["k"]["kernel"]).reshape(b, t, c.num_kv_heads, c.head_dim)
        v = (h @ a["v"]["kernel"]).reshape(b, t, c.num_kv_heads, c.head_dim)
        q, k = _rope_complex(q, c.rope_theta), _rope_complex(k, c.rope_theta)
        y = _attention_reference(q, k, v).reshape(b, t, -1)
        x = x + y @ a["o"]["kernel"]
        m = blk["mlp"]
        h = _rms(x, blk["mlp_norm"]["scale"], c.rms_norm_eps)
        g = h @ m["gate"]["kernel"]
        x = x + (g / (1 + np.exp(-g)) * (h @ m["up"]["kernel"])) @ m["down"]["kernel"]
    head = p[-1]
    h = _rms(x, head["norm"]["scale"], c.rms_norm_eps)
    return h @ (head["embedding"].T if c.tie_embeddings else head["lm_head"]["kernel"])


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_layers_equal_hand_written_math(tied):
    config = LlamaConfig(**{**vars(TINY), "tie_embeddings": tied})
    layers = build_layers(config)
    tokens = _tokens((2, 16))
    variables = layers.init(jax.random.key(0), tokens)
    # the real initialisers' scales are small: make the norms and logits count
    variables = jax.tree.map(lambda a: a * 8.0 if a.ndim == 2 else a + 0.3, variables)
    if tied:
        variables[-1]["params"]["embedding"] = variables[0]["params"]["embedding"]
    logits, _ = jax.jit(layers.apply)(variables, tokens)
    want = _reference_logits(config, [v["params"] for v in variables], tokens)
    assert logits.shape == (2, 16, config.vocab_size)
    _close(logits, want, rtol=1e-5, atol=1e-5)


def test_tied_layers_equal_the_whole_nnx_model():
    # the family's Llama (one nnx module, the head reading the embedding's own Param)
    # through the linen bridge, as spec.monolith; untied, tests/test_models.py checks it
    spec = get_model("llama", tie_embeddings=True)
    tokens = _tokens((2, 16))
    mono = spec.monolith.init(jax.random.key(0), tokens)
    assert "embedding" not in mono["params"]["head"]  # one array
    params = {**mono["params"], "head": {**mono["params"]["head"]}}
    params["head"]["embedding"] = params["embed"]["embedding"]
    logits, _ = spec.layers.apply(spec.layers.split({"params": params}), tokens)
    _close(logits, spec.monolith.apply(mono, tokens), rtol=1e-6, atol=1e-6)


def test_causal_mask_and_dropout():
    spec = get_model("llama")
    tokens = _tokens((2, 16))
    variables = spec.layers.init(jax.random.key(0), tokens)
    apply = jax.jit(spec.layers.apply, static_argnames="train")
    logits, _ = apply(variables, tokens)
    changed, _ = apply(variables, tokens.at[:, 9].set((tokens[:, 9] + 1) % TINY.vocab_size))
    np.testing.assert_array_equal(changed[:, :9], logits[:, :9])  # the past does not see it
    assert not np.allclose(changed[:, 9:], logits[:, 9:], atol=1e-6)
    dropped, _ = apply(variables, tokens, train=True, rng=jax.random.key(1))
    again, _ = apply(variables, tokens, train=True, rng=jax.random.key(1))
    np.testing.assert_array_equal(dropped, again)
    assert not np.allclose(dropped, logits, atol=1e-4)
    with pytest.raises(LayerError, match="exceeds the model's context"):
        jax.eval_shape(spec.layers.init, jax.random.key(0), _tokens((1, 17)))


def test_profile_costs_every_layer():
    spec = get_model("llama")
    prof = profile(spec.layers, jax.ShapeDtypeStruct((4, TINY.seq_len), jnp.int32))
    assert [layer.name for layer in prof.layers] == list(spec.layers.names)
    for layer in prof.layers:
        assert layer.param_bytes > 0 and layer.output_bytes > 0
        assert layer.forward_flops and layer.forward_flops > 0
    blocks = [layer.forward_flops for layer in prof.layers[1:-1]]
    assert blocks[0] == blocks[1] > prof.layers[0].forward_flops


# -- training: pipelines against a plain nnx + optax loop ------------------------------------


class PlainLlama(nnx.Module):
    """The model as one ordinary nnx module from the family's parts; tied, the head holds
    the embedding's own ``nnx.Param`` (one array, one gradient). ``keys[i]`` seeds the
    dropout of part ``i``, as a pipeline seeds layer ``i``."""

    def __init__(self, config, rngs):
        self.embed = LlamaEmbedding(config, rngs=rngs)
        self.blocks = nnx.List([LlamaBlock(config, rngs=rngs) for _ in range(config.num_layers)])
        self.head = LlamaHead(config, rngs=rngs)
        if config.tie_embeddings:
            self.head.embedding = self.embed.embedding

    def __call__(self, tokens, keys):
        x = self.embed(tokens, train=True, rngs=nnx.Rngs(keys[0]))
        for i, block in enumerate(self.blocks):
            x = block(x, train=True, rngs=nnx.Rngs(keys[i + 1]))
        return self.head(x)


def _as_plain(layer_params):
    """Per-layer params (a list in layer order, or a dict by layer name) as the pure dict of
    :class:`PlainLlama`'s params (a tied head's copy left out: the plain model has one)."""
    if isinstance(layer_params, dict):
        layer_params = list(layer_params.values())
    embed, *blocks, head = (jax.tree.map(np.asarray, p) for p in layer_params)
    head = {k: v for k, v in head.items() if k != "embedding"}
    return {"embed": embed, "blocks": dict(enumerate(blocks)), "head": head}


def _loss(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _plain_training(config, optimizer, initial, batches, M, rng):
    """One device, nnx and optax: per step, M microbatch gradients of the plain model,
    their mean, one update. Microbatch ``k`` (counted over the steps) drops out with the
    keys ``fold_in(fold_in(rng, k), i)``. Returns the losses and the final params."""
    model = PlainLlama(config, nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    nnx.replace_by_pure_dict(params, initial)
    params = jax.device_put(params, jax.devices()[0])
    n = config.num_layers + 2

    @jax.jit
    def grad(p, x, y, k):
        keys = [jax.random.fold_in(jax.random.fold_in(rng, k), i) for i in range(n)]
        return jax.value_and_grad(lambda p: _loss(nnx.merge(graphdef, p)(x, keys), y))(p)

    update = mean_update(optimizer)
    opt_state = jax.device_put(optimizer.init(params), jax.devices()[0])
    losses, k = [], 0
    for x, y in batches:
        size = len(x) // M
        grads = []
        for j in range(M):
            loss, g = grad(params, x[j * size : (j + 1) * size], y[j * size : (j + 1) * size], k)
            losses.append(float(loss))
            grads.append(g)
            k += 1
        params, opt_state = update(grads, opt_state, params)
    return losses, nnx.to_pure_dict(params)


STEPS, M, ROWS = 2, 2, 2  # steps, microbatches per step, rows per microbatch


def _batches(config):
    spec = make_spec(config)
    x, y = spec.sample_batch(STEPS * M * ROWS, 5)
    n = M * ROWS
    return [(x[t * n : (t + 1) * n], y[t * n : (t + 1) * n]) for t in range(STEPS)]


def _pipeline(config, stages, schedule, optimizer):
    layers = build_layers(config)
    pipe = Pipeline(
        layers, stages, _loss, optimizer, schedule=ScheduleSpec(schedule, microbatches=M)
    )
    batches = _batches(config)
    state = pipe.init(jax.random.key(7), batches[0][0][:ROWS])
    initial, rng = pipe.variables(state), state.rng
    losses = []
    for batch in batches:
        state, metrics = pipe.step(state, batch)
        losses += [float(v) for v in metrics.losses]
    return initial, rng, losses, pipe.params(state)


@functools.cache
def _plain(config, optimizer_name, initial_key):
    """The plain loop's losses and final params (cached: every plan starts from the same
    variables, checked by ``initial_key``)."""
    initial, rng = _INITIAL[initial_key]
    return _plain_training(config, _OPTIMIZERS[optimizer_name](), initial, _batches(config), M, rng)


_INITIAL: dict = {}
_OPTIMIZERS = {"sgd": lambda: optax.sgd(0.5), "adam": lambda: optax.adam(1e-2)}


def _check_against_plain(config, stages, schedule, optimizer_name):
    initial, rng, losses, params = _pipeline(
        config, stages, schedule, _OPTIMIZERS[optimizer_name]()
    )
    start = _as_plain([v["params"] for v in initial])
    key = (config, optimizer_name)
    if key in _INITIAL:  # the same variables and key, whatever the plan
        _close(start, _INITIAL[key][0], rtol=0, atol=0)
        np.testing.assert_array_equal(
            jax.random.key_data(rng), jax.random.key_data(_INITIAL[key][1])
        )
    else:
        _INITIAL[key] = (start, rng)
    want_losses, want_params = _plain(config, optimizer_name, key)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    _close(_as_plain(params), want_params, rtol=1e-5, atol=1e-6)
    return params


def _even(P):
    bounds = {2: [(0, 1), (2, 3)], 4: [(0, 0), (1, 1), (2, 2), (3, 3)]}[P]
    return [StagePlan(a, b, (s,)) for s, (a, b) in enumerate(bounds)]


@pytest.mark.parametrize(("schedule", "P"), [("gpipe", 2), ("1f1b", 4)])
def test_flush_schedules_equal_a_plain_nnx_training_loop(schedule, P):
    # each schedule once and each depth once (1f1b on 2 stages: the tied test below)
    _check_against_plain(TINY, _even(P), schedule, "sgd")


def test_tied_embedding_across_stages_equals_the_plain_loop():
    config = LlamaConfig(**{**vars(TINY), "tie_embeddings": True})
    params = _check_against_plain(config, _even(2), "1f1b", "adam")
    np.testing.assert_array_equal(params["embed"]["embedding"], params["head"]["embedding"])
