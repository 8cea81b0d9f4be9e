"""The traced model's jaxpr cut into layers (:func:`~pdjax.layers.split_model`): which
equations each layer evaluates (constants recomputed where used), which values cross each
boundary and which variable leaves each layer reads, all by data flow from the markers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr, Jaxpr

from pdjax._trees import key_str
from pdjax.errors import LayerError
from pdjax.layers.base import PyTree, Variables
from pdjax.layers.split.calls import MARK, PARENT, transform_hint

__all__ = [
    "Cut",
    "Program",
    "evaluate_cut",
    "input_spec",
    "is_var",
    "leaf_path",
    "nested_marks",
    "owners_and_ties",
    "plan_cuts",
    "replace_leaves",
    "run_cut",
]


# -- the traced program and its cuts ------------------------------------------------------


def is_var(atom: Any) -> bool:
    return not hasattr(atom, "val")  # a Literal has .val


def leaf_path(path: Any) -> tuple[str, ...]:
    return tuple(key_str(k) for k in path)


def _jaxprs_in(value: Any) -> list[Any]:
    if isinstance(value, ClosedJaxpr):
        return [value.jaxpr]
    if isinstance(value, Jaxpr):
        return [value]
    if isinstance(value, (tuple, list)):
        return [j for v in value for j in _jaxprs_in(v)]
    return []


def nested_marks(eqn: Any) -> list[str]:
    """The units of the markers inside an equation's bodies (a scan's, a remat's, a
    cond's branches), in order, at any depth."""
    out: list[str] = []
    for value in eqn.params.values():
        for jaxpr in _jaxprs_in(value):
            for e in jaxpr.eqns:
                if e.primitive is MARK:
                    out.append(e.params["unit"])
                else:
                    out += nested_marks(e)
    return out


@dataclasses.dataclass
class Cut:
    eqns: list[Any]  # what this layer evaluates, in order (constant prefix included)
    inputs: list[Any]  # the jaxpr vars it receives (model inputs for the first)
    outputs: list[Any]  # the jaxpr vars it sends on (model output for the last)
    reads: set[tuple[str, ...]]  # the variable leaves its equations read


@dataclasses.dataclass
class Program:
    jaxpr: Any
    consts: list[Any]
    var_leaves: list[tuple[tuple[str, ...], Any]]  # (path, jaxpr var) of each variable
    x_vars: list[Any]
    rng_var: Any | None
    y_tree: Any
    y_vars: list[Any]
    state_out: dict[tuple[str, ...], Any]  # variable path -> new value's atom
    cuts: list[Cut]


def plan_cuts(
    jaxpr: Any,
    units: list[str],
    n_cuts: int,
    needed_last: list[Any],
    state_out: dict[tuple[str, ...], Any],
    owner_of: Callable[[tuple[str, ...]], int | None],
    var_of: dict[Any, tuple[str, ...]],
    x_vars: list[Any],
    free: frozenset[Any] = frozenset(),
) -> list[Cut]:
    """Splits the equations at the marker of each cut unit's first call. ``free`` are
    jaxpr inputs every layer holds (an nnx model's RNG): what is computed from them and
    constants alone is recomputed where used, like a constant."""
    eqns = list(jaxpr.eqns)
    starts = [0]
    seen: set[str] = set()
    for i, e in enumerate(eqns):
        if e.primitive is MARK:
            unit = e.params["unit"]
            if unit in units and unit not in seen:
                seen.add(unit)
                starts.append(i)
            continue
        inner = nested_marks(e)
        first = [u for u in inner if u in units and u not in seen]
        if not first:
            continue
        # a cut called inside a transform's body (nn.remat, nn.scan, jax.lax.cond): the
        # layer starts at that equation if the body holds that cut's call alone
        others = sorted({u for u in inner if u != first[0]})
        if others:
            what = ["the call of the cuts' parent" if u == PARENT else repr(u) for u in others]
            raise LayerError(
                f"split_model: the cut {first[0]!r} is called inside a "
                f"{e.primitive.name!r} equation of the model's program together with "
                f"{', '.join(what)}; {transform_hint(e.primitive.name)}"
            )
        seen.add(first[0])
        starts.append(i)
    if len(starts) != n_cuts:
        missing = [u for u in units if u not in seen]
        raise LayerError(
            f"split_model: the cut submodules {missing} are not called at the top level of "
            "the model's program for these shapes (inside nn.scan, nn.jit, jax.lax.cond or "
            "another transform?); cut at submodules the model calls directly"
        )
    bounds = [*starts, len(eqns)]
    # constants: computed from literals and constvars only; recomputed where used
    const_def: dict[Any, int] = {}
    constvars = set(jaxpr.constvars)
    for i, e in enumerate(eqns):
        if e.primitive is MARK or e.effects:
            continue
        if all(not is_var(a) or a in constvars or a in const_def or a in free for a in e.invars):
            for o in e.outvars:
                const_def[o] = i
    defined_in: dict[Any, int] = {v: 0 for v in x_vars}
    for k in range(n_cuts):
        for e in eqns[bounds[k] : bounds[k + 1]]:
            for o in e.outvars:
                defined_in[o] = k
    used_in: list[set[Any]] = []
    for k in range(n_cuts):
        used: set[Any] = set()
        for e in eqns[bounds[k] : bounds[k + 1]]:
            used |= {a for a in e.invars if is_var(a)}
        used_in.append(used)
    used_in[-1] |= {a for a in needed_last if is_var(a)}
    for path, atom in state_out.items():
        owner = owner_of(path)
        if is_var(atom) and owner is not None:
            used_in[owner].add(atom)
    cuts = []
    for k in range(n_cuts):
        own = eqns[bounds[k] : bounds[k + 1]]
        # constants used here but defined elsewhere: prepend their defining equations
        need = [v for v in used_in[k] if v in const_def and defined_in.get(v) != k]
        prefix: set[int] = set()
        stack = list(need)
        while stack:
            v = stack.pop()
            i = const_def[v]
            if i in prefix:
                continue
            prefix.add(i)
            stack += [a for a in eqns[i].invars if is_var(a) and a in const_def]
        body = [eqns[i] for i in sorted(prefix)] + own
        reads = {var_of[a] for e in body for a in e.invars if is_var(a) and a in var_of}
        reads |= {var_of[a] for a in used_in[k] if a in var_of}
        cuts.append(Cut(body, [], [], reads))
    # what crosses each boundary: defined at or before it, used after it, not a constant
    order = {v: n for n, v in enumerate(x_vars)}
    for e in eqns:
        for o in e.outvars:
            order.setdefault(o, len(order))
    for k in range(n_cuts - 1):
        later = set().union(*used_in[k + 1 :])
        live = [v for v in later if v in defined_in and defined_in[v] <= k and v not in const_def]
        live.sort(key=order.__getitem__)
        cuts[k].outputs = live
        cuts[k + 1].inputs = live
    cuts[0].inputs = list(x_vars)
    cuts[-1].outputs = list(needed_last)
    return cuts


def replace_leaves(state: Variables, updates: Mapping[tuple[str, ...], Any]) -> Variables:
    def walk(node: Any, prefix: tuple[str, ...]) -> Any:
        if isinstance(node, Mapping):
            return {key: walk(v, (*prefix, str(key))) for key, v in node.items()}
        return updates.get(prefix, node)

    return {c: walk(v, (c,)) for c, v in state.items()}


def evaluate_cut(cut: Cut, env: dict[Any, Any], name: str) -> Callable[[Any], Any]:
    """Evaluates ``cut``'s equations on ``env`` (jaxpr var -> value: constants, the
    variables, the inputs, the RNG), adding their outputs; returns the reader of an atom."""

    def read(a: Any) -> Any:
        if not is_var(a):
            return a.val
        if a not in env:
            raise LayerError(
                f"layer {name!r} reads a value it does not hold (a variable of "
                "another layer?); this is a bug in split_model"
            )
        return env[a]

    for e in cut.eqns:
        args = [read(a) for a in e.invars]
        if e.primitive is MARK:
            outs = args
        else:
            with e.ctx.manager:
                outs = e.primitive.bind(*args, **e.primitive.get_bind_params(e.params))
            if not e.primitive.multiple_results:
                outs = [outs]
        env.update(zip(e.outvars, outs, strict=True))
    return read


def input_spec(k: int, x: PyTree, x_tree: Any, x_dtypes: Sequence[Any]) -> Any:
    """The model input's shapes and dtypes as layer ``k`` sees them: ``x`` itself at the
    first layer, else read from the zero-size witnesses that cross every boundary (one per
    model input, its shape plus a trailing 0) with the model's input tree and dtypes."""
    if k == 0:
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), a.dtype), x)
    shapes = [jnp.shape(w)[:-1] for w in x["inputs"]]
    return jax.tree.unflatten(
        x_tree, [jax.ShapeDtypeStruct(s, d) for s, d in zip(shapes, x_dtypes, strict=True)]
    )


def run_cut(
    prog: Program,
    k: int,
    name: str,
    variables: Variables,
    x: PyTree,
    x_spec: Any,
    train: bool,
    rng: jax.Array | None,
) -> tuple[PyTree, Variables]:
    """Layer ``k`` (called ``name``) of ``prog`` on its variables and input: its output
    (the model's output at the last cut, else the values crossing the boundary and the
    input witnesses) and its non-parameter collections (updated in train mode)."""
    cut = prog.cuts[k]
    env: dict[Any, Any] = dict(zip(prog.jaxpr.constvars, prog.consts, strict=True))
    flat = {leaf_path(p): v for p, v in jax.tree_util.tree_flatten_with_path(variables)[0]}
    for path, var in prog.var_leaves:
        if path in flat:
            env[var] = flat[path]
    if prog.rng_var is not None:
        env[prog.rng_var] = rng
    values = jax.tree.leaves(x) if k == 0 else list(x["live"])
    if len(values) != len(cut.inputs):
        raise LayerError(f"layer {name!r} got {len(values)} values, expected {len(cut.inputs)}")
    env.update(zip(cut.inputs, values, strict=True))
    read = evaluate_cut(cut, env, name)
    if k == len(prog.cuts) - 1:
        y = jax.tree.unflatten(prog.y_tree, [read(a) for a in cut.outputs])
    else:
        witness = [jnp.zeros((*s.shape, 0), jnp.float32) for s in jax.tree.leaves(x_spec)]
        y = {"live": tuple(read(a) for a in cut.outputs), "inputs": witness}
    state = {c: v for c, v in variables.items() if c != "params"}
    if train and state:
        updates = {p: read(a) for p, a in prog.state_out.items() if p in flat}
        state = replace_leaves(state, updates)
    return y, state


def owners_and_ties(
    readers: Mapping[tuple[str, ...], set[int]], names: Sequence[str]
) -> tuple[dict[tuple[str, ...], tuple[int, ...]], dict[str, list[str]]]:
    """Per variable leaf, the layers that hold it (those whose equations read it; the first
    layer when none does), and the ``tied=`` groups of the parameters held by several.

    Raises:
      LayerError: for a non-parameter variable (BatchNorm statistics) read by two layers.
    """
    owners: dict[tuple[str, ...], tuple[int, ...]] = {}
    tied: dict[str, list[str]] = {}
    for p, ks_set in readers.items():
        ks = tuple(sorted(ks_set)) or (0,)
        owners[p] = ks
        if len(ks) > 1:
            coll, rest = p[0], "/".join(p[1:])
            if coll != "params":
                raise LayerError(
                    f"split_model: {rest!r} (collection {coll!r}) is used in layers "
                    f"{[names[k] for k in ks]}; a non-parameter variable (BatchNorm "
                    "statistics) cannot be tied across layers: cut so that its uses "
                    "fall in one layer (move or drop a cut in at=)"
                )
            tied[rest] = [f"{names[k]}/{rest}" for k in ks]
    return owners, tied
