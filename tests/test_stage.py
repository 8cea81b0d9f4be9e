"""Stage executables: forward/backward equal jax.vjp of the whole model; no weight copies."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pdjax.layers import sequential
from pdjax.pipeline.stage import Stage


def _xent(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


@pytest.mark.parametrize("remat", [False, True])
@pytest.mark.parametrize("replicas", [1, 2])
def test_two_stages_match_whole_model_vjp(remat, replicas):
    seq = sequential(nn.Dense(16), nn.Dense(16), nn.Dense(5))
    x = jax.random.normal(jax.random.key(0), (8, 4))
    labels = jnp.arange(8) % 5
    variables = seq.init(jax.random.key(1), x)
    params = [v["params"] for v in variables]
    devs = jax.devices()
    opt = optax.sgd(0.1)
    s0 = Stage(0, seq.layers[:2], 0, devs[:replicas], opt, remat=remat)
    s1 = Stage(1, seq.layers[2:], 2, devs[replicas : 2 * replicas], opt, _xent, remat=remat)
    rng = (jax.random.key(2), np.int32(0))
    p0, p1 = s0.place_weights(params[:2]), s1.place_weights(params[2:])
    xb = s0.place_batch(x)
    h, _, res0 = s0.forward(p0, [{}, {}], xb, rng, None)
    hb = s1.place_batch(h)
    loss, _, res1 = s1.forward(p1, [{}], hb, rng, s1.place_batch(labels))
    lb = s1.place_batch(labels)
    if remat:
        g1, gh = s1.backward_recompute(p1, hb, jnp.ones(()), ([{}], rng, lb), None, "both")
        gh = s0.place_batch(gh)
        g0, gx = s0.backward_recompute(p0, xb, gh, ([{}, {}], rng, None), None, "both")
    else:
        g1, gh = s1.backward(p1, hb, res1, jnp.ones(()), None, "both")
        g0, gx = s0.backward(p0, xb, res0, s0.place_batch(gh), None, "both")
    assert gx is None  # the first stage never computes an input gradient

    def whole(params):
        y, _ = seq.apply([{"params": p} for p in params], x)  # no dropout: rng unused
        return _xent(y, labels)

    ref_loss, ref_grads = jax.value_and_grad(whole)(params)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
        g0 + g1,
        ref_grads,
    )
    assert g0[0]["kernel"].sharding.device_set == set(devs[:replicas])
    # residuals hold no copy of the weights or of the stage input
    if not remat:
        kept = {a.shape for a in res0}
        assert (4, 16) not in kept and (16, 16) not in kept and (8, 4) not in kept
    else:
        assert res0 == [] and res1 == []


def test_split_backward_and_trace_counts():
    seq = sequential(nn.Dense(8), nn.Dense(3))
    x = jnp.ones((4, 6))
    params = [v["params"] for v in seq.init(jax.random.key(0), x)]
    st = Stage(1, seq.layers, 1, jax.devices()[:1], optax.sgd(0.1))
    rng = (jax.random.key(0), np.int32(0))
    for _ in range(3):
        y, _, res = st.forward(params, [{}, {}], x, rng, None)
        ct = jnp.ones_like(y)
        gp, gx = st.backward(params, x, res, ct, None, "both")
        gi_p, gi_x = st.backward(params, x, res, ct, None, "input")
        gw_p, gw_x = st.backward(params, x, res, ct, None, "weights")
        acc = jax.tree.map(jnp.copy, gp)
        twice, _ = st.backward(params, x, res, ct, acc, "both")  # donates acc
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, 2 * b, rtol=1e-6), twice, gp)
        params, _ = st.update(gp, params, optax.sgd(0.1).init(params), jnp.float32(1.0))
    assert gi_p is None and gw_x is None
    np.testing.assert_allclose(gi_x, gx, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), gw_p, gp)
    # compiled once per shape: forward and update once, backward once per variant
    assert st.trace_counts == {"forward": 1, "backward": 4, "update": 1}
