"""The pipeline's forward-only calls: the newest weights read out
(:meth:`Forward.variables`, :meth:`Forward.params`, into the user's nnx or linen model),
evaluation and prediction through the stages in eval mode, and the values that cross
processes to reach every one of them (the last stage's losses, a stage's weights)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pdjax import export
from pdjax._sharding import shard_on
from pdjax.errors import PipelineError
from pdjax.layers import LayerSequence, PyTree, Variables
from pdjax.pipeline.executor.arguments import check_callback, check_stream
from pdjax.pipeline.executor.checks import Checker, check_pairs, shared_rows
from pdjax.pipeline.executor.config import integer
from pdjax.pipeline.executor.decisions import Decisions
from pdjax.pipeline.executor.stages import StageSet
from pdjax.pipeline.executor.state import PipelineState
from pdjax.pipeline.executor.trees import abstract, plain, shape_key
from pdjax.pipeline.stage import split_loss, with_aux
from pdjax.pipeline.transport import Transport

__all__ = ["Forward"]


class Forward:
    """Reading the weights out, evaluation and prediction (see the module), over the
    pipeline's stages, checks and transport."""

    def __init__(
        self,
        stage_set: StageSet,
        layers: LayerSequence,
        checker: Checker,
        decisions: Decisions,
        transport: Transport,
    ) -> None:
        self.stage_set = stage_set
        self.layers = layers
        self.checker = checker
        self.decisions = decisions
        self.transport = transport
        # loss_spec's answers by the shapes they depend on: tracing the model again for
        # every call cost the first stage's driver about 0.9 ms of CPU per microbatch on
        # the cluster benchmark (mlp-512, 24 microbatches per call)
        self._loss_specs: dict[Any, Any] = {}

    def variables(self, state: PipelineState) -> list[Variables]:
        """The per-layer variables (params and state) of the newest weights.

        In a multi-process run (:attr:`Pipeline.multiprocess`) this is collective: every process
        must call it, and each gets all the variables, another process's stages copied to
        its own first device."""
        out: list[Variables] = []
        pairs: Iterable[tuple[list[PyTree], list[Variables]]]
        pairs = zip(state.params, state.model_state, strict=True)
        if self.stage_set.multiprocess:
            pairs = (
                self.broadcast(s, (p, ms)) for s, (p, ms) in enumerate(pairs)
            )  # in stage order, the same in every process
        for params, model_state in pairs:
            for p, ms in zip(params, model_state, strict=True):
                out.append({**ms, "params": p})
        return out

    def params(self, state: PipelineState) -> dict[str, Any]:
        """The full parameter tree ``{layer name: params}`` of the newest weights."""
        return self.layers.merge(self.variables(state))["params"]

    def update_nnx(
        self, state: PipelineState, model: Any = None, *, device: jax.Device | None = None
    ) -> Any:
        """Writes the newest weights and model state into the nnx modules the layers were
        built from, on one ``device`` (:func:`pdjax.export.update_nnx`); returns
        ``model`` (the user's whole model, checked to hold them)."""
        return export.update_nnx(self.layers, self.variables(state), model, device=device)

    def linen_variables(
        self,
        state: PipelineState,
        names: Sequence[str | None] | Mapping[str, str] | None = None,
        *,
        device: jax.Device | None = None,
    ) -> dict[str, dict[str, Any]]:
        """The newest variables as the user's linen tree ``{collection: {submodule name:
        ...}}`` on one ``device`` (:func:`pdjax.export.linen_variables`; default names:
        the layers' names)."""
        return export.linen_variables(self.layers, self.variables(state), names, device=device)

    def evaluate(
        self,
        state: PipelineState,
        batches: Iterable[tuple[PyTree, PyTree]],
        *,
        metrics: Callable[[PyTree, PyTree], Mapping[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """The loss and the loss function's metrics over ``batches`` of ``(inputs,
        targets)``, in eval mode (no dropout, BatchNorm running statistics), forward only,
        through the stages: each stage runs on its own devices with the newest weights
        (nothing is gathered on one device), batch ``k`` at stage ``s`` while batch
        ``k + 1`` runs at stage ``s - 1``. ``state`` is not consumed.

        Returns:
          ``{"loss": ..., "samples": n}``, and the means of the loss function's aux
          outputs (``loss_fn -> (loss, aux)``): a dict ``aux`` merged in (``{"loss",
          "samples", "accuracy", ...}``), any other aux under ``"aux"``. Every mean is
          over the batches weighted by their sizes, which is the mean over the samples
          for a loss (or metric) that is a per-sample mean. ``metrics(outputs, targets)
          -> {name: scalar}``, an evaluation-only function (e.g. accuracy beside a loss
          without aux), adds its means too (computed on the last stage).

        Raises:
          PipelineError: for no batches, or a pipeline spanning processes (not supported
          yet: evaluate on :meth:`variables` there); and as :meth:`Pipeline.run` does for a state
          or batches that do not fit.
        """
        batches = check_stream("batches", batches, "evaluate")
        check_callback("metrics", metrics, "metrics(outputs, targets) -> {name: scalar}")
        if not batches:
            raise PipelineError("evaluate needs at least one (inputs, targets) batch")
        check_pairs(batches, "evaluate", "batches")
        self._check_forward(state, batches[0][0])
        sizes = np.array(self.checker.check_items(state, batches, "batch", True), np.float64)
        outs = self._forward_stream(
            state, [b[0] for b in batches], [b[1] for b in batches], metrics
        )
        weights = sizes / sizes.sum()
        values = jax.device_get(outs)
        extra: dict[str, Any] = {}
        if metrics is not None:  # (loss, aux, metrics) per batch
            extra = jax.tree.map(
                lambda *a: plain(np.tensordot(weights, np.stack(a).astype(np.float64), axes=1)),
                *[v[2] for v in values],
            )
            values = [with_aux(v[0], v[1]) for v in values]
        losses = [v[0] if isinstance(v, tuple) else v for v in values]
        result: dict[str, Any] = {
            "loss": float(np.dot(weights, np.asarray(losses, np.float64))),
            "samples": int(sizes.sum()),
        }
        if values and isinstance(values[0], tuple):
            aux = jax.tree.map(
                lambda *a: plain(np.tensordot(weights, np.stack(a).astype(np.float64), axes=1)),
                *[v[1] for v in values],
            )
            if isinstance(aux, Mapping) and not {"loss", "samples"} & set(aux):
                result.update(aux)
            else:
                result["aux"] = aux
        result.update(extra)
        return result

    def predict(
        self, state: PipelineState, inputs: PyTree, *, batch_size: int | None = None
    ) -> PyTree:
        """The model's outputs for ``inputs`` in eval mode, forward only through the
        stages (see :meth:`evaluate`), in batches of ``batch_size`` rows (default: all
        at once), concatenated: arrays on the last stage's devices. ``state`` is not
        consumed."""
        n = shared_rows((("inputs", inputs),), "")
        if n < 1:
            raise PipelineError("predict needs inputs of at least one row, got 0 rows")
        size = n if batch_size is None else integer("batch_size", batch_size, 1)
        chunks = [jax.tree.map(lambda a, k=k: a[k : k + size], inputs) for k in range(0, n, size)]
        self._check_forward(state, chunks[0])
        self.checker.check_items(state, chunks, "batch", with_targets=False)
        outs = self._forward_stream(state, chunks, None)
        if len(outs) == 1:
            return outs[0]
        return jax.tree.map(lambda *a: jnp.concatenate(a), *outs)

    def _check_forward(self, state: Any, x: PyTree) -> None:
        """What :meth:`evaluate` and :meth:`predict` refuse before any device work."""
        if self.stage_set.multiprocess:
            raise PipelineError(
                "evaluate and predict run in one process; across processes gather the "
                "weights with pipe.variables(state) and evaluate them on one device"
            )
        self.checker.check_state(state, x)

    def _forward_stream(
        self,
        state: PipelineState,
        inputs: list[PyTree],
        targets: list[PyTree] | None,
        metrics: Callable[..., Any] | None = None,
    ) -> list[Any]:
        """Eval-mode forwards of a stream through the stages, dispatched as a wavefront
        (stage ``s`` takes item ``k`` at tick ``k + s``): the last stage's outputs, or
        with ``targets`` its losses (and aux)."""
        stages = self.stage_set.stages
        S, N = len(stages), len(inputs)
        with_loss = targets is not None
        progs = [
            st.eval_program(with_loss and s == S - 1, metrics if s == S - 1 else None)
            for s, st in enumerate(stages)
        ]
        cur: list[Any] = list(inputs)
        for tick in range(N + S - 1):
            for s in reversed(range(S)):
                k = tick - s
                if not 0 <= k < N:
                    continue
                stage = stages[s]
                args = [state.params[s], state.model_state[s], stage.place_eval(cur[k])]
                if with_loss and s == S - 1:
                    assert targets is not None
                    args.append(stage.place_eval(targets[k]))
                cur[k] = progs[s](*args)
        return cur

    def loss_spec(self, state: PipelineState, mb: tuple[PyTree, PyTree]) -> Any:
        """The shapes of what the last stage's forward leaves for a microbatch like ``mb``:
        its loss, or ``(loss, aux)``. Remembered per shapes of the microbatch, weights and
        model state."""
        key = (shape_key(mb), shape_key(state.params), shape_key(state.model_state))
        found = self._loss_specs.get(key)
        if found is None:
            found = self._loss_specs[key] = self._trace_loss_spec(state, mb)
        return found

    def _trace_loss_spec(self, state: PipelineState, mb: tuple[PyTree, PyTree]) -> Any:
        x, t = abstract(mb[0]), abstract(mb[1])
        S = self.stage_set.num_stages
        y = self.decisions.stage_outputs(state, x)[-1] if S > 1 else x
        layers = self.stage_set.stages[-1]
        loss_fn = layers.loss_fn
        assert loss_fn is not None

        def loss(p: Any, st: Any, y: Any, t: Any) -> Any:
            out = layers.microbatch_output(p, st, y, jax.random.key(0))
            return with_aux(*split_loss(loss_fn(out, t)))

        last = S - 1
        return jax.eval_shape(
            loss, abstract(state.params[last]), abstract(state.model_state[last]), y, t
        )

    def broadcast(self, s: int, tree: PyTree) -> PyTree:
        """``tree`` of stage ``s`` (real on its process, shapes elsewhere) on every process;
        elsewhere on that process's first device. Every process calls it, in one order;
        values travel through the pipeline's transport."""
        stage = self.stage_set.stages[s]
        source = stage.devices[0]  # one replica, from the process that holds this device
        if source.process_index == self.stage_set.process_index:
            tree = jax.tree.map(lambda a: shard_on(stage.place_weights(a), source), tree)
        return self.transport.broadcast(tree, source)
