"""Building a :class:`~pdjax.layers.LayerSequence` from what users write: linen and nnx
modules, nnx factories and plain functions (:func:`sequential`, :func:`as_layer`)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from flax import nnx

from pdjax.errors import LayerError
from pdjax.layers.base import Layer
from pdjax.layers.fn_layer import Fn, FnLayer, fn_name
from pdjax.layers.linen_layer import LinenLayer
from pdjax.layers.nnx_layer import NnxLayer, init_signature, rngs_param
from pdjax.layers.precision_layer import PrecisionLayer
from pdjax.layers.sequence import LayerSequence
from pdjax.layers.tied import normalise_tied
from pdjax.precision import Policy, get_policy

__all__ = ["as_layer", "sequential"]


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
    param, others = rngs_param(obj)
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
        signature = init_signature(obj)
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
        return f"{i:02d}_{fn_name(module.fn)}"
    return f"{i:02d}_{type(module).__name__}"


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
        float16 (``"f16"``) trains only with a loss-scaled optimizer
        (:func:`pdjax.precision.loss_scaled`).

    Returns:
      The layer sequence.

    Raises:
      LayerError: for an empty list, duplicate names, something that is not a module, a
        module instance or nnx variable shared by two layers and not declared tied, or a
        ``tied`` entry naming no layer, no parameter (checked where shapes are known: nnx
        layers here, linen ones at ``init``), copies of different shapes or dtypes, or a
        leaf in two groups; a ``precision`` that is not a policy, or is given for a
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
    if names is not None and (isinstance(names, str) or not isinstance(names, Iterable)):
        raise LayerError(
            f"names must be a list of strings, one per module, got {type(names).__name__} {names!r}"
        )
    name_list = (
        list(names) if names is not None else [_default_name(i, m) for i, m in enumerate(modules)]
    )
    bad = [n for n in name_list if not isinstance(n, str) or not n]
    if bad:
        raise LayerError(f"names must be non-empty strings, got {bad[0]!r} in {name_list}")
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
    return LayerSequence(layers, normalise_tied(tied))
