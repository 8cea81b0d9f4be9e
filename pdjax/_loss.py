"""A loss function's result: the scalar loss, or ``(loss, aux)`` with metrics."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pdjax.errors import PipelineError

__all__ = ["split_loss", "with_aux"]

PyTree = Any


def split_loss(out: Any) -> tuple[jax.Array, PyTree]:
    """A loss function's result as ``(loss, aux)``: ``loss_fn(outputs, targets)`` returns
    the scalar mean loss, or ``(loss, aux)`` with ``aux`` a pytree of metrics (accuracy,
    token counts) reported per microbatch. The loss is returned as float32 (the seed of the
    backward); ``aux`` is ``None`` when there is none.

    Raises:
      PipelineError: (when traced) if the loss is not a scalar floating-point value.
    """
    if isinstance(out, (tuple, list)) and len(out) == 2:
        loss, aux = out
    else:
        loss, aux = out, None
    shape, dtype = np.shape(loss), jnp.result_type(loss)
    if shape != () or not jnp.issubdtype(dtype, jnp.floating):
        raise PipelineError(
            "loss_fn(outputs, targets) must return a scalar floating-point loss (the mean "
            "over the microbatch), or (loss, aux) with aux a pytree of metrics; got "
            f"{'a ' + type(out).__name__ + ' whose loss is ' if aux is not None else ''}"
            f"{dtype}{list(shape)}" + (": reduce it with .mean()" if shape else "")
        )
    return jnp.asarray(loss, jnp.float32), aux


def with_aux(loss: jax.Array, aux: PyTree) -> Any:
    """What a last stage's forward leaves in its ``loss`` slot: the loss, or ``(loss,
    aux)`` for a loss function with auxiliary outputs."""
    return loss if aux is None else (loss, aux)
