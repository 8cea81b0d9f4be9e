"""Interleaved 1F1B (Megatron-LM): a flush schedule with ``v`` model chunks on every
device group, placed ``s % P``, with its :class:`~pdjax.schedules.kind.ScheduleKind` (the
one schedule whose chunk count the caller chooses)."""

from __future__ import annotations

from collections.abc import Sequence

from pdjax.errors import ScheduleError
from pdjax.schedules.actions import Schedule
from pdjax.schedules.arguments import positive
from pdjax.schedules.flush import flush_schedule, one_f_one_b_order
from pdjax.schedules.kind import GenerateArgs, ScheduleKind
from pdjax.schedules.semantics import Shape, flush_semantics

__all__ = ["FAMILY", "INTERLEAVED", "interleaved"]


def interleaved(
    num_stages: int,
    num_microbatches: int,
    chunks: int = 2,
    *,
    steps: int = 1,
    num_layers: int | None = None,
    replicas: Sequence[int] | None = None,
) -> Schedule:
    """Interleaved 1F1B (Megatron-LM): ``v`` model chunks per device group.

    Device group ``d`` holds the virtual stages ``d, d + P, ..., d + (v - 1) P``. Forwards
    go through microbatches in groups of ``P``, chunk by chunk; backwards likewise with the
    chunks reversed. Group ``d`` warms up with ``2 (P - d - 1) + (v - 1) P`` forwards, then
    alternates. With per-chunk costs ``F / v`` and ``B / v`` the bubble is 1F1B's divided
    by ``v``. ``chunks=1`` is :func:`one_f_one_b`'s order.

    Versions: every action of step ``t`` uses version ``t``; each virtual stage's
    ``U(s, t)`` makes ``t + 1``. In flight at group ``d`` (over its chunks): at most
    ``min(2 (P - d - 1) + (v - 1) P + 1, M v)``. Versions kept: 1.

    Args:
        num_stages: ``P``, device groups (the schedule has ``P * chunks`` virtual stages).
        num_microbatches: ``M``, microbatches per step; a multiple of ``P`` when
            ``chunks > 1``.
        chunks: ``v``, model chunks per device group.
        steps: optimizer steps to lay out.
        num_layers: if given, the layer count to split into ``P * chunks`` equal stages.
        replicas: devices per device group (default 1 each).

    Raises:
        ScheduleError: for a parameter out of range, ``M`` not a multiple of ``P``, or a
            layer count that ``P * chunks`` does not divide.
    """
    P = positive("num_stages (P)", num_stages)
    M = positive("num_microbatches (M)", num_microbatches)
    v = positive("chunks (v)", chunks)
    positive("steps", steps)
    if num_layers is not None:
        positive("num_layers", num_layers)
        if num_layers % (P * v):
            fits = [c for c in range(1, num_layers // P + 1) if num_layers % (P * c) == 0]
            raise ScheduleError(
                f"interleaved: chunks={v} over P={P} device groups needs a layer count divisible "
                f"by P * chunks = {P * v}; got num_layers={num_layers}. Accepted chunks for "
                f"{num_layers} layers and P={P}: {fits or 'none (use fewer device groups)'}"
            )
    if v > 1 and M % P:
        raise ScheduleError(
            f"interleaved with chunks={v} needs num_microbatches (M) a multiple of "
            f"num_stages (P={P}); got M={M}. Accepted: M in {{{P}, {2 * P}, {3 * P}, ...}}"
        )
    total = M * v

    def position(i: int, backward: bool) -> tuple[int, int]:
        group, rest = divmod(i, P * v)
        chunk = rest // P
        return (v - 1 - chunk if backward else chunk), group * P + rest % P

    def warmup(d: int) -> int:
        return min(2 * (P - d - 1) + (v - 1) * P, total)

    def order(d: int) -> list[tuple[str, int, int]]:
        if v == 1:
            return [(kind, d, k) for kind, k in one_f_one_b_order(P, M, d)]
        out = []
        for i in range(warmup(d)):
            chunk, k = position(i, False)
            out.append(("F", d + chunk * P, k))
        for i in range(total - warmup(d)):
            chunk, k = position(warmup(d) + i, False)
            out.append(("F", d + chunk * P, k))
            chunk, k = position(i, True)
            out.append(("B", d + chunk * P, k))
        for i in range(total - warmup(d), total):
            chunk, k = position(i, True)
            out.append(("B", d + chunk * P, k))
        return out

    return flush_schedule(INTERLEAVED, P, v, M, steps, step_order=order, replicas=replicas)


def _interleaved_in_flight(shape: Shape, group: int) -> int:
    P, M, v = shape.groups, shape.microbatches, shape.chunks
    if v == 1:
        return min(P - group, M)
    return min(2 * (P - group - 1) + (v - 1) * P + 1, M * v)


def _build(a: GenerateArgs) -> Schedule:
    return interleaved(
        a.num_stages, a.num_microbatches, a.chunks, steps=a.steps, num_layers=a.num_layers,
        replicas=a.replicas,
    )  # fmt: skip


INTERLEAVED = ScheduleKind(
    semantics=flush_semantics(
        "interleaved",
        _interleaved_in_flight,
        "min(2 (P - d - 1) + (v - 1) P + 1, M v) (min(P - d, M) for v = 1)",
        chunked=True,
    ),
    build=_build,
    chunks=None,  # the caller's v
)
"""Interleaved 1F1B."""

FAMILY = (INTERLEAVED,)
"""This module's schedules, in the order they are listed."""
