"""The data of a lowered program: where stages live (:class:`StagePlace`,
:class:`Placement`), one operation (:class:`Op`, of a kind :class:`OpKind` with flags
:class:`OpFlag`), the values it reads and writes (:class:`Slot`, of a kind
:class:`SlotKind`) and what every process runs for one call (:class:`Program`). The slots
and operation kinds are tabled in :mod:`pdjax.pipeline.lowering.program`, which makes them
(:func:`~pdjax.pipeline.lowering.lower`).

This is the whole contract between the lowering and the interpreter: the interpreter
dispatches on an operation's :class:`OpKind` and a slot's :class:`SlotKind`, never on the
text they print as.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from typing import Any

from pdjax.schedules import Action

__all__ = ["Op", "OpFlag", "OpKind", "Placement", "Program", "Slot", "SlotKind", "StagePlace"]


class OpKind(enum.StrEnum):
    """What an operation does (the table of :mod:`pdjax.pipeline.lowering.program`); it
    prints as its name."""

    KEYS = "KEYS"
    F = "F"
    B = "B"
    I = "I"  # noqa: E741 (zero bubble's input-gradient backward)
    W = "W"
    U = "U"
    BU = "BU"
    FB = "FB"
    FBU = "FBU"
    SQ = "SQ"
    TG = "TG"
    MOVE = "MOVE"
    SEND = "SEND"
    RECV = "RECV"
    SENDRECV = "SENDRECV"
    LOSS = "LOSS"
    WAIT = "WAIT"
    SYNC = "SYNC"
    GATHER = "GATHER"
    PART = "PART"


#: The kinds a stage program computes (:meth:`pdjax.pipeline.stage.Stage.program`).
COMPUTE = frozenset(
    {
        OpKind.F,
        OpKind.B,
        OpKind.I,
        OpKind.W,
        OpKind.U,
        OpKind.BU,
        OpKind.FB,
        OpKind.FBU,
        OpKind.SQ,
        OpKind.TG,
        OpKind.KEYS,
    }
)
#: The kinds that move a value between stages.
TRANSFERS = frozenset({OpKind.MOVE, OpKind.SEND, OpKind.RECV, OpKind.SENDRECV})


class OpFlag(enum.StrEnum):
    """A program variant of an operation (see :mod:`pdjax.pipeline.lowering.program`)."""

    ACC = "acc"
    RECOMPUTE = "recompute"
    NEWEST = "newest"
    DONATE_W = "donate_w"


class SlotKind(enum.StrEnum):
    """What a slot holds; its value is the prefix the slot prints with."""

    OFFSET = "offset"
    WEIGHTS = "w"
    OPT = "o"
    STATE = "st"
    RNG = "rng"
    KEY = "key"
    X = "x"
    TARGET = "t"
    Y = "y"
    RESIDUALS = "r"
    COTANGENTS = "c"
    E = "e"
    D = "d"
    GRADS = "g"
    LOSS = "loss"
    SQUARES = "q"
    TIED_GRADS = "pg"
    TIED_VALUES = "nw"


_VERSIONED = (SlotKind.WEIGHTS, SlotKind.OPT)


class Slot(str):
    """A named value of a program: a typed key that *is* its text (``w0v1``,
    ``mx0.2``, ``pg2.0@0``), so it hashes and compares as fast as a string, equals the
    text it prints as, and tells its kind and indices without being parsed.

    Attributes:
      kind: what it holds.
      stage: the stage it belongs to (``t{k}`` and ``loss{k}``: the last stage; -1 for
        ``offset``).
      number: the weight version (``w``, ``o``), the microbatch (or its group's first),
        or the update (``q``, ``pg``, ``nw``); -1 where none (``st{s}``, ``rng{s}``).
      group: a round-robin stage's group value (printed with an ``m``).
      to: tied values: the stage they are for (``:{to}``); -1 where none.
      at: the stage whose devices it arrived on (``@{at}``); -1 where none.
    """

    kind: SlotKind
    stage: int
    number: int
    group: bool
    to: int
    at: int

    def __new__(
        cls,
        kind: SlotKind,
        stage: int = -1,
        number: int = -1,
        *,
        group: bool = False,
        to: int = -1,
        at: int = -1,
    ) -> Slot:
        self = super().__new__(cls, _text(kind, stage, number, group, to, at))
        for name, value in (
            ("kind", kind),
            ("stage", stage),
            ("number", number),
            ("group", group),
            ("to", to),
            ("at", at),
        ):
            object.__setattr__(self, name, value)
        return self

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"slot {self} is immutable")

    def __reduce__(self) -> Any:
        return (_slot, (self.kind, self.stage, self.number, self.group, self.to, self.at))

    @property
    def home(self) -> int:
        """The stage whose devices hold it (-1: every process's host, ``offset``)."""
        return self.at if self.at >= 0 else self.stage

    def evolve(
        self, *, number: int | None = None, to: int | None = None, at: int | None = None
    ) -> Slot:
        """This slot with another number, destination or arrival stage."""
        return Slot(
            self.kind,
            self.stage,
            self.number if number is None else number,
            group=self.group,
            to=self.to if to is None else to,
            at=self.at if at is None else at,
        )


def _slot(kind: SlotKind, stage: int, number: int, group: bool, to: int, at: int) -> Slot:
    return Slot(kind, stage, number, group=group, to=to, at=at)


def _text(kind: SlotKind, stage: int, number: int, group: bool, to: int, at: int) -> str:
    """The slot's name (the table of :mod:`pdjax.pipeline.lowering.program`)."""
    if kind is SlotKind.OFFSET:
        return "offset"
    if kind in _VERSIONED:
        return f"{kind.value}{stage}v{number}"
    if kind is SlotKind.RNG or (kind is SlotKind.STATE and number < 0):
        return f"{kind.value}{stage}"
    if kind in (SlotKind.LOSS, SlotKind.TARGET) and not group:
        return f"{kind.value}{number}"
    text = f"{'m' if group else ''}{kind.value}{stage}.{number}"
    if to >= 0:
        text += f":{to}"
    if at >= 0:
        text += f"@{at}"
    return text


OFFSET = Slot(SlotKind.OFFSET)
"""The caller's count of microbatches before the call (seeds the keys)."""


@dataclasses.dataclass(frozen=True)
class StagePlace:
    """Where one stage lives: global device ids and the processes that hold them."""

    devices: tuple[int, ...]
    processes: tuple[int, ...] = (0,)


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where every stage lives and how values cross processes.

    Attributes:
      stages: per stage, its devices and processes.
      platform: the devices' platform (``cpu``, ``gpu``, ``tpu``).
      transport: how values cross processes: ``device_put`` (JAX's cross-host
        transfers) or ``collective`` (an XLA collective over the two devices).
      num_processes: processes in the run.
    """

    stages: tuple[StagePlace, ...]
    platform: str = "cpu"
    transport: str = "device_put"
    num_processes: int = 1

    @classmethod
    def local(cls, devices: Sequence[Sequence[int]], platform: str = "cpu") -> Placement:
        """One process: stage ``s`` on device ids ``devices[s]``."""
        return cls(tuple(StagePlace(tuple(d)) for d in devices), platform)


@dataclasses.dataclass(frozen=True)
class Op:
    """One operation of a program (see the module's table).

    Attributes:
      kind: the operation (``F``, ``BU``, ``MOVE``, ...).
      stage: the stage it runs on (for transfers: the stage the value comes from).
      mb: the microbatch (for ``U``: the update's number; -1 where none applies).
      version: the weight version it reads (-1 where none).
      flags: program variant (``acc``, ``recompute``, ``newest``, ``donate_w``).
      ins: slots read, in argument order.
      outs: slots written, in result order.
      frees: slots dropped after it (their last read in this process).
      peer: transfers: the stage the value goes to.
      actions: the schedule actions it carries out (for timelines).
      part: transfers: ``(source part, destination part)``, the device index within a
        round-robin stage the piece leaves from or goes to (-1: the stage's whole layout).
    """

    kind: OpKind
    stage: int = -1
    mb: int = -1
    version: int = -1
    flags: frozenset[OpFlag] = frozenset()
    ins: tuple[Slot, ...] = ()
    outs: tuple[Slot, ...] = ()
    frees: tuple[Slot, ...] = ()
    peer: int = -1
    actions: tuple[Action, ...] = ()
    part: tuple[int, int] = (-1, -1)

    def __str__(self) -> str:
        head = self.kind + "".join(f"+{f}" for f in sorted(self.flags))
        where = f"{self.stage}" + (f">{self.peer}" if self.peer >= 0 else "")
        if self.part != (-1, -1):
            where += "[{}>{}]".format(*("-" if i < 0 else i for i in self.part))
        text = f"{head:<10} {where:<4} {' '.join(self.ins)} -> {' '.join(self.outs)}"
        if self.frees:
            text += f" | free {' '.join(self.frees)}"
        return text.rstrip()


@dataclasses.dataclass(frozen=True)
class Program:
    """What every process runs for one call over ``num_microbatches`` microbatches.

    Attributes:
      schedule: the schedule's name.
      num_microbatches: microbatches of the call.
      ops: per process, its operations in dispatch order.
      inputs: per process, the slots the caller fills before the first operation.
      outputs: per process, the slots the call returns (newest weights, optimizer and
        model state of its stages, losses).
      peak_versions: per stage, the most weight versions alive at once.
      actions: schedule actions covered.
      updates: per stage, the optimizer updates the call makes.
    """

    schedule: str
    num_microbatches: int
    ops: tuple[tuple[Op, ...], ...]
    inputs: tuple[tuple[Slot, ...], ...]
    outputs: tuple[tuple[Slot, ...], ...]
    peak_versions: tuple[int, ...]
    actions: int
    updates: tuple[int, ...] = ()

    def table(self, process: int = 0) -> str:
        """One line per operation of ``process``."""
        return "\n".join(str(op) for op in self.ops[process])

    def kinds(self, process: int = 0) -> str:
        """The operations' short forms (``1F0 1BU0 MOVE1>0 ...``), for compact tests."""
        out = []
        for op in self.ops[process]:
            if op.kind in (OpKind.MOVE, OpKind.SEND, OpKind.RECV):
                out.append(f"{op.kind}{op.stage}>{op.peer}")
            elif op.kind in (OpKind.KEYS, OpKind.SYNC):
                out.append(f"{op.kind}{op.stage}")
            elif op.kind in (OpKind.LOSS, OpKind.WAIT):
                out.append(f"{op.kind}{op.mb}")
            else:
                out.append(f"{op.stage}{op.kind}{op.mb}")
        return " ".join(out)
