"""One training call of a pipeline: the caller's values into the registers of bound code
(:class:`Feeder`: weights, states, keys, the microbatches placed on their stages), the
interpreter over them, and the state, losses and metrics read back (:func:`execute`)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from functools import lru_cache
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pdjax import _xla_cpu
from pdjax._sharding import held
from pdjax.distributed import allgather_json
from pdjax.errors import PipelineError
from pdjax.layers import PyTree
from pdjax.pipeline.executor.forward import Forward
from pdjax.pipeline.executor.interpreter import (
    Code,
    interpret,
    interpret_counting,
    interpret_recording,
)
from pdjax.pipeline.executor.stages import StageSet
from pdjax.pipeline.executor.state import PipelineState, RunMetrics
from pdjax.pipeline.executor.trees import concat, loss_of
from pdjax.pipeline.lowering.types import OFFSET, Slot, SlotKind
from pdjax.pipeline.stage import Stage
from pdjax.pipeline.transport import Transport
from pdjax.schedules import Schedule
from pdjax.schedules.timeline import Timeline

__all__ = ["Feeder", "check_layouts", "execute"]


SPLIT_CHUNK = 64
"""Microbatches placed by one splitting program at most (:meth:`Feeder._place_microbatches`)."""


class Feeder:
    """The caller's values as the slots a program starts from, with what it keeps to
    place them fast: the caller's key on every stage (while it is the same object), and
    the programs that split a batch on a stage's devices."""

    def __init__(self, stage_set: StageSet) -> None:
        self.stage_set = stage_set
        self._rng: tuple[jax.Array, dict[Slot, jax.Array]] | None = None
        self._splitters: dict[Any, Any] = {}

    def inputs(
        self, state: PipelineState, microbatches: list[tuple[PyTree, PyTree]]
    ) -> dict[Slot, Any]:
        """The caller's slots: weights, states, per-stage PRNG keys (placed once per call,
        wherever the caller's key lives), the inputs and the targets (one transfer each)."""
        ss = self.stage_set
        check_layouts(ss, microbatches)
        last = ss.num_stages - 1
        values: dict[Slot, Any] = {OFFSET: np.int32(state.microbatches)}
        for s in range(ss.num_stages):
            if not ss.local[s]:
                continue
            # the last stage of a loss-scaled optimizer: the scale after its weights
            weights = ss.stages[s].weights_in(state.params[s], state.opt_state[s])
            values[Slot(SlotKind.WEIGHTS, s, 0)] = weights
            values[Slot(SlotKind.OPT, s, 0)] = state.opt_state[s]
            values[Slot(SlotKind.STATE, s)] = state.model_state[s]
        values.update(self._placed_rng(state.rng))
        for s, i, kind in ((0, 0, SlotKind.X), (last, 1, SlotKind.TARGET)):
            if not ss.local[s]:
                continue
            stage = ss.stages[s]
            trees = [mb[i] for mb in microbatches]
            if stage.round_robin:  # one array per group: microbatch k0 + d on device d
                r = stage.num_replicas
                groups = [concat(trees[k : k + r]) for k in range(0, len(trees), r)]
                placed = self._place_microbatches(stage, groups)
                values.update((Slot(kind, s, k * r, group=True), v) for k, v in enumerate(placed))
            else:
                placed = self._place_microbatches(stage, trees)
                values.update((Slot(kind, s, k), v) for k, v in enumerate(placed))
        return values

    def _placed_rng(self, rng: jax.Array) -> dict[Slot, jax.Array]:
        """The caller's key on every local stage's devices; kept while the caller's key is
        the same object (a state passes its key on), so a call moves it only when it is new."""
        cached = self._rng
        if cached is None or cached[0] is not rng:
            ss = self.stage_set
            placed = {
                Slot(SlotKind.RNG, s): stage.place_weights(rng)
                for s, stage in enumerate(ss.stages)
                if ss.local[s]
            }
            self._rng = cached = (rng, placed)
        return cached[1]

    def _place_microbatches(self, stage: Stage, trees: list[PyTree]) -> list[PyTree]:
        """Host microbatches (numpy) go over as one array per leaf and are split on the
        devices by one cached program: two dispatches, not one transfer per microbatch;
        in chunks of :data:`SPLIT_CHUNK` microbatches, since XLA's compile time of a
        splitter grows faster than its outputs (measured on CPU: 64 outputs 1.6 s, 256
        7 s, 1024 57 s; an epoch-long call of ``pdjax train`` has thousands). Chunks of
        equal rows share one program. Across processes, or for device arrays, the stage
        places them itself, all at once."""
        placed: list[PyTree]
        leaves = jax.tree.leaves(trees)
        if self.stage_set.multiprocess or not all(isinstance(a, np.ndarray) for a in leaves):
            placed = stage.place_batch(trees)
            return placed
        placed = []
        for run in _runs_alike(trees):  # microbatches of other lengths (buckets) apart
            for lo in range(0, len(run), SPLIT_CHUNK):
                placed.extend(self._place_chunk(stage, run[lo : lo + SPLIT_CHUNK]))
        return placed

    def _place_chunk(self, stage: Stage, trees: list[PyTree]) -> list[PyTree]:
        """:meth:`_place_microbatches` of at most :data:`SPLIT_CHUNK` host microbatches."""
        placed: list[PyTree]
        treedef = jax.tree.structure(trees[0])
        rows = [[np.shape(a)[0] for a in jax.tree.leaves(t)] for t in trees]
        key = (id(stage), treedef, len(trees), tuple(map(tuple, rows)))
        split = self._splitters.get(key)
        if split is None:
            if any(len(set(r)) != 1 for r in rows):
                placed = stage.place_batch(trees)
                return placed
            bounds = tuple(int(b) for b in np.cumsum([0, *(r[0] for r in rows)]))
            split = self._splitters[key] = _splitter(bounds, stage.batch_sharding)
        whole = jax.tree.map(lambda *a: np.concatenate(a), *trees)
        placed = split(jax.device_put(whole, stage.batch_sharding))
        return placed


def _past_rows(tree: PyTree) -> Any:
    """A hashable key of ``tree``'s structure and its leaves' shapes past the rows and
    dtypes: what microbatches must share to be stacked or concatenated (one bucket)."""
    leaves, treedef = jax.tree.flatten(tree)
    # a device array's own dtype (numpy reading a jax array's dtype is deprecated)
    dtypes = [np.dtype(a.dtype) if hasattr(a, "dtype") else np.result_type(a) for a in leaves]
    return treedef, tuple((np.shape(a)[1:], d) for a, d in zip(leaves, dtypes, strict=True))


def check_layouts(stage_set: StageSet, microbatches: list[tuple[PyTree, PyTree]]) -> None:
    """Refuses, before any device work, a call whose microbatches differ past the rows
    (sequence lengths of several buckets in one call) where the runtime needs them alike:
    across processes (the receiving side binds a call's transfers to the shapes of its
    first microbatch) and within a group of a round-robin stage (its ``r`` microbatches
    run as one array). Elsewhere a call may mix lengths: each microbatch runs the
    programs compiled for its shapes.

    Raises:
      PipelineError: naming the first microbatch that differs, and what to do.
    """
    groups = [st.num_replicas for st in stage_set.stages if st.round_robin]
    if not (stage_set.multiprocess or groups) or len(microbatches) < 2:
        return
    keys = [_past_rows(mb) for mb in microbatches]
    if stage_set.multiprocess:
        bad = next((k for k in range(1, len(keys)) if keys[k] != keys[0]), None)
        if bad is not None:
            raise PipelineError(
                f"microbatch {bad} has other shapes past the batch dimension than microbatch "
                "0 (another sequence length?): across processes every microbatch of a call "
                "must share its shapes; run one call per bucket (sequence length)"
            )
    for r in sorted(set(groups)):
        for k in range(0, len(keys) - r + 1, r):
            bad = next((j for j in range(k + 1, k + r) if keys[j] != keys[k]), None)
            if bad is not None:
                raise PipelineError(
                    f"microbatch {bad} has other shapes past the batch dimension than "
                    f"microbatch {k} (another sequence length?), but a round-robin stage "
                    f"runs each group of {r} consecutive microbatches as one array: order "
                    f"the stream so that each group of {r} shares one bucket, or run one "
                    "call per bucket"
                )


def _runs_alike(trees: list[PyTree]) -> list[list[PyTree]]:
    """``trees`` cut into runs of consecutive microbatches whose leaves agree past the
    rows (shape and dtype): only those concatenate into one array per leaf. A call of one
    bucket is one run; a stream that mixes sequence lengths is cut where the length
    changes, and each run is placed by the splitter of its own layout."""
    if len(trees) < 2 or _all_alike(trees):  # one bucket: no key per microbatch
        return [trees]
    runs: list[list[PyTree]] = []
    last: Any = None
    for t in trees:
        key = _past_rows(t)
        if not runs or key != last:
            runs.append([])
            last = key
        runs[-1].append(t)
    return runs


def _all_alike(trees: list[PyTree]) -> bool:
    """Whether every microbatch of ``trees`` has the first one's leaf shapes past the rows
    and dtypes, by a cheap check for microbatches that are arrays or flat tuples of arrays
    (anything else: False, and the caller keys each microbatch)."""

    def flat(t: Any) -> tuple[Any, ...] | None:
        items = t if isinstance(t, tuple) else (t,)
        return items if all(isinstance(a, np.ndarray | jax.Array) for a in items) else None

    first = flat(trees[0])
    if first is None:
        return False
    want = [(a.shape[1:], a.dtype) for a in first]
    for t in trees[1:]:
        items = t if isinstance(t, tuple) else (t,)
        if len(items) != len(want):
            return False
        for a, (shape, dtype) in zip(items, want, strict=True):
            if not isinstance(a, np.ndarray | jax.Array) or a.shape[1:] != shape:
                return False
            if a.dtype != dtype:
                return False
    return True


@lru_cache(maxsize=256)
def _splitter(bounds: tuple[int, ...], sharding: Any) -> Callable[..., Any]:
    """The program that cuts a batch (each leaf the microbatches concatenated) at
    ``bounds`` into microbatches placed by ``sharding``: it reads nothing of a pipeline,
    so every pipeline of the process feeding the same rows to the same devices shares
    it."""

    def cut(whole: PyTree) -> list[PyTree]:
        return [
            jax.tree.map(lambda a, lo=lo, hi=hi: a[lo:hi], whole)
            for lo, hi in itertools.pairwise(bounds)
        ]

    return jax.jit(cut, out_shardings=sharding)


def execute(
    code: Code,
    state: PipelineState,
    microbatches: list[tuple[PyTree, PyTree]],
    *,
    feeder: Feeder,
    forward: Forward,
    transport: Transport,
    workarounds: _xla_cpu.Workarounds,
    schedule: Schedule | None,
    on_loss: Callable[[int, jax.Array], None] | None = None,
    collectives: bool = False,
) -> tuple[PipelineState, RunMetrics]:
    """Runs ``code`` over ``microbatches`` from ``state``. ``schedule``: record each
    operation's span (the call's schedule, for the timeline; None: do not)."""
    ss = feeder.stage_set
    prog, slots = code.program, code.slots
    reg = code.registers()
    for name, value in feeder.inputs(state, microbatches).items():
        i = slots.get(name)
        if i is not None:
            reg[i] = value
    t0, c0 = time.perf_counter(), time.thread_time()
    all_reduces = None
    if schedule is not None:
        spans, peaks = interpret_recording(code, reg, schedule, ss.stages, on_loss)
    elif collectives:
        all_reduces = interpret_counting(code, reg, on_loss)
    else:
        interpret(code, reg, on_loss)
    host, host_cpu = time.perf_counter() - t0, time.thread_time() - c0
    transport.drain()  # the sender must outlive the transfer
    new_state = _new_state(code, ss, state, reg, len(microbatches))
    losses = _losses(code, forward, state, microbatches, reg)
    aux = [v[1] for v in losses] if losses and isinstance(losses[0], tuple) else None
    record = schedule is not None
    metrics = RunMetrics(
        losses=[loss_of(v) for v in losses],
        aux=aux,
        peak_versions=prog.peak_versions,
        actions=prog.actions,
        host_seconds=host,
        host_cpu_seconds=host_cpu,
        timeline=Timeline(prog.schedule, ss.num_groups, tuple(spans)) if record else None,
        peak_bytes=tuple(peaks) if record else None,
        ops=len(code.steps),
        workarounds=workarounds.reasons,
        all_reduces=all_reduces,
    )
    if ss.multiprocess:
        # Return drained everywhere: this process's results are computed (so what it
        # received has arrived) and so are every other process's (so what it sent has
        # been taken). A process that went on at once could enter an XLA collective
        # (data parallelism, a replicated stage) while a transfer its peer still needs
        # waits behind it.
        # jax leaves block_until_ready unannotated
        jax.block_until_ready([a for a in jax.tree.leaves((new_state, metrics.losses)) if held(a)])
        allgather_json("pipeline run drained")
    return new_state, metrics


def _new_state(
    code: Code, ss: StageSet, state: PipelineState, reg: list[Any], num_microbatches: int
) -> PipelineState:
    """The state after a call: the program's outputs where it has them (the weights,
    optimizer and model state of this process's stages), ``state``'s elsewhere."""
    prog = code.program
    found: dict[tuple[SlotKind, int], Any] = {}
    for out in prog.outputs[ss.process_index]:
        if out.kind in (SlotKind.WEIGHTS, SlotKind.OPT, SlotKind.STATE) and out in code.slots:
            found.setdefault((out.kind, out.stage), reg[code.slots[out]])

    def value(s: int, field: str, kind: SlotKind) -> Any:
        key = (kind, s)
        return found[key] if key in found else getattr(state, field)[s]

    stages = range(ss.num_stages)

    def params(s: int) -> Any:
        w = value(s, "params", SlotKind.WEIGHTS)
        return ss.stages[s].weights_out(w) if (SlotKind.WEIGHTS, s) in found else w

    return PipelineState(
        params=tuple(params(s) for s in stages),
        model_state=tuple(value(s, "model_state", SlotKind.STATE) for s in stages),
        opt_state=tuple(value(s, "opt_state", SlotKind.OPT) for s in stages),
        updates=tuple(u + n for u, n in zip(state.updates, prog.updates, strict=True)),
        microbatches=state.microbatches + num_microbatches,
        rng=state.rng,
    )


def _losses(
    code: Code,
    forward: Forward,
    state: PipelineState,
    microbatches: list[tuple[PyTree, PyTree]],
    reg: list[Any],
) -> list[Any]:
    """Per microbatch, what the last stage's forward left: its loss, or ``(loss,
    aux)``; across processes broadcast from the last stage's processes to all."""
    ss = forward.stage_set
    N, last = len(microbatches), ss.num_stages - 1
    if ss.local[last]:
        losses: list[Any] = [reg[code.slots[Slot(SlotKind.LOSS, last, k)]] for k in range(N)]
    else:
        losses = [None] * N
    if ss.multiprocess:  # the losses live on the last stage's processes
        # stacked, so that they cross as one array per leaf of a microbatch's loss (and
        # aux), not one per microbatch: 24 scalar transfers cost the first stage's
        # driver about 10 ms per call on the cluster benchmark's workers
        if ss.local[last]:
            stacked = _stacker(N)(losses)
        else:  # their shapes: the loss and any aux of a microbatch, N of them
            spec = forward.loss_spec(state, microbatches[0])
            stacked = jax.tree.map(lambda a: jax.ShapeDtypeStruct((N, *a.shape), a.dtype), spec)
        stacked = forward.broadcast(last, stacked)
        if not ss.local[last]:
            losses = list(_unstacker(N)(stacked))
    return losses


@lru_cache(maxsize=64)
def _stacker(n: int) -> Callable[[list[Any]], Any]:
    """One program: ``n`` microbatches' losses (trees alike) as one tree of ``[n, ...]``."""
    return jax.jit(lambda trees: jax.tree.map(lambda *a: jnp.stack(a), *trees))


@lru_cache(maxsize=64)
def _unstacker(n: int) -> Callable[[Any], tuple[Any, ...]]:
    """One program: a tree of ``[n, ...]`` as ``n`` trees, one per microbatch."""

    def split(tree: Any) -> tuple[Any, ...]:
        leaves, treedef = jax.tree.flatten(tree)
        return tuple(jax.tree.unflatten(treedef, [a[k] for a in leaves]) for k in range(n))

    return jax.jit(split)
