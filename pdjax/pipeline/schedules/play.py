"""The event player: plays a schedule against action durations and transfer times (the
unit clock of :meth:`~pdjax.pipeline.schedules.actions.Schedule.grid`, the validator's
deadlock check, and the simulator), and the weight versions alive along a group's list."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from pdjax.errors import ScheduleError

if TYPE_CHECKING:
    from pdjax.pipeline.schedules.actions import Action, Schedule

__all__ = ["Move", "live_versions", "play"]

Key = tuple[str, int, int]
"""What an action waits for: ``("x", stage, mb)`` the activation into ``stage``,
``("g", stage, mb)`` the gradient into it, ``("f", ...)`` / ``("i", ...)`` its own forward
/ input gradient."""
Move = tuple[int, int, float, float, "Action"]
"""A transfer that takes time: ``(src, dst, start, end, producing action)``."""
Transfer = Callable[[int, int, int], float]


def play(
    s: Schedule,
    duration: Callable[[Action], float],
    transfer: Transfer | None,
    posted: bool = False,
) -> tuple[list[list[float]], list[list[float]], list[Move]]:
    """Plays ``s``: every action starts once its group is free and its inputs have arrived.

    Args:
        s: the schedule.
        duration: seconds (or ticks) of each action.
        transfer: seconds to move the tensor crossing the cut after stage ``cut`` from group
            ``src`` to group ``dst``, as ``transfer(cut, src, dst)``; ``None``: free. Each
            directed pair of groups is one link that carries one tensor at a time, in the
            order the sender produced them.
        posted: a transfer starts only once the receiving group has reached the action that
            needs it (a receive posted in program order, by a host thread that was busy
            with the actions before); else as soon as the sender has produced it.

    Returns:
        Start times and end times per group (parallel to ``s.actions``), and the transfers
        that take time as ``(src, dst, start, end, producing action)``.

    Raises:
        ScheduleError: if the schedule deadlocks.
    """
    player = _Player(s, transfer, posted)
    player.run(duration)
    if any(player.nxt[d] < len(s.actions[d]) for d in range(s.num_groups)):
        raise ScheduleError(_deadlock_message(s, player.nxt, player.ready))
    return player.starts, player.ends, player.transfers


def _needs(s: Schedule, a: Action) -> tuple[Key, ...]:
    """What ``a`` waits for, besides its group."""
    ks = s.covers(a)
    if a.kind == "F":
        return tuple(("x", a.stage, k) for k in ks) if a.stage > 0 else ()
    if a.kind in "BI":
        own = ("f", a.stage, a.mb)
        if a.stage == s.num_stages - 1:
            return (own,)
        return (own, *(("g", a.stage, k) for k in ks))
    if a.kind == "W":
        return (("i", a.stage, a.mb),)
    return ()


class _Player:
    """The state of one play: per group its next action and when it is free, when each
    input is ready, and each link's queue."""

    def __init__(self, s: Schedule, transfer: Transfer | None, posted: bool) -> None:
        G = s.num_groups
        self.s, self.transfer, self.posted = s, transfer, posted
        self.starts: list[list[float]] = [[] for _ in range(G)]
        self.ends: list[list[float]] = [[] for _ in range(G)]
        self.transfers: list[Move] = []
        self.ready: dict[Key, float] = {}
        self.pending: dict[Key, tuple[float, float, int, int, Action]] = {}
        self.link_free: dict[tuple[int, int], float] = {}
        self.free = [0.0] * G
        self.nxt = [0] * G

    def run(self, duration: Callable[[Action], float]) -> None:
        """Runs every group as far as it can, round after round, until none moves."""
        progress = True
        while progress:
            progress = False
            for d in range(self.s.num_groups):
                acts = self.s.actions[d]
                while self.nxt[d] < len(acts):
                    a = acts[self.nxt[d]]
                    start = self._start(d, a)
                    if start is None:
                        break
                    end = start + duration(a)
                    self.starts[d].append(start)
                    self.ends[d].append(end)
                    self.free[d] = end
                    self.nxt[d] += 1
                    progress = True
                    self._produce(d, a, end)

    def _start(self, d: int, a: Action) -> float | None:
        """When ``a`` can start on group ``d``, or None while an input is missing."""
        start = self.free[d]
        for key in _needs(self.s, a):
            at = self.ready.get(key)
            if at is None and key in self.pending:  # posted now that d has reached a
                sent, seconds, src, dst, by = self.pending.pop(key)
                self._move(key, max(sent, self.free[d]), seconds, src=src, dst=dst, a=by)
                at = self.ready[key]
            if at is None:
                return None
            start = max(start, at)
        return start

    def _produce(self, d: int, a: Action, end: float) -> None:
        """Marks what ``a`` (ended at ``end`` on group ``d``) makes ready, and sends it."""
        s, where = self.s, self.s.stage_device
        if a.kind == "F":
            self.ready["f", a.stage, a.mb] = end
            if a.stage + 1 < s.num_stages:
                for k in s.covers(a):
                    self._send(
                        ("x", a.stage + 1, k), a.stage, src=d, dst=where[a.stage + 1], at=end, a=a
                    )
        elif a.kind in "BI":
            self.ready["i", a.stage, a.mb] = end
            if a.stage > 0:
                for k in s.covers(a):
                    self._send(
                        ("g", a.stage - 1, k),
                        a.stage - 1,
                        src=d,
                        dst=where[a.stage - 1],
                        at=end,
                        a=a,
                    )

    def _send(self, key: Key, cut: int, *, src: int, dst: int, at: float, a: Action) -> None:
        seconds = 0.0 if src == dst or self.transfer is None else self.transfer(cut, src, dst)
        if seconds <= 0:
            self.ready[key] = at
        elif self.posted:
            self.pending[key] = (at, seconds, src, dst, a)
        else:
            self._move(key, at, seconds, src=src, dst=dst, a=a)

    def _move(self, key: Key, at: float, seconds: float, *, src: int, dst: int, a: Action) -> None:
        start = max(at, self.link_free.get((src, dst), 0.0))
        end = start + seconds
        self.link_free[src, dst] = end
        self.transfers.append((src, dst, start, end, a))
        self.ready[key] = end


def _deadlock_message(s: Schedule, nxt: list[int], ready: dict[Key, float]) -> str:
    what = {
        "x": lambda st, k: f"the activation of F(stage={st - 1}, mb={k})",
        "g": lambda st, k: f"the input gradient of B/I(stage={st + 1}, mb={k})",
        "f": lambda st, k: f"F(stage={st}, mb={k})",
        "i": lambda st, k: f"I(stage={st}, mb={k})",
    }
    lines = []
    for d, pos in enumerate(nxt):
        if pos < len(s.actions[d]):
            a = s.actions[d][pos]
            missing = [key for key in _needs(s, a) if key not in ready]
            waits = " and ".join(what[kind](st, k) for kind, st, k in missing)
            where = f"device group {d}, position {pos}: {a.describe()}"
            lines.append(f"{where} waits for {waits}")
    return "cross-stage dependency cannot be met (the schedule deadlocks): " + "; ".join(lines)


def live_versions(acts: Sequence[Action], stage: int) -> list[int]:
    """Weight versions of ``stage`` alive during each action of its group's list.

    Version ``v`` lives from just after the update that makes it (from the start for
    ``v = 0``) until its last use or the update that reads it, whichever is later.
    """
    made = {0: -1}
    last_use: dict[int, int] = {}
    for pos, a in enumerate(acts):
        if a.stage != stage:
            continue
        last_use[a.version] = pos
        if a.kind == "U":
            made[a.version + 1] = pos
    delta = [0] * (len(acts) + 1)
    newest = max(made)
    for v, start in made.items():
        end = len(acts) - 1 if v == newest else max(last_use.get(v, -1), made[v + 1])
        if end >= start + 1:
            delta[start + 1] += 1
            delta[end + 1] -= 1
    live, count = [], 0
    for pos in range(len(acts)):
        count += delta[pos]
        live.append(count)
    return live
