"""A layer computing under a mixed precision policy (:class:`PrecisionLayer`), as
:func:`~pdjax.layers.sequential`'s ``precision=`` makes it."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from pdjax.layers.base import Layer, PyTree, Variables
from pdjax.precision import Policy

__all__ = ["PrecisionLayer"]


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _Recast:
    """In a kept pullback, the place of leaf ``index`` of the compute-dtype casts
    (parameters, then input): a pytree with no leaves, filled again in the backward."""

    index: int


def _cast_back(grads: PyTree, like: PyTree) -> PyTree:
    """The cotangents of a cast's outputs as cotangents of its inputs (``like``): each
    float leaf cast to its input's dtype, as the transpose of ``convert_element_type``
    does; others (``float0``) as they are."""

    def back(g: Any, a: Any) -> Any:
        if jnp.issubdtype(jnp.result_type(a), jnp.floating) and g.dtype != a.dtype:
            return g.astype(a.dtype)
        return g

    return jax.tree.map(back, grads, like)


def _in_dtypes_of(new: Variables, old: Variables) -> Variables:
    """``new`` (a layer's collections after a call) with each float leaf cast back to the
    dtype of the same leaf in ``old`` where that differs (collections alike in structure)."""

    def back(a: Any, b: Any) -> Any:
        if not (hasattr(a, "dtype") and hasattr(b, "dtype")) or a.dtype == b.dtype:
            return a
        if jnp.issubdtype(a.dtype, jnp.floating) and jnp.issubdtype(b.dtype, jnp.floating):
            return a.astype(b.dtype)
        return a

    out = dict(new)
    for coll, tree in new.items():
        # jaxlib ships no stub for PyTreeDef, whose == mypy then cannot see
        if coll in old and jax.tree.structure(tree) == jax.tree.structure(old[coll]):  # type: ignore[operator]
            out[coll] = jax.tree.map(back, tree, old[coll])
    return out


@dataclasses.dataclass(frozen=True)
class PrecisionLayer:
    """A layer computing under a mixed precision policy (:mod:`pdjax.precision`); made by
    :func:`sequential`'s ``precision=``.

    ``apply`` casts the float leaves of the ``"params"`` collection and of the input to
    the policy's compute dtype, calls the wrapped layer, and casts its float outputs to the
    compute dtype, or to the output dtype for the model's last layer (``final``). The
    variables keep the parameters in the parameter dtype, so their gradients come back in
    it through the cast. Other collections (BatchNorm statistics) go in as they are and
    come back in their own dtypes; integer and PRNG-key leaves are never cast. ``init``
    casts the float parameters to the parameter dtype.

    The backward does not keep the compute-dtype copies of the parameters (or of the
    input) among its residuals: ``apply`` is a ``jax.custom_vjp`` whose forward keeps the
    wrapped layer's residuals but those copies, and whose backward casts the
    parameter-dtype weights and input (which a pipeline stage holds anyway) again. So a
    stage holds no compute-dtype weight copy per microbatch in flight, the profiler's
    ``residual_bytes`` has none, and the values computed are those of differentiating the
    casts directly. Being a ``custom_vjp``, it has no forward-mode derivative
    (``jax.jvp``).

    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> from pdjax.layers import sequential
    >>> seq = sequential(nn.Dense(8), nn.Dense(4), precision="bf16")
    >>> v = seq.init(jax.random.key(0), jnp.ones((2, 3)))
    >>> v[0]["params"]["kernel"].dtype, seq.layers[0].apply(v[0], jnp.ones((2, 3)))[0].dtype
    (dtype('float32'), dtype(bfloat16))
    >>> seq.apply(v, jnp.ones((2, 3)))[0].dtype
    dtype('float32')

    Attributes:
      layer: the wrapped layer.
      policy: the ``jmp.Policy`` (see :func:`pdjax.precision.get_policy`).
      final: cast the output to the policy's output dtype (the model's last layer), not
        to its compute dtype.
    """

    layer: Layer
    policy: Policy
    final: bool = False

    @property
    def name(self) -> str:
        """The wrapped layer's name."""
        return self.layer.name

    @property
    def kind(self) -> str:
        """What the wrapped layer is (its module's class name, for profiles and tables)."""
        module = getattr(self.layer, "module", None)
        if module is not None:
            return type(module).__name__
        return str(getattr(self.layer, "kind", type(self.layer).__name__))

    def init(self, rng: jax.Array, x: PyTree) -> Variables:
        """The wrapped layer's variables for ``x`` (cast to the compute dtype), with the
        float parameters in the parameter dtype."""
        variables = dict(self.layer.init(rng, self.policy.cast_to_compute(x)))
        if "params" in variables:
            variables["params"] = self.policy.cast_to_param(variables["params"])
        return variables

    def apply(
        self,
        variables: Variables,
        x: PyTree,
        *,
        train: bool = False,
        rng: jax.Array | None = None,
    ) -> tuple[PyTree, Variables]:
        """Applies the wrapped layer in the compute dtype; see the class docstring."""
        policy, layer, final = self.policy, self.layer, self.final
        has_params = "params" in variables

        def run(params: PyTree, others: Variables, x: PyTree) -> Any:
            inner = {**others, "params": params} if has_params else others
            y, state = layer.apply(inner, x, train=train, rng=rng)
            y = policy.cast_to_output(y) if final else policy.cast_to_compute(y)
            return y, state

        def casts(variables: Variables, x: PyTree) -> tuple[PyTree, Variables, PyTree]:
            others = {k: v for k, v in variables.items() if k != "params"}
            params = policy.cast_to_compute(variables.get("params", {}))
            return params, others, policy.cast_to_compute(x)

        # the backward recomputes the casts from the parameter-dtype weights and the input
        # (held anyway) instead of keeping their compute-dtype copies among the residuals
        @jax.custom_vjp
        def recast(variables: Variables, x: PyTree) -> Any:
            return run(*casts(variables, x))

        def fwd(variables: Variables, x: PyTree) -> Any:
            params, others, xc = casts(variables, x)
            out, pullback = jax.vjp(lambda p, h: run(p, others, h), params, xc)
            recomputed = {id(a): k for k, a in enumerate(jax.tree.leaves((params, xc)))}
            kept = jax.tree.map(
                lambda a: _Recast(recomputed[id(a)]) if id(a) in recomputed else a, pullback
            )
            return out, (variables, x, kept)

        def bwd(res: Any, ct: Any) -> Any:
            variables, x, kept = res
            params, _, xc = casts(variables, x)
            leaves = jax.tree.leaves((params, xc))
            pullback = jax.tree.map(
                lambda a: leaves[a.index] if isinstance(a, _Recast) else a,
                kept,
                is_leaf=lambda a: isinstance(a, _Recast),
            )
            g_params, g_x = pullback(ct)
            # the model state (BatchNorm statistics, RNG counters) gets no gradient
            grads: dict[str, Any] = dict.fromkeys(variables)
            if has_params:
                grads["params"] = _cast_back(g_params, variables["params"])
            return grads, _cast_back(g_x, x)

        recast.defvjp(fwd, bwd)
        y, state = recast(dict(variables), x)
        return y, _in_dtypes_of(state, variables)
