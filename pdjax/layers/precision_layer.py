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

    The backward keeps the compute-dtype copy of the parameters among its residuals (as
    ``jax.vjp`` of any cast does), so a pipeline stage holds one such copy per microbatch
    in flight; the profiler's ``residual_bytes`` counts it.

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
        policy = self.policy
        cast = dict(variables)
        if "params" in cast:
            cast["params"] = policy.cast_to_compute(cast["params"])
        y, state = self.layer.apply(cast, policy.cast_to_compute(x), train=train, rng=rng)
        y = policy.cast_to_output(y) if self.final else policy.cast_to_compute(y)
        return y, _in_dtypes_of(state, variables)
