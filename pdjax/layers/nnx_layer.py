"""A ``flax.nnx`` module, or a factory ``rngs -> nnx.Module``, as a pdjax layer
(:class:`NnxLayer`), and how pdjax reads an nnx callable's signature."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
from flax import nnx

from pdjax.errors import LayerError
from pdjax.layers.base import PyTree, Variables, mode_kwarg

__all__ = ["NnxLayer"]


def _nnx_collection(variable_type: type) -> str:
    if issubclass(variable_type, nnx.Param):
        return "params"
    if issubclass(variable_type, nnx.BatchStat):
        return "batch_stats"
    return "state"


def init_signature(fn: Callable[..., Any]) -> inspect.Signature:
    """``inspect.signature``, but an nnx module class (or a ``functools.partial`` of one)
    gets its ``__init__``'s parameters, not its metaclass's ``(*args, **kwargs)``.

    Raises:
      TypeError, ValueError: for a callable without signature (some builtins).
    """
    if isinstance(fn, functools.partial):
        inner = init_signature(fn.func)

        def proxy(*args: Any, **kwargs: Any) -> None:
            del args, kwargs

        proxy.__signature__ = inner  # type: ignore[attr-defined]
        return inspect.signature(functools.partial(proxy, *fn.args, **fn.keywords))
    if isinstance(fn, type) and issubclass(fn, nnx.Module):
        init = inspect.signature(fn.__init__)
        return init.replace(parameters=list(init.parameters.values())[1:])
    return inspect.signature(fn)


def rngs_param(fn: Callable[..., Any]) -> tuple[inspect.Parameter | None, list[str]]:
    """How a callable would take an ``nnx.Rngs``: ``(parameter, other required names)``.

    The parameter is the one named ``rngs`` or annotated ``nnx.Rngs`` (None if there is
    none, or if the callable has no signature, as builtins and ufuncs may not).
    """
    try:
        params = init_signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None, []
    found = None
    others = []
    for p in params:
        if p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            continue
        annotation = p.annotation
        if isinstance(annotation, str):
            is_rngs = annotation.rsplit(".", 1)[-1] == "Rngs"
        else:
            is_rngs = annotation is nnx.Rngs
        if found is None and (p.name == "rngs" or is_rngs):
            found = p
        elif p.default is inspect.Parameter.empty:
            others.append(p.name)
    return found, others


def _call_factory(factory: Callable[..., nnx.Module], rngs: nnx.Rngs) -> Any:
    """Calls an nnx factory with ``rngs``, by keyword where its parameter is keyword-only
    (``functools.partial(nnx.Linear, 3, 4)``), else positionally."""
    param, _ = rngs_param(factory)
    if param is not None and param.kind == inspect.Parameter.KEYWORD_ONLY:
        return factory(**{param.name: rngs})
    return factory(rngs)


def _is_tracer(value: Any) -> bool:
    return any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(value))


def _owned_variables(
    module: nnx.Module, *, concrete_only: bool = False
) -> dict[int, tuple[str, nnx.Variable[Any]]]:
    """The module's variables by ``id``, with their paths, RNG state left out (pdjax
    reseeds every layer's RNG streams itself, so two layers sharing one lose nothing).

    ``concrete_only`` keeps the variables holding concrete arrays: inside a trace (the
    ``nnx.eval_shape`` of a factory) those are the ones that existed before the factory
    was called, i.e. captured from outside and possibly shared with another layer.
    """
    owned: dict[int, tuple[str, nnx.Variable[Any]]] = {}
    for path, node in nnx.iter_graph(module):
        if not isinstance(node, nnx.Variable) or isinstance(node, nnx.RngState):
            continue
        if concrete_only and _is_tracer(node.get_value()):
            continue
        owned.setdefault(id(node), ("/".join(map(str, path)), node))
    return owned


class NnxLayer:
    """A ``flax.nnx`` module as a pdjax layer, through ``nnx.split`` and ``nnx.merge``.

    nnx modules create their variables when constructed. Give either a module instance
    (``init`` then returns a copy of its current variables and ignores ``rng``) or a
    factory ``rngs -> module`` (``init`` builds a fresh module from ``nnx.Rngs(rng)``; a
    factory whose ``rngs`` parameter is keyword-only, ``functools.partial(nnx.Linear, 3,
    4)``, gets it by keyword).

    Variables map to collections ``"params"`` (``nnx.Param``), ``"batch_stats"``
    (``nnx.BatchStat``) and ``"state"`` (everything else, e.g. RNG counters).

    Train/eval reaches the module both ways nnx modules are written: the merged module is
    switched with ``module.train()`` / ``module.eval()`` (the ``deterministic`` and
    ``use_running_average`` attributes of ``nnx.Dropout``, ``nnx.BatchNorm`` and the like),
    and the flag is passed to its ``__call__`` as whichever of ``train``, ``training``,
    ``deterministic`` or ``use_running_average`` it accepts (inverted for the last two), as
    :class:`LinenLayer` does.

    With ``rng`` given, every RNG stream of the module is reseeded from it, so dropout masks
    depend only on ``rng`` (pdjax passes a fresh key per call and microbatch); a module
    without RNG streams of its own whose ``__call__`` takes ``rngs`` (a bare
    ``nnx.Dropout(0.5)``) gets ``nnx.Rngs(rng)`` there in train mode. Without ``rng`` the
    module's own streams advance and their counters come back in the ``"state"``
    collection.
    """

    def __init__(
        self,
        module: nnx.Module | Callable[[nnx.Rngs], nnx.Module],
        name: str,
    ) -> None:
        self.name = name
        captured: dict[int, tuple[str, nnx.Variable[Any]]] = {}
        if isinstance(module, nnx.Module):
            self._factory: Callable[[nnx.Rngs], nnx.Module] | None = None
            template = module
        elif callable(module):
            self._factory = module

            def build() -> Any:
                built = _call_factory(module, nnx.Rngs(0))
                if isinstance(built, nnx.Module):
                    captured.update(_owned_variables(built, concrete_only=True))
                return built

            template = nnx.eval_shape(build)
            if not isinstance(template, nnx.Module):
                raise LayerError(
                    f"layer {name!r}: the factory returned {type(template).__name__}, not an "
                    "nnx.Module; a parameter-free function goes in as Fn(function)"
                )
        else:
            raise LayerError(
                f"layer {name!r}: expected an nnx.Module or a factory rngs -> nnx.Module, "
                f"got {type(module).__name__}"
            )
        #: the wrapped module's class name (for profiles and tables)
        self.kind = type(template).__name__
        self._graphdef, state = nnx.split(template)
        self._template = state
        #: variables that may also be reachable from another layer (by ``id``, with path)
        if isinstance(module, nnx.Module):  # (no factory)
            self._instance: nnx.Module | None = module
            self._owned = _owned_variables(module)
        else:
            self._instance = None
            self._owned = captured
        self._streams: list[str] = sorted(
            {
                v.tag  # a str: RngStream's tag is required
                for _, v in nnx.iter_graph(template)
                if isinstance(v, nnx.RngStream)
            }
        )
        call = type(template).__call__
        self._mode = mode_kwarg(call)
        try:
            self._takes_rngs = "rngs" in inspect.signature(call).parameters
        except (TypeError, ValueError):
            self._takes_rngs = False

    def __repr__(self) -> str:
        return f"NnxLayer(name={self.name!r})"

    def _to_collections(self, state: nnx.State[Any, Any]) -> Variables:
        out: dict[str, dict[Any, Any]] = {}
        flat = nnx.to_flat_state(state)
        for path, var in flat:
            coll = _nnx_collection(type(var))
            out.setdefault(coll, {})[path] = var.get_value()
        result: Variables = {}
        for coll, items in out.items():
            result[coll] = _unflatten(items)
        return result

    def _to_state(self, variables: Variables) -> nnx.State[Any, Any]:
        flat_values: dict[tuple[Any, ...], Any] = {}
        for _coll, tree in variables.items():
            for path, leaf in _flatten(tree):
                flat_values[path] = leaf
        pairs = []
        for path, var in nnx.to_flat_state(self._template):
            if path not in flat_values:
                raise LayerError(
                    f"layer {self.name!r}: variables lack {'/'.join(map(str, path))}; "
                    "were they built by this layer's init?"
                )
            pairs.append((path, var.replace(flat_values[path])))
        return nnx.from_flat_state(pairs)

    def init(self, rng: jax.Array, x: PyTree) -> Variables:
        """Returns the module's variables (fresh from ``rng`` if built from a factory)."""
        del x  # nnx modules know their shapes at construction
        if self._factory is not None:
            module = _call_factory(self._factory, nnx.Rngs(rng))
        else:
            module = self._instance
        _, state = nnx.split(module)
        return self._to_collections(state)

    def apply(
        self,
        variables: Variables,
        x: PyTree,
        *,
        train: bool = False,
        rng: jax.Array | None = None,
    ) -> tuple[PyTree, Variables]:
        """Merges the variables into the module, calls it, and splits the state back out."""
        module = nnx.merge(self._graphdef, self._to_state(variables))
        if train:
            module.train()
        else:
            module.eval()
        kwargs: dict[str, Any] = {}
        if self._mode is not None:
            arg, inverted = self._mode
            kwargs[arg] = (not train) if inverted else train
        if rng is not None and self._streams:
            keys: dict[str, Any] = {
                s: jax.random.fold_in(rng, i) for i, s in enumerate(self._streams)
            }
            nnx.reseed(module, policy="match_shape", **keys)
        elif rng is not None and train and self._takes_rngs:
            kwargs["rngs"] = nnx.Rngs(rng)
        try:
            y = module(x, **kwargs)
        except Exception as e:  # nnx's own message names no layer
            if train and not self._streams and "rng" in str(e).lower():
                if rng is None and self._takes_rngs:
                    raise LayerError(
                        f"layer {self.name!r} needs an RNG in train mode (dropout?); "
                        "pass rng=jax.random.key(...) to apply"
                    ) from e
                raise LayerError(
                    f"layer {self.name!r} needs random numbers in train mode (dropout?) but "
                    "has no RNG stream for pdjax to seed: build its random modules with "
                    "rngs (nnx.Dropout(rate, rngs=rngs)), or take rngs in __call__"
                ) from e
            raise
        if not train:
            return y, {k: v for k, v in variables.items() if k != "params"}
        _, state = nnx.split(module)
        new = self._to_collections(state)
        return y, {k: v for k, v in new.items() if k != "params"}


def _flatten(
    tree: Mapping[Any, Any], prefix: tuple[Any, ...] = ()
) -> Iterator[tuple[tuple[Any, ...], Any]]:
    for k, v in tree.items():
        if isinstance(v, Mapping):
            yield from _flatten(v, (*prefix, k))
        else:
            yield (*prefix, k), v


def _unflatten(items: Mapping[tuple[Any, ...], Any]) -> dict[Any, Any]:
    root: dict[Any, Any] = {}
    for path, value in items.items():
        node = root
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = value
    return root
