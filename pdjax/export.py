"""Trained variables back into the user's own model.

pdjax trains a :class:`~pdjax.layers.LayerSequence`: per layer, a dict of collections
(``{"params": ..., "batch_stats": ...}``) named by pdjax's layer names. A user's model
names its parts its own way. Two ways back:

* **nnx**: :func:`update_nnx` writes each layer's variables into the module object the
  layer was built from (``nnx.update``), so the user's model, which holds those very
  objects, now has the trained values under its own attribute names; for the layers of
  :func:`~pdjax.split_model`, into the nnx model that was split.
* **linen**: :func:`linen_variables` builds the user's variable tree, each layer's
  collections under the name the user's parent module gives that submodule.

>>> import jax, jax.numpy as jnp, flax.linen as nn
>>> import pdjax
>>> seq = pdjax.sequential(nn.Dense(4), nn.relu, nn.Dense(2))
>>> variables = seq.init(jax.random.key(0), jnp.ones((1, 3)))
>>> tree = linen_variables(seq, variables, names=["layers_0", None, "layers_2"])
>>> sorted(tree["params"])
['layers_0', 'layers_2']
>>> y = nn.Sequential([nn.Dense(4), nn.relu, nn.Dense(2)]).apply(tree, jnp.ones((1, 3)))
>>> bool(jnp.allclose(y, seq.apply(variables, jnp.ones((1, 3)))[0]))
True
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
from flax import nnx

from pdjax.errors import LayerError
from pdjax.layers import FnLayer, LayerSequence, LinenLayer, NnxLayer, SplitLayer, Variables
from pdjax.layers.split.cuts import leaf_path
from pdjax.layers.split.nnx_model import NnxSplitter
from pdjax.layers.tied import leaf_positions

__all__ = ["linen_variables", "update_nnx"]


def _inner(layer: Any) -> Any:
    """The layer under any wrappers (a mixed precision policy's)."""
    while hasattr(layer, "layer"):
        layer = layer.layer
    return layer


def _on(device: jax.Device | None, tree: Any) -> Any:
    """``tree`` on one device (every stage's arrays together), as a user's model expects."""
    return jax.device_put(tree, jax.devices()[0] if device is None else device)


def update_nnx(
    layers: LayerSequence,
    variables: Sequence[Variables],
    model: nnx.Module | None = None,
    *,
    device: jax.Device | None = None,
) -> nnx.Module | None:
    """Writes ``variables`` (per layer, e.g. ``pipe.variables(state)``) into the nnx
    modules the layers were built from, on one ``device`` (default: the first).

    Args:
      layers: the layer sequence, whose nnx layers were given module *instances*
        (``pdjax.sequential(model.embed, *model.blocks, model.head)``), or the whole
        ``split_model(model, ...)`` of an nnx model (its state is written into
        ``model``, as ``nnx.update(model, layers.model_variables(variables))``).
      variables: per layer, its variables.
      model: the user's whole model, optional: checked to hold every nnx layer's module
        (so the update lands where the user looks; for a split, to be the model split),
        and returned.
      device: where the values go.

    Returns:
      ``model``.

    Raises:
      LayerError: for a layer built from a factory (it has no module of the user's to
        update: use the variables), a linen layer (use :func:`linen_variables`; a split
        linen model: ``layers.model_variables``), a module that ``model`` does not hold,
        part of a split, or variables of another length.
    """
    if len(variables) != len(layers):
        raise LayerError(f"got variables for {len(variables)} layers, the model has {len(layers)}")
    split = [_inner(layer) for layer in layers if isinstance(_inner(layer), SplitLayer)]
    if split:
        return _update_split(layers, split, variables, model, device)
    held = {id(node) for _, node in nnx.iter_graph(model)} if model is not None else None
    updates = []
    for layer, v in zip(layers, variables, strict=True):
        inner = _inner(layer)
        if isinstance(inner, FnLayer):
            continue
        if isinstance(inner, LinenLayer):
            raise LayerError(
                f"layer {layer.name!r} is a linen module: linen keeps no variables in the "
                "module; build the tree with pdjax.export.linen_variables"
            )
        if not isinstance(inner, NnxLayer) or inner._instance is None:
            raise LayerError(
                f"layer {layer.name!r} was built from a factory, so no module of yours holds "
                "its variables: take them from pipe.variables(state), or build the layers "
                "from your model's module instances"
            )
        if held is not None and id(inner._instance) not in held:
            raise LayerError(
                f"layer {layer.name!r}'s module ({inner.kind}) is not part of the model "
                "given: pass the model whose submodules the layers were built from"
            )
        updates.append((inner._instance, inner._to_state(_on(device, v))))
    for module, state in updates:  # only once every layer has been checked
        nnx.update(module, state)
    return model


def _update_split(
    layers: LayerSequence,
    split: Sequence[SplitLayer],
    variables: Sequence[Variables],
    model: nnx.Module | None,
    device: jax.Device | None,
) -> nnx.Module | None:
    """:func:`update_nnx` for the layers of :func:`~pdjax.split_model`: the model's whole
    ``nnx.State`` from the layers' variables, written into the nnx model that was split."""
    owner = split[0].splitter
    if (
        len(split) != len(layers)
        or any(s.splitter is not owner for s in split)
        or [s.index for s in split] != list(range(len(owner.names)))
    ):
        raise LayerError(
            "update_nnx takes the whole split_model(...) of one model (every layer of it, "
            "in order), not a part of it or a mix with other layers"
        )
    if not isinstance(owner, NnxSplitter):
        raise LayerError(
            "these layers split a linen model, which keeps no variables in the module: "
            "take its tree with layers.model_variables(pipe.variables(state)) and call "
            "model.apply(tree, x)"
        )
    if model is not None and model is not owner.model:
        raise LayerError(
            f"the layers split another {type(owner.model).__name__} than the model given: "
            "pass the model given to split_model (or none)"
        )
    flat: dict[tuple[str, ...], Any] = {}
    for v in variables:
        for path, leaf in jax.tree_util.tree_flatten_with_path(dict(v))[0]:
            flat.setdefault(leaf_path(path), leaf)
    nnx.update(owner.model, owner.model_tree(flat, device or jax.devices()[0]))
    return model


def _only_tied_copies(
    layers: LayerSequence, i: int, variables: Variables, chosen: Sequence[str | None]
) -> bool:
    """Whether all layer ``i`` holds (``variables``) are tied copies (``sequential(...,
    tied=...)``) of parameters that another layer, one with a name in ``chosen``, holds."""
    if any(jax.tree.leaves(tree) for coll, tree in variables.items() if coll != "params"):
        return False
    params = variables.get("params", {})
    where = leaf_positions(params)
    copies = {
        where.get(path)
        for _, leaves in layers.tied_leaves
        if any(j != i and chosen[j] is not None for j, _ in leaves)
        for j, path in leaves
        if j == i
    }
    return copies >= set(range(len(jax.tree.leaves(params))))


def linen_variables(
    layers: LayerSequence,
    variables: Sequence[Variables],
    names: Sequence[str | None] | Mapping[str, str] | None = None,
    *,
    device: jax.Device | None = None,
) -> dict[str, dict[str, Any]]:
    """The user's linen variable tree ``{collection: {submodule name: ...}}`` from per-layer
    ``variables`` (e.g. ``pipe.variables(state)``), on one ``device`` (default: the first).

    Args:
      layers: the layer sequence.
      variables: per layer, its variables.
      names: the name of each layer's submodule in the user's parent module: one per layer
        (``None`` for a layer without variables, or for one holding only tied copies of
        parameters a named layer exports: the user's model holds them once), or a
        mapping from pdjax layer names (``layers.names``); default: the layers' names, so
        name the layers as your parent module names its submodules (``sequential(...,
        names=["encoder", ...])``; ``nn.Sequential`` names them ``layers_0``,
        ``layers_1``, ...).

    Raises:
      LayerError: for a name list of another length, two layers with variables under one
        name, or a layer with variables (other than tied copies) and no name.

    Parameters in flax metadata boxes (``nn.with_logical_partitioning``) stay boxed, their
    sharding annotations kept.
    """
    if len(variables) != len(layers):
        raise LayerError(f"got variables for {len(variables)} layers, the model has {len(layers)}")
    if names is None:
        chosen: list[str | None] = list(layers.names)
    elif isinstance(names, Mapping):
        unknown = sorted(set(names) - set(layers.names))
        if unknown:
            raise LayerError(f"names maps unknown layers {unknown}; the layers: {layers.names}")
        chosen = [names.get(n) for n in layers.names]
    else:
        chosen = list(names)
        if len(chosen) != len(layers):
            raise LayerError(f"got {len(chosen)} names for {len(layers)} layers")
    out: dict[str, dict[str, Any]] = {}
    for layer, v, name in zip(layers, _on(device, list(variables)), chosen, strict=True):
        if not jax.tree.leaves(v):
            continue
        if name is None and _only_tied_copies(layers, layers.names.index(layer.name), v, chosen):
            continue  # the user's model holds the parameter once, under another layer's name
        if name is None:
            raise LayerError(
                f"layer {layer.name!r} has variables but no name in names (a layer may go "
                "without a name only if all it holds are tied copies of parameters that "
                "a named layer exports)"
            )
        for coll, tree in v.items():
            if not jax.tree.leaves(tree):
                continue
            if name in out.setdefault(coll, {}):
                raise LayerError(f"two layers put their {coll!r} under the name {name!r}")
            out[coll][name] = tree
    return out
