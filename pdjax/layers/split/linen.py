"""The traced ``flax.linen`` model that the layers of one :func:`~pdjax.layers.split_model`
share (:class:`LinenSplitter`): the model's variables, its cuts and their owners, the
program traced per input shape and mode, and each layer's ``init`` and ``apply``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from pdjax.errors import LayerError
from pdjax.layers.base import PyTree, Variables
from pdjax.layers.split.calls import (
    auto_units,
    control_flow_error,
    field_paths,
    marked,
    record_calls,
    resolve_at,
    resolve_mode,
    top_calls,
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


class LinenSplitter:
    """The traced model shared by the layers of one :func:`split_model`."""

    def __init__(
        self, module: nn.Module, sample: PyTree, at: Any, mode: Mapping[str, str] | None
    ) -> None:
        self.module = module
        self.mode = resolve_mode(module, mode)
        self.x_tree = jax.tree.structure(sample)
        self.x_dtypes = [jnp.asarray(a).dtype for a in jax.tree.leaves(sample)]
        x_spec = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.asarray(a).dtype), sample
        )
        self._cache: dict[Any, Program] = {}
        key = jax.random.key(0)
        try:
            self.var_spec = jax.eval_shape(
                lambda k, x: self._module(False).init(
                    {"params": k, "dropout": k}, x, **self._kwargs(False)
                ),
                key,
                x_spec,
            )
            calls, _ = record_calls(
                lambda v, x, r: self._call(v, x, False, r, None), self.var_spec, x_spec, key
            )
        except (
            jax.errors.ConcretizationTypeError,
            jax.errors.TracerBoolConversionError,
            jax.errors.TracerIntegerConversionError,
        ) as e:
            raise control_flow_error(e) from e
        if at is None or at == "blocks":
            self.parent, units = auto_units(calls)
        elif isinstance(at, str):
            raise LayerError(
                f"at={at!r}: give 'blocks' (cut before each repeated block) or a list of "
                "submodule names, e.g. at=['blocks_2']"
            )
        else:
            self.parent, units = resolve_at(calls, list(at))
        top = top_calls(calls, self.parent)
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
        leaves = [leaf_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(self.var_spec)[0]]
        readers: dict[tuple[str, ...], set[int]] = {p: set() for p in leaves}
        for train in (False, True):
            prog = self._program(x_spec, train, jax.ShapeDtypeStruct((), key.dtype), owner=None)
            for k, cut in enumerate(prog.cuts):
                for p in cut.reads:
                    readers[p].add(k)
        self.owners, self.tied = owners_and_ties(readers, self.names)
        self._cache.clear()  # traced before ownership was known

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
        rngs = {"dropout": rng} if rng is not None else {}
        module, kwargs = self._module(train), self._kwargs(train)
        if mutable:
            return module.apply(variables, x, rngs=rngs, mutable=mutable, **kwargs)
        return module.apply(variables, x, rngs=rngs, **kwargs), {}

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
                    marked((jnp.zeros((), jnp.float32),), path[-1])
                else:
                    new = marked(tuple(leaves[n] for n in arrays), path[-1])
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
            raise control_flow_error(e) from e
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
        params_key, dropout_key = jax.random.split(rng)
        full = self._module(False).init(
            {"params": params_key, "dropout": dropout_key},
            self._sample_input(k, x),
            **self._kwargs(False),
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
