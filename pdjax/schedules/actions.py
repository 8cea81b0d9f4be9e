"""Schedules as data: :class:`Action`, :class:`Schedule`, and their text and JSON forms.

Compact strings name one action as ``<stage><kind><mb>[v<version>]``, the version shown only
when it is not 0: ``"2F0"`` is the forward of microbatch 0 at stage 2 with version 0,
``"1B7v3"`` the backward of microbatch 7 at stage 1 with version 3, ``"0U2v2"`` the third
update of stage 0. :meth:`Schedule.grid` prints the unit-time clock (every action one tick,
each as early as its dependencies allow) with one column per device group; :func:`parse_grid`
reads it back.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from pdjax.errors import ScheduleError
from pdjax.schedules.play import play

if TYPE_CHECKING:
    from pdjax.schedules.spec import ScheduleSpec

__all__ = ["KINDS", "Action", "Schedule", "format_actions", "parse_actions", "parse_grid"]

KINDS = ("F", "B", "I", "W", "U")
"""Action kinds: forward, backward, input-gradient, weight-gradient, update."""

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
        cached = cls is Action and type(text) is str
        if cached and text in _PARSED:
            return _PARSED[text]
        match = _ACTION_RE.fullmatch(text.strip())
        if match is None:
            raise ScheduleError(
                f"cannot read action {text!r}: expected <stage><kind><mb>[v<version>] with kind "
                f"one of {'/'.join(KINDS)}, e.g. '2F0' or '1B7v3'"
            )
        stage, kind, mb, version = match.groups()
        action = cls(kind, int(stage), int(mb), int(version or 0))
        if cached:
            if len(_PARSED) >= _PARSED_MOST:
                _PARSED.clear()
            _PARSED[text] = action
        return action


_PARSED: dict[str, Action] = {}
"""Actions :meth:`Action.parse` has read, by their text: a schedule's JSON names the same
few thousand actions over and over (an action is immutable, so one object serves)."""
_PARSED_MOST = 1 << 15
"""Texts :data:`_PARSED` keeps at most (it starts over when full)."""
_WRITTEN_IF_SET = ("in_flight",)
"""Fields :meth:`Schedule.to_json` leaves out at their default: added after the format's
first version, so that every schedule written before keeps its text (and reads back the
same, the default filling in)."""


def format_actions(actions: Sequence[Sequence[Action]]) -> str:
    """One line per device group: ``g<d>: <action> <action> ...``.

    >>> from pdjax.schedules import gpipe
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
        name: one of :data:`~pdjax.schedules.registry.SCHEDULES`; fixes the
            semantics the validator checks.
        num_stages: ``S``, the number of (virtual) stages. For ``interleaved`` with ``v``
            chunks over ``P`` device groups, ``S = P * v``; for ``zb-v``, ``S = 2 P``;
            otherwise ``S = P``.
        num_microbatches: ``N``, all microbatches the schedule runs (``steps * M`` for the
            flush schedules, the stream length for ``pipedream`` and ``2bw``).
        microbatches_per_step: ``M``, the microbatches whose gradients one update applies
            (1 for ``pipedream``, which updates after every microbatch).
        actions: per device group, its actions in execution order.
        stage_device: the device group of each stage
            (:func:`~pdjax.schedules.registry.stage_groups`):
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
            updates once per such group of ``r``; see
            :func:`~pdjax.schedules.streaming.pipedream`).
        in_flight_bound: per device group, the most microbatches whose forward has run
            there and whose backward (``B``, or ``I`` and ``W``) has not, summed over the
            group's stages.
        version_bound: per stage, the most weight versions it ever keeps.
        vertical_sync: ``pipedream`` only: every stage uses the version stage 0 used.
        weight_stashing: ``pipedream`` only: the backward reuses the forward's version
            (``False``: it uses the newest weights, the paper's inconsistent baseline).
        extra_in_flight: ``pipedream`` only: microbatches in flight per stage beyond
            ``P - s`` (latency hiding; see :func:`~pdjax.schedules.streaming.pipedream`).
        in_flight: ``pipedream`` only: the groups in flight at round-robin stages,
            ``"full-rate"`` (the default) or ``"paper"`` (PipeDream's NOAM at the input
            stage; see :func:`~pdjax.schedules.inflight.paper_in_flight`).
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
    in_flight: str = "full-rate"

    @functools.cached_property
    def _derived(self) -> dict[str, Any]:
        """Indexes of the actions that the player, the validator and the simulator derive
        from the fields, kept here so that each is built once per schedule, not once per
        call (``play`` runs a schedule several times: to validate it, for its clock, under
        each set of costs). Valid for the schedule's life: the dataclass is frozen and its
        fields are tuples. Not a field: no part of equality, hashing, ``repr`` or JSON."""
        return {}

    @property
    def spec(self) -> ScheduleSpec:
        """The :class:`~pdjax.schedules.ScheduleSpec` this schedule runs: its kind, ``M``
        per step, chunks, its kind's options and its replication modes (None where every
        group splits)."""
        from pdjax.schedules.spec import ScheduleSpec

        return ScheduleSpec(
            self.name,
            microbatches=self.microbatches_per_step,
            chunks=self.chunks,
            weight_stashing=self.weight_stashing,
            vertical_sync=self.vertical_sync,
            extra_in_flight=self.extra_in_flight,
            in_flight=self.in_flight,
            replication=self.replication or None,
        )

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
        # imported here: the registry imports the generators, which import this module
        from pdjax.schedules.registry import SEMANTICS

        row = SEMANTICS.get(self.name)
        if row is not None and row.updates_per_microbatch:
            return self.group_size(stage)
        return self.microbatches_per_step

    def updates_of(self, stage: int) -> int:
        """Optimizer updates of ``stage`` over the whole schedule."""
        return self.num_microbatches // self.per_update(stage)

    def stages_of(self, group: int) -> tuple[int, ...]:
        """The stages device group ``group`` holds, in increasing order."""
        # Every group's, listed in one pass over stage_device and kept: callers ask for
        # each group in turn, and one pass each would take groups x stages. (For int
        # groups only, where equality is the dict's; anything else: the pass.)
        by_group: dict[int, tuple[int, ...]] | None = self._derived.get("stages_of")
        if by_group is None and all(type(d) is int for d in self.stage_device):
            lists: dict[int, list[int]] = {}
            for s, d in enumerate(self.stage_device):
                lists.setdefault(d, []).append(s)
            by_group = self._derived["stages_of"] = {d: tuple(v) for d, v in lists.items()}
        if by_group is not None and type(group) is int:
            return by_group.get(group, ())
        return tuple(s for s, d in enumerate(self.stage_device) if d == group)

    def clock(self) -> tuple[tuple[int, ...], ...]:
        """Unit-time start tick of every action (each takes one tick, starts when ready).

        Raises:
            ScheduleError: if the schedule deadlocks (a cross-stage dependency cannot be met).
        """
        starts, _, _ = play(self, lambda a: 1, None)
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
            if field.name in _WRITTEN_IF_SET and value == field.default:
                continue
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
