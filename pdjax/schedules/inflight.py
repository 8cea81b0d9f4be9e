"""Microbatches in flight under round-robin replication: the 1F1B order over groups of
microbatches, and the groups in flight each stage keeps (the counts the generators use and
the semantics table states; the validator checks them against the least counts here).

A stage ``s`` on ``r`` round-robin devices runs ``n_s = r`` consecutive microbatches at
once (one per device); a split stage has ``n_s = 1``. ``q_s`` is the number of such groups
in flight at stage ``s``.

Two counts are offered (:data:`IN_FLIGHT`, ``pipedream``'s ``in_flight``):
:func:`round_robin_in_flight`'s default, ``"full-rate"``, which adds groups until a
balanced pipeline runs at full rate, and :func:`paper_in_flight`, ``"paper"``: PipeDream's
own count, NOAM groups at the input stage.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

from pdjax.errors import ScheduleError

__all__ = [
    "IN_FLIGHT",
    "group_order",
    "group_sizes",
    "least_groups_in_flight",
    "paper_in_flight",
    "round_robin_in_flight",
    "unit_rate",
    "unit_stream",
    "unstuck",
]

IN_FLIGHT = ("full-rate", "paper")
"""``pipedream``'s ``in_flight`` option: the groups each round-robin stage keeps in flight.
``"full-rate"`` (the default): enough for a balanced pipeline to run at full rate
(:func:`round_robin_in_flight`); ``"paper"``: PipeDream's NOAM at the input stage
(:func:`paper_in_flight`). With no round-robin stage both are ``P - s``."""


def group_sizes(replicas: Sequence[int], replication: Sequence[str]) -> tuple[int, ...]:
    """Per device group, microbatches one action covers: its replicas under round-robin,
    else 1 (``replication`` empty: every group splits)."""
    if not replication:
        return (1,) * len(replicas)
    return tuple(r if m == "round-robin" else 1 for r, m in zip(replicas, replication, strict=True))


def least_groups_in_flight(units: Sequence[int], stage: int, extra: int = 0) -> int:
    """Groups in flight at ``stage`` of a 1F1B-style order over groups.

    ``units[s] = n_s``: microbatches one action of stage ``s`` covers (its replicas under
    round-robin, else 1). ``q_s`` is the larger of

    - ``ceil(W_s / n_s) + e``, ``W_s = n_s + ... + n_{P-1}``: enough to keep the stages
      from ``s`` on busy (``P - s + e`` with no round-robin stage; PipeDream's NOAM at
      stage 0), ``e`` not at the last stage;
    - ``ceil((q_{s+1} n_{s+1} + n_s - 1 - ((n_s - 1) mod gcd(n_s, n_{s+1}))) / n_s)``: the
      forwards stage ``s + 1`` needs before the backward of the group holding the last
      microbatch of stage ``s``'s oldest group (groups of different sizes do not line up),
      so that the order cannot deadlock.
    """
    P = len(units)
    q = 1
    for s in range(P - 1, stage - 1, -1):
        n = units[s]
        e = extra if s < P - 1 else 0
        busy = -(-sum(units[s:]) // n) + e
        if s == P - 1:
            q = busy
            continue
        after = units[s + 1]
        slack = n - 1 - ((n - 1) % math.gcd(n, after))
        q = max(busy, -(-(q * after + slack) // n))
    return q


def group_order(groups: int, warmup: int) -> list[tuple[str, int]]:
    """1F1B over ``groups`` (indices): ``warmup`` forwards, F/B pairs, then the drain."""
    warmup = min(warmup, groups)
    order = [("F", g) for g in range(warmup)]
    for g in range(groups - warmup):
        order += [("F", warmup + g), ("B", g)]
    order += [("B", g) for g in range(groups - warmup, groups)]
    return order


def round_robin_in_flight(
    units: Sequence[int], extra: int = 0, in_flight: str = "full-rate"
) -> tuple[int, ...]:
    """``q_s`` per stage: the groups in flight each stage of a round-robin pipeline keeps.

    ``in_flight="paper"`` returns :func:`paper_in_flight` (which takes no ``extra``); the
    rest of this docstring is the default, ``"full-rate"``.

    ``units[s] = n_s``: the microbatches one action of stage ``s`` covers (its replicas if
    round-robin, else 1). Starting from the least counts (:func:`least_groups_in_flight`:
    the busy bound and the one that keeps groups of unequal sizes from deadlocking), from
    the last stage back, stage ``s`` gets one more group at a time until the stages from
    ``s`` on run a balanced pipeline (every stage one unit of forward and two of backward
    per microbatch on one device, free transfers) at full rate, one microbatch per 3 units
    (found by playing the schedule; a few more groups everywhere if the whole still falls
    short). Groups of unequal sizes need more than the busy bound: a group leaves its stage
    all at once and its microbatches queue at the next. ``extra`` (``pipedream``'s latency
    hiding) is then added at every stage but the last. With every ``n_s = 1`` this is
    ``P - s + extra``.

    >>> round_robin_in_flight([1, 1, 1]), round_robin_in_flight([15, 1])
    ((3, 2, 1), (2, 1))
    >>> round_robin_in_flight([1, 2]), round_robin_in_flight([12, 2, 1, 1])
    ((4, 1), (3, 3, 2, 1))
    """
    units = tuple(int(n) for n in units)
    if in_flight not in IN_FLIGHT:
        raise ScheduleError(f"in_flight must be one of {IN_FLIGHT}; got {in_flight!r}")
    if in_flight == "paper":
        if extra:
            raise ScheduleError(
                f"in_flight='paper' keeps PipeDream's own count, NOAM at the input stage; "
                f"extra_in_flight={extra} would add to it: pass extra_in_flight=0, or "
                "in_flight='full-rate' for latency hiding"
            )
        return paper_in_flight(units)
    q = list(_searched_in_flight(units))
    for st in range(len(units) - 1):
        q[st] += extra
    return unstuck(units, q)


def paper_in_flight(units: Sequence[int]) -> tuple[int, ...]:
    """``q_s`` per stage with PipeDream's own count: NOAM groups at the input stage.

    PipeDream admits ``NOAM = ceil(W / n_0)`` microbatches per input-stage worker
    (``W = n_0 + ... + n_{P-1}`` workers), and each worker of stage ``s`` keeps
    ``ceil(W_s / n_s)`` (its runtime's warm-up, ``(W_s - 1) // n_s``, plus one), ``W_s =
    n_s + ... + n_{P-1}``. Here a stage's group of ``n_s`` microbatches moves at once, so:

    - ``q_0 = NOAM``: ``n_0 NOAM`` microbatches in flight at the input stage;
    - ``q_s = max(lo_s, min(ceil(W_s / n_s), cap_s))`` for ``s >= 1``, with ``cap_s =
      floor((n_{s-1} q_{s-1} - c_{s-1}) / n_s)`` the most groups stage ``s - 1`` can feed
      in the group-by-group 1F1B order without a deadlock (``c_s = n_s - 1 - ((n_s - 1)
      mod gcd(n_s, n_{s+1}))``, as in :func:`least_groups_in_flight`), and ``lo_s`` the
      least the stages after ``s`` need (:func:`unstuck` from one group everywhere).

    Each stage runs 1F1B over its groups with these counts; group ``g`` of stage ``s``
    uses version ``max(0, g - q_s + 1)``, ``q_s - 1`` updates stale (``NOAM - 1`` at the
    input stage). A group enters stage ``s`` only once stage ``s - 1`` has forwarded all of
    it, and stage ``s - 1`` holds ``n_{s-1} q_{s-1}`` microbatches from the start of one of
    its groups, so ``cap_s`` is the most groups stage ``s`` can hold at every alignment of
    its groups with stage ``s - 1``'s, whatever the order (1-3-1: stage 0's 5 hold one
    group of 3, not PipeDream's 2); an order that held one more group only where the
    groups happen to line up would give each group its own staleness.

    Raises:
        ScheduleError: where ``NOAM < lo_0``: a later stage's groups straddle the earlier
            stages' so that the input stage must hold more than NOAM groups (replicas
            ``(1, 5, 2)``: stage 2's group ``{4, 5}`` needs stage 1's groups ``0..4`` and
            ``5..9`` forwarded, so stage 0 holds 10 microbatches, NOAM is 8). The message
            names the full-rate counts to pass instead.

    >>> paper_in_flight([1, 3, 1]), paper_in_flight([2, 2]), paper_in_flight([1, 1, 1])
    ((5, 1, 1), (2, 1), (3, 2, 1))
    """
    units = tuple(int(n) for n in units)
    P = len(units)
    least = unstuck(units, [1] * P)
    noam = -(-sum(units) // units[0])
    if noam < least[0]:
        raise ScheduleError(
            f"in_flight='paper' cannot run round-robin groups {units}: PipeDream's NOAM is "
            f"{noam} groups of {units[0]} at the input stage, but later stages' groups "
            f"straddle earlier ones', so stage 0 must hold at least {least[0]} groups for "
            f"the pipeline not to deadlock; pass in_flight='full-rate' (q = "
            f"{round_robin_in_flight(units)} groups per stage)"
        )
    q = [noam]
    for s in range(1, P):
        n, before = units[s], units[s - 1]
        slack = before - 1 - ((before - 1) % math.gcd(before, n))
        cap = (before * q[-1] - slack) // n
        busy = -(-sum(units[s:]) // n)
        q.append(max(least[s], min(busy, cap)))
    return tuple(q)


def unstuck(units: Sequence[int], q: list[int]) -> tuple[int, ...]:
    """``q`` raised where stage ``s + 1``'s count needs more groups at stage ``s``."""
    q = list(q)
    for st in range(len(units) - 2, -1, -1):
        n, after = units[st], units[st + 1]
        slack = n - 1 - ((n - 1) % math.gcd(n, after))
        q[st] = max(q[st], -(-(q[st + 1] * after + slack) // n))
    return tuple(q)


@functools.lru_cache(maxsize=256)
def _searched_in_flight(units: tuple[int, ...]) -> tuple[int, ...]:
    """From the last stage back: the least groups in flight at stage ``s`` that let the
    stages from ``s`` on run at full rate (``s`` fed without waiting), then a check of the
    whole pipeline with a few more groups everywhere if it still falls short."""
    P = len(units)
    q = list(unstuck(units, [least_groups_in_flight(units, st) for st in range(P)]))
    if all(n == 1 for n in units):
        return tuple(q)
    for st in range(P - 2, -1, -1):
        for _ in range(2 * sum(units[st:])):
            if unit_rate(units[st:], q[st:]) <= 3.0 + 1e-9:
                break
            q[st] += 1
        q = list(unstuck(units, q))
    best = (unit_rate(units, q), tuple(q))
    for _ in range(3):
        if best[0] <= 3.0 + 1e-9:
            break
        q = list(unstuck(units, [x + (t < P - 1) for t, x in enumerate(q)]))
        rate = unit_rate(units, q)
        if rate < best[0] - 1e-9:
            best = (rate, tuple(q))
    return best[1]


def unit_rate(units: tuple[int, ...], q: Sequence[int], length: int | None = None) -> float:
    """Steady-state time per microbatch of round-robin 1F1B with ``q`` groups in flight,
    every stage costing 1 (forward) + 2 (backward) per microbatch on one device, free
    transfers (the middle fifth of a long stream at stage 0).

    The same game :func:`~pdjax.schedules.play.play` plays on the
    :class:`~pdjax.schedules.actions.Schedule` of these orders, written for this
    one case: a stage's forwards (and backwards) end in group order, so an action waits
    only for the neighbour's group that holds its *last* microbatch
    (``tests/test_schedule.py`` checks it against ``play``; it is what makes the planner's
    final in-flight search take seconds, not minutes, on 64 devices).

    The stream is ``length`` microbatches (default :func:`unit_stream`): a multiple of
    every group size where that is short, else a stage's last group is cut short. The
    middle fifth is far from both ends either way (the stream is at least 4 times the
    microbatches in flight), and a stage 0 that never idles there reads exactly 3."""
    P = len(units)
    N = unit_stream(units, q) if length is None else length
    groups = [-(-N // n) for n in units]
    orders = [group_order(groups[st], q[st] - 1) for st in range(P)]
    # the neighbour's group holding the last microbatch of each of my groups
    last = [[min(g * n + n, N) - 1 for g in range(groups[st])] for st, n in enumerate(units)]
    down = [[k // units[st + 1] for k in last[st]] if st < P - 1 else [] for st in range(P)]
    up = [[k // units[st - 1] for k in last[st]] if st else [] for st in range(P)]
    f_end: list[list[float]] = [[] for _ in range(P)]
    b_end: list[list[float]] = [[] for _ in range(P)]
    free = [0.0] * P
    nxt = [0] * P
    progress = True
    while progress:
        progress = False
        for st in range(P):
            i, t = _unit_advance(
                st,
                orders[st],
                units[st],
                nxt[st],
                free[st],
                up=up,
                down=down,
                f_end=f_end,
                b_end=b_end,
            )
            progress = progress or i > nxt[st]
            free[st], nxt[st] = t, i
    if any(nxt[st] < len(orders[st]) for st in range(P)):
        raise ScheduleError(f"round-robin groups {units} with {tuple(q)} in flight deadlock")
    done = b_end[0]
    lo, hi = int(len(done) * 0.4), int(len(done) * 0.6)
    return (done[hi] - done[lo]) / ((hi - lo) * units[0])


def _unit_advance(
    st: int,
    order: list[tuple[str, int]],
    n: int,
    i: int,
    t: float,
    *,
    up: list[list[int]],
    down: list[list[int]],
    f_end: list[list[float]],
    b_end: list[list[float]],
) -> tuple[int, float]:
    """Runs stage ``st``'s order from position ``i`` (free at ``t``) until an action waits
    for a neighbour; returns the new position and free time (appends to the end times)."""
    P = len(f_end)
    while i < len(order):
        kind, g = order[i]
        if kind == "F":
            if st:
                need, prev = up[st][g], f_end[st - 1]
                if need >= len(prev):
                    break
                t = max(t, prev[need])
            t += n
            f_end[st].append(t)
        else:
            if st < P - 1:
                need, after = down[st][g], b_end[st + 1]
                if need >= len(after):
                    break
                t = max(t, after[need])
            t += 2 * n
            b_end[st].append(t)
        i += 1
    return i, t


def unit_stream(units: Sequence[int], q: Sequence[int]) -> int:
    """Microbatches :func:`unit_rate` streams: at least 12 of the largest group and 4 times
    the microbatches in flight; a multiple of every group size unless that is more than
    twice as long."""
    held = sum(a * b for a, b in zip(q, units, strict=True))
    least = max(12 * max(units), 4 * held)
    period = math.lcm(*units)
    whole = period * -(-least // period)
    return whole if whole <= 2 * least else least
