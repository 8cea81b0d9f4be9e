"""The :class:`LayerSequence`: layers applied one after the other, with their variables
kept per layer and their tied parameters kept equal."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence

import jax

from pdjax.errors import LayerError
from pdjax.layers.base import Layer, PyTree, TiedLeaf, Variables
from pdjax.layers.precision_layer import PrecisionLayer
from pdjax.layers.tied import (
    check_leaves,
    check_unshared,
    lookup,
    normalise_tied,
    replaced,
    resolve_tied,
)
from pdjax.precision import Policy

__all__ = ["LayerSequence"]


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
        tied = normalise_tied(self.tied)
        object.__setattr__(self, "tied", tied)
        object.__setattr__(self, "_tied_leaves", resolve_tied(self.layers, tied))
        check_unshared(self.layers, tied)

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
            check_leaves(self.layers, self.tied_leaves, lambda i: variables[i].get("params", {}))

    def tie(self, variables: Sequence[Variables]) -> list[Variables]:
        """``variables`` with every tied copy set to its group's first listed leaf."""
        out = [dict(v) for v in variables]
        for _, leaves in self.tied_leaves:
            i0, path0 = leaves[0]
            value = lookup(out[i0]["params"], path0)
            for i, path in leaves[1:]:
                out[i]["params"] = replaced(out[i]["params"], path, value)
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
