"""A ``flax.linen`` module as a pdjax layer (:class:`LinenLayer`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax

from pdjax.errors import LayerError
from pdjax.layers.base import PyTree, Variables, mode_kwarg

__all__ = ["LinenLayer"]


def _split_key(rng: jax.Array) -> tuple[jax.Array, jax.Array]:
    a, b = jax.random.split(rng)
    return a, b


@dataclasses.dataclass(frozen=True)
class LinenLayer:
    """A ``flax.linen`` module as a pdjax layer.

    The train/eval switch is passed to the module's ``__call__`` as whichever of ``train``,
    ``training``, ``deterministic`` or ``use_running_average`` it accepts (inverted for the
    last two). Dropout draws from the ``"dropout"`` RNG stream, which ``apply`` fills from
    ``rng``. In train mode every collection other than ``"params"`` is mutable.

    Attributes:
      module: the Flax linen module (unbound).
      name: a unique name within its sequence.
    """

    module: nn.Module
    name: str

    def _kwargs(self, train: bool) -> dict[str, Any]:
        # Any, not bool: spread into Module.init/apply, whose own keyword parameters
        # (method, mutable, ...) mypy would match a bool against
        mode = mode_kwarg(type(self.module).__call__)
        if mode is None:
            return {}
        arg, inverted = mode
        return {arg: (not train) if inverted else train}

    def init(self, rng: jax.Array, x: PyTree) -> Variables:
        """Initialises the module's variables for input ``x`` (in eval mode)."""
        params_key, dropout_key = _split_key(rng)
        variables = self.module.init(
            {"params": params_key, "dropout": dropout_key}, x, **self._kwargs(False)
        )
        return {k: v for k, v in dict(variables).items()}

    def apply(
        self,
        variables: Variables,
        x: PyTree,
        *,
        train: bool = False,
        rng: jax.Array | None = None,
    ) -> tuple[PyTree, Variables]:
        """Applies the module; returns the output and its non-parameter collections."""
        state = {k: v for k, v in variables.items() if k != "params"}
        rngs = {"dropout": rng} if rng is not None else {}
        kwargs = self._kwargs(train)
        try:
            if train and state:
                y, updates = self.module.apply(
                    variables, x, rngs=rngs, mutable=list(state), **kwargs
                )
                return y, {**state, **dict(updates)}
            return self.module.apply(variables, x, rngs=rngs, **kwargs), state
        except Exception as e:  # flax raises several RNG error types across versions
            if "rng" in str(e).lower() and rng is None and train:
                raise LayerError(
                    f"layer {self.name!r} needs an RNG in train mode (dropout?); "
                    "pass rng=jax.random.key(...) to apply"
                ) from e
            raise
