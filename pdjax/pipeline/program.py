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

======================  =============================================================
slot                    value
======================  =============================================================
``w{s}v{n}``            stage ``s``'s weights, version ``n`` (``w{s}v0`` from the caller)
``o{s}v{n}``            its optimizer state after the update that made version ``n``
``st{s}``, ``st{s}.{k}``  its model state (BatchNorm statistics): before the call, after
                        the forward of microbatch ``k``
``rng{s}``, ``key{s}.{k}``  the caller's PRNG key on the stage's devices; microbatch ``k``'s
``x{s}.{k}``            stage ``s``'s input for microbatch ``k`` (``x0.{k}``: the caller's)
``t{k}``                microbatch ``k``'s targets, on the last stage
``y{s}.{k}``            stage ``s``'s output (before it moves to stage ``s + 1``)
``r{s}.{k}``            residuals the forward keeps for the backward
``c{s}.{k}``            zero bubble: the output cotangents ``I`` keeps for ``W``
``e{s}.{k}``            gradient of stage ``s``'s input (before it moves to ``s - 1``)
``d{s}.{k}``            gradient of stage ``s``'s output (arrived from ``s + 1``)
``g{s}.{k}``            stage ``s``'s summed weight gradients up to microbatch ``k``
``loss{k}``             microbatch ``k``'s loss, on the last stage
``q{s}.{u}``, ``q{s}.{u}@{r}``  update ``u``'s gradient sum of squares at stage ``s`` (and on
                        stage ``r``): optimizers that clip by the global norm
``pg{s}.{u}:{o}``       tied parameters: update ``u``'s summed gradients of stage ``s``'s
                        copies of the groups stage ``o`` owns (``@{o}``: arrived there)
``nw{o}.{u}:{s}``       the new values of those groups, made by owner ``o``'s update
                        ``u``, for stage ``s`` (``@{s}``: arrived there)
``m<name>{s}.{k}``      a round-robin stage's group value (``mx``, ``my``, ``mkey``,
                        ``mt``, ``mloss``, ``md``, ``me``): the ``r`` microbatches from
                        ``k`` on, concatenated, microbatch ``k + d`` on device ``d``
======================  =============================================================

A round-robin stage (PipeDream's replication; see
:func:`~pdjax.pipeline.schedules.pipedream`) computes ``r`` microbatches in one operation:
``GATHER`` assembles the pieces that arrived on its devices into the group value (no
copy), ``PART`` hands the group's outputs back as one piece per microbatch (no copy), and
each piece moves to or from its own device (``MOVE`` with ``part``).

Operations and their arguments (the stage programs of :class:`~pdjax.pipeline.stage.Stage`
take and return exactly these, in this order; ``[..]`` appears only where it applies):

=========  ==================================================  ===========================
kind       reads                                               writes
=========  ==================================================  ===========================
``KEYS``   ``rng{s}``                                          ``key{s}.{k}`` for every k
``F``      ``w st x key [t]``                                  ``y|loss st' [r]``
``B``      ``w x R [d] [g]``                                   ``g' [e]``
``I``      ``w x R [d]``                                       ``[e] c``
``W``      ``w x R c [g]``                                     ``g'``
``U``      ``g w o [pg@s ...] [nw@s ...] [q@s ...]``           ``w' o' [nw:r ...]``
``BU``     ``w x R [d] [g] [w_newest] o``                      ``w' o' [e]``
``FB``     ``w st x key t [g]``                                ``loss st' g' [e]``
``FBU``    ``w st x key t [g] [w_newest] o``                   ``loss st' w' o' [e]``
``SQ``     ``g [pg@s ...]``                                    ``q``
``TG``     ``g``                                               ``pg:o`` per owner ``o``
``MOVE``   a value on stage ``s``                              the same on stage ``peer``
``SEND``   a value on stage ``s`` (this process holds it)      (nothing)
``RECV``   (nothing: the value comes from stage ``s``)         the value on stage ``peer``
``LOSS``   ``loss{k}``                                         (calls ``on_loss``)
``WAIT``   ``loss{k}``                                         (blocks until it is computed)
``SYNC``   the outputs of the operation before                 (blocks: one at a time)
``GATHER`` ``r`` pieces, each on its device of stage ``s``     the group value
``PART``   a group value                                       its ``r`` pieces
=========  ==================================================  ===========================

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

from pdjax.errors import PipelineError
from pdjax.pipeline.schedules import STREAMING, Action, Schedule

__all__ = ["Op", "Placement", "Program", "StagePlace", "lower"]

_COMPUTE = ("F", "B", "I", "W", "U", "BU", "FB", "FBU", "SQ", "TG", "KEYS")
_TRANSPORTS = ("device_put", "collective")


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


def lower(
    schedule: Schedule,
    placement: Placement,
    *,
    remat: bool | Sequence[bool] = False,
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
      schedule: a schedule that passed :func:`~pdjax.pipeline.schedules.validate`.
      placement: where each stage lives; ``placement.stages[s]`` for stage ``s``.
      remat: every stage recomputes its forward in its backward (keeps no residuals), or
        per stage, one flag each.
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
    holders = tuple(tuple(sorted(set(h))) for h in tied)
    for h in holders:
        if len(h) < 2 or not all(0 <= t < S for t in h):
            raise PipelineError(f"a tied group's stages {h} must be at least two of 0..{S - 1}")
    if holders and not _updates_in_lockstep(schedule):
        raise PipelineError(
            f"tied parameters across stages need every stage to update once per step; "
            f"{schedule.name} does not"
        )
    flags = (bool(remat),) * S if isinstance(remat, bool) else tuple(bool(r) for r in remat)
    if len(flags) != S:
        raise PipelineError(f"remat gives {len(flags)} flags for {S} stages; give one per stage")
    ops = _global_ops(schedule, placement, flags, fuse, coupled, run_ahead, on_loss, holders)
    ops = _in_dependency_order(ops, _caller_slots(schedule))
    if one_at_a_time is not None:
        ops = _one_at_a_time(ops, one_at_a_time)
    if donate_weights:
        ops = _donate_dropped_weights(ops, schedule)
    peak = _peak_versions(ops, S)
    per_process, inputs, outputs = [], [], []
    for p in range(placement.num_processes):
        mine = [op for op in ops if _runs_on(op, p, placement)]
        mine = [_for_process(op, p, placement) for op in mine]
        ins = tuple(
            slot for slot in _caller_slots(schedule) if _holds(slot, p, placement, schedule)
        )
        outs = tuple(
            slot for slot in _final_slots(ops, schedule) if _holds(slot, p, placement, schedule)
        )
        per_process.append(tuple(_with_frees(mine, set(outs))))
        inputs.append(ins)
        outputs.append(outs)
    return Program(
        schedule=schedule.name,
        num_microbatches=schedule.num_microbatches,
        ops=tuple(per_process),
        inputs=tuple(inputs),
        outputs=tuple(outputs),
        peak_versions=peak,
        actions=sum(len(g) for g in schedule.actions),
        updates=tuple(
            sum(a.kind == "U" and a.stage == s for g in schedule.actions for a in g)
            for s in range(S)
        ),
    )


# ----------------------------------------------------------------------------- the ops


def _check_transport(placement: Placement) -> None:
    if placement.transport not in _TRANSPORTS:
        raise PipelineError(
            f"unknown transport {placement.transport!r}; choose one of {_TRANSPORTS}"
        )
    used = sorted({p for st in placement.stages for p in st.processes})
    if placement.transport == "device_put" and placement.platform == "cpu" and len(used) > 2:
        raise PipelineError(
            f"this pipeline spans {len(used)} processes ({used}) and moves values between "
            "them with jax.device_put, which on CPU pairs sends and receives per sender (a "
            "process sending to two others hangs one of them); use transport='collective' "
            "(an XLA collective per link) or at most 2 processes"
        )


def _updates_in_lockstep(schedule: Schedule) -> bool:
    """Whether the stages update together, once per step each (flush schedules): update
    ``u`` of one stage then goes with update ``u`` of every other."""
    if schedule.name in STREAMING:
        return False
    counts = {
        sum(a.kind == "U" and a.stage == s for g in schedule.actions for a in g)
        for s in range(schedule.num_stages)
    }
    return len(counts) == 1


def _caller_slots(schedule: Schedule) -> list[str]:
    """The slots the caller fills: every stage's weights, optimizer and model state and
    PRNG key, the microbatch offset, the inputs (stage 0) and the targets (last stage)."""
    S, N = schedule.num_stages, schedule.num_microbatches
    slots = ["offset"]
    for s in range(S):
        slots += [f"w{s}v0", f"o{s}v0", f"st{s}", f"rng{s}"]
    first, last = schedule.group_size(0), schedule.group_size(S - 1)
    xs = [f"mx0.{k}" for k in range(0, N, first)] if first > 1 else [f"x0.{k}" for k in range(N)]
    ts = [f"mt{S - 1}.{k}" for k in range(0, N, last)] if last > 1 else [f"t{k}" for k in range(N)]
    return slots + xs + ts


def _global_ops(
    schedule: Schedule,
    placement: Placement,
    remat: Sequence[bool],
    fuse: bool,
    coupled: bool,
    run_ahead: int | None,
    on_loss: bool,
    tied: Sequence[tuple[int, ...]] = (),
) -> list[Op]:
    """The operations of every process, in the schedule's unit-time clock order."""
    S, N = schedule.num_stages, schedule.num_microbatches
    # tied groups across stages: per stage, the owners it sends gradients to (and gets new
    # values from), and the holders of the groups it owns (the other way round)
    owners = [sorted({h[0] for h in tied if s in h[1:]}) for s in range(S)]
    members = [sorted({r for h in tied if h[0] == s for r in h[1:]}) for s in range(S)]
    # an update that waits for other stages' values is not fused with a backward
    unfused = [coupled or bool(owners[s] or members[s]) for s in range(S)]
    last = S - 1
    n_of = [schedule.group_size(s) for s in range(S)]
    rr = [n > 1 for n in n_of]
    order = sorted(
        (tick, g, i) for g, ticks in enumerate(schedule.clock()) for i, tick in enumerate(ticks)
    )
    backward_version = {
        (a.stage, a.mb): a.version for g in schedule.actions for a in g if a.kind in "BI"
    }
    latest = [0] * S
    state = [f"st{s}" for s in range(S)]
    state_before: dict[tuple[int, int], str] = {}
    forward_version: dict[tuple[int, int], int] = {}
    acc: list[str | None] = [None] * S
    updates = [0] * S
    ops: list[Op] = [
        Op(
            "KEYS",
            s,
            outs=tuple(f"mkey{s}.{k}" if rr[s] else f"key{s}.{k}" for k in range(0, N, n_of[s])),
            ins=(f"rng{s}", "offset"),
        )
        for s in range(S)
    ]
    skip: set[tuple[int, int]] = set()  # (group, index) of actions fused into an earlier op

    def name(prefix: str, s: int, k: int) -> str:
        """A stage's slot for microbatch ``k`` (a round-robin stage's: the group's)."""
        return f"m{prefix}{s}.{k}" if rr[s] else f"{prefix}{s}.{k}"

    def target(s: int, k: int) -> str:
        return f"mt{s}.{k}" if rr[s] else f"t{k}"

    def loss_slot(s: int, k: int) -> str:
        return f"mloss{s}.{k}" if rr[s] else f"loss{k}"

    def moved(
        slot_from: str, slot_to: str, src: int, dst: int, mb: int, part: bool = True
    ) -> list[Op]:
        sp, dp = (mb % n_of[t] if part and rr[t] else -1 for t in (src, dst))
        return [Op("MOVE", src, mb, ins=(slot_from,), outs=(slot_to,), peer=dst, part=(sp, dp))]

    def gathered(prefix: str, s: int, k: int) -> list[Op]:
        """A round-robin stage's group value from the pieces on its devices."""
        if not rr[s]:
            return []
        pieces = tuple(f"{prefix}{s}.{j}" for j in range(k, k + n_of[s]))
        return [Op("GATHER", s, k, ins=pieces, outs=(f"m{prefix}{s}.{k}",))]

    def parted(slot: str, s: int, k: int, pieces: list[str]) -> list[Op]:
        return [Op("PART", s, k, ins=(slot,), outs=tuple(pieces))] if rr[s] else []

    def covered(s: int, k: int) -> range:
        return range(k, k + n_of[s])

    def sent_back(s: int, k: int) -> list[Op]:
        """The input gradient of stage ``s > 0`` to stage ``s - 1``, piece by piece."""
        out = parted(f"me{s}.{k}", s, k, [f"e{s}.{j}" for j in covered(s, k)])
        for j in covered(s, k):
            out += moved(f"e{s}.{j}", f"d{s - 1}.{j}", s, s - 1, j)
        return out

    def losses(s: int, k: int) -> list[Op]:
        out = parted(f"mloss{s}.{k}", s, k, [f"loss{j}" for j in covered(s, k)])
        for j in covered(s, k):
            out += loss_ops(j)
        return out

    def residual_args(s: int, k: int, recompute: bool) -> tuple[str, ...]:
        if recompute:
            extra = (target(s, k),) if s == last else ()
            return (state_before[(s, k)], name("key", s, k), *extra)
        return (f"r{s}.{k}",)

    def update_tail(s: int, read_version: int) -> tuple[tuple[str, ...], frozenset[str]]:
        """(extra inputs, flags) of a fused update after a backward at ``read_version``."""
        n = latest[s]
        if read_version == n:
            return (f"o{s}v{n}",), frozenset({"newest"})
        return (f"w{s}v{n}", f"o{s}v{n}"), frozenset()

    def after_update(s: int) -> tuple[str, str]:
        latest[s] += 1
        updates[s] += 1
        acc[s] = None
        return f"w{s}v{latest[s]}", f"o{s}v{latest[s]}"

    def loss_ops(k: int) -> list[Op]:
        out = []
        if on_loss:
            out.append(Op("LOSS", last, k, ins=(f"loss{k}",)))
        if run_ahead is not None and k - run_ahead >= 0:
            out.append(Op("WAIT", last, k - run_ahead, ins=(f"loss{k - run_ahead}",)))
        return out

    for _, g, i in order:
        if (g, i) in skip:
            continue
        acts = schedule.actions[g]
        a = acts[i]
        s, k, v = a.stage, a.mb, a.version
        nxt = acts[i + 1] if i + 1 < len(acts) else None
        nxt2 = acts[i + 2] if i + 2 < len(acts) else None
        w = f"w{s}v{v}"
        if a.kind == "F":
            forward_version[(s, k)] = v
            state_before[(s, k)] = state[s]
            new_state = f"st{s}.{k}"
            x = name("x", s, k)
            key = name("key", s, k)
            if s > 0:
                ops += gathered("x", s, k)
            if (
                s == last
                and fuse
                and nxt is not None
                and nxt.kind == "B"
                and (nxt.stage, nxt.mb, nxt.version) == (s, k, v)
            ):
                skip.add((g, i + 1))
                g_in = (acc[s],) if acc[s] else ()
                flags = {"acc"} if acc[s] else set()
                e = () if s == 0 else (name("e", s, k),)
                if not unfused[s] and nxt2 is not None and nxt2.kind == "U" and nxt2.stage == s:
                    skip.add((g, i + 2))
                    tail, more = update_tail(s, v)
                    w2, o2 = after_update(s)
                    ops.append(
                        Op(
                            "FBU",
                            s,
                            k,
                            v,
                            frozenset(flags | more),
                            (w, state[s], x, key, target(s, k), *g_in, *tail),
                            (loss_slot(s, k), new_state, w2, o2, *e),
                            actions=(a, nxt, nxt2),
                        )
                    )
                else:
                    acc[s] = gsum = f"g{s}.{k}"
                    ops.append(
                        Op(
                            "FB",
                            s,
                            k,
                            v,
                            frozenset(flags),
                            (w, state[s], x, key, target(s, k), *g_in),
                            (loss_slot(s, k), new_state, gsum, *e),
                            actions=(a, nxt),
                        )
                    )
                state[s] = new_state
                ops += losses(s, k) if rr[s] else loss_ops(k)
                if s > 0:
                    ops += sent_back(s, k)
                continue
            recompute = remat[s] or backward_version[(s, k)] != v
            out = loss_slot(s, k) if s == last else name("y", s, k)
            tgt = (target(s, k),) if s == last else ()
            res = () if recompute else (f"r{s}.{k}",)
            ops.append(
                Op(
                    "F",
                    s,
                    k,
                    v,
                    frozenset({"recompute"}) if recompute else frozenset(),
                    (w, state[s], x, key, *tgt),
                    (out, new_state, *res),
                    actions=(a,),
                )
            )
            state[s] = new_state
            if s == last:
                ops += losses(s, k) if rr[s] else loss_ops(k)
            else:
                ops += parted(out, s, k, [f"y{s}.{j}" for j in covered(s, k)])
                for j in covered(s, k):
                    ops += moved(f"y{s}.{j}", f"x{s + 1}.{j}", s, s + 1, j)
        elif a.kind in ("B", "I", "W"):
            recompute = remat[s] or forward_version[(s, k)] != v
            flags = {"recompute"} if recompute else set()
            x = name("x", s, k)
            R = residual_args(s, k, recompute)
            d = () if s == last else (name("d", s, k),)
            e = () if s == 0 else (name("e", s, k),)
            if s < last:
                ops += gathered("d", s, k)
            if a.kind == "I":
                ops.append(
                    Op(
                        "I",
                        s,
                        k,
                        v,
                        frozenset(flags),
                        (w, x, *R, *d),
                        (*e, f"c{s}.{k}"),
                        actions=(a,),
                    )
                )
            else:
                g_in = (acc[s],) if acc[s] else ()
                if acc[s]:
                    flags.add("acc")
                if a.kind == "W":
                    acc[s] = gsum = f"g{s}.{k}"
                    ops.append(
                        Op(
                            "W",
                            s,
                            k,
                            v,
                            frozenset(flags),
                            (w, x, *R, f"c{s}.{k}", *g_in),
                            (gsum,),
                            actions=(a,),
                        )
                    )
                    continue
                if (
                    fuse
                    and not unfused[s]
                    and nxt is not None
                    and nxt.kind == "U"
                    and nxt.stage == s
                ):
                    skip.add((g, i + 1))
                    tail, more = update_tail(s, v)
                    w2, o2 = after_update(s)
                    ops.append(
                        Op(
                            "BU",
                            s,
                            k,
                            v,
                            frozenset(flags | more),
                            (w, x, *R, *d, *g_in, *tail),
                            (w2, o2, *e),
                            actions=(a, nxt),
                        )
                    )
                else:
                    acc[s] = gsum = f"g{s}.{k}"
                    ops.append(
                        Op(
                            "B",
                            s,
                            k,
                            v,
                            frozenset(flags),
                            (w, x, *R, *d, *g_in),
                            (gsum, *e),
                            actions=(a,),
                        )
                    )
            if a.kind != "W" and s > 0:
                ops += sent_back(s, k)
        else:  # U
            if v != latest[s]:
                raise PipelineError(
                    f"{a.describe()} expects version {v}, stage {s} is at {latest[s]}"
                )
            grads = acc[s]
            if grads is None:
                raise PipelineError(f"{a.describe()} has no gradient to apply")
            n = latest[s]
            u = updates[s]
            if owners[s]:  # this stage's tied gradients, to each owner of a group it holds
                sums = tuple(f"pg{s}.{u}:{o}" for o in owners[s])
                ops.append(Op("TG", s, u, ins=(grads,), outs=sums))
                for o in owners[s]:
                    ops += moved(f"pg{s}.{u}:{o}", f"pg{s}.{u}@{o}", s, o, u, part=False)
            tied_in = tuple(f"pg{r}.{u}@{s}" for r in members[s])
            new_in = tuple(f"nw{o}.{u}:{s}@{s}" for o in owners[s])
            norms: tuple[str, ...] = ()
            if coupled:
                # every stage's sum of squares for this update, on this stage's devices
                norms = tuple(f"q{r}.{u}@{s}" for r in range(S) if r != s)
                ops.append(Op("SQ", s, u, ins=(grads, *tied_in), outs=(f"q{s}.{u}",)))
                for r in range(S):
                    if r != s:
                        ops += moved(f"q{s}.{u}", f"q{s}.{u}@{r}", s, r, u, part=False)
            w2, o2 = after_update(s)
            sent = tuple(f"nw{s}.{u}:{r}" for r in members[s])
            ops.append(
                Op(
                    "U",
                    s,
                    a.mb,
                    n,
                    frozenset(),
                    (grads, f"w{s}v{n}", f"o{s}v{n}", *tied_in, *new_in, *norms),
                    (w2, o2, *sent),
                    actions=(a,),
                )
            )
            for r in members[s]:
                ops += moved(f"nw{s}.{u}:{r}", f"nw{s}.{u}:{r}@{r}", s, r, u, part=False)
    return ops


def _in_dependency_order(ops: list[Op], given: Sequence[str]) -> list[Op]:
    """``ops`` reordered, as little as possible, so that every slot is written before it
    is read (needed only when updates wait for every stage's sum of squares)."""
    writer: dict[str, int] = {}
    for i, op in enumerate(ops):
        for slot in op.outs:
            if slot in writer:
                raise PipelineError(f"slot {slot} is written twice ({ops[writer[slot]]}, {op})")
            writer[slot] = i
    have = set(given)
    waiting: dict[str, list[int]] = {}
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
        if op.kind in _COMPUTE and op.kind != "KEYS" and stages[op.stage] and op.outs:
            out.append(Op("SYNC", op.stage, op.mb, ins=op.outs))
    return out


def _donate_dropped_weights(ops: list[Op], schedule: Schedule) -> list[Op]:
    """Marks fused updates whose newest weights nothing reads later (``donate_w``): their
    buffers are reused for the new version. Where a gradient sum comes in (``U``, and
    ``acc``) it is donated already and takes the new version's place, so donating the
    weights too would leave buffers XLA cannot use. The caller's version 0 is never
    donated (the caller may still hold it)."""
    last_read: dict[str, int] = {}
    for i, op in enumerate(ops):
        for slot in op.ins:
            last_read[slot] = i
    out = []
    for i, op in enumerate(ops):
        if op.kind in ("BU", "FBU") and "acc" not in op.flags:
            made = next(x for x in op.outs if x.startswith(f"w{op.stage}v"))
            n = int(made.split("v")[-1]) - 1
            newest = f"w{op.stage}v{n}"
            if n > 0 and last_read.get(newest) == i:
                op = dataclasses.replace(op, flags=op.flags | {"donate_w"})
        out.append(op)
    del schedule
    return out


def _peak_versions(ops: list[Op], S: int) -> tuple[int, ...]:
    """Per stage, the most weight versions alive after any operation (a version stays
    alive while it is the newest or a later operation reads it)."""
    last_read: dict[str, int] = {}
    for i, op in enumerate(ops):
        for slot in op.ins:
            last_read[slot] = i
    alive: list[dict[str, int]] = [{f"w{s}v0": 0} for s in range(S)]
    peak = [1] * S
    for i, op in enumerate(ops):
        for slot in op.outs:
            if _is_weights(slot):
                s, n = (int(x) for x in slot[1:].split("v"))
                alive[s][slot] = n
        for s in range(S):
            newest = max(alive[s].values())
            alive[s] = {
                x: n for x, n in alive[s].items() if n == newest or last_read.get(x, -1) > i
            }
            peak[s] = max(peak[s], len(alive[s]))
    return tuple(peak)


def _is_weights(slot: str) -> bool:
    return slot.startswith("w") and "v" in slot


def _final_slots(ops: list[Op], schedule: Schedule) -> list[str]:
    S = schedule.num_stages
    written = [o for op in ops for o in op.outs]
    out = []
    for s in range(S):
        for prefix in (f"w{s}v", f"o{s}v"):
            versions = [int(x[len(prefix) :]) for x in written if x.startswith(prefix)]
            out.append(f"{prefix}{max(versions, default=0)}")
        states = [x for x in written if x.startswith(f"st{s}.")]
        out.append(states[-1] if states else f"st{s}")
    out += [f"loss{k}" for k in range(schedule.num_microbatches)]
    return out


# ----------------------------------------------------------------------------- processes


def _stage_of(slot: str, schedule: Schedule) -> int:
    """The stage whose devices hold ``slot``."""
    if slot.startswith(("loss", "t")) and not slot.startswith("st"):
        return schedule.num_stages - 1
    if "@" in slot:
        return int(slot.split("@")[1])
    head = slot.lstrip("abcdefghijklmnopqrstuvwxyz")
    return int(head.split(".")[0].split("v")[0])


def _holds(slot: str, p: int, placement: Placement, schedule: Schedule) -> bool:
    if slot == "offset":
        return True
    return p in placement.stages[_stage_of(slot, schedule)].processes


def _runs_on(op: Op, p: int, placement: Placement) -> bool:
    if op.kind == "MOVE":
        return p in placement.stages[op.stage].processes or p in placement.stages[op.peer].processes
    return p in placement.stages[op.stage].processes


def _for_process(op: Op, p: int, placement: Placement) -> Op:
    """A transfer as process ``p`` sees it: a ``MOVE`` when it holds both ends alone, or
    when both stages are on the same devices (two chunks of one device group, as
    ``interleaved`` with one group and ``zb-v``'s turn: every process already holds its
    part, the value only changes slot); a ``SEND`` and/or ``RECV`` otherwise (a stage
    spanning processes takes part on both)."""
    if op.kind != "MOVE":
        return op
    here, there = placement.stages[op.stage], placement.stages[op.peer]
    src, dst = here.processes, there.processes
    if src == dst == (p,) or here.devices == there.devices:
        return op
    if p in src and p in dst:
        return dataclasses.replace(op, kind="SENDRECV")
    if p in src:
        return dataclasses.replace(op, kind="SEND", outs=())
    return dataclasses.replace(op, kind="RECV", ins=())


def _with_frees(ops: list[Op], keep: set[str]) -> list[Op]:
    """Each op with the slots it reads for the last time (or writes and nothing reads)."""
    last: dict[str, int] = {}
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
