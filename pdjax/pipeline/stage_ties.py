"""A stage's tied parameter copies (:class:`StageTies`): which leaves of its parameters are
copies of a group tied across stages, which stage owns each group, and the views and
exchanges its update makes for them (see :mod:`pdjax.pipeline.stage`'s tied parameters).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax

from pdjax.layers import PyTree

__all__ = ["StageTies"]


@dataclasses.dataclass(frozen=True)
class StageTies:
    """A stage's copies of tied parameters, and what its update exchanges for them.

    Leaves are indices into ``jax.tree.leaves`` of the stage's parameters (its per-layer
    list). A group's *owner* is the first stage that holds a copy of it (``holders[i][0]``):
    the only one whose optimizer sees it. Groups and tuples exchanged with a stage are in
    the model's group order, so both ends agree on them.

    Attributes:
      stage: this stage's index.
      names: per tied group with a copy here, its name.
      copies: per group, its copies' leaf indices, first listed first (the owner's
        optimizer sees the first).
      holders: per group, the stages holding a copy, ascending (this one included).
    """

    stage: int
    names: tuple[str, ...]
    copies: tuple[tuple[int, ...], ...]
    holders: tuple[tuple[int, ...], ...]

    def owned(self, i: int) -> bool:
        return self.holders[i][0] == self.stage

    @property
    def members(self) -> tuple[int, ...]:
        """The other stages holding copies of groups this stage owns: they send it their
        gradients (``pg``) and get the new values (``nw``) from its update."""
        return tuple(
            sorted({r for i, h in enumerate(self.holders) if self.owned(i) for r in h[1:]})
        )

    @property
    def owners(self) -> tuple[int, ...]:
        """The owners of the groups this stage holds but does not own."""
        return tuple(sorted({h[0] for i, h in enumerate(self.holders) if not self.owned(i)}))

    def _with(self, peer: int, owner: int) -> tuple[int, ...]:
        """The groups owned by ``owner`` that ``peer`` holds, by position here."""
        return tuple(i for i, h in enumerate(self.holders) if h[0] == owner and peer in h)

    @property
    def hidden(self) -> frozenset[int]:
        """The leaves the optimizer does not see: every copy but an owned group's first."""
        return frozenset(
            c
            for i, copies in enumerate(self.copies)
            for c in (copies[1:] if self.owned(i) else copies)
        )

    def view(self, tree: PyTree) -> PyTree:
        """``tree`` (parameters or gradients) as the optimizer sees it: hidden leaves None."""
        leaves, treedef = jax.tree.flatten(tree)
        hidden = self.hidden
        return jax.tree.unflatten(
            treedef, [None if k in hidden else a for k, a in enumerate(leaves)]
        )

    def _local_sum(self, leaves: Sequence[Any], i: int) -> Any:
        total = leaves[self.copies[i][0]]
        for c in self.copies[i][1:]:
            total = total + leaves[c]
        return total

    def partials(self, grads: PyTree) -> tuple[tuple[jax.Array, ...], ...]:
        """Per owner (:attr:`owners`), this stage's summed gradients of the groups it
        holds for that owner."""
        leaves = jax.tree.leaves(grads)
        return tuple(
            tuple(self._local_sum(leaves, i) for i in self._with(self.stage, o))
            for o in self.owners
        )

    def grad_view(self, grads: PyTree, incoming: Sequence[Sequence[jax.Array]]) -> PyTree:
        """The gradients as the optimizer sees them: an owned group's first copy holds the
        group's whole gradient, the other holders' sums (``incoming``, per
        :attr:`members`) added to this stage's in stage order; hidden leaves None."""
        leaves, treedef = jax.tree.flatten(grads)
        parts: dict[int, dict[int, Any]] = {}
        for r, values in zip(self.members, incoming, strict=True):
            for i, v in zip(self._with(r, self.stage), values, strict=True):
                parts.setdefault(i, {})[r] = v
        out = list(leaves)
        for i, copies in enumerate(self.copies):
            if not self.owned(i):
                continue
            got = {**parts.get(i, {}), self.stage: self._local_sum(leaves, i)}
            total = got[self.holders[i][0]]
            for r in self.holders[i][1:]:
                total = total + got[r]
            out[copies[0]] = total
        hidden = self.hidden
        return jax.tree.unflatten(treedef, [None if k in hidden else a for k, a in enumerate(out)])

    def expand(
        self, new_view: PyTree, treedef: Any, received: Sequence[Sequence[jax.Array]]
    ) -> tuple[PyTree, tuple[tuple[jax.Array, ...], ...]]:
        """The stage's new parameters from the optimizer's (``new_view``, hidden leaves
        None) and the owners' new values (``received``, per :attr:`owners`), and the new
        values this stage sends (per :attr:`members`)."""
        leaves = jax.tree.flatten(new_view, is_leaf=lambda a: a is None)[0]
        value: dict[int, Any] = {}
        for i, copies in enumerate(self.copies):
            if self.owned(i):
                value[i] = leaves[copies[0]]
        for o, values in zip(self.owners, received, strict=True):
            for i, v in zip(self._with(self.stage, o), values, strict=True):
                value[i] = v
        for i, copies in enumerate(self.copies):
            for c in copies:
                leaves[c] = value[i]
        sent = tuple(tuple(value[i] for i in self._with(r, self.stage)) for r in self.members)
        return jax.tree.unflatten(treedef, leaves), sent
