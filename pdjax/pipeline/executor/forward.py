"""The pipeline's forward-only calls: the newest weights read out
(:meth:`Forward.variables`, :meth:`Forward.params`, into the user's nnx or linen model),
evaluation, prediction and per-item results (:meth:`Forward.collect`, what greedy
generation reads) through the stages in eval mode, in one process or across several
(activations cross between stages through the pipeline's transport), and the values that
cross processes to reach every one of them (the last stage's losses, a stage's weights)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from pdjax import export
from pdjax._sharding import held, shard_on
from pdjax.distributed import allgather_json
from pdjax.errors import PipelineError
from pdjax.layers import LayerSequence, PyTree, Variables
from pdjax.pipeline.executor.arguments import check_callback, check_stream
from pdjax.pipeline.executor.cached_generation import CachedGeneration
from pdjax.pipeline.executor.checks import Checker, check_pairs, shared_rows
from pdjax.pipeline.executor.config import integer
from pdjax.pipeline.executor.decisions import Decisions
from pdjax.pipeline.executor.generation import generate
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
        # across processes: every stage's eval output shapes per item shapes, the links
        # set up and built, and the last stage's programs that stack or finish its values
        self._eval_specs: dict[Any, list[Any]] = {}
        self._connected: set[tuple[int, bool]] = set()
        self._links: dict[Any, Callable[[Any], Any]] = {}
        self._stackers: dict[int, Callable[[list[Any]], Any]] = {}
        self._finishers: dict[Callable[..., Any], Callable[..., Any]] = {}
        # cached generation's stage programs, built on its first call; what generate
        # said (once each) about calls that ran without the cache
        self._generation: CachedGeneration | None = None
        self.generation_notes: set[str] = set()

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

        Across processes (:attr:`Pipeline.multiprocess`) it is collective: every process
        calls it with the same batches; activations cross between stages as in
        :meth:`Pipeline.run`, the last stage's per-batch values reach every process, and
        every process returns the same dict.

        Returns:
          ``{"loss": ..., "samples": n}``, and the means of the loss function's aux
          outputs (``loss_fn -> (loss, aux)``): a dict ``aux`` merged in (``{"loss",
          "samples", "accuracy", ...}``), any other aux under ``"aux"``. Every mean is
          over the batches weighted by their sizes, which is the mean over the samples
          for a loss (or metric) that is a per-sample mean. ``metrics(outputs, targets)
          -> {name: scalar}``, an evaluation-only function (e.g. accuracy beside a loss
          without aux), adds its means too (computed on the last stage).

        Raises:
          PipelineError: for no batches; and as :meth:`Pipeline.run` does for a state or
          batches that do not fit.
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
        values = self._everywhere(
            state, outs, [b[0] for b in batches], [b[1] for b in batches], metrics
        )
        self._drained(values)
        weights = sizes / sizes.sum()
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
        consumed.

        Across processes (:attr:`Pipeline.multiprocess`) it is collective: every process
        calls it with the same inputs, and the outputs stay where the last stage computed
        them: a process that holds a device of the last stage gets them (arrays of the
        last stage's sharding, global where that stage spans processes), every other
        process gets None: the outputs do not cross to it (:meth:`evaluate`,
        :meth:`collect` and :meth:`Pipeline.generate` bring their small results to every
        process)."""
        n = shared_rows((("inputs", inputs),), "")
        if n < 1:
            raise PipelineError("predict needs inputs of at least one row, got 0 rows")
        size = n if batch_size is None else integer("batch_size", batch_size, 1)
        chunks = [jax.tree.map(lambda a, k=k: a[k : k + size], inputs) for k in range(0, n, size)]
        self._check_forward(state, chunks[0])
        self.checker.check_items(state, chunks, "batch", with_targets=False)
        outs = self._forward_stream(state, chunks, None)
        self._drained(outs)
        if outs[0] is None:  # another process holds the last stage
            return None
        if len(outs) == 1:
            return outs[0]
        return jax.tree.map(lambda *a: jnp.concatenate(a), *outs)

    def collect(
        self,
        state: PipelineState,
        inputs: Sequence[PyTree],
        finish: Callable[..., PyTree],
        extras: Sequence[PyTree],
    ) -> list[PyTree]:
        """Per item of ``inputs``, ``finish(outputs, extra)`` of the model's eval-mode
        outputs (forward only through the stages, as :meth:`predict`), computed on the
        last stage's devices (jitted; keep it small: an argmax, a reduction) with that
        item's ``extras`` entry (arrays, placed beside the outputs), as host (numpy)
        values on every process. Collective across processes, like :meth:`evaluate`;
        ``state`` is not consumed."""
        inputs = list(inputs)
        if not inputs or len(extras) != len(inputs):
            raise PipelineError(
                f"collect needs one extra per input item, got {len(extras)} for "
                f"{len(inputs)} inputs"
            )
        self._check_forward(state, inputs[0])
        self.checker.check_items(state, inputs, "batch", with_targets=False)
        last = self.stage_set.stages[-1]
        fn = self._finishers.get(finish)
        if fn is None:
            fn = self._finishers[finish] = jax.jit(finish, out_shardings=last.replicated)
        outs = self._forward_stream(state, inputs, None)
        local = self.stage_set.local[-1]
        done = [
            fn(y, last.place_weights(e)) if local else None
            for y, e in zip(outs, extras, strict=True)
        ]
        if self.stage_set.multiprocess:
            specs = [
                jax.eval_shape(finish, sp[-1], abstract(e))
                for sp, e in zip(self._out_specs(state, inputs, None, None), extras, strict=True)
            ]
            done = self._broadcast_last(done, specs)
        values = [jax.tree.map(np.asarray, v) for v in jax.device_get(done)]
        self._drained(values)
        return values

    def output_spec(self, state: PipelineState, x: PyTree) -> Any:
        """The shapes of the model's eval-mode outputs for inputs like ``x``, through the
        stages (nothing runs). Raises :class:`PipelineError` for inputs the model does not
        take (naming the layer), as :meth:`predict` does."""
        self._check_forward(state, x)
        self.checker.check_items(state, [x], "batch", with_targets=False)
        return self._out_specs(state, [x], None, None)[0][-1]

    def generate(
        self,
        state: PipelineState,
        prompt_tokens: Any,
        max_new_tokens: int,
        *,
        context: int | None = None,
        cache: bool | Literal["auto"] = "auto",
        microbatches: int = 1,
    ) -> np.ndarray:
        """Greedy decoding through the stages, with a key/value cache where it applies
        (:func:`.generation.generate`)."""
        return generate(
            self,
            state,
            prompt_tokens,
            max_new_tokens,
            context=context,
            cache=cache,
            microbatches=microbatches,
        )

    def cached_generation(self) -> CachedGeneration:
        """The stage programs of cached generation (built once, on first use)."""
        if self._generation is None:
            self._generation = CachedGeneration(self.stage_set)
        return self._generation

    def _check_forward(self, state: Any, x: PyTree) -> None:
        """What :meth:`evaluate` and :meth:`predict` refuse before any device work."""
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
        with ``targets`` its losses (and aux); None where this process holds none of the
        last stage's devices. Across processes every process walks the same ticks, so
        the transfers between stages pair up in one order everywhere."""
        ss = self.stage_set
        stages = ss.stages
        S, N = len(stages), len(inputs)
        with_loss = targets is not None
        progs = [
            st.eval_program(with_loss and s == S - 1, metrics if s == S - 1 else None)
            for s, st in enumerate(stages)
        ]
        multi = ss.multiprocess
        specs = self._out_specs(state, inputs, None, None) if multi else None
        rows = [_rows(x) for x in inputs]
        if multi:
            self._connect(rows)
        cur: list[Any] = list(inputs)
        for tick in range(N + S - 1):
            for s in reversed(range(S)):
                k = tick - s
                if not 0 <= k < N:
                    continue
                stage = stages[s]
                if not multi:
                    x = stage.place_eval(cur[k])
                elif not ss.local[s]:
                    y = None
                else:
                    x = stage.place_eval(cur[k]) if s == 0 else cur[k]
                if not multi or ss.local[s]:
                    args = [state.params[s], state.model_state[s], x]
                    if with_loss and s == S - 1:
                        assert targets is not None
                        args.append(stage.place_eval(targets[k]))
                    y = progs[s](*args)
                if multi and s < S - 1:
                    assert specs is not None
                    y = self._move(s, y, specs[k][s], rows[k])
                cur[k] = y
        return cur

    def _out_specs(
        self,
        state: PipelineState,
        inputs: Sequence[PyTree],
        targets: Sequence[PyTree] | None,
        metrics: Callable[..., Any] | None,
    ) -> list[list[Any]]:
        """Per item, the shapes of every stage's eval-mode output (the last stage's: its
        outputs, or with ``targets`` what its loss program returns), traced once per
        shapes of the item and the state; every process can compute them."""
        stages = self.stage_set.stages
        S = len(stages)
        out = []
        for k, x in enumerate(inputs):
            t = None if targets is None else targets[k]
            key = (
                shape_key(x),
                None if t is None else shape_key(t),
                metrics,
                shape_key(state.params),
                shape_key(state.model_state),
            )
            found = self._eval_specs.get(key)
            if found is None:
                found, y = [], abstract(x)
                for s, st in enumerate(stages):
                    loss = t is not None and s == S - 1
                    args = [abstract(state.params[s]), abstract(state.model_state[s]), y]
                    if loss:
                        args.append(abstract(t))
                    prog = st.eval_program(loss, metrics if loss else None)
                    y = jax.eval_shape(prog, *args)
                    found.append(y)
                if len(self._eval_specs) > 256:
                    self._eval_specs.clear()
                self._eval_specs[key] = found
            out.append(found)
        return out

    def _connect(self, rows: list[int]) -> None:
        """Sets up, before the first transfer, every link between stages that a stream of
        items of ``rows`` rows uses (each process the ones it joins; the same order
        everywhere)."""
        stages = self.stage_set.stages
        for s in range(len(stages) - 1):
            for whole in sorted({not self._as_batch(s, n) for n in rows}):
                if (s, whole) not in self._connected:
                    self.transport.connect(stages[s], stages[s + 1], replicated=whole)
                    self._connected.add((s, whole))

    def _as_batch(self, s: int, n: int) -> bool:
        """Whether an item of ``n`` rows crosses from stage ``s`` to ``s + 1`` split along
        its rows (both stages split it evenly), rather than whole."""
        stages = self.stage_set.stages
        return n % stages[s].batch_ways == 0 and n % stages[s + 1].batch_ways == 0

    def _move(self, s: int, y: Any, spec: Any, n: int) -> Any:
        """Stage ``s``'s output ``y`` (None where this process holds none of its devices)
        on stage ``s + 1``, laid out as :meth:`Stage.place_eval` lays out an item of ``n``
        rows there; None where this process holds none of its devices. Collective: every
        process calls it for every item, in the same order."""
        ss = self.stage_set
        src, dst = ss.stages[s], ss.stages[s + 1]
        if not (ss.local[s] or ss.local[s + 1]):
            return None
        if src.devices == dst.devices:
            return y
        me = {ss.process_index}
        if ss.owners[s] == ss.owners[s + 1] == me:
            return dst.place_eval(y)
        batch = self._as_batch(s, n)
        if y is not None and src.num_replicas > 1:  # the layout the transfer reads
            y = jax.device_put(y, src.batch_sharding if batch else src.replicated)
        key = (s, shape_key(spec), batch)
        link = self._links.get(key)
        if link is None:
            link = self._links[key] = self.transport.link(src, dst, spec, replicated=not batch)
        got = link(y)
        if got is not None and not batch and dst.num_replicas > 1 and n % dst.batch_ways == 0:
            got = jax.device_put(got, dst.batch_sharding)
        return got

    def _everywhere(
        self,
        state: PipelineState,
        outs: list[Any],
        inputs: list[PyTree],
        targets: list[PyTree],
        metrics: Callable[..., Any] | None,
    ) -> list[Any]:
        """The last stage's per-item values ``outs`` (losses, aux, metrics) as host values
        on every process (across processes they come from the last stage's)."""
        if self.stage_set.multiprocess:
            specs = [sp[-1] for sp in self._out_specs(state, inputs, targets, metrics)]
            outs = self._broadcast_last(outs, specs)
        got: list[Any] = jax.device_get(outs)
        return got

    def _broadcast_last(self, values: list[Any], specs: list[Any]) -> list[Any]:
        """Per-item values of the last stage (None where this process holds none of its
        devices; shapes ``specs``) on every process: stacked into one array per leaf when
        every item's shapes agree, else item by item."""
        ss = self.stage_set
        last = ss.num_stages - 1
        local = ss.local[last]
        n = len(values)
        if all(shape_key(sp) == shape_key(specs[0]) for sp in specs):
            if local:
                stacked = self._stack(ss.stages[last])(values)
            else:
                stacked = jax.tree.map(
                    lambda a: jax.ShapeDtypeStruct((n, *a.shape), a.dtype), specs[0]
                )
            stacked = jax.device_get(self.broadcast(last, stacked))
            return [jax.tree.map(lambda a, k=k: a[k], stacked) for k in range(n)]
        tree = values if local else [abstract(sp) for sp in specs]
        got: list[Any] = self.broadcast(last, tree)
        return got

    def _stack(self, stage: Any) -> Callable[[list[Any]], Any]:
        """One program per stage: items' values (trees alike) as one tree of ``[n, ...]``,
        replicated on the stage's devices."""
        fn = self._stackers.get(stage.index)
        if fn is None:
            fn = self._stackers[stage.index] = jax.jit(
                lambda trees: jax.tree.map(lambda *a: jnp.stack(a), *trees),
                out_shardings=stage.replicated,
            )
        return fn

    def _drained(self, values: Any) -> None:
        """Across processes, returns once every process is done with the call: what this
        process sent has left and its results are computed (see ``calls.execute``: a
        process that went on at once could enter another collective while a transfer
        its peer still needs waits behind it)."""
        if not self.stage_set.multiprocess:
            return
        self.transport.drain()
        # jax leaves block_until_ready unannotated
        jax.block_until_ready([a for a in jax.tree.leaves(values) if held(a)])
        allgather_json("pipeline forward drained")

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


def _rows(tree: PyTree) -> int:
    """The rows (leading dimension) of an item's first leaf."""
    leaves = jax.tree.leaves(tree)
    return int(np.shape(leaves[0])[0]) if leaves else 0
