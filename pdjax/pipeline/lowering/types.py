"""The data of a lowered program: where stages live (:class:`StagePlace`,
:class:`Placement`), one operation (:class:`Op`) and what every process runs for one call
(:class:`Program`). The slots and operation kinds are tabled in
:mod:`pdjax.pipeline.lowering.program`, which makes them (:func:`~pdjax.pipeline.lowering.lower`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from pdjax.schedules import Action

__all__ = ["Op", "Placement", "Program", "StagePlace"]


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

    kind: str
    stage: int = -1
    mb: int = -1
    version: int = -1
    flags: frozenset[str] = frozenset()
    ins: tuple[str, ...] = ()
    outs: tuple[str, ...] = ()
    frees: tuple[str, ...] = ()
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
    inputs: tuple[tuple[str, ...], ...]
    outputs: tuple[tuple[str, ...], ...]
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
            if op.kind in ("MOVE", "SEND", "RECV"):
                out.append(f"{op.kind}{op.stage}>{op.peer}")
            elif op.kind in ("KEYS", "SYNC"):
                out.append(f"{op.kind}{op.stage}")
            elif op.kind in ("LOSS", "WAIT"):
                out.append(f"{op.kind}{op.mb}")
            else:
                out.append(f"{op.stage}{op.kind}{op.mb}")
        return " ".join(out)
