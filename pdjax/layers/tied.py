"""Tied parameters (``sequential(..., tied=...)``): checking, resolving and reading the
copies of one parameter held by several layers, and refusing objects two layers share
undeclared."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax.core import meta

from pdjax._trees import key_str
from pdjax.errors import LayerError
from pdjax.layers.base import Layer, PyTree, TiedLeaf
from pdjax.layers.fn_layer import FnLayer
from pdjax.layers.linen_layer import LinenLayer
from pdjax.layers.nnx_layer import NnxLayer
from pdjax.layers.precision_layer import PrecisionLayer


def normalise_tied(tied: Any) -> tuple[tuple[str, tuple[str, ...]], ...]:
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


def check_unshared(layers: Sequence[Layer], tied: Sequence[tuple[str, tuple[str, ...]]]) -> None:
    """Raises if two layers share a linen module instance, or an nnx variable that ``tied``
    does not declare as one parameter (both paths in the same group)."""
    group_of = {leaf: name for name, leaves in tied for leaf in leaves}
    group_of |= {  # an nnx variable's path also spelled with its field, '<path>/value'
        leaf.removesuffix("/value"): name
        for name, leaves in tied
        for leaf in leaves
        if leaf.endswith("/value") and leaf.removesuffix("/value") not in group_of
    }
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


def _boxed(node: Any) -> bool:
    """Whether ``node`` is a parameter in a flax metadata box (``nn.Partitioned``,
    ``nn.LogicallyPartitioned``: ``nn.with_partitioning``, ``nn.with_logical_partitioning``)."""
    return isinstance(node, meta.AxisMetadata)


def unboxed(node: Any) -> Any:
    """A boxed parameter's value (no sharding constraint applied), else ``node``."""
    if isinstance(node, meta.Partitioned):
        return node.value
    if isinstance(node, meta.AxisMetadata):
        return node.unbox()
    return node


def locate(tree: Any, path: tuple[str, ...]) -> tuple[Any, tuple[str, ...]] | None:
    """The parameter at ``path`` (keys compared as text) in nested mappings, and its path
    as ``tied=`` names it, or None. A boxed parameter (:func:`_boxed`) is found at its own
    path (``embed/embedding``) and at its box's field (``embed/embedding/value``, as
    ``jax.tree_util`` paths spell it), and returned with its box."""
    node = tree
    for n, part in enumerate(path):
        if _boxed(node):
            return (node, path[:n]) if path[n:] == ("value",) else None
        if not isinstance(node, Mapping):
            return None
        node = next((v for k, v in node.items() if str(k) == part), None)
        if node is None:
            return None
    return None if isinstance(node, Mapping) else (node, path)


def lookup(tree: Any, path: tuple[str, ...]) -> Any:
    """The parameter at ``path`` (see :func:`locate`; boxed ones in their box), or None."""
    found = locate(tree, path)
    return None if found is None else found[0]


def replaced(tree: Any, path: tuple[str, ...], value: Any) -> Any:
    """``tree`` (nested mappings) with the parameter at ``path`` (see :func:`locate`) set to
    ``value``'s value; a boxed one keeps its own box (its metadata), with the value in it."""
    if _boxed(tree):
        return tree.replace_boxed(unboxed(value))
    if not path:
        return unboxed(value)
    items = dict(tree.items())
    key = next(k for k in items if str(k) == path[0])
    items[key] = replaced(items[key], path[1:], value)
    return items if type(tree) is dict else type(tree)(items)


def leaf_positions(params: Any) -> dict[tuple[str, ...], int]:
    """Each parameter of ``params`` by its path (keys as text) -> its index in
    ``jax.tree.leaves(params)``; a boxed one by its own path and by its box's field's
    (``.../embedding`` and ``.../embedding/value``)."""
    out: dict[tuple[str, ...], int] = {}
    n = 0
    for path, node in jax.tree_util.tree_flatten_with_path(params, is_leaf=_boxed)[0]:
        keys = tuple(key_str(k) for k in path)
        inner = jax.tree_util.tree_flatten_with_path(node)[0]
        if _boxed(node) and len(inner) == 1:
            out[keys] = n
        for j, (sub, _) in enumerate(inner):
            out[(*keys, *(key_str(k) for k in sub))] = n + j
        n += len(inner)
    return out


def _param_paths(params: Any) -> list[str]:
    return [
        "/".join(key_str(k) for k in path)
        for path, _ in jax.tree_util.tree_flatten_with_path(params, is_leaf=_boxed)[0]
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


def _own_path(params: Any, path: tuple[str, ...]) -> tuple[str, ...]:
    """``path`` without a trailing ``value`` (an nnx variable's or a metadata box's field)
    where ``params`` are known and the path names a parameter without it."""
    if params is None or path[-1] != "value" or lookup(params, path) is not None:
        return path
    return path[:-1] if lookup(params, path[:-1]) is not None else path


def resolve_tied(
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
    known = [_known_params(layer) for layer in layers]
    result = tuple(
        (group, tuple((i, _own_path(known[i], path)) for i, path in leaves))
        for group, leaves in out
    )
    check_leaves(layers, result, lambda i: known[i])
    return result


def check_leaves(
    layers: Sequence[Layer],
    groups: Sequence[tuple[str, tuple[TiedLeaf, ...]]],
    params_of: Callable[[int], Any],
) -> None:
    """Every tied leaf exists in its layer's params (where ``params_of(i)`` is known, not
    None), is listed once (a boxed parameter's two spellings are one leaf) and has the
    first leaf's shape and dtype."""
    seen: dict[tuple[int, tuple[str, ...]], tuple[str, str]] = {}
    for group, leaves in groups:
        first: tuple[str, Any] | None = None
        for i, path in leaves:
            params = params_of(i)
            if params is None:
                continue
            text = f"{layers[i].name}/{'/'.join(path)}"
            found = locate(params, path)
            if found is None:
                raise LayerError(
                    f"tied[{group!r}] names {text!r}, but layer {layers[i].name!r} has no "
                    f"parameter at {'/'.join(path)!r}; its parameters are "
                    f"{_param_paths(params)}"
                )
            leaf, canonical = unboxed(found[0]), (i, found[1])
            if canonical in seen:
                other, other_text = seen[canonical]
                again = "twice" if other == group else f"in groups {other!r} and {group!r}"
                raise LayerError(
                    f"{other_text!r} and {text!r} name one parameter, listed {again} of "
                    "tied=; a parameter belongs to one group, listed once"
                )
            seen[canonical] = (group, text)
            dtype = leaf.dtype if hasattr(leaf, "dtype") else np.asarray(leaf).dtype
            sig = (tuple(np.shape(leaf)), str(dtype))
            if first is None:
                first = (text, sig)
            elif sig != first[1]:
                raise LayerError(
                    f"tied[{group!r}]: {text!r} is {sig[1]}{list(sig[0])} but {first[0]!r} is "
                    f"{first[1][1]}{list(first[1][0])}; tied copies need one shape and dtype"
                )
