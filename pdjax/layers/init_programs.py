"""Layers initialised on given devices by compiled programs that identical layers share
(:func:`init_on`).

Initialising is the most expensive program of a small model to compile: every parameter
draws random bits, and XLA compiles each draw's kernels (a few hundred milliseconds per
layer on a CPU). A model usually repeats one block, and a process often builds several
pipelines of one model (``pdjax train --compare``, ``pdjax bench``, a planner measuring
candidates), so a layer is initialised by a program of its own, compiled once per
process for every layer that computes the same thing: the same program initialises
``Block(8)`` at layer 3 and at layer 5, of this pipeline and of the next. The layer's
index is an argument of the program, not a constant in it.

A compiled program runs on the devices it was compiled for, so a program shared by
stages on different devices runs on one *home* device the caller names (the first
device of the pipeline's first stage), and its values then move to the stage's devices:
one compile per distinct layer, not one per layer and device set, for a copy of each
layer's variables (no more than the weights the stage holds anyway).

Which layers share: a linen module compared by its fields (its dataclass equality, which
``nn.jit`` and the profiler also trust), a parameter-free function by its identity, and
either under the same precision policy. An nnx module is never shared: its ``init``
returns the arrays it already holds, which the program carries as constants. Nor is a
layer class of the user's own, or a linen module with a field that does not hash (an
array): consecutive such layers are initialised by one program of their own, as before.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax

from pdjax.layers.base import Layer, PyTree, Variables
from pdjax.layers.fn_layer import FnLayer
from pdjax.layers.linen_layer import LinenLayer
from pdjax.layers.precision_layer import PrecisionLayer

__all__ = ["init_layers", "init_on"]

#: Shared programs kept per process, the least recently used dropped first: one per
#: distinct layer and device set (each compiles once per input shape).
MAX_SHARED = 256

_shared: collections.OrderedDict[Hashable, Callable[..., Any]] = collections.OrderedDict()


def _share_key(layer: Layer) -> Hashable | None:
    """What decides ``layer``'s initialisation given its input's shapes, or None where its
    program must not be shared (see the module's docstring)."""
    key: Hashable
    # exact classes: a subclass may change what the layer computes
    if type(layer) is LinenLayer:
        key = ("linen", type(layer.module), layer.module)
    elif type(layer) is FnLayer:
        key = ("fn", layer.fn)
    elif type(layer) is PrecisionLayer:
        inner = _share_key(layer.layer)
        if inner is None:
            return None
        key = ("precision", inner, layer.policy, layer.final)
    else:
        return None
    try:
        hash(key)
        if not bool(key == key):  # a field that compares to an array, or NaN
            return None
    except Exception:  # a field that does not hash or compare (an array)
        return None
    return key


def init_layers(
    layers: Sequence[Layer], first: Any, key: jax.Array, x: PyTree
) -> tuple[list[Variables], PyTree]:
    """``layers`` (model layers ``first ..``) initialised as :meth:`LayerSequence.init`
    does: layer ``i`` from ``fold_in(key, i)``, fed the layer before's output; and the
    last one's output."""
    out = []
    for j, layer in enumerate(layers):
        v = layer.init(jax.random.fold_in(key, first + j), x)
        x, _ = layer.apply(v, x, train=False)
        out.append(v)
    return out, x


def _program(layers: tuple[Layer, ...], share: Hashable | None, place: Any) -> Any:
    """The jitted :func:`init_layers` of ``layers`` placed by ``place`` (a sharding, or a
    device that its inputs are on): the one shared under ``share`` (made on first use), or
    a new one where ``share`` is None."""
    out_shardings = None if isinstance(place, jax.Device) else place
    if share is None:
        return jax.jit(functools.partial(init_layers, layers), out_shardings=out_shardings)
    cache_key = (share, place)
    found = _shared.get(cache_key)
    if found is not None:
        _shared.move_to_end(cache_key)
        return found
    fn = _shared[cache_key] = jax.jit(
        functools.partial(init_layers, layers), out_shardings=out_shardings
    )
    while len(_shared) > MAX_SHARED:
        _shared.popitem(last=False)
    return fn


def _runs(layers: Sequence[Layer]) -> list[tuple[int, tuple[Layer, ...], Hashable | None]]:
    """``layers`` as (offset, run, share key): each layer that shares alone, each maximal
    run of layers that do not together."""
    runs: list[tuple[int, tuple[Layer, ...], Hashable | None]] = []
    for j, layer in enumerate(layers):
        share = _share_key(layer)
        if share is None and runs and runs[-1][2] is None:
            offset, run, _ = runs[-1]
            runs[-1] = (offset, (*run, layer), None)
        else:
            runs.append((j, (layer,), share))
    return runs


def init_on(
    layers: Sequence[Layer],
    first: int,
    key: jax.Array,
    x: PyTree,
    sharding: Any,
    home: jax.Device | None = None,
    place: Callable[[int, list[Variables]], list[Variables]] | None = None,
) -> tuple[list[Variables], PyTree]:
    """``layers``, model layers ``first ..``, initialised as :meth:`LayerSequence.init`
    does (layer ``i`` from ``fold_in(key, i)``), with the variables and the last layer's
    output placed by ``sharding``; ``key`` and ``x`` should be on its devices already.

    With a ``home`` device (and a ``sharding`` this process holds whole), the layers that
    share a program are initialised there and their variables moved to ``sharding``, so
    callers passing the same ``home`` share the programs whatever their devices.

    The values are those one program of all the layers computes: the programs draw the
    same bits from the same keys (at XLA's lowest optimization level, a float may round in
    its last bit differently from one program to another, as between any two programs).

    ``place(offset, variables)``, with a ``home``: every run is initialised there and its
    variables (of layers ``offset ..`` of ``layers``) placed by it instead (a sharded
    stage's: each parameter on its own sharding), so no device holds more than one run's
    variables whole."""
    if home is not None and not sharding.is_fully_addressable:
        home = None  # another process's devices: each process computes its own part
    variables: list[Variables] = []
    for offset, run, share in _runs(layers):
        if place is not None and home is not None:
            put = functools.partial(jax.device_put, device=home)
            vs, x = _program(run, share, home)(first + offset, put(key), put(x))
            vs = place(offset, vs)
        elif share is None or home is None:
            vs, x = _program(run, share, sharding)(first + offset, key, jax.device_put(x, sharding))
        else:
            put = functools.partial(jax.device_put, device=home)
            vs, x = _program(run, share, home)(first + offset, put(key), put(x))
            vs = jax.device_put(vs, sharding)
        variables += vs
    return variables, jax.device_put(x, sharding)
