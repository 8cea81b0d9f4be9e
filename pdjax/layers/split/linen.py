"""The traced ``flax.linen`` model that the layers of one :func:`~pdjax.layers.split_model`
share (:class:`LinenSplitter`): the model's variables, its cuts and their owners, the
program traced per input shape and mode, and each layer's ``init`` and ``apply``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp

from pdjax.errors import LayerError
from pdjax.layers.base import PyTree, Variables
from pdjax.layers.split.calls import (
    PARENT,
    Nesting,
    axis_names_of,
    call_path,
    choose_units,
    control_flow_error,
    field_paths,
    input_form,
    is_child,
    is_lifted,
    mark_call,
    on_named_axes,
    path_parent,
    record_calls,
    resolve_mode,
    stream_keys,
    transform_hint,
    unit_name,
    with_field,
)
from pdjax.layers.split.cuts import (
    Program,
    input_spec,
    leaf_path,
    owners_and_ties,
    plan_cuts,
    run_cut,
)

__all__ = ["LinenSplitter"]

_TRACER_ERRORS = (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerBoolConversionError,
    jax.errors.TracerIntegerConversionError,
)


class LinenSplitter:
    """The traced model shared by the layers of one :func:`split_model`."""

    def __init__(
        self,
        module: nn.Module,
        args: Sequence[PyTree],
        kwargs: Mapping[str, PyTree] | None,
        at: Any,
        mode: Mapping[str, str] | None,
        rng_streams: tuple[str, ...],
    ) -> None:
        self.module = module
        self.mode = resolve_mode(module, mode, tuple(kwargs or {}))
        self.form, sample = input_form(args, kwargs, list(self.mode))
        #: the RNG streams the model draws from when applied, each derived from a layer's rng
        self.streams = rng_streams
        #: axis names the model's modules reduce over, bound to size-1 axes in every trace
        self.axes: set[str] = set()
        self._seen_axes: set[str] = set()
        self._lifted: dict[str, str] = {}  # lifted modules seen: name -> class
        self.x_tree = jax.tree.structure(sample)
        self.x_dtypes = [jnp.asarray(a).dtype for a in jax.tree.leaves(sample)]
        x_spec = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.asarray(a).dtype), sample
        )
        self._cache: dict[Any, Program] = {}
        key = jax.random.key(0)
        try:
            self.var_spec = self._retrying(
                lambda: jax.eval_shape(lambda k, x: self._init(k, k, x), key, x_spec), False
            )
            calls, _ = self._retrying(
                lambda: record_calls(
                    lambda v, x, r: self._call(v, x, False, r, None),
                    self.var_spec,
                    x_spec,
                    key,
                    seen=self._see,
                ),
                False,
            )
        except _TRACER_ERRORS as e:
            raise control_flow_error(e) from e
        scans = [name for name, kind in self._lifted.items() if kind.startswith("Scan")]
        note = f" ({scans[0]!r} is scanned: {transform_hint('scan')})" if scans else ""
        self.parent, top, units = choose_units(calls, at, note=note)
        self.units = units
        self.names = ["00_" + (unit_name(top[0].path, self.parent) if top else "start")] + [
            f"{k + 1:02d}_{u}" for k, u in enumerate(units)
        ]
        self.names = [n.replace("/", "_") for n in self.names]
        self.parent_calls = [unit_name(c.path, self.parent) for c in top]
        # variable ownership by data flow, from an eval and a train trace of the sample
        leaves = [leaf_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(self.var_spec)[0]]
        readers: dict[tuple[str, ...], set[int]] = {p: set() for p in leaves}
        for train in (False, True):
            prog = self._program(x_spec, train, jax.ShapeDtypeStruct((), key.dtype), owner=None)
            for k, cut in enumerate(prog.cuts):
                for p in cut.reads:
                    readers[p].add(k)
        self.owners, self.tied = owners_and_ties(readers, self.names)
        self._cache.clear()  # traced before ownership was known

    # the axis names and the RNG streams
    def _see(self, module: Any) -> None:
        self._seen_axes |= axis_names_of(module)
        if is_lifted(module) and module.name:
            self._lifted.setdefault(module.name, type(module).__name__)

    def _watch(self, next_fun: Any, a: Any, kw: Any, context: Any) -> Any:
        self._see(context.module)
        return next_fun(*a, **kw)

    def _retrying(self, trace: Any, train: bool, rng_given: bool = True) -> Any:
        """``trace()``, again with the axis names bound that the modules it called
        reduce over, where it stopped at one unbound; a missing RNG stream refused."""
        while True:
            try:
                return trace()
            except NameError:
                new = self._seen_axes - self.axes
                if not new:
                    raise
                self.axes |= new
                self._cache.clear()
            except flax.errors.InvalidRngError as e:
                raise self._rng_error(e, train, rng_given) from e

    def _rng_error(self, e: Exception, train: bool, rng_given: bool) -> LayerError:
        which = "train" if train else "eval"
        found = re.search(r'PRNG for "([^"]+)"', str(e))
        stream = found.group(1) if found else None
        if rng_given and stream is not None and stream not in self.streams:
            return LayerError(
                f"split_model: {type(self.module).__name__} draws from the RNG stream "
                f"{stream!r} in {which} mode, which pdjax does not give it: name every stream "
                f"it draws from, split_model(..., rng_streams={(*self.streams, stream)!r}); "
                "each layer derives them all from the rng the pipeline gives it"
            )
        return LayerError(
            f"split_model: {type(self.module).__name__} needs a PRNG in {which} mode "
            f"(dropout?) and the layer was given none: pass rng=jax.random.key(...) "
            f"(pipelines do in training), or run it in eval mode; pdjax switches the "
            f"mode through "
            f"{self.mode or 'nothing (no train/deterministic field or argument found)'}"
            ": name the field or argument with split_model(..., mode={'config."
            "deterministic': 'eval'}) or mode={'train': 'train'}, or mode={} to "
            "leave the model as it is"
        )

    def _init(self, params_key: Any, stream_key: Any, x: Any) -> Any:
        args, kw = self.form.unpack(x)

        def go() -> Any:
            with nn.intercept_methods(self._watch):
                return self._module(False).init(
                    {"params": params_key, **stream_keys(stream_key, self.streams)},
                    *args,
                    **kw,
                    **self._kwargs(False),
                )

        return on_named_axes(go, sorted(self.axes))()

    # the mode -> module and call arguments
    def _module(self, train: bool) -> nn.Module:
        module = self.module
        fields = set(field_paths(module))
        for name, when in self.mode.items():
            if name in fields:
                module = with_field(module, name, train if when == "train" else not train)
        return module

    def _kwargs(self, train: bool) -> dict[str, Any]:
        fields = set(field_paths(self.module))
        return {
            name: (train if when == "train" else not train)
            for name, when in self.mode.items()
            if name not in fields
        }

    def _call(self, variables: Any, x: Any, train: bool, rng: Any, mutable: Any) -> Any:
        rngs = stream_keys(rng, self.streams) if rng is not None else {}
        module, kwargs = self._module(train), self._kwargs(train)
        args, kw = self.form.unpack(x)

        def go() -> Any:
            with nn.intercept_methods(self._watch):
                if mutable:
                    return module.apply(
                        variables, *args, rngs=rngs, mutable=mutable, **kw, **kwargs
                    )
                return module.apply(variables, *args, rngs=rngs, **kw, **kwargs), {}

        return on_named_axes(go, sorted(self.axes))()

    def _program(self, x_spec: Any, train: bool, rng_spec: Any, owner: Any = True) -> Program:
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

        def fn(variables: Any, x: Any, rng: Any) -> Any:
            nesting = Nesting()

            def interceptor(next_fun: Any, a: Any, kw: Any, context: Any) -> Any:
                path = call_path(context)
                if path is None or nesting.depth:
                    return next_fun(*a, **kw)
                if path == parent:
                    a, kw = mark_call(a, kw, PARENT)
                if is_child(path, parent, path_parent):
                    a, kw = mark_call(a, kw, unit_name(path, parent))
                    return nesting.enter(next_fun, a, kw)
                return next_fun(*a, **kw)

            with nn.intercept_methods(interceptor):
                return self._call(variables, x, train, rng, mutable)

        try:
            closed, out_shape = self._retrying(
                lambda: jax.make_jaxpr(fn, return_shape=True)(self.var_spec, x_spec, rng_spec),
                train,
                rng_spec is not None,
            )
        except _TRACER_ERRORS as e:
            raise control_flow_error(e) from e
        except LayerError:
            raise
        except Exception as e:
            if "rng" in str(e).lower() and rng_spec is None:
                raise self._rng_error(e, train, False) from e
            raise
        jaxpr = closed.jaxpr
        n_var = len(jax.tree.leaves(self.var_spec))
        n_x = len(jax.tree.leaves(x_spec))
        var_paths = [
            leaf_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(self.var_spec)[0]
        ]
        var_vars = list(jaxpr.invars[:n_var])
        x_vars = list(jaxpr.invars[n_var : n_var + n_x])
        rng_var = jaxpr.invars[n_var + n_x] if rng_spec is not None else None
        y_shape, state_shape = out_shape
        n_y = len(jax.tree.leaves(y_shape))
        y_vars = list(jaxpr.outvars[:n_y])
        state_paths = [
            leaf_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(state_shape)[0]
        ]
        state_out = dict(zip(state_paths, jaxpr.outvars[n_y:], strict=True))
        var_of = dict(zip(var_vars, var_paths, strict=True))
        if owner is None:

            def owner_of(p: tuple[str, ...]) -> int | None:
                return None  # ownership unknown yet
        else:

            def owner_of(p: tuple[str, ...]) -> int | None:
                return self.owners[p][-1]

        cuts = plan_cuts(
            jaxpr, self.units, len(self.units) + 1, y_vars, state_out, owner_of, var_of, x_vars
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

    # the layers' work
    def _x_spec(self, k: int, x: PyTree) -> Any:
        return input_spec(k, x, self.x_tree, self.x_dtypes)

    def _sample_input(self, k: int, x: PyTree) -> Any:
        spec = self._x_spec(k, x)
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), spec)

    def init_cut(self, k: int, rng: jax.Array, x: PyTree) -> Variables:
        params_key, stream_key = jax.random.split(rng)
        full = self._retrying(
            lambda: self._init(params_key, stream_key, self._sample_input(k, x)), False
        )
        return self.subset(k, full)

    def model_tree(self, flat: Mapping[tuple[str, ...], Any], device: Any) -> dict[str, Any]:
        """The model's own variable tree (``model.init``'s structure) from its leaves by
        path, on ``device``."""
        paths = [leaf_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(self.var_spec)[0]]
        missing = [p for p in paths if p not in flat]
        if missing:
            raise LayerError(f"the layers' variables lack {['/'.join(p) for p in missing[:5]]}")
        tree: dict[str, Any] = jax.tree.unflatten(
            jax.tree.structure(self.var_spec), [flat[p] for p in paths]
        )
        on: dict[str, Any] = jax.device_put(tree, device)
        return on

    def subset(self, k: int, tree: Any) -> Variables:
        out: dict[str, Any] = {}
        for path, leaf in jax.tree_util.tree_flatten_with_path(dict(tree))[0]:
            p = leaf_path(path)
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
        return run_cut(prog, k, self.names[k], variables, x, x_spec, train, rng)
