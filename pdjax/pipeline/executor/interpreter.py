"""The interpreter of lowered programs. :func:`bind` turns this process's operations of a
:class:`~pdjax.pipeline.lowering.Program` into :class:`Code`: each operation one function
(a stage program, a transfer of the pipeline's :mod:`~pdjax.pipeline.transport`, a wait)
with the registers it reads, writes and drops, chosen by the operation's
:class:`~pdjax.pipeline.lowering.OpKind` and its slots'
:class:`~pdjax.pipeline.lowering.SlotKind`. :func:`interpret` then only calls them in order
on a register file; it keeps nothing between calls (the call's ``on_loss`` callback sits in
a register of its own)."""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from pdjax.errors import PipelineError
from pdjax.layers import PyTree
from pdjax.pipeline.executor.trees import loss_of, shape_key
from pdjax.pipeline.lowering import Op, OpKind, Program, Slot, SlotKind
from pdjax.pipeline.stage import Stage
from pdjax.pipeline.transport import Transport
from pdjax.schedules import Schedule
from pdjax.schedules.timeline import Span

__all__ = ["Code", "bind", "interpret", "interpret_counting", "interpret_recording"]

Step = tuple[Callable[..., Any], tuple[int, ...], tuple[int, ...], tuple[int, ...]]
"""One bound operation: ``(function, input registers, output registers, registers to
drop after it)``; the function takes the inputs and returns a tuple of the outputs."""


@dataclasses.dataclass(frozen=True)
class Code:
    """A program bound for this process.

    Attributes:
      program: the lowered program.
      ops: this process's operations (``program.ops[process]``).
      steps: per operation, its ``Step`` (one bound operation).
      slots: the register of every slot.
      callback: the register of the call's ``on_loss`` callback (read by ``LOSS``).
    """

    program: Program
    ops: tuple[Op, ...]
    steps: tuple[Step, ...]
    slots: Mapping[Slot, int]
    callback: int

    def registers(self) -> list[Any]:
        """An empty register file for one call."""
        return [None] * (len(self.slots) + 1)


def bind(
    prog: Program,
    process: int,
    stages: Sequence[Stage],
    transport: Transport,
    specs: Sequence[Any] | None,
) -> Code:
    """``prog``'s operations of ``process`` bound to functions (see the module).

    Args:
      prog: the lowered program.
      process: this process.
      stages: the pipeline's stages.
      transport: what moves values between stages.
      specs: across processes, the shapes of every stage's output but the last's (what a
        transfer receives); None within a process.
    """
    ops = prog.ops[process]
    slots: dict[Slot, int] = {}
    for name in prog.inputs[process]:
        slots.setdefault(name, len(slots))
    for op in ops:
        for name in (*op.ins, *op.outs):
            slots.setdefault(name, len(slots))
    callback = len(slots)
    steps = []
    for op in ops:
        fn = _function(op, prog, stages, transport, specs)
        ins = tuple(slots[n] for n in op.ins)
        if op.kind is OpKind.LOSS:
            ins = (callback, *ins)
        steps.append((fn, ins, tuple(slots[n] for n in op.outs), tuple(slots[n] for n in op.frees)))
    return Code(prog, ops, tuple(steps), slots, callback)


def _function(
    op: Op, prog: Program, stages: Sequence[Stage], transport: Transport, specs: Any
) -> Callable[..., Any]:
    """What the interpreter calls for ``op``: always ``fn(*inputs) -> outputs``."""
    kind = op.kind
    if kind is OpKind.GATHER:
        return partial(gather, stages[op.stage])
    if kind is OpKind.PART:
        return partial(part, stages[op.stage], op.outs[0].kind is SlotKind.LOSS)
    if kind is OpKind.MOVE and op.part != (-1, -1):
        return transport.piece(stages[op.stage], stages[op.peer], op.part)
    if kind in (OpKind.MOVE, OpKind.SEND, OpKind.RECV, OpKind.SENDRECV):
        return _transfer(op, stages, transport, specs)
    if kind is OpKind.LOSS:  # the call's callback, from its register
        return partial(_report_loss, op.mb)
    if kind in (OpKind.WAIT, OpKind.SYNC):
        return _wait
    prog_fn = stages[op.stage].program(kind, op.flags)
    if kind is OpKind.KEYS:
        n = prog.num_microbatches
        return lambda rng, offset: prog_fn(rng, offset, n)
    return prog_fn


def _transfer(
    op: Op, stages: Sequence[Stage], transport: Transport, specs: Any
) -> Callable[..., Any]:
    """A ``MOVE``, ``SEND``, ``RECV`` or ``SENDRECV`` of the value in its slot."""
    kind = op.kind
    src, dst = stages[op.stage], stages[op.peer]
    slot = op.ins[0] if op.ins else op.outs[0]
    scalar = slot.kind is SlotKind.SQUARES
    if slot.kind in (SlotKind.TIED_GRADS, SlotKind.TIED_VALUES):  # the weights' layout
        if kind is not OpKind.MOVE:
            raise PipelineError("tied parameters across processes are not supported")
        return transport.link(src, dst, None, replicated=True)
    spec: Any
    if scalar:
        # jax leaves ShapeDtypeStruct.__init__ unannotated
        spec = jax.ShapeDtypeStruct((), jnp.float32)
    elif specs is None:
        spec = None
    else:  # forward: stage op.stage's output; backward: stage op.peer's output
        spec = specs[min(op.stage, op.peer)]
    link = transport.link(src, dst, spec, replicated=scalar)
    if kind is OpKind.MOVE:  # within this process: returns a 1-tuple
        return link
    transport.connect(src, dst, replicated=scalar)
    if kind is OpKind.SEND:
        return lambda v: (link(v), ())[1]
    if kind is OpKind.RECV:
        return lambda: (link(None),)
    return lambda v: (link(v),)


def _report_loss(k: int, on_loss: Callable[[int, jax.Array], None], loss: Any) -> tuple[()]:
    """A ``LOSS`` operation: hands microbatch ``k``'s loss to the call's callback."""
    on_loss(k, loss_of(loss))
    return ()


def interpret(
    code: Code, reg: list[Any], on_loss: Callable[[int, jax.Array], None] | None = None
) -> None:
    """Runs bound ``code`` on the register file ``reg`` (inputs filled): each operation
    reads its registers, writes its results and drops what nothing reads later.
    Everything else was decided by the lowering."""
    reg[code.callback] = on_loss
    for fn, ins, outs, frees in code.steps:
        res = fn(*[reg[i] for i in ins])
        for i, v in zip(outs, res):  # noqa: B905 (lengths fixed by the lowering)
            reg[i] = v
        for i in frees:
            reg[i] = None


def interpret_recording(
    code: Code,
    reg: list[Any],
    sched: Schedule,
    stages: Sequence[Stage],
    on_loss: Callable[[int, jax.Array], None] | None = None,
) -> tuple[list[Span], list[int]]:
    """:func:`interpret`, waiting for each operation and recording its span and the
    live bytes per device group (a diagnostic: the devices do not overlap)."""
    reg[code.callback] = on_loss
    group_of_device = {d: sched.stage_device[s] for s, st in enumerate(stages) for d in st.devices}
    peaks = [0] * sched.num_groups
    spans: list[Span] = []
    origin = time.perf_counter()
    for op, (fn, ins, outs, frees) in zip(code.ops, code.steps, strict=True):
        t0 = time.perf_counter()
        res = fn(*[reg[i] for i in ins])
        jax.block_until_ready(res)
        for i, v in zip(outs, res, strict=True):
            reg[i] = v
        for i in frees:
            reg[i] = None
        t1 = time.perf_counter()
        for a in op.actions:
            spans.append(Span(sched.stage_device[a.stage], t0 - origin, t1 - origin, a))
        _track_live_bytes(peaks, group_of_device)
    return spans, peaks


def live_bytes_per_device(arrays: Sequence[Any] | None = None) -> dict[jax.Device, int]:
    """Bytes of the live arrays (default: ``jax.live_arrays()``) per device, each buffer
    once. ``jax.live_arrays()`` also lists the per-device arrays that reading an array's
    ``addressable_shards`` makes (and caches on it), which share its buffers: those are
    left out, and a one-device array is counted as itself (reading its shards would make
    another such array). Nothing here waits for a computation to finish."""
    listed = [
        a
        for a in (jax.live_arrays() if arrays is None else arrays)
        if isinstance(a, jax.Array) and not a.is_deleted()
    ]
    per_device: dict[jax.Device, int] = {}
    parts: set[int] = set()
    for a in listed:
        if len(a.sharding.device_set) > 1:
            for shard in a.addressable_shards:
                parts.add(id(shard.data))
                per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    for a in listed:
        if len(a.sharding.device_set) > 1 or id(a) in parts:
            continue
        device = next(iter(a.sharding.device_set))
        per_device[device] = per_device.get(device, 0) + a.nbytes
    return per_device


def _track_live_bytes(peaks: list[int], group_of_device: Mapping[jax.Device, int]) -> None:
    """Raises ``peaks[g]`` to the live bytes of the fullest device of each group ``g``
    (:func:`live_bytes_per_device`)."""
    for device, used in live_bytes_per_device().items():
        g = group_of_device.get(device)
        if g is not None and used > peaks[g]:
            peaks[g] = used


_ALL_REDUCE = re.compile(r"\ball-reduce(?:-start)?\(")


def interpret_counting(
    code: Code, reg: list[Any], on_loss: Callable[[int, jax.Array], None] | None = None
) -> dict[str, int]:
    """:func:`interpret`, counting per operation kind the all-reduces in the compiled
    program each operation runs (each distinct program and argument shapes compiled once
    more, to read its HLO)."""
    reg[code.callback] = on_loss
    counts: dict[str, int] = {}
    texts: dict[Any, int] = {}
    for op, (fn, ins, outs, frees) in zip(code.ops, code.steps, strict=True):
        args = [reg[i] for i in ins]
        if hasattr(fn, "lower"):
            key = (id(fn), shape_key(args))
            if key not in texts:
                texts[key] = len(_ALL_REDUCE.findall(fn.lower(*args).compile().as_text()))
            kind = op.kind.value
            counts[kind] = counts.get(kind, 0) + texts[key]
        res = fn(*args)
        for i, v in zip(outs, res, strict=True):
            reg[i] = v
        for i in frees:
            reg[i] = None
    return counts


def gather(stage: Stage, *pieces: PyTree) -> tuple[PyTree]:
    """A round-robin group from its microbatches, each already on its device (piece ``d``
    on device ``d``): one array per leaf, sharded over the stage's devices, no copy."""
    leaves = [jax.tree.leaves(p) for p in pieces]
    treedef = jax.tree.structure(pieces[0])
    out = []
    for parts in zip(*leaves, strict=True):
        shape = (sum(a.shape[0] for a in parts), *parts[0].shape[1:])
        out.append(jax.make_array_from_single_device_arrays(shape, stage.batch_sharding, parts))
    return (jax.tree.unflatten(treedef, out),)


def part(stage: Stage, scalars: bool, group: PyTree) -> tuple[PyTree, ...]:
    """A round-robin group's value as one piece per microbatch, each on its own device (no
    copy); ``scalars``: the group's losses, one scalar per microbatch."""
    leaves, treedef = jax.tree.flatten(group)
    per_device = [{sh.device: sh.data for sh in a.addressable_shards} for a in leaves]
    out = []
    for d in stage.devices:
        parts = [m[d] for m in per_device]
        if scalars:  # each device's [1, ...] rows: its microbatch's loss (and aux)
            parts = [a.reshape(a.shape[1:]) for a in parts]
        out.append(jax.tree.unflatten(treedef, parts))
    return tuple(out)


def _wait(*values: Any) -> tuple[()]:
    jax.block_until_ready(values)
    return ()
