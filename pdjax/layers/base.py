"""What every layer is: the :class:`Layer` protocol, the types of variables, activations
and losses, and the helpers the layer kinds share."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import jax

__all__ = ["Layer", "LossFn", "PyTree", "TiedLeaf", "Variables", "count_traces"]

PyTree = Any
#: A layer's variables: collection name -> pytree, e.g. ``{"params": ..., "batch_stats": ...}``.
Variables = dict[str, PyTree]
#: ``loss_fn(outputs, targets) -> scalar``: the mean loss of a (micro)batch.
LossFn = Callable[[PyTree, PyTree], jax.Array]
#: One copy of a tied parameter: ``(layer index, path of keys inside the layer's params)``.
TiedLeaf = tuple[int, tuple[str, ...]]


def count_traces(counts: dict[str, int], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps ``fn`` so that each trace (compilation) increments ``counts[name]``.

    Wrap before ``jax.jit``: the wrapper runs only while JAX traces, so a test can assert
    that a function compiled once per shape.
    """

    def traced(*args: Any) -> Any:
        counts[name] = counts.get(name, 0) + 1
        return fn(*args)

    return traced


@runtime_checkable
class Layer(Protocol):
    """What pdjax needs of one layer. Implemented by :class:`LinenLayer`, :class:`NnxLayer`
    and :class:`FnLayer`."""

    @property
    def name(self) -> str:
        """The layer's name (read-only here, so frozen dataclasses implement it too)."""
        ...

    def init(self, rng: jax.Array, x: PyTree) -> Variables:
        """Creates the layer's variables for input ``x``."""
        ...

    def apply(
        self,
        variables: Variables,
        x: PyTree,
        *,
        train: bool = False,
        rng: jax.Array | None = None,
    ) -> tuple[PyTree, Variables]:
        """Returns ``(output, non-parameter collections after the call)``."""
        ...


def mode_kwarg(fn: Callable[..., Any]) -> tuple[str, bool] | None:
    """Finds how a module's ``__call__`` is told train vs eval: ``(argname, inverted)``."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None
    if "train" in params:
        return ("train", False)
    if "training" in params:
        return ("training", False)
    if "deterministic" in params:
        return ("deterministic", True)
    if "use_running_average" in params:
        return ("use_running_average", True)
    return None
