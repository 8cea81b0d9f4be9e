"""Placing host values on a sharding that may span processes."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pdjax.layers import PyTree

__all__ = ["first_device", "held", "place", "shard_on"]


def place(tree: PyTree, sharding: jax.sharding.Sharding) -> PyTree:
    """``tree`` on ``sharding``. When the sharding spans processes (``jax.distributed``),
    every process holds the whole value (same seed, same batch) and contributes the part
    its own devices hold; ``jax.device_put`` cannot place a local array there."""
    if sharding.is_fully_addressable:
        return jax.device_put(tree, sharding)

    def one(leaf: Any) -> jax.Array:
        if jnp.issubdtype(jnp.result_type(leaf), jax.dtypes.prng_key):
            impl = jax.random.key_impl(leaf)
            key: jax.Array = jax.random.wrap_key_data(one(jax.random.key_data(leaf)), impl=impl)
            return key
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            moved: jax.Array = jax.device_put(leaf, sharding)  # already global: reshard
            return moved
        whole = np.asarray(leaf)
        return jax.make_array_from_callback(whole.shape, sharding, lambda i: whole[i])

    return jax.tree.map(one, tree)


def first_device(process: int) -> jax.Device:
    """Process ``process``'s first device in the global device list."""
    return next(d for d in jax.devices() if d.process_index == process)


def held(leaf: Any) -> bool:
    """Whether ``leaf`` is an array with data in this process (to wait for)."""
    return isinstance(leaf, jax.Array) and bool(leaf.addressable_shards)


def shard_on(array: jax.Array, device: jax.Device) -> jax.Array:
    """The shard of ``array`` that ``device`` holds (a whole replica, for weights)."""
    data: jax.Array = next(sh.data for sh in array.addressable_shards if sh.device == device)
    return data
