"""One function per layer: a stage's programs trace each layer once per program (the
forward, the fused forward and backward, the recomputing backward, the parts check...),
and every trace must compute the same function, or the programs of one step would mix
them (a loss from one trace, the gradients of another).

:class:`LayerTraces` applies a layer as a program's trace always did (a direct call),
after tracing it once more with ``jax.make_jaxpr`` (a trace, nothing compiled). The first
such jaxpr of a layer for given input types is kept as a structural form (:func:`form`:
primitives, parameters, wiring, types and constants; not the variables' names, nor the
identities of callables, which every trace makes anew); a later trace for the same
types that differs is refused, naming the layer, before the program that would mix them
is compiled.

The program does not run the recorded jaxpr instead of the call: replayed in another
trace, a ``jax.custom_vjp`` that closes over a traced value (a layer's PRNG key, as
:class:`~pdjax.layers.precision_layer.PrecisionLayer`'s does) would run its rules with
the tracers of the finished trace.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from pdjax.errors import PipelineError
from pdjax.layers import Layer, PyTree

__all__ = ["LayerTraces", "form"]


class LayerTraces:
    """The first trace's form of each layer application, per input types and context
    (see the module)."""

    def __init__(self) -> None:
        self._forms: dict[Hashable, tuple[Hashable, jcore.Jaxpr]] = {}

    def apply(
        self,
        index: int,
        layer: Layer,
        variables: PyTree,
        x: PyTree,
        *,
        train: bool,
        rng: jax.Array | None,
        context: str,
    ) -> Any:
        """``layer.apply(variables, x, train=train, rng=rng)``, once its jaxpr is compared
        with the first for these input types (see the module). ``index``: the layer's
        index in the model (named by the refusal); ``context``: what the trace runs
        under (e.g. one device's rows in a ``shard_map``): traces of different contexts
        are not compared.

        Raises:
          PipelineError: where an earlier trace of the same layer for the same input types
            and context computed another function.
        """

        def fn(v: PyTree, x: PyTree, rng: jax.Array | None) -> Any:
            return layer.apply(v, x, train=train, rng=rng)

        args = (variables, x, rng)
        closed = jax.make_jaxpr(fn)(*args)
        # the types with their shardings, and the mesh in context: a trace under another
        # mesh or sharding may legitimately differ (e.g. in a sharding parameter)
        key = (
            index,
            train,
            context,
            repr(jax.sharding.get_abstract_mesh()),
            jax.tree.structure(args),
            tuple(
                (str(a), getattr(a, "weak_type", False), repr(getattr(a, "sharding", None)))
                for a in closed.in_avals
            ),
        )
        mine = form(closed)
        # the open jaxpr, printed only for a refusal (the constants stay with the trace)
        first = self._forms.setdefault(key, (mine, closed.jaxpr))
        if first[0] != mine:
            raise PipelineError(_refusal(index, layer, str(first[1]), str(closed.jaxpr)))
        # the program's own trace: a jaxpr replayed in another trace would call a
        # custom_vjp's rules with the tracers of the finished one (closures over the key)
        return layer.apply(variables, x, train=train, rng=rng)


def _refusal(index: int, layer: Layer, first: str, now: str) -> str:
    """The refusal's text: the layer, where its two traces first differ, and the rule."""
    a, b = first.splitlines(), now.splitlines()
    diff = [k for k in range(max(len(a), len(b))) if a[k : k + 1] != b[k : k + 1]]
    if diff:
        k = diff[0]
        was, got = (" ".join(t[k : k + 1]).strip()[:160] or "(end)" for t in (a, b))
        where = f"line {k + 1} of its jaxpr was `{was}`, is `{got}`"
    else:
        where = "in an equation parameter its printed jaxpr does not show"
    return (
        f"layer {index} ({layer.name}) computed a different function when traced again "
        f"for the same inputs ({where}): a layer must compute the same function on every "
        "trace, since pdjax traces it once per program and the programs of a step would "
        "train a mix of its traces. Keep Python-side state that changes between calls "
        "(counters, globals, Python random draws) out of its __call__: derive such values "
        "from its inputs, its variables or its PRNG key"
    )


def form(closed: jcore.ClosedJaxpr | jcore.Jaxpr) -> Hashable:
    """A hashable structural form of a jaxpr: equal for two traces of one function (the
    variables numbered in order of appearance, callables and other opaque parameters by
    their type, constants by value), different where a primitive, a parameter, a
    literal, a constant, a type or the wiring differs."""
    if isinstance(closed, jcore.ClosedJaxpr):
        jaxpr, consts = closed.jaxpr, list(closed.consts)
    else:
        jaxpr, consts = closed, []
    numbers: dict[Any, int] = {}

    def name(v: Any) -> Hashable:
        if isinstance(v, jcore.Literal):
            return ("literal", str(v.aval), _param(v.val))
        if v not in numbers:
            numbers[v] = len(numbers)
        return numbers[v]

    head = (
        tuple((name(v), str(v.aval)) for v in jaxpr.constvars),
        tuple(_param(c) for c in consts),
        tuple((name(v), str(v.aval)) for v in jaxpr.invars),
    )
    eqns = []
    for eqn in jaxpr.eqns:
        ins = tuple(name(v) for v in eqn.invars)
        params = tuple(sorted((k, _param(p)) for k, p in eqn.params.items()))
        outs = tuple((name(v), str(v.aval)) for v in eqn.outvars)
        eqns.append((eqn.primitive.name, ins, params, outs))
    return (head, tuple(eqns), tuple(name(v) for v in jaxpr.outvars))


def _param(x: Any) -> Hashable:
    """An equation parameter or constant, in :func:`form`'s terms."""
    if isinstance(x, jcore.ClosedJaxpr | jcore.Jaxpr):
        return ("jaxpr", form(x))
    if isinstance(x, tuple | list):
        return (type(x).__name__, tuple(_param(v) for v in x))
    if isinstance(x, dict):
        return ("dict", tuple(sorted((repr(k), _param(v)) for k, v in x.items())))
    if isinstance(x, jax.core.Tracer):
        return ("tracer", str(x.aval))
    if isinstance(x, np.ndarray | np.generic | jax.Array):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):  # a typed key: its bits
            x = jax.random.key_data(jnp.asarray(x))
        a = np.asarray(x)
        return ("array", str(a.dtype), a.shape, a.tobytes())
    if isinstance(x, bool | int | float | complex | str | bytes | type(None)):
        return (type(x).__name__, repr(x))  # repr: a NaN equals itself
    text = repr(x)
    if callable(x) or " at 0x" in text:  # made anew by every trace: its type only
        return ("opaque", type(x).__module__, type(x).__qualname__)
    return (type(x).__module__, type(x).__qualname__, text)
