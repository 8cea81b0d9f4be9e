"""Layer sequences: a model as an ordered list of Flax modules.

A :class:`Layer` is the unit pdjax profiles, partitions and places on devices. It wraps
one Flax module (``flax.linen`` or ``flax.nnx``), or a parameter-free function such as
``nn.relu`` (:class:`FnLayer`), behind two pure functions:

* ``init(rng, x) -> variables``: the layer's variables as a plain dict of collections,
  ``{"params": ..., "batch_stats": ...}``, built from a sample input ``x``;
* ``apply(variables, x, *, train, rng) -> (y, state)``: the output pytree ``y`` and the
  layer's non-parameter collections after the call (BatchNorm statistics updated in train
  mode, unchanged in eval mode).

Activations between layers are arbitrary pytrees: arrays, tuples (seq2seq), dicts.
A :class:`LayerSequence` composes layers; applying it equals applying a monolithic model
built from the same modules in the same order. Each layer owns its parameters: a module
object (or an nnx variable) reachable from two layers is refused, since pdjax would give
each layer its own copy and silently untie them. Parameters that are one, such as an
embedding shared with the output head, are declared with ``tied=`` (see :func:`sequential`):
each layer keeps a copy, and pdjax keeps the copies equal, with the gradient of the one
parameter (the sum of the copies' gradients). ``sequential(..., precision="bf16")``
computes every layer in bfloat16 with float32 parameters (:class:`PrecisionLayer`).

>>> import jax, jax.numpy as jnp, flax.linen as nn
>>> seq = sequential(nn.Dense(8), nn.Dense(4))
>>> variables = seq.init(jax.random.key(0), jnp.ones((2, 3)))
>>> y, _ = seq.apply(variables, jnp.ones((2, 3)))
>>> y.shape
(2, 4)
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pdjax.errors import LayerError
from pdjax.precision import Policy, get_policy

__all__ = [
    "Fn",
    "FnLayer",
    "Layer",
    "LayerSequence",
    "LinenLayer",
    "LossFn",
    "NnxLayer",
    "PrecisionLayer",
    "PyTree",
    "TiedLeaf",
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
#: One copy of a tied parameter: ``(layer index, path of keys inside the layer's params)``.
TiedLeaf = tuple[int, tuple[str, ...]]


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
    """What pdjax needs of one layer. Implemented by :class:`LinenLayer`, :class:`NnxLayer`
    and :class:`FnLayer`."""

    @property
    def name(self) -> str:
        """The layer's name (read-only here, so frozen dataclasses implement it too)."""
        ...

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

    def _kwargs(self, train: bool) -> dict[str, Any]:
        # Any, not bool: spread into Module.init/apply, whose own keyword parameters
        # (method, mutable, ...) mypy would match a bool against
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


def _signature(fn: Callable[..., Any]) -> inspect.Signature:
    """``inspect.signature``, but an nnx module class (or a ``functools.partial`` of one)
    gets its ``__init__``'s parameters, not its metaclass's ``(*args, **kwargs)``.

    Raises:
      TypeError, ValueError: for a callable without signature (some builtins).
    """
    if isinstance(fn, functools.partial):
        inner = _signature(fn.func)

        def proxy(*args: Any, **kwargs: Any) -> None:
            del args, kwargs

        proxy.__signature__ = inner  # type: ignore[attr-defined]
        return inspect.signature(functools.partial(proxy, *fn.args, **fn.keywords))
    if isinstance(fn, type) and issubclass(fn, nnx.Module):
        init = inspect.signature(fn.__init__)
        return init.replace(parameters=list(init.parameters.values())[1:])
    return inspect.signature(fn)


def _rngs_param(fn: Callable[..., Any]) -> tuple[inspect.Parameter | None, list[str]]:
    """How a callable would take an ``nnx.Rngs``: ``(parameter, other required names)``.

    The parameter is the one named ``rngs`` or annotated ``nnx.Rngs`` (None if there is
    none, or if the callable has no signature, as builtins and ufuncs may not).
    """
    try:
        params = _signature(fn).parameters.values()
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
    param, _ = _rngs_param(factory)
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
        self._mode = _mode_kwarg(call)
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


def _fn_name(fn: Callable[..., Any]) -> str:
    """A function's name fit for a layer name: ``relu``, ``lambda`` (``functools.partial``
    unwrapped), else its type's name."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    name = getattr(fn, "__name__", None) or type(fn).__name__
    return re.sub(r"\W+", "_", str(name)).strip("_") or "fn"


@dataclasses.dataclass(frozen=True)
class Fn:
    """Marks a callable as a parameter-free layer function ``x -> y``.

    Plain functions (``nn.relu``, ``jnp.tanh``, ``lambda x: x * 2``, a
    ``functools.partial``) are recognised without it (see :func:`as_layer`); wrap one that
    would otherwise be taken for an nnx factory, such as a function whose one parameter is
    called ``rngs``.

    >>> import jax.numpy as jnp
    >>> seq = sequential(Fn(lambda rngs: rngs * 2), jnp.tanh)
    >>> seq.names
    ('00_lambda', '01_tanh')

    Attributes:
      fn: the function, called on the previous layer's output.
    """

    fn: Callable[[PyTree], PyTree]

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise LayerError(f"Fn needs a callable, got {type(self.fn).__name__}")


@dataclasses.dataclass(frozen=True)
class FnLayer:
    """A parameter-free function ``x -> y`` as a pdjax layer.

    It has no variables (``init`` returns ``{}``) and ``apply`` calls the function, the
    same in train and eval mode; ``variables`` and ``rng`` are ignored.

    Attributes:
      fn: the function, e.g. ``nn.relu``, ``jnp.tanh``, ``lambda x: x * 2``.
      name: a unique name within its sequence.
    """

    fn: Callable[[PyTree], PyTree]
    name: str

    @property
    def kind(self) -> str:
        """The function's name (for profiles and tables)."""
        return _fn_name(self.fn)

    def init(self, rng: jax.Array, x: PyTree) -> Variables:
        """Returns no variables."""
        del rng, x
        return {}

    def apply(
        self,
        variables: Variables,
        x: PyTree,
        *,
        train: bool = False,
        rng: jax.Array | None = None,
    ) -> tuple[PyTree, Variables]:
        """Returns ``(fn(x), {})``."""
        del variables, train, rng
        return self.fn(x), {}


def _in_dtypes_of(new: Variables, old: Variables) -> Variables:
    """``new`` (a layer's collections after a call) with each float leaf cast back to the
    dtype of the same leaf in ``old`` where that differs (collections alike in structure)."""

    def back(a: Any, b: Any) -> Any:
        if not (hasattr(a, "dtype") and hasattr(b, "dtype")) or a.dtype == b.dtype:
            return a
        if jnp.issubdtype(a.dtype, jnp.floating) and jnp.issubdtype(b.dtype, jnp.floating):
            return a.astype(b.dtype)
        return a

    out = dict(new)
    for coll, tree in new.items():
        # jaxlib ships no stub for PyTreeDef, whose == mypy then cannot see
        if coll in old and jax.tree.structure(tree) == jax.tree.structure(old[coll]):  # type: ignore[operator]
            out[coll] = jax.tree.map(back, tree, old[coll])
    return out


@dataclasses.dataclass(frozen=True)
class PrecisionLayer:
    """A layer computing under a mixed precision policy (:mod:`pdjax.precision`); made by
    :func:`sequential`'s ``precision=``.

    ``apply`` casts the float leaves of the ``"params"`` collection and of the input to
    the policy's compute dtype, calls the wrapped layer, and casts its float outputs to the
    compute dtype, or to the output dtype for the model's last layer (``final``). The
    variables keep the parameters in the parameter dtype, so their gradients come back in
    it through the cast. Other collections (BatchNorm statistics) go in as they are and
    come back in their own dtypes; integer and PRNG-key leaves are never cast. ``init``
    casts the float parameters to the parameter dtype.

    The backward keeps the compute-dtype copy of the parameters among its residuals (as
    ``jax.vjp`` of any cast does), so a pipeline stage holds one such copy per microbatch
    in flight; the profiler's ``residual_bytes`` counts it.

    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> seq = sequential(nn.Dense(8), nn.Dense(4), precision="bf16")
    >>> v = seq.init(jax.random.key(0), jnp.ones((2, 3)))
    >>> v[0]["params"]["kernel"].dtype, seq.layers[0].apply(v[0], jnp.ones((2, 3)))[0].dtype
    (dtype('float32'), dtype(bfloat16))
    >>> seq.apply(v, jnp.ones((2, 3)))[0].dtype
    dtype('float32')

    Attributes:
      layer: the wrapped layer.
      policy: the ``jmp.Policy`` (see :func:`pdjax.precision.get_policy`).
      final: cast the output to the policy's output dtype (the model's last layer), not
        to its compute dtype.
    """

    layer: Layer
    policy: Policy
    final: bool = False

    @property
    def name(self) -> str:
        """The wrapped layer's name."""
        return self.layer.name

    @property
    def kind(self) -> str:
        """What the wrapped layer is (its module's class name, for profiles and tables)."""
        module = getattr(self.layer, "module", None)
        if module is not None:
            return type(module).__name__
        return str(getattr(self.layer, "kind", type(self.layer).__name__))

    def init(self, rng: jax.Array, x: PyTree) -> Variables:
        """The wrapped layer's variables for ``x`` (cast to the compute dtype), with the
        float parameters in the parameter dtype."""
        variables = dict(self.layer.init(rng, self.policy.cast_to_compute(x)))
        if "params" in variables:
            variables["params"] = self.policy.cast_to_param(variables["params"])
        return variables

    def apply(
        self,
        variables: Variables,
        x: PyTree,
        *,
        train: bool = False,
        rng: jax.Array | None = None,
    ) -> tuple[PyTree, Variables]:
        """Applies the wrapped layer in the compute dtype; see the class docstring."""
        policy = self.policy
        cast = dict(variables)
        if "params" in cast:
            cast["params"] = policy.cast_to_compute(cast["params"])
        y, state = self.layer.apply(cast, policy.cast_to_compute(x), train=train, rng=rng)
        y = policy.cast_to_output(y) if self.final else policy.cast_to_compute(y)
        return y, _in_dtypes_of(state, variables)


#: Top-level packages whose callables are functions, never nnx factories.
_FUNCTION_PACKAGES = frozenset({"builtins", "jax", "jaxlib", "math", "numpy", "operator"})


def _classify(obj: Any) -> Any:
    """``obj``, or ``Fn(obj)`` where ``obj`` is a callable taken for a plain function.

    A callable other than a module or layer is an nnx factory if it has a parameter named
    ``rngs`` (or annotated ``nnx.Rngs``) and no other required one; a function if it
    comes from JAX, NumPy or the standard library, has no signature, or, called with an
    ``nnx.Rngs`` under ``nnx.eval_shape``, fails or returns anything but an nnx module.

    Raises:
      LayerError: for a module class where an instance is needed, a callable that cannot
        take one argument, or a callable pytree holding arrays (an Equinox module, say),
        whose arrays a function layer would silently never train.
    """
    if isinstance(obj, (nn.Module, nnx.Module, Fn)) or not callable(obj):
        return obj
    if isinstance(obj, Layer) and not isinstance(obj, type):
        return obj
    what = getattr(obj, "__name__", type(obj).__name__)
    param, others = _rngs_param(obj)
    if param is not None and not others:
        return obj  # a factory rngs -> nnx.Module (an nnx class taking only rngs included)
    if isinstance(obj, type) and issubclass(obj, nn.Module):
        raise LayerError(
            f"cannot make a layer from the class {what}: pass an instance, {what}(...)"
        )
    if isinstance(obj, type) and issubclass(obj, nnx.Module):
        raise LayerError(
            f"cannot make a layer from the class {what}: pass an instance, or a factory "
            f"lambda rngs: {what}(..., rngs=rngs)"
        )
    if param is not None and param.default is inspect.Parameter.empty:
        raise LayerError(
            f"cannot make a layer from {what}: it takes rngs but also needs {others}; an "
            "nnx factory takes rngs alone (lambda rngs: Module(..., rngs=rngs))"
        )
    if any(isinstance(leaf, (jax.Array, np.ndarray)) for leaf in jax.tree.leaves(obj)):
        raise LayerError(
            f"cannot make a layer from {what}: it is a pytree holding arrays (parameters?) "
            "that a function layer would never train; pass a flax module, or wrap it in "
            "pdjax.layers.Fn if the arrays are constants"
        )
    base = obj
    while isinstance(base, functools.partial):
        base = base.func
    package = str(getattr(base, "__module__", None) or "").split(".")[0]
    if inspect.isbuiltin(base) or package in _FUNCTION_PACKAGES:
        return Fn(obj)
    try:
        signature = _signature(obj)
    except (TypeError, ValueError):
        return Fn(obj)
    try:
        signature.bind(None)
    except TypeError:
        raise LayerError(
            f"cannot make a layer from {what}{signature}: a layer function takes one "
            "input (the previous layer's output; bind the rest with functools.partial), "
            "an nnx factory one argument named rngs"
        ) from None
    # one parameter, not named rngs: a factory `lambda r: nnx.Linear(..., rngs=r)` or a
    # function; only a factory builds a module from an nnx.Rngs
    try:
        built = nnx.eval_shape(lambda: obj(nnx.Rngs(0)))
    except Exception:
        return Fn(obj)
    return obj if isinstance(built, nnx.Module) else Fn(obj)


def as_layer(module: Any, name: str) -> Layer:
    """Wraps a linen module, an nnx module or factory ``rngs -> nnx.Module``, a
    parameter-free function (or :class:`Fn`), or returns a Layer.

    A callable is an nnx factory if its parameter is named ``rngs`` (or annotated
    ``nnx.Rngs``) or if calling it with an ``nnx.Rngs`` builds an nnx module; otherwise it
    is a function ``x -> y`` (:class:`FnLayer`). Wrap a function in :class:`Fn` to say so.

    Raises:
      LayerError: if ``module`` is none of those.
    """
    return _to_layer(_classify(module), name)


def _to_layer(module: Any, name: str) -> Layer:
    if isinstance(module, nn.Module):
        return LinenLayer(module, name)
    if isinstance(module, nnx.Module):
        return NnxLayer(module, name)
    if isinstance(module, Fn):
        return FnLayer(module.fn, name)
    if isinstance(module, (LinenLayer, NnxLayer, FnLayer)):
        return module
    if isinstance(module, Layer) and not isinstance(module, type):
        return module
    if callable(module):
        return NnxLayer(module, name)
    raise LayerError(
        f"cannot make a layer from {type(module).__name__}; pass a flax.linen Module, "
        "a flax.nnx Module, a factory rngs -> nnx.Module, or a function x -> y"
    )


def _default_name(i: int, module: Any) -> str:
    if isinstance(module, Fn):
        return f"{i:02d}_{_fn_name(module.fn)}"
    return f"{i:02d}_{type(module).__name__}"


def _shareable(layer: Layer) -> Iterator[tuple[int, str, str]]:
    """``(id, what, where)`` of each object of ``layer`` that holds its parameters and could
    be reachable from another layer too: a linen module instance, or an nnx variable (with
    its path in the layer's module)."""
    if isinstance(layer, PrecisionLayer):
        yield from _shareable(layer.layer)
    elif isinstance(layer, LinenLayer):
        yield id(layer.module), f"the {type(layer.module).__name__} module instance", ""
    elif isinstance(layer, NnxLayer):
        for key, (path, var) in layer._owned.items():
            yield key, f"an nnx {type(var).__name__}", path


def _check_unshared(layers: Sequence[Layer], tied: Sequence[tuple[str, tuple[str, ...]]]) -> None:
    """Raises if two layers share a linen module instance, or an nnx variable that ``tied``
    does not declare as one parameter (both paths in the same group)."""
    group_of = {leaf: name for name, leaves in tied for leaf in leaves}
    seen: dict[int, tuple[str, str]] = {}
    for layer in layers:
        for key, what, where in _shareable(layer):
            if key not in seen:
                seen[key] = (layer.name, where)
                continue
            first, first_where = seen[key]
            if first == layer.name:
                continue
            a, b = f"{first}/{first_where}", f"{layer.name}/{where}"
            if where and first_where and group_of.get(a) is not None:
                if group_of.get(a) == group_of.get(b):
                    continue
            if where or first_where:
                what += f" ({first_where!r} in {first!r}, {where!r} in {layer.name!r})"
                hint = (
                    "declare the copies as one parameter, e.g. sequential(..., "
                    f"tied={{{where.split('/')[-1]!r}: [{a!r}, {b!r}]}}) (parameters only), "
                    "or build a separate module for each layer"
                )
            else:
                hint = (
                    "build a separate module for each layer, and declare the parameters "
                    "that are one with sequential(..., tied={'name': "
                    f"['{first}/<path in its params>', '{layer.name}/<path in its params>']}})"
                )
            raise LayerError(
                f"layers {first!r} and {layer.name!r} share {what}: sharing objects between "
                "layers is not supported yet unless declared, since pdjax gives each layer "
                f"its own copy and would silently train them apart; {hint} (tied= keeps the "
                "copies one parameter)"
            )


def _key_str(key: Any) -> str:
    """One key of a pytree path as the text a ``tied=`` path uses."""
    for attr in ("key", "idx", "name"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _lookup(tree: Any, path: tuple[str, ...]) -> Any:
    """The leaf at ``path`` (keys compared as text) in nested mappings, or None."""
    node = tree
    for part in path:
        if not isinstance(node, Mapping):
            return None
        node = next((v for k, v in node.items() if str(k) == part), None)
        if node is None:
            return None
    return None if isinstance(node, Mapping) else node


def _replaced(tree: Any, path: tuple[str, ...], value: Any) -> Any:
    """``tree`` (nested mappings) with the leaf at ``path`` replaced by ``value``."""
    if not path:
        return value
    items = dict(tree.items())
    key = next(k for k in items if str(k) == path[0])
    items[key] = _replaced(items[key], path[1:], value)
    return items if type(tree) is dict else type(tree)(items)


def _param_paths(params: Any) -> list[str]:
    return [
        "/".join(_key_str(k) for k in path)
        for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]
    ]


def _unwrapped(layer: Layer) -> Layer:
    """The layer a :class:`PrecisionLayer` wraps, else ``layer``."""
    return layer.layer if isinstance(layer, PrecisionLayer) else layer


def _known_params(layer: Layer) -> PyTree | None:
    """A layer's params (shapes) where known without a sample input: nnx layers (built at
    construction) and functions (none); None for linen modules and others."""
    if isinstance(layer, PrecisionLayer):
        params = _known_params(layer.layer)
        if params is None:
            return None
        dtype = layer.policy.param_dtype
        return jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(
                np.shape(a), dtype if jnp.issubdtype(a.dtype, jnp.floating) else a.dtype
            ),
            params,
        )
    if isinstance(layer, FnLayer):
        return {}
    if isinstance(layer, NnxLayer):
        return layer._to_collections(layer._template).get("params", {})
    return None


def _resolve_tied(
    layers: Sequence[Layer], tied: Sequence[tuple[str, tuple[str, ...]]]
) -> tuple[tuple[str, tuple[TiedLeaf, ...]], ...]:
    """``tied`` with every ``"<layer>/<path>"`` as ``(layer index, path keys)``, checked
    as far as the layers are known before any input (see :meth:`LayerSequence.check_tied`)."""
    if not tied:
        return ()
    names = [layer.name for layer in layers]
    where: dict[TiedLeaf, str] = {}
    out = []
    for group, leaves in tied:
        if len(leaves) < 2:
            raise LayerError(
                f"tied[{group!r}] lists {len(leaves)} leaf; a tied group names every copy of "
                "one parameter, at least two"
            )
        resolved = []
        for text in leaves:
            owners = [n for n in names if text.startswith(n + "/")]
            if not owners:
                raise LayerError(
                    f"tied[{group!r}] names {text!r}, but no layer is called that: write "
                    f"'<layer name>/<path in its params>' with a layer of {names}"
                )
            name = max(owners, key=len)
            i = names.index(name)
            path = tuple(text[len(name) + 1 :].split("/"))
            if not all(path):
                raise LayerError(
                    f"tied[{group!r}] names {text!r}: the path inside layer {name!r} is empty "
                    "or has an empty key"
                )
            if isinstance(_unwrapped(layers[i]), FnLayer):
                raise LayerError(
                    f"tied[{group!r}] names {text!r}, but layer {name!r} is a function "
                    "without parameters"
                )
            leaf = (i, path)
            if leaf in where:
                other = where[leaf]
                again = "twice" if other == group else f"in groups {other!r} and {group!r}"
                raise LayerError(
                    f"{text!r} is listed {again} of tied=; a parameter belongs to one group"
                )
            where[leaf] = group
            resolved.append(leaf)
        out.append((group, tuple(resolved)))
    result = tuple(out)
    known = [_known_params(layer) for layer in layers]
    _check_leaves(layers, result, lambda i: known[i])
    return result


def _check_leaves(
    layers: Sequence[Layer],
    groups: Sequence[tuple[str, tuple[TiedLeaf, ...]]],
    params_of: Callable[[int], Any],
) -> None:
    """Every tied leaf exists in its layer's params (where ``params_of(i)`` is known, not
    None) and has the first leaf's shape and dtype."""
    for group, leaves in groups:
        first: tuple[str, Any] | None = None
        for i, path in leaves:
            params = params_of(i)
            if params is None:
                continue
            text = f"{layers[i].name}/{'/'.join(path)}"
            leaf = _lookup(params, path)
            if leaf is None:
                raise LayerError(
                    f"tied[{group!r}] names {text!r}, but layer {layers[i].name!r} has no "
                    f"parameter at {'/'.join(path)!r}; its parameters are "
                    f"{_param_paths(params)}"
                )
            dtype = leaf.dtype if hasattr(leaf, "dtype") else np.asarray(leaf).dtype
            sig = (tuple(np.shape(leaf)), str(dtype))
            if first is None:
                first = (text, sig)
            elif sig != first[1]:
                raise LayerError(
                    f"tied[{group!r}]: {text!r} is {sig[1]}{list(sig[0])} but {first[0]!r} is "
                    f"{first[1][1]}{list(first[1][0])}; tied copies need one shape and dtype"
                )


@dataclasses.dataclass(frozen=True)
class LayerSequence:
    """An ordered sequence of layers, applied one after the other.

    Variables are kept per layer, as a list (index ``i`` for layer ``i``); :meth:`merge`
    turns them into one Flax-style tree keyed by layer name and :meth:`split` back.

    Attributes:
      layers: the layers, in order; names are unique.
      tied: the tied parameters (:func:`sequential`'s ``tied=``), as ``(group name,
        ("<layer name>/<path in its params>", ...))`` pairs; a mapping is accepted too.
    """

    layers: tuple[Layer, ...]
    tied: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def __post_init__(self) -> None:
        if not self.layers:
            raise LayerError("a layer sequence needs at least one layer")
        names = [layer.name for layer in self.layers]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise LayerError(f"layer names must be unique; repeated: {dupes}")
        tied = _normalise_tied(self.tied)
        object.__setattr__(self, "tied", tied)
        object.__setattr__(self, "_tied_leaves", _resolve_tied(self.layers, tied))
        _check_unshared(self.layers, tied)

    @property
    def tied_leaves(self) -> tuple[tuple[str, tuple[TiedLeaf, ...]], ...]:
        """The tied groups with each copy as ``(layer index, path keys)``, first listed first."""
        return self._tied_leaves  # type: ignore[attr-defined,no-any-return]

    def check_tied(self, variables: Sequence[Variables]) -> None:
        """Checks ``tied`` against per-layer variables (arrays or shapes): every listed
        path is a parameter of its layer, and each group's copies share one shape and dtype.

        Raises:
          LayerError: naming the group, the leaf and what is wrong.
        """
        if self.tied:
            _check_leaves(self.layers, self.tied_leaves, lambda i: variables[i].get("params", {}))

    def tie(self, variables: Sequence[Variables]) -> list[Variables]:
        """``variables`` with every tied copy set to its group's first listed leaf."""
        out = [dict(v) for v in variables]
        for _, leaves in self.tied_leaves:
            i0, path0 = leaves[0]
            value = _lookup(out[i0]["params"], path0)
            for i, path in leaves[1:]:
                out[i]["params"] = _replaced(out[i]["params"], path, value)
        return out

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self) -> Iterator[Layer]:
        return iter(self.layers)

    def __getitem__(self, index: slice | int) -> LayerSequence:
        """A contiguous sub-sequence (an int gives a one-layer sequence)."""
        if isinstance(index, int):
            index = slice(index, index + 1 if index != -1 else None)
        layers = tuple(self.layers[index])
        inside = {layer.name for layer in layers}
        tied = []  # the groups with at least two copies inside
        for name, leaves in self.tied:
            kept = tuple(t for t in leaves if any(t.startswith(n + "/") for n in inside))
            if len(kept) > 1:
                tied.append((name, kept))
        return LayerSequence(layers, tuple(tied))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(layer.name for layer in self.layers)

    @property
    def precision(self) -> Policy | None:
        """The mixed precision policy every layer computes under (:func:`sequential`'s
        ``precision=``), or None if some layer has none or they differ."""
        policies = {getattr(layer, "policy", None) for layer in self.layers}
        if len(policies) != 1 or not all(isinstance(layer, PrecisionLayer) for layer in self):
            return None
        return policies.pop()

    def init(self, rng: jax.Array, x: PyTree) -> list[Variables]:
        """Initialises every layer in turn, feeding each the previous layer's output.

        Layer ``i`` is initialised from ``jax.random.fold_in(rng, i)``; then every tied
        copy takes its group's first listed leaf (:meth:`tie`). Under ``jax.eval_shape``
        this costs no compute (useful for paper-size models).

        Raises:
          LayerError: for a ``tied`` path that is not a parameter, or copies of different
            shapes or dtypes.
        """
        variables = []
        for i, layer in enumerate(self.layers):
            v = layer.init(jax.random.fold_in(rng, i), x)
            x, _ = layer.apply(v, x, train=False)
            variables.append(v)
        if not self.tied:
            return variables
        self.check_tied(variables)
        return self.tie(variables)

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


def _normalise_tied(tied: Any) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """``tied`` (a mapping or pairs) as ``((name, (leaf, ...)), ...)``, types checked."""
    if tied is None:
        return ()
    items = tied.items() if isinstance(tied, Mapping) else tied
    try:
        pairs = [(name, leaves) for name, leaves in items]
    except (TypeError, ValueError):
        raise LayerError(
            "tied must map a group name to its leaves, e.g. tied={'wte': "
            "['00_Embed/embedding', '05_Head/embedding']}"
        ) from None
    out = []
    for name, leaves in pairs:
        if not isinstance(name, str):
            raise LayerError(f"tied group names are strings, got {name!r}")
        if isinstance(leaves, str) or not isinstance(leaves, Iterable):
            raise LayerError(
                f"tied[{name!r}] must list the copies as '<layer name>/<path in its params>' "
                f"strings, got {leaves!r}"
            )
        leaves = tuple(leaves)
        bad = [leaf for leaf in leaves if not isinstance(leaf, str)]
        if bad:
            raise LayerError(f"tied[{name!r}] holds {bad[0]!r}; write '<layer>/<path>' strings")
        out.append((name, leaves))
    return tuple(out)


def sequential(
    *modules: Any,
    names: Iterable[str] | None = None,
    tied: Mapping[str, Sequence[str]] | None = None,
    precision: Policy | str | None = None,
) -> LayerSequence:
    """Builds a :class:`LayerSequence` from linen modules, nnx modules or nnx factories,
    and parameter-free functions (see :func:`as_layer`).

    Args:
      *modules: the modules in order (a single list is accepted too).
      names: optional unique names; default ``"{index:02d}_{ClassName}"``, for a function
        ``"{index:02d}_{function name}"`` (``"02_relu"``, ``"03_lambda"``).
      tied: parameters that are one (an embedding shared with the output head): group
        name -> the copies, each ``"<layer name>/<path in the layer's params>"``, e.g.
        ``{"wte": ["00_Embed/embedding", "05_Head/embedding"]}`` where the head holds a
        parameter ``embedding`` of the same shape and dtype and computes ``x @
        embedding.T``. Each layer keeps its copy; every copy starts as the first listed
        one, and training treats the group as one parameter (its gradient is the sum of
        the copies', the optimizer sees it once) so the copies stay equal. An nnx
        variable shared by two layers is accepted when its two paths are declared here.
      precision: a mixed precision policy (a ``jmp.Policy``, or a string such as
        ``"bf16"`` or ``"params=float32,compute=bfloat16,output=float32"``; see
        :func:`pdjax.precision.get_policy`): every layer becomes a
        :class:`PrecisionLayer`, computing in the compute dtype with its parameters kept
        in the parameter dtype, activations between layers (and pipeline stages) in the
        compute dtype, and the last layer's output in the output dtype, for the loss.

    Returns:
      The layer sequence.

    Raises:
      LayerError: for an empty list, duplicate names, something that is not a module, a
        module instance or nnx variable shared by two layers and not declared tied, or a
        ``tied`` entry naming no layer, no parameter (checked where shapes are known: nnx
        layers here, linen ones at ``init``), copies of different shapes or dtypes, or a
        leaf in two groups; a ``precision`` that is not a policy, holds float16 (it
        needs loss scaling, which pdjax does not do yet: use bfloat16), or is given for a
        layer that already has one.

    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> tied = {"k": ["00_Dense/kernel", "01_Dense/kernel"]}
    >>> seq = sequential(nn.Dense(4), nn.Dense(4), tied=tied)
    >>> v = seq.init(jax.random.key(0), jnp.ones((2, 4)))
    >>> bool((v[0]["params"]["kernel"] == v[1]["params"]["kernel"]).all())
    True
    """
    if len(modules) == 1 and isinstance(modules[0], (list, tuple)):
        modules = tuple(modules[0])
    modules = tuple(_classify(m) for m in modules)
    name_list = (
        list(names) if names is not None else [_default_name(i, m) for i, m in enumerate(modules)]
    )
    if len(name_list) != len(modules):
        raise LayerError(f"got {len(name_list)} names for {len(modules)} modules")
    layers = tuple(_to_layer(m, n) for m, n in zip(modules, name_list, strict=True))
    if precision is not None:
        policy = get_policy(precision)
        for layer in layers:
            if isinstance(layer, PrecisionLayer):
                raise LayerError(
                    f"layer {layer.name!r} already computes under precision {layer.policy}; "
                    f"give precision= once (pass its .layer to wrap it under {policy})"
                )
        last = len(layers) - 1
        layers = tuple(
            PrecisionLayer(layer, policy, final=i == last) for i, layer in enumerate(layers)
        )
    return LayerSequence(layers, _normalise_tied(tied))
