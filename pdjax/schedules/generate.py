"""The dispatcher: :func:`generate` builds any schedule by name."""

from __future__ import annotations

from collections.abc import Sequence

from pdjax.errors import ScheduleError
from pdjax.schedules.actions import Schedule
from pdjax.schedules.arguments import replicas_of, replication_of
from pdjax.schedules.flush import gpipe, interleaved, one_f_one_b
from pdjax.schedules.semantics import ROUND_ROBIN, SCHEDULES, SEMANTICS
from pdjax.schedules.streaming import pipedream, pipedream_2bw
from pdjax.schedules.zero_bubble import zb_h1, zb_h2, zb_v

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
) -> Schedule:
    """Builds the schedule called ``name``
    (one of :data:`~pdjax.schedules.semantics.SCHEDULES`).

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

    Raises:
        ScheduleError: for an unknown name or a parameter out of range.
    """
    row = SEMANTICS.get(name)
    if extra_in_flight and (row is None or "extra_in_flight" not in row.options):
        raise ScheduleError(f"extra_in_flight is a pipedream option, not of {name}")
    if name not in ROUND_ROBIN and replication is not None:
        replication_of(replication, replicas_of(replicas, num_stages), name)
    rr = {"replication": replication}
    if name == "gpipe":
        return gpipe(num_stages, num_microbatches, steps=steps, replicas=replicas, **rr)
    if name == "1f1b":
        return one_f_one_b(num_stages, num_microbatches, steps=steps, replicas=replicas, **rr)
    if name == "zb-h1":
        return zb_h1(num_stages, num_microbatches, steps=steps, replicas=replicas)
    if name == "zb-h2":
        return zb_h2(num_stages, num_microbatches, steps=steps, replicas=replicas)
    if name == "zb-v":
        _check_zb_v_chunks(chunks)
        return zb_v(
            num_stages, num_microbatches, steps=steps, num_layers=num_layers, replicas=replicas
        )
    if name == "interleaved":
        return interleaved(
            num_stages,
            num_microbatches,
            chunks,
            steps=steps,
            num_layers=num_layers,
            replicas=replicas,
        )
    if name == "pipedream":
        return pipedream(
            num_stages,
            num_microbatches if stream is None else stream,
            vertical_sync=vertical_sync,
            weight_stashing=weight_stashing,
            replicas=replicas,
            extra_in_flight=extra_in_flight,
            replication=replication,
        )
    if name == "2bw":
        N = num_microbatches * steps if stream is None else stream
        return pipedream_2bw(num_stages, num_microbatches, N, replicas=replicas, **rr)
    raise ScheduleError(f"unknown schedule {name!r}; accepted: {', '.join(SCHEDULES)}")


def _check_zb_v_chunks(chunks: int) -> None:
    """``zb-v`` takes only its V's two chunks per device group."""
    if chunks != 2:
        raise ScheduleError(
            f"zb-v places two stages on each device group (a V: 2P stages over P groups); "
            f"chunks must be 2, got {chunks!r}"
        )
