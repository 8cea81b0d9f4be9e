"""A whole Flax model cut into pdjax layers at named submodules (:func:`split_model`).

Real models are one ``@nn.compact`` body (or a ``setup`` with submodules): an embedding,
a loop over blocks, a final norm, an output head sharing the embedding (``embed.attend``),
glue between the calls (reshapes, masks, positional encodings). :func:`split_model` turns
such a model into a :class:`SplitLayers` (a :class:`~pdjax.layers.LayerSequence`) whose
layers are contiguous ranges of the model's own computation, and whose variables keep the
model's own tree: :meth:`SplitLayers.model_variables` merges per-layer variables (what
``pipe.variables(state)`` returns) into exactly the tree ``model.init`` builds, so
``model.apply(split.model_variables(pipe.variables(state)), x)`` runs the trained model.

How the model is cut, and why that way. The model's ``apply`` is traced to a jaxpr
(``jax.make_jaxpr``) with its variables, inputs and dropout RNG as the jaxpr's inputs,
while ``flax.linen.intercept_methods`` puts an identity marker equation at the start of
every call of a *split unit* (a submodule at the cut level, e.g. each decoder block). The
equations between two cut markers are one layer. A layer's ``apply`` re-traces the model
for the shapes at hand (cached per shape and mode) and evaluates its own equations only:

* it is exact: the jaxpr *is* the model's computation, in the model's order, so every
  piece of glue (reshapes, adds, masks, positional encodings, the final norm, code in the
  parent of the parent) runs once, in the layer where it falls, on real data. Nothing is
  replayed from a recording, and nothing re-runs the parent's Python body with some calls
  skipped (which would need the skipped calls' outputs from somewhere);
* what crosses a cut is found by data flow: the jaxpr values defined before the cut and
  used after it (the activations, a mask built once at the top, positions...), sent as a
  pytree. Values computed from constants alone (a causal mask from shapes) are recomputed
  where used rather than sent;
* which variables a layer holds is found by data flow too: the parameters its equations
  read. A parameter read in two layers (lm1b's shared embedding: ``embed(x)`` in the first,
  ``embed.attend(y)`` in the last) becomes a ``tied=`` group of
  :class:`~pdjax.layers.LayerSequence`, automatically, so its copies stay one parameter;
* dropout draws from the same ``"dropout"`` stream derivation as the whole model (the
  RNG's uses fall inside the submodules' equations); BatchNorm statistics come back as
  the model's own ``mutable`` outputs.

``intercept_methods`` (rather than a module-graph walk) is used because it sees the calls
as they happen, in order, including a second method (``attend``) of a module and modules
defined inline in a compact body. The re-trace per shape needs the model's input shapes
in every layer: each boundary pytree carries, besides the values, a zero-size float array
per model input (``shape + (0,)``: no bytes) from which the shapes are read.

Train/eval: pdjax layers get ``train=True/False``. A model switches dropout and BatchNorm
by a ``__call__`` argument (``train``, ``deterministic``, ...) or by a field
(``TransformerConfig.deterministic``, ``ResNet.train``); ``mode=`` names them (``{"train":
"train"}``: True in train mode; ``{"config.deterministic": "eval"}``: True in eval mode; a
dotted name reaches into dataclass fields), found automatically by default.

What is refused, before any work: an ``at=`` name that is not a submodule called at one
level (the message lists those that are), cuts out of order or leaving a layer empty,
data-dependent Python control flow, and a non-parameter variable (BatchNorm statistics)
used in two layers, which cannot be tied.

flax ``nnx`` models are not split yet: build their layers from the model's own submodules
with :func:`~pdjax.layers.sequential` (``examples/nnx_model.py``).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.extend.core import Primitive

from pdjax._trees import key_str
from pdjax.errors import LayerError
from pdjax.layers.base import PyTree, Variables
from pdjax.layers.sequence import LayerSequence

__all__ = ["SplitLayer", "SplitLayers", "split_model"]

#: ``__call__`` arguments and fields that switch train/eval, and whether True means eval.
_MODE_NAMES = {
    "train": "train",
    "training": "train",
    "deterministic": "eval",
    "use_running_average": "eval",
}

# -- the marker equation: identity, bound at the start of each split unit's call ---------

_mark_p = Primitive("pdjax_split_mark")
_mark_p.multiple_results = True
_mark_p.def_impl(lambda *xs, **_: list(xs))
_mark_p.def_abstract_eval(lambda *avals, **_: list(avals))


def _marked(values: tuple[Any, ...], unit: str) -> list[Any]:
    return list(_mark_p.bind(*values, unit=unit))


# -- the call structure ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Call:
    path: tuple[str, ...]  # the module's scope path
    method: str
    kind: str  # the module's class name
    depth: int  # how many intercepted calls enclose it


def _record_calls(fn: Callable[..., Any], *args: Any) -> tuple[list[_Call], Any]:
    """Every module method call made by ``fn(*args)`` (abstractly), in order."""
    calls: list[_Call] = []
    depth = [0]

    def interceptor(next_fun: Any, a: Any, kw: Any, context: Any) -> Any:
        module = context.module
        scope = module.scope
        if scope is None or context.method_name in ("setup", "__post_init__"):
            return next_fun(*a, **kw)
        calls.append(_Call(tuple(scope.path), context.method_name, type(module).__name__, depth[0]))
        depth[0] += 1
        try:
            return next_fun(*a, **kw)
        finally:
            depth[0] -= 1

    with nn.intercept_methods(interceptor):
        out = jax.eval_shape(fn, *args)
    return calls, out


def _top_calls(calls: list[_Call], parent: tuple[str, ...]) -> list[_Call]:
    """The calls of ``parent``'s direct children made while no other child's call runs."""
    out = []
    active_depth: int | None = None
    for c in calls:
        if active_depth is not None and c.depth > active_depth:
            continue
        active_depth = None
        if len(c.path) == len(parent) + 1 and c.path[: len(parent)] == parent:
            out.append(c)
            active_depth = c.depth
    return out


def _auto_units(calls: list[_Call]) -> tuple[tuple[str, ...], list[str]]:
    """The parent and its repeated children: of the shallowest parent that calls two or
    more distinct children of one class, the class with the most (the decoder blocks)."""
    best: tuple[int, int, tuple[str, ...], list[str]] | None = None
    parents = sorted({c.path[:-1] for c in calls if c.path}, key=len)
    for parent in parents:
        top = _top_calls(calls, parent)
        by_kind: dict[str, list[str]] = {}
        for c in top:
            names = by_kind.setdefault(c.kind, [])
            if c.path[-1] not in names:
                names.append(c.path[-1])
        for names in by_kind.values():
            if len(names) >= 2 and (best is None or len(names) > best[0]):
                best = (len(names), -len(parent), parent, names)
        if best is not None:
            break  # the shallowest parent with a repeated child class
    if best is None:
        raise LayerError(
            "split_model(at='blocks') found no repeated submodule (two or more of one "
            "class called by one parent); name the cuts: at=['<submodule>', ...] with "
            f"submodules of {_describe(calls)}"
        )
    return best[2], best[3]


def _describe(calls: list[_Call]) -> list[str]:
    seen: list[str] = []
    for c in calls:
        if c.path:
            name = "/".join(c.path)
            if name not in seen:
                seen.append(name)
    return seen


def _resolve_at(calls: list[_Call], at: Sequence[str]) -> tuple[tuple[str, ...], list[str]]:
    """``at`` names as ``(parent path, [child names])``; a name is a path ``"a/b"`` or the
    last part of exactly one submodule's path."""
    known = _describe(calls)
    paths: list[tuple[str, ...]] = []
    for name in at:
        if not isinstance(name, str) or not name:
            raise LayerError(f"at= lists submodule names as strings, got {name!r}")
        hits = [p for p in known if p == name or p.endswith("/" + name)]
        if len(hits) != 1:
            what = "names no submodule" if not hits else f"is ambiguous ({hits})"
            shown = [p for p in known if p.count("/") < 2]
            more = f" and {len(known) - len(shown)} deeper ones" if len(shown) < len(known) else ""
            raise LayerError(
                f"split_model(at=...): {name!r} {what}; the submodules called are {shown}"
                f"{more} (write one, or its path with '/')"
            )
        paths.append(tuple(hits[0].split("/")))
    parents = {p[:-1] for p in paths}
    if len(parents) != 1:
        raise LayerError(
            f"split_model(at={list(at)}): the cuts must be children of one parent module, "
            f"got parents {sorted('/'.join(p) or '<the model>' for p in parents)}"
        )
    return paths[0][:-1], [p[-1] for p in paths]


# -- the train/eval switch --------------------------------------------------------------


def _field_paths(module: nn.Module) -> list[str]:
    """Dotted names of the module's bool fields and its dataclass fields' bool fields."""
    out = []
    for f in dataclasses.fields(module):
        if f.name in ("parent", "name"):
            continue
        value = getattr(module, f.name, None)
        if isinstance(value, bool):
            out.append(f.name)
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            for g in dataclasses.fields(value):
                if isinstance(getattr(value, g.name, None), bool):
                    out.append(f"{f.name}.{g.name}")
    return out


def _call_args(module: nn.Module) -> list[str]:
    try:
        return list(inspect.signature(type(module).__call__).parameters)[1:]
    except (TypeError, ValueError):
        return []


def _resolve_mode(module: nn.Module, mode: Mapping[str, str] | None) -> dict[str, str]:
    fields, args = _field_paths(module), _call_args(module)
    if mode is None:
        found = {}
        for name in fields:
            last = name.rsplit(".", 1)[-1]
            if last in _MODE_NAMES:
                found[name] = _MODE_NAMES[last]
        for name in args:
            if name in _MODE_NAMES:
                found[name] = _MODE_NAMES[name]
        return found
    if not isinstance(mode, Mapping):
        raise LayerError(
            f"mode= maps a field or __call__ argument to 'train' or 'eval' (when it is "
            f"True), e.g. {{'config.deterministic': 'eval'}}; got {mode!r}"
        )
    for name, when in mode.items():
        if when not in ("train", "eval"):
            raise LayerError(
                f"mode[{name!r}] = {when!r}: say when the flag is True, 'train' or 'eval'"
            )
        if name not in fields and name not in args:
            raise LayerError(
                f"mode names {name!r}, which is neither a bool field of "
                f"{type(module).__name__} ({fields}) nor an argument of its __call__ ({args})"
            )
    return dict(mode)


def _with_field(obj: Any, dotted: str, value: bool) -> Any:
    head, _, rest = dotted.partition(".")
    inner = getattr(obj, head)
    new = _with_field(inner, rest, value) if rest else value
    if isinstance(obj, nn.Module):
        changes: dict[str, Any] = {head: new}
        return obj.clone(**changes)
    return dataclasses.replace(obj, **{head: new})


# -- the traced program and its cuts ------------------------------------------------------


def _is_var(atom: Any) -> bool:
    return not hasattr(atom, "val")  # a Literal has .val


def _leaf_path(path: Any) -> tuple[str, ...]:
    return tuple(key_str(k) for k in path)


@dataclasses.dataclass
class _Cut:
    eqns: list[Any]  # what this layer evaluates, in order (constant prefix included)
    inputs: list[Any]  # the jaxpr vars it receives (model inputs for the first)
    outputs: list[Any]  # the jaxpr vars it sends on (model output for the last)
    reads: set[tuple[str, ...]]  # the variable leaves its equations read


@dataclasses.dataclass
class _Program:
    jaxpr: Any
    consts: list[Any]
    var_leaves: list[tuple[tuple[str, ...], Any]]  # (path, jaxpr var) of each variable
    x_vars: list[Any]
    rng_var: Any | None
    y_tree: Any
    y_vars: list[Any]
    state_out: dict[tuple[str, ...], Any]  # variable path -> new value's atom
    cuts: list[_Cut]


def _plan_cuts(
    jaxpr: Any,
    units: list[str],
    n_cuts: int,
    needed_last: list[Any],
    state_out: dict[tuple[str, ...], Any],
    owner_of: Callable[[tuple[str, ...]], int | None],
    var_of: dict[Any, tuple[str, ...]],
    x_vars: list[Any],
) -> list[_Cut]:
    """Splits the equations at the marker of each cut unit's first call."""
    eqns = list(jaxpr.eqns)
    starts = [0]
    seen: set[str] = set()
    for i, e in enumerate(eqns):
        if e.primitive is _mark_p:
            unit = e.params["unit"]
            if unit in units and unit not in seen:
                seen.add(unit)
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
        if e.primitive is _mark_p or e.effects:
            continue
        if all(not _is_var(a) or a in constvars or a in const_def for a in e.invars):
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
            used |= {a for a in e.invars if _is_var(a)}
        used_in.append(used)
    used_in[-1] |= {a for a in needed_last if _is_var(a)}
    for path, atom in state_out.items():
        owner = owner_of(path)
        if _is_var(atom) and owner is not None:
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
            stack += [a for a in eqns[i].invars if _is_var(a) and a in const_def]
        body = [eqns[i] for i in sorted(prefix)] + own
        reads = {var_of[a] for e in body for a in e.invars if _is_var(a) and a in var_of}
        reads |= {var_of[a] for a in used_in[k] if a in var_of}
        cuts.append(_Cut(body, [], [], reads))
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


class SplitLayer:
    """One cut of a :func:`split_model` model: the model's equations from one cut
    submodule's first call to the next's (see the module docstring). Its input is the
    model's input (first layer) or the previous cut's boundary pytree, its output the next
    boundary or the model's output (last layer)."""

    def __init__(self, owner: _Splitter, index: int, name: str) -> None:
        self._owner = owner
        self.index = index
        self.name = name
        #: what profiles and tables call the layer's kind
        self.kind = "split"

    def __repr__(self) -> str:
        return f"SplitLayer(name={self.name!r})"

    def init(self, rng: jax.Array, x: PyTree) -> Variables:
        """This layer's share of ``model.init`` for the model input that ``x`` implies."""
        return self._owner.init_cut(self.index, rng, x)

    def apply(
        self,
        variables: Variables,
        x: PyTree,
        *,
        train: bool = False,
        rng: jax.Array | None = None,
    ) -> tuple[PyTree, Variables]:
        """Evaluates this cut's equations; returns the output and the non-parameter
        collections after the call."""
        return self._owner.apply_cut(self.index, variables, x, train, rng)


class _Splitter:
    """The traced model shared by the layers of one :func:`split_model`."""

    def __init__(
        self, module: nn.Module, sample: PyTree, at: Any, mode: Mapping[str, str] | None
    ) -> None:
        self.module = module
        self.mode = _resolve_mode(module, mode)
        self.x_tree = jax.tree.structure(sample)
        self.x_dtypes = [jnp.asarray(a).dtype for a in jax.tree.leaves(sample)]
        x_spec = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.asarray(a).dtype), sample
        )
        self._cache: dict[Any, _Program] = {}
        key = jax.random.key(0)
        try:
            self.var_spec = jax.eval_shape(
                lambda k, x: self._module(False).init(
                    {"params": k, "dropout": k}, x, **self._kwargs(False)
                ),
                key,
                x_spec,
            )
            calls, _ = _record_calls(
                lambda v, x, r: self._call(v, x, False, r, None), self.var_spec, x_spec, key
            )
        except (
            jax.errors.ConcretizationTypeError,
            jax.errors.TracerBoolConversionError,
            jax.errors.TracerIntegerConversionError,
        ) as e:
            raise _control_flow_error(e) from e
        if at is None or at == "blocks":
            self.parent, units = _auto_units(calls)
        elif isinstance(at, str):
            raise LayerError(
                f"at={at!r}: give 'blocks' (cut before each repeated block) or a list of "
                "submodule names, e.g. at=['blocks_2']"
            )
        else:
            self.parent, units = _resolve_at(calls, list(at))
        top = _top_calls(calls, self.parent)
        first_call: dict[str, int] = {}
        for n, c in enumerate(top):
            first_call.setdefault(c.path[-1], n)
        positions = [first_call[u] for u in units]
        if len(set(units)) != len(units) or positions != sorted(positions):
            raise LayerError(
                f"split_model(at={units}): each cut once, in the order the model calls "
                f"them ({[c.path[-1] for c in top]})"
            )
        if at is None or at == "blocks":
            if positions and positions[0] == 0:
                units, positions = units[1:], positions[1:]
        elif positions and positions[0] == 0:
            raise LayerError(
                f"split_model: the cut {units[0]!r} is the model's first submodule call, "
                f"so the layer before it would be empty; drop it from at= ({units})"
            )
        if not units:
            raise LayerError("split_model: no cut left; the model would be one layer")
        self.units = units
        self.names = ["00_" + (top[0].path[-1] if top else "start")] + [
            f"{k + 1:02d}_{u}" for k, u in enumerate(units)
        ]
        self.parent_calls = [c.path[-1] for c in top]
        # variable ownership by data flow, from an eval and a train trace of the sample
        leaves = [_leaf_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(self.var_spec)[0]]
        readers: dict[tuple[str, ...], set[int]] = {p: set() for p in leaves}
        for train in (False, True):
            prog = self._program(x_spec, train, jax.ShapeDtypeStruct((), key.dtype), owner=None)
            for k, cut in enumerate(prog.cuts):
                for p in cut.reads:
                    readers[p].add(k)
        self.owners: dict[tuple[str, ...], tuple[int, ...]] = {}
        tied: dict[str, list[str]] = {}
        for p in leaves:
            ks = tuple(sorted(readers[p])) or (0,)
            self.owners[p] = ks
            if len(ks) > 1:
                coll, rest = p[0], "/".join(p[1:])
                if coll != "params":
                    raise LayerError(
                        f"split_model: {rest!r} (collection {coll!r}) is used in layers "
                        f"{[self.names[k] for k in ks]}; a non-parameter variable (BatchNorm "
                        "statistics) cannot be tied across layers: cut so that its uses "
                        "fall in one layer (move or drop a cut in at=)"
                    )
                tied[rest] = [f"{self.names[k]}/{rest}" for k in ks]
        self.tied = tied
        self._cache.clear()  # traced before ownership was known

    # the mode -> module and call arguments
    def _module(self, train: bool) -> nn.Module:
        module = self.module
        fields = set(_field_paths(module))
        for name, when in self.mode.items():
            if name in fields:
                module = _with_field(module, name, train if when == "train" else not train)
        return module

    def _kwargs(self, train: bool) -> dict[str, Any]:
        fields = set(_field_paths(self.module))
        return {
            name: (train if when == "train" else not train)
            for name, when in self.mode.items()
            if name not in fields
        }

    def _call(self, variables: Any, x: Any, train: bool, rng: Any, mutable: Any) -> Any:
        rngs = {"dropout": rng} if rng is not None else {}
        module, kwargs = self._module(train), self._kwargs(train)
        if mutable:
            return module.apply(variables, x, rngs=rngs, mutable=mutable, **kwargs)
        return module.apply(variables, x, rngs=rngs, **kwargs), {}

    def _program(self, x_spec: Any, train: bool, rng_spec: Any, owner: Any = True) -> _Program:
        key = (
            jax.tree.structure(x_spec),
            tuple((a.shape, str(a.dtype)) for a in jax.tree.leaves(x_spec)),
            train,
            None if rng_spec is None else str(rng_spec.dtype),
        )
        if key in self._cache:
            return self._cache[key]
        mutable = [c for c in self.var_spec if c != "params"] if train else []
        parent = self.parent
        depth = [0]

        def interceptor(next_fun: Any, a: Any, kw: Any, context: Any) -> Any:
            scope = context.module.scope
            if scope is None or context.method_name in ("setup", "__post_init__"):
                return next_fun(*a, **kw)
            path = tuple(scope.path)
            mine = len(path) == len(parent) + 1 and path[:-1] == parent and depth[0] == 0
            if mine:
                leaves, tree = jax.tree.flatten((a, kw))
                arrays = [n for n, v in enumerate(leaves) if isinstance(v, jax.Array)]
                if not arrays:
                    _marked((jnp.zeros((), jnp.float32),), path[-1])
                else:
                    new = _marked(tuple(leaves[n] for n in arrays), path[-1])
                    for n, v in zip(arrays, new, strict=True):
                        leaves[n] = v
                    a, kw = jax.tree.unflatten(tree, leaves)
                depth[0] += 1
            try:
                return next_fun(*a, **kw)
            finally:
                if mine:
                    depth[0] -= 1

        def fn(variables: Any, x: Any, rng: Any) -> Any:
            with nn.intercept_methods(interceptor):
                return self._call(variables, x, train, rng, mutable)

        try:
            closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(
                self.var_spec, x_spec, rng_spec
            )
        except (
            jax.errors.ConcretizationTypeError,
            jax.errors.TracerBoolConversionError,
            jax.errors.TracerIntegerConversionError,
        ) as e:
            raise _control_flow_error(e) from e
        except Exception as e:
            if "rng" in str(e).lower() and rng_spec is None:
                which = "train" if train else "eval"
                raise LayerError(
                    f"split_model: {type(self.module).__name__} needs a PRNG in {which} mode "
                    f"(dropout?) and the layer was given none: pass rng=jax.random.key(...) "
                    f"(pipelines do in training), or run it in eval mode; pdjax switches the "
                    f"mode through "
                    f"{self.mode or 'nothing (no train/deterministic field or argument found)'}"
                    ": name the field or argument with split_model(..., mode={'config."
                    "deterministic': 'eval'}) or mode={'train': 'train'}, or mode={} to "
                    "leave the model as it is"
                ) from e
            raise
        jaxpr = closed.jaxpr
        n_var = len(jax.tree.leaves(self.var_spec))
        n_x = len(jax.tree.leaves(x_spec))
        var_paths = [
            _leaf_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(self.var_spec)[0]
        ]
        var_vars = list(jaxpr.invars[:n_var])
        x_vars = list(jaxpr.invars[n_var : n_var + n_x])
        rng_var = jaxpr.invars[n_var + n_x] if rng_spec is not None else None
        y_shape, state_shape = out_shape
        n_y = len(jax.tree.leaves(y_shape))
        y_vars = list(jaxpr.outvars[:n_y])
        state_paths = [
            _leaf_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(state_shape)[0]
        ]
        state_out = dict(zip(state_paths, jaxpr.outvars[n_y:], strict=True))
        var_of = dict(zip(var_vars, var_paths, strict=True))
        if owner is None:

            def owner_of(p: tuple[str, ...]) -> int | None:
                return None  # ownership unknown yet
        else:

            def owner_of(p: tuple[str, ...]) -> int | None:
                return self.owners[p][-1]

        cuts = _plan_cuts(
            jaxpr, self.units, len(self.units) + 1, y_vars, state_out, owner_of, var_of, x_vars
        )
        prog = _Program(
            jaxpr,
            list(closed.consts),
            list(zip(var_paths, var_vars, strict=True)),
            x_vars,
            rng_var,
            jax.tree.structure(y_shape),
            y_vars,
            state_out,
            cuts,
        )
        self._cache[key] = prog
        return prog

    # the layers' work
    def _x_spec(self, k: int, x: PyTree) -> Any:
        if k == 0:
            return jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), a.dtype), x)
        shapes = [jnp.shape(w)[:-1] for w in x["inputs"]]
        return jax.tree.unflatten(
            self.x_tree,
            [jax.ShapeDtypeStruct(s, d) for s, d in zip(shapes, self.x_dtypes, strict=True)],
        )

    def _sample_input(self, k: int, x: PyTree) -> Any:
        spec = self._x_spec(k, x)
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), spec)

    def init_cut(self, k: int, rng: jax.Array, x: PyTree) -> Variables:
        params_key, dropout_key = jax.random.split(rng)
        full = self._module(False).init(
            {"params": params_key, "dropout": dropout_key},
            self._sample_input(k, x),
            **self._kwargs(False),
        )
        return self._subset(k, full)

    def _subset(self, k: int, tree: Any) -> Variables:
        out: dict[str, Any] = {}
        for path, leaf in jax.tree_util.tree_flatten_with_path(dict(tree))[0]:
            p = _leaf_path(path)
            if k in self.owners.get(p, (0,)):
                node = out
                for part in p[:-1]:
                    node = node.setdefault(part, {})
                node[p[-1]] = leaf
        return out

    def apply_cut(
        self, k: int, variables: Variables, x: PyTree, train: bool, rng: jax.Array | None
    ) -> tuple[PyTree, Variables]:
        x_spec = self._x_spec(k, x)
        rng_spec = None if rng is None else jax.ShapeDtypeStruct(jnp.shape(rng), rng.dtype)
        prog = self._program(x_spec, train, rng_spec)
        cut = prog.cuts[k]
        env: dict[Any, Any] = dict(zip(prog.jaxpr.constvars, prog.consts, strict=True))
        flat = {_leaf_path(p): v for p, v in jax.tree_util.tree_flatten_with_path(variables)[0]}
        for path, var in prog.var_leaves:
            if path in flat:
                env[var] = flat[path]
        if prog.rng_var is not None:
            env[prog.rng_var] = rng
        values = jax.tree.leaves(x) if k == 0 else list(x["live"])
        if len(values) != len(cut.inputs):
            raise LayerError(
                f"layer {self._name(k)!r} got {len(values)} values, expected {len(cut.inputs)}"
            )
        env.update(zip(cut.inputs, values, strict=True))

        def read(a: Any) -> Any:
            if not _is_var(a):
                return a.val
            if a not in env:
                raise LayerError(
                    f"layer {self._name(k)!r} reads a value it does not hold (a variable of "
                    "another layer?); this is a bug in split_model"
                )
            return env[a]

        for e in cut.eqns:
            args = [read(a) for a in e.invars]
            if e.primitive is _mark_p:
                outs = args
            else:
                with e.ctx.manager:
                    outs = e.primitive.bind(*args, **e.primitive.get_bind_params(e.params))
                if not e.primitive.multiple_results:
                    outs = [outs]
            env.update(zip(e.outvars, outs, strict=True))
        last = k == len(self.units)
        if last:
            y = jax.tree.unflatten(prog.y_tree, [read(a) for a in cut.outputs])
        else:
            witness = [jnp.zeros((*s.shape, 0), jnp.float32) for s in jax.tree.leaves(x_spec)]
            y = {"live": tuple(read(a) for a in cut.outputs), "inputs": witness}
        state = {c: v for c, v in variables.items() if c != "params"}
        if train and state:
            updates = {p: read(a) for p, a in prog.state_out.items() if p in flat}
            state = _replace_leaves(state, updates)
        return y, state

    def _name(self, k: int) -> str:
        return self.names[k]


def _replace_leaves(state: Variables, updates: Mapping[tuple[str, ...], Any]) -> Variables:
    def walk(node: Any, prefix: tuple[str, ...]) -> Any:
        if isinstance(node, Mapping):
            return {key: walk(v, (*prefix, str(key))) for key, v in node.items()}
        return updates.get(prefix, node)

    return {c: walk(v, (c,)) for c, v in state.items()}


def _control_flow_error(e: Exception) -> LayerError:
    return LayerError(
        "split_model: the model's Python control flow depends on the data (an if or loop "
        "on an array value), which a split cannot follow; write it with jnp.where, "
        f"jax.lax.cond or jax.lax.fori_loop, or compute it from shapes ({type(e).__name__})"
    )


@dataclasses.dataclass(frozen=True)
class SplitLayers(LayerSequence):
    """The :class:`~pdjax.layers.LayerSequence` of a :func:`split_model` model, with the
    way back to the model's own variable tree.

    Attributes:
      splitter: the traced model its layers share (internal).
    """

    splitter: Any = None

    def model_variables(
        self, variables: Sequence[Variables], *, device: jax.Device | None = None
    ) -> dict[str, Any]:
        """Per-layer variables (``pipe.variables(state)``, ``layers.init(...)``) -> the
        model's own tree, exactly the structure ``model.init`` builds (a tied copy is
        taken from the first layer holding it), on one ``device`` (default: the first),
        for ``model.apply(tree, x)``."""
        if len(variables) != len(self.layers):
            raise LayerError(
                f"got variables for {len(variables)} layers, the split has {len(self.layers)}"
            )
        flat: dict[tuple[str, ...], Any] = {}
        for v in variables:
            for path, leaf in jax.tree_util.tree_flatten_with_path(dict(v))[0]:
                flat.setdefault(_leaf_path(path), leaf)
        paths = [
            _leaf_path(p)
            for p, _ in jax.tree_util.tree_flatten_with_path(self.splitter.var_spec)[0]
        ]
        missing = [p for p in paths if p not in flat]
        if missing:
            raise LayerError(f"the layers' variables lack {['/'.join(p) for p in missing[:5]]}")
        tree: dict[str, Any] = jax.tree.unflatten(
            jax.tree.structure(self.splitter.var_spec), [flat[p] for p in paths]
        )
        on: dict[str, Any] = jax.device_put(tree, device or jax.devices()[0])
        return on

    def layer_variables(self, tree: Mapping[str, Any]) -> list[Variables]:
        """The inverse of :meth:`model_variables`: the model's tree (``model.init(...)``)
        as per-layer variables, a tied parameter copied to each layer holding it."""
        return [self.splitter._subset(k, tree) for k in range(len(self.layers))]


def split_model(
    model: nn.Module,
    sample: PyTree,
    *,
    at: str | Sequence[str] | None = "blocks",
    mode: Mapping[str, str] | None = None,
) -> SplitLayers:
    """Cuts a whole ``flax.linen`` model into pdjax layers at submodule calls.

    Args:
      model: the model, unbound (``TransformerLM(config)``, ``ResNet(...)``).
      sample: one input batch (arrays, or a pytree of them), as ``model.apply`` takes it;
        only its shapes and dtypes are used.
      at: where the layers start: ``"blocks"`` (default) cuts before each repeated
        block: the shallowest module that calls two or more submodules of one class, and
        of those the most numerous class (the decoder blocks, wherever they sit); or a list
        of submodule names (``["encoderdecoderblock_2", ...]``, or paths
        ``"decoder/encoderdecoderblock_2"``), children of one parent module, in call
        order. Glue between calls (masks, reshapes, positional encodings, the final norm)
        runs in the layer where it falls; the first layer holds everything before the
        first cut.
      mode: how train/eval reaches the model: a bool field (a dotted name reaches into a
        dataclass field: ``"config.deterministic"``) or a ``__call__`` argument, mapped to
        ``"train"`` (True in train mode) or ``"eval"`` (True in eval mode). Default: every
        field or argument named ``train``, ``training`` (``"train"``), ``deterministic``
        or ``use_running_average`` (``"eval"``). ``{}``: the model is left as it is.

    Returns:
      A :class:`SplitLayers` (a :class:`~pdjax.layers.LayerSequence`) for
      ``pdjax.Pipeline`` and ``pdjax.profile``; a parameter read in two layers (a shared
      embedding) is tied, and :meth:`SplitLayers.model_variables` merges the layers'
      variables into the model's own tree.

    Raises:
      LayerError: for a cut name that no submodule has (the message lists those called),
        cuts of different parents, out of order or leaving a layer empty, data-dependent
        Python control flow, a non-parameter variable used in two layers, or a ``mode``
        naming no field or argument.

    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> class MLP(nn.Module):
    ...     @nn.compact
    ...     def __call__(self, x):
    ...         for i in range(3):
    ...             x = nn.relu(nn.Dense(4, name=f"dense_{i}")(x)) + 1.0
    ...         return x
    >>> layers = split_model(MLP(), jnp.ones((2, 4)), at=["dense_1"])
    >>> layers.names
    ('00_dense_0', '01_dense_1')
    >>> v = layers.init(jax.random.key(0), jnp.ones((2, 4)))
    >>> y, _ = layers.apply(v, jnp.ones((2, 4)))
    >>> bool(jnp.allclose(y, MLP().apply(layers.model_variables(v), jnp.ones((2, 4)))))
    True
    """
    if isinstance(model, type):
        raise LayerError(f"split_model needs a module instance, {model.__name__}(...)")
    if not isinstance(model, nn.Module):
        raise LayerError(
            f"split_model splits a flax.linen Module, got {type(model).__name__}; for an nnx "
            "model build the layers from its submodules with pdjax.sequential(model.embed, "
            "*model.blocks, model.head, tied=...)"
        )
    splitter = _Splitter(model, sample, at, mode)
    layers = tuple(SplitLayer(splitter, k, name) for k, name in enumerate(splitter.names))
    return SplitLayers(layers, tuple((g, tuple(v)) for g, v in splitter.tied.items()), splitter)
