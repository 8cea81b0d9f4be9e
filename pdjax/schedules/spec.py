"""What a pipeline runs, as one typed value: :class:`ScheduleSpec`.

A spec names a schedule kind and every setting of it: ``M``, the chunks per device group,
and the kind's own options (weight stashing, vertical sync, the in-flight mode and extra
depth, replication per device group, the memory policy per stage). It is validated once,
when it is made, against what the kind declares (its row of the semantics table), and has
an exact JSON round trip. The generators, the lowering, the runtime, the planner, the
simulator, the command line and the training configuration all read this one definition:
:class:`~pdjax.partition.Plan` holds one, :func:`~pdjax.partition.plan_auto` writes its
choice into it, and :class:`~pdjax.pipeline.Pipeline` runs it.

>>> spec = ScheduleSpec("pipedream", vertical_sync=True)
>>> spec.label
'pipedream (vsync)'
>>> ScheduleSpec.from_dict(spec.to_dict()) == spec
True
>>> ScheduleSpec("gpipe", vertical_sync=True)
Traceback (most recent call last):
...
pdjax.errors.ScheduleSpecError: vertical_sync is an option of pipedream, not of gpipe
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

from pdjax._memory_policy import memory_policies
from pdjax.errors import ScheduleSpecError
from pdjax.schedules.arguments import REPLICATION
from pdjax.schedules.inflight import IN_FLIGHT

__all__ = ["MAX_MICROBATCHES", "OPTIONS", "VARIANTS", "Option", "ScheduleSpec", "option_owners"]

MAX_MICROBATCHES = 2**16
"""The most microbatches per step (and chunks, and microbatches in flight beyond the
schedule's): a step's program holds an action per microbatch and stage."""

_WHY = (
    ": a step's program holds an action per microbatch and stage (for more samples per "
    "step use larger microbatches; every microbatch needs at least one sample)"
)

_COUNTS = {2: "two"}


@dataclasses.dataclass(frozen=True)
class Option:
    """One of a kind's own options: its default, what it does, and its range.

    Attributes:
        default: the value of a spec that does not set it (and of every kind without it).
        help: what it does, in a few words (the command line's help).
        choices: the values a text option takes (None: a bool or an integer).
        most: the largest value of an integer option the command line takes, and ``why``.
        label: how a table of runs names it when set (``{}``: its value).
        off: for an option on by default, what turning it off does.
    """

    default: Any
    help: str
    label: str = ""
    choices: tuple[str, ...] | None = None
    most: int | None = None
    why: str = ""
    off: str = ""


OPTIONS: dict[str, Option] = {
    "vertical_sync": Option(False, "every stage uses the version stage 0 used", "vertical sync"),
    "weight_stashing": Option(
        True,
        "the backward reuses its forward's weight version (off: the newest weights)",
        "no stashing",
        off="the backward uses the newest weights, not its forward's (no weight stashing)",
    ),
    "extra_in_flight": Option(
        0,
        "N more microbatches in flight per stage (hides transfer latency; one more stashed "
        "version and activation each)",
        "+{} in flight",
        most=1024,
        why="each is one more stashed version and activation per stage",
    ),
    "in_flight": Option(
        "full-rate",
        "with round-robin stages: full-rate (enough groups in flight to keep a balanced "
        "pipeline busy) or paper (PipeDream's NOAM at the input stage: less stale, slower "
        "where the counts differ)",
        "{} in flight",
        choices=IN_FLIGHT,
    ),
}
"""The options a schedule kind may declare (its row's ``options``), with their defaults:
a spec holds the default of every option its kind does not declare."""


def _integer(name: str, value: Any, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
        raise ScheduleSpecError(
            f"{name} must be an integer >= {least}, got {value!r} ({type(value).__name__}); "
            f"pass a whole number such as {max(least, 1)}"
        )
    number = int(value)
    if number > MAX_MICROBATCHES:
        digits = len(str(number))
        shown = f"an integer of {digits} digits" if digits > 20 else str(number)
        raise ScheduleSpecError(f"{name} must be at most {MAX_MICROBATCHES}, got {shown}{_WHY}")
    return number


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ScheduleSpecError(f"{name} must be True or False, got {value!r}")
    return value


def _modes(value: Any) -> str | tuple[str, ...] | None:
    """``replication`` as None (the stages' own), one mode, or one mode per device group."""
    if value is None:
        return None
    modes = (value,) if isinstance(value, str) else value
    if not isinstance(modes, Sequence) or not modes:
        raise ScheduleSpecError(
            f"replication must be 'split', 'round-robin' or one of them per device group, "
            f"got {value!r}"
        )
    for mode in modes:
        if mode not in REPLICATION:
            raise ScheduleSpecError(
                f"replication must be 'split' or 'round-robin' (one for every device group, or "
                f"one per group), got {mode!r}"
            )
    return value if isinstance(value, str) else tuple(value)


def _remat(value: Any) -> bool | str | tuple[bool | str, ...]:
    """``remat`` as given (a bool, a policy name, or one per stage), checked."""
    if isinstance(value, bool | str):
        memory_policies(value, 1, ScheduleSpecError)
        return value
    if not isinstance(value, Sequence) or not value:
        raise ScheduleSpecError(
            f"remat must be a bool, a memory policy name, or one per stage, got {value!r}"
        )
    memory_policies(tuple(value), len(value), ScheduleSpecError)
    return tuple(value)


@dataclasses.dataclass(frozen=True)
class ScheduleSpec:
    """A schedule kind and its settings: what a pipeline runs (see the module).

    Attributes:
        kind: the schedule (one of :data:`~pdjax.schedules.SCHEDULES`).
        microbatches: ``M``, microbatches per step (``pipedream``: those of one call's
            batch; it updates after every microbatch).
        chunks: stages per device group: ``v`` for ``interleaved``, 2 for ``zb-v``, else
            1; None means the kind's default (1 for ``interleaved``, as the runtime has
            always taken it; :func:`~pdjax.schedules.generate` by name takes 2).
        weight_stashing: ``pipedream``: the backward reuses the forward's weight version
            (``False``: the newest weights, the paper's inconsistent baseline).
        vertical_sync: ``pipedream``: every stage uses the version stage 0 used.
        extra_in_flight: ``pipedream``: microbatches in flight per stage beyond ``P - s``.
        in_flight: ``pipedream``: the groups in flight at round-robin stages,
            ``"full-rate"`` or ``"paper"`` (:data:`~pdjax.schedules.IN_FLIGHT`).
        replication: how a replicated device group shares its work: ``"split"`` (each
            microbatch split across its devices) or ``"round-robin"`` (whole microbatches
            per device, PipeDream's), one for every group or one per group; None: each
            plan stage's own (:attr:`~pdjax.partition.StagePlan.replication`).
        grad_allreduce: where a replicated (split) group's gradients are all-reduced:
            ``"update"`` (once per update, of each device's summed part, for stages whose
            layers compute row by row; the others fall back to ``"backward"``) or
            ``"backward"`` (every backward; XLA's data parallelism).
        remat: each stage's memory policy, what its forward keeps for its backward:
            ``False`` or ``"none"`` (every residual), ``True`` or ``"full"`` (nothing: the
            backward recomputes the forward), ``"dots"`` / ``"dots-no-batch"`` (only
            matrix-product outputs, by ``jax.checkpoint``'s policies) or ``"offload"``
            (those products in the host's pinned memory); one for every stage, or one per
            stage (as :func:`~pdjax.partition.plan_auto` chooses them). Every policy
            computes the same values.

    A setting the kind does not have is refused (``vertical_sync=True`` for ``gpipe``), so
    that no spec means more than its schedule does.
    """

    kind: str = "1f1b"
    microbatches: int = 1
    chunks: int | None = None
    weight_stashing: bool = True
    vertical_sync: bool = False
    extra_in_flight: int = 0
    in_flight: str = "full-rate"
    replication: str | tuple[str, ...] | None = None
    grad_allreduce: str = "update"
    remat: bool | str | tuple[bool | str, ...] = False

    def __post_init__(self) -> None:
        # imported here: the registry imports the generators, which read specs
        from pdjax.schedules.registry import SCHEDULE_KINDS, unknown_schedule

        kind = SCHEDULE_KINDS.get(self.kind) if isinstance(self.kind, str) else None
        if kind is None:
            raise unknown_schedule(self.kind)
        row = kind.semantics
        put = object.__setattr__
        put(self, "microbatches", _integer("microbatches", self.microbatches, 1))
        chunks = kind.default_chunks if self.chunks is None else self.chunks
        put(self, "chunks", _integer("chunks", chunks, 1))
        put(self, "weight_stashing", _flag("weight_stashing", self.weight_stashing))
        put(self, "vertical_sync", _flag("vertical_sync", self.vertical_sync))
        put(self, "extra_in_flight", _integer("extra_in_flight", self.extra_in_flight, 0))
        if self.in_flight not in IN_FLIGHT:
            raise ScheduleSpecError(f"in_flight must be one of {IN_FLIGHT}, got {self.in_flight!r}")
        for name, option in OPTIONS.items():
            value = getattr(self, name)
            if value != option.default and name not in row.options:
                shown = "=False" if value is False else (f"={value!r}" if value else "")
                raise ScheduleSpecError(
                    f"{name}{'' if value is True else shown} is an option of "
                    f"{option_owners(name)}, not of {self.kind}"
                )
        if self.in_flight == "paper" and self.extra_in_flight:
            raise ScheduleSpecError(
                f"in_flight='paper' keeps PipeDream's own count (NOAM at the input stage); "
                f"extra_in_flight={self.extra_in_flight} would add to it: pass one of them"
            )
        fixed = kind.chunks
        if fixed is not None and fixed > 1 and self.chunks != fixed:
            shape = " (a V over 2P stages)" if row.v_shaped else ""
            raise ScheduleSpecError(
                f"{self.kind} runs {_COUNTS.get(fixed, fixed)} chunks per device group{shape}: "
                f"chunks must be {fixed}, got {self.chunks}"
            )
        if not row.chunked and self.chunks != 1:
            raise ScheduleSpecError(
                f"chunks={self.chunks} is an option of interleaved, not of {self.kind}"
            )
        put(self, "replication", _modes(self.replication))
        if self.grad_allreduce not in ("update", "backward"):
            raise ScheduleSpecError(
                f"grad_allreduce must be 'update' or 'backward', got {self.grad_allreduce!r}"
            )
        put(self, "remat", _remat(self.remat))

    # -- reading ---------------------------------------------------------------------------

    @property
    def changed(self) -> dict[str, Any]:
        """The kind's options set away from their defaults, in declaration order."""
        return {
            name: getattr(self, name)
            for name, option in OPTIONS.items()
            if getattr(self, name) != option.default
        }

    @property
    def label(self) -> str:
        """A short name for tables: the kind, ``v`` where the kind takes chunks, the options
        that are on (but the extra depth, which tables show apart)."""
        from pdjax.schedules.registry import schedule_kind

        if schedule_kind(self.kind).chunks is None:
            return f"{self.kind} (v={self.chunks})"
        words = {
            "vertical_sync": "vsync",
            "weight_stashing": "no stash",
            "in_flight": "paper in flight",
        }
        extras = [words[name] for name in self.changed if name in words]
        return self.kind + (f" ({', '.join(extras)})" if extras else "")

    def replace(self, **changes: Any) -> ScheduleSpec:
        """This spec with ``changes`` (validated again)."""
        return dataclasses.replace(self, **changes)

    # -- JSON ------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Every field, as JSON types (tuples as lists): :meth:`from_dict` inverts it."""
        out = dataclasses.asdict(self)
        for name in ("replication", "remat"):
            if isinstance(out[name], tuple):
                out[name] = list(out[name])
        return out

    @classmethod
    def from_dict(cls, data: Any, what: str = "schedule") -> ScheduleSpec:
        """The spec :meth:`to_dict` wrote; a name alone (``"1f1b"``) is that kind with its
        defaults. Refuses fields it does not know, naming them."""
        if isinstance(data, str):
            return cls(data)
        if not isinstance(data, Mapping):
            raise ScheduleSpecError(f"{what} must be a schedule name or an object, got {data!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ScheduleSpecError(f"{what} has fields pdjax does not know: {unknown}")
        if "kind" not in data:
            raise ScheduleSpecError(f'{what} names no kind (e.g. "kind": "1f1b")')
        fields = dict(data)
        for name in ("replication", "remat"):
            if isinstance(fields.get(name), list):
                fields[name] = tuple(fields[name])
        return cls(**fields)


def option_owners(option: str) -> str:
    """The schedules that declare ``option``, as a phrase (``"pipedream"``)."""
    from pdjax.schedules.registry import SEMANTICS

    names = [n for n, row in SEMANTICS.items() if option in row.options]
    return " and ".join(names) if names else "no schedule"


VARIANTS: dict[str, dict[str, Any]] = {
    "pipedream-nostash": {"kind": "pipedream", "weight_stashing": False},
    "pipedream-vsync": {"kind": "pipedream", "vertical_sync": True},
}
"""Named variants of a kind, as the command line's ``--schedule`` and ``--compare`` take
them beside the kinds' own names: the kind and the options it sets."""
