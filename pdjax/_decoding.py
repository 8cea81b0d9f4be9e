"""The key/value-cache protocol between a pipeline's cached generation
(:mod:`pdjax.pipeline.executor.cached_generation`) and the layers that support it (the
Llama family, :mod:`pdjax.models.llama`).

It lives at the foundation because both sides read it and neither may import the other:
the runtime (``pdjax.pipeline``) does not import the models.

A layer takes part by accepting a :class:`CacheStep` as its input (``layer.apply(v,
CacheStep(...))``) and returning one: the step with its ``x`` replaced by the layer's
output and its ``cache`` by the layer's own cache after the step (``None`` for a layer
without one, an embedding or a head). Any other answer (an error, another type) means
the layer does not support the cache, and generation keeps its uncached path.
:class:`CacheStep` is deliberately not a pytree: a layer that maps a function over its
input's leaves sees one opaque leaf and fails, rather than passing a step through
half-handled.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["CacheStep"]


@dataclasses.dataclass(frozen=True)
class CacheStep:
    """One layer's input in cached generation.

    Attributes:
      x: the layer's input proper: int32 token ids ``[B, T]`` for the first layer, the
        previous layer's activations after it. ``T`` is the prompt's length in the
        prefill, 1 in a decode step.
      start: int32 scalar (traced): the position of ``x[:, 0]`` in the sequence; the
        prefill starts at 0, the decode step of the token at position ``p`` at ``p``.
      length: the cache's positions (static): the most tokens the call feeds, the prompt
        and every new token but the last.
      cache: the layer's cache as it returned it from the previous step (``None`` in the
        prefill: the layer allocates it, ``length`` positions, and writes the prompt's).
    """

    x: Any
    start: Any
    length: int
    cache: Any = None

    def advance(self, x: Any, cache: Any = None) -> CacheStep:
        """This step with the layer's output ``x`` and its ``cache`` after the step (None:
        the layer keeps no cache): what a supporting layer returns."""
        return dataclasses.replace(self, x=x, cache=cache)
