"""The token-weighted loss: a batch's loss as the mean over its real tokens, not the mean
of its microbatches' means.

A language model's loss (:meth:`pdjax.models.ModelSpec.loss`) is the mean over one
microbatch's real targets (targets ``>= 0``), and a flush pipeline's update averages it
over the batch's ``M`` microbatches. With buckets the microbatches hold different numbers
of real tokens, so that mean of means weighs a token of a short microbatch more than one
of a long microbatch. :class:`~pdjax.apps.data.bucket_stream.BucketStream` with
``token_weights=True`` gives each microbatch's targets as ``(targets, weight)``, with
``weight = M * real(microbatch) / real(batch)``, and :func:`token_weighted` multiplies the
loss by it:

    mean_m  loss_m * M * real_m / real  =  sum_m (sum of token losses)_m / real,

the mean over the batch's real tokens, every token counting the same (the convention of
:mod:`pdjax.apps.data.bpe`). A microbatch without real tokens has weight 0 and loss 0 (the
kept mean of nothing is 0), so it adds nothing and no NaN.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp

__all__ = ["token_weighted"]


def _weighted_targets(targets: Any) -> bool:
    """Whether ``targets`` are ``(targets, weights)``: a pair whose second is a vector of
    one weight per row (every leaf the runtime carries has a row per sample), the first
    of more dimensions."""
    return (
        isinstance(targets, tuple)
        and len(targets) == 2
        and jnp.ndim(targets[1]) == 1
        and jnp.ndim(targets[0]) >= 2
    )


def token_weighted(loss: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """``loss`` taking ``(targets, weights)`` targets as well: ``loss'(outputs, (targets,
    weights)) = loss(outputs, targets) * mean(weights)``, and plain targets
    (evaluation's) as ``loss`` does. The stream gives every row of a microbatch the
    microbatch's weight (the runtime needs a row per sample in every leaf, and may split
    the rows over a stage's devices), so their mean is that weight.

    A pair of a 2-D (or more) array and a vector is taken as ``(targets, weights)``; any
    other targets go to ``loss`` as they are.
    A loss that returns ``(loss, aux)`` has its first element weighted.

    Args:
      loss: ``(outputs, targets) -> scalar`` (or ``(scalar, aux)``), e.g.
        ``ModelSpec.loss``.

    Returns:
      The wrapped loss, a pure function (jit and grad see through it).

    >>> import jax.numpy as jnp
    >>> mean = lambda outputs, targets: jnp.mean((outputs - targets) ** 2)
    >>> weighted = token_weighted(mean)
    >>> x, t = jnp.ones((2, 3)), jnp.zeros((2, 3))
    >>> float(weighted(x, (t, jnp.full(2, 0.5)))), float(weighted(x, t))
    (0.5, 1.0)
    """

    def weighted(outputs: Any, targets: Any) -> Any:
        if not _weighted_targets(targets):
            return loss(outputs, targets)
        plain, weights = targets
        weight = jnp.mean(weights)
        value = loss(outputs, plain)
        if isinstance(value, tuple):
            return (value[0] * weight, *value[1:])
        return value * weight

    return weighted
