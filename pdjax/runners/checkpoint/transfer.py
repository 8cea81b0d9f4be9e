"""Moving checkpoint arrays between processes (``jax.distributed``): process 0 alone
writes and reads the directory, so a save first gathers every array there (a sharded
stage's arrays assembled whole in their own process first), and a restore sends each
process the arrays it holds (each process places its part on its devices).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from pdjax._sharding import first_device
from pdjax.distributed import allgather_json
from pdjax.errors import CheckpointError


def _whole(leaf: Any) -> Any:
    """A local array holding all of ``leaf`` (an addressable replica, or ``leaf`` itself
    for host arrays; for an array sharded over this process's devices alone, such as a
    sharded stage's weights, its shards assembled in host memory: process 0 writes the
    whole step, so it receives every array whole), or None when this process holds none
    of it or only part."""
    if not isinstance(leaf, jax.Array):
        return leaf
    for shard in leaf.addressable_shards:
        if shard.data.shape == leaf.shape:
            return shard.data
    if leaf.addressable_shards and leaf.is_fully_addressable:
        return np.asarray(leaf)
    return None


def move(value: Any, spec: Any, *, src: int, dst: int) -> np.ndarray | None:
    """``value`` (an array of ``spec``'s shape and dtype, real on process ``src``) sent to
    process ``dst``; the two processes call it together. Returns it on ``dst`` (as host
    memory), None on ``src``. Through ``jax.device_put``, or, with more than 2 processes on
    CPU (where JAX's CPU transfers cannot tell receivers apart), an XLA collective."""
    if collective_transfers():
        from pdjax.pipeline.transport import Collective

        global _LINKS
        _LINKS = _LINKS or Collective()
        a, b = first_device(src), first_device(dst)
        if jax.process_index() == src:
            _LINKS._single(
                piece=jax.device_put(value, a),
                src=a,
                dst=b,
                shape=spec.shape,
                dtype=spec.dtype,
                send=True,
            ).block_until_ready()
            return None
        received = _LINKS._single(
            piece=None, src=a, dst=b, shape=spec.shape, dtype=spec.dtype, send=False
        )
        return np.asarray(received)
    from_, to = (
        jax.sharding.SingleDeviceSharding(first_device(src)),
        jax.sharding.SingleDeviceSharding(first_device(dst)),
    )
    if jax.process_index() == src:
        jax.device_put(jax.device_put(value, from_), to).block_until_ready()
        return None
    remote = jax.make_array_from_single_device_arrays(spec.shape, from_, [], dtype=spec.dtype)
    return np.asarray(jax.device_put(remote, to))


_LINKS: Any = None  # the collective links of checkpoint transfers (made on first use)


def collective_transfers() -> bool:
    if jax.process_count() <= 2:
        return False
    platform: str = jax.devices()[0].platform
    return platform == "cpu"


def gather_to_0(arrays: Mapping[str, Any]) -> dict[str, Any]:
    """Several processes: every array in host memory on process 0 (empty elsewhere). Each
    comes from process 0 when it holds all of it, else from the first process that does.
    Every process calls it, with the same names in the same order."""
    names = list(arrays)
    whole = {n: _whole(arrays[n]) for n in names}
    has = np.array([whole[n] is not None for n in names], dtype=np.bool_)
    table = np.array(allgather_json(has.tolist()), dtype=np.bool_).reshape(-1, len(names))
    me = jax.process_index()
    out: dict[str, Any] = {}
    for j, name in enumerate(names):
        holders = np.flatnonzero(table[:, j])
        if holders.size == 0:
            raise CheckpointError(
                f"no process holds all of {name} (sharded across processes); pdjax "
                "checkpoints hold whole arrays: replicate it, or shard within one process"
            )
        src = int(holders[0])
        if src == 0:
            if me == 0:
                out[name] = np.asarray(whole[name])
        elif me in (0, src):
            got = move(whole[name], arrays[name], src=src, dst=0)
            if me == 0:
                out[name] = got
    return out
