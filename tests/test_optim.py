"""The optimizer across pipeline stages (pdjax.pipeline.optim): which optimizers act on each
stage alone, the exact one-scalar exchange for global-norm clipping, and the refusals."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pdjax.errors import PipelineError
from pdjax.pipeline.optim import (
    StageOptimizer,
    coupled_through_grad_norm,
    others_sum_squares,
    stage_coupling,
    sum_squares,
)

S = jax.ShapeDtypeStruct
F32 = jnp.float32

#: A 3-stage split of a small MLP: per stage, a list of per-layer param trees.
STAGES = [
    [{"kernel": S((3, 4), F32), "bias": S((4,), F32)}],
    [{"kernel": S((4, 4), F32), "bias": S((4,), F32)}, {"scale": S((4,), F32)}],
    [{"kernel": S((4, 2), F32), "bias": S((2,), F32)}],
]


def _stateless(fn):
    """A transformation ``updates -> fn(updates)`` with no state."""
    return optax.GradientTransformation(
        lambda params: optax.EmptyState(), lambda u, state, params=None: (fn(u), state)
    )


def _random(seed, tree, scale=1.0):
    """Normal leaves of ``tree``'s shapes (numpy: no random-number kernels to compile)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda a: jnp.asarray(scale * rng.standard_normal(a.shape), a.dtype), tree)


def _contrib(name, *args):
    fn = getattr(optax.contrib, name, None)
    if fn is None:
        pytest.skip(f"optax.contrib.{name} is not in this optax")
    return fn(*args)


# name -> (factory, coupled, coupled only through other stages' gradients)
CASES = {
    "sgd": (lambda: optax.sgd(0.1, momentum=0.9), False, False),
    "adam": (lambda: optax.adam(1e-3), False, False),
    "adamw": (lambda: optax.adamw(1e-3, weight_decay=1e-2), False, False),
    "clip+adam": (lambda: optax.chain(optax.clip(1.0), optax.adam(1e-3)), False, False),
    "lamb": (lambda: optax.lamb(1e-3), False, False),  # per-leaf trust ratio
    "lars": (lambda: optax.lars(1e-3), False, False),
    "inject_hyperparams(adam)": (lambda: optax.inject_hyperparams(optax.adam)(1e-3), False, False),
    "inject_hyperparams(adam, schedule)": (
        lambda: optax.inject_hyperparams(optax.adam)(optax.linear_schedule(1e-3, 0.0, 100)),
        False,
        False,
    ),
    # the condition depends on the shared step counter only: per output of the cond
    "MultiSteps(adam)": (
        lambda: optax.MultiSteps(optax.adam(1e-3), 2).gradient_transformation(),
        False,
        False,
    ),
    "clip_by_global_norm+sgd": (
        lambda: optax.chain(optax.clip_by_global_norm(0.05), optax.sgd(0.1)),
        True,
        True,
    ),
    "clip_by_global_norm+adam": (
        lambda: optax.chain(optax.clip_by_global_norm(0.05), optax.adam(1e-3)),
        True,
        True,
    ),
    # clipping adam's output reads the other stages' adam state: no gradient exchange helps
    "adam+clip_by_global_norm": (
        lambda: optax.chain(optax.adam(1e-3), optax.clip_by_global_norm(0.05)),
        True,
        False,
    ),
    "contrib.cocob": (lambda: _contrib("cocob"), False, False),  # per-leaf betting
    "contrib.schedule_free_sgd": (lambda: _contrib("schedule_free_sgd", 1.0), False, False),
    "contrib.schedule_free_adamw": (lambda: _contrib("schedule_free_adamw", 1e-3), False, False),
    # DoG/DoWG: step size from the whole model's parameter distance and gradient norms
    "contrib.dog": (lambda: _contrib("dog"), True, False),
    "contrib.dowg": (lambda: _contrib("dowg"), True, False),
    "contrib.prodigy": (lambda: _contrib("prodigy"), True, False),
}


@pytest.mark.parametrize("name", list(CASES))
def test_classification(name):
    factory, coupled, gradients_only = CASES[name]
    c = stage_coupling(factory(), STAGES)
    assert c.analysed
    assert c.coupled == coupled, c.describe()
    assert c.gradients_only == gradients_only, c.describe()
    assert c.exact_per_stage == (not coupled)
    if not coupled:
        assert c.sources == (frozenset(),) * 3
        assert not c.stage_dependent_state


def test_sources_name_what_couples():
    c = stage_coupling(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)), STAGES)
    assert c.sources[0] == {("gradients", 1), ("gradients", 2)}
    assert c.sources[2] == {("gradients", 0), ("gradients", 1)}
    assert any(path.endswith(".count") for path in c.shared_state)  # adam's step count
    assert not c.stage_dependent_state  # the count is the same at every stage
    assert "gradients of stages 1, 2" in c.describe()
    dog = stage_coupling(_contrib("dog"), STAGES)
    assert ("params", 1) in dog.sources[0]
    assert any("max_dist" in p for p in dog.stage_dependent_state)
    assert "params" in dog.summary


def test_injected_hyperparameters_are_shared_state():
    c = stage_coupling(optax.inject_hyperparams(optax.adam)(1e-3), STAGES)
    assert any("learning_rate" in p for p in c.shared_state)  # shared, and unchanging
    assert not c.coupled


def test_many_leaves():
    # more inputs than a machine word: the dependency sets must not overflow
    stages = [[{"w": S((2,), F32)} for _ in range(30)] for _ in range(3)]
    assert not stage_coupling(optax.adam(1e-3), stages).coupled

    def ring(u, state, params):
        # each leaf's update reads the previous leaf's parameters (the last of the previous
        # stage, at a stage's first leaf); parameters are the highest-numbered inputs
        gs, treedef = jax.tree.flatten(u)
        ps = jax.tree.leaves(params)
        out = [g + 1e-3 * jnp.mean(ps[i - 1]) for i, g in enumerate(gs)]
        return jax.tree.unflatten(treedef, out), state

    c = stage_coupling(optax.GradientTransformation(lambda p: optax.EmptyState(), ring), stages)
    assert c.sources == ({("params", 2)}, {("params", 0)}, {("params", 1)})


def test_one_stage_is_never_coupled():
    opt = optax.chain(optax.clip_by_global_norm(0.05), optax.sgd(0.1))
    assert not stage_coupling(opt, STAGES[:1]).coupled


def _split_update(opt, grads, params):
    """The optimizer run on each stage alone (fresh state): what a naive pipeline does."""
    return [opt.update(g, opt.init(p), p)[0] for g, p in zip(grads, params, strict=True)]


def test_shape_constant_coupling_is_caught():
    # no data flows between stages, but the divisor counts the whole model's elements
    opt = _stateless(
        lambda u: jax.tree.map(lambda g: g / sum(x.size for x in jax.tree.leaves(u)), u)
    )
    c = stage_coupling(opt, STAGES)
    assert c.sources == (frozenset(),) * 3 and not c.stage_dependent_state
    assert c.coupled and not c.exact_per_stage and not c.gradients_only
    assert "differs" in c.summary
    # and it really is wrong per stage
    params = [_random(s, p) for s, p in enumerate(STAGES)]
    grads = [_random(10 + s, p) for s, p in enumerate(STAGES)]
    whole = opt.update(grads, opt.init(params), params)[0]
    split = _split_update(opt, grads, params)
    assert not np.allclose(split[0][0]["bias"], whole[0][0]["bias"])


def _per_leaf_loops(updates):
    def leaf(g):
        g = jax.lax.cond(jnp.sum(g) > 0, lambda x: 2 * x, lambda x: -x, g)
        g = jax.lax.while_loop(lambda c: jnp.max(jnp.abs(c)) > 1.0, lambda c: c / 2, g)
        g = jax.lax.scan(lambda c, x: (c + x, c * x), jnp.zeros(g.shape[1:]), g)[1]
        return jax.jit(jax.nn.relu)(g)  # a jit and a custom_jvp_call

    return jax.tree.map(leaf, updates)


def _global_loop(updates):
    norm = optax.tree.norm(updates)

    def leaf(g):
        cond = lambda c: c[1] > 1.0  # noqa: E731
        return jax.lax.while_loop(cond, lambda c: (c[0] / 2, c[1] / 2), (g, norm))[0]

    return jax.tree.map(leaf, updates)


def test_sub_jaxprs_are_followed():
    # cond, while, scan, jit and custom_jvp per leaf: no false coupling
    assert not stage_coupling(_stateless(_per_leaf_loops), STAGES).coupled
    # a while loop whose trip count is the global norm's: coupled through gradients
    c = stage_coupling(_stateless(_global_loop), STAGES)
    assert c.coupled and c.gradients_only
    # the optimizer's update under jax.jit is analysed through the jit
    for opt, coupled in [
        (optax.adam(1e-3), False),
        (optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1)), True),
    ]:
        jitted = optax.GradientTransformation(opt.init, jax.jit(opt.update))
        assert stage_coupling(jitted, STAGES).coupled == coupled


def test_untraceable_or_unsplittable_is_coupled():
    # an update that needs an extra argument fails on a stage's own parameters: its own
    # failure, named as such (not a coupling), with the optimizer's error chained
    needs_value = optax.GradientTransformationExtraArgs(
        lambda p: optax.EmptyState(), lambda u, s, p=None, *, value: (u, s)
    )
    with pytest.raises(PipelineError, match=r"stage 0: its update\(grads, state, params\) "
                       r"raised TypeError: .*'value'") as e:  # fmt: skip
        stage_coupling(needs_value, STAGES)
    assert isinstance(e.value.__cause__, TypeError)
    # one that runs on each stage's tree but not on the whole model's cannot be analysed:
    # coupled, to be safe
    stage_only = optax.GradientTransformation(
        lambda p: optax.EmptyState() if isinstance(p, list) else 1 / 0,
        lambda u, s, p=None: (u, s),
    )
    c = stage_coupling(stage_only, STAGES)
    assert c.coupled and not c.analysed and "ZeroDivisionError" in c.describe()
    # per-leaf momentum kept in a flat list: not attributable to stages, so coupled
    flat = optax.GradientTransformation(
        lambda p: [jnp.zeros_like(x) for x in jax.tree.leaves(p)],
        lambda u, s, p=None: (
            u,
            [0.9 * m + g for m, g in zip(s, jax.tree.leaves(u), strict=True)],
        ),
    )
    c = stage_coupling(flat, STAGES)
    assert c.coupled and not c.splittable and not c.gradients_only


@pytest.mark.parametrize("inner", ["sgd", "adam"])
def test_exchange_equals_whole_model_update(inner):
    opt = optax.chain(
        optax.clip_by_global_norm(0.05), optax.sgd(0.1) if inner == "sgd" else optax.adam(1e-2)
    )
    so = StageOptimizer(opt, STAGES)
    assert so.needs_exchange

    @jax.jit
    def step(whole, stages, naive, grads):
        """One step of: the whole model (one optax update over a plain list of the stages'
        trees), the stages with the exchange, and the stages without it."""
        (w_state, w_params), (states, params), (n_states, n_params) = whole, stages, naive
        w_upd, w_state = opt.update(grads, w_state, w_params)
        sums = [so.sum_squares(g) for g in grads]  # each stage's scalar, then the exchange
        upd, n_upd = [], []
        for s in range(3):
            u, states[s] = so.update(grads[s], states[s], params[s], others_sum_squares(sums, s))
            n, n_states[s] = opt.update(grads[s], n_states[s], n_params[s])
            upd.append(u)
            n_upd.append(n)
        apply = optax.apply_updates
        return (
            (w_state, apply(w_params, w_upd)),
            (states, apply(params, upd)),
            (n_states, apply(n_params, n_upd)),
            (w_upd, upd),
        )

    params = [_random(s, p) for s, p in enumerate(STAGES)]
    whole = (opt.init(params), params)
    stages = ([so.init(p) for p in params], params)
    naive = ([opt.init(p) for p in params], params)  # what running the optimizer per stage does
    for k, scale in enumerate([1.0, 1e-3, 0.3, 1e-2, 3.0]):  # clipping on and off
        grads = [_random(100 * k + s, p, scale) for s, p in enumerate(STAGES)]
        whole, stages, naive, (w_upd, upd) = step(whole, stages, naive, grads)
        # rtol 1e-6 per element, and 1e-6 of the leaf's largest update for elements near 0
        # (the norm's summation order differs: adam's momentum amplifies that rounding
        # where successive gradients cancel)
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6 * np.abs(b).max()),
            upd,
            w_upd,
        )
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), stages[1], whole[1])
    # without the exchange the stages go wrong
    assert not np.allclose(naive[1][0][0]["kernel"], whole[1][0][0]["kernel"], rtol=1e-3)
    with pytest.raises(PipelineError, match="others_sq"):
        so.update(grads[0], stages[0][0], stages[1][0])


def test_sum_squares():
    grads = [_random(s, p) for s, p in enumerate(STAGES)]
    sums = jax.jit(lambda gs: [sum_squares(g) for g in gs])(grads)
    np.testing.assert_allclose(sum(sums), optax.tree.norm(grads) ** 2, rtol=1e-6)
    np.testing.assert_allclose(others_sum_squares(sums, 1), sums[0] + sums[2], rtol=1e-7)


def test_uncoupled_optimizer_runs_unchanged():
    opt = optax.adam(1e-3)
    so = StageOptimizer(opt, STAGES)
    assert not so.needs_exchange
    params = _random(0, STAGES[1])
    grads = _random(1, STAGES[1])
    state = so.init(params)
    # the checkpoint layout is the optimizer's own
    assert jax.tree.structure(state) == jax.tree.structure(opt.init(params))
    mine, _ = so.update(grads, state, params)
    ref, _ = opt.update(grads, opt.init(params), params)
    jax.tree.map(np.testing.assert_array_equal, mine, ref)


def test_coupling_beyond_the_gradient_norm_is_refused():
    dog = _contrib("dog")
    with pytest.raises(PipelineError, match=r"params.*optimizer_scope='stage'"):
        StageOptimizer(dog, STAGES)
    assert not coupled_through_grad_norm(dog, STAGES)
    # coupled only through gradients, but through their L1 norm: the data-flow test passes,
    # the numerical check of the exchange must catch it
    l1 = _stateless(
        lambda u: jax.tree.map(
            lambda g: g / (1 + sum(jnp.sum(jnp.abs(x)) for x in jax.tree.leaves(u))), u
        )
    )
    assert stage_coupling(l1, STAGES).gradients_only
    with pytest.raises(PipelineError, match=r"not only through the gradients' global norm") as e:
        StageOptimizer(l1, STAGES)
    assert "differs from the whole model's" in str(e.value)
    # accepting per-stage semantics explicitly: no check, the optimizer as it is
    so = StageOptimizer(dog, STAGES, scope="stage")
    assert so.coupling is None and not so.needs_exchange


def test_coupled_through_grad_norm():
    assert coupled_through_grad_norm(_stateless(_global_loop), STAGES)
    assert not coupled_through_grad_norm(optax.adam(1e-3), STAGES)  # not coupled at all
    adam_then_clip = optax.chain(optax.adam(1e-3), optax.clip_by_global_norm(1e-3))
    assert not coupled_through_grad_norm(adam_then_clip, STAGES)
