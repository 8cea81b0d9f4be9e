"""Mixed precision: the dtypes a model keeps its parameters in, computes in, and outputs.

A policy is DeepMind's ``jmp.Policy`` (``param_dtype``, ``compute_dtype``,
``output_dtype``); :func:`get_policy` reads one from a string. Give it to
:func:`pdjax.sequential` (``precision=``) and every layer computes in the compute dtype:

* the optimizer's parameters stay in the parameter dtype (float32); each layer casts its
  float parameters and float inputs to the compute dtype inside its ``apply``, so the
  gradients come back in the parameter dtype through the cast;
* each layer's output is in the compute dtype, so activations (and their gradients) cross
  pipeline stages in it: half the bytes of float32 in bfloat16;
* the last layer's output is cast to the output dtype (float32) before the loss;
* integer and PRNG-key leaves (token ids, keys) are never cast, and non-parameter
  collections (BatchNorm statistics) stay in their own dtype.

The profiler calls the same ``apply``, so it costs the model in the compute dtype.

bfloat16 has float32's range and needs no loss scaling. float16 does: its gradients
underflow unless the loss is scaled up and the gradients down. :func:`loss_scaled` wraps
the optimizer with ``jmp``'s dynamic loss scale (:class:`LossScaleState` in the optimizer
state); a :class:`~pdjax.pipeline.Pipeline` with a flush schedule then seeds the last
stage's backward with the scale, every stage unscales its gradients, and all stages skip
an update together when any stage's gradients are not finite (the flag rides on the
exchanged gradient norm), adjusting the scale as ``jmp`` does. A float16 model trained
without it, or where pdjax cannot do it exactly (``pipedream``, ``2bw``, data
parallelism), is refused.

>>> p = get_policy("bf16")
>>> str(p)
'p=full,c=bf16,o=full'
>>> get_policy("params=float32,compute=bfloat16,output=float32") == p
True
"""

from __future__ import annotations

from typing import Any, NamedTuple, TypeAlias

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax

from pdjax.errors import LayerError

__all__ = [
    "LossScaleState",
    "LossScaled",
    "Policy",
    "computes_in_float16",
    "get_policy",
    "loss_scale_of",
    "loss_scaled",
]

#: A mixed precision policy: ``jmp.Policy(param_dtype, compute_dtype, output_dtype)``.
Policy: TypeAlias = jmp.Policy  # Any to mypy: jmp ships no type information

_FORMS = (
    "write 'bf16' (parameters and output float32, compute bfloat16) or "
    "'params=float32,compute=bfloat16,output=float32' (keys p, c, o; dtypes float32 or f32, "
    "bfloat16 or bf16, float16 or f16)"
)


def get_policy(spec: Policy | str) -> Policy:
    """A checked mixed precision policy from a ``jmp.Policy`` or a string.

    A bare dtype name is the compute dtype of the usual mixed policy: ``"bf16"`` and
    ``"bfloat16"`` mean parameters float32, compute bfloat16, output float32 (unlike
    ``jmp.get_policy("bf16")``, which puts all three in bfloat16; write
    ``"params=bf16,compute=bf16,output=bf16"`` for that). ``"float32"`` (``"f32"``,
    ``"full"``) changes nothing. Any other string is parsed by ``jmp.get_policy``:
    ``"params=float32,compute=bfloat16,output=float32"`` (keys ``p``, ``c``, ``o`` for
    short; compute defaults to the params dtype, output to the compute dtype).

    float16 is accepted (``"f16"``: compute float16, parameters and output float32); it
    trains only with a :func:`loss_scaled` optimizer.

    Raises:
      LayerError: for a string neither form reads, or a policy with a dtype that is not a
        float.

    >>> get_policy("c=bf16").output_dtype is jnp.bfloat16
    True
    >>> get_policy("bfloat17")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    pdjax.errors.LayerError: precision 'bfloat17' is not a policy (Unknown dtype 'bfloat17' ...
    """
    if isinstance(spec, str):
        text = spec.strip().lower()
        try:
            if "=" in text:
                policy = jmp.get_policy(text.replace(" ", ""))
            else:
                compute = jmp.get_policy(text).compute_dtype  # jmp's dtype names
                policy = Policy(jnp.float32, compute, jnp.float32)
        except (ValueError, KeyError) as e:
            raise LayerError(f"precision {spec!r} is not a policy ({e}); {_FORMS}") from None
    elif isinstance(spec, jmp.Policy):
        policy = spec
    else:
        raise LayerError(
            f"precision must be a jmp.Policy or a string, got {type(spec).__name__}; {_FORMS}"
        )
    for field in ("param_dtype", "compute_dtype", "output_dtype"):
        dtype = np.dtype(getattr(policy, field))
        if not jnp.issubdtype(dtype, jnp.floating):
            raise LayerError(f"precision {spec!r}: {field} is {dtype}, not a float dtype")
    return policy


def computes_in_float16(policy: Policy | None) -> bool:
    """Whether ``policy`` holds float16 anywhere (then training needs loss scaling)."""
    if policy is None:
        return False
    fields = (policy.param_dtype, policy.compute_dtype, policy.output_dtype)
    return any(np.dtype(d) == np.dtype(jnp.float16) for d in fields)


# -- dynamic loss scaling ------------------------------------------------------------------


class LossScaleState(NamedTuple):
    """The state of a :func:`loss_scaled` optimizer: the wrapped optimizer's state and
    ``jmp.DynamicLossScale``'s two arrays (its ``period`` and ``factor`` are the
    optimizer's, fixed).

    Attributes:
      inner: the wrapped optimizer's state.
      loss_scale: the current loss scale (float32 scalar).
      counter: finite steps since the scale last changed (int32 scalar).
    """

    inner: Any
    loss_scale: jax.Array
    counter: jax.Array


class LossScaled(optax.GradientTransformation):  # type: ignore[misc]  # optax: untyped to mypy
    """An optax transformation made by :func:`loss_scaled` (its type marks it: the
    pipeline seeds the loss's cotangent with the scale of its state)."""


def loss_scaled(
    optimizer: optax.GradientTransformation, loss_scale: jmp.DynamicLossScale | None = None
) -> LossScaled:
    """``optimizer`` under ``jmp``'s dynamic loss scaling, for float16 training.

    Its gradients are those of the *scaled* loss (``loss * scale``: the pipeline's last
    stage seeds its backward with the scale). ``update`` unscales them
    (``loss_scale.unscale``), and when they are all finite (``jmp.all_finite``) applies
    ``optimizer``; otherwise it returns zero updates and keeps ``optimizer``'s state (the
    step is skipped). Either way the scale adjusts as ``jmp.DynamicLossScale.adjust`` does
    (halved, by ``factor``, on an overflow; doubled after ``period`` finite steps). That is
    the usual ``jmp`` loop, as an optax transformation::

        grads = loss_scale.unscale(grads)
        finite = jmp.all_finite(grads)
        loss_scale = loss_scale.adjust(finite)
        params, opt_state = jmp.select_tree(finite, (new_params, new_opt_state),
                                           (params, opt_state))

    Across pipeline stages the finiteness is the whole model's: the stages exchange their
    gradients' sums of squares (:mod:`pdjax.pipeline.optim`), and a non-finite gradient
    anywhere makes every stage's check fail, so all stages skip together and keep equal
    scales.

    Args:
      optimizer: the optax transformation to run on the unscaled gradients.
      loss_scale: the initial ``jmp.DynamicLossScale`` (default: scale ``2**15``,
        ``period`` 2000, ``factor`` 2).

    >>> import jmp, optax
    >>> opt = loss_scaled(optax.sgd(0.1), jmp.DynamicLossScale(jnp.float32(4.0), period=2))
    >>> state = opt.init({"w": jnp.ones(2)})
    >>> _, state = opt.update({"w": jnp.array([jnp.inf, 0.0])}, state)
    >>> float(state.loss_scale), int(state.counter)  # skipped: the scale halves
    (2.0, 0)
    """
    if not isinstance(optimizer, optax.GradientTransformation):
        raise TypeError(
            f"loss_scaled takes an optax GradientTransformation, got {type(optimizer).__name__}"
        )
    if isinstance(optimizer, LossScaled):
        raise TypeError("the optimizer is loss_scaled already")
    if loss_scale is None:
        loss_scale = jmp.DynamicLossScale(jnp.asarray(2.0**15, jnp.float32))
    if not isinstance(loss_scale, jmp.DynamicLossScale):
        raise TypeError(
            f"loss_scale must be a jmp.DynamicLossScale, got {type(loss_scale).__name__}"
        )
    first = np.asarray(loss_scale.loss_scale, np.float32)
    count = np.asarray(loss_scale.counter, np.int32)
    period, factor = loss_scale.period, loss_scale.factor
    minimum = np.asarray(loss_scale.min_loss_scale, np.float32)

    def init(params: Any) -> LossScaleState:
        return LossScaleState(optimizer.init(params), jnp.asarray(first), jnp.asarray(count))

    def update(grads: Any, state: LossScaleState, params: Any = None) -> tuple[Any, LossScaleState]:
        scale = jmp.DynamicLossScale(state.loss_scale, state.counter, period, factor, minimum)
        grads = scale.unscale(grads)
        finite = jmp.all_finite(grads)
        updates, inner = optimizer.update(grads, state.inner, params)
        inner = jmp.select_tree(finite, inner, state.inner)
        updates = jmp.select_tree(finite, updates, jax.tree.map(jnp.zeros_like, updates))
        scale = scale.adjust(finite)
        return updates, LossScaleState(inner, scale.loss_scale, scale.counter)

    return LossScaled(init, update)


def loss_scale_of(opt_state: Any) -> jax.Array | None:
    """The current loss scale in a :func:`loss_scaled` optimizer's state (``None`` for
    another optimizer's)."""
    if isinstance(opt_state, LossScaleState):
        return opt_state.loss_scale
    return None
