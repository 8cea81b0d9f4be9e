"""The registry of schedules: every :class:`~pdjax.schedules.kind.ScheduleKind`, by name,
and the lookups and name lists derived from it.

The kinds come from the family modules listed in :data:`FAMILY_MODULES`, each of which
defines its schedules (generator and kind) and lists them in ``FAMILY``; the registry keeps
that order (the order ``pdjax simulate --schedule all``, ``plan_auto`` and every choice
list show). Adding a schedule is one module with its ``FAMILY`` and one line here.

>>> semantics("2bw").streams, semantics("2bw").versions_formula
(True, '2')
>>> STREAMING, CHUNKED
(('pipedream', '2bw'), ('interleaved', 'zb-v'))
>>> schedule_kind("zb-v").chunks, schedule_kind("interleaved").chunks
(2, None)
"""

from __future__ import annotations

import importlib
import types
from collections.abc import Mapping

from pdjax.errors import ScheduleError
from pdjax.schedules.kind import MODULO, ScheduleKind
from pdjax.schedules.semantics import ScheduleSemantics

__all__ = [
    "CHUNKED",
    "FAMILY_MODULES",
    "FLUSHING",
    "ROUND_ROBIN",
    "SCHEDULES",
    "SCHEDULE_KINDS",
    "SEMANTICS",
    "SPLIT_BACKWARD",
    "STALE",
    "STREAMING",
    "schedule_kind",
    "semantics",
    "stage_groups",
    "unknown_schedule",
]

FAMILY_MODULES = (
    "pdjax.schedules.flush",  # gpipe, 1f1b
    "pdjax.schedules.streaming",  # pipedream, 2bw
    "pdjax.schedules.interleaved_1f1b",  # interleaved
    "pdjax.schedules.zero_bubble",  # zb-h1, zb-h2, zb-v
)
"""The modules whose ``FAMILY`` lists schedules, in the order they are listed."""


def _gather() -> tuple[ScheduleKind, ...]:
    kinds: list[ScheduleKind] = []
    for module in FAMILY_MODULES:
        family = importlib.import_module(module).FAMILY
        if not all(isinstance(k, ScheduleKind) for k in family):
            raise TypeError(f"{module}.FAMILY must hold ScheduleKind objects")
        kinds.extend(family)
    names = [k.name for k in kinds]
    if len(set(names)) != len(names):
        raise TypeError(f"schedule names registered twice: {names}")
    return tuple(kinds)


_KINDS = _gather()

SCHEDULE_KINDS: Mapping[str, ScheduleKind] = types.MappingProxyType({k.name: k for k in _KINDS})
"""Every schedule's :class:`~pdjax.schedules.kind.ScheduleKind`, by name."""
SEMANTICS: Mapping[str, ScheduleSemantics] = types.MappingProxyType(
    {k.name: k.semantics for k in _KINDS}
)
"""Every schedule's :class:`~pdjax.schedules.semantics.ScheduleSemantics`, by name."""

SCHEDULES = tuple(SCHEDULE_KINDS)
"""Schedule names, as :func:`~pdjax.schedules.generate` and the ``pdjax simulate``
command accept them."""
STREAMING = tuple(k.name for k in _KINDS if k.semantics.streams)
"""One stream, no flush."""
FLUSHING = tuple(k.name for k in _KINDS if k.semantics.flushes)
"""A flush every step of ``M``: updates equal sequential training."""
STALE = tuple(k.name for k in _KINDS if k.semantics.stale)
"""Updates with gradients of older weights."""
CHUNKED = tuple(k.name for k in _KINDS if k.semantics.chunked)
"""Several stages per device group."""
ROUND_ROBIN = tuple(k.name for k in _KINDS if k.semantics.round_robin)
"""With a round-robin form."""
SPLIT_BACKWARD = tuple(k.name for k in _KINDS if k.semantics.split_backward)
"""The backward split into ``I`` and ``W``."""


def unknown_schedule(name: str) -> ScheduleError:
    """The error for a schedule name that is not registered."""
    return ScheduleError(f"unknown schedule {name!r}; accepted: {', '.join(SCHEDULES)}")


def schedule_kind(name: str) -> ScheduleKind:
    """The kind of schedule ``name``.

    Raises:
        ScheduleError: for an unknown name.
    """
    kind = SCHEDULE_KINDS.get(name)
    if kind is None:
        raise unknown_schedule(name)
    return kind


def semantics(name: str) -> ScheduleSemantics:
    """The row of schedule ``name``.

    Raises:
        ScheduleError: for an unknown name.
    """
    return schedule_kind(name).semantics


def stage_groups(name: str, groups: int, chunks: int = 1) -> tuple[int, ...]:
    """The device group of each (virtual) stage of schedule ``name`` over ``groups``
    device groups with ``chunks`` stages each, by its placement: ``s % P`` (``interleaved``,
    every one-stage-per-group schedule, and any name not registered), or the V of ``zb-v``
    (``chunks`` must be 2): stages ``0 .. P - 1`` on groups ``0 .. P - 1``, then stages
    ``P .. 2P - 1`` back on groups ``P - 1 .. 0``.

    >>> stage_groups("interleaved", 3, 2), stage_groups("zb-v", 3, 2)
    ((0, 1, 2, 0, 1, 2), (0, 1, 2, 2, 1, 0))
    """
    kind = SCHEDULE_KINDS.get(name)
    placement = MODULO if kind is None else kind.placement
    return placement.groups(groups, chunks)
