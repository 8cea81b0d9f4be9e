"""Generation with a key/value cache through a pipeline's stages (``Pipeline.generate``,
``cache=``): the tokens of the uncached path, which tests/test_generate.py checks
against one-device greedy decoding, token for token; the cache used (one-token decode
steps, each program compiled once per call shape); the fallbacks and refusals."""

import functools
import logging

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import pdjax
from pdjax._decoding import CacheStep
from pdjax.errors import PipelineError
from pdjax.models import get_model
from pdjax.models.llama import LlamaAttention, LlamaConfig, cached_attention, causal_attention
from pdjax.pipeline import Pipeline
from pdjax.pipeline.executor.cached_generation import microbatch_rows

CONTEXT = 16  # the tiny llama's context


@functools.cache
def _setup(stages=2, replicas=1):
    """The tiny llama (untrained: random weights give varied argmaxes) over ``stages``
    stages of ``replicas`` devices each, and its state."""
    spec = get_model("llama", "tiny")
    plan = pdjax.even_stages(len(spec.layers), stages, replicas)
    pipe = Pipeline(spec.layers, plan, spec.loss, optax.sgd(0.1))
    state = pipe.init(jax.random.key(0), spec.sample_input(2, jax.random.key(1)))
    return spec, pipe, state


def _prompts(b, t, seed=0):
    return np.random.default_rng(seed).integers(0, 64, (b, t)).astype(np.int32)


def _generation(pipe):
    return pipe.forward.cached_generation()


@pytest.mark.parametrize(
    ("stages", "replicas", "rows", "microbatches"),
    [(2, 1, 5, 2), (2, 1, 5, 3), (4, 1, 5, 1), (2, 2, 4, 2)],
)
def test_cached_equals_uncached(stages, replicas, rows, microbatches):
    """Several prompts, 2 and 4 stages, even and uneven microbatches (5 rows in 3
    blocks: 2, 2, 1), stages of 2 devices (each microbatch's rows split over them): the
    cached tokens are the uncached path's, and the cache is what ran: a prefill of the
    prompt, then decode steps of one token per row, each program traced once per stage
    and shape, not once per token."""
    _, pipe, state = _setup(stages, replicas)
    prompts = _prompts(rows, 6, seed=stages + microbatches)
    gen = _generation(pipe)
    got = pipe.generate(state, prompts, 10, cache=True, microbatches=microbatches)
    want = pipe.generate(state, prompts, 10, cache=False)
    assert got.shape == (rows, 16) and got.dtype == np.int32
    np.testing.assert_array_equal(got, want)
    assert len(set(got[:, 6:].ravel().tolist())) > 3  # varied tokens: a real test
    sizes = {sl.stop - sl.start for sl in microbatch_rows(rows, microbatches)}
    traced = [(kind, s, shape[:2]) for kind, s, shape, _ in gen.traces]
    for s in range(stages):  # every stage ran a prefill of the prompts and one-token steps
        for r in sizes:
            assert ("prefill", s, (r, 6)) in traced
            assert ("decode", s, (r, 1)) in traced
    assert all(shape[1] == 1 for kind, _, shape in traced if kind == "decode")
    # each program traced once per stage and call shape, not once per token
    assert len(gen.traces) == len(set(gen.traces))
    # a second call of the same shapes compiles nothing
    before = len(gen.traces)
    again = pipe.generate(state, prompts, 10, microbatches=microbatches)
    np.testing.assert_array_equal(again, want)
    assert len(gen.traces) == before


def test_cached_fills_the_context_and_matches_one_device_decoding():
    """Up to the model's context exactly (prompt 3 + 14 new tokens feed 16 positions), by
    default (``cache="auto"``), against greedy decoding of the whole model on one
    device."""
    spec, pipe, state = _setup()
    prompts = _prompts(2, 3, seed=4)
    got = pipe.generate(state, prompts, 14, context=CONTEXT, microbatches=2)
    apply = jax.jit(lambda v, x: spec.layers.apply(v, x, train=False)[0])
    variables = jax.device_put(jax.tree.map(np.asarray, pipe.variables(state)), jax.devices()[0])
    seq = prompts
    for _ in range(14):
        logits = np.asarray(apply(variables, jnp.asarray(seq)))
        seq = np.concatenate([seq, logits[:, -1].argmax(-1)[:, None].astype(np.int32)], 1)
    np.testing.assert_array_equal(got, seq)


def test_cached_attention_is_causal_attention():
    """Attention over a cache written one position at a time equals causal attention over
    the whole sequence, and the block's cached path its plain one."""
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(2, 5, 4, 8)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(2, 5, 2, 8)), jnp.float32) for _ in range(2))
    want = causal_attention(q, k, v)
    padded = [jnp.concatenate([a, 100 * jnp.ones((2, 3, 2, 8))], axis=1) for a in (k, v)]
    for i in range(5):  # query i against a cache of 8 positions, 0..i written
        got = cached_attention(q[:, i : i + 1], *padded, jnp.array([i]))
        np.testing.assert_allclose(got, want[:, i : i + 1], rtol=1e-5, atol=1e-6)
    attn = LlamaAttention(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
    x = jnp.asarray(rng.normal(size=(2, 5, 32)), jnp.float32)
    whole = attn(x)
    y, cache = attn.cached(x[:, :3], None, jnp.int32(0), 7)
    assert cache[0].shape == (2, 7, 2, 8)
    parts = [y]
    for i in (3, 4):
        y, cache = attn.cached(x[:, i : i + 1], cache, jnp.int32(i), 7)
        parts.append(y)
    np.testing.assert_allclose(jnp.concatenate(parts, 1), whole, rtol=1e-5, atol=1e-6)


def _linen_lm():
    """A token model without cache support (linen embedding, dense, logits)."""
    layers = pdjax.sequential(nn.Embed(64, 16), nn.Dense(16), jnp.tanh, nn.Dense(64))

    def loss(logits, targets):
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    pipe = Pipeline(layers, pdjax.even_stages(4, 2), loss, optax.sgd(0.1))
    state = pipe.init(jax.random.key(0), np.zeros((2, 4), np.int32))
    return pipe, state


class _Embed(nn.Module):
    @nn.compact
    def __call__(self, x):
        embed = nn.Embed(64, 16)
        return x.advance(embed(x.x)) if isinstance(x, CacheStep) else embed(x)


class _PrefixMean(nn.Module):
    """A causal layer of a user's own: each position's mean over the positions up to it,
    then a dense layer; given a :class:`CacheStep`, its cache is the running sum."""

    @nn.compact
    def __call__(self, x):
        dense = nn.Dense(16)
        if not isinstance(x, CacheStep):
            return dense(jnp.cumsum(x, 1) / jnp.arange(1, x.shape[1] + 1)[None, :, None])
        h = x.x
        total = jnp.zeros((h.shape[0], 1, h.shape[2])) if x.cache is None else x.cache
        sums = total + jnp.cumsum(h, 1)
        count = x.start + jnp.arange(1, h.shape[1] + 1)
        return x.advance(dense(sums / count[None, :, None]), sums[:, -1:])


class _Logits(nn.Module):
    @nn.compact
    def __call__(self, x):
        dense = nn.Dense(64)
        return x.advance(dense(x.x)) if isinstance(x, CacheStep) else dense(x)


def test_linen_layers_of_ones_own_join_the_protocol():
    """Linen layers that answer a :class:`CacheStep` with one (a cache of their own
    shape: a running sum) generate with the cache, the uncached path's tokens."""
    layers = pdjax.sequential(_Embed(), _PrefixMean(), _Logits())

    def loss(logits, targets):
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    pipe = Pipeline(layers, pdjax.even_stages(3, 2), loss, optax.sgd(0.1))
    state = pipe.init(jax.random.key(0), np.zeros((2, 4), np.int32))
    prompts = _prompts(3, 4, seed=5)
    got = pipe.generate(state, prompts, 6, cache=True, microbatches=2)
    np.testing.assert_array_equal(got, pipe.generate(state, prompts, 6, cache=False))
    assert len(set(got[:, 4:].ravel().tolist())) > 2
    assert {kind for kind, *_ in _generation(pipe).traces} == {"prefill", "decode"}


def test_model_without_cache_runs_uncached_and_says_so_once(caplog):
    pipe, state = _linen_lm()
    prompts = _prompts(2, 4)
    with caplog.at_level(logging.WARNING, logger="pdjax"):
        got = pipe.generate(state, prompts, 3)
        again = pipe.generate(state, prompts, 3, microbatches=2)
    notes = [r.getMessage() for r in caplog.records if r.name == "pdjax"]
    assert len(notes) == 1, notes  # once
    assert "without a key/value cache" in notes[0] and "stage 0" in notes[0]
    want = pipe.generate(state, prompts, 3, cache=False)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(again, want)
    assert not _generation(pipe).traces  # no cached program ran
    with pytest.raises(PipelineError, match=r"cache=True: stage 0 .*pass cache='auto'"):
        pipe.generate(state, prompts, 3, cache=True)


def test_sliding_window_runs_uncached(caplog):
    """Past ``context`` the window slides, which a cache cannot reproduce: ``auto`` feeds
    the tokens within the context through the cache (4 new tokens after 13: 16
    positions fed) and the rest as the uncached path does, the same tokens as
    ``cache=False``, saying so once; a prompt past the context runs uncached whole;
    ``cache=True`` refuses both."""
    _, pipe, state = _setup()
    gen = _generation(pipe)
    prompts = _prompts(2, 13, seed=1)
    with caplog.at_level(logging.WARNING, logger="pdjax"):
        got = pipe.generate(state, prompts, 7, context=CONTEXT)
        pipe.generate(state, prompts, 7, context=CONTEXT)
        long = _prompts(2, 18, seed=2)
        got_long = pipe.generate(state, long, 2, context=CONTEXT)
    notes = [r.getMessage() for r in caplog.records if r.name == "pdjax"]
    assert len(notes) == 2, notes  # once per reason
    assert "slides past context=16" in notes[0] and "tokens before them use it" in notes[0]
    assert "prompt's 18 tokens exceed context=16" in notes[1]
    want = pipe.generate(state, prompts, 7, context=CONTEXT, cache=False)
    np.testing.assert_array_equal(got, want)
    assert len(set(want[:, 13:].ravel().tolist())) > 2
    # the first 4 new tokens came through a cache of the 16 positions the context holds
    assert ("decode", 0, (2, 1), 16) in gen.traces
    want_long = pipe.generate(state, long, 2, context=CONTEXT, cache=False)
    np.testing.assert_array_equal(got_long, want_long)
    with pytest.raises(PipelineError, match=r"window slides.*cache='auto'"):
        pipe.generate(state, prompts, 7, context=CONTEXT, cache=True)
    with pytest.raises(PipelineError, match=r"exceed context=16.*cache='auto'"):
        pipe.generate(state, long, 2, context=CONTEXT, cache=True)


def test_cached_refusals():
    _, pipe, state = _setup()
    prompts = _prompts(2, 3)
    with pytest.raises(PipelineError, match="cache must be True, False or 'auto', got 'yes'"):
        pipe.generate(state, prompts, 2, cache="yes")
    with pytest.raises(PipelineError, match="cache must be True, False or 'auto', got 1"):
        pipe.generate(state, prompts, 2, cache=1)
    with pytest.raises(PipelineError, match="microbatches must be at most 2"):
        pipe.generate(state, prompts, 2, microbatches=3)
    with pytest.raises(PipelineError, match="microbatches must be an integer >= 1"):
        pipe.generate(state, prompts, 2, microbatches=0)
    # the uncached path's refusals come first, the same with the cache
    with pytest.raises(PipelineError, match=r"windows of 17 tokens.*pass context="):
        pipe.generate(state, _prompts(1, 12), 6, cache=True)
    np.testing.assert_array_equal(pipe.generate(state, prompts, 0, cache=True), prompts)
