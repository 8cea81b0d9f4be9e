"""PyTorch pipelining's CSV schedules: read them into a :class:`Schedule`, write one out.

``torch.distributed.pipelining`` (``schedules.py``: ``PipelineScheduleMulti._dump_csv`` /
``_load_csv`` and ``_PipelineScheduleRuntime``'s, which also take ``format="compute_comms"``)
keeps a schedule as CSV: row ``r`` is rank ``r``'s actions in order, one per cell, written
by ``csv.writer`` (no header; ``\\r\\n`` line ends). A cell is ``_Action.from_str``'s
``<stage><type>[<microbatch>]``:

- compute: ``F`` (forward), ``B`` (full backward), ``I`` (backward of the input),
  ``W`` (backward of the weights), e.g. ``"2F0"``, ``"1I3"``; the microbatch is required;
- communication and other runtime work: ``SEND_F``, ``RECV_F``, ``SEND_B``, ``RECV_B``
  (``"0SEND_F1"``), ``UNSHARD``, ``RESHARD``, ``REDUCE_GRAD`` (no microbatch: ``"1UNSHARD"``);
- ``(<action>;<action>;...)OVERLAP_F_B``: sub-actions torch runs one after the other unless
  a custom function overlaps them;
- an empty cell: an idle time step (torch's lockstep schedules pad with them).

A stage's rank is the row it appears in; torch checks that no stage appears on two ranks,
that every stage runs ``F`` for every microbatch, and either ``B`` or ``I`` then ``W`` for
each. One CSV is one ``step()``: one optimizer update after all microbatches.

pdjax's own form differs in two ways: the updates are actions (``U``), and every action
carries a weight version. :func:`read_torch_csv` adds the updates a flush schedule needs
(versions 0 for a single step) and drops communication (pdjax implies the transfers),
:func:`write_torch_csv` drops the updates and versions.

>>> import io
>>> from pdjax.schedules import one_f_one_b
>>> out = io.StringIO()
>>> write_torch_csv(one_f_one_b(2, 2), out)
>>> print(out.getvalue().replace("\\r", ""), end="")
0F0,0F1,,0B0,,0B1
,1F0,1B0,1F1,1B1
>>> read_torch_csv(io.StringIO(out.getvalue()), name="1f1b") == one_f_one_b(2, 2)
True
"""

from __future__ import annotations

import csv
import dataclasses
import io
import os
import re
from collections.abc import Sequence
from typing import IO, NamedTuple

from pdjax._jsonio import write_atomic
from pdjax.errors import ScheduleError
from pdjax.schedules import (
    CHUNKED,
    FLUSHING,
    Action,
    Schedule,
    Shape,
    semantics,
    stage_groups,
    validate,
)

__all__ = ["COMMUNICATION_TYPES", "COMPUTE_TYPES", "read_torch_csv", "write_torch_csv"]

COMPUTE_TYPES = ("F", "B", "I", "W")
"""torch's compute action types, spelled as pdjax spells them."""

COMMUNICATION_TYPES = (
    "SEND_F",
    "RECV_F",
    "SEND_B",
    "RECV_B",
    "UNSHARD",
    "RESHARD",
    "REDUCE_GRAD",
)
"""torch's other action types: :func:`read_torch_csv` skips them (pdjax implies them)."""

_TYPES = "|".join(sorted(COMPUTE_TYPES + COMMUNICATION_TYPES, key=len, reverse=True))
_ACTION_RE = re.compile(rf"(\d+)({_TYPES})(\d*)")
_OVERLAP_RE = re.compile(r"\(([^()]*)\)OVERLAP_F_B")
_LOCATION_RE = re.compile(r"device group (\d+), position (\d+)")

PathOrFile = str | os.PathLike[str] | IO[str]


class _Cell(NamedTuple):
    """One compute action read from the CSV, with where it was."""

    row: int  # the rank
    col: int  # 0-based cell index
    text: str  # the whole cell (an OVERLAP_F_B cell for its sub-actions)
    kind: str
    stage: int
    mb: int

    @property
    def label(self) -> str:
        return f"{self.stage}{self.kind}{self.mb}"


def _at(row: int, col: int, text: str, label: str | None = None) -> str:
    inner = f" ({label!r} inside it)" if label is not None and label != text else ""
    return f"rank {row} (row {row + 1}), cell {col + 1} {text!r}{inner}"


def _where(cell: _Cell) -> str:
    return _at(cell.row, cell.col, cell.text, cell.label)


# ----------------------------------------------------------------------------- writing


def write_torch_csv(schedule: Schedule, path_or_file: PathOrFile, *, aligned: bool = True) -> None:
    """Writes ``schedule`` as torch pipelining's CSV: one row per device group (rank).

    Each row lists the group's ``F``, ``B``, ``I`` and ``W`` actions in order as
    ``<stage><type><microbatch>``. pdjax's ``U`` (optimizer update) actions have no torch
    counterpart (torch updates after ``step()``) and are dropped, and so are the weight
    versions. A schedule of several steps is written as one torch step over all its
    microbatches: read it back with ``microbatches_per_step`` to restore the steps.

    Args:
        schedule: a flush schedule (``gpipe``, ``1f1b``, ``interleaved``, ``zb-h1``,
            ``zb-h2``, ``zb-v``: each row holds the stages of its device group, ``zb-v``'s
            two in a V as torch's ZBV layout has them).
        path_or_file: a path, or a text file opened with ``newline=""``.
        aligned: put each action in the cell of its unit-time tick (:meth:`Schedule.clock`
            without the updates), idle ticks as empty cells, as torch's own lockstep
            schedules (``PipelineScheduleMulti``) are laid out; ``False``: no empty cells.
            Either reads back to the same actions.

    Raises:
        ScheduleError: for a schedule torch cannot express: ``pipedream``/``2bw`` (updates
            inside the stream) or round-robin replication (one action, several microbatches).

    >>> import io
    >>> from pdjax.schedules import zb_h1
    >>> out = io.StringIO()
    >>> write_torch_csv(zb_h1(2, 2), out, aligned=False)
    >>> print(out.getvalue().replace("\\r", ""), end="")
    0F0,0F1,0I0,0W0,0I1,0W1
    1F0,1I0,1F1,1I1,1W0,1W1
    """
    if schedule.name not in FLUSHING:
        raise ScheduleError(
            f"torch's CSV holds one flush step (an update after all microbatches); "
            f"{schedule.name} updates inside its stream and has no torch form. Write one of "
            f"{', '.join(FLUSHING)}"
        )
    if any(r == "round-robin" for r in schedule.replication):
        raise ScheduleError(
            "round-robin replication runs several microbatches in one action, which torch's "
            "CSV cannot say; generate the schedule with replication='split'"
        )
    compute = tuple(tuple(a for a in acts if a.kind != "U") for acts in schedule.actions)
    rows: list[list[str]] = []
    if aligned:
        ticks = dataclasses.replace(schedule, actions=compute).clock()
        for acts, times in zip(compute, ticks, strict=True):
            row = [""] * (1 + max(times, default=-1))
            for a, t in zip(acts, times, strict=True):
                row[t] = _torch_text(a)
            rows.append(row)
    else:
        rows = [[_torch_text(a) for a in acts] for acts in compute]
    if isinstance(path_or_file, (str, os.PathLike)):
        # a temporary file and a rename: a link or FIFO at the path is refused, never
        # written through, and a crash leaves no half-written file
        text = io.StringIO(newline="")
        csv.writer(text).writerows(rows)
        write_atomic(os.fspath(path_or_file), text.getvalue(), what="CSV", error=ScheduleError)
    else:
        csv.writer(path_or_file).writerows(rows)


def _torch_text(a: Action) -> str:
    return f"{a.stage}{a.kind}{a.mb}"


# ----------------------------------------------------------------------------- reading


def read_torch_csv(
    path_or_file: PathOrFile,
    *,
    name: str = "1f1b",
    microbatches_per_step: int | None = None,
    replicas: Sequence[int] | None = None,
) -> Schedule:
    """Reads torch pipelining's CSV into a validated pdjax :class:`Schedule`.

    Row ``r`` becomes device group ``r``; each stage belongs to the row it appears in
    (several stages per row: ``name="interleaved"``). ``F``, ``B``, ``I``, ``W`` cells become
    actions in order (an ``OVERLAP_F_B`` cell its sub-actions, one after the other); empty
    cells and communication / runtime cells (``SEND_F``, ``RECV_F``, ``SEND_B``, ``RECV_B``,
    ``UNSHARD``, ``RESHARD``, ``REDUCE_GRAD``) are skipped: pdjax implies the transfers. The
    microbatches are ``0 .. N-1`` (``N`` one more than the largest seen), the stages
    ``0 .. S-1``. Each row then gets, at the end of each step (after its last action of
    that step's microbatches), one ``U`` per stage it holds, in stage order, as the pdjax
    generators lay out a flush; every action of step ``t`` uses weight version ``t``.
    Completely empty rows at the end of the file are ignored.

    Args:
        path_or_file: a path, or a text file (opened with ``newline=""``).
        name: the flush semantics the schedule is validated under: ``gpipe``, ``1f1b``,
            ``interleaved``, ``zb-h1``, ``zb-h2`` or ``zb-v`` (they differ in the
            microbatches in flight they allow per rank, ``gpipe`` all of a step's, and
            ``zb-v`` in its layout: ``2P`` stages in a V, stage ``s`` on rank
            ``min(s, 2P - 1 - s)``, as torch's ZBV schedule places them).
        microbatches_per_step: ``M``; default all ``N`` microbatches (one torch step).
            Give it to read a multi-step pdjax schedule back (``N`` a multiple of ``M``).
        replicas: devices per rank (default 1 each).

    Returns:
        The schedule, validated with :func:`~pdjax.schedules.validate`.

    Raises:
        ScheduleError: naming the rank (row), the cell and its text, and what to do: a
            cell that is not a torch action (or a compute action without microbatch), a
            stage on two ranks, missing or repeated work (a microbatch without its
            forward, a backward without or before its forward, ``B`` and also ``I``/``W``
            for one microbatch, a ``W`` without or before its ``I``, no backward), a layout
            pdjax does not run (a stage ``s`` off rank ``s % P``, or off the V for
            ``zb-v``; several stages per rank but not ``interleaved`` or ``zb-v``), a step
            that starts before the previous one ended, or whatever
            :func:`~pdjax.schedules.validate` finds (more in flight than ``name`` allows, a
            deadlock), with its positions translated to CSV cells. Too many in flight
            names the other names the file reads under; torch's interleaved zero bubble
            (split backwards over several stages per rank, each ``W`` deferred), which
            no pdjax schedule holds, is refused naming the pdjax schedules to run instead
            (``zb-v``, or ``interleaved`` with the file's chunks).

    >>> import io
    >>> text = "0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0B0,0RECV_B1,0B1\\n"
    >>> text += "1RECV_F0,1F0,1RECV_F1,1F1,1B1,1SEND_B1,1B0,1SEND_B0\\n"
    >>> s = read_torch_csv(io.StringIO(text), name="gpipe")
    >>> print(s.grid())
    t  g0   g1
    0  0F0  .
    1  0F1  1F0
    2  .    1F1
    3  .    1B1
    4  .    1B0
    5  0B0  1U0
    6  0B1  .
    7  0U0  .
    """
    source, rows = _read_rows(path_or_file)
    try:
        return _from_rows(rows, name, microbatches_per_step, replicas)
    except ScheduleError as e:
        raise ScheduleError(f"{source}: {e}") from e


def _from_rows(
    rows: list[list[str]],
    name: str,
    microbatches_per_step: int | None,
    replicas: Sequence[int] | None,
    *,
    advise: bool = True,
) -> Schedule:
    """The schedule of ``rows`` under ``name``; ``advise``: an in-flight refusal says
    which other names read the file (see :func:`_in_flight_advice`)."""
    cells, comms = _parse(rows)
    where = _stage_ranks(cells)
    _check_comms(comms, where)
    num_ranks = len(rows)
    num_stages, num_mb = _check_work(cells, where, num_ranks)
    _check_layout(cells, where, name, num_ranks, num_stages)
    per_step = num_mb if microbatches_per_step is None else microbatches_per_step
    if not isinstance(per_step, int) or isinstance(per_step, bool) or per_step < 1:
        raise ScheduleError(f"microbatches_per_step must be an integer >= 1; got {per_step!r}")
    if num_mb % per_step:
        raise ScheduleError(
            f"{num_mb} microbatches are not a whole number of steps of "
            f"microbatches_per_step={per_step}; give a divisor of {num_mb}, or leave it out "
            "(one step)"
        )
    layout = _layout(name, num_ranks, num_stages)
    actions, origins = _with_updates(cells, layout, per_step)
    chunks = num_stages // num_ranks
    in_flight, versions = _bounds(name, num_ranks, chunks, per_step)
    schedule = Schedule(
        name=name,
        num_stages=num_stages,
        num_microbatches=num_mb,
        microbatches_per_step=per_step,
        actions=actions,
        stage_device=layout,
        replicas=tuple(replicas) if replicas is not None else (1,) * num_ranks,
        in_flight_bound=in_flight,
        version_bound=versions,
    )
    try:
        validate(schedule)
    except ScheduleError as e:
        message = _translate(str(e), origins, schedule)
        if advise and "in-flight bound" in message:
            message += _in_flight_advice(rows, schedule, microbatches_per_step, replicas)
        raise ScheduleError(message) from e
    return schedule


def _in_flight_advice(
    rows: list[list[str]],
    schedule: Schedule,
    microbatches_per_step: int | None,
    replicas: Sequence[int] | None,
) -> str:
    """What to do with a file that keeps more microbatches in flight than
    ``schedule.name`` allows: the other flush names it reads under (each tried), or, for
    torch's interleaved zero bubble, which no pdjax schedule holds, the pdjax schedules
    of its family to run instead."""
    allows = (
        f" ({schedule.name} allows {list(schedule.in_flight_bound)} microbatches in flight per rank"
    )
    fits = []
    for other in FLUSHING:
        if other == schedule.name:
            continue
        try:
            _from_rows(rows, other, microbatches_per_step, replicas, advise=False)
        except ScheduleError:
            continue
        fits.append(other)
    if fits:
        return f"{allows}; the file reads as {' and '.join(fits)}: give name={fits[0]!r})"
    P, M, v = schedule.num_groups, schedule.microbatches_per_step, schedule.chunks
    split = any(a.kind in ("I", "W") for acts in schedule.actions for a in acts)
    if v > 1 and split and not semantics(schedule.name).v_shaped:
        return (
            f"{allows}): its I and W cells over {v} stages per rank are torch's interleaved "
            "zero bubble (ScheduleInterleavedZeroBubble, each W run later than its I), "
            "which keeps more microbatches in flight than any pdjax schedule of this "
            "layout; pdjax has no interleaved zero-bubble schedule. Run pdjax's "
            "zero-bubble schedule with 2 stages per rank instead, zb-v (a V: "
            f"'pdjax simulate --unit-costs 1,1,1 --stages {P} --microbatches {M} "
            "--schedule zb-v', 'pdjax train --schedule zb-v'; torch's "
            "ScheduleZBVZeroBubble CSV reads with name='zb-v'), or this layout as "
            f"interleaved 1F1B ('--schedule interleaved --chunks {v}', whose CSV reads "
            "with name='interleaved')"
        )
    return f"{allows}, and no other pdjax flush schedule reads this file: reorder the row)"


def _read_rows(path_or_file: PathOrFile) -> tuple[str, list[list[str]]]:
    if isinstance(path_or_file, (str, os.PathLike)):
        source = os.fspath(path_or_file)
        try:
            with open(path_or_file, newline="") as f:
                rows = list(csv.reader(f))
        except (OSError, UnicodeDecodeError, csv.Error) as e:
            raise ScheduleError(f"cannot read the torch schedule CSV {source!r}: {e}") from e
    else:
        source = getattr(path_or_file, "name", None) or "the torch schedule CSV"
        try:
            rows = list(csv.reader(path_or_file))
        except csv.Error as e:
            raise ScheduleError(f"{source}: not CSV: {e}") from e
    while rows and not any(c.strip() for c in rows[-1]):
        rows.pop()
    if not rows:
        raise ScheduleError(f"{source}: no rows; expected one row of actions per rank")
    return str(source), rows


_HINTS = {
    "BW": "older torch releases spelled the full backward 'BW': write it as B",
    "U": "pdjax's update U has no torch form; read_torch_csv adds the updates: remove it",
}


def _parse_one(text: str, row: int, col: int, whole: str) -> tuple[str, int, int | None]:
    match = _ACTION_RE.fullmatch(text)
    if match is None:
        kind = re.fullmatch(r"\d+([A-Z_]+)\d*(v\d+)?", text)
        hint = ""
        if kind is not None and kind.group(2):
            hint = "; weight versions ('v1') are pdjax's, torch's CSV has none"
        elif kind is not None and kind.group(1) in _HINTS:
            hint = "; " + _HINTS[kind.group(1)]
        raise ScheduleError(
            f"{_at(row, col, whole, text)}: not a torch pipelining action: expected "
            f"<stage><type>[<microbatch>] with type one of {', '.join(COMPUTE_TYPES)} "
            f"(compute) or {', '.join(COMMUNICATION_TYPES)}, e.g. '2F0', '1SEND_B3', or "
            f"(<action>;<action>)OVERLAP_F_B{hint}"
        )
    stage, kind_text, mb = match.groups()
    if kind_text in COMPUTE_TYPES and not mb:
        raise ScheduleError(
            f"{_at(row, col, whole, text)}: a {kind_text} action needs its microbatch, "
            f"e.g. '{stage}{kind_text}0'"
        )
    return kind_text, int(stage), int(mb) if mb else None


def _parse(rows: list[list[str]]) -> tuple[list[list[_Cell]], list[tuple[int, int, str, int]]]:
    """Compute cells per row, and communication cells as ``(row, col, text, stage)``."""
    cells: list[list[_Cell]] = []
    comms: list[tuple[int, int, str, int]] = []
    for r, row in enumerate(rows):
        out: list[_Cell] = []
        for c, raw in enumerate(row):
            text = raw.strip()
            if not text:
                continue
            overlap = _OVERLAP_RE.fullmatch(text)
            parts = [p.strip() for p in overlap.group(1).split(";")] if overlap else [text]
            for part in parts:
                if not part:
                    continue
                kind, stage, mb = _parse_one(part, r, c, text)
                if kind in COMPUTE_TYPES:
                    assert mb is not None
                    out.append(_Cell(row=r, col=c, text=text, kind=kind, stage=stage, mb=mb))
                else:
                    comms.append((r, c, text, stage))
        cells.append(out)
    return cells, comms


def _stage_ranks(cells: list[list[_Cell]]) -> dict[int, _Cell]:
    """Each stage's first compute cell; raises if a stage appears on two ranks."""
    first: dict[int, _Cell] = {}
    for row in cells:
        for cell in row:
            seen = first.setdefault(cell.stage, cell)
            if seen.row != cell.row:
                raise ScheduleError(
                    f"{_where(cell)}: stage {cell.stage} already runs on rank {seen.row} "
                    f"({_where(seen)}); a stage lives on one rank: move its actions to one row"
                )
    return first


def _check_comms(comms: list[tuple[int, int, str, int]], where: dict[int, _Cell]) -> None:
    for r, c, text, stage in comms:
        if stage not in where:
            raise ScheduleError(
                f"{_at(r, c, text)}: names stage {stage}, which no row computes; every stage "
                "needs its F and backward actions"
            )
        if where[stage].row != r:
            raise ScheduleError(
                f"{_at(r, c, text)}: stage {stage} runs on rank {where[stage].row}, and torch "
                f"posts a stage's sends and receives on its own rank: move it to row "
                f"{where[stage].row + 1}"
            )


def _check_work(
    cells: list[list[_Cell]], where: dict[int, _Cell], num_ranks: int
) -> tuple[int, int]:
    """Every stage's work present once and in order; returns ``(S, N)``."""
    for r, row in enumerate(cells):
        if not row:
            raise ScheduleError(
                f"rank {r} (row {r + 1}) has no compute actions: every rank needs a stage "
                "(drop the row, or give it its stages' F and backward cells)"
            )
    num_stages = 1 + max(where)
    for s in range(num_stages):
        if s not in where:
            raise ScheduleError(
                f"no row computes stage {s}, but stage {num_stages - 1} exists: the stages are "
                f"0 .. S-1 (torch's stage_index), each on one rank; add stage {s}'s actions"
            )
    num_mb = 1 + max(c.mb for row in cells for c in row)
    for row in cells:
        seen: dict[tuple[str, int, int], _Cell] = {}
        for cell in row:
            s, k = cell.stage, cell.mb
            key = (cell.kind, s, k)
            if key in seen:
                raise ScheduleError(
                    f"{_where(cell)} repeats {_where(seen[key])}: each action runs once; remove one"
                )
            if cell.kind in "BI":
                other = "I" if cell.kind == "B" else "B"
                if (other, s, k) in seen:
                    raise ScheduleError(
                        f"{_where(cell)}: microbatch {k} of stage {s} already has "
                        f"{_where(seen[other, s, k])}; use either B (the whole backward) or "
                        "the pair I then W"
                    )
                if ("F", s, k) not in seen:
                    raise ScheduleError(_before(cell, "F", row, "forward"))
            if cell.kind == "W":
                if ("B", s, k) in seen:
                    raise ScheduleError(
                        f"{_where(cell)}: microbatch {k} of stage {s} already has "
                        f"{_where(seen['B', s, k])}, its whole backward; use either B or the "
                        f"pair I then W (older torch releases wrote the input backward as B "
                        f"next to W: rename that B to '{s}I{k}')"
                    )
                if ("I", s, k) not in seen:
                    if any(c.label == f"{s}B{k}" for c in row):
                        raise ScheduleError(
                            f"{_where(cell)}: microbatch {k} of stage {s} also has a whole "
                            f"backward '{s}B{k}' later in the row; use either B or the pair I "
                            "then W"
                        )
                    raise ScheduleError(_before(cell, "I", row, "input gradient"))
            seen[key] = cell
        for cell in row:  # the row holds all of each of its stages' work
            s, k = cell.stage, cell.mb
            if cell.kind == "F" and not {("B", s, k), ("I", s, k)} & seen.keys():
                raise ScheduleError(
                    f"{_where(cell)} has no backward: add '{s}B{k}' (or '{s}I{k}' then "
                    f"'{s}W{k}') later in row {cell.row + 1}"
                )
            if cell.kind == "I" and ("W", s, k) not in seen:
                raise ScheduleError(
                    f"{_where(cell)} has no weight gradient: add '{s}W{k}' after it in row "
                    f"{cell.row + 1} (or replace it with '{s}B{k}')"
                )
    forwards = {(c.stage, c.mb) for row in cells for c in row if c.kind == "F"}
    for s in range(num_stages):
        for k in range(num_mb):
            if (s, k) not in forwards:
                r = where[s].row
                raise ScheduleError(
                    f"stage {s} (rank {r}, row {r + 1}) has no forward of microbatch {k} "
                    f"(microbatches run 0 .. {num_mb - 1} at every stage): add '{s}F{k}' to "
                    f"row {r + 1}"
                )
    return num_stages, num_mb


def _before(cell: _Cell, kind: str, row: list[_Cell], what: str) -> str:
    need = f"{cell.stage}{kind}{cell.mb}"
    later = next((c for c in row if c.label == need and c.col >= cell.col), None)
    if later is not None:
        return f"{_where(cell)} runs before its {what} {_where(later)}: move it after that"
    return (
        f"{_where(cell)}: microbatch {cell.mb} of stage {cell.stage} has no {what} '{need}': "
        f"add it before this cell in row {cell.row + 1}"
    )


def _check_layout(
    cells: list[list[_Cell]],
    where: dict[int, _Cell],
    name: str,
    num_ranks: int,
    num_stages: int,
) -> None:
    if name not in FLUSHING:
        raise ScheduleError(
            f"name={name!r}: a torch CSV is one flush step (an update after all "
            f"microbatches); read it as one of {', '.join(FLUSHING)}"
        )
    if semantics(name).v_shaped and num_stages != 2 * num_ranks:
        raise ScheduleError(
            f"name='zb-v' places 2 stages per rank in a V; the file has {num_stages} stages "
            f"over {num_ranks} ranks (expected {2 * num_ranks})"
        )
    layout = _layout(name, num_ranks, num_stages)
    for s in range(num_stages):
        if where[s].row != layout[s]:
            raise ScheduleError(
                f"{_where(where[s])}: stage {s} runs on rank {where[s].row}, but "
                + (
                    f"zb-v places stage s on rank min(s, 2P - 1 - s) = {layout[s]} (a V)"
                    if semantics(name).v_shaped
                    else f"pdjax places stage s on rank s % P = {layout[s]} (torch's 'loop' "
                    "layout); a V-shaped layout (torch's ZBV) reads with name='zb-v', "
                    "DualPipeV's is not supported"
                )
            )
    if num_stages % num_ranks:
        r = num_stages % num_ranks
        raise ScheduleError(
            f"{num_stages} stages over {num_ranks} ranks: rank {r} (row {r + 1}) holds fewer "
            "stages than rank 0; every rank holds the same number of stages"
        )
    chunks = num_stages // num_ranks
    if chunks > 1 and name not in CHUNKED:
        held = ", ".join(str(s) for s in range(0, num_stages, num_ranks))
        raise ScheduleError(
            f"rank 0 (row 1) holds stages {held} ({chunks} per rank): only interleaved runs "
            f"several stages per rank; read it with name='interleaved' (not {name!r})"
        )


def _layout(name: str, num_ranks: int, num_stages: int) -> tuple[int, ...]:
    """The rank of each stage under ``name``: the V of ``zb-v``, else ``s % P``."""
    if semantics(name).v_shaped:
        return stage_groups(name, num_ranks, 2)
    return tuple(s % num_ranks for s in range(num_stages))


def _with_updates(
    cells: list[list[_Cell]], layout: Sequence[int], per_step: int
) -> tuple[tuple[tuple[Action, ...], ...], list[list[_Cell | None]]]:
    """Each row's actions with the updates after each step, and each action's cell."""
    actions: list[tuple[Action, ...]] = []
    origins: list[list[_Cell | None]] = []
    steps = 1 + max(c.mb for row in cells for c in row) // per_step
    for r, row in enumerate(cells):
        held = [s for s, rank in enumerate(layout) if rank == r]
        last = [max(i for i, c in enumerate(row) if c.mb // per_step == t) for t in range(steps)]
        for t in range(steps - 1):
            late = next((c for c in row[: last[t]] if c.mb // per_step > t), None)
            if late is not None:
                raise ScheduleError(
                    f"{_where(late)} belongs to step {late.mb // per_step} "
                    f"(microbatches_per_step={per_step}) but comes before "
                    f"{_where(row[last[t]])} of step {t}: a flush schedule finishes a step on "
                    "each rank before it starts the next"
                )
        acts: list[Action] = []
        where: list[_Cell | None] = []
        for i, c in enumerate(row):
            acts.append(Action(c.kind, c.stage, c.mb, c.mb // per_step))
            where.append(c)
            if i in last:
                t = last.index(i)
                acts += [Action("U", s, t, t) for s in held]
                where += [None] * len(held)
        actions.append(tuple(acts))
        origins.append(where)
    return tuple(actions), origins


def _bounds(
    name: str, groups: int, chunks: int, per_step: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """In-flight and version bounds ``name`` declares (the semantics table's, one step)."""
    row = semantics(name)
    shape = Shape(groups, per_step, per_step, chunks)
    in_flight = tuple(row.in_flight(shape, d) for d in range(groups))
    return in_flight, tuple(row.versions(shape, s) for s in range(groups * chunks))


def _translate(message: str, origins: list[list[_Cell | None]], schedule: Schedule) -> str:
    """The validator's ``device group d, position i`` as the CSV's rank, row and cell."""

    def cell(match: re.Match[str]) -> str:
        d, i = int(match.group(1)), int(match.group(2))
        try:
            origin = origins[d][i]
        except IndexError:
            return match.group(0)
        if origin is None:
            a = schedule.actions[d][i]
            return f"rank {d} (row {d + 1}), the update {a} pdjax appended after step {a.mb}"
        return _where(origin)

    return _LOCATION_RE.sub(cell, message)
