"""The dispatcher: :func:`generate` builds any schedule by name, through its
:class:`~pdjax.schedules.kind.ScheduleKind` in the registry."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pdjax.errors import ScheduleError
from pdjax.schedules.actions import Schedule
from pdjax.schedules.arguments import replicas_of, replication_of
from pdjax.schedules.kind import GenerateArgs
from pdjax.schedules.registry import ROUND_ROBIN, SCHEDULE_KINDS, unknown_schedule
from pdjax.schedules.spec import ScheduleSpec

__all__ = ["generate"]


def generate(
    schedule: str | ScheduleSpec,
    num_stages: int,
    num_microbatches: int | None = None,
    *,
    stream: int | None = None,
    steps: int = 1,
    num_layers: int | None = None,
    replicas: Sequence[int] | None = None,
    **settings: Any,
) -> Schedule:
    """Builds a schedule: ``schedule`` as a :class:`~pdjax.schedules.ScheduleSpec`, or its
    kind's name (one of :data:`~pdjax.schedules.registry.SCHEDULES`) with the spec's
    settings as keywords (``generate("interleaved", 4, 8, chunks=3)``).

    Args:
        schedule: the spec, or the kind's name.
        num_stages: ``P``, device groups.
        num_microbatches: ``M``, microbatches per step (for ``pipedream``, the stream length
            when ``stream`` is not given); with a spec, None (its own) or the same.
        stream: ``N``, the stream length of ``pipedream`` and ``2bw`` (default: ``steps * M``
            for ``2bw``, ``M`` for ``pipedream``).
        steps: optimizer steps for the flush schedules and the default ``2bw`` stream.
        num_layers: ``interleaved`` and ``zb-v``: checks that ``P * chunks`` divides it.
        replicas: devices per device group.
        settings: with a name, the spec's other fields (``chunks``: 2 for ``interleaved``
            unless given, ignored by the kinds without chunks; the kind's options,
            ``replication``: per device group ``"split"`` or ``"round-robin"``, one word
            for all, round-robin for ``gpipe``, ``1f1b``, ``pipedream`` and ``2bw``).

    Raises:
        ScheduleError: for an unknown name, a setting the kind does not have, or a
            parameter out of range.
    """
    if isinstance(schedule, ScheduleSpec):
        if settings:
            raise ScheduleError(
                f"generate() takes a spec or a name with settings, not both: "
                f"{sorted(settings)} given with {schedule}; use spec.replace(...)"
            )
        if num_microbatches is not None and num_microbatches != schedule.microbatches:
            raise ScheduleError(
                f"num_microbatches={num_microbatches} differs from the spec's "
                f"microbatches={schedule.microbatches}"
            )
        spec = schedule
    else:
        if num_microbatches is None:
            raise ScheduleError(f"generate({schedule!r}, ...) needs num_microbatches")
        kind = SCHEDULE_KINDS.get(schedule) if isinstance(schedule, str) else None
        if kind is None:
            raise unknown_schedule(schedule)
        if not kind.semantics.chunked and settings.get("chunks") not in (None, 1):
            settings = {k: v for k, v in settings.items() if k != "chunks"}
        if kind.chunks is None:  # interleaved by name: v = 2 unless given
            settings.setdefault("chunks", 2)
        spec = ScheduleSpec(schedule, microbatches=num_microbatches, **settings)
    kind = SCHEDULE_KINDS[spec.kind]
    if spec.kind not in ROUND_ROBIN and spec.replication is not None:
        replication_of(spec.replication, replicas_of(replicas, num_stages), spec.kind, ROUND_ROBIN)
    return kind.build(
        GenerateArgs(
            num_stages,
            spec,
            stream=stream,
            steps=steps,
            num_layers=num_layers,
            replicas=replicas,
        )
    )
