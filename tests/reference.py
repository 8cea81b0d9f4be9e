"""Independent references for the runtime tests: plain single-device training loops.

Nothing here uses pdjax's stages, schedules or weight store: each function walks the
microbatches in order on one device, from the formulas of
``docs/semantics.md#weight-versions-and-updates``.

Each microbatch's gradient and each update are one jitted program: run op by op, every
``jnp`` operation of the optimizer's update on a new shape would compile a program of its
own (most of these tests' compile time).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax


def _one_device(*trees):
    return jax.device_put(trees, jax.devices()[0])


def mean_update(optimizer):
    """The update on the mean of some microbatch gradients, as one jitted program:
    ``update(grads, opt_state, params) -> (params, opt_state)`` sums ``grads`` (a list, one
    tree per microbatch) in order, scales the sum by ``1/len(grads)``, and applies the
    optimizer's update with ``optax.apply_updates``."""

    @jax.jit
    def update(grads, opt_state, params):
        acc = grads[0]
        for g in grads[1:]:
            acc = jax.tree.map(jnp.add, acc, g)
        acc = jax.tree.map(lambda a: a * jnp.float32(1.0 / len(grads)), acc)
        updates, opt_state = optimizer.update(acc, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return update


def apply_layers(layers, params, state, x, rng, lo=0, hi=None):
    """Layers ``lo..hi-1`` in train mode; layer ``i`` draws from ``fold_in(rng, i)``."""
    hi = len(layers) if hi is None else hi
    new_state = list(state)
    for i in range(lo, hi):
        layer = layers.layers[i]
        x, new_state[i] = layer.apply(
            {**state[i], "params": params[i]}, x, train=True, rng=jax.random.fold_in(rng, i)
        )
    return x, new_state


def microbatch_grad(layers, loss_fn, params, state, x, y, rng):
    """Loss, parameter gradients and new model state of one microbatch."""

    def f(p):
        out, new_state = apply_layers(layers, p, state, x, rng)
        return loss_fn(out, y), new_state

    (loss, new_state), grads = jax.value_and_grad(f, has_aux=True)(params)
    return loss, grads, new_state


def flush_training(layers, loss_fn, optimizer, variables, microbatches, *, M, rng):
    """Gradient accumulation: each step sums M microbatch gradients, scales by 1/M, updates.

    Returns (per-layer params, per-layer state, losses).
    """
    variables, microbatches = _one_device(variables, microbatches)
    params = [v["params"] for v in variables]
    state = [{k: a for k, a in v.items() if k != "params"} for v in variables]
    (opt_state,) = _one_device(optimizer.init(params))  # committed, as the update returns it
    grad_fn = jax.jit(
        lambda p, s, x, y, r, k: microbatch_grad(
            layers, loss_fn, params=p, state=s, x=x, y=y, rng=jax.random.fold_in(r, k)
        )
    )
    update = mean_update(optimizer)
    losses = []
    for t in range(len(microbatches) // M):
        grads = []
        for k in range(t * M, (t + 1) * M):
            x, y = microbatches[k]
            loss, g, state = grad_fn(params, state, x, y, rng, k)
            losses.append(loss)
            grads.append(g)
        params, opt_state = update(grads, opt_state, params)
    return params, state, losses


def stage_grads(layers, loss_fn, bounds, fwd_params, bwd_params, x, y, rng, state=None):
    """Per-stage gradients of one microbatch when each stage's forward uses ``fwd_params[s]``
    and its backward is the VJP at ``bwd_params[s]`` and the stage input the forward saw.

    ``bounds[s] = (first, last + 1)`` layer range of stage ``s``. With ``bwd == fwd`` this is
    the ordinary gradient (weight stashing); otherwise PipeDream without stashing.
    ``state``: per layer, its non-parameter collections, held constant (train-mode outputs
    that do not read them: BatchNorm's batch statistics, reseeded nnx RNG streams).
    """
    P = len(bounds)
    inputs = []
    h = x
    for s, (lo, hi) in enumerate(bounds):
        inputs.append(h)
        h, _ = _stage_apply(layers, fwd_params[s], h, rng, lo=lo, hi=hi, state=state)
    grads = [None] * P
    ct = None
    for s in reversed(range(P)):
        lo, hi = bounds[s]

        def f(p, h, lo=lo, hi=hi, s=s):
            out, _ = _stage_apply(layers, p, h, rng, lo=lo, hi=hi, state=state)
            return loss_fn(out, y) if s == P - 1 else out

        out, pullback = jax.vjp(f, bwd_params[s], inputs[s])
        g, ct = pullback(jnp.ones_like(out) if s == P - 1 else ct)
        grads[s] = g
    return grads


def _stage_apply(layers, params, x, rng, lo, hi, state=None):
    for j, i in enumerate(range(lo, hi)):
        rest = state[i] if state is not None else {}
        x, _ = layers.layers[i].apply(
            {**rest, "params": params[j]}, x, train=True, rng=jax.random.fold_in(rng, i)
        )
    return x, None


def delayed_training(
    layers,
    loss_fn,
    optimizer,
    variables,
    microbatches,
    *,
    bounds,
    version_of,
    rng,
    backward_version_of=None,
    M=1,
    whole_model=False,
):
    """The delayed-update recurrence of ``docs/semantics.md#weight-versions-and-updates``
    for models whose train-mode outputs do not read their model state (BatchNorm's running
    averages, nnx RNG counters that pdjax reseeds): the state is passed as it was at the
    start.

    ``version_of(s, k)``: the version stage ``s`` uses for microbatch ``k``'s forward;
    ``backward_version_of(s, k)`` (default: the same) for its backward. Every ``M``
    microbatches (``M`` may be a list: one period per stage, PipeDream's round-robin
    replication) each stage applies the mean of their gradients to its newest weights:
    ``W_s(t+1) = W_s(t) - lr * mean_k g_s(k)``. With ``whole_model`` the optimizer makes one
    update of all stages together (one state over the whole model: global-norm clipping
    sees every stage's gradient). Returns the final per-stage params list.
    """
    backward_version_of = backward_version_of or version_of
    variables, microbatches = _one_device(variables, microbatches)
    P = len(bounds)
    params = [v["params"] for v in variables]
    state = [{k: a for k, a in v.items() if k != "params"} for v in variables]
    history = [[params[lo:hi]] for lo, hi in bounds]  # history[s][v]: version v of stage s
    # committed to the device, as the updates return them (else the first update compiles a
    # program of its own)
    opt_states, whole_state = _one_device(
        [optimizer.init(history[s][0]) for s in range(P)],
        optimizer.init([h[0] for h in history]),
    )
    grad_fn = jax.jit(
        lambda fp, bp, x, y, r, k: stage_grads(
            layers,
            loss_fn,
            bounds,
            fwd_params=fp,
            bwd_params=bp,
            x=x,
            y=y,
            rng=jax.random.fold_in(r, k),
            state=state,
        )
    )
    update = mean_update(optimizer)
    pending = [[] for _ in range(P)]  # pending[s]: stage s's gradients since its update
    periods = list(M) if isinstance(M, (list, tuple)) else [M] * P
    assert not whole_model or len(set(periods)) == 1
    M = periods[0]
    for k, (x, y) in enumerate(microbatches):
        fwd = [history[s][version_of(s, k)] for s in range(P)]
        bwd = [history[s][backward_version_of(s, k)] for s in range(P)]
        grads = grad_fn(fwd, bwd, x, y, rng, k)
        for s in range(P):
            pending[s].append(grads[s])
        if k % M == M - 1 and whole_model:
            newest = [h[-1] for h in history]
            whole = [list(g) for g in zip(*pending, strict=True)]  # per microbatch, all stages
            new, whole_state = update(whole, whole_state, newest)
            for s in range(P):
                history[s].append(new[s])
            pending = [[] for _ in range(P)]
        elif not whole_model:
            for s in range(P):
                m = periods[s]
                if k % m != m - 1:
                    continue
                new, opt_states[s] = update(pending[s], opt_states[s], history[s][-1])
                history[s].append(new)
                pending[s] = []
    return [h[-1] for h in history]


def random_stream(n, mb=4, seed=0):
    """``n`` microbatches ``(x, labels)`` of ``mb`` rows: 16 standard-normal features and
    one of 10 integer classes each (numpy, seeded)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [
        (
            rng.standard_normal((mb, 16)).astype(np.float32),
            rng.integers(0, 10, mb).astype(np.int32),
        )
        for _ in range(n)
    ]


def replica_plan(bounds, replicas):
    """Stages over layers ``[lo, hi)`` of ``bounds``, stage ``s`` on the next
    ``replicas[s]`` devices (ids from 0)."""
    from pdjax.partition import StagePlan

    devices, first = [], 0
    for r in replicas:
        devices.append(tuple(range(first, first + r)))
        first += r
    return tuple(StagePlan(lo, hi - 1, d) for (lo, hi), d in zip(bounds, devices, strict=True))


def xent(logits, labels):
    """Mean softmax cross-entropy over integer labels."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


class Dense32(nn.Module):
    """A 32-wide dense layer with tanh."""

    @nn.compact
    def __call__(self, x):
        return nn.tanh(nn.Dense(32)(x))


class DenseDropout(nn.Module):
    """A 32-wide dense layer with ReLU and dropout 0.25 (in training)."""

    @nn.compact
    def __call__(self, x, train: bool = False):
        return nn.Dropout(0.25, deterministic=not train)(nn.relu(nn.Dense(32)(x)))


def pipeline_kwargs(**kwargs):
    """Keywords for :class:`~pdjax.pipeline.Pipeline` from a test's flat ones: the
    schedule's (``schedule`` as the kind's name, ``microbatches``, ``chunks``, the kind's
    options, ``replication``, ``grad_allreduce``, ``remat``) gathered into one
    :class:`~pdjax.schedules.ScheduleSpec`, the runtime's (``devices``, ``transport``,
    ``optimizer_scope``) passed as they are."""
    import dataclasses

    from pdjax.schedules import ScheduleSpec

    fields = {f.name for f in dataclasses.fields(ScheduleSpec)} - {"kind"}
    spec = {k: kwargs.pop(k) for k in list(kwargs) if k in fields}
    schedule = kwargs.pop("schedule", "1f1b")
    if not isinstance(schedule, str):  # a spec or a Schedule already
        assert not spec, spec
        return {**kwargs, "schedule": schedule}
    return {**kwargs, "schedule": ScheduleSpec(schedule, **spec)}
