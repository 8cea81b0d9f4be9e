"""float16 with dynamic loss scaling (``pdjax.precision.loss_scaled``): a flush schedule
equals a plain single-device jax + optax + jmp loop, overflowing steps included (skipped
on every stage, the scale adjusted as jmp does); where pdjax cannot do it exactly, it
refuses before any work."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
import pytest
from reference import apply_layers

from pdjax.errors import PipelineError
from pdjax.layers import sequential
from pdjax.partition import StagePlan
from pdjax.pipeline import Pipeline, even_stages
from pdjax.precision import LossScaleState, get_policy, loss_scaled
from pdjax.runners import DataParallel
from pdjax.schedules import ScheduleSpec

F16 = np.dtype(jnp.float16)


def _mse(y, t):
    return jnp.mean((y - t) ** 2)


def _model():
    return sequential(nn.Dense(16), nn.tanh, nn.Dense(16), nn.tanh, nn.Dense(4), precision="f16")


def _scale():
    """2**30 overflows float16 at once (step 0 is skipped), ``factor`` 2**16 brings it to
    2**14 (finite), and after ``period`` 2 finite steps it is back at 2**30 (skipped)."""
    return jmp.DynamicLossScale(jnp.float32(2.0**30), period=2, factor=2**16)


def _jmp_loop(layers, inner, loss_scale, variables, microbatches, M, rng):
    """The usual jmp loop on one device: per step, the gradients of ``scale(loss)`` of M
    microbatches summed in order and scaled by 1/M, unscaled, the update applied only when
    they are all finite, the scale adjusted. Returns per step (params, scale, counter)
    and the losses."""
    dev = jax.devices()[0]
    params = jax.device_put([v.get("params", {}) for v in variables], dev)
    state = [{k: a for k, a in v.items() if k != "params"} for v in variables]
    opt_state = jax.device_put(inner.init(params), dev)

    @jax.jit
    def grad(params, x, y, scale, k):
        def f(p):
            out, _ = apply_layers(layers, p, state, x, jax.random.fold_in(rng, k))
            loss = _mse(out, y)
            return jmp.DynamicLossScale(scale).scale(loss), loss

        return jax.grad(f, has_aux=True)(params)

    @jax.jit
    def step(grads, opt_state, params, scale, counter):
        ls = jmp.DynamicLossScale(scale, counter, loss_scale.period, loss_scale.factor)
        acc = grads[0]
        for g in grads[1:]:
            acc = jax.tree.map(jnp.add, acc, g)
        acc = jax.tree.map(lambda a: a * jnp.float32(1.0 / len(grads)), acc)
        acc = ls.unscale(acc)
        finite = jmp.all_finite(acc)
        updates, new_opt = inner.update(acc, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        params, opt_state = jmp.select_tree(finite, (new_params, new_opt), (params, opt_state))
        ls = ls.adjust(finite)
        return params, opt_state, ls.loss_scale, ls.counter, finite

    scale, counter = jnp.float32(loss_scale.loss_scale), jnp.int32(0)
    history, losses, finite = [], [], []
    for t in range(0, len(microbatches), M):
        out = [
            grad(params, x, y, scale, k)
            for k, (x, y) in enumerate(microbatches[t : t + M], start=t)
        ]
        losses += [float(loss) for _, loss in out]
        params, opt_state, scale, counter, ok = step(
            [g for g, _ in out], opt_state, params, scale, counter
        )
        history.append((params, float(scale), int(counter)))
        finite.append(bool(ok))
    return history, losses, finite


def _one_stage(n: int, replication: str | None) -> tuple[StagePlan, ...]:
    """One stage of all ``n`` layers: on one device, or on two (``replication``)."""
    if replication is None:
        return (StagePlan(0, n - 1, (0,)),)
    return (StagePlan(0, n - 1, (0, 1), replication=replication),)


@pytest.mark.parametrize(
    "schedule, stages, inner, one_call",
    [
        ("gpipe", 2, optax.sgd(0.1), False),
        # the global norm is the unscaled gradients' (the phantom leaf is unscaled too);
        # one call over every step: the scale changes within it
        ("1f1b", 3, optax.chain(optax.clip_by_global_norm(0.05), optax.adam(1e-2)), True),
        # one stage: its backward's seed (the scale after its weights) and its fused
        # update (which donates the optimizer state holding the scale) are one program
        ("1f1b", None, optax.chain(optax.clip_by_global_norm(0.05), optax.adam(1e-2)), True),
        ("gpipe", "split", optax.sgd(0.1), False),
        ("1f1b", "round-robin", optax.sgd(0.1), False),
    ],
)
def test_float16_loss_scaling_equals_the_jmp_loop(schedule, stages, inner, one_call):
    layers = _model()
    # split: each device's float16 gradients of its half of a microbatch, summed (rounded
    # apart from the reference's whole microbatch)
    rtol = 2e-3 if stages == "split" else 1e-5
    plan = (
        even_stages(len(layers), stages)
        if isinstance(stages, int)
        else _one_stage(len(layers), stages)
    )
    M, mb, steps = 2, 4, 4
    xs = jax.random.normal(jax.random.key(1), (steps * M * mb, 6))
    ts = jax.random.normal(jax.random.key(2), (steps * M * mb, 4))
    microbatches = [
        (xs[k * mb : (k + 1) * mb], ts[k * mb : (k + 1) * mb]) for k in range(steps * M)
    ]
    opt = loss_scaled(inner, _scale())
    pipe = Pipeline(layers, plan, _mse, opt, schedule=ScheduleSpec(schedule, microbatches=M))
    state = pipe.init(jax.random.key(3), xs[:mb])
    # the finite flag rides on the exchanged sums of squares (one stage: nothing to exchange)
    assert pipe.coupled == (len(plan) > 1)
    start = pipe.variables(state)
    got, losses = [], []
    for t in range(1 if one_call else steps):
        calls = microbatches if one_call else microbatches[t * M : (t + 1) * M]
        state, metrics = pipe.run(state, calls)
        losses += [float(v) for v in metrics.losses]
        scales = {(float(o.loss_scale), int(o.counter)) for o in state.opt_state}
        assert len(scales) == 1  # every stage holds the same scale
        got.append(([v["params"] for v in pipe.variables(state)], *scales.pop()))
    # the layers did compute in float16
    h = jax.eval_shape(lambda v, x: layers.layers[0].apply(v, x)[0], start[0], xs[:mb])
    assert np.dtype(h.dtype) == F16
    ref, ref_losses, finite = _jmp_loop(layers, inner, _scale(), start, microbatches, M, state.rng)
    assert finite == [False, True, True, False]  # the test covers skipped steps
    np.testing.assert_allclose(losses, ref_losses, rtol=rtol)
    first = jax.tree.leaves([v["params"] for v in start])
    ref = ref[-1:] if one_call else ref
    for t, ((params, scale, counter), (ref_params, ref_scale, ref_counter)) in enumerate(
        zip(got, ref, strict=True)
    ):
        assert (scale, counter) == (ref_scale, ref_counter), t
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True):
            np.testing.assert_allclose(a, b, rtol=rtol, atol=1e-7 if rtol < 1e-3 else 1e-5)
        if t == 0 and not one_call:  # skipped on every stage: the initial weights, exactly
            for a, b in zip(jax.tree.leaves(params), first, strict=True):
                np.testing.assert_array_equal(a, b)
    # the steps that were not skipped moved the weights
    assert not np.allclose(jax.tree.leaves(got[-1][0])[0], first[0])


def test_loss_scaled_state_and_policy():
    assert get_policy("f16") == jmp.Policy(jnp.float32, jnp.float16, jnp.float32)
    opt = loss_scaled(optax.sgd(1.0), jmp.DynamicLossScale(jnp.float32(8.0), period=2))
    state = opt.init({"w": jnp.ones(2)})
    assert isinstance(state, LossScaleState) and float(state.loss_scale) == 8.0
    # finite: unscaled by 8 and applied; twice finite: the scale doubles
    updates, state = opt.update({"w": jnp.array([8.0, -16.0])}, state)
    np.testing.assert_array_equal(updates["w"], [-1.0, 2.0])
    _, state = opt.update({"w": jnp.array([8.0, -16.0])}, state)
    assert (float(state.loss_scale), int(state.counter)) == (16.0, 0)
    # not finite: no update, the scale halves
    updates, state = opt.update({"w": jnp.array([jnp.nan, 1.0])}, state)
    np.testing.assert_array_equal(updates["w"], [0.0, 0.0])
    assert (float(state.loss_scale), int(state.counter)) == (8.0, 0)
    with pytest.raises(TypeError, match="already"):
        loss_scaled(opt)


def test_refused_where_not_exact():
    layers = _model()
    plan = even_stages(len(layers), 2)
    scaled = loss_scaled(optax.sgd(0.1))
    with pytest.raises(PipelineError, match=r"float16.*loss_scaled"):
        Pipeline(layers, plan, _mse, optax.sgd(0.1), schedule=ScheduleSpec("1f1b", microbatches=2))
    for schedule in ("pipedream", "2bw"):
        with pytest.raises(PipelineError, match=rf"under {schedule}.*flush schedule"):
            Pipeline(layers, plan, _mse, scaled, schedule=ScheduleSpec(schedule, microbatches=2))
    with pytest.raises(PipelineError, match="optimizer_scope='model'"):
        Pipeline(
            layers,
            plan,
            _mse,
            scaled,
            schedule=ScheduleSpec("1f1b", microbatches=2),
            optimizer_scope="stage",
        )
    with pytest.raises(PipelineError, match="DataParallel does not scale the loss"):
        DataParallel(layers, _mse, scaled, devices=jax.devices()[:1])
    bf16 = sequential(nn.Dense(4), precision="bf16")
    with pytest.raises(PipelineError, match="DataParallel does not scale the loss"):
        DataParallel(bf16, _mse, scaled, devices=jax.devices()[:1])
    # one stage: nothing to exchange, still exact (a plain loss-scaled step)
    Pipeline(
        layers,
        (StagePlan(0, len(layers) - 1, (0,)),),
        _mse,
        scaled,
        schedule=ScheduleSpec("1f1b", microbatches=2),
    )
