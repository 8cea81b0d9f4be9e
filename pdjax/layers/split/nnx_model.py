"""The traced ``flax.nnx`` model that the layers of one :func:`~pdjax.layers.split_model`
share (:class:`NnxSplitter`).

An nnx model is traced as a pure function of its state: ``nnx.merge`` of the model's
graph with the variables given, the call, ``nnx.split`` of the state after it. The split
units are the children of one called module (the model, or a module inside it): a
module's children are the called modules it reaches without passing through another
(``self.embed``, each of ``self.blocks``, ``self.head``; containers are looked through),
named by their path (``"blocks/1"``, ``"decoder/blocks/1"``). While the model is traced,
the ``__call__`` of its modules' classes is wrapped: a first trace records every call
(path, class, nesting), from which the cuts are chosen as for linen; the program's trace
binds the marker equation at each call of the parent's children made while no other such
call runs. The classes are restored after each trace.

Variables are the model's ``nnx.State`` leaves but its RNG streams (``nnx.RngKey``,
``nnx.RngCount``): ``nnx.Param`` in ``"params"``, ``nnx.BatchStat`` in ``"batch_stats"``,
any other in ``"state"``, each under its path. The RNG streams are no variable of any
layer: with a layer's ``rng`` given, every stream of the model is reseeded from it at the
start of the trace (as :class:`~pdjax.layers.NnxLayer` does), and what derives from the RNG
alone (the dropout keys and masks) is recomputed in the layer where it is used, from that
layer's ``rng``; without ``rng`` the streams are the model's as they were when split,
held as constants (they do not advance).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from pdjax.errors import LayerError
from pdjax.layers.base import PyTree, Variables
from pdjax.layers.split.calls import (
    MODE_NAMES,
    PARENT,
    Call,
    Nesting,
    axis_names_of,
    choose_units,
    control_flow_error,
    input_form,
    mark_call,
    on_named_axes,
    unit_name,
)
from pdjax.layers.split.cuts import (
    Program,
    input_spec,
    owners_and_ties,
    plan_cuts,
    run_cut,
)

__all__ = ["NnxSplitter", "collection_of", "module_paths", "patched_calls"]


def collection_of(variable: Any) -> str:
    """The collection pdjax files an nnx variable under."""
    if isinstance(variable, nnx.Param):
        return "params"
    if isinstance(variable, nnx.BatchStat):
        return "batch_stats"
    return "state"


def callable_module(node: nnx.Module) -> bool:
    """Whether a module is called (has a ``__call__``); containers (``nnx.List``,
    ``nnx.Dict``) and holders of modules without one are looked through."""
    if isinstance(node, (nnx.List, nnx.Dict)):
        return False
    return any("__call__" in c.__dict__ for c in type(node).__mro__ if c is not object)


def module_paths(model: nnx.Module) -> dict[int, tuple[str, ...]]:
    """The model's called modules (its own excepted) by ``id``: their path in its graph
    (``("blocks", "1")``; containers are path parts, not modules)."""
    paths: dict[int, tuple[str, ...]] = {}
    for path, node in nnx.iter_graph(model):
        if path and isinstance(node, nnx.Module) and callable_module(node):
            paths.setdefault(id(node), tuple(map(str, path)))
    return paths


def parent_finder(paths: Iterable[tuple[str, ...]]) -> Callable[[tuple[str, ...]], tuple[str, ...]]:
    """A called module's parent: the nearest called module above it (``()``: the model)."""
    known = set(paths)

    def parent_of(path: tuple[str, ...]) -> tuple[str, ...]:
        for n in range(len(path) - 1, 0, -1):
            if path[:n] in known:
                return path[:n]
        return ()

    return parent_of


#: ``on_call(path, module, call, args, kwargs)``: runs a module's call (``call(*a, **kw)``)
OnCall = Callable[[tuple[str, ...], Any, Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any]


@contextlib.contextmanager
def patched_calls(model: nnx.Module, on_call: OnCall) -> Iterator[None]:
    """Within: each call of one of the model's called modules goes through ``on_call``
    (once per call: a ``super().__call__`` of the same module runs plainly). The classes
    defining those modules' ``__call__`` are patched, and restored after."""
    paths = module_paths(model)
    defining: dict[type, Any] = {}
    for _, node in nnx.iter_graph(model):
        if id(node) in paths:
            cls = next(c for c in type(node).__mro__ if "__call__" in c.__dict__)
            defining.setdefault(cls, cls.__dict__["__call__"])
    active: set[int] = set()

    def wrap(original: Any) -> Any:
        def call(module: Any, *a: Any, **kw: Any) -> Any:
            path = paths.get(id(module))
            if path is None or id(module) in active:
                return original(module, *a, **kw)
            active.add(id(module))
            try:
                return on_call(path, module, lambda *a2, **kw2: original(module, *a2, **kw2), a, kw)
            finally:
                active.discard(id(module))

        return call

    try:
        for cls, original in defining.items():
            cls.__call__ = wrap(original)  # type: ignore[method-assign]
        yield
    finally:
        for cls, original in defining.items():
            cls.__call__ = original  # type: ignore[method-assign]


def resolve_nnx_mode(
    model: nnx.Module, mode: Mapping[str, str] | None, given: Sequence[str] = ()
) -> dict[str, str]:
    """``mode=`` for an nnx model: the ``__call__`` arguments that switch train/eval
    (``given``: arguments the user passes, never found)."""
    try:
        args = list(inspect.signature(type(model).__call__).parameters)[1:]
    except (TypeError, ValueError):
        args = []
    if mode is None:
        return {a: MODE_NAMES[a] for a in args if a in MODE_NAMES and a not in given}
    if not isinstance(mode, Mapping):
        raise LayerError(
            f"mode= maps a __call__ argument to 'train' or 'eval' (when it is True), e.g. "
            f"{{'deterministic': 'eval'}}; got {mode!r}"
        )
    for name, when in mode.items():
        if when not in ("train", "eval"):
            raise LayerError(
                f"mode[{name!r}] = {when!r}: say when the flag is True, 'train' or 'eval'"
            )
        if name not in args:
            raise LayerError(
                f"mode names {name!r}, which is no argument of "
                f"{type(model).__name__}.__call__ ({args})"
            )
    return dict(mode)


class NnxSplitter:
    """The traced nnx model shared by the layers of one :func:`split_model`."""

    def __init__(
        self,
        model: nnx.Module,
        args: Sequence[PyTree],
        kwargs: Mapping[str, PyTree] | None,
        at: Any,
        mode: Mapping[str, str] | None,
    ) -> None:
        self.model = model
        #: the ``__call__`` arguments switched; ``train()``/``eval()`` run unless mode={}
        self.mode = resolve_nnx_mode(model, mode, tuple(kwargs or {}))
        self.switch = mode is None or bool(mode)
        self.form, sample = input_form(args, kwargs, list(self.mode))
        self.graphdef, state = nnx.split(model)
        #: (nnx path, pdjax leaf path, template variable) of each variable, RNG left out
        self.entries: list[tuple[tuple[Any, ...], tuple[str, ...], Any]] = []
        self.rng_state: list[tuple[tuple[Any, ...], Any]] = []
        for path, var in nnx.to_flat_state(state):
            if isinstance(var, nnx.RngState):
                self.rng_state.append((tuple(path), var))
            else:
                lp = (collection_of(var), *map(str, path))
                self.entries.append((tuple(path), lp, var))
        self.streams = sorted(
            {v.tag for _, v in nnx.iter_graph(model) if isinstance(v, nnx.RngStream)}
        )
        #: axis names the model's modules reduce over, bound to size-1 axes in every trace
        self.axes = sorted({n for _, v in nnx.iter_graph(model) for n in axis_names_of(v)})
        self.parent_of = parent_finder(module_paths(model).values())
        self.x_tree = jax.tree.structure(sample)
        self.x_dtypes = [jnp.asarray(a).dtype for a in jax.tree.leaves(sample)]
        x_spec = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.asarray(a).dtype), sample
        )
        self._cache: dict[Any, Program] = {}
        self.parent: tuple[str, ...] = ()
        self.units: list[str] = []
        key_spec = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
        calls: list[Call] = []
        self._trace(x_spec, False, key_spec, self._recorder(calls))
        if not calls:
            raise LayerError(
                "split_model: the nnx model calls no submodule to cut at; build its layers "
                "with pdjax.sequential(...) instead"
            )
        self.parent, top, self.units = choose_units(calls, at, self.parent_of)
        self.names = [
            n.replace("/", "_")
            for n in ["00_" + unit_name(top[0].path, self.parent)]
            + [f"{k + 1:02d}_{u}" for k, u in enumerate(self.units)]
        ]
        self.parent_calls = [unit_name(c.path, self.parent) for c in top]
        readers: dict[tuple[str, ...], set[int]] = {lp: set() for _, lp, _ in self.entries}
        for train in (False, True):
            prog = self._program(x_spec, train, key_spec, owner=None)
            for k, cut in enumerate(prog.cuts):
                for p in cut.reads:
                    readers[p].add(k)
        self.owners, self.tied = owners_and_ties(readers, self.names)
        self._cache.clear()  # traced before ownership was known

    @staticmethod
    def _recorder(calls: list[Call]) -> OnCall:
        """Records every call (path, class, nesting) in ``calls``."""
        nesting = Nesting()

        def on_call(path: Any, module: Any, call: Any, a: Any, kw: Any) -> Any:
            calls.append(Call(path, "__call__", type(module).__name__, nesting.depth))
            return nesting.enter(call, a, kw)

        return on_call

    def _marker(self) -> OnCall:
        """Binds the marker at each call of a child of the cuts' parent made while no
        other such call runs."""
        nesting = Nesting()

        def on_call(path: Any, module: Any, call: Any, a: Any, kw: Any) -> Any:
            if nesting.depth:
                return call(*a, **kw)
            if path == self.parent:
                a, kw = mark_call(a, kw, PARENT)
                return call(*a, **kw)
            if self.parent_of(path) != self.parent:
                return call(*a, **kw)
            a, kw = mark_call(a, kw, unit_name(path, self.parent))
            return nesting.enter(call, a, kw)

        return on_call

    def _run(self, values: list[Any], x: Any, train: bool, rng: Any, on_call: OnCall) -> Any:
        def go() -> Any:
            pairs = [
                (p, var.replace(v)) for (p, _, var), v in zip(self.entries, values, strict=True)
            ]
            rngs = [(p, var.replace(var.get_value())) for p, var in self.rng_state]  # fresh
            state = nnx.from_flat_state([*pairs, *rngs])
            model = nnx.merge(self.graphdef, state)
            if self.switch:
                if train:
                    model.train()
                else:
                    model.eval()
            if rng is not None and self.streams:
                keys: dict[str, Any] = {
                    s: jax.random.fold_in(rng, i) for i, s in enumerate(self.streams)
                }
                nnx.reseed(model, policy="match_shape", **keys)
            kwargs = {a: (train if when == "train" else not train) for a, when in self.mode.items()}
            args, kw = self.form.unpack(x)
            with patched_calls(model, on_call):
                y = model(*args, **kw, **kwargs)
            if not train:
                return y, []
            after = dict(nnx.to_flat_state(nnx.state(model)))
            return y, [after[p].get_value() for p, lp, _ in self.entries if lp[0] != "params"]

        return on_named_axes(go, self.axes)()

    def _trace(self, x_spec: Any, train: bool, rng_spec: Any, on_call: OnCall) -> tuple[Any, Any]:
        specs = [
            jax.ShapeDtypeStruct(jnp.shape(v.get_value()), jnp.asarray(v.get_value()).dtype)
            for *_, v in self.entries
        ]
        try:
            closed, out_shape = jax.make_jaxpr(
                lambda v, x, r: self._run(v, x, train, r, on_call), return_shape=True
            )(specs, x_spec, rng_spec)
        except (
            jax.errors.ConcretizationTypeError,
            jax.errors.TracerBoolConversionError,
            jax.errors.TracerIntegerConversionError,
        ) as e:
            raise control_flow_error(e) from e
        except LayerError:
            raise
        except Exception as e:
            if "rng" in str(e).lower() and (rng_spec is None or not self.streams):
                which = "train" if train else "eval"
                raise LayerError(
                    f"split_model: {type(self.model).__name__} needs random numbers in "
                    f"{which} mode (dropout?) and "
                    + (
                        "the layer was given no rng: pass rng=jax.random.key(...) "
                        "(pipelines do in training), or run it in eval mode"
                        if rng_spec is None
                        else "has no RNG stream for pdjax to seed: build its random modules "
                        "with rngs (nnx.Dropout(rate, rngs=rngs))"
                    )
                ) from e
            raise
        return closed, out_shape

    def _program(self, x_spec: Any, train: bool, rng_spec: Any, owner: Any = True) -> Program:
        key = (
            jax.tree.structure(x_spec),
            tuple((a.shape, str(a.dtype)) for a in jax.tree.leaves(x_spec)),
            train,
            None if rng_spec is None else str(rng_spec.dtype),
        )
        if key in self._cache:
            return self._cache[key]
        closed, out_shape = self._trace(x_spec, train, rng_spec, self._marker())
        jaxpr = closed.jaxpr
        n_var, n_x = len(self.entries), len(jax.tree.leaves(x_spec))
        var_paths = [lp for _, lp, _ in self.entries]
        var_vars = list(jaxpr.invars[:n_var])
        x_vars = list(jaxpr.invars[n_var : n_var + n_x])
        rng_var = jaxpr.invars[n_var + n_x] if rng_spec is not None else None
        y_shape, _ = out_shape
        n_y = len(jax.tree.leaves(y_shape))
        y_vars = list(jaxpr.outvars[:n_y])
        state_paths = [lp for _, lp, _ in self.entries if lp[0] != "params"] if train else []
        state_out = dict(zip(state_paths, jaxpr.outvars[n_y:], strict=True))
        var_of = dict(zip(var_vars, var_paths, strict=True))

        def owner_of(p: tuple[str, ...]) -> int | None:
            return None if owner is None else self.owners[p][-1]

        cuts = plan_cuts(
            jaxpr,
            self.units,
            len(self.units) + 1,
            y_vars,
            state_out,
            owner_of,
            var_of,
            x_vars,
            free=frozenset() if rng_var is None else frozenset({rng_var}),
        )
        prog = Program(
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

    # the variables: per-layer collections <-> the model's nnx.State
    def collections(self, state: Any) -> dict[tuple[str, ...], Any]:
        """An ``nnx.State`` of the model (or part of it) as leaves by pdjax path."""
        flat = dict(nnx.to_flat_state(state))
        return {lp: flat[p].get_value() for p, lp, _ in self.entries if p in flat}

    def subset(self, k: int, tree: Any) -> Variables:
        """Layer ``k``'s variables from an ``nnx.State`` of the model."""
        out: dict[str, Any] = {}
        for p, leaf in self.collections(tree).items():
            if k in self.owners.get(p, (0,)):
                node = out
                for part in p[:-1]:
                    node = node.setdefault(part, {})
                node[p[-1]] = leaf
        return out

    def model_tree(self, flat: Mapping[tuple[str, ...], Any], device: Any) -> Any:
        """The model's ``nnx.State`` (its RNG streams left out) from its leaves by path, on
        ``device``, for ``nnx.update(model, state)``."""
        missing = [lp for _, lp, _ in self.entries if lp not in flat]
        if missing:
            raise LayerError(f"the layers' variables lack {['/'.join(p) for p in missing[:5]]}")
        pairs = [(p, var.replace(jax.device_put(flat[lp], device))) for p, lp, var in self.entries]
        return nnx.from_flat_state(pairs)

    # the layers' work
    def _x_spec(self, k: int, x: PyTree) -> Any:
        return input_spec(k, x, self.x_tree, self.x_dtypes)

    def init_cut(self, k: int, rng: jax.Array, x: PyTree) -> Variables:
        """Layer ``k``'s share of the model's current variables (``rng`` is not used: an
        nnx model holds its variables)."""
        del rng, x
        return self.subset(k, nnx.state(self.model))

    def apply_cut(
        self, k: int, variables: Variables, x: PyTree, train: bool, rng: jax.Array | None
    ) -> tuple[PyTree, Variables]:
        """Evaluates layer ``k``'s equations."""
        x_spec = self._x_spec(k, x)
        rng_spec = None if rng is None else jax.ShapeDtypeStruct(jnp.shape(rng), rng.dtype)
        prog = self._program(x_spec, train, rng_spec)
        return run_cut(prog, k, self.names[k], variables, x, x_spec, train, rng)
