"""Pipeline schedules as data: actions, generators, a validator, and text forms.

A :class:`Schedule` lists, for each device group, the ordered actions it runs:

- ``F(stage, mb)``: forward of microbatch ``mb`` through ``stage``;
- ``B(stage, mb)``: its whole backward (input gradient and weight gradient);
- ``I(stage, mb)`` / ``W(stage, mb)``: the backward split into the input gradient (what the
  previous stage waits for) and the weight gradient (which can be deferred);
- ``U(stage, step)``: the optimizer update of ``stage`` with the gradients of update ``step``.

Every action carries the weight *version* it must use (the number of optimizer updates the
stage's weights have received; for ``U`` the version it reads, producing ``version + 1``).
Transfers are not listed: activations flow ``F(s, k) -> F(s + 1, k)`` and gradients
``B/I(s + 1, k) -> B/I(s, k)`` whenever the two stages live on different device groups.

Compact strings name one action as ``<stage><kind><mb>[v<version>]``, the version shown only
when it is not 0: ``"2F0"`` is the forward of microbatch 0 at stage 2 with version 0,
``"1B7v3"`` the backward of microbatch 7 at stage 1 with version 3, ``"0U2v2"`` the third
update of stage 0. :meth:`Schedule.grid` prints the unit-time clock (every action one tick,
each as early as its dependencies allow) with one column per device group; :func:`parse_grid`
reads it back.

>>> s = one_f_one_b(2, 2)
>>> print(s.grid())
t  g0   g1
0  0F0  .
1  0F1  1F0
2  .    1B0
3  0B0  1F1
4  .    1B1
5  0B1  1U0
6  0U0  .
>>> parse_grid(s.grid()) == s.actions
True
>>> validate(s)
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from pdjax.errors import ScheduleError

__all__ = [
    "KINDS",
    "SCHEDULES",
    "Action",
    "Schedule",
    "format_actions",
    "generate",
    "gpipe",
    "group_sizes",
    "interleaved",
    "one_f_one_b",
    "parse_actions",
    "parse_grid",
    "pipedream",
    "pipedream_2bw",
    "round_robin_in_flight",
    "stage_groups",
    "validate",
    "zb_h1",
    "zb_h2",
    "zb_v",
]

KINDS = ("F", "B", "I", "W", "U")
"""Action kinds: forward, backward, input-gradient, weight-gradient, update."""

SCHEDULES = ("gpipe", "1f1b", "pipedream", "2bw", "interleaved", "zb-h1", "zb-h2", "zb-v")
"""Schedule names, as :func:`generate` and the ``pdjax simulate`` command accept them."""

_FLUSH = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v")
_CHUNKED = ("interleaved", "zb-v")  # several stages per device group
_ROUND_ROBIN = ("gpipe", "1f1b", "pipedream", "2bw")
_ASYNC = ("pipedream", "2bw")
_JSON_FORMAT = "pdjax.schedule/1"
_ACTION_RE = re.compile(r"(\d+)([FBIWU])(\d+)(?:v(\d+))?")


class Action(NamedTuple):
    """One step of one device group.

    Attributes:
        kind: ``"F"``, ``"B"``, ``"I"``, ``"W"`` or ``"U"``.
        stage: the (virtual) stage index, ``0 <= stage < num_stages``.
        mb: the microbatch index; for ``U``, the update index (the step).
        version: the weight version the action uses (for ``U``: reads, and replaces with
            ``version + 1``).
    """

    kind: str
    stage: int
    mb: int
    version: int = 0

    def __str__(self) -> str:
        suffix = f"v{self.version}" if self.version else ""
        return f"{self.stage}{self.kind}{self.mb}{suffix}"

    def describe(self) -> str:
        """Readable form for error messages, e.g. ``B(stage=1, mb=3, version=0)``."""
        index = "step" if self.kind == "U" else "mb"
        return f"{self.kind}(stage={self.stage}, {index}={self.mb}, version={self.version})"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Reads a compact string such as ``"2F0"`` or ``"1B7v3"``.

        Raises:
            ScheduleError: if ``text`` is not ``<stage><kind><mb>[v<version>]``.

        >>> Action.parse("1B7v3")
        Action(kind='B', stage=1, mb=7, version=3)
        """
        match = _ACTION_RE.fullmatch(text.strip())
        if match is None:
            raise ScheduleError(
                f"cannot read action {text!r}: expected <stage><kind><mb>[v<version>] with kind "
                f"one of {'/'.join(KINDS)}, e.g. '2F0' or '1B7v3'"
            )
        stage, kind, mb, version = match.groups()
        return cls(kind, int(stage), int(mb), int(version or 0))


def format_actions(actions: Sequence[Sequence[Action]]) -> str:
    """One line per device group: ``g<d>: <action> <action> ...``.

    >>> print(format_actions(gpipe(2, 1).actions))
    g0: 0F0 0B0 0U0
    g1: 1F0 1B0 1U0
    """
    return "\n".join(f"g{d}: " + " ".join(map(str, acts)) for d, acts in enumerate(actions))


def parse_actions(text: str) -> tuple[tuple[Action, ...], ...]:
    """Inverse of :func:`format_actions`.

    Raises:
        ScheduleError: on a malformed line or action.
    """
    groups = []
    for number, line in enumerate(text.strip().splitlines()):
        head, sep, body = line.partition(":")
        if not sep or head.strip() != f"g{number}":
            raise ScheduleError(f"line {number + 1}: expected 'g{number}: <actions>', got {line!r}")
        groups.append(tuple(Action.parse(token) for token in body.split()))
    return tuple(groups)


def parse_grid(text: str) -> tuple[tuple[Action, ...], ...]:
    """Reads the per-device-group action lists back from :meth:`Schedule.grid`.

    Raises:
        ScheduleError: if the header or a row is malformed.
    """
    lines = [line for line in text.strip().splitlines() if line.strip()]
    if not lines or lines[0].split()[0] != "t":
        raise ScheduleError("a schedule grid starts with a header 't g0 g1 ...'")
    width = len(lines[0].split()) - 1
    groups: list[list[Action]] = [[] for _ in range(width)]
    for line in lines[1:]:
        cells = line.split()
        if len(cells) != width + 1:
            raise ScheduleError(f"grid row {line!r} has {len(cells) - 1} cells, expected {width}")
        for d, cell in enumerate(cells[1:]):
            if cell != ".":
                groups[d].append(Action.parse(cell))
    return tuple(tuple(g) for g in groups)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A pipeline schedule: what every device group runs, in order, with which weights.

    Attributes:
        name: one of :data:`SCHEDULES`; fixes the semantics the validator checks.
        num_stages: ``S``, the number of (virtual) stages. For ``interleaved`` with ``v``
            chunks over ``P`` device groups, ``S = P * v``; for ``zb-v``, ``S = 2 P``;
            otherwise ``S = P``.
        num_microbatches: ``N``, all microbatches the schedule runs (``steps * M`` for the
            flush schedules, the stream length for ``pipedream`` and ``2bw``).
        microbatches_per_step: ``M``, the microbatches whose gradients one update applies
            (1 for ``pipedream``, which updates after every microbatch).
        actions: per device group, its actions in execution order.
        stage_device: the device group of each stage (:func:`stage_groups`):
            ``stage_device[s] = s % P``; for ``interleaved``, group ``d`` holds stages
            ``d, d + P, d + 2P, ...``; for ``zb-v`` (the V), stages ``0 .. P - 1`` on groups
            ``0 .. P - 1`` and stages ``P .. 2P - 1`` on groups ``P - 1 .. 0``, so that group
            ``d`` holds stages ``d`` and ``2P - 1 - d``.
        replicas: devices in each device group.
        replication: per device group, how its replicas share the work: ``"split"`` (each
            microbatch split across them; the default, ``()`` meaning every group) or
            ``"round-robin"`` (PipeDream's: each replica takes whole microbatches, ``r``
            consecutive ones at once; the group's ``F`` and ``B`` actions then cover
            ``r`` microbatches each, named by the first, and under ``pipedream`` it
            updates once per such group of ``r``; see :func:`pipedream`).
        in_flight_bound: per device group, the most microbatches whose forward has run
            there and whose backward (``B``, or ``I`` and ``W``) has not, summed over the
            group's stages.
        version_bound: per stage, the most weight versions it ever keeps.
        vertical_sync: ``pipedream`` only: every stage uses the version stage 0 used.
        weight_stashing: ``pipedream`` only: the backward reuses the forward's version
            (``False``: it uses the newest weights, the paper's inconsistent baseline).
        extra_in_flight: ``pipedream`` only: microbatches in flight per stage beyond
            ``P - s`` (latency hiding; see :func:`pipedream`).
    """

    name: str
    num_stages: int
    num_microbatches: int
    microbatches_per_step: int
    actions: tuple[tuple[Action, ...], ...]
    stage_device: tuple[int, ...]
    replicas: tuple[int, ...]
    in_flight_bound: tuple[int, ...]
    version_bound: tuple[int, ...]
    vertical_sync: bool = False
    weight_stashing: bool = True
    extra_in_flight: int = 0
    replication: tuple[str, ...] = ()

    @property
    def num_groups(self) -> int:
        """``P``, the number of device groups (pipeline depth)."""
        return len(self.actions)

    @property
    def chunks(self) -> int:
        """Stages per device group (``v`` for ``interleaved``, 2 for ``zb-v``, else 1)."""
        return self.num_stages // max(1, self.num_groups)

    @property
    def num_steps(self) -> int:
        """Steps of ``M`` microbatches (optimizer updates per stage, except at round-robin
        stages under ``pipedream``: see :meth:`updates_of`)."""
        return self.num_microbatches // self.microbatches_per_step

    def group_size(self, stage: int) -> int:
        """Microbatches one ``F``/``B`` of ``stage`` covers: its replicas under round-robin
        replication, else 1."""
        d = self.stage_device[stage]
        rr = bool(self.replication) and self.replication[d] == "round-robin"
        return self.replicas[d] if rr else 1

    def covers(self, a: Action) -> range:
        """The microbatches action ``a`` computes (``U``: none)."""
        if a.kind == "U":
            return range(0)
        return range(a.mb, a.mb + self.group_size(a.stage))

    def per_update(self, stage: int) -> int:
        """Microbatches whose gradients one update of ``stage`` applies: ``M``, or under
        ``pipedream`` the stage's group size (1 unless round-robin)."""
        if self.name == "pipedream":
            return self.group_size(stage)
        return self.microbatches_per_step

    def updates_of(self, stage: int) -> int:
        """Optimizer updates of ``stage`` over the whole schedule."""
        return self.num_microbatches // self.per_update(stage)

    def stages_of(self, group: int) -> tuple[int, ...]:
        """The stages device group ``group`` holds, in increasing order."""
        return tuple(s for s, d in enumerate(self.stage_device) if d == group)

    def clock(self) -> tuple[tuple[int, ...], ...]:
        """Unit-time start tick of every action (each takes one tick, starts when ready).

        Raises:
            ScheduleError: if the schedule deadlocks (a cross-stage dependency cannot be met).
        """
        starts, _, _ = _play(self, lambda a: 1, None)
        return tuple(tuple(int(t) for t in group) for group in starts)

    def grid(self) -> str:
        """The unit-time clock as text: one row per tick, one column per device group.

        Idle cells print as ``.``; :func:`parse_grid` reads the actions back.
        """
        ticks = self.clock()
        length = 1 + max((t[-1] for t in ticks if t), default=-1)
        cells = [["."] * self.num_groups for _ in range(length)]
        for d, (acts, times) in enumerate(zip(self.actions, ticks, strict=True)):
            for action, tick in zip(acts, times, strict=True):
                cells[tick][d] = str(action)
        rows = [["t"] + [f"g{d}" for d in range(self.num_groups)]]
        rows += [[str(t), *row] for t, row in enumerate(cells)]
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        return "\n".join(
            "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip()
            for r in rows
        )

    def to_json(self) -> str:
        """JSON text (each group's actions as one line of compact strings).

        :meth:`from_json` returns an equal schedule.
        """
        lines = [f'  "format": {json.dumps(_JSON_FORMAT)}']
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "actions":
                groups = ",\n".join(f"    {json.dumps(' '.join(map(str, g)))}" for g in value)
                text = f"[\n{groups}\n  ]"
            else:
                text = json.dumps(list(value) if isinstance(value, tuple) else value)
            lines.append(f"  {json.dumps(field.name)}: {text}")
        return "{\n" + ",\n".join(lines) + "\n}\n"

    @classmethod
    def from_json(cls, text: str) -> Schedule:
        """Reads :meth:`to_json` output.

        Raises:
            ScheduleError: if the text is not a pdjax schedule.
        """
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ScheduleError(f"schedule JSON does not parse: {e}") from e
        if not isinstance(data, dict) or data.get("format") != _JSON_FORMAT:
            raise ScheduleError(f"not a pdjax schedule: expected a 'format': {_JSON_FORMAT!r} key")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names - {"format"}
        missing = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING}
        missing -= set(data)
        if unknown or missing:
            raise ScheduleError(
                f"schedule JSON: unknown keys {sorted(unknown)}, missing keys {sorted(missing)}"
            )
        fields: dict[str, Any] = {}
        try:
            for name in names & set(data):
                value = data[name]
                if name == "actions":
                    value = tuple(tuple(map(Action.parse, g.split())) for g in value)
                elif isinstance(value, list):
                    value = tuple(value)
                fields[name] = value
        except (TypeError, AttributeError) as e:
            raise ScheduleError(f"schedule JSON: malformed 'actions' ({e})") from e
        return cls(**fields)


# ----------------------------------------------------------------------------- generators


def _positive(name: str, value: object, minimum: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ScheduleError(f"{name} must be an integer >= {minimum}; got {value!r}")
    return value


def _replicas(replicas: Sequence[int] | None, groups: int) -> tuple[int, ...]:
    if replicas is None:
        return (1,) * groups
    replicas = tuple(replicas)
    if len(replicas) != groups:
        raise ScheduleError(
            f"replicas has {len(replicas)} entries but the pipeline has {groups} device groups "
            f"(num_stages); pass one replica count per stage, e.g. the Plan's"
        )
    for r in replicas:
        _positive("every replica count", r)
    return replicas


REPLICATION = ("split", "round-robin")
"""How a replicated stage's devices share its microbatches."""


def _replication(
    replication: Sequence[str] | str | None, replicas: tuple[int, ...], name: str
) -> tuple[str, ...]:
    """Per device group ``"split"`` or ``"round-robin"`` (``()`` when every group splits)."""
    if replication is None:
        return ()
    if isinstance(replication, str):
        replication = [replication] * len(replicas)
    replication = tuple(replication)
    if len(replication) != len(replicas):
        raise ScheduleError(
            f"replication has {len(replication)} entries but the pipeline has {len(replicas)} "
            "device groups; give one per group, or one word for all"
        )
    for mode in replication:
        if mode not in REPLICATION:
            raise ScheduleError(f"replication must be one of {REPLICATION}, got {mode!r}")
    if all(m == "split" or r == 1 for m, r in zip(replication, replicas, strict=True)):
        return ()
    if name not in _ROUND_ROBIN:
        raise ScheduleError(
            f"round-robin replication runs whole groups of microbatches through 1F1B-style "
            f"orders: {', '.join(_ROUND_ROBIN)}; {name} has no round-robin form, use "
            "replication='split'"
        )
    return replication


def group_sizes(replicas: Sequence[int], replication: Sequence[str]) -> tuple[int, ...]:
    """Per device group, microbatches one action covers: its replicas under round-robin,
    else 1 (``replication`` empty: every group splits)."""
    if not replication:
        return (1,) * len(replicas)
    return tuple(r if m == "round-robin" else 1 for r, m in zip(replicas, replication, strict=True))


def _groups_in_flight(units: Sequence[int], stage: int, extra: int = 0) -> int:
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


def _group_order(groups: int, warmup: int) -> list[tuple[str, int]]:
    """1F1B over ``groups`` (indices): ``warmup`` forwards, F/B pairs, then the drain."""
    warmup = min(warmup, groups)
    order = [("F", g) for g in range(warmup)]
    for g in range(groups - warmup):
        order += [("F", warmup + g), ("B", g)]
    order += [("B", g) for g in range(groups - warmup, groups)]
    return order


def round_robin_in_flight(units: Sequence[int], extra: int = 0) -> tuple[int, ...]:
    """``q_s`` per stage: the groups in flight each stage of a round-robin pipeline keeps.

    ``units[s] = n_s``: the microbatches one action of stage ``s`` covers (its replicas if
    round-robin, else 1). Starting from the least counts (:func:`_groups_in_flight`: the
    busy bound and the one that keeps groups of unequal sizes from deadlocking), from the
    last stage back, stage ``s`` gets one more group at a time until the stages from ``s``
    on run a balanced pipeline (every stage one unit of forward and two of backward per
    microbatch on one device, free transfers) at full rate, one microbatch per 3 units
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
    q = list(_searched_in_flight(units))
    for st in range(len(units) - 1):
        q[st] += extra
    return _unstuck(units, q)


def _unstuck(units: Sequence[int], q: list[int]) -> tuple[int, ...]:
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
    q = list(_unstuck(units, [_groups_in_flight(units, st) for st in range(P)]))
    if all(n == 1 for n in units):
        return tuple(q)
    for st in range(P - 2, -1, -1):
        for _ in range(2 * sum(units[st:])):
            if _unit_rate(units[st:], q[st:]) <= 3.0 + 1e-9:
                break
            q[st] += 1
        q = list(_unstuck(units, q))
    best = (_unit_rate(units, q), tuple(q))
    for _ in range(3):
        if best[0] <= 3.0 + 1e-9:
            break
        q = list(_unstuck(units, [x + (t < P - 1) for t, x in enumerate(q)]))
        rate = _unit_rate(units, q)
        if rate < best[0] - 1e-9:
            best = (rate, tuple(q))
    return best[1]


def _unit_rate(units: tuple[int, ...], q: Sequence[int], length: int | None = None) -> float:
    """Steady-state time per microbatch of round-robin 1F1B with ``q`` groups in flight,
    every stage costing 1 (forward) + 2 (backward) per microbatch on one device, free
    transfers (the middle fifth of a long stream at stage 0).

    The same game :func:`_play` plays on the :class:`Schedule` of these orders, written
    for this one case: a stage's forwards (and backwards) end in group order, so an
    action waits only for the neighbour's group that holds its *last* microbatch
    (``tests/test_schedule.py`` checks it against :func:`_play`; it is what makes the
    planner's final in-flight search take seconds, not minutes, on 64 devices).

    The stream is ``length`` microbatches (default :func:`_unit_stream`): a multiple of
    every group size where that is short, else a stage's last group is cut short. The
    middle fifth is far from both ends either way (the stream is at least 4 times the
    microbatches in flight), and a stage 0 that never idles there reads exactly 3."""
    P = len(units)
    N = _unit_stream(units, q) if length is None else length
    groups = [-(-N // n) for n in units]
    orders = [_group_order(groups[st], q[st] - 1) for st in range(P)]
    # the neighbour's group holding the last microbatch of each of my groups
    up = [[min(g * n + n, N) - 1 for g in range(groups[st])] for st, n in enumerate(units)]
    down = [[k // units[st + 1] for k in up[st]] if st < P - 1 else [] for st in range(P)]
    up = [[k // units[st - 1] for k in up[st]] if st else [] for st in range(P)]
    f_end: list[list[float]] = [[] for _ in range(P)]
    b_end: list[list[float]] = [[] for _ in range(P)]
    free = [0.0] * P
    nxt = [0] * P
    progress = True
    while progress:
        progress = False
        for st in range(P):
            order, n, t = orders[st], units[st], free[st]
            i, fe, be = nxt[st], f_end[st], b_end[st]
            while i < len(order):
                kind, g = order[i]
                if kind == "F":
                    if st:
                        need = up[st][g]
                        prev = f_end[st - 1]
                        if need >= len(prev):
                            break
                        t = max(t, prev[need])
                    t += n
                    fe.append(t)
                else:
                    if st < P - 1:
                        need = down[st][g]
                        after = b_end[st + 1]
                        if need >= len(after):
                            break
                        t = max(t, after[need])
                    t += 2 * n
                    be.append(t)
                i += 1
                progress = True
            free[st], nxt[st] = t, i
    if any(nxt[st] < len(orders[st]) for st in range(P)):
        raise ScheduleError(f"round-robin groups {units} with {tuple(q)} in flight deadlock")
    done = b_end[0]
    lo, hi = int(len(done) * 0.4), int(len(done) * 0.6)
    return (done[hi] - done[lo]) / ((hi - lo) * units[0])


def _unit_stream(units: Sequence[int], q: Sequence[int]) -> int:
    """Microbatches :func:`_unit_rate` streams: at least 12 of the largest group and 4 times
    the microbatches in flight; a multiple of every group size unless that is more than
    twice as long."""
    held = sum(a * b for a, b in zip(q, units, strict=True))
    least = max(12 * max(units), 4 * held)
    period = math.lcm(*units)
    whole = period * -(-least // period)
    return whole if whole <= 2 * least else least


def _check_multiple(what: str, count: int, units: Sequence[int]) -> None:
    for d, n in enumerate(units):
        if count % n:
            raise ScheduleError(
                f"{what}={count} is not a multiple of device group {d}'s {n} round-robin "
                f"replicas (each takes whole groups of {n} microbatches)"
            )


def _extra(e: int, stage: int, num_stages: int) -> int:
    """PipeDream's extra microbatches in flight at ``stage``: ``e``, none at the last stage."""
    return e if stage < num_stages - 1 else 0


def _one_f_one_b_order(
    num_stages: int, count: int, stage: int, extra: int = 0
) -> list[tuple[str, int]]:
    """1F1B order at ``stage``: warm-up forwards (``extra`` more than ``P - s - 1``), then
    forward/backward pairs, then drain."""
    warmup = min(num_stages - stage - 1 + extra, count)
    order = [("F", k) for k in range(warmup)]
    for k in range(count - warmup):
        order += [("F", warmup + k), ("B", k)]
    order += [("B", k) for k in range(count - warmup, count)]
    return order


def stage_groups(name: str, groups: int, chunks: int = 1) -> tuple[int, ...]:
    """The device group of each (virtual) stage of schedule ``name`` over ``groups``
    device groups with ``chunks`` stages each: ``s % P`` (``interleaved`` and every
    one-stage-per-group schedule), or the V of ``zb-v`` (``chunks`` must be 2): stages
    ``0 .. P - 1`` on groups ``0 .. P - 1``, then stages ``P .. 2P - 1`` back on groups
    ``P - 1 .. 0``.

    >>> stage_groups("interleaved", 3, 2), stage_groups("zb-v", 3, 2)
    ((0, 1, 2, 0, 1, 2), (0, 1, 2, 2, 1, 0))
    """
    stages = groups * chunks
    if name == "zb-v":
        return tuple(min(s, stages - 1 - s) for s in range(stages))
    return tuple(s % groups for s in range(stages))


def _flush(
    name: str,
    groups: int,
    chunks: int,
    per_step: int,
    steps: int,
    step_order: Callable[[int], list[tuple[str, int, int]]],
    in_flight: Callable[[int], int],
    replicas: Sequence[int] | None,
    replication: tuple[str, ...] = (),
) -> Schedule:
    """Repeats one step's order ``steps`` times, step ``t`` at version ``t``, then updates
    (each of the group's stages, in increasing order)."""
    stages = groups * chunks
    where = stage_groups(name, groups, chunks)
    actions = []
    for d in range(groups):
        order = step_order(d)
        mine = [s for s in range(stages) if where[s] == d]
        acts = []
        for t in range(steps):
            acts += [Action(kind, s, t * per_step + k, t) for kind, s, k in order]
            acts += [Action("U", s, t, t) for s in mine]
        actions.append(tuple(acts))
    return Schedule(
        name=name,
        num_stages=stages,
        num_microbatches=per_step * steps,
        microbatches_per_step=per_step,
        actions=tuple(actions),
        stage_device=where,
        replicas=_replicas(replicas, groups),
        in_flight_bound=tuple(in_flight(d) for d in range(groups)),
        version_bound=(1,) * stages,
        replication=replication,
    )


def gpipe(
    num_stages: int,
    num_microbatches: int,
    *,
    steps: int = 1,
    replicas: Sequence[int] | None = None,
    replication: Sequence[str] | str | None = None,
) -> Schedule:
    """GPipe: all forwards of a step, then all backwards (last microbatch first), then update.

    Versions: every action of step ``t`` uses version ``t``; ``U(s, t)`` makes ``t + 1``.
    In flight: ``M`` at every stage. Versions kept: 1.

    Args:
        num_stages: ``P``, stages (one device group each).
        num_microbatches: ``M``, microbatches per step.
        steps: optimizer steps to lay out.
        replicas: devices per stage (default 1 each).

    Raises:
        ScheduleError: for a parameter out of range.

    >>> print(format_actions(gpipe(2, 2).actions))
    g0: 0F0 0F1 0B1 0B0 0U0
    g1: 1F0 1F1 1B1 1B0 1U0
    """
    P = _positive("num_stages (P)", num_stages)
    M = _positive("num_microbatches (M)", num_microbatches)
    _positive("steps", steps)
    reps = _replicas(replicas, P)
    mode = _replication(replication, reps, "gpipe")
    units = group_sizes(reps, mode)
    _check_multiple("num_microbatches (M)", M, units)

    def order(s: int) -> list[tuple[str, int, int]]:
        ks = range(0, M, units[s])
        return [("F", s, k) for k in ks] + [("B", s, k) for k in reversed(ks)]

    return _flush("gpipe", P, 1, M, steps, order, lambda s: M, replicas, mode)


def one_f_one_b(
    num_stages: int,
    num_microbatches: int,
    *,
    steps: int = 1,
    replicas: Sequence[int] | None = None,
    replication: Sequence[str] | str | None = None,
) -> Schedule:
    """1F1B with a flush (PipeDream-Flush): ``P - s - 1`` warm-up forwards, then F/B pairs.

    Versions: every action of step ``t`` uses version ``t``; ``U(s, t)`` makes ``t + 1``.
    In flight at stage ``s``: at most ``min(P - s, M)``. Versions kept: 1.

    With round-robin stages (``replication``) every stage runs 1F1B over its groups of
    ``n_s`` microbatches (``n_s``: its replicas if round-robin, else 1) with
    ``q_s = ceil(W_s / n_s)`` groups in flight, ``W_s = n_s + ... + n_{P-1}``: at most
    ``min(q_s n_s, M)`` microbatches. ``M`` must be a multiple of every ``n_s``.

    Args:
        num_stages: ``P``, stages (one device group each).
        num_microbatches: ``M``, microbatches per step.
        steps: optimizer steps to lay out.
        replicas: devices per stage (default 1 each).

    Raises:
        ScheduleError: for a parameter out of range.
    """
    P = _positive("num_stages (P)", num_stages)
    M = _positive("num_microbatches (M)", num_microbatches)
    _positive("steps", steps)
    reps = _replicas(replicas, P)
    mode = _replication(replication, reps, "1f1b")
    units = group_sizes(reps, mode)
    _check_multiple("num_microbatches (M)", M, units)

    q = round_robin_in_flight(units)

    def order(s: int) -> list[tuple[str, int, int]]:
        n = units[s]
        return [(kind, s, g * n) for kind, g in _group_order(M // n, q[s] - 1)]

    def in_flight(s: int) -> int:
        return min(q[s] * units[s], M)

    return _flush("1f1b", P, 1, M, steps, order, in_flight, replicas, mode)


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
    P = _positive("num_stages (P)", num_stages)
    M = _positive("num_microbatches (M)", num_microbatches)
    _positive("steps", steps)

    def order(s: int) -> list[tuple[str, int, int]]:
        out: list[tuple[str, int, int]] = []
        for kind, k in _one_f_one_b_order(P, M, s):
            if kind == "F":
                out.append(("F", s, k))
            else:
                out.append(("I", s, k))
                if k - s >= 0:
                    out.append(("W", s, k - s))
        out += [("W", s, k) for k in range(max(0, M - s), M)]
        return out

    return _flush("zb-h1", P, 1, M, steps, order, lambda s: min(P, M), replicas)


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
    P = _positive("num_stages (P)", num_stages)
    M = _positive("num_microbatches (M)", num_microbatches)
    _positive("steps", steps)

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

    return _flush("zb-h2", P, 1, M, steps, order, lambda s: min(2 * P - 1, M), replicas)


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
    model). Group ``d`` runs:

    1. ``2 (P - d) - 1`` forwards of its first chunk;
    2. ``d`` times: a forward of the second chunk, then of the first;
    3. ``P - d`` times: ``F``, ``I``, ``W`` of the second chunk;
    4. until both chunks have run every forward: ``F`` (while any is left), ``I``, ``W`` of
       the first chunk, then ``F``, ``I``, ``W`` of the second;
    5. the drain: ``d`` times ``I`` of the first chunk and ``I`` of the second; ``P - d``
       times ``I`` and the oldest deferred ``W`` of the first chunk; then the deferred
       ``W`` of the second chunk, then of the first.

    For ``M < 2P - 1`` the order is laid out for ``2P - 1`` microbatches and the actions of
    the missing ones are left out.

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
    P = _positive("num_stages (P)", num_stages)
    M = _positive("num_microbatches (M)", num_microbatches)
    _positive("steps", steps)
    if num_layers is not None:
        _positive("num_layers", num_layers)
        if num_layers % (2 * P):
            raise ScheduleError(
                f"zb-v over P={P} device groups splits the model into 2P = {2 * P} equal "
                f"stages (two chunks per group); got num_layers={num_layers}, which {2 * P} "
                f"does not divide"
            )
    n = max(M, 2 * P - 1)  # the order's length; microbatches >= M are left out

    def order(d: int) -> list[tuple[str, int, int]]:
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

    return _flush("zb-v", P, 2, M, steps, order, lambda d: min(2 * P, 2 * M), replicas)


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
    P = _positive("num_stages (P)", num_stages)
    M = _positive("num_microbatches (M)", num_microbatches)
    v = _positive("chunks (v)", chunks)
    _positive("steps", steps)
    if num_layers is not None:
        _positive("num_layers", num_layers)
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
            return [(kind, d, k) for kind, k in _one_f_one_b_order(P, M, d)]
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

    def in_flight(d: int) -> int:
        return min(P - d, M) if v == 1 else min(warmup(d) + 1, total)

    return _flush("interleaved", P, v, M, steps, order, in_flight, replicas)


def pipedream(
    num_stages: int,
    num_microbatches: int,
    *,
    vertical_sync: bool = False,
    weight_stashing: bool = True,
    replicas: Sequence[int] | None = None,
    extra_in_flight: int = 0,
    replication: Sequence[str] | str | None = None,
) -> Schedule:
    """PipeDream: asynchronous 1F1B over a stream, an update after every backward.

    Stage ``s`` warms up with ``P - s - 1`` forwards, then runs ``F``, ``B``, ``U`` for each
    microbatch, no flush. ``U(s, k)`` applies microbatch ``k``'s gradient and makes version
    ``k + 1``.

    Versions, for microbatch ``k`` at stage ``s``:

    - default (weight stashing): ``F`` and ``B`` use ``max(0, k - (P - s) + 1)``;
      versions kept: ``P - s``;
    - ``vertical_sync=True``: ``F`` and ``B`` use ``max(0, k - P + 1)``, the version stage 0
      used; versions kept: up to ``P``;
    - ``weight_stashing=False``: ``F`` as above; ``B`` uses the newest weights, which at
      stage ``s`` is version ``k`` (updates ``0 .. k - 1`` have run), written out in the
      action; versions kept: 1 (``P`` with vertical sync).

    In flight at stage ``s``: at most ``min(P - s, N)``.

    ``extra_in_flight = e`` (latency hiding): every stage but the last warms up with ``e``
    more forwards, so ``P - s + e`` microbatches are in flight there and a delay of up to
    ``e`` periods on the activation/gradient round trip no longer stalls the stage (the
    last stage has no round trip to hide). Each extra microbatch costs one more stashed
    version and one more stashed activation per stage, and one more update of staleness:
    ``P - s`` becomes ``P - s + e`` for ``s < P - 1`` in every formula above (``P`` becomes
    ``P + e`` with vertical sync).

    Round-robin replication (PipeDream's own, ``replication``): a stage ``s`` on ``r``
    devices takes groups of ``n_s = r`` consecutive microbatches, one per device, and
    updates once per group with their mean gradient (``U(s, u)`` applies group ``u``,
    microbatches ``u n_s .. u n_s + n_s - 1``, and makes version ``u + 1``); any other stage
    has ``n_s = 1``. Stage ``s`` runs 1F1B over its groups with ``q_s = ceil(W_s / n_s) + e``
    groups in flight (``e`` not at the last stage), ``W_s = n_s + ... + n_{P-1}`` (the
    microbatch slots from ``s`` on; PipeDream's NOAM at stage 0). Microbatch ``k``, in group
    ``g = k // n_s``, runs ``F`` and ``B`` at version ``max(0, g - q_s + 1)``: the updates
    of the groups ``0 .. g - q_s``, whose backwards ran before its forward. Versions kept:
    ``q_s``; in flight: ``q_s n_s`` microbatches. With every ``n_s = 1`` this is the formula
    above (``q_s = P - s + e``). ``N`` must be a multiple of every ``n_s``; vertical sync and
    ``weight_stashing=False`` are not defined with round-robin stages.

    Args:
        num_stages: ``P``, stages (one device group each).
        num_microbatches: ``N``, the stream length.
        vertical_sync: every stage uses stage 0's version for each microbatch.
        weight_stashing: the backward reuses the forward's version.
        replicas: devices per stage (default 1 each).
        extra_in_flight: ``e >= 0``, microbatches in flight beyond 1F1B's ``P - s``.
        replication: per stage ``"split"`` or ``"round-robin"`` (or one word for all).

    Raises:
        ScheduleError: for a parameter out of range.
    """
    P = _positive("num_stages (P)", num_stages)
    N = _positive("num_microbatches (N, the stream length)", num_microbatches)
    e = _positive("extra_in_flight", extra_in_flight, minimum=0)
    reps = _replicas(replicas, P)
    mode = _replication(replication, reps, "pipedream")
    if mode:
        return _pipedream_round_robin(P, N, e, reps, mode, vertical_sync, weight_stashing)
    actions = []
    for s in range(P):
        es = e if s < P - 1 else 0
        lag = P + e if vertical_sync else P - s + es
        acts = []
        for kind, k in _one_f_one_b_order(P, N, s, es):
            forward_version = max(0, k - lag + 1)
            if kind == "F":
                acts.append(Action("F", s, k, forward_version))
            else:
                acts.append(Action("B", s, k, forward_version if weight_stashing else k))
                acts.append(Action("U", s, k, k))
        actions.append(tuple(acts))
    if vertical_sync:
        versions = (P + e,) * P
    else:
        versions = tuple(P - s + _extra(e, s, P) if weight_stashing else 1 for s in range(P))
    return Schedule(
        name="pipedream",
        num_stages=P,
        num_microbatches=N,
        microbatches_per_step=1,
        actions=tuple(actions),
        stage_device=tuple(range(P)),
        replicas=_replicas(replicas, P),
        in_flight_bound=tuple(min(P - s + _extra(e, s, P), N) for s in range(P)),
        version_bound=versions,
        vertical_sync=vertical_sync,
        weight_stashing=weight_stashing,
        extra_in_flight=e,
    )


def _pipedream_round_robin(
    P: int,
    N: int,
    e: int,
    replicas: tuple[int, ...],
    replication: tuple[str, ...],
    vertical_sync: bool,
    weight_stashing: bool,
) -> Schedule:
    """:func:`pipedream` with round-robin stages (the formulas in its docstring)."""
    if vertical_sync or not weight_stashing:
        raise ScheduleError(
            "pipedream with round-robin replication is defined with weight stashing and "
            "without vertical sync; use replication='split' for those options"
        )
    units = group_sizes(replicas, replication)
    _check_multiple("num_microbatches (N, the stream length)", N, units)
    qs = round_robin_in_flight(units, e)
    actions = []
    for s in range(P):
        n, q = units[s], qs[s]
        acts = []
        for kind, g in _group_order(N // n, q - 1):
            version = max(0, g - q + 1)
            acts.append(Action(kind, s, g * n, version))
            if kind == "B":
                acts.append(Action("U", s, g, g))
        actions.append(tuple(acts))
    return Schedule(
        name="pipedream",
        num_stages=P,
        num_microbatches=N,
        microbatches_per_step=1,
        actions=tuple(actions),
        stage_device=tuple(range(P)),
        replicas=replicas,
        in_flight_bound=tuple(min(qs[s] * units[s], N) for s in range(P)),
        version_bound=tuple(min(qs[s], N // units[s]) for s in range(P)),
        extra_in_flight=e,
        replication=replication,
    )


def pipedream_2bw(
    num_stages: int,
    microbatches_per_step: int,
    num_microbatches: int,
    *,
    replicas: Sequence[int] | None = None,
    replication: Sequence[str] | str | None = None,
) -> Schedule:
    """PipeDream-2BW: 1F1B without flush, one update per ``M`` microbatches, two versions.

    Stage ``s`` runs the 1F1B order over the whole stream and ``U(s, t)`` right after the
    backward of step ``t``'s last microbatch: ``W(t + 1) = W(t) - lr * g(W(t - 1))``.

    Versions: every ``F`` and ``B`` of step ``t`` (microbatches ``t M .. t M + M - 1``), at
    every stage, uses ``W(t - 1)``, version ``max(0, t - 1)`` (``W(-1) = W(0)``); ``U(s, t)``
    reads version ``t``. Versions kept: 2. In flight at stage ``s``: ``min(P - s, N)``.

    Args:
        num_stages: ``P``, stages (one device group each).
        microbatches_per_step: ``M >= P``, microbatches per update.
        num_microbatches: ``N``, the stream length, a multiple of ``M``.
        replicas: devices per stage (default 1 each).

    Raises:
        ScheduleError: for a parameter out of range, ``M < P``, or ``N`` not a multiple of
            ``M``.
    """
    P = _positive("num_stages (P)", num_stages)
    M = _positive("microbatches_per_step (M)", microbatches_per_step)
    N = _positive("num_microbatches (N, the stream length)", num_microbatches)
    if M < P:
        raise ScheduleError(
            f"2bw needs microbatches_per_step (M) >= num_stages (P) so that step t can use "
            f"W(t-1) at every stage; got M={M}, P={P}. Accepted: M in [{P}, inf)"
        )
    if N % M:
        raise ScheduleError(
            f"2bw needs num_microbatches (N, the stream length) a multiple of "
            f"microbatches_per_step (M={M}); got N={N}. Accepted: N in {{{M}, {2 * M}, ...}}"
        )
    reps = _replicas(replicas, P)
    mode = _replication(replication, reps, "2bw")
    units = group_sizes(reps, mode)
    _check_multiple("microbatches_per_step (M)", M, units)
    qs = round_robin_in_flight(units)
    actions = []
    for s in range(P):
        n = units[s]
        acts = []
        for kind, g in _group_order(N // n, qs[s] - 1):
            k = g * n
            t = k // M
            acts.append(Action(kind, s, k, max(0, t - 1)))
            if kind == "B" and (k + n) % M == 0:
                acts.append(Action("U", s, t, t))
        actions.append(tuple(acts))
    return Schedule(
        name="2bw",
        num_stages=P,
        num_microbatches=N,
        microbatches_per_step=M,
        actions=tuple(actions),
        stage_device=tuple(range(P)),
        replicas=reps,
        in_flight_bound=tuple(min(qs[s] * units[s], N) for s in range(P)),
        version_bound=(2,) * P,
        replication=mode,
    )


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
    """Builds the schedule called ``name`` (one of :data:`SCHEDULES`).

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
    if extra_in_flight and name != "pipedream":
        raise ScheduleError(f"extra_in_flight is a pipedream option, not of {name}")
    if name not in _ROUND_ROBIN and replication is not None:
        _replication(replication, _replicas(replicas, num_stages), name)
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
        if chunks != 2:
            raise ScheduleError(
                f"zb-v places two stages on each device group (a V: 2P stages over P groups); "
                f"chunks must be 2, got {chunks!r}"
            )
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


# ----------------------------------------------------------------------------- validator


def _expected_in_flight(s: Schedule, group: int) -> int:
    """In-flight bound of ``group`` under ``s.name``'s semantics (independent of generators)."""
    P, S, M, N = s.num_groups, s.num_stages, s.microbatches_per_step, s.num_microbatches
    if s.replication and s.name != "gpipe":
        # round-robin: the schedule's own q_s (see round_robin_in_flight), if it is at least
        # the least count and whole groups (or every microbatch there is)
        units = [s.group_size(st) for st in range(P)]
        cap = N if s.name != "1f1b" else M
        e = s.extra_in_flight if s.name == "pipedream" else 0
        least = min(
            _unstuck(units, [_groups_in_flight(units, st, e) for st in range(P)])[group]
            * units[group],
            cap,
        )
        declared = s.in_flight_bound[group]
        if declared >= least and (declared % units[group] == 0 or declared == cap):
            return declared
        return least
    if s.name == "gpipe":
        return M
    if s.name == "1f1b":
        return min(P - group, M)
    if s.name == "zb-h1":
        return min(P, M)
    if s.name == "zb-h2":
        return min(2 * P - 1, M)
    if s.name == "zb-v":
        return min(2 * P, 2 * M)
    if s.name == "interleaved":
        v = S // P
        if v == 1:
            return min(P - group, M)
        return min(2 * (P - group - 1) + (v - 1) * P + 1, M * v)
    return min(P - group + _extra(s.extra_in_flight, group, P), N)


def _semantic_groups_in_flight(s: Schedule, units: Sequence[int], stage: int) -> int:
    """``q_s``, the groups in flight of a round-robin schedule's stage: its in-flight bound
    in groups (checked against the least count by the header checks)."""
    return -(-s.in_flight_bound[s.stage_device[stage]] // units[stage])


def _expected_versions(s: Schedule, stage: int) -> int:
    P, e = s.num_stages, s.extra_in_flight
    if s.name == "pipedream" and s.replication:
        units = [s.group_size(st) for st in range(P)]
        q = _semantic_groups_in_flight(s, units, stage)
        return min(q, s.num_microbatches // units[stage])
    if s.name == "pipedream":
        if s.vertical_sync:
            return P + e
        return P - stage + _extra(e, stage, P) if s.weight_stashing else 1
    return 2 if s.name == "2bw" else 1


def _required_version(s: Schedule, a: Action, updates: int) -> tuple[int, str]:
    """The version ``a`` must use, and why, given ``updates`` already run at its stage."""
    P, M, k = s.num_stages, s.microbatches_per_step, a.mb
    if a.kind == "U":
        return updates, f"it is update number {updates} of stage {a.stage}"
    step = k // M
    if s.name in _FLUSH:
        return step, f"{s.name} runs every microbatch of step {step} with version {step}"
    if s.name == "2bw":
        return max(0, step - 1), f"2bw runs step {step} with W(t-1), version max(0, t-1)"
    if a.kind != "F" and not s.weight_stashing:
        return updates, (
            f"pipedream without weight stashing runs the backward with the newest weights, "
            f"version {updates} after {updates} updates"
        )
    e = s.extra_in_flight
    if s.replication:
        units = [s.group_size(st) for st in range(P)]
        q = _semantic_groups_in_flight(s, units, a.stage)
        g = k // units[a.stage]
        return max(0, g - q + 1), (
            f"pipedream with round-robin stages runs group g={g} of stage {a.stage} at "
            f"version max(0, g - q_s + 1), q_s={q}"
        )
    if s.vertical_sync:
        return max(0, k - (P + e) + 1), "pipedream with vertical sync uses max(0, k-(P+e)+1)"
    lag = P - a.stage + _extra(e, a.stage, P)
    return max(0, k - lag + 1), "pipedream uses version max(0, k-(P-s+e)+1), e=0 at the last"


def _check_header(s: Schedule) -> None:
    if s.name not in SCHEDULES:
        raise ScheduleError(f"unknown schedule name {s.name!r}; accepted: {', '.join(SCHEDULES)}")
    for label, value in [
        ("num_stages", s.num_stages),
        ("num_microbatches", s.num_microbatches),
        ("microbatches_per_step", s.microbatches_per_step),
        ("number of device groups", s.num_groups),
    ]:
        _positive(label, value)
    if s.name == "pipedream" and s.microbatches_per_step != 1:
        raise ScheduleError("pipedream updates after every microbatch: microbatches_per_step=1")
    if s.num_microbatches % s.microbatches_per_step:
        raise ScheduleError(
            f"num_microbatches={s.num_microbatches} is not a multiple of "
            f"microbatches_per_step={s.microbatches_per_step}"
        )
    if (s.vertical_sync or not s.weight_stashing) and s.name != "pipedream":
        raise ScheduleError("vertical_sync and weight_stashing=False are pipedream options only")
    if s.extra_in_flight and s.name != "pipedream":
        raise ScheduleError("extra_in_flight is a pipedream option only")
    _positive("extra_in_flight", s.extra_in_flight, minimum=0)
    if s.num_stages % s.num_groups or (s.chunks > 1 and s.name not in _CHUNKED):
        raise ScheduleError(
            f"{s.name} with {s.num_stages} stages on {s.num_groups} device groups: only "
            f"interleaved and zb-v put several stages (a multiple of the groups) on one group"
        )
    if s.name == "zb-v" and s.chunks != 2:
        raise ScheduleError(
            f"zb-v puts two stages (a V) on each device group: 2P = {2 * s.num_groups} "
            f"stages on {s.num_groups} groups; got {s.num_stages} stages"
        )
    expected_map = stage_groups(s.name, s.num_groups, s.chunks)
    if tuple(s.stage_device) != expected_map:
        how = "the V: stage s on group min(s, 2P - 1 - s)" if s.name == "zb-v" else ""
        how = how or "stage s on group s % P"
        raise ScheduleError(
            f"stage_device must be {list(expected_map)} ({how}); got {list(s.stage_device)}"
        )
    for label, values, size in [
        ("replicas", s.replicas, s.num_groups),
        ("in_flight_bound", s.in_flight_bound, s.num_groups),
        ("version_bound", s.version_bound, s.num_stages),
    ]:
        if len(values) != size:
            raise ScheduleError(f"{label} has {len(values)} entries, expected {size}")
    for r in s.replicas:
        _positive("every replica count", r)
    if s.replication:
        if _replication(s.replication, tuple(s.replicas), s.name) != tuple(s.replication):
            raise ScheduleError(
                "replication lists 'round-robin' only for stages of one replica: give () "
                "(every group split)"
            )
        if s.chunks > 1:
            raise ScheduleError("round-robin replication puts one stage on each device group")
        if s.name == "pipedream" and (s.vertical_sync or not s.weight_stashing):
            raise ScheduleError(
                "pipedream with round-robin stages is defined with weight stashing and "
                "without vertical sync"
            )
        units = [s.group_size(st) for st in range(s.num_stages)]
        per = s.num_microbatches if s.name == "pipedream" else s.microbatches_per_step
        _check_multiple("microbatches per step (M; N for pipedream)", per, units)
    for d in range(s.num_groups):
        if s.in_flight_bound[d] != _expected_in_flight(s, d):
            raise ScheduleError(
                f"device group {d}: in_flight_bound={s.in_flight_bound[d]} but {s.name} "
                f"holds at most {_expected_in_flight(s, d)} microbatches there"
            )
    for st in range(s.num_stages):
        if s.version_bound[st] != _expected_versions(s, st):
            raise ScheduleError(
                f"stage {st}: version_bound={s.version_bound[st]} but {s.name} keeps "
                f"{_expected_versions(s, st)} weight versions there"
            )


def _where(s: Schedule, group: int, position: int) -> str:
    return f"device group {group}, position {position}: {s.actions[group][position].describe()}"


def _check_work(s: Schedule) -> None:
    """Every action in range and on its stage's group; all work present exactly once."""
    S, N = s.num_stages, s.num_microbatches
    seen: dict[tuple[str, int, int], tuple[int, int]] = {}
    for d, acts in enumerate(s.actions):
        for pos, a in enumerate(acts):
            if a.kind not in KINDS:
                raise ScheduleError(f"{_where(s, d, pos)}: unknown kind {a.kind!r}")
            if not 0 <= a.stage < S:
                raise ScheduleError(f"{_where(s, d, pos)}: stage out of range [0, {S})")
            if s.stage_device[a.stage] != d:
                raise ScheduleError(
                    f"{_where(s, d, pos)}: stage {a.stage} lives on device group "
                    f"{s.stage_device[a.stage]}, not {d}"
                )
            limit = s.updates_of(a.stage) if a.kind == "U" else N
            if not 0 <= a.mb < limit:
                index = "step" if a.kind == "U" else "microbatch"
                raise ScheduleError(f"{_where(s, d, pos)}: {index} out of range [0, {limit})")
            n = s.group_size(a.stage)
            if a.kind != "U" and a.mb % n:
                raise ScheduleError(
                    f"{_where(s, d, pos)}: stage {a.stage} is round-robin over {n} replicas; "
                    f"its actions cover groups of {n} microbatches, named by the first (a "
                    f"multiple of {n})"
                )
            key = (a.kind, a.stage, a.mb)
            if key in seen:
                first = seen[key]
                raise ScheduleError(
                    f"{_where(s, d, pos)} repeats work already done at device group "
                    f"{first[0]}, position {first[1]}"
                )
            seen[key] = (d, pos)
    for st in range(S):
        for k in range(0, N, s.group_size(st)):
            if ("F", st, k) not in seen:
                raise ScheduleError(f"drops work: F(stage={st}, mb={k}) is missing")
            full = ("B", st, k) in seen
            split = [kind for kind in "IW" if (kind, st, k) in seen]
            if full and split:
                raise ScheduleError(
                    f"repeats work: stage {st}, mb {k} has both B and {'/'.join(split)}; "
                    f"use either B or the pair I and W"
                )
            if not full and len(split) < 2:
                lack = "B (or I and W)" if not split else ("W" if split == ["I"] else "I")
                raise ScheduleError(f"drops work: stage {st}, mb {k} has no {lack}")
        for t in range(s.updates_of(st)):
            if ("U", st, t) not in seen:
                raise ScheduleError(f"drops work: U(stage={st}, step={t}) is missing")


def _check_order(s: Schedule) -> None:
    """Per device group: local order, versions, in-flight and version bounds."""
    for d, acts in enumerate(s.actions):
        forwarded: set[tuple[int, int]] = set()
        input_grads: set[tuple[int, int]] = set()
        finished: set[tuple[int, int]] = set()
        updates = dict.fromkeys(s.stages_of(d), 0)
        in_flight = 0
        for pos, a in enumerate(acts):
            key = (a.stage, a.mb)
            if a.kind == "F":
                forwarded.add(key)
                in_flight += len(s.covers(a))
                if in_flight > s.in_flight_bound[d]:
                    raise ScheduleError(
                        f"{_where(s, d, pos)} exceeds the in-flight bound: "
                        f"{in_flight} > {s.in_flight_bound[d]} microbatches on the group"
                    )
            elif a.kind in "BI":
                if key not in forwarded:
                    raise ScheduleError(
                        f"{_where(s, d, pos)} runs before its forward F(stage={a.stage}, mb={a.mb})"
                    )
                input_grads.add(key)
            elif a.kind == "W" and key not in input_grads:
                raise ScheduleError(
                    f"{_where(s, d, pos)} runs before its input gradient I(stage={a.stage}, "
                    f"mb={a.mb})"
                )
            if a.kind in "BW":
                finished.update((a.stage, k) for k in s.covers(a))
                in_flight -= len(s.covers(a))
            if a.kind == "U":
                M = s.per_update(a.stage)
                for k in range(a.mb * M, (a.mb + 1) * M):
                    if (a.stage, k) not in finished:
                        raise ScheduleError(
                            f"{_where(s, d, pos)} runs before the backward of microbatch {k}, "
                            f"whose gradient it applies"
                        )
            done = updates[a.stage]
            required, why = _required_version(s, a, done)
            if a.version != required:
                raise ScheduleError(
                    f"{_where(s, d, pos)} uses weight version {a.version}, but {s.name} "
                    f"requires version {required}: {why}"
                )
            if required > done:
                raise ScheduleError(
                    f"{_where(s, d, pos)} needs weight version {required}, which does not "
                    f"exist yet: only {done} updates of stage {a.stage} have run before it"
                )
            if a.kind == "U":
                updates[a.stage] += 1
        for stage in s.stages_of(d):
            live = _live_versions(acts, stage)
            peak = max(live, default=0)
            if peak > s.version_bound[stage]:
                pos = live.index(peak)
                raise ScheduleError(
                    f"{_where(s, d, pos)}: stage {stage} keeps {peak} weight versions here, "
                    f"more than {s.name}'s bound of {s.version_bound[stage]}"
                )


def _live_versions(acts: Sequence[Action], stage: int) -> list[int]:
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


def _play(
    s: Schedule,
    duration: Callable[[Action], float],
    transfer: Callable[[int, int, int], float] | None,
    posted: bool = False,
) -> tuple[list[list[float]], list[list[float]], list[tuple[int, int, float, float, Action]]]:
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
    S, G = s.num_stages, s.num_groups
    where = s.stage_device
    starts: list[list[float]] = [[] for _ in range(G)]
    ends: list[list[float]] = [[] for _ in range(G)]
    transfers: list[tuple[int, int, float, float, Action]] = []
    ready: dict[tuple[str, int, int], float] = {}
    link_free: dict[tuple[int, int], float] = {}
    free = [0.0] * G
    nxt = [0] * G

    def needs(a: Action) -> tuple[tuple[str, int, int], ...]:
        ks = s.covers(a)
        if a.kind == "F":
            return tuple(("x", a.stage, k) for k in ks) if a.stage > 0 else ()
        if a.kind in "BI":
            own = ("f", a.stage, a.mb)
            if a.stage == S - 1:
                return (own,)
            return (own, *(("g", a.stage, k) for k in ks))
        if a.kind == "W":
            return (("i", a.stage, a.mb),)
        return ()

    pending: dict[tuple[str, int, int], tuple[float, float, int, int, Action]] = {}

    def send(key: tuple[str, int, int], cut: int, src: int, dst: int, at: float, a: Action) -> None:
        seconds = 0.0 if src == dst or transfer is None else transfer(cut, src, dst)
        if seconds <= 0:
            ready[key] = at
        elif posted:
            pending[key] = (at, seconds, src, dst, a)
        else:
            move(key, at, seconds, src, dst, a)

    def move(key: tuple[str, int, int], at: float, seconds: float, src: int, dst: int,
             a: Action) -> None:  # fmt: skip
        start = max(at, link_free.get((src, dst), 0.0))
        end = start + seconds
        link_free[src, dst] = end
        transfers.append((src, dst, start, end, a))
        ready[key] = end

    progress = True
    while progress:
        progress = False
        for d in range(G):
            acts = s.actions[d]
            while nxt[d] < len(acts):
                a = acts[nxt[d]]
                start = free[d]
                blocked = False
                for key in needs(a):
                    at = ready.get(key)
                    if at is None and key in pending:  # posted now that d has reached a
                        sent, seconds, src, dst, by = pending.pop(key)
                        move(key, max(sent, free[d]), seconds, src, dst, by)
                        at = ready[key]
                    if at is None:
                        blocked = True
                        break
                    start = max(start, at)
                if blocked:
                    break
                end = start + duration(a)
                starts[d].append(start)
                ends[d].append(end)
                free[d] = end
                nxt[d] += 1
                progress = True
                if a.kind == "F":
                    ready["f", a.stage, a.mb] = end
                    if a.stage + 1 < S:
                        for k in s.covers(a):
                            send(("x", a.stage + 1, k), a.stage, d, where[a.stage + 1], end, a)
                elif a.kind in "BI":
                    ready["i", a.stage, a.mb] = end
                    if a.stage > 0:
                        for k in s.covers(a):
                            send(("g", a.stage - 1, k), a.stage - 1, d, where[a.stage - 1], end, a)
    if any(nxt[d] < len(s.actions[d]) for d in range(G)):
        raise ScheduleError(_deadlock_message(s, nxt, ready, needs))
    return starts, ends, transfers


def _deadlock_message(
    s: Schedule,
    nxt: list[int],
    ready: dict[tuple[str, int, int], float],
    needs: Callable[[Action], tuple[tuple[str, int, int], ...]],
) -> str:
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
            missing = [key for key in needs(a) if key not in ready]
            waits = " and ".join(what[kind](st, k) for kind, st, k in missing)
            lines.append(f"{_where(s, d, pos)} waits for {waits}")
    return "cross-stage dependency cannot be met (the schedule deadlocks): " + "; ".join(lines)


def validate(schedule: Schedule) -> None:
    """Checks that ``schedule`` is runnable and computes what its name promises.

    Checks, each independently of the generators: the header (name, sizes, stage
    placement, and bounds equal to the semantics' own), that every action is in range and
    on its stage's device group, that every ``F``, ``B`` (or ``I`` and ``W``) and ``U`` runs
    exactly once, that every ``B``/``I`` follows its ``F`` and every ``W`` its ``I``, that every
    ``U`` follows the backwards it applies, that every action uses the weight version the
    schedule's semantics require (recomputed here from the table in DESIGN.md) and that it
    exists by then, the in-flight and versions-kept bounds, and that the cross-stage
    dependencies can be met (no deadlock).

    Args:
        schedule: the schedule.

    Raises:
        ScheduleError: naming the first offending action.
    """
    _check_header(schedule)
    _check_work(schedule)
    _check_order(schedule)
    _play(schedule, lambda a: 1, None)
