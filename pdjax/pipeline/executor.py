"""The executor: runs a schedule's actions on real devices.

One Python driver walks the schedule in a dependency-respecting order (the schedule's
unit-time clock) and dispatches, per action, a stage's jitted function on that stage's
device group. Activations and gradients move with ``jax.device_put`` to the receiving
stage's sharding. Dispatch is asynchronous, so the device groups overlap: the driver runs
ahead, and each device works as soon as its inputs are ready.

Semantics (``shared/DESIGN.md``, "Schedules and their semantics") come from the schedule:
every ``F``/``B``/``I``/``W`` reads the weight version its action names from the stage's
:class:`~pdjax.pipeline.stash.WeightStore`, ``U`` applies the accumulated gradients to the
newest version and adds the next one. Flush schedules and ``2bw`` scale the summed
gradients of a step by ``1 / M`` (the mean over microbatches); ``pipedream`` applies each
microbatch's gradient alone.

Per microbatch ``k`` (counted over the pipeline's life), layer ``i`` draws dropout from
``fold_in(fold_in(rng, k), i)``. BatchNorm statistics are updated by each microbatch's
forward, in the order the stage runs the forwards (microbatch order in every schedule),
so statistics are microbatch statistics, as in gradient accumulation.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pdjax._sharding import first_device as device_of_process
from pdjax._sharding import held
from pdjax.distributed import allgather_json, check_cpu_transfers
from pdjax.errors import PdjaxError, PipelineError
from pdjax.layers import LayerSequence, PyTree, Variables
from pdjax.pipeline.schedule import SCHEDULES, Action, Schedule, generate, validate
from pdjax.pipeline.stage import LossFn, Stage
from pdjax.pipeline.stash import WeightStore
from pdjax.pipeline.timeline import Span, Timeline

__all__ = ["Pipeline", "PipelineState", "RunMetrics", "StageSpec", "even_stages"]

_ASYNC = ("pipedream", "2bw")


@dataclasses.dataclass(frozen=True)
class StageSpec:
    """Where a stage is: layers ``first_layer..last_layer`` (inclusive) on ``devices`` (ids).

    The same fields as :class:`pdjax.partition.StagePlan`; either works as a plan stage.
    """

    first_layer: int
    last_layer: int
    devices: tuple[int, ...]


def even_stages(
    num_layers: int, num_stages: int, replicas: int = 1, first_device: int = 0
) -> tuple[StageSpec, ...]:
    """Splits ``num_layers`` layers into ``num_stages`` near-equal contiguous stages, stage
    ``s`` on devices ``first_device + s*replicas ..`` (``replicas`` each).

    >>> [(s.first_layer, s.last_layer, s.devices) for s in even_stages(5, 2)]
    [(0, 2, (0,)), (3, 4, (1,))]
    """
    if replicas < 1:
        raise PipelineError(f"replicas must be >= 1, got {replicas}")
    if not 1 <= num_stages <= num_layers:
        raise PipelineError(
            f"num_stages must be in 1..{num_layers} (one layer at least per stage), "
            f"got {num_stages}"
        )
    bounds = [-(-s * num_layers // num_stages) for s in range(num_stages + 1)]  # ceil
    return tuple(
        StageSpec(
            bounds[s],
            bounds[s + 1] - 1,
            tuple(range(first_device + s * replicas, first_device + (s + 1) * replicas)),
        )
        for s in range(num_stages)
    )


class PipelineState(NamedTuple):
    """Everything a pipeline carries between calls (a pytree; newest weights only).

    Attributes:
      params: per stage, the parameters of each of its layers.
      model_state: per stage, each layer's non-parameter collections (BatchNorm stats).
      opt_state: per stage, the optimizer state.
      updates: per stage, the optimizer updates applied so far (its weight version).
      microbatches: microbatches consumed so far (seeds the per-microbatch RNG).
      rng: the base PRNG key for dropout.
    """

    params: tuple[list[PyTree], ...]
    model_state: tuple[list[Variables], ...]
    opt_state: tuple[optax.OptState, ...]
    updates: tuple[int, ...]
    microbatches: int
    rng: jax.Array


@dataclasses.dataclass
class RunMetrics:
    """What one call of :meth:`Pipeline.step` / :meth:`Pipeline.run` measured.

    Attributes:
      losses: per microbatch, its loss (a device array on the last stage).
      peak_versions: per stage, the most weight versions held at once.
      actions: actions dispatched.
      host_seconds: wall time the driver spent dispatching (excludes waiting for results).
      timeline: per-action measured spans, when asked for (``timeline=True``).
      peak_bytes: with ``timeline=True``, per device group the most bytes of live arrays
        seen on one of its devices after any action (weights, versions, optimizer state,
        stashes, gradients, activations in transit, and whatever the caller holds there).
    """

    losses: list[jax.Array]
    peak_versions: tuple[int, ...]
    actions: int
    host_seconds: float
    timeline: Timeline | None = None
    peak_bytes: tuple[int, ...] | None = None

    @property
    def loss(self) -> float:
        """Mean loss over the microbatches (blocks until they are computed)."""
        return float(np.mean([float(x) for x in self.losses]))


def _track_live_bytes(peaks: list[int], group_of_device: Mapping[jax.Device, int]) -> None:
    """Raises ``peaks[g]`` to the live bytes of the fullest device of each group ``g``."""
    per_device: dict[jax.Device, int] = {}
    for array in jax.live_arrays():
        if array.is_deleted():
            continue
        for shard in array.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    for device, used in per_device.items():
        g = group_of_device.get(device)
        if g is not None and used > peaks[g]:
            peaks[g] = used


class _Saved(NamedTuple):
    x: PyTree
    residuals: list[jax.Array]
    version: int
    state: list[Variables]
    rng: jax.Array
    targets: PyTree


class Pipeline:
    """A model split into stages on devices, trained with a pipeline schedule.

    Args:
      layers: the model.
      plan: the stages: a :class:`pdjax.partition.Plan`, or a sequence of objects with
        ``first_layer``, ``last_layer`` (inclusive) and ``devices`` (ids into
        ``devices``) such as :func:`even_stages`. For ``interleaved`` with ``chunks=v``
        give ``P * v`` stages; stage ``s`` runs on the devices of stage ``s % P``.
      loss_fn: ``loss_fn(outputs, targets) -> scalar``, the mean loss of a microbatch.
      optimizer: any optax ``GradientTransformation``; each stage keeps its own state.
      schedule: one of ``gpipe``, ``1f1b``, ``interleaved``, ``zb-h1`` (flush: use
        :meth:`step`), ``pipedream``, ``2bw`` (streaming: use :meth:`run`).
      microbatches: ``M``, microbatches per optimizer step (flush schedules and ``2bw``).
      chunks: ``v`` for ``interleaved``.
      vertical_sync: ``pipedream`` option (every stage uses stage 0's version).
      weight_stashing: ``pipedream`` option (``False``: the backward uses the newest weights).
      remat: recompute each stage's forward in its backward instead of keeping residuals.
      devices: the devices plan ids refer to (default ``jax.devices()``).

    Raises:
      PipelineError: before any device work, for a plan that does not cover the model,
        too few devices, or an unknown schedule.
    """

    def __init__(
        self,
        layers: LayerSequence,
        plan: Any,
        loss_fn: LossFn,
        optimizer: optax.GradientTransformation,
        *,
        schedule: str = "1f1b",
        microbatches: int = 1,
        chunks: int = 1,
        vertical_sync: bool = False,
        weight_stashing: bool = True,
        remat: bool = False,
        devices: Sequence[jax.Device] | None = None,
    ) -> None:
        if schedule not in SCHEDULES:
            raise PipelineError(f"unknown schedule {schedule!r}; choose one of {SCHEDULES}")
        if microbatches < 1:
            raise PipelineError(f"microbatches must be >= 1, got {microbatches}")
        if chunks < 1:
            raise PipelineError(f"chunks must be >= 1, got {chunks}")
        if schedule != "pipedream" and (vertical_sync or not weight_stashing):
            raise PipelineError(
                "vertical_sync and weight_stashing=False are options of the pipedream "
                f"schedule, not of {schedule}"
            )
        if schedule != "interleaved" and chunks != 1:
            raise PipelineError(f"chunks={chunks} is an option of interleaved, not of {schedule}")
        self.layers = layers
        self.schedule_name = schedule
        self.microbatches = microbatches
        self.chunks = chunks
        self.vertical_sync = vertical_sync
        self.weight_stashing = weight_stashing
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        specs = tuple(getattr(plan, "stages", plan))
        self.stage_specs = specs
        self._check_cover(specs, len(layers))
        if len(specs) % self.chunks:
            raise PipelineError(
                f"interleaved with chunks={self.chunks} needs a multiple of {self.chunks} "
                f"stages, the plan has {len(specs)}"
            )
        self.num_groups = len(specs) // self.chunks
        all_devices = list(jax.devices() if devices is None else devices)
        for s, spec in enumerate(specs):
            ids = tuple(spec.devices)
            if len(set(ids)) != len(ids) or any(d < 0 for d in ids):
                raise PipelineError(f"stage {s} lists devices {ids}: ids must be distinct and >= 0")
        wanted = sorted({d for spec in specs for d in spec.devices})
        if wanted and wanted[-1] >= len(all_devices):
            raise PipelineError(
                f"the plan uses device ids up to {wanted[-1]} but only {len(all_devices)} "
                "devices are visible; on CPU set jax.config.update('jax_num_cpu_devices', N) "
                "(or XLA_FLAGS=--xla_force_host_platform_device_count=N) before using JAX"
            )
        self.stages: list[Stage] = []
        for s, spec in enumerate(specs):
            group_spec = specs[s % self.num_groups]
            if tuple(spec.devices) != tuple(group_spec.devices):
                raise PipelineError(
                    f"interleaved stage {s} must use the devices of stage {s % self.num_groups} "
                    f"({tuple(group_spec.devices)}), got {tuple(spec.devices)}"
                )
            self.stages.append(
                Stage(
                    s,
                    layers.layers[spec.first_layer : spec.last_layer + 1],
                    spec.first_layer,
                    [all_devices[d] for d in spec.devices],
                    optimizer,
                    loss_fn if s == len(specs) - 1 else None,
                    remat=remat,
                )
            )
        self.replicas = tuple(len(spec.devices) for spec in specs[: self.num_groups])
        if schedule == "2bw" and microbatches < self.num_groups:
            raise PipelineError(
                f"2bw needs microbatches (M) >= stages (P) so that step t can use W(t-1) at "
                f"every stage; got M={microbatches}, P={self.num_groups}"
            )
        self._schedules: dict[tuple[int, int], Schedule] = {}
        # multi-controller runs (jax.distributed): the stages this process drives
        self.process_index = jax.process_index()
        # per stage, the processes that hold its devices (a replicated stage may span
        # several: each of them runs the stage's programs, SPMD)
        self.owners = tuple(frozenset(d.process_index for d in st.devices) for st in self.stages)
        self.local = tuple(self.process_index in owners for owners in self.owners)
        self._specs: dict[Any, list[Any]] = {}
        if self.multiprocess:
            check_cpu_transfers("a pipeline across processes")

    @property
    def multiprocess(self) -> bool:
        """Whether some stages run (also) in other processes (``jax.distributed``)."""
        return any(owners != {self.process_index} for owners in self.owners)

    @staticmethod
    def _check_cover(specs: Sequence[Any], num_layers: int) -> None:
        if not specs:
            raise PipelineError("the plan has no stages")
        expected = 0
        for s, spec in enumerate(specs):
            if spec.first_layer != expected or spec.last_layer < spec.first_layer:
                raise PipelineError(
                    f"stage {s} holds layers {spec.first_layer}-{spec.last_layer}, expected it "
                    f"to start at layer {expected}: stages must cover layers 0-{num_layers - 1} "
                    "contiguously, in order"
                )
            if not spec.devices:
                raise PipelineError(f"stage {s} has no devices")
            expected = spec.last_layer + 1
        if expected != num_layers:
            raise PipelineError(
                f"the plan's stages cover layers 0-{expected - 1}, the model has {num_layers} "
                f"layers (0-{num_layers - 1})"
            )

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    # -- state ------------------------------------------------------------------------------

    def check_shapes(self, sample: PyTree, variables: Sequence[Variables] | None = None) -> None:
        """Traces the model stage by stage on ``sample`` (shapes only, no FLOPs).

        Raises:
          PipelineError: naming the stage, the layer and the input shapes that fail.
        """
        specs = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(np.shape(a), jnp.result_type(a)), sample
        )
        if variables is None:
            variables = jax.eval_shape(self.layers.init, jax.random.key(0), specs)
        x = specs
        for s, spec in enumerate(self.stage_specs):
            for i in range(spec.first_layer, spec.last_layer + 1):
                layer = self.layers.layers[i]
                try:
                    x = jax.eval_shape(
                        lambda v, x, layer=layer: layer.apply(v, x)[0], variables[i], x
                    )
                except PdjaxError:
                    raise
                except Exception as e:
                    shapes = [f"{a.dtype}{list(a.shape)}" for a in jax.tree.leaves(x)]
                    raise PipelineError(
                        f"stage {s}, layer {i} ({layer.name}) cannot take the output of the "
                        f"layer before it, shapes {shapes}: {type(e).__name__}: {e}"
                    ) from e

    def init(self, rng: jax.Array, sample: PyTree) -> PipelineState:
        """Initialises every layer from ``rng`` on a sample microbatch and places the stages.

        ``rng`` also seeds dropout (through ``fold_in(rng, 1)``).
        """
        self.check_shapes(sample)
        variables = jax.jit(self.layers.init)(jax.random.fold_in(rng, 0), sample)
        return self.state_from_variables(variables, jax.random.fold_in(rng, 1))

    def state_from_variables(
        self, variables: Sequence[Variables] | Mapping[str, Any], rng: jax.Array
    ) -> PipelineState:
        """A fresh state from given variables (pre-trained, restored): a per-layer list, or
        the merged tree of :meth:`LayerSequence.merge`. Optimizer state starts anew."""
        if isinstance(variables, Mapping):
            variables = self.layers.split(variables)
        if len(variables) != len(self.layers):
            raise PipelineError(
                f"got variables for {len(variables)} layers, the model has {len(self.layers)}"
            )
        params, model_state, opt_state = [], [], []
        for s, (stage, spec) in enumerate(zip(self.stages, self.stage_specs, strict=True)):
            vs = variables[spec.first_layer : spec.last_layer + 1]
            # another process's stage: global arrays with no shard here (shapes only: they
            # size the transfers; orbax saves each process's own shards)
            place = stage.place_weights if self.local[s] else partial(_remote, stage.replicated)
            p = place([v.get("params", {}) for v in vs])
            params.append(p)
            model_state.append(place([{k: x for k, x in v.items() if k != "params"} for v in vs]))
            init = (
                self.optimizer.init
                if self.local[s]
                else partial(jax.eval_shape, self.optimizer.init)
            )
            opt_state.append(place(init(p)))
        return PipelineState(
            params=tuple(params),
            model_state=tuple(model_state),
            opt_state=tuple(opt_state),
            updates=(0,) * self.num_stages,
            microbatches=0,
            rng=rng,
        )

    def variables(self, state: PipelineState) -> list[Variables]:
        """The per-layer variables (params and state) of the newest weights.

        In a multi-process run (:attr:`multiprocess`) this is collective: every process
        must call it, and each gets all the variables, another process's stages copied to
        its own first device."""
        out: list[Variables] = []
        pairs = zip(state.params, state.model_state, strict=True)
        if self.multiprocess:
            pairs = (
                self._broadcast(s, (p, ms)) for s, (p, ms) in enumerate(pairs)
            )  # in stage order, the same in every process
        for params, model_state in pairs:
            for p, ms in zip(params, model_state, strict=True):
                out.append({**ms, "params": p})
        return out

    def params(self, state: PipelineState) -> dict[str, Any]:
        """The full parameter tree ``{layer name: params}`` of the newest weights."""
        return self.layers.merge(self.variables(state))["params"]

    # -- schedules ----------------------------------------------------------------------------

    def schedule(self, num_microbatches: int) -> Schedule:
        """The validated schedule for a call over ``num_microbatches`` microbatches."""
        key = (num_microbatches, self.microbatches)
        if key not in self._schedules:
            M = self.microbatches
            name = self.schedule_name
            if name == "pipedream":
                sched = generate(
                    name,
                    self.num_groups,
                    num_microbatches,
                    vertical_sync=self.vertical_sync,
                    weight_stashing=self.weight_stashing,
                    replicas=self.replicas,
                )
            elif name == "2bw":
                sched = generate(
                    name, self.num_groups, M, stream=num_microbatches, replicas=self.replicas
                )
            else:
                if num_microbatches % M:
                    raise PipelineError(
                        f"{name} runs whole steps of {M} microbatches; got {num_microbatches}"
                    )
                sched = generate(
                    name,
                    self.num_groups,
                    M,
                    steps=num_microbatches // M,
                    chunks=self.chunks,
                    replicas=self.replicas,
                )
            validate(sched)
            self._schedules[key] = sched
        return self._schedules[key]

    # -- running ----------------------------------------------------------------------------

    def split_batch(self, batch: tuple[PyTree, PyTree]) -> list[tuple[PyTree, PyTree]]:
        """Splits ``(inputs, targets)`` into ``M`` equal microbatches along axis 0.

        Raises:
          PipelineError: if the batch is not divisible by ``M`` times every stage's replicas.
        """
        inputs, targets = batch
        n = jax.tree.leaves(inputs)[0].shape[0]
        M = self.microbatches
        need = [M * r for r in self.replicas]
        for s, k in enumerate(need):
            if n % k:
                raise PipelineError(
                    f"batch of {n} samples cannot be split into {M} microbatches of equal "
                    f"size, each divisible by stage {s}'s {self.replicas[s]} replicas; use a "
                    f"batch size that is a multiple of {int(np.lcm.reduce(need))}"
                )
        size = n // M
        return [
            jax.tree.map(lambda a, k=k: a[k * size : (k + 1) * size], (inputs, targets))
            for k in range(M)
        ]

    def step(
        self, state: PipelineState, batch: tuple[PyTree, PyTree], *, timeline: bool = False
    ) -> tuple[PipelineState, RunMetrics]:
        """One optimizer step of a flush schedule over ``batch = (inputs, targets)``.

        The batch is split into ``M`` microbatches. The state passed in is consumed (its
        optimizer state is updated in place): keep the one returned.
        """
        if self.schedule_name in _ASYNC:
            raise PipelineError(
                f"{self.schedule_name} is asynchronous: its updates lag behind the stream, "
                "so one step at a time would drain after every step (2bw would then use "
                "W(t), not W(t-1)); use run(state, microbatches) over a stream"
            )
        return self.run(state, self.split_batch(batch), timeline=timeline)

    def run(
        self,
        state: PipelineState,
        microbatches: Sequence[tuple[PyTree, PyTree]],
        *,
        timeline: bool = False,
        on_loss: Callable[[int, jax.Array], None] | None = None,
    ) -> tuple[PipelineState, RunMetrics]:
        """Runs the schedule over a stream of ``(inputs, targets)`` microbatches.

        The pipeline fills at the start of the call and drains at its end, so
        consecutive calls are one stream with a drain between them (what a checkpoint
        needs). The state passed in is consumed (its optimizer state is updated in
        place): keep the one returned. With ``timeline=True`` the driver waits for each
        action and records its measured span and the live bytes per device group (so
        the devices do not overlap in that mode, and it is slow: a diagnostic).
        ``on_loss(k, loss)`` is called when microbatch ``k``'s loss is dispatched (an
        unfinished device array: converting it to a float waits for it). Across processes
        (:attr:`multiprocess`) every process calls it, and it returns once the pipeline
        has drained in all of them.
        """
        microbatches = list(microbatches)
        if not microbatches:
            raise PipelineError("run needs at least one microbatch")
        if any(
            isinstance(leaf, jax.Array) and leaf.is_deleted()
            for leaf in jax.tree.leaves(state.opt_state)
        ):
            raise PipelineError(
                "this state was consumed by an earlier step/run (the optimizer state is "
                "updated in place); pass the state that call returned"
            )
        for k, (x, _) in enumerate(microbatches):
            n = jax.tree.leaves(x)[0].shape[0]
            bad = [r for r in self.replicas if n < 1 or n % r]
            if bad:
                raise PipelineError(
                    f"microbatch {k} has {n} samples; every microbatch needs a positive "
                    f"multiple of each stage's replicas {self.replicas}"
                )
        sched = self.schedule(len(microbatches))
        return self._execute(sched, state, microbatches, timeline, on_loss)

    def _execute(
        self,
        sched: Schedule,
        state: PipelineState,
        microbatches: list[tuple[PyTree, PyTree]],
        record: bool,
        on_loss: Callable[[int, jax.Array], None] | None = None,
    ) -> tuple[PipelineState, RunMetrics]:
        S = self.num_stages
        reads: list[dict[int, int]] = [{} for _ in range(S)]
        for group in sched.actions:
            for a in group:
                if a.kind != "U":
                    reads[a.stage][a.version] = reads[a.stage].get(a.version, 0) + 1
        stores = [WeightStore(state.params[s], reads[s]) for s in range(S)]
        opt_state = list(state.opt_state)
        model_state = list(state.model_state)
        grads: list[Any] = [None] * S
        saved: dict[tuple[int, int], _Saved] = {}
        fwd_in: dict[tuple[int, int], PyTree] = {}
        bwd_in: dict[tuple[int, int], PyTree] = {}
        losses: dict[int, jax.Array] = {}
        scale = jnp.float32(1.0 / sched.microbatches_per_step)
        window = 4 * max(sched.microbatches_per_step, sched.num_groups)
        # Replicated stages on XLA's CPU client: programs holding collectives, queued several
        # deep on a few cores, can deadlock until its 40 s rendezvous timeout aborts the
        # process; run them one at a time there (in-process CPU devices share one thread
        # pool anyway, so little overlap is lost).
        one_at_a_time = any(
            len(st.devices) > 1 and st.devices[0].platform == "cpu" for st in self.stages
        )
        last = S - 1
        one = [
            self.stages[last].place_weights(jnp.ones((), jnp.float32)) if self.local[last] else None
        ]

        order = sorted(
            (tick, g, i) for g, ticks in enumerate(sched.clock()) for i, tick in enumerate(ticks)
        )
        spans: list[Span] = []
        group_of_device = {
            d: sched.stage_device[s] for s, st in enumerate(self.stages) for d in st.devices
        }
        peaks = [0] * sched.num_groups
        origin = time.perf_counter()
        host = 0.0

        # one batched transfer each for the inputs (to stage 0) and targets (to the last
        # stage), before the first action: a transfer per microbatch costs a dispatch each
        local = self.local
        inputs = self.stages[0].place_batch([mb[0] for mb in microbatches]) if local[0] else None
        targets = (
            self.stages[last].place_batch([mb[1] for mb in microbatches]) if local[last] else None
        )
        # another process's stage: take part in the transfers to and from this process
        # (both sides call device_put, in the same clock order); its output shapes size them
        act = self._activation_specs(state, microbatches[0][0]) if self.multiprocess else []
        # a stage spanning processes needs the PRNG key as a global array on its devices
        rngs = [
            stage.place_weights(state.rng) if len(self.owners[s]) > 1 else state.rng
            for s, stage in enumerate(self.stages)
        ]
        sent: list[Any] = []
        fused: set[tuple[int, int]] = set()  # (group, index) of updates done with a backward

        for _, g, i in order:
            a: Action = sched.actions[g][i]
            t0 = time.perf_counter()
            s, k = a.stage, a.mb
            stage = self.stages[s]
            out: Any = None
            if not local[s]:
                if a.kind == "F" and s != last and local[s + 1]:
                    fwd_in[(s + 1, k)] = self._move(s, s + 1, None, act[s], sent)
                elif a.kind in ("B", "I") and s > 0 and local[s - 1]:
                    bwd_in[(s - 1, k)] = self._move(s, s - 1, None, act[s - 1], sent)
                continue
            if a.kind == "F":
                params = stores[s].read(a.version)
                x = inputs[k] if s == 0 else fwd_in.pop((s, k))
                tgt = targets[k] if s == last else None
                rng = (rngs[s], np.int32(state.microbatches + k))
                before = model_state[s]
                y, model_state[s], res = stage.forward(params, before, x, rng, tgt)
                saved[(s, k)] = _Saved(x, res, a.version, before, rng, tgt)
                if s == last:
                    losses[k] = y
                    # bound how far the driver runs ahead: XLA's CPU client aborts when many
                    # queued programs wait on collectives (replicated stages) on few cores
                    if k - window in losses:
                        losses[k - window].block_until_ready()
                    if on_loss is not None:
                        on_loss(k, y)
                else:
                    got = self._move(s, s + 1, y, act[s] if act else None, sent)
                    if local[s + 1]:
                        fwd_in[(s + 1, k)] = got
                out = y
            elif a.kind in ("B", "I", "W"):
                want = {"B": "both", "I": "input", "W": "weights"}[a.kind]
                sv = saved.pop((s, k)) if a.kind != "I" else saved[(s, k)]
                params = stores[s].read(a.version)
                ct = one[0] if s == last else (bwd_in.pop((s, k)) if a.kind != "W" else None)
                if a.kind == "I":
                    saved[(s, k)] = sv._replace(targets=(sv.targets, ct))
                elif a.kind == "W":
                    tgt, ct = sv.targets
                    sv = sv._replace(targets=tgt)
                acc = grads[s] if a.kind != "I" else None
                nxt = sched.actions[g][i + 1] if i + 1 < len(sched.actions[g]) else None
                if (
                    a.kind == "B"
                    and sched.microbatches_per_step == 1
                    and acc is None
                    and nxt is not None
                    and nxt.kind == "U"
                    and nxt.stage == s
                    and nxt.version == stores[s].latest
                    and a.version == sv.version
                    and not stage.remat
                ):  # the update follows at once: one program for both (Stage.backward_update)
                    # donate the newest weights when nothing reads them later and this
                    # call made them (the caller's own arrays are never deleted)
                    latest = stores[s].latest
                    if a.version == latest > 0 and not stores[s].reads_left(latest):
                        new, opt_state[s], gx = stage.backward_update_newest(
                            params, sv.x, sv.residuals, ct, opt_state[s]
                        )
                    else:
                        new, opt_state[s], gx = stage.backward_update(
                            params, sv.x, sv.residuals, ct, stores[s].newest, opt_state[s]
                        )
                    del params
                    stores[s].push(new)
                    fused.add((g, i + 1))
                    if gx is not None and s > 0:
                        got = self._move(s, s - 1, gx, act[s - 1] if act else None, sent)
                        if local[s - 1]:
                            bwd_in[(s - 1, k)] = got
                    out = new
                elif a.version == sv.version and not stage.remat:
                    gp, gx = stage.backward(params, sv.x, sv.residuals, ct, acc, want)
                else:  # remat, or no weight stashing: the VJP at these weights, saved input
                    gp, gx = stage.backward_recompute(
                        params, sv.x, ct, (sv.state, sv.rng, sv.targets), acc, want
                    )
                if out is None:
                    if gp is not None:
                        grads[s] = gp  # the sum so far: backward added into the accumulator
                    if gx is not None and s > 0:
                        got = self._move(s, s - 1, gx, act[s - 1] if act else None, sent)
                        if local[s - 1]:
                            bwd_in[(s - 1, k)] = got
                    out = gp if gp is not None else gx
            elif (g, i) in fused:  # done with the backward before it
                pass
            else:  # U
                if a.version != stores[s].latest:
                    raise PipelineError(
                        f"{a.describe()} expects version {a.version}, stage {s} is at "
                        f"{stores[s].latest}"
                    )
                new, opt_state[s] = stage.update(grads[s], stores[s].newest, opt_state[s], scale)
                grads[s] = None
                stores[s].push(new)
                out = new
            host += time.perf_counter() - t0
            if one_at_a_time and not record:
                jax.block_until_ready(out)
            if record:
                jax.block_until_ready(out)
                spans.append(Span(g, t0 - origin, time.perf_counter() - origin, a))
                _track_live_bytes(peaks, group_of_device)

        # the sender must outlive the transfer: wait until every outgoing one has left
        jax.block_until_ready(sent)
        if not local[last]:  # the losses live on the last stage's process: fetch them
            n = len(microbatches)
            losses = dict(enumerate(self._broadcast(last, [jnp.float32(0)] * n)))
        elif self.multiprocess:
            self._broadcast(last, [losses[k].astype(jnp.float32) for k in range(len(microbatches))])
        if saved or fwd_in or bwd_in or any(gr is not None for gr in grads):
            raise PipelineError("the schedule left work undone (unmatched F/B or updates)")
        new_state = PipelineState(
            params=tuple(store.newest for store in stores),
            model_state=tuple(model_state),
            opt_state=tuple(opt_state),
            updates=tuple(u + store.latest for u, store in zip(state.updates, stores, strict=True)),
            microbatches=state.microbatches + len(microbatches),
            rng=state.rng,
        )
        metrics = RunMetrics(
            losses=[losses[k] for k in range(len(microbatches)) if k in losses],
            peak_versions=tuple(store.peak_alive for store in stores),
            actions=len(order),
            host_seconds=host,
            timeline=Timeline(sched.name, sched.num_groups, tuple(spans)) if record else None,
            peak_bytes=tuple(peaks) if record else None,
        )
        if self.multiprocess:
            # Return drained everywhere: this process's results are computed (so what it
            # received has arrived) and so are every other process's (so what it sent has
            # been taken). A process that went on at once could enter an XLA collective
            # (data parallelism, a replicated stage) while a transfer its peer still needs
            # waits behind it.
            jax.block_until_ready(
                [a for a in jax.tree.leaves((new_state, metrics.losses)) if held(a)]
            )
            allgather_json("pipeline run drained")
        return new_state, metrics

    # -- across processes -------------------------------------------------------------------

    def _activation_specs(self, state: PipelineState, x: PyTree) -> list[Any]:
        """Per stage, the shapes of its output for a microbatch input like ``x`` (what a
        process receives from another process's stage, or sends back as a gradient)."""
        x = _abstract(x)
        key = jax.tree.structure(x), tuple((a.shape, str(a.dtype)) for a in jax.tree.leaves(x))
        if key not in self._specs:
            rng = (state.rng, np.int32(0))
            specs = []
            for s, stage in enumerate(self.stages[:-1]):
                x, _, _ = jax.eval_shape(
                    stage.forward,
                    _abstract(state.params[s]),
                    _abstract(state.model_state[s]),
                    x,
                    rng,
                    None,
                )
                specs.append(x)
            self._specs[key] = specs
        return self._specs[key]

    def _broadcast(self, s: int, tree: PyTree) -> PyTree:
        """``tree`` of stage ``s`` (real on its process, shapes elsewhere) on every process;
        elsewhere on that process's first device. Every process calls it, in one order."""
        stage = self.stages[s]
        source = stage.devices[0]  # one replica, from the process that holds this device
        owner = source.process_index
        here = jax.sharding.SingleDeviceSharding(source)
        out = tree
        for q in range(jax.process_count()):
            if q == owner or self.process_index not in (q, owner):
                continue
            target = jax.sharding.SingleDeviceSharding(device_of_process(q))
            if self.process_index == owner:
                replica = jax.tree.map(lambda a: _shard_on(stage.place_weights(a), source), tree)
                jax.block_until_ready(jax.device_put(replica, target))
            else:
                out = jax.device_put(_remote(here, tree), target)
        return out

    def _move(
        self, src: int, dst: int, y: PyTree | None, spec: PyTree | None, sent: list[Any]
    ) -> PyTree | None:
        """An activation (or gradient) of stage ``src`` on stage ``dst``'s devices, batch
        sharded: ``y`` where this process runs ``src`` (None elsewhere), ``spec`` its
        shapes. Every process that runs either stage calls it, in the same order; returns
        the array where this process runs ``dst`` (None elsewhere). What this process sends
        to another is appended to ``sent`` (kept alive until the call's end)."""
        me = self.process_index
        a, b = self.stages[src], self.stages[dst]
        if self.owners[src] == self.owners[dst] == {me}:
            return b.place_batch(y)
        if len(self.owners[src]) == len(self.owners[dst]) == 1 and len(a.devices) == len(
            b.devices
        ):  # whole stages in two processes: one device_put, both sides taking part
            if me in self.owners[src]:
                sent.append(jax.device_put(a.place_batch(y), b.batch_sharding))
                return None
            return jax.device_put(_remote(a.batch_sharding, spec), b.batch_sharding)
        if y is not None:
            y = a.place_batch(y)
        leaves, tree = jax.tree.flatten(y if y is not None else spec)
        moved = [_reshard_rows(leaf, a.devices, b.devices, y is not None, sent) for leaf in leaves]
        if me not in self.owners[dst]:
            return None
        return jax.tree.unflatten(
            tree,
            [
                jax.make_array_from_single_device_arrays(
                    np.shape(leaf), b.batch_sharding, shards, dtype=jnp.result_type(leaf)
                )
                for leaf, shards in zip(leaves, moved, strict=True)
            ],
        )


def _remote(sharding: jax.sharding.Sharding, tree: PyTree) -> PyTree:
    """``tree`` as global arrays on another process's devices: shapes, no local data."""
    return jax.tree.map(
        lambda a: jax.make_array_from_single_device_arrays(
            np.shape(a), sharding, [], dtype=jnp.result_type(a)
        ),
        tree,
    )


def _shard_on(array: jax.Array, device: jax.Device) -> jax.Array:
    """The shard of ``array`` that ``device`` holds (a whole replica, for weights)."""
    return next(sh.data for sh in array.addressable_shards if sh.device == device)


def _rows(n: int, parts: int, i: int) -> tuple[int, int]:
    return i * n // parts, (i + 1) * n // parts


def _reshard_rows(
    leaf: Any,
    src: Sequence[jax.Device],
    dst: Sequence[jax.Device],
    have: bool,
    sent: list[Any],
) -> list[jax.Array]:
    """One batch-sharded array moved from devices ``src`` to ``dst`` (batch axis 0, equal
    parts): each overlap of a source and a destination part goes from its source device
    to its destination device, within a process or across (``jax.device_put`` of single
    device arrays, which JAX moves between processes). ``leaf`` is the array where this
    process holds source parts (``have``), else its shape. Returns this process's
    destination parts, in ``dst`` order."""
    me = jax.process_index()
    n = np.shape(leaf)[0]
    rest, dtype = tuple(np.shape(leaf)[1:]), jnp.result_type(leaf)
    parts: dict[int, list[jax.Array]] = {}
    for i, d in enumerate(dst):
        lo, hi = _rows(n, len(dst), i)
        for j, e in enumerate(src):
            start, stop = _rows(n, len(src), j)
            a, b = max(lo, start), min(hi, stop)
            if a >= b or me not in (d.process_index, e.process_index):
                continue
            to = jax.sharding.SingleDeviceSharding(d)
            if e.process_index == me:
                assert have
                piece = _shard_on(leaf, e)[a - start : b - start]
                if d.process_index != me:
                    sent.append(jax.device_put(piece, to))
                    continue
                piece = jax.device_put(piece, to)
            else:
                remote = jax.make_array_from_single_device_arrays(
                    (b - a, *rest), jax.sharding.SingleDeviceSharding(e), [], dtype=dtype
                )
                piece = jax.device_put(remote, to)
            parts.setdefault(i, []).append(piece)
    return [
        ps[0] if len(ps) == 1 else jnp.concatenate(ps)
        for i, ps in sorted(parts.items())
        if dst[i].process_index == me
    ]


def _abstract(tree: PyTree) -> PyTree:
    """``tree`` with every leaf replaced by its ``jax.ShapeDtypeStruct``."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), jnp.result_type(a)), tree)
