"""The dispatcher: :func:`generate` builds any schedule by name, through its
:class:`~pdjax.schedules.kind.ScheduleKind` in the registry."""

from __future__ import annotations

from collections.abc import Sequence

from pdjax.errors import ScheduleError
from pdjax.schedules.actions import Schedule
from pdjax.schedules.arguments import replicas_of, replication_of
from pdjax.schedules.kind import GenerateArgs
from pdjax.schedules.registry import ROUND_ROBIN, SCHEDULE_KINDS, unknown_schedule

__all__ = ["generate"]


def generate(
    name: str,
    num_stages: int,
    num_microbatches: int,
    *,
    stream: int | None = None,
    chunks: int = 2,
    steps: int = 1,
    vertical_sync: bool = False,
    weight_stashing: bool = True,
    num_layers: int | None = None,
    replicas: Sequence[int] | None = None,
    extra_in_flight: int = 0,
    replication: Sequence[str] | str | None = None,
    in_flight: str = "full-rate",
) -> Schedule:
    """Builds the schedule called ``name``
    (one of :data:`~pdjax.schedules.registry.SCHEDULES`).

    Args:
        name: the schedule.
        num_stages: ``P``, device groups.
        num_microbatches: ``M``, microbatches per step (for ``pipedream``, the stream length
            when ``stream`` is not given).
        stream: ``N``, the stream length of ``pipedream`` and ``2bw`` (default: ``steps * M``
            for ``2bw``, ``M`` for ``pipedream``).
        chunks: ``v`` for ``interleaved``; ``zb-v`` has 2 (its V), and takes only 2.
        steps: optimizer steps for the flush schedules and the default ``2bw`` stream.
        vertical_sync: ``pipedream`` option.
        weight_stashing: ``pipedream`` option.
        num_layers: ``interleaved`` and ``zb-v``: checks that ``P * chunks`` divides it.
        replicas: devices per device group.
        extra_in_flight: ``pipedream`` option (latency hiding).
        replication: per device group ``"split"`` or ``"round-robin"`` (one word: all);
            round-robin for ``gpipe``, ``1f1b``, ``pipedream`` and ``2bw``.
        in_flight: ``pipedream`` option: ``"full-rate"`` (default) or ``"paper"``, the
            groups in flight at round-robin stages.

    Raises:
        ScheduleError: for an unknown name or a parameter out of range.
    """
    kind = SCHEDULE_KINDS.get(name)
    if extra_in_flight and (kind is None or not kind.takes("extra_in_flight")):
        takes = [k.name for k in SCHEDULE_KINDS.values() if k.takes("extra_in_flight")]
        raise ScheduleError(f"extra_in_flight is a {', '.join(takes)} option, not of {name}")
    if in_flight != "full-rate" and (kind is None or not kind.takes("in_flight")):
        takes = [k.name for k in SCHEDULE_KINDS.values() if k.takes("in_flight")]
        raise ScheduleError(
            f"in_flight={in_flight!r} is a {', '.join(takes)} option, not of {name}"
        )
    if name not in ROUND_ROBIN and replication is not None:
        replication_of(replication, replicas_of(replicas, num_stages), name, ROUND_ROBIN)
    if kind is None:
        raise unknown_schedule(name)
    return kind.build(
        GenerateArgs(
            num_stages,
            num_microbatches,
            stream=stream,
            chunks=chunks,
            steps=steps,
            vertical_sync=vertical_sync,
            weight_stashing=weight_stashing,
            num_layers=num_layers,
            replicas=replicas,
            extra_in_flight=extra_in_flight,
            replication=replication,
            in_flight=in_flight,
        )
    )
