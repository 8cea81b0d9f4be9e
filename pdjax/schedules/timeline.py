"""Timelines: when each action ran on each device group, simulated or measured.

The simulator (:func:`pdjax.simulator.simulate`) returns one; the runtime records one from
measured times. :mod:`pdjax.simulator.trace` turns either into a Chrome trace or a Gantt chart.
"""

from __future__ import annotations

import dataclasses
import json
from typing import NamedTuple

from pdjax.errors import ScheduleError
from pdjax.schedules.actions import Action

__all__ = ["Span", "Timeline", "Transfer"]

_JSON_FORMAT = "pdjax.timeline/1"


class Span(NamedTuple):
    """One action on one device group.

    Attributes:
        group: the device group.
        start: seconds from the timeline's origin.
        end: seconds from the timeline's origin.
        action: what ran.
    """

    group: int
    start: float
    end: float
    action: Action


class Transfer(NamedTuple):
    """One tensor crossing a cut between device groups.

    Attributes:
        src: sending device group.
        dst: receiving device group.
        start: seconds from the timeline's origin.
        end: seconds from the timeline's origin.
        action: the action that produced the tensor (``F``: an activation going forward;
            ``B`` or ``I``: a gradient going backward).
    """

    src: int
    dst: int
    start: float
    end: float
    action: Action


@dataclasses.dataclass(frozen=True)
class Timeline:
    """Per-device-group spans of one run of a schedule.

    Attributes:
        name: a label (the schedule's name for a simulation).
        num_groups: device groups, one row each.
        spans: the actions, in any order.
        transfers: the transfers between groups, in any order.
    """

    name: str
    num_groups: int
    spans: tuple[Span, ...]
    transfers: tuple[Transfer, ...] = ()

    @property
    def makespan(self) -> float:
        """Seconds from the origin to the end of the last span or transfer."""
        ends = [s.end for s in self.spans] + [t.end for t in self.transfers]
        return max(ends, default=0.0)

    def busy(self, group: int, start: float = 0.0, end: float | None = None) -> float:
        """Seconds ``group`` computes within ``[start, end]`` (default: the whole run)."""
        end = self.makespan if end is None else end
        return sum(
            max(0.0, min(s.end, end) - max(s.start, start)) for s in self.spans if s.group == group
        )

    def total_busy(self, start: float = 0.0, end: float | None = None) -> float:
        """:meth:`busy` of every group, summed (group by group), in one pass over the
        spans rather than one per group."""
        end = self.makespan if end is None else end
        per_group = [0.0] * self.num_groups
        for s in self.spans:
            per_group[s.group] += max(0.0, min(s.end, end) - max(s.start, start))
        return sum(per_group)

    def to_json(self) -> str:
        """JSON text; :meth:`from_json` returns an equal timeline."""
        return json.dumps(
            {
                "format": _JSON_FORMAT,
                "name": self.name,
                "num_groups": self.num_groups,
                "spans": [[s.group, s.start, s.end, str(s.action)] for s in self.spans],
                "transfers": [
                    [t.src, t.dst, t.start, t.end, str(t.action)] for t in self.transfers
                ],
            }
        )

    @classmethod
    def from_json(cls, text: str) -> Timeline:
        """Reads :meth:`to_json` output.

        Raises:
            ScheduleError: if the text is not a pdjax timeline.
        """
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ScheduleError(f"timeline JSON does not parse: {e}") from e
        if not isinstance(data, dict) or data.get("format") != _JSON_FORMAT:
            raise ScheduleError(f"not a pdjax timeline: expected 'format': {_JSON_FORMAT!r}")
        try:
            return cls(
                name=data["name"],
                num_groups=data["num_groups"],
                spans=tuple(Span(g, a, b, Action.parse(x)) for g, a, b, x in data["spans"]),
                transfers=tuple(
                    Transfer(s, d, a, b, Action.parse(x)) for s, d, a, b, x in data["transfers"]
                ),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ScheduleError(f"timeline JSON is malformed: {e!r}") from e
