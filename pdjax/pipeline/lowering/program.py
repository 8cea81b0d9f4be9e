"""Lowering: a validated schedule and a placement become, per process, a flat program.

A :class:`Program` decides ahead of time everything the interpreter would otherwise work out
per action: which stage program runs (an operation's kind and flags), which weight version
it reads, where each input comes from, the explicit transfers between stages (``MOVE``
within a process; ``SEND``/``RECV`` across processes, both sides in the same order), when
each value is dropped, which actions are fused into one program, and where the driver
waits so that it does not run too far ahead. Programs are plain data: printable (one line
per operation), comparable, and testable without devices.

Every value lives in a named *slot*, written once (SSA), so the order of a program can be
checked and any program can be re-sorted by data dependencies:

==============================  ==================================================================
slot                            value
==============================  ==================================================================
``w{s}v{n}``                    stage ``s``'s weights, version ``n`` (``w{s}v0`` from the caller)
``o{s}v{n}``                    its optimizer state after the update that made version ``n``
``st{s}``, ``st{s}.{k}``        its model state (BatchNorm statistics): before the call, after
                                the forward of microbatch ``k``
``rng{s}``, ``key{s}.{k}``      the caller's PRNG key on the stage's devices; microbatch ``k``'s
``x{s}.{k}``                    stage ``s``'s input for microbatch ``k`` (``x0.{k}``: the caller's)
``t{k}``                        microbatch ``k``'s targets, on the last stage
``y{s}.{k}``                    stage ``s``'s output (before it moves to stage ``s + 1``)
``r{s}.{k}``                    residuals the forward keeps for the backward
``c{s}.{k}``                    zero bubble: the output cotangents ``I`` keeps for ``W``
``e{s}.{k}``                    gradient of stage ``s``'s input (before it moves to ``s - 1``)
``d{s}.{k}``                    gradient of stage ``s``'s output (arrived from ``s + 1``)
``g{s}.{k}``                    stage ``s``'s summed weight gradients up to microbatch ``k``
``loss{k}``                     microbatch ``k``'s loss, on the last stage
``q{s}.{u}``, ``q{s}.{u}@{r}``  update ``u``'s gradient sum of squares at stage ``s`` (and on
                                stage ``r``): optimizers that clip by the global norm
``pg{s}.{u}:{o}``               tied parameters: update ``u``'s summed gradients of stage ``s``'s
                                copies of the groups stage ``o`` owns (``@{o}``: arrived there)
``nw{o}.{u}:{s}``               the new values of those groups, made by owner ``o``'s update
                                ``u``, for stage ``s`` (``@{s}``: arrived there)
``m<name>{s}.{k}``              a round-robin stage's group value (``mx``, ``my``, ``mkey``,
                                ``mt``, ``mloss``, ``md``, ``me``): the ``r`` microbatches from
                                ``k`` on, concatenated, microbatch ``k + d`` on device ``d``
==============================  ==================================================================

A round-robin stage (PipeDream's replication; see
:func:`~pdjax.schedules.pipedream`) computes ``r`` microbatches in one operation:
``GATHER`` assembles the pieces that arrived on its devices into the group value (no
copy), ``PART`` hands the group's outputs back as one piece per microbatch (no copy), and
each piece moves to or from its own device (``MOVE`` with ``part``).

Operations and their arguments (the stage programs of :class:`~pdjax.pipeline.stage.Stage`
take and return exactly these, in this order; ``[..]`` appears only where it applies):

==========  ==================================================  ============================
kind        reads                                               writes
==========  ==================================================  ============================
``KEYS``    ``rng{s}``                                          ``key{s}.{k}`` for every k
``F``       ``w st x key [t]``                                  ``y|loss st' [r]``
``B``       ``w x R [d] [g]``                                   ``g' [e]``
``I``       ``w x R [d]``                                       ``[e] c``
``W``       ``w x R c [g]``                                     ``g'``
``U``       ``g w o [pg@s ...] [nw@s ...] [q@s ...]``           ``w' o' [nw:r ...]``
``BU``      ``w x R [d] [g] [w_newest] o``                      ``w' o' [e]``
``FB``      ``w st x key t [g]``                                ``loss st' g' [e]``
``FBU``     ``w st x key t [g] [w_newest] o``                   ``loss st' w' o' [e]``
``SQ``      ``g [pg@s ...]``                                    ``q``
``TG``      ``g``                                               ``pg:o`` per owner ``o``
``MOVE``    a value on stage ``s``                              the same on stage ``peer``
``SEND``    a value on stage ``s`` (this process holds it)      (nothing)
``RECV``    (nothing: the value comes from stage ``s``)         the value on stage ``peer``
``LOSS``    ``loss{k}``                                         (calls ``on_loss``)
``WAIT``    ``loss{k}``                                         (blocks until it is computed)
``SYNC``    the outputs of the operation before                 (blocks: one at a time)
``GATHER``  ``r`` pieces, each on its device of stage ``s``     the group value
``PART``    a group value                                       its ``r`` pieces
==========  ==================================================  ============================

Tied parameters (``sequential(..., tied=...)``) whose copies sit on several stages: each
group is owned by the first stage holding a copy. At each update, every other holder sums
its copies' gradients (``TG``) and sends them to the owner (``pg``); the owner's update adds
them to its own, updates the group once, and sends the new value (``nw``) to the holders,
whose update writes it into their copies. Updates of such stages are not fused with a
backward. Copies on one stage are summed inside its update.

``R`` is ``r`` (the forward's residuals) or, with the ``recompute`` flag, ``st key [t]``
(what recomputing the forward needs: rematerialisation, or PipeDream without weight
stashing, whose backward runs at newer weights). Flags: ``acc`` adds into a running
gradient sum; ``recompute``; ``newest`` (the weights read are the newest, passed once);
``donate_w`` (the newest weights are dropped by this operation: their buffers are reused).
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Sequence

from pdjax._memory_policy import memory_policies, recomputes
from pdjax.errors import PipelineError
from pdjax.pipeline.lowering.ops import global_ops
from pdjax.pipeline.lowering.types import (
    COMPUTE,
    OFFSET,
    Op,
    OpFlag,
    OpKind,
    Placement,
    Program,
    Slot,
    SlotKind,
)
from pdjax.pipeline.transport import TRANSPORTS
from pdjax.schedules import Schedule, semantics

__all__ = ["lower"]


def lower(
    schedule: Schedule,
    placement: Placement,
    *,
    remat: bool | str | Sequence[bool | str] = False,
    fuse: bool = True,
    coupled: bool = False,
    run_ahead: int | None = None,
    one_at_a_time: Sequence[bool] | None = None,
    on_loss: bool = False,
    donate_weights: bool = True,
    tied: Sequence[Sequence[int]] = (),
) -> Program:
    """Lowers a validated ``schedule`` over ``placement`` into per-process programs.

    Args:
      schedule: a schedule that passed :func:`~pdjax.schedules.validate`.
      placement: where each stage lives; ``placement.stages[s]`` for stage ``s``.
      remat: every stage's memory policy, or one per stage (a bool or a name of
        :data:`pdjax._memory_policy.MEMORY_POLICIES`). Only ``True``/``"full"`` changes
        the program: such a stage's forward keeps no residuals and its backward gets the
        ``recompute`` flag; the named policies keep residuals (what their
        ``jax.checkpoint`` policy saves), which the stage's programs decide.
      fuse: fuse a backward with the update that follows it, and on the last stage a
        forward with its backward (one program each).
      coupled: the optimizer couples stages through the gradients' global norm: each
        update waits for every stage's sum of squares (no backward-update fusion).
      run_ahead: where the driver waits: after dispatching microbatch ``k``'s loss, for
        microbatch ``k - run_ahead``'s (None: never).
      one_at_a_time: per stage, wait for each of its operations before the next.
      on_loss: report each loss to a callback as it is dispatched (``LOSS`` operations).
      donate_weights: fused updates reuse the buffers of the weights they replace when
        nothing reads them later (``donate_w``); off where donating a buffer that queued
        programs still read blocks the driver (XLA's CPU client: ``pdjax._xla_cpu``).
      tied: per tied parameter group with copies on several stages, those stages
        (ascending; the first owns the group). Their updates exchange the group's
        gradients and new value (``TG``, ``pg``, ``nw``); every stage must update once
        per step (flush schedules).

    Raises:
      PipelineError: for a placement that does not fit the schedule, or a program that
        cannot run (a cross-process link with no transport that supports it).
    """
    _check_placement(schedule, placement)
    holders = _tied_holders(schedule, tied)
    S = schedule.num_stages
    flags = tuple(recomputes(p) for p in memory_policies(remat, S, PipelineError))
    ops = global_ops(
        schedule,
        remat=flags,
        fuse=fuse,
        coupled=coupled,
        run_ahead=run_ahead,
        on_loss=on_loss,
        tied=holders,
    )
    ops = _in_dependency_order(ops, _caller_slots(schedule))
    if one_at_a_time is not None:
        ops = _one_at_a_time(ops, one_at_a_time)
    if donate_weights:
        ops = _donate_dropped_weights(ops, schedule)
    per_process, inputs, outputs = _split_by_process(ops, schedule, placement)
    return Program(
        schedule=schedule.name,
        num_microbatches=schedule.num_microbatches,
        ops=per_process,
        inputs=inputs,
        outputs=outputs,
        peak_versions=_peak_versions(ops, S),
        actions=sum(len(g) for g in schedule.actions),
        updates=tuple(
            sum(a.kind == "U" and a.stage == s for g in schedule.actions for a in g)
            for s in range(S)
        ),
    )


# ----------------------------------------------------------------------------- checks


def _check_placement(schedule: Schedule, placement: Placement) -> None:
    S = schedule.num_stages
    if len(placement.stages) != S:
        raise PipelineError(f"the placement has {len(placement.stages)} stages, the schedule {S}")
    _check_transport(placement)
    if schedule.replication and placement.num_processes > 1:
        raise PipelineError(
            "round-robin replication runs in one process for now (its stages gather "
            "microbatches from their devices on the host); use replication='split' across "
            "processes"
        )


def _tied_holders(schedule: Schedule, tied: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    """Each tied group's stages, ascending and checked (the first owns the group)."""
    S = schedule.num_stages
    holders = tuple(tuple(sorted(set(h))) for h in tied)
    for h in holders:
        if len(h) < 2 or not all(0 <= t < S for t in h):
            raise PipelineError(f"a tied group's stages {h} must be at least two of 0..{S - 1}")
    if holders and not _updates_in_lockstep(schedule):
        raise PipelineError(
            f"tied parameters across stages need every stage to update once per step; "
            f"{schedule.name} does not"
        )
    return holders


def _check_transport(placement: Placement) -> None:
    if placement.transport not in TRANSPORTS:
        raise PipelineError(
            f"unknown transport {placement.transport!r}; choose one of {tuple(TRANSPORTS)}"
        )
    used = sorted({p for st in placement.stages for p in st.processes})
    most = TRANSPORTS[placement.transport].cpu_processes
    if placement.platform == "cpu" and most is not None and len(used) > most:
        raise PipelineError(
            f"this pipeline spans {len(used)} processes ({used}) and moves values between "
            "them with jax.device_put, which on CPU pairs sends and receives per sender (a "
            "process sending to two others hangs one of them); use transport='collective' "
            "(an XLA collective per link) or at most 2 processes"
        )


def _updates_in_lockstep(schedule: Schedule) -> bool:
    """Whether the stages update together, once per step each (flush schedules): update
    ``u`` of one stage then goes with update ``u`` of every other."""
    if semantics(schedule.name).streams:
        return False
    counts = {
        sum(a.kind == "U" and a.stage == s for g in schedule.actions for a in g)
        for s in range(schedule.num_stages)
    }
    return len(counts) == 1


def _caller_slots(schedule: Schedule) -> list[Slot]:
    """The slots the caller fills: every stage's weights, optimizer and model state and
    PRNG key, the microbatch offset, the inputs (stage 0) and the targets (last stage)."""
    S, N = schedule.num_stages, schedule.num_microbatches
    slots = [OFFSET]
    for s in range(S):
        slots += [
            Slot(SlotKind.WEIGHTS, s, 0),
            Slot(SlotKind.OPT, s, 0),
            Slot(SlotKind.STATE, s),
            Slot(SlotKind.RNG, s),
        ]
    first, last = schedule.group_size(0), schedule.group_size(S - 1)
    xs = [Slot(SlotKind.X, 0, k, group=first > 1) for k in range(0, N, first)]
    ts = [Slot(SlotKind.TARGET, S - 1, k, group=last > 1) for k in range(0, N, last)]
    return slots + xs + ts


def _in_dependency_order(ops: list[Op], given: Sequence[Slot]) -> list[Op]:
    """``ops`` reordered, as little as possible, so that every slot is written before it
    is read (needed only when updates wait for every stage's sum of squares)."""
    writer: dict[Slot, int] = {}
    for i, op in enumerate(ops):
        for slot in op.outs:
            if slot in writer:
                raise PipelineError(f"slot {slot} is written twice ({ops[writer[slot]]}, {op})")
            writer[slot] = i
    have = set(given)
    waiting: dict[Slot, list[int]] = {}
    missing = [0] * len(ops)
    ready: list[int] = []
    for i, op in enumerate(ops):
        for slot in set(op.ins):
            if slot in have:
                continue
            if slot not in writer:
                raise PipelineError(f"{op} reads {slot}, which nothing writes")
            missing[i] += 1
            waiting.setdefault(slot, []).append(i)
        if not missing[i]:
            heapq.heappush(ready, i)
    out = []
    while ready:
        i = heapq.heappop(ready)
        out.append(ops[i])
        for slot in ops[i].outs:
            for j in waiting.pop(slot, ()):
                missing[j] -= 1
                if not missing[j]:
                    heapq.heappush(ready, j)
    if len(out) != len(ops):
        raise PipelineError("the program's operations wait on each other (a cycle)")
    return out


def _one_at_a_time(ops: list[Op], stages: Sequence[bool]) -> list[Op]:
    out = []
    for op in ops:
        out.append(op)
        if op.kind in COMPUTE and op.kind is not OpKind.KEYS and stages[op.stage] and op.outs:
            out.append(Op(OpKind.SYNC, op.stage, op.mb, ins=op.outs))
    return out


def _donate_dropped_weights(ops: list[Op], schedule: Schedule) -> list[Op]:
    """Marks fused updates whose newest weights nothing reads later (``donate_w``): their
    buffers are reused for the new version. Where a gradient sum comes in (``U``, and
    ``acc``) it is donated already and takes the new version's place, so donating the
    weights too would leave buffers XLA cannot use. The caller's version 0 is never
    donated (the caller may still hold it)."""
    last_read: dict[Slot, int] = {}
    for i, op in enumerate(ops):
        for slot in op.ins:
            last_read[slot] = i
    out = []
    for i, op in enumerate(ops):
        if op.kind in (OpKind.BU, OpKind.FBU) and OpFlag.ACC not in op.flags:
            made = next(x for x in op.outs if x.kind is SlotKind.WEIGHTS and x.stage == op.stage)
            n = made.number - 1
            newest = made.evolve(number=n)
            if n > 0 and last_read.get(newest) == i:
                op = dataclasses.replace(op, flags=op.flags | {OpFlag.DONATE_W})
        out.append(op)
    del schedule
    return out


def _peak_versions(ops: list[Op], S: int) -> tuple[int, ...]:
    """Per stage, the most weight versions alive after any operation (a version stays
    alive while it is the newest or a later operation reads it)."""
    last_read: dict[Slot, int] = {}
    for i, op in enumerate(ops):
        for slot in op.ins:
            last_read[slot] = i
    alive: list[dict[Slot, int]] = [{Slot(SlotKind.WEIGHTS, s, 0): 0} for s in range(S)]
    peak = [1] * S
    for i, op in enumerate(ops):
        for slot in op.outs:
            if slot.kind is SlotKind.WEIGHTS:
                alive[slot.stage][slot] = slot.number
        for s in range(S):
            newest = max(alive[s].values())
            alive[s] = {
                x: n for x, n in alive[s].items() if n == newest or last_read.get(x, -1) > i
            }
            peak[s] = max(peak[s], len(alive[s]))
    return tuple(peak)


def _final_slots(ops: list[Op], schedule: Schedule) -> list[Slot]:
    S = schedule.num_stages
    written = [o for op in ops for o in op.outs]
    out = []
    for s in range(S):
        for kind in (SlotKind.WEIGHTS, SlotKind.OPT):
            versions = [x.number for x in written if x.kind is kind and x.stage == s]
            out.append(Slot(kind, s, max(versions, default=0)))
        states = [x for x in written if x.kind is SlotKind.STATE and x.stage == s and x.number >= 0]
        out.append(states[-1] if states else Slot(SlotKind.STATE, s))
    out += [Slot(SlotKind.LOSS, S - 1, k) for k in range(schedule.num_microbatches)]
    return out


# ----------------------------------------------------------------------------- processes


def _split_by_process(
    ops: list[Op], schedule: Schedule, placement: Placement
) -> tuple[tuple[tuple[Op, ...], ...], tuple[tuple[Slot, ...], ...], tuple[tuple[Slot, ...], ...]]:
    """Per process: its operations (with what each frees), the slots the caller fills and
    the slots the call returns."""
    per_process, inputs, outputs = [], [], []
    for p in range(placement.num_processes):
        mine = [op for op in ops if _runs_on(op, p, placement)]
        mine = [_for_process(op, p, placement) for op in mine]
        ins = tuple(slot for slot in _caller_slots(schedule) if _holds(slot, p, placement))
        outs = tuple(slot for slot in _final_slots(ops, schedule) if _holds(slot, p, placement))
        per_process.append(tuple(_with_frees(mine, set(outs))))
        inputs.append(ins)
        outputs.append(outs)
    return tuple(per_process), tuple(inputs), tuple(outputs)


def _holds(slot: Slot, p: int, placement: Placement) -> bool:
    """Whether process ``p`` holds ``slot`` (on the devices of :attr:`Slot.home`)."""
    if slot.kind is SlotKind.OFFSET:
        return True
    return p in placement.stages[slot.home].processes


def _runs_on(op: Op, p: int, placement: Placement) -> bool:
    if op.kind is OpKind.MOVE:
        return p in placement.stages[op.stage].processes or p in placement.stages[op.peer].processes
    return p in placement.stages[op.stage].processes


def _for_process(op: Op, p: int, placement: Placement) -> Op:
    """A transfer as process ``p`` sees it: a ``MOVE`` when it holds both ends alone, or
    when both stages are on the same devices (two chunks of one device group, as
    ``interleaved`` with one group and ``zb-v``'s turn: every process already holds its
    part, the value only changes slot); a ``SEND`` and/or ``RECV`` otherwise (a stage
    spanning processes takes part on both)."""
    if op.kind is not OpKind.MOVE:
        return op
    here, there = placement.stages[op.stage], placement.stages[op.peer]
    src, dst = here.processes, there.processes
    if src == dst == (p,) or here.devices == there.devices:
        return op
    if p in src and p in dst:
        return dataclasses.replace(op, kind=OpKind.SENDRECV)
    if p in src:
        return dataclasses.replace(op, kind=OpKind.SEND, outs=())
    return dataclasses.replace(op, kind=OpKind.RECV, ins=())


def _with_frees(ops: list[Op], keep: set[Slot]) -> list[Op]:
    """Each op with the slots it reads for the last time (or writes and nothing reads)."""
    last: dict[Slot, int] = {}
    for i, op in enumerate(ops):
        for slot in op.ins:
            last[slot] = i
        for slot in op.outs:
            last.setdefault(slot, i)
    out = []
    for i, op in enumerate(ops):
        seen = list(dict.fromkeys((*op.ins, *op.outs)))
        frees = tuple(x for x in seen if last.get(x) == i and x not in keep)
        out.append(dataclasses.replace(op, frees=frees) if frees else op)
    return out
