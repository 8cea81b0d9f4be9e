"""The Llama family's logical axis names (``out_sharding`` metadata on every parameter):
present on every parameter with one name per dimension, the names the sharding rules
expect, and pure metadata: the same seed draws the same weights with or without them, and
no mesh is needed to build the model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax.core import meta

from pdjax.models import LlamaConfig, get_model, llama
from pdjax.models.llama import AXES, LlamaBlock, LlamaEmbedding, LlamaHead, build_layers

TINY = LlamaConfig.tiny()
TIED = LlamaConfig(**{**vars(TINY), "tie_embeddings": True})

#: the names each parameter should carry, by its path inside its layer
WANT = {
    ("embedding",): ("vocab", "embed"),
    ("attn", "q", "kernel"): ("embed", "heads"),
    ("attn", "k", "kernel"): ("embed", "kv_heads"),
    ("attn", "v", "kernel"): ("embed", "kv_heads"),
    ("attn", "o", "kernel"): ("heads", "embed"),
    ("attn_norm", "scale"): ("norm",),
    ("mlp", "gate", "kernel"): ("embed", "mlp"),
    ("mlp", "up", "kernel"): ("embed", "mlp"),
    ("mlp", "down", "kernel"): ("mlp", "embed"),
    ("mlp_norm", "scale"): ("norm",),
    ("norm", "scale"): ("norm",),
    ("lm_head", "kernel"): ("embed", "vocab"),
}


def _tokens(shape=(2, 16)):
    return jnp.asarray(np.random.default_rng(0).integers(0, TINY.vocab_size, shape), jnp.int32)


@pytest.mark.parametrize("config", [TINY, TIED], ids=["untied", "tied"])
def test_every_param_has_logical_axes(config):
    seen = set()
    for layer in build_layers(config):
        flat = list(nnx.to_flat_state(layer._template))
        assert flat, layer.name
        for path, var in flat:
            assert isinstance(var, nnx.Param), (layer.name, path)
            names = var.get_metadata().get("out_sharding")
            where = f"{layer.name}/{'/'.join(map(str, path))}"
            assert isinstance(names, tuple) and len(names) == len(var.shape), (where, names)
            assert all(isinstance(n, str) for n in names), (where, names)
            assert names == WANT[tuple(map(str, path))], where
            assert var.get_metadata()["eager_sharding"] is False, where
            seen.add(tuple(map(str, path)))
    head = ("embedding",) if config.tie_embeddings else ("lm_head", "kernel")
    assert head in seen and ("attn", "q", "kernel") in seen
    assert set(AXES.values()) == set(WANT.values())


def _modules(config):
    return [
        LlamaEmbedding(config, rngs=nnx.Rngs(0)),
        LlamaBlock(config, rngs=nnx.Rngs(1)),
        LlamaHead(config, rngs=nnx.Rngs(2)),
    ]


@pytest.mark.parametrize("config", [TINY, TIED], ids=["untied", "tied"])
def test_names_leave_values_unchanged(config, monkeypatch):
    named = _modules(config)
    monkeypatch.setattr(llama, "_axes", lambda role: {})  # the same modules, unannotated
    plain = _modules(config)
    x = _tokens()
    for a, b in zip(named, plain, strict=True):
        fa, fb = nnx.to_flat_state(nnx.state(a)), nnx.to_flat_state(nnx.state(b))
        assert [p for p, _ in fa] == [p for p, _ in fb]
        for (path, va), (_, vb) in zip(fa, fb, strict=True):
            assert "out_sharding" in va.get_metadata(), path
            assert "out_sharding" not in vb.get_metadata(), path
            np.testing.assert_array_equal(va.get_value(), vb.get_value(), err_msg=str(path))
        np.testing.assert_array_equal(a(x), b(x))
        x = a(x)


def test_no_mesh_needed_even_with_eager_sharding_on():
    # the names never shard a value on creation, whatever the global default
    want = build_layers(TINY).init(jax.random.key(0), _tokens())
    with nnx.use_eager_sharding(True):
        block = LlamaBlock(TINY, rngs=nnx.Rngs(0))
        got = build_layers(TINY).init(jax.random.key(0), _tokens())
    assert block.attn.q.kernel.get_metadata()["out_sharding"] == ("embed", "heads")
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        np.testing.assert_array_equal(a, b)


def test_monolith_variables_stay_bare_arrays():
    spec = get_model("llama")
    mono = spec.monolith.init(jax.random.key(0), _tokens())
    leaves = jax.tree.leaves(mono, is_leaf=lambda x: isinstance(x, meta.AxisMetadata))
    assert leaves and all(isinstance(leaf, jax.Array) for leaf in leaves)
    layered = spec.layers.split(mono)
    logits, _ = spec.layers.apply(layered, _tokens())
    np.testing.assert_allclose(logits, spec.monolith.apply(mono, _tokens()), rtol=1e-6, atol=1e-6)
