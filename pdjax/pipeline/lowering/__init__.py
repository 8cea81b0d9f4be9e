"""Lowering: a validated schedule and a placement become, per process, a flat program of
operations on typed slots (the contract is in :mod:`.program`'s documentation).

Modules: :mod:`.types` (the plain data: :class:`Placement`, :class:`Op` of an
:class:`OpKind` with :class:`OpFlag` flags, :class:`Slot` of a :class:`SlotKind`,
:class:`Program`), :mod:`.ops` (one helper per action kind, tick by tick, for every
process) and :mod:`.program` (:func:`lower`: orders the operations, splits them per
process and marks what each frees).
"""

from pdjax.pipeline.lowering.program import lower
from pdjax.pipeline.lowering.types import (
    Op,
    OpFlag,
    OpKind,
    Placement,
    Program,
    Slot,
    SlotKind,
    StagePlace,
)

__all__ = [
    "Op",
    "OpFlag",
    "OpKind",
    "Placement",
    "Program",
    "Slot",
    "SlotKind",
    "StagePlace",
    "lower",
]
