"""How a pipeline lays out its parameters and optimizer state, per stage
(:class:`ParamLayout`, from :meth:`Pipeline.param_layout
<pdjax.pipeline.Pipeline.param_layout>`): what code outside the runtime (moving a
checkpoint into another plan, :mod:`pdjax.runners.checkpoint.replan`) reads instead of the
stages' internals."""

from __future__ import annotations

import dataclasses

import jax

from pdjax.layers import PyTree
from pdjax.pipeline.executor.decisions import Decisions
from pdjax.pipeline.executor.stages import StageSet

__all__ = ["ParamLayout", "TiedGroup", "param_layout"]


@dataclasses.dataclass(frozen=True)
class TiedGroup:
    """A tied parameter group with copies on a stage.

    Attributes:
      name: the group's name (``sequential(..., tied=...)``).
      copies: the leaves of the stage's parameters (indices into ``jax.tree.leaves`` of
        its per-layer list) that are copies of the group, the first listed first.
      holders: the stages holding a copy, ascending; the first owns the group (only its
        optimizer sees it, at its first copy).
    """

    name: str
    copies: tuple[int, ...]
    holders: tuple[int, ...]

    @property
    def owner(self) -> int:
        return self.holders[0]


@dataclasses.dataclass(frozen=True)
class ParamLayout:
    """One stage's parameters and optimizer state.

    Attributes:
      stage: the stage.
      tied: its tied groups with copies here.
      hidden: the leaves of its parameters its optimizer does not see (every tied copy but
        an owned group's first).
      phantom: the optimizer is coupled through the gradients' global norm: it runs over
        ``(parameters as it sees them, one phantom scalar)``, so its per-parameter state
        has one leaf more than the parameters.
    """

    stage: int
    tied: tuple[TiedGroup, ...]
    hidden: frozenset[int]
    phantom: bool

    def view(self, params: PyTree) -> PyTree:
        """``params`` (the stage's per-layer list) as the optimizer sees them: the hidden
        leaves None."""
        if not self.hidden:
            return params
        leaves, treedef = jax.tree.flatten(params)
        return jax.tree.unflatten(
            treedef, [None if k in self.hidden else a for k, a in enumerate(leaves)]
        )

    def optimizer_structure(self, params: PyTree) -> PyTree:
        """The tree structure of what the optimizer runs over for ``params``: a
        per-parameter subtree of its state has it."""
        view = self.view(params)
        return jax.tree.structure((view, 0) if self.phantom else view)


def param_layout(stage_set: StageSet, decisions: Decisions) -> tuple[ParamLayout, ...]:
    """Per stage of ``stage_set``, its :class:`ParamLayout` as decided so far."""
    del decisions  # the decisions are written into the stages (ties, optimizer)
    out = []
    for s, stage in enumerate(stage_set.stages):
        ties = stage.ties
        groups = (
            ()
            if ties is None
            else tuple(
                TiedGroup(n, c, h)
                for n, c, h in zip(ties.names, ties.copies, ties.holders, strict=True)
            )
        )
        out.append(
            ParamLayout(
                stage=s,
                tied=groups,
                hidden=ties.hidden if ties is not None else frozenset(),
                phantom=bool(getattr(stage.optimizer, "needs_exchange", False)),
            )
        )
    return tuple(out)
