"""A parameter-free function ``x -> y`` as a pdjax layer (:class:`FnLayer`), and
:class:`Fn`, which marks a callable as one."""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable
from typing import Any

import jax

from pdjax.errors import LayerError
from pdjax.layers.base import PyTree, Variables

__all__ = ["Fn", "FnLayer"]


def fn_name(fn: Callable[..., Any]) -> str:
    """A function's name fit for a layer name: ``relu``, ``lambda`` (``functools.partial``
    unwrapped), else its type's name."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    name = getattr(fn, "__name__", None) or type(fn).__name__
    return re.sub(r"\W+", "_", str(name)).strip("_") or "fn"


@dataclasses.dataclass(frozen=True)
class Fn:
    """Marks a callable as a parameter-free layer function ``x -> y``.

    Plain functions (``nn.relu``, ``jnp.tanh``, ``lambda x: x * 2``, a
    ``functools.partial``) are recognised without it (see :func:`as_layer`); wrap one that
    would otherwise be taken for an nnx factory, such as a function whose one parameter is
    called ``rngs``.

    >>> import jax.numpy as jnp
    >>> from pdjax.layers import sequential
    >>> seq = sequential(Fn(lambda rngs: rngs * 2), jnp.tanh)
    >>> seq.names
    ('00_lambda', '01_tanh')

    Attributes:
      fn: the function, called on the previous layer's output.
    """

    fn: Callable[[PyTree], PyTree]

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise LayerError(f"Fn needs a callable, got {type(self.fn).__name__}")


@dataclasses.dataclass(frozen=True)
class FnLayer:
    """A parameter-free function ``x -> y`` as a pdjax layer.

    It has no variables (``init`` returns ``{}``) and ``apply`` calls the function, the
    same in train and eval mode; ``variables`` and ``rng`` are ignored.

    Attributes:
      fn: the function, e.g. ``nn.relu``, ``jnp.tanh``, ``lambda x: x * 2``.
      name: a unique name within its sequence.
    """

    fn: Callable[[PyTree], PyTree]
    name: str

    @property
    def kind(self) -> str:
        """The function's name (for profiles and tables)."""
        return fn_name(self.fn)

    def init(self, rng: jax.Array, x: PyTree) -> Variables:
        """Returns no variables."""
        del rng, x
        return {}

    def apply(
        self,
        variables: Variables,
        x: PyTree,
        *,
        train: bool = False,
        rng: jax.Array | None = None,
    ) -> tuple[PyTree, Variables]:
        """Returns ``(fn(x), {})``."""
        del variables, train, rng
        return self.fn(x), {}
