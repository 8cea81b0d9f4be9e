"""The event player: plays a schedule against action durations and transfer times (the
unit clock of :meth:`~pdjax.schedules.actions.Schedule.grid`, the validator's
deadlock check, and the simulator), and the weight versions alive along a group's list."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from pdjax.errors import ScheduleError

if TYPE_CHECKING:
    from pdjax.schedules.actions import Action, Schedule

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
            needs it (as if each receive were posted in program order); else as soon as
            the sender has produced it.

    Returns:
        Start times and end times per group (parallel to ``s.actions``), and the transfers
        that take time as ``(src, dst, start, end, producing action)``.

    Raises:
        ScheduleError: if the schedule deadlocks.
    """
    player = _Player(s, transfer, posted)
    player.run(duration)
    if any(player.nxt[d] < len(s.actions[d]) for d in range(s.num_groups)):
        ready: Collection[Slot] = player.ready
        if _index(s).coded:
            ready = {_decode(code, s.num_stages) for code in player.ready if isinstance(code, int)}
        raise ScheduleError(_deadlock_message(s, player.nxt, ready))
    return player.starts, player.ends, player.transfers


def _needs(s: Schedule, a: Action, ks: range | None = None) -> tuple[Key, ...]:
    """What ``a`` waits for, besides its group (``ks``: ``s.covers(a)``, if known)."""
    ks = s.covers(a) if ks is None else ks
    if a.kind == "F":
        return _keys("x", a.stage, ks) if a.stage > 0 else ()
    if a.kind in "BI":
        own = ("f", a.stage, a.mb)
        if a.stage == s.num_stages - 1:
            return (own,)
        return (own, *_keys("g", a.stage, ks))
    if a.kind == "W":
        return (("i", a.stage, a.mb),)
    return ()


def _keys(kind: str, stage: int, ks: range) -> tuple[Key, ...]:
    """``(kind, stage, k)`` for each ``k`` in ``ks`` (most often one)."""
    if len(ks) == 1:
        return ((kind, stage, ks[0]),)
    return tuple((kind, stage, k) for k in ks)


Sends = tuple[Any, ...]
"""The tensors an action sends: ``key, cut, destination group`` for each, one after the
other in one flat tuple (the key a :data:`Key`, or in a coded index its int: see
:class:`_Index`)."""


def _makes(s: Schedule, a: Action, ks: range | None = None) -> tuple[Key | None, Sends]:
    """What ``a`` makes ready when it ends: its own result's key (``("f", ...)`` or
    ``("i", ...)``, or ``None``) and the tensors it sends (:data:`Sends`); ``ks``:
    ``s.covers(a)``, if known."""
    where = s.stage_device
    sends: list[Any] = []
    if a.kind == "F":
        if a.stage + 1 < s.num_stages:
            ks = s.covers(a) if ks is None else ks
            for key in _keys("x", a.stage + 1, ks):
                sends += (key, a.stage, where[a.stage + 1])
        return ("f", a.stage, a.mb), tuple(sends)
    if a.kind in "BI":
        if a.stage > 0:
            ks = s.covers(a) if ks is None else ks
            for key in _keys("g", a.stage - 1, ks):
                sends += (key, a.stage - 1, where[a.stage - 1])
        return ("i", a.stage, a.mb), tuple(sends)
    return None, ()


Slot = Key | int
"""A key as an index holds it: the :data:`Key` itself, or in a coded index the int that
stands for it (:func:`_code`)."""

_CODES = ("x", "g", "f", "i")
"""The kinds of key, in the order of their codes (:func:`_code`)."""


def _code(key: Key, stages: int) -> int:
    """The int that stands for ``key`` in a coded index of a schedule of ``stages`` stages:
    ``4 (mb * stages + stage) + kind``, one for each key with ``0 <= stage < stages`` and
    ``mb >= 0``."""
    kind, stage, mb = key
    return 4 * (mb * stages + stage) + _CODES.index(kind)


def _decode(code: int, stages: int) -> Key:
    """The key :func:`_code` codes as ``code``."""
    rest, kind = divmod(code, 4)
    mb, stage = divmod(rest, stages)
    return _CODES[kind], stage, mb


class _Index(NamedTuple):
    """Per group and position, what the action there needs (:func:`_needs`) and makes
    (:func:`_makes`: its own key, and what it sends); ``None`` where not computed yet.

    ``coded``: the keys are ints (:func:`_code`), not tuples. The index lives as long as
    its schedule, and the garbage collector counts the containers it tracks: a coded
    index of ``n`` actions adds about ``2 n`` tuples of numbers only, flat (the collector
    stops tracking such a tuple at its first look, but one holding tuples only at a later
    look, and by then it may have been promoted to the oldest generation, whose growth
    sets off full collections: walks over every object of the process)."""

    needs: list[list[tuple[Slot, ...] | None]]
    owns: list[list[Slot | None]]
    sends: list[list[Sends | None]]
    coded: bool


def _index(s: Schedule) -> _Index:
    """The :class:`_Index` of ``s``, kept on the schedule (it depends on the fields alone):
    a schedule is played more than once (validated, then simulated under one set of costs
    or many).

    Built whole and coded, with each stage's group size looked up once, when every action
    is one of ``F``, ``B``, ``I``, ``W`` with a stage in range and a microbatch ``>= 0``, or a
    ``U``, and every entry can be computed; otherwise (a malformed schedule, played
    unchecked) with tuple keys, each entry computed as the player first reaches its
    action, so that the schedule fails (or deadlocks) exactly where and how it would
    without the index."""
    derived = s._derived
    index: _Index | None = derived.get("play")
    if index is None:
        try:
            index = _coded_index(s)
        except Exception:  # computed lazily instead, raising when (and if) reached
            index = _Index(
                needs=[[None] * len(g) for g in s.actions],
                owns=[[None] * len(g) for g in s.actions],
                sends=[[None] * len(g) for g in s.actions],
                coded=False,
            )
        derived["play"] = index
    return index


def _coded_index(s: Schedule) -> _Index:
    """Every entry of the :class:`_Index`, coded (raises if an action is not as
    :func:`_index` says, or an entry cannot be computed)."""
    S, where = s.num_stages, s.stage_device
    X, G, F, I = range(4)  # noqa: E741  (the codes of _CODES' kinds)
    # s.group_size of every stage_device index (negative ones included, as Python reads
    # them): units[a.stage] is s.group_size(a.stage), and fails where it does
    units = [s.group_size(st) for st in range(len(where))]
    index = _Index([], [], [], coded=True)
    for acts in s.actions:
        needs_d: list[tuple[Slot, ...] | None] = []
        owns_d: list[Slot | None] = []
        sends_d: list[Sends | None] = []
        for a in acts:
            kind, st, mb = a.kind, a.stage, a.mb
            needs: tuple[Slot, ...]
            own: Slot | None
            sends: Sends
            if kind == "U":
                needs, own, sends = (), None, ()
            elif not (
                kind in ("F", "B", "I", "W")
                and type(st) is int
                and type(mb) is int
                and 0 <= st < S
                and mb >= 0
            ):
                raise ValueError(f"{a} has no coded keys")
            elif units[st] == 1:
                # the common case, one microbatch (s.covers(a) is [mb]), written out: the
                # entries of _needs and _makes, coded (4 * (mb * S + stage) + kind)
                at = 4 * (mb * S + st)
                if kind == "F":
                    needs = (at + X,) if st > 0 else ()
                    own = at + F
                    sends = (at + 4 + X, st, where[st + 1]) if st + 1 < S else ()
                elif kind == "W":
                    needs, own, sends = (at + I,), None, ()
                else:  # B or I
                    needs = (at + F,) if st == S - 1 else (at + F, at + G)
                    own = at + I
                    sends = (at - 4 + G, st - 1, where[st - 1]) if st > 0 else ()
            else:
                ks = range(mb, mb + units[st])  # s.covers(a)
                needs = tuple(_code(key, S) for key in _needs(s, a, ks))
                made, sent = _makes(s, a, ks)
                own = None if made is None else _code(made, S)
                sends = tuple(_code(x, S) if j % 3 == 0 else x for j, x in enumerate(sent))
            needs_d.append(needs)
            owns_d.append(own)
            sends_d.append(sends)
        index.needs.append(needs_d)
        index.owns.append(owns_d)
        index.sends.append(sends_d)
    return index


class _Player:
    """The state of one play: per group its next action and when it is free, when each
    input is ready, and each link's queue."""

    def __init__(self, s: Schedule, transfer: Transfer | None, posted: bool) -> None:
        G = s.num_groups
        self.s, self.transfer, self.posted = s, transfer, posted
        self.starts: list[list[float]] = [[] for _ in range(G)]
        self.ends: list[list[float]] = [[] for _ in range(G)]
        self.transfers: list[Move] = []
        self.ready: dict[Slot, float] = {}
        self.pending: dict[Slot, tuple[float, float, int, int, Action]] = {}
        self.link_free: dict[tuple[int, int], float] = {}
        self.free = [0.0] * G
        self.nxt = [0] * G

    def run(self, duration: Callable[[Action], float]) -> None:
        """Runs every group as far as it can, round after round, until none moves.

        Each group runs, in order, every action whose inputs are ready (when it can start:
        once its group is free and every input it needs has arrived), and then marks what
        the action makes ready and sends it on. Rounds visit the groups in order
        ``0 .. G - 1``, and the order in which the groups run their actions decides the
        order of the transfers on each link and in the list of moves.

        A visit to a group waiting for an input that has not arrived (or, with posted
        receives, been sent) changes nothing, so a waiting group is visited again only
        once its input has come: in the same round if a group before it in the round made
        it, else in the next. The actions then run in the order of visiting every group
        in every round, without the visits that change nothing (a long pipeline's rounds
        are mostly those). The loop is written out in one function, with the inputs and
        outputs of every action from :func:`_index`: it is the inner loop of the
        validator's deadlock check and of every simulation."""
        s, transfer, posted = self.s, self.transfer, self.posted
        ready, pending, free, nxt = self.ready, self.pending, self.free, self.nxt
        index = _index(s)
        waiting: dict[Slot, list[int]] = {}  # by the input they wait for
        this_round = list(range(s.num_groups))  # a heap: the groups left to visit
        queued = set(this_round)
        next_round: set[int] = set()

        def wake(key: Slot, d: int) -> None:
            """Visits the groups waiting for ``key``, which group ``d`` has just made."""
            for w in waiting.pop(key):
                if w < d:
                    next_round.add(w)
                elif w not in queued:
                    heapq.heappush(this_round, w)
                    queued.add(w)

        while this_round:
            while this_round:
                d = heapq.heappop(this_round)
                queued.discard(d)
                acts = s.actions[d]
                i, n = nxt[d], len(acts)
                needs_d, owns_d, sends_d = index.needs[d], index.owns[d], index.sends[d]
                starts_d, ends_d = self.starts[d], self.ends[d]
                while i < n:
                    a = acts[i]
                    needs = needs_d[i]
                    if needs is None:
                        needs = needs_d[i] = _needs(s, a)
                    # when a can start: once its group is free and its inputs have arrived
                    start, missing = free[d], None
                    for key in needs:
                        at = ready.get(key)
                        if at is None and key in pending:  # posted now that d has reached a
                            sent, seconds, src, dst, by = pending.pop(key)
                            self._move(key, max(sent, free[d]), seconds, src=src, dst=dst, a=by)
                            at = ready[key]
                        if at is None:
                            missing = key
                            break
                        if at > start:  # max(start, at)
                            start = at
                    if missing is not None:
                        waiting.setdefault(missing, []).append(d)
                        break
                    end = start + duration(a)
                    starts_d.append(start)
                    ends_d.append(end)
                    free[d] = end
                    nxt[d] = i + 1
                    # what a makes ready, sent on to the groups that read it
                    sends = sends_d[i]
                    if sends is None:
                        owns_d[i], sends = _makes(s, a)
                        sends_d[i] = sends
                    own = owns_d[i]
                    if own is not None:
                        ready[own] = end
                        if own in waiting:
                            wake(own, d)
                    for j in range(0, len(sends), 3):
                        key, cut, dst = sends[j], sends[j + 1], sends[j + 2]
                        secs = 0.0 if d == dst or transfer is None else transfer(cut, d, dst)
                        if secs <= 0:
                            ready[key] = end
                        elif posted:
                            pending[key] = (end, secs, d, dst, a)
                        else:
                            self._move(key, end, secs, src=d, dst=dst, a=a)
                        if key in waiting:
                            wake(key, d)
                    i += 1
            this_round = sorted(next_round)
            queued = set(this_round)
            next_round = set()

    def _move(self, key: Slot, at: float, seconds: float, *, src: int, dst: int, a: Action) -> None:
        start = max(at, self.link_free.get((src, dst), 0.0))
        end = start + seconds
        self.link_free[src, dst] = end
        self.transfers.append((src, dst, start, end, a))
        self.ready[key] = end


def _deadlock_message(s: Schedule, nxt: list[int], ready: Collection[Slot]) -> str:
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


def kept_live_versions(s: Schedule, group: int, stage: int) -> list[int]:
    """:func:`live_versions` of ``stage`` along group ``group``'s list of ``s``, computed
    once per schedule and kept on it (``Schedule._derived``): the validator and the
    simulator both read it. Callers must not change the list."""
    kept: dict[tuple[int, int], list[int]] = s._derived.setdefault("live_versions", {})
    live = kept.get((group, stage))
    if live is None:
        live = kept[group, stage] = live_versions(s.actions[group], stage)
    return live
