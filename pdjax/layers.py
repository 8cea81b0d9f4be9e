"""Layer sequences: a model as an ordered list of Flax modules.

A :class:`Layer` is the unit pdjax profiles, partitions and places on devices. It wraps
one Flax module (``flax.linen`` or ``flax.nnx``) behind two pure functions:

* ``init(rng, x) -> variables``: the layer's variables as a plain dict of collections,
  ``{"params": ..., "batch_stats": ...}``, built from a sample input ``x``;
* ``apply(variables, x, *, train, rng) -> (y, state)``: the output pytree ``y`` and the
  layer's non-parameter collections after the call (BatchNorm statistics updated in train
  mode, unchanged in eval mode).

Activations between layers are arbitrary pytrees: arrays, tuples (seq2seq), dicts.
A :class:`LayerSequence` composes layers; applying it equals applying a monolithic model
built from the same modules in the same order.

>>> import jax, jax.numpy as jnp, flax.linen as nn
>>> seq = sequential(nn.Dense(8), nn.Dense(4))
>>> variables = seq.init(jax.random.key(0), jnp.ones((2, 3)))
>>> y, _ = seq.apply(variables, jnp.ones((2, 3)))
>>> y.shape
(2, 4)
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import flax.linen as nn
import jax
from flax import nnx

from pdjax.errors import LayerError

__all__ = [
    "Layer",
    "LayerSequence",
    "LinenLayer",
    "LossFn",
    "NnxLayer",
    "PyTree",
    "Variables",
    "as_layer",
    "count_traces",
    "sequential",
]

PyTree = Any
#: A layer's variables: collection name -> pytree, e.g. ``{"params": ..., "batch_stats": ...}``.
Variables = dict[str, PyTree]
#: ``loss_fn(outputs, targets) -> scalar``: the mean loss of a (micro)batch.
LossFn = Callable[[PyTree, PyTree], jax.Array]


def count_traces(counts: dict[str, int], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps ``fn`` so that each trace (compilation) increments ``counts[name]``.

    Wrap before ``jax.jit``: the wrapper runs only while JAX traces, so a test can assert
    that a function compiled once per shape.
    """

    def traced(*args: Any) -> Any:
        counts[name] = counts.get(name, 0) + 1
        return fn(*args)

    return traced


@runtime_checkable
class Layer(Protocol):
    """What pdjax needs of one layer. Implemented by :class:`LinenLayer` and :class:`NnxLayer`."""

    name: str

    def init(self, rng: jax.Array, x: PyTree) -> Variables:
        """Creates the layer's variables for input ``x``."""
        ...

    def apply(
        self,
        variables: Variables,
        x: PyTree,
        *,
        train: bool = False,
        rng: jax.Array | None = None,
    ) -> tuple[PyTree, Variables]:
        """Returns ``(output, non-parameter collections after the call)``."""
        ...


def _mode_kwarg(fn: Callable[..., Any]) -> tuple[str, bool] | None:
    """Finds how a module's ``__call__`` is told train vs eval: ``(argname, inverted)``."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None
    if "train" in params:
        return ("train", False)
    if "training" in params:
        return ("training", False)
    if "deterministic" in params:
        return ("deterministic", True)
    if "use_running_average" in params:
        return ("use_running_average", True)
    return None


def _split_key(rng: jax.Array) -> tuple[jax.Array, jax.Array]:
    a, b = jax.random.split(rng)
    return a, b


@dataclasses.dataclass(frozen=True)
class LinenLayer:
    """A ``flax.linen`` module as a pdjax layer.

    The train/eval switch is passed to the module's ``__call__`` as whichever of ``train``,
    ``training``, ``deterministic`` or ``use_running_average`` it accepts (inverted for the
    last two). Dropout draws from the ``"dropout"`` RNG stream, which ``apply`` fills from
    ``rng``. In train mode every collection other than ``"params"`` is mutable.

    Attributes:
      module: the Flax linen module (unbound).
      name: a unique name within its sequence.
    """

    module: nn.Module
    name: str

    def _kwargs(self, train: bool) -> dict[str, bool]:
        mode = _mode_kwarg(type(self.module).__call__)
        if mode is None:
            return {}
        arg, inverted = mode
        return {arg: (not train) if inverted else train}

    def init(self, rng: jax.Array, x: PyTree) -> Variables:
        """Initialises the module's variables for input ``x`` (in eval mode)."""
        params_key, dropout_key = _split_key(rng)
        variables = self.module.init(
            {"params": params_key, "dropout": dropout_key}, x, **self._kwargs(False)
        )
        return {k: v for k, v in dict(variables).items()}

    def apply(
        self,
        variables: Variables,
        x: PyTree,
        *,
        train: bool = False,
        rng: jax.Array | None = None,
    ) -> tuple[PyTree, Variables]:
        """Applies the module; returns the output and its non-parameter collections."""
        state = {k: v for k, v in variables.items() if k != "params"}
        rngs = {"dropout": rng} if rng is not None else {}
        kwargs = self._kwargs(train)
        try:
            if train and state:
                y, updates = self.module.apply(
                    variables, x, rngs=rngs, mutable=list(state), **kwargs
                )
                return y, {**state, **dict(updates)}
            return self.module.apply(variables, x, rngs=rngs, **kwargs), state
        except Exception as e:  # flax raises several RNG error types across versions
            if "rng" in str(e).lower() and rng is None and train:
                raise LayerError(
                    f"layer {self.name!r} needs an RNG in train mode (dropout?); "
                    "pass rng=jax.random.key(...) to apply"
                ) from e
            raise


def _nnx_collection(variable_type: type) -> str:
    if issubclass(variable_type, nnx.Param):
        return "params"
    if issubclass(variable_type, nnx.BatchStat):
        return "batch_stats"
    return "state"


class NnxLayer:
    """A ``flax.nnx`` module as a pdjax layer, through ``nnx.split`` and ``nnx.merge``.

    nnx modules create their variables when constructed. Give either a module instance
    (``init`` then returns a copy of its current variables and ignores ``rng``) or a
    factory ``rngs -> module`` (``init`` builds a fresh module from ``nnx.Rngs(rng)``).

    Variables map to collections ``"params"`` (``nnx.Param``), ``"batch_stats"``
    (``nnx.BatchStat``) and ``"state"`` (everything else, e.g. RNG counters). Train/eval is
    set with ``module.train()`` / ``module.eval()``; with ``rng`` given, every RNG stream of
    the module is reseeded from it, so dropout masks depend only on ``rng``.
    """

    def __init__(
        self,
        module: nnx.Module | Callable[[nnx.Rngs], nnx.Module],
        name: str,
    ) -> None:
        self.name = name
        if isinstance(module, nnx.Module):
            self._factory: Callable[[nnx.Rngs], nnx.Module] | None = None
            template = module
        elif callable(module):
            self._factory = module
            template = nnx.eval_shape(lambda: module(nnx.Rngs(0)))
        else:
            raise LayerError(
                f"layer {name!r}: expected an nnx.Module or a factory rngs -> nnx.Module, "
                f"got {type(module).__name__}"
            )
        #: the wrapped module's class name (for profiles and tables)
        self.kind = type(template).__name__
        self._graphdef, state = nnx.split(template)
        self._template = state
        self._instance = module if self._factory is None else None
        self._streams = sorted(
            {
                getattr(v, "tag", None)
                for _, v in nnx.iter_graph(template)
                if isinstance(v, nnx.RngStream)
            }
            - {None}
        )

    def __repr__(self) -> str:
        return f"NnxLayer(name={self.name!r})"

    def _to_collections(self, state: nnx.State) -> Variables:
        out: dict[str, dict[Any, Any]] = {}
        flat = nnx.to_flat_state(state)
        for path, var in flat:
            coll = _nnx_collection(type(var))
            out.setdefault(coll, {})[path] = var.get_value()
        result: Variables = {}
        for coll, items in out.items():
            result[coll] = _unflatten(items)
        return result

    def _to_state(self, variables: Variables) -> nnx.State:
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
            module = self._factory(nnx.Rngs(rng))
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
        if rng is not None and self._streams:
            nnx.reseed(
                module, **{s: jax.random.fold_in(rng, i) for i, s in enumerate(self._streams)}
            )
        y = module(x)
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


def as_layer(module: Any, name: str) -> Layer:
    """Wraps a linen module, an nnx module (or factory ``rngs -> nnx.Module``), or returns a Layer.

    Raises:
      LayerError: if ``module`` is none of those.
    """
    if isinstance(module, nn.Module):
        return LinenLayer(module, name)
    if isinstance(module, nnx.Module):
        return NnxLayer(module, name)
    if isinstance(module, (LinenLayer, NnxLayer)):
        return module
    if isinstance(module, Layer) and not isinstance(module, type):
        return module
    if callable(module):
        return NnxLayer(module, name)
    raise LayerError(
        f"cannot make a layer from {type(module).__name__}; pass a flax.linen Module, "
        "a flax.nnx Module, or a factory rngs -> nnx.Module"
    )


def _default_name(i: int, module: Any) -> str:
    return f"{i:02d}_{type(module).__name__}"


@dataclasses.dataclass(frozen=True)
class LayerSequence:
    """An ordered sequence of layers, applied one after the other.

    Variables are kept per layer, as a list (index ``i`` for layer ``i``); :meth:`merge`
    turns them into one Flax-style tree keyed by layer name and :meth:`split` back.

    Attributes:
      layers: the layers, in order; names are unique.
    """

    layers: tuple[Layer, ...]

    def __post_init__(self) -> None:
        if not self.layers:
            raise LayerError("a layer sequence needs at least one layer")
        names = [layer.name for layer in self.layers]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise LayerError(f"layer names must be unique; repeated: {dupes}")

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self) -> Iterator[Layer]:
        return iter(self.layers)

    def __getitem__(self, index: slice | int) -> LayerSequence:
        """A contiguous sub-sequence (an int gives a one-layer sequence)."""
        if isinstance(index, int):
            index = slice(index, index + 1 if index != -1 else None)
        return LayerSequence(tuple(self.layers[index]))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(layer.name for layer in self.layers)

    def init(self, rng: jax.Array, x: PyTree) -> list[Variables]:
        """Initialises every layer in turn, feeding each the previous layer's output.

        Layer ``i`` is initialised from ``jax.random.fold_in(rng, i)``. Under
        ``jax.eval_shape`` this costs no compute (useful for paper-size models).
        """
        variables = []
        for i, layer in enumerate(self.layers):
            v = layer.init(jax.random.fold_in(rng, i), x)
            x, _ = layer.apply(v, x, train=False)
            variables.append(v)
        return variables

    def apply(
        self,
        variables: Sequence[Variables],
        x: PyTree,
        *,
        train: bool = False,
        rng: jax.Array | None = None,
    ) -> tuple[PyTree, list[Variables]]:
        """Applies the layers in order; layer ``i`` gets ``fold_in(rng, i)`` if ``rng`` is given.

        Returns:
          ``(output, [non-parameter collections of each layer after the call])``.
        """
        if len(variables) != len(self.layers):
            raise LayerError(
                f"got variables for {len(variables)} layers, the sequence has {len(self.layers)}"
            )
        states = []
        for i, (layer, v) in enumerate(zip(self.layers, variables, strict=True)):
            r = None if rng is None else jax.random.fold_in(rng, i)
            x, s = layer.apply(v, x, train=train, rng=r)
            states.append(s)
        return x, states

    def boundary_specs(self, variables: Sequence[Variables], x: PyTree) -> list[PyTree]:
        """Shape/dtype pytrees of the input and of each layer's output (``len + 1`` entries).

        Computed with ``jax.eval_shape``: no FLOPs are spent.
        """
        specs = [jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), x)]
        for layer, v in zip(self.layers, variables, strict=True):
            out = jax.eval_shape(
                lambda v, x, layer=layer: layer.apply(v, x, train=False)[0], v, specs[-1]
            )
            specs.append(out)
        return specs

    def merge(self, variables: Sequence[Variables]) -> dict[str, dict[str, PyTree]]:
        """Per-layer variables -> one tree ``{collection: {layer name: ...}}``."""
        tree: dict[str, dict[str, PyTree]] = {}
        for layer, v in zip(self.layers, variables, strict=True):
            for coll, value in v.items():
                tree.setdefault(coll, {})[layer.name] = value
        return tree

    def split(self, tree: Mapping[str, Mapping[str, PyTree]]) -> list[Variables]:
        """Inverse of :meth:`merge`."""
        out: list[Variables] = []
        for layer in self.layers:
            out.append({coll: sub[layer.name] for coll, sub in tree.items() if layer.name in sub})
        return out


def sequential(*modules: Any, names: Iterable[str] | None = None) -> LayerSequence:
    """Builds a :class:`LayerSequence` from linen modules, nnx modules or nnx factories.

    Args:
      *modules: the modules in order (a single list is accepted too).
      names: optional unique names; default ``"{index:02d}_{ClassName}"``.

    Returns:
      The layer sequence.

    Raises:
      LayerError: for an empty list, duplicate names, or something that is not a module.
    """
    if len(modules) == 1 and isinstance(modules[0], (list, tuple)):
        modules = tuple(modules[0])
    name_list = (
        list(names) if names is not None else [_default_name(i, m) for i, m in enumerate(modules)]
    )
    if len(name_list) != len(modules):
        raise LayerError(f"got {len(name_list)} names for {len(modules)} modules")
    return LayerSequence(tuple(as_layer(m, n) for m, n in zip(modules, name_list, strict=True)))
