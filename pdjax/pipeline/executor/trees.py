"""Small pytree helpers the runtime's modules share: shapes, placement of shards,
buffers kept apart before donation, and layer initialisation."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pdjax.layers import PyTree


def compose(f: Callable[[Any], Any], g: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda x: f(g(x))


def shape_key(tree: PyTree) -> Any:
    leaves = jax.tree.leaves(tree)
    return jax.tree.structure(tree), tuple((np.shape(a), str(jnp.result_type(a))) for a in leaves)


def unaliased(tree: PyTree, other: PyTree) -> PyTree:
    """``tree`` with every array that shares a buffer with an array of ``other``, or with
    an earlier array of ``tree``, copied: donating the tree must not donate ``other``'s
    buffers or one buffer twice."""

    def pointers(a: Any) -> set[int]:
        if not isinstance(a, jax.Array) or a.is_deleted():
            return set()
        return {s.data.unsafe_buffer_pointer() for s in a.addressable_shards}

    taken = set().union(*(pointers(a) for a in jax.tree.leaves(other)))

    def one(a: Any) -> Any:
        mine = pointers(a)
        if mine & taken:
            a = jnp.array(a, copy=True)
            mine = pointers(a)
        taken.update(mine)
        return a

    return jax.tree.map(one, tree)


def concat(trees: list[PyTree]) -> PyTree:
    """Microbatches concatenated along axis 0 (on the host when they are numpy)."""
    if all(isinstance(a, np.ndarray) for a in jax.tree.leaves(trees)):
        return jax.tree.map(lambda *a: np.concatenate(a), *trees)
    return jax.tree.map(lambda *a: jnp.concatenate(a), *trees)


def plain(a: np.ndarray) -> Any:
    """A 0-d array as a Python float; others as they are."""
    return float(a) if np.ndim(a) == 0 else a


def loss_of(value: Any) -> jax.Array:
    """The loss in a ``loss`` slot's value (the loss, or ``(loss, aux)``)."""
    loss: jax.Array = value[0] if isinstance(value, tuple) else value
    return loss


def remote(sharding: jax.sharding.Sharding, tree: PyTree) -> PyTree:
    """``tree`` as global arrays on another process's devices: shapes, no local data."""
    return jax.tree.map(
        lambda a: jax.make_array_from_single_device_arrays(
            np.shape(a), sharding, [], dtype=jnp.result_type(a)
        ),
        tree,
    )


def abstract(tree: PyTree) -> PyTree:
    """``tree`` with every leaf replaced by its ``jax.ShapeDtypeStruct``."""
    # jax leaves ShapeDtypeStruct.__init__ unannotated
    return jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(np.shape(a), jnp.result_type(a)),
        tree,
    )


def shapes_text(tree: PyTree) -> str:
    """``float32[4, 8], int32[4]``: the leaves' dtypes and shapes."""
    return ", ".join(f"{jnp.result_type(a)}{list(np.shape(a))}" for a in jax.tree.leaves(tree))
