"""The zero-bubble schedules (Qi et al.): the backward split into ``I`` (input gradient)
and ``W`` (weight gradient), ``W`` deferred to fill the bubbles. ZB-H1 and ZB-H2 keep one
stage per device group; ZB-V puts two on each, in a V.

ZB-V's order (:func:`zb_v`): device group ``d`` holds stage ``d`` (its *first* chunk) and
``2P - 1 - d`` (its *second*), and runs, for one step:

1. ``2 (P - d) - 1`` forwards of its first chunk;
2. ``d`` times: a forward of the second chunk, then of the first;
3. ``P - d`` times: ``F``, ``I``, ``W`` of the second chunk;
4. until both chunks have run every forward: ``F`` (while any is left), ``I``, ``W`` of
   the first chunk, then ``F``, ``I``, ``W`` of the second;
5. the drain: ``d`` times ``I`` of the first chunk and ``I`` of the second; ``P - d``
   times ``I`` and the oldest deferred ``W`` of the first chunk; then the deferred
   ``W`` of the second chunk, then of the first.

For ``M < 2P - 1`` the order is laid out for ``2P - 1`` microbatches and the actions of the
missing ones are left out.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdjax.errors import ScheduleError
from pdjax.schedules.actions import Schedule
from pdjax.schedules.arguments import positive
from pdjax.schedules.flush import flush_schedule, one_f_one_b_order
from pdjax.schedules.kind import V_SHAPE, GenerateArgs, ScheduleKind
from pdjax.schedules.semantics import Shape, flush_semantics

__all__ = ["FAMILY", "ZB_H1", "ZB_H2", "ZB_V", "zb_h1", "zb_h2", "zb_v"]


def zb_h1(
    num_stages: int,
    num_microbatches: int,
    *,
    steps: int = 1,
    replicas: Sequence[int] | None = None,
) -> Schedule:
    """ZB-H1 (zero bubble): 1F1B with the backward split, ``W`` deferred to fill bubbles.

    Stage ``s`` runs the 1F1B order of ``F`` and ``I``; ``W(s, j)`` follows ``I(s, j + s)``
    (stage 0 does not defer, the last stage defers ``P - 1``), and the deferred ``W`` fill the
    drain. With ``F = I = W`` and ``M >= P`` every stage idles ``P - 1`` units per step,
    a third of 1F1B's ``3 (P - 1)``.

    Versions: every action of step ``t`` uses version ``t``; ``U(s, t)`` makes ``t + 1``.
    In flight (forward run, ``W`` not yet): at most ``min(P, M)`` at every stage, 1F1B's peak
    (``min(P - s, M)`` still wait for ``I``). Versions kept: 1.

    Args:
        num_stages: ``P``, stages (one device group each).
        num_microbatches: ``M``, microbatches per step.
        steps: optimizer steps to lay out.
        replicas: devices per stage (default 1 each).

    Raises:
        ScheduleError: for a parameter out of range.
    """
    P = positive("num_stages (P)", num_stages)
    M = positive("num_microbatches (M)", num_microbatches)
    positive("steps", steps)

    def order(s: int) -> list[tuple[str, int, int]]:
        out: list[tuple[str, int, int]] = []
        for kind, k in one_f_one_b_order(P, M, s):
            if kind == "F":
                out.append(("F", s, k))
            else:
                out.append(("I", s, k))
                if k - s >= 0:
                    out.append(("W", s, k - s))
        out += [("W", s, k) for k in range(max(0, M - s), M)]
        return out

    return flush_schedule(ZB_H1, P, 1, M, steps, step_order=order, replicas=replicas)


def zb_h2(
    num_stages: int,
    num_microbatches: int,
    *,
    steps: int = 1,
    replicas: Sequence[int] | None = None,
) -> Schedule:
    """ZB-H2 (zero bubble, Qi et al., ICLR 2024): more warm-up forwards than ZB-H1 and
    deferred ``W`` in the drain, so that every stage runs without a gap.

    Stage ``s`` warms up with ``2 (P - s) - 1`` forwards (``2P - 1`` at stage 0: what fills
    the wait for the first input gradient), then for each microbatch ``j`` runs ``I(s, j)``,
    ``W(s, j - d_s)`` and the next forward, ``d_s = 2s`` (none at stage 0, ``2P - 2`` at the
    last); the ``d_s`` deferred ``W`` fill the drain. The trapezoid of ZB-H1 becomes a
    parallelogram. With fewer microbatches than the warm-up wants (``M < 2P - 1``) the
    forwards run out and ``d_s = min(2s, max(0, M - P + s))`` (never slower than ZB-H1).

    Bubble, with ``F = I = W = 1`` and ``M >= 2P - 1``: stage ``s`` runs its ``3M`` actions
    without a gap from tick ``s`` to ``3M + s`` (the paper's bubble ``(P - 1)(T_F + T_B -
    2 T_W) = 0``). One step takes ``3M + P - 1``: stage ``s`` idles ``s`` before and ``P - 1
    - s`` after, as ZB-H1; but updates are per stage, so the next step's parallelogram
    starts at stage ``s`` right where this one ends there, and ``k`` steps take ``3Mk + P -
    1``: the idle ``P - 1`` per stage is paid once, not per step (ZB-H1: ``k (3M + P - 1)``).

    Activation memory: at most ``min(2 (P - s) - 1, M)`` microbatches at stage ``s`` wait
    for their input gradient (the paper's ``(2P - 1) M_B`` at stage 0, twice 1F1B's ``P``),
    and ``min(2P - 1, M)`` at every stage hold their stash until their ``W`` (pdjax's
    in-flight count: the runtime's ``W`` reads the forward's residuals).

    Versions: every action of step ``t`` uses version ``t``; ``U(s, t)`` makes ``t + 1``.
    In flight (forward run, ``W`` not yet): at most ``min(2P - 1, M)`` at every stage.
    Versions kept: 1.

    Args:
        num_stages: ``P``, stages (one device group each).
        num_microbatches: ``M``, microbatches per step (any; without a bubble from
            ``2P - 1``).
        steps: optimizer steps to lay out.
        replicas: devices per stage (default 1 each).

    Raises:
        ScheduleError: for a parameter out of range.

    >>> print(zb_h2(2, 3).grid())
    t   g0   g1
    0   0F0  .
    1   0F1  1F0
    2   0F2  1I0
    3   0I0  1F1
    4   0W0  1I1
    5   0I1  1F2
    6   0W1  1I2
    7   0I2  1W0
    8   0W2  1W1
    9   0U0  1W2
    10  .    1U0
    """
    P = positive("num_stages (P)", num_stages)
    M = positive("num_microbatches (M)", num_microbatches)
    positive("steps", steps)

    def order(s: int) -> list[tuple[str, int, int]]:
        warmup = min(2 * (P - s) - 1, M)
        defer = min(2 * s, max(0, M - P + s))
        out = [("F", s, k) for k in range(warmup)]
        for j in range(M):
            out.append(("I", s, j))
            if j >= defer:
                out.append(("W", s, j - defer))
            if warmup + j < M:
                out.append(("F", s, warmup + j))
        out += [("W", s, k) for k in range(M - defer, M)]
        return out

    return flush_schedule(ZB_H2, P, 1, M, steps, step_order=order, replicas=replicas)


def zb_v(
    num_stages: int,
    num_microbatches: int,
    *,
    steps: int = 1,
    num_layers: int | None = None,
    replicas: Sequence[int] | None = None,
) -> Schedule:
    """ZB-V (Qi et al., "Pipeline Parallelism with Controllable Memory", 2024): two chunks
    per device group in a V, the backward split into ``I`` and ``W``.

    The ``2P`` stages go down and back up the device groups: stages ``0 .. P - 1`` on
    groups ``0 .. P - 1``, stages ``P .. 2P - 1`` on groups ``P - 1 .. 0`` (group ``d``
    holds stage ``d``, its *first* chunk, and ``2P - 1 - d``, its *second*; the last
    group runs stages ``P - 1`` and ``P`` back to back, and group 0 holds both ends of the
    model). The order each group runs, for any ``M``, is in the module docstring.

    Bubble, with every chunk's ``F = I = W = 1`` and ``M >= 2P - 1``: group ``d`` runs its
    ``6M`` actions without a gap from tick ``d`` to ``6M + d`` (the paper's zero bubble).
    One step takes ``6M + P - 1``, each group idling ``P - 1`` (``d`` before, ``P - 1 - d``
    after; in units of a whole stage, a chunk being half of one, ``(P - 1) / 2`` of a
    ``3M + (P - 1) / 2`` step, a sixth of 1F1B's ``3 (P - 1)``); updates are per stage, so
    ``k`` steps take ``6Mk + P - 1``.

    Activation memory: at most ``2P`` chunk-microbatches in flight (forward run, ``W`` not
    yet) on every group, each chunk half a stage: ``P`` microbatches of a whole stage, the
    peak of 1F1B (at its first stage), as the paper states; at most ``2M`` when ``M < P``.

    Versions: every action of step ``t`` uses version ``t``; ``U(s, t)`` makes ``t + 1``.
    In flight at every group (over its two stages): at most ``min(2P, 2M)``. Versions
    kept: 1.

    Args:
        num_stages: ``P``, device groups (the schedule has ``2P`` stages).
        num_microbatches: ``M``, microbatches per step (any; without a bubble from
            ``2P - 1``).
        steps: optimizer steps to lay out.
        num_layers: if given, the layer count to split into ``2P`` equal stages.
        replicas: devices per device group (default 1 each).

    Raises:
        ScheduleError: for a parameter out of range, or a layer count that ``2P`` does not
            divide.

    >>> s = zb_v(2, 3)  # M = 2P - 1: no gap from a group's first action to its last
    >>> s.stage_device
    (0, 1, 1, 0)
    >>> print(s.grid())
    t   g0   g1
    0   0F0  .
    1   0F1  1F0
    2   0F2  2F0
    3   3F0  1F1
    4   3I0  2F1
    5   3W0  2I0
    6   3F1  2W0
    7   3I1  1F2
    8   3W1  1I0
    9   0I0  1W0
    10  0W0  2F2
    11  3F2  2I1
    12  3I2  2W1
    13  3W2  1I1
    14  0I1  2I2
    15  0W1  1I2
    16  0I2  1W1
    17  0W2  2W2
    18  0U0  1W2
    19  3U0  1U0
    20  .    2U0
    """
    P = positive("num_stages (P)", num_stages)
    M = positive("num_microbatches (M)", num_microbatches)
    positive("steps", steps)
    if num_layers is not None:
        _check_zb_v_layers(P, num_layers)
    n = max(M, 2 * P - 1)  # the order's length; microbatches >= M are left out
    return flush_schedule(
        ZB_V, P, 2, M, steps, step_order=lambda d: _zb_v_order(P, M, n, d), replicas=replicas
    )


def _check_zb_v_layers(P: int, num_layers: int) -> None:
    """``num_layers`` splits into ZB-V's ``2P`` equal stages."""
    positive("num_layers", num_layers)
    if num_layers % (2 * P):
        raise ScheduleError(
            f"zb-v over P={P} device groups splits the model into 2P = {2 * P} equal "
            f"stages (two chunks per group); got num_layers={num_layers}, which {2 * P} "
            f"does not divide"
        )


def _zb_v_order(P: int, M: int, n: int, d: int) -> list[tuple[str, int, int]]:
    """Group ``d``'s order for one step of ZB-V laid out for ``n >= M`` microbatches (the
    steps in the module docstring), without the actions of microbatches ``>= M``."""
    arms = (d, 2 * P - 1 - d)  # first chunk, second chunk
    forwards, inputs, weights = [0, 0], [0, 0], [0, 0]
    out: list[tuple[str, int, int]] = []

    def run(kind: str, arm: int) -> None:
        count = {"F": forwards, "I": inputs, "W": weights}[kind]
        out.append((kind, arms[arm], count[arm]))
        count[arm] += 1

    for _ in range(2 * (P - d) - 1):
        run("F", 0)
    for _ in range(d):
        run("F", 1)
        run("F", 0)
    for _ in range(P - d):
        for kind in "FIW":
            run(kind, 1)
    while forwards[1] < forwards[0] or forwards[0] < n:
        if forwards[0] < n:
            run("F", 0)
        for arm in (0, 1):
            if arm:
                run("F", 1)
            run("I", arm)
            run("W", arm)
    for _ in range(d):
        run("I", 0)
        run("I", 1)
    for _ in range(P - d):
        run("I", 0)
        run("W", 0)
    for arm in (1, 0):
        while weights[arm] < n:
            run("W", arm)
    return [a for a in out if a[2] < M]


def _zb_h1_in_flight(shape: Shape, group: int) -> int:
    return min(shape.groups, shape.microbatches)


def _zb_h2_in_flight(shape: Shape, group: int) -> int:
    return min(2 * shape.groups - 1, shape.microbatches)


def _zb_v_in_flight(shape: Shape, group: int) -> int:
    return min(2 * shape.groups, 2 * shape.microbatches)


def _build_zb_h1(a: GenerateArgs) -> Schedule:
    return zb_h1(a.num_stages, a.num_microbatches, steps=a.steps, replicas=a.replicas)


def _build_zb_h2(a: GenerateArgs) -> Schedule:
    return zb_h2(a.num_stages, a.num_microbatches, steps=a.steps, replicas=a.replicas)


def _build_zb_v(a: GenerateArgs) -> Schedule:
    _check_zb_v_chunks(a.chunks)
    return zb_v(
        a.num_stages, a.num_microbatches, steps=a.steps, num_layers=a.num_layers,
        replicas=a.replicas,
    )  # fmt: skip


def _check_zb_v_chunks(chunks: int) -> None:
    """``zb-v`` takes only its V's two chunks per device group."""
    if chunks != 2:
        raise ScheduleError(
            f"zb-v places two stages on each device group (a V: 2P stages over P groups); "
            f"chunks must be 2, got {chunks!r}"
        )


# The dynamic program prices the newer zero-bubble schedules as zb-h1 (they keep 1F1B's
# in flight or more); the simulator then picks among its partitions.
ZB_H1 = ScheduleKind(
    semantics=flush_semantics("zb-h1", _zb_h1_in_flight, "min(P, M)", split_backward=True),
    build=_build_zb_h1,
)
"""ZB-H1."""
ZB_H2 = ScheduleKind(
    semantics=flush_semantics("zb-h2", _zb_h2_in_flight, "min(2P - 1, M)", split_backward=True),
    build=_build_zb_h2,
)
"""ZB-H2."""
ZB_V = ScheduleKind(
    semantics=flush_semantics(
        "zb-v",
        _zb_v_in_flight,
        "min(2P, 2M) over the group's two stages",
        chunked=True,
        v_shaped=True,
        split_backward=True,
    ),
    build=_build_zb_v,
    placement=V_SHAPE,
    chunks=2,
)
"""ZB-V: two stages per device group, in a V."""

FAMILY = (ZB_H1, ZB_H2, ZB_V)
"""This module's schedules, in the order they are listed."""
