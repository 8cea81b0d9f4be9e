"""Lowering: a validated schedule and a placement become, per process, a flat program of
operations on named slots (the contract is in :mod:`.program`'s documentation).

Modules: :mod:`.types` (the plain data: :class:`Placement`, :class:`Op`,
:class:`Program`), :mod:`.ops` (one helper per action kind, tick by tick, for every
process) and :mod:`.program` (:func:`lower`: orders the operations, splits them per
process and marks what each frees).
"""

from pdjax.pipeline.lowering.program import lower
from pdjax.pipeline.lowering.types import Op, Placement, Program, StagePlace

__all__ = ["Op", "Placement", "Program", "StagePlace", "lower"]
