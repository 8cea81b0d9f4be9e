"""Data parallelism, the "pjit DP" baseline: the whole model as one jitted train step.

By default the model's parameters and optimizer state are replicated on every device of a
one-axis ``Mesh`` (``"data"``); each batch is sharded along its first axis over the same
axis with ``NamedSharding``. One ``jax.jit`` function computes the loss, its gradient and
the optimizer update for the whole batch; XLA partitions it and inserts the gradient
all-reduce. This is what pdjax's pipelines are compared against, and what a plan with one
stage on all devices computes.

With ``mesh=`` the devices form a mesh of named axes (:mod:`pdjax.layers.sharding`),
e.g. ``{"data": 2, "fsdp": 2, "tensor": 2}``: FSDP (ZeRO-3) and tensor parallelism with
no pipeline. Each parameter is split over the mesh as the model's annotations and the
:class:`~pdjax.layers.sharding.ShardingRules` say (``embed`` dimensions over ``fsdp``,
heads, MLP and vocabulary over ``tensor`` by default), the optimizer state as its
parameter, and each batch's rows over ``data`` and ``fsdp``; BatchNorm statistics stay
replicated. The step is the same program with those shardings: XLA's SPMD partitioner
inserts the collectives (the weights' all-gathers, the gradients' reduce-scatters and
all-reduces), pdjax writes none. A mesh of ``data`` alone is the replicated default.

Semantics match :class:`pdjax.pipeline.executor.Pipeline` with one stage and ``M = 1``:
a DP step is one microbatch (the whole batch) and one optimizer update with its mean-loss
gradient. Per microbatch ``k`` (here the step count over the life of the run, from
``state.step``), layer ``i`` draws dropout from ``fold_in(fold_in(state.rng, k), i)``.
BatchNorm statistics are those of the whole global batch (XLA reduces across devices),
as on a single device with that batch. As a :class:`~pdjax.runners.Runner`, its
:meth:`~DataParallel.run` takes a stream of batches and makes one step of each.

>>> import jax, optax
>>> from pdjax.models import get_model
>>> spec = get_model("mlp")
>>> x, y = spec.sample_batch(8)
>>> dp = DataParallel(spec.layers, spec.loss, optax.sgd(0.1), devices=jax.devices()[:1])
>>> state = dp.init(jax.random.key(0), x)
>>> state, metrics = dp.step(state, (x, y))
>>> state.step, metrics.loss > 0
(1, True)
"""

from __future__ import annotations

import dataclasses
import numbers
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pdjax import _xla_cpu
from pdjax._loss import split_loss, with_aux
from pdjax._sharding import place
from pdjax.errors import PipelineError
from pdjax.layers import LayerSequence, LossFn, PyTree, Variables, count_traces
from pdjax.layers.init_programs import init_on
from pdjax.layers.sharding import (
    MeshAxes,
    MeshError,
    ShardingRules,
    StageSharding,
    describe_mesh,
    is_sharded,
    make_mesh,
    mesh_axes,
    mesh_size,
)
from pdjax.pipeline.executor.arguments import (
    check_arrays,
    check_callback,
    check_devices,
    check_flag,
    check_key,
    check_layers,
    check_loss_fn,
    check_optimizer,
    check_stream,
)
from pdjax.pipeline.optim import on_model_names
from pdjax.precision import LossScaled, computes_in_float16

__all__ = ["DPMetrics", "DPState", "DataParallel"]


class DPState(NamedTuple):
    """Everything data-parallel training carries between steps (a pytree).

    Attributes:
      params: per layer, its ``"params"`` collection (replicated on every device, or on a
        sharded mesh each parameter on its own sharding).
      model_state: per layer, its other collections (BatchNorm statistics), replicated.
      opt_state: the optimizer state over ``params``, replicated (on a sharded mesh each
        leaf shaped as a parameter, such as Adam's moments, sharded as that parameter).
      step: optimizer updates so far, which is also the batches (microbatches) consumed;
        seeds the per-step dropout RNG.
      rng: the base PRNG key for dropout.
    """

    params: list[PyTree]
    model_state: list[Variables]
    opt_state: optax.OptState
    step: int
    rng: jax.Array

    # The counters every runner's state has (pdjax.runners.RunnerState): one "stage"
    # updated once per step, and a step consumes one microbatch (the batch).
    @property
    def updates(self) -> tuple[int, ...]:
        """Optimizer updates so far, as a one-stage pipeline's: ``(step,)``."""
        return (self.step,)

    @property
    def microbatches(self) -> int:
        """Microbatches consumed so far: the steps (a step's microbatch is its batch)."""
        return self.step


@dataclasses.dataclass
class DPMetrics:
    """What one :meth:`DataParallel.step` measured.

    Attributes:
      losses: the step's loss, as a one-element list of a device scalar (the same shape
        of result as :class:`pdjax.pipeline.executor.RunMetrics` with one microbatch).
      host_seconds: wall time spent dispatching the step (excludes waiting for it).
      workarounds: the XLA CPU workarounds in force (``pdjax._xla_cpu``), one line each.
      aux: per step, the loss function's ``aux`` for one returning ``(loss, aux)``, else
        ``None``.
      actions: the steps dispatched (each one action).
    """

    losses: list[jax.Array]
    host_seconds: float
    workarounds: tuple[str, ...] = ()
    aux: list[PyTree] | None = None
    actions: int = 1

    @property
    def loss(self) -> float:
        """The mean loss over the batch (blocks until it is computed)."""
        return float(np.mean([float(x) for x in self.losses]))

    def mean_aux(self) -> PyTree:
        """The mean over the steps of the loss function's auxiliary outputs (NumPy), or
        ``None``; one step's as they are."""
        if self.aux is None:
            return None
        if len(self.aux) == 1:
            return jax.device_get(self.aux[0])
        return jax.tree.map(lambda *a: np.mean(np.stack(a), axis=0), *jax.device_get(self.aux))


@jax.jit
def _copy(tree: PyTree) -> PyTree:
    """A copy of every array of ``tree``, placed as it is (one program per layout)."""
    return jax.tree.map(jnp.copy, tree)


class DataParallel:
    """A model trained with data parallelism: one jitted step over a device mesh.

    Args:
      layers: the model.
      loss_fn: ``loss_fn(outputs, targets) -> scalar``, the mean loss of a batch.
      optimizer: any optax ``GradientTransformation``.
      devices: the devices to shard the batch over (default ``jax.devices()``).
      donate: let each :meth:`step` reuse the buffers of the state it is given for the
        new state (less memory; the old state's arrays are deleted and must not be used
        again). Set ``False`` to keep old states alive, e.g. while saving them.
      mesh: the devices as a mesh of named axes, a dict or ``(axis, size)`` pairs such as
        ``{"fsdp": 4, "tensor": 2}`` (text such as ``"fsdp=4,tensor=2"``: read it with
        :func:`pdjax.layers.sharding.parse_mesh`), whose sizes multiply to the device count.
        The axes are ordered ``data``, ``fsdp``, others, ``tensor`` (the last over
        neighbouring devices of ``devices``). ``data`` replicates the weights, ``fsdp``
        splits the batch and the weights (ZeRO-3), ``tensor`` splits each layer's weights
        (Megatron-style); a batch's rows are split over ``data`` and ``fsdp``
        (:attr:`batch_ways`). Default (or ``data`` alone): every device one replica. The
        step's collectives are XLA's, inserted by its SPMD partitioner.
      sharding: the :class:`~pdjax.layers.sharding.ShardingRules` that map the model's
        parameter annotations to the mesh's axes (default ``ShardingRules()``; e.g.
        ``ShardingRules(fsdp="auto")`` splits unannotated parameters over ``fsdp``).

    Raises:
      PipelineError: for layers that are not a pdjax layer sequence (a plain list: wrap
        it with :func:`pdjax.sequential`), a ``loss_fn`` that is not callable, an
        optimizer that is not an optax ``GradientTransformation``, an empty or repeated
        device list, or ``sharding`` that is not a ``ShardingRules``.
      MeshError: for a mesh that is not a dict or ``(axis, size)`` pairs of positive
        sizes, or whose sizes do not multiply to the device count.

    The shardings of a sharded mesh are decided (and every annotation checked:
    :class:`~pdjax.layers.sharding.ShardingError`) by :meth:`init` or
    :meth:`state_from_variables`, before anything compiles; :attr:`layout` holds them.

    Every jitted function compiles once per input shape; ``trace_counts`` counts traces
    (``"step"`` and ``"evaluate"``).
    """

    def __init__(
        self,
        layers: LayerSequence,
        loss_fn: LossFn,
        optimizer: optax.GradientTransformation,
        *,
        devices: Sequence[jax.Device] | None = None,
        donate: bool = True,
        mesh: Mapping[str, int] | Sequence[tuple[str, int]] | None = None,
        sharding: ShardingRules | None = None,
    ) -> None:
        layers = check_layers(layers, "DataParallel")
        check_loss_fn(loss_fn, "DataParallel")
        check_optimizer(optimizer, "DataParallel")
        devices = check_devices(devices, "DataParallel")
        donate = check_flag("donate", donate)
        self.devices = tuple(jax.devices() if devices is None else devices)
        if not self.devices:
            raise PipelineError("DataParallel needs at least one device; got devices=[]")
        if len(set(self.devices)) != len(self.devices):
            raise PipelineError(f"DataParallel got a device more than once: {self.devices}")
        axes = _mesh_of(mesh, len(self.devices))
        if sharding is not None and not isinstance(sharding, ShardingRules):
            raise PipelineError(
                "DataParallel sharding must be a pdjax.layers.sharding.ShardingRules, got "
                f"a {type(sharding).__name__}"
            )
        if axes is not None:
            me = jax.process_index()
            if any(d.process_index != me for d in self.devices):
                raise PipelineError(
                    f"DataParallel with mesh {describe_mesh(axes)} spans processes; a sharded "
                    "mesh runs on one process's devices (devices=jax.local_devices())"
                )
        if getattr(layers, "tied", ()):
            raise PipelineError(
                "DataParallel does not support tied parameters (sequential(..., tied=...)): it "
                "would train each copy apart; use pdjax.Pipeline with one stage on these "
                "devices, which sums the copies' gradients and updates them as one"
            )
        policies = [getattr(layer, "policy", None) for layer in layers.layers]
        if any(computes_in_float16(p) for p in policies) or isinstance(optimizer, LossScaled):
            raise PipelineError(
                "DataParallel does not scale the loss, which float16 needs (and a "
                "pdjax.precision.loss_scaled optimizer expects); use pdjax.Pipeline with one "
                "stage on these devices and a loss_scaled optimizer, or precision='bf16'"
            )
        self.layers = layers
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        # what runs it: on the model's own names for split_model's layers (a mask function
        # reading them, as under a Pipeline), the state in this runner's structure
        self._optimizer = on_model_names(optimizer, layers)
        self.workarounds = _xla_cpu.for_data_parallel(self.devices[0].platform, len(self.devices))
        self._run_ahead = _xla_cpu.RunAhead(self.workarounds.run_ahead)
        #: the mesh's axes, outermost first (``(("data", n),)``: replicated)
        self.mesh_axes: MeshAxes = axes if axes is not None else (("data", len(self.devices)),)
        #: the placement of a sharded mesh's parameters (None: replicated), decided by
        #: :meth:`init` or :meth:`state_from_variables`
        self.layout: StageSharding | None = None
        if axes is not None:
            rules = sharding if sharding is not None else ShardingRules()
            self.mesh = make_mesh(self.devices, axes, rules.axis_names)
            self.layout = StageSharding(self.mesh, rules)
            self.replicated = self.layout.replicated
            self.batch_sharding = self.layout.batch
        else:
            self.mesh = Mesh(np.asarray(self.devices), ("data",))
            self.replicated = NamedSharding(self.mesh, P())
            self.batch_sharding = NamedSharding(self.mesh, P("data"))
        self.trace_counts: dict[str, int] = {}
        # (params, model_state, opt_state); a sharded mesh's new state is pinned to its
        # shardings inside the step
        kwargs: dict[str, Any] = {"donate_argnums": (0,) if donate else ()}
        if self.layout is None:
            kwargs["out_shardings"] = self.replicated
        self._train_step = jax.jit(count_traces(self.trace_counts, "step", self._step_fn), **kwargs)
        self._evaluate = jax.jit(count_traces(self.trace_counts, "evaluate", self._evaluate_fn))

    @property
    def num_devices(self) -> int:
        """The devices of the mesh."""
        return len(self.devices)

    @property
    def sharded(self) -> bool:
        """Whether the weights are split over the mesh (a ``mesh`` beyond ``data``)."""
        return self.layout is not None

    @property
    def batch_ways(self) -> int:
        """The row blocks a batch is split into (every batch size must be a multiple):
        the devices, or on a sharded mesh the sizes of its ``data`` and ``fsdp`` axes."""
        return self.layout.batch_ways if self.layout is not None else len(self.devices)

    @property
    def microbatches(self) -> int:
        """Microbatches per optimizer update: 1, the whole batch (as ``M`` of a pipeline)."""
        return 1

    # -- state ------------------------------------------------------------------------------

    def init(self, rng: jax.Array, sample: PyTree) -> DPState:
        """Initialises every layer from ``rng`` on a sample batch and replicates the state.

        As :meth:`Pipeline.init`: the variables come from ``fold_in(rng, 0)`` and dropout
        is seeded by ``fold_in(rng, 1)``, so both runners start from the same weights.

        Raises:
          PipelineError: for an ``rng`` that is not one PRNG key (``jax.random.key(0)``),
            or a sample leaf that is not an array of numbers.
        """
        check_key(rng, "init")
        check_arrays((("sample", sample),), "init: ")
        if self.layout is not None:  # every annotation checked before anything compiles
            shapes = jax.eval_shape(self.layers.init, jax.random.fold_in(rng, 0), sample)
            self._resolve([v.get("params", {}) for v in shapes])
        key = place(jax.random.fold_in(rng, 0), self.replicated)
        # by the programs a pipeline's stages use (pdjax.layers.init_programs), on the first
        # device: equal layers share one, also with earlier runners of this process
        variables, _ = init_on(
            self.layers.layers,
            0,
            key,
            place(sample, self.replicated),
            self.replicated,
            self.devices[0],
        )
        return self.state_from_variables(variables, jax.random.fold_in(rng, 1))

    def state_from_variables(
        self, variables: Sequence[Variables] | Mapping[str, Any], rng: jax.Array
    ) -> DPState:
        """A fresh state from given variables (pre-trained, restored): a per-layer list, or
        the merged tree of :meth:`LayerSequence.merge`. Optimizer state starts anew at step 0.

        The arrays are copied onto the mesh, so donation never deletes the caller's; on a
        sharded mesh each parameter onto its sharding (decided here, from the variables'
        shapes, if :meth:`init` has not).

        Raises:
          PipelineError: if the variables do not match the model's layer count, or
            ``rng`` is not one PRNG key.
          ShardingError: on a sharded mesh, for an annotation or rule that does not fit it.
        """
        check_key(rng, "state_from_variables")
        if isinstance(variables, Mapping):
            variables = self.layers.split(variables)
        if len(variables) != len(self.layers):
            raise PipelineError(
                f"got variables for {len(variables)} layers, the model has {len(self.layers)}"
            )
        raw = [v.get("params", {}) for v in variables]
        states = [{k: a for k, a in v.items() if k != "params"} for v in variables]
        if self.layout is None:
            params, model_state = self.replicate((raw, states))
            opt_state = self.replicate(jax.jit(self._optimizer.init)(params))
        else:
            self._resolve(raw)
            params = self.place_params(raw)
            model_state = self.replicate(states)
            opt_state = self.place_opt_state(jax.jit(self._optimizer.init)(params))
        return DPState(params, model_state, opt_state, 0, place(rng, self.replicated))

    def _resolve(self, params: Sequence[PyTree]) -> None:
        """Decides a sharded mesh's parameter shardings from per-layer parameters (arrays
        or shapes), checking them against the mesh; once."""
        if self.layout is not None and not self.layout.params:
            self.layout.resolve(
                self.layers.layers, list(params), f"DataParallel ({describe_mesh(self.mesh_axes)})"
            )

    def place_params(self, params: list[PyTree]) -> list[PyTree]:
        """A copy of per-layer parameters on the mesh: replicated, or on a sharded mesh
        each on its sharding (:attr:`layout`; decided first by :meth:`init` or
        :meth:`state_from_variables`)."""
        if self.layout is None:
            placed: list[PyTree] = self.replicate(params)
            return placed
        placed = _copy(jax.device_put(params, self._params_layout()))
        return placed

    def place_opt_state(self, opt_state: optax.OptState) -> optax.OptState:
        """A copy of optimizer state on the mesh: replicated, or on a sharded mesh each
        leaf shaped as a parameter (Adam's moments) sharded as that parameter."""
        if self.layout is None:
            return self.replicate(opt_state)
        return _copy(jax.device_put(opt_state, self.layout.like_params(opt_state)))

    def _params_layout(self) -> list[PyTree]:
        """The parameters' shardings; refused before they are decided."""
        if self.layout is None or not self.layout.params:
            raise PipelineError(
                "DataParallel's parameter shardings are decided by init or "
                "state_from_variables: make the state with this DataParallel first"
            )
        return self.layout.params

    def replicate(self, tree: PyTree) -> PyTree:
        """A copy of ``tree`` (weights, optimizer state) on every device, e.g. to put
        restored arrays into a :class:`DPState` with ``state._replace(opt_state=...)``
        (on a sharded mesh: :meth:`place_params`, :meth:`place_opt_state`)."""
        # device_put may reuse the caller's buffer as one replica (even with
        # may_alias=False when the devices differ); the jitted copy never does, so
        # donating the state cannot delete the caller's arrays.
        return _copy(place(tree, self.replicated))

    def variables(self, state: DPState) -> list[Variables]:
        """The per-layer variables (params and state)."""
        return [{**ms, "params": p} for p, ms in zip(state.params, state.model_state, strict=True)]

    def params(self, state: DPState) -> dict[str, Any]:
        """The full parameter tree ``{layer name: params}``."""
        return self.layers.merge(self.variables(state))["params"]

    # -- running ----------------------------------------------------------------------------

    def place_batch(self, tree: PyTree) -> PyTree:
        """Puts a batch (numpy or device arrays, any pytree) on the mesh, sharded on axis 0.

        Raises:
          PipelineError: if a leaf is not an array of numbers, the leaves disagree on the
            batch size or it is not a multiple of :attr:`batch_ways`.
        """
        check_arrays((("batch", tree),), "")
        sizes = {np.shape(leaf)[0] if np.ndim(leaf) else None for leaf in jax.tree.leaves(tree)}
        n = next(iter(sizes)) if len(sizes) == 1 else None
        if n is None:
            raise PipelineError(
                f"every input and target needs the same leading batch axis; got sizes {sizes}"
            )
        ways = self.batch_ways
        if n % ways and self.layout is not None:
            raise PipelineError(
                f"a batch of {n} samples cannot be split evenly into the {ways} row blocks "
                f"of mesh {describe_mesh(self.mesh_axes)} (its data and fsdp axes); use a "
                f"batch size that is a multiple of {ways} (e.g. {max(1, n // ways) * ways}) "
                "or a mesh with smaller data and fsdp axes"
            )
        if n % ways:
            raise PipelineError(
                f"a batch of {n} samples cannot be sharded evenly over {ways} "
                f"devices; use a batch size that is a multiple of {ways} "
                f"(e.g. {max(1, n // ways) * ways}) or pass fewer "
                "devices=..."
            )
        return place(tree, self.batch_sharding)

    def step(self, state: DPState, batch: tuple[PyTree, PyTree]) -> tuple[DPState, DPMetrics]:
        """One optimizer step on ``batch = (inputs, targets)``, sharded over the devices.

        With ``donate=True`` (the default) ``state``'s arrays are consumed.

        Raises:
          PipelineError: for a state that is not a :class:`DPState` (a pipeline's state),
            a batch that is not an ``(inputs, targets)`` pair of arrays, or a batch size
            that is not a multiple of :attr:`batch_ways`.
        """
        t0 = time.perf_counter()
        _check_state(state, "step")
        if not (isinstance(batch, tuple | list) and len(batch) == 2):
            raise PipelineError(
                f"step takes one (inputs, targets) pair, got a {type(batch).__name__}"
                + (f" of {len(batch)} items" if isinstance(batch, tuple | list) else "")
            )
        inputs, targets = self.place_batch(batch)
        params, model_state, opt_state, loss = self._train_step(
            (state.params, state.model_state, state.opt_state),
            state.rng,
            state.step,
            inputs,
            targets,
        )
        new_state = DPState(params, model_state, opt_state, state.step + 1, state.rng)
        host = time.perf_counter() - t0
        aux = None
        if isinstance(loss, tuple):
            loss, aux = loss
        self._run_ahead.dispatched(loss)  # bounded on XLA's CPU client (pdjax._xla_cpu)
        return new_state, DPMetrics(
            [loss], host, self.workarounds.reasons, None if aux is None else [aux]
        )

    def run(
        self,
        state: DPState,
        microbatches: Sequence[tuple[PyTree, PyTree]],
        *,
        on_loss: Callable[[int, jax.Array], None] | None = None,
    ) -> tuple[DPState, DPMetrics]:
        """One :meth:`step` on each batch of the stream, in order (a step's microbatch is
        its batch); ``on_loss(k, loss)`` is called once batch ``k``'s step is dispatched.

        Returns:
          The last state and the steps' metrics together: a loss (and ``aux``) per step,
          their host seconds summed, one action each.

        Raises:
          PipelineError: for no batches, or as :meth:`step` does.
        """
        _check_state(state, "run")
        check_callback("on_loss", on_loss, "on_loss(k, loss)")
        microbatches = check_stream("batches", microbatches, "run")
        if not microbatches:
            raise PipelineError("run needs at least one (inputs, targets) batch")
        losses: list[jax.Array] = []
        aux: list[PyTree] = []
        host = 0.0
        metrics = None
        for k, batch in enumerate(microbatches):
            state, metrics = self.step(state, batch)
            losses += metrics.losses
            aux += metrics.aux or []
            host += metrics.host_seconds
            if on_loss is not None:
                on_loss(k, metrics.losses[0])
        assert metrics is not None  # at least one batch
        return state, DPMetrics(
            losses=losses,
            host_seconds=host,
            workarounds=metrics.workarounds,
            aux=aux if metrics.aux is not None else None,
            actions=len(losses),
        )

    def predict(self, state: DPState, inputs: PyTree, *, batch_size: int | None = None) -> PyTree:
        """The model's outputs for ``inputs`` in eval mode (:meth:`evaluate`), in batches of
        ``batch_size`` rows (default: all at once), concatenated. ``state`` is not consumed.

        Raises:
          PipelineError: for no rows, or a batch whose size is not a multiple of
            :attr:`batch_ways`.
        """
        _check_state(state, "predict")
        check_arrays((("inputs", inputs),), "")
        n = {np.shape(leaf)[0] if np.ndim(leaf) else 0 for leaf in jax.tree.leaves(inputs)}
        rows = max(n) if n else 0
        if rows < 1:
            raise PipelineError("predict needs inputs of at least one row, got 0 rows")
        if batch_size is not None and (
            isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral)
            or batch_size < 1
        ):  # fmt: skip
            raise PipelineError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        size = rows if batch_size is None else batch_size
        outs = [
            self.evaluate(state, jax.tree.map(lambda a, k=k: a[k : k + size], inputs))
            for k in range(0, rows, size)
        ]
        if len(outs) == 1:
            return outs[0]
        return jax.tree.map(lambda *a: jnp.concatenate(a), *outs)

    def evaluate(self, state: DPState, inputs: PyTree) -> PyTree:
        """The model's outputs in eval mode (no dropout, BatchNorm running statistics).

        Args:
          state: the training state (not consumed).
          inputs: a batch ``(B, ...)`` with ``B`` a multiple of :attr:`batch_ways`.

        Returns:
          The outputs (e.g. logits ``(B, num_classes)``), sharded on the batch axis.

        Raises:
          PipelineError: for a state that is not a :class:`DPState`, a leaf that is not an
            array of numbers, or a batch size that is not a multiple of :attr:`batch_ways`.
        """
        _check_state(state, "evaluate")
        return self._evaluate(state.params, state.model_state, self.place_batch(inputs))

    # -- jitted bodies ----------------------------------------------------------------------

    def _step_fn(
        self,
        trained: tuple[list[PyTree], list[Variables], optax.OptState],
        rng: jax.Array,
        step: jax.Array,
        inputs: PyTree,
        targets: PyTree,
    ) -> tuple[list[PyTree], list[Variables], optax.OptState, jax.Array]:
        # what the step replaces comes as one argument, so that one donation covers it
        params, model_state, opt_state = trained
        key = jax.random.fold_in(rng, step)

        def objective(p: list[PyTree]) -> tuple[jax.Array, tuple[list[Variables], PyTree]]:
            variables = [{**s, "params": q} for q, s in zip(p, model_state, strict=True)]
            outputs, new_state = self.layers.apply(variables, inputs, train=True, rng=key)
            loss, aux = split_loss(self.loss_fn(outputs, targets))
            return loss, (new_state, aux)

        (loss, (new_state, aux)), grads = jax.value_and_grad(objective, has_aux=True)(params)
        if self.layout is not None:  # each gradient reduced onto its parameter's shards
            grads = jax.lax.with_sharding_constraint(grads, self._params_layout())
        updates, opt_state = self._optimizer.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        if self.layout is not None:  # the new state keeps the shardings it came with
            new_params = jax.lax.with_sharding_constraint(new_params, self._params_layout())
            o_layout = self.layout.like_params(opt_state)
            opt_state = jax.lax.with_sharding_constraint(opt_state, o_layout)
            new_state = jax.lax.with_sharding_constraint(new_state, self.replicated)
        return new_params, new_state, opt_state, with_aux(loss, aux)

    def _evaluate_fn(
        self, params: list[PyTree], model_state: list[Variables], inputs: PyTree
    ) -> PyTree:
        variables = [{**s, "params": p} for p, s in zip(params, model_state, strict=True)]
        return self.layers.apply(variables, inputs, train=False)[0]


def _mesh_of(mesh: Any, devices: int) -> MeshAxes | None:
    """``mesh`` (a dict or pairs) as :func:`~pdjax.layers.sharding.mesh_axes`, checked to span
    ``devices``; None for no mesh or one of ``data`` alone (replicated)."""
    if mesh is None:
        return None
    if isinstance(mesh, str | bytes):
        raise MeshError(
            f"DataParallel mesh takes a dict or (axis, size) pairs, got the text {mesh!r}; "
            "read text with pdjax.layers.sharding.parse_mesh, or write e.g. "
            "{'fsdp': 4, 'tensor': 2}"
        )
    if not isinstance(mesh, Mapping | Sequence):
        raise MeshError(
            "DataParallel mesh takes a dict or (axis, size) pairs such as "
            f"{{'fsdp': 4, 'tensor': 2}}, got a {type(mesh).__name__}"
        )
    axes = mesh_axes(mesh)
    if mesh_size(axes) != devices:
        raise MeshError(
            f"DataParallel mesh {describe_mesh(axes)} spans {mesh_size(axes)} devices, it has "
            f"{devices}: the mesh's sizes must multiply to the device count (pass "
            "devices=... or change the mesh)"
        )
    return axes if is_sharded(axes) else None


def _check_state(state: Any, call: str) -> None:
    """Refuses a ``state`` that is not a :class:`DPState` (a pipeline's, a tuple)."""
    if not isinstance(state, DPState):
        other = (
            " (a Pipeline's state: run it with that Pipeline, or move the weights with "
            "state_from_variables(pipe.variables(state), rng))"
            if type(state).__name__ == "PipelineState"
            else ""
        )
        raise PipelineError(
            f"{call}: state must be the DPState that this DataParallel's init (or step, run) "
            f"returned, got a {type(state).__name__}{other}"
        )
