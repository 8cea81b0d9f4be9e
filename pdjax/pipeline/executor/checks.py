"""What the pipeline's calls check before any device work: that a state is one this
pipeline makes (not consumed, of its layout), that the inputs and targets fit the model's
weights and the loss function (traced on shapes, once per layout), and that items are
``(inputs, targets)`` pairs with one row per sample in every leaf."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pdjax.errors import PdjaxError, PipelineError
from pdjax.layers import LayerSequence, PyTree, Variables
from pdjax.layers.init_programs import init_layers
from pdjax.pipeline.executor.arguments import check_arrays
from pdjax.pipeline.executor.stages import StageSet
from pdjax.pipeline.executor.state import PipelineState
from pdjax.pipeline.executor.trees import abstract, shapes_text
from pdjax.pipeline.optim import StageOptimizer
from pdjax.pipeline.stage import LossFn, split_loss

__all__ = ["Checker", "Settle", "split_batch"]

Settle = Callable[[Sequence[PyTree]], tuple[list[PyTree], StageOptimizer]]
"""Settles the ties and the optimizer on a state's per-stage parameters (arrays or
shapes), once: returns the parameters as each stage's optimizer sees them, and it."""


class Checker:
    """The checks of what a call is given (see the module), and what they remember: the
    layers' traced shapes, the state layouts this pipeline made, the shapes init saw, and
    the item layouts found to fit.

    Args:
      stage_set: the pipeline's stages.
      layers: the model.
      loss_fn: the loss.
      settle: how the pipeline settles ties and optimizer on a state's parameters.
    """

    def __init__(
        self, stage_set: StageSet, layers: LayerSequence, loss_fn: LossFn, settle: Settle
    ) -> None:
        self.stage_set = stage_set
        self.layers = layers
        self.loss_fn = loss_fn
        self.settle = settle
        # Per layer, layout of its variables (None: made by init) and input: the variables
        # init makes (or None) and the output's shapes (check_shapes).
        self._layer_shapes: dict[Any, Any] = {}
        # What the API checks once and then trusts (check_state, check_items): the
        # layouts of the states this pipeline made, the last one first; the shapes of the
        # sample init saw (for messages); per layout of an item (or of a call's items)
        # found to fit the weights of the state layout _fits_layout, its rows.
        self._state_layouts: list[Any] = []
        self.init_shapes: str | None = None
        self._fits: dict[Any, Any] = {}
        self._fits_layout: Any = None

    def check_shapes(self, sample: PyTree, variables: Sequence[Variables] | None = None) -> Any:
        """Traces the model layer by layer on ``sample`` (shapes only, no FLOPs), with
        ``variables`` (per layer; default: those init would make for ``sample``), and
        returns the shapes of the model's output.

        Each layer is traced once per layout of its variables and input, and remembered
        (the first step traces nothing that init traced already); without ``variables``,
        one trace per layer makes its variables and its output together.

        Raises:
          PipelineError: naming the stage, the layer and the input shapes that fail.
        """
        made, y = self._trace_layers(abstract(sample), variables)
        if self.stage_set.tied_stages:
            self.layers.check_tied(made if variables is None else variables)
        return y

    def _trace_layers(
        self, x: PyTree, variables: Sequence[Variables] | None
    ) -> tuple[list[Variables], PyTree]:
        """:meth:`check_shapes` on ``x`` (shapes) without the ties' check: the variables
        made per layer (as shapes; none where ``variables`` are given) and the output."""
        made: list[Variables] = []
        for s, spec in enumerate(self.stage_set.specs):
            for i in range(spec.first_layer, spec.last_layer + 1):
                if variables is None:
                    v, x = self._layer_init_shapes(s, i, x)
                    made.append(v)
                else:
                    x = self._layer_output_shapes(s, i, variables[i], x)
        return made, x

    def _layer_init_shapes(self, s: int, i: int, x: PyTree) -> tuple[Variables, PyTree]:
        """Layer ``i``'s variables as init makes them for input ``x`` and its output, as
        shapes (one trace of both, remembered with the output for those variables)."""
        key = (i, None, _shape_key(x))
        known = self._layer_shapes.get(key)
        if known is None:
            layer = self.layers.layers[i]
            with _naming(s, i, layer.name, x):
                (v,), y = jax.eval_shape(partial(init_layers, (layer,), i), jax.random.key(0), x)
            known = self._remember(key, (v, y))
            self._remember((i, _shape_key(v), key[2]), y)
        return known  # type: ignore[no-any-return]

    def _layer_output_shapes(self, s: int, i: int, variables: Variables, x: PyTree) -> PyTree:
        """The shapes of layer ``i``'s output for ``variables`` and input ``x`` (shapes
        or arrays), traced once per layout of both."""
        key = (i, _shape_key(variables), _shape_key(x))
        known = self._layer_shapes.get(key)
        if known is None:
            layer = self.layers.layers[i]
            with _naming(s, i, layer.name, x):
                y = jax.eval_shape(lambda v, x: layer.apply(v, x)[0], variables, x)
            known = self._remember(key, y)
        return known

    def _remember(self, key: Any, value: Any) -> Any:
        if len(self._layer_shapes) > 4096:  # ever new shapes: keep it bounded
            self._layer_shapes.clear()
        self._layer_shapes[key] = value
        return value

    def accept_layout(self, layout: Any) -> None:
        """Trusts states of ``layout`` from now on (the newest is compared first)."""
        if layout not in self._state_layouts:
            self._state_layouts.insert(0, layout)

    def check_state(self, state: Any, x: PyTree) -> None:
        """Refuses, before any device work, a state this pipeline cannot run: not a
        :class:`PipelineState`, consumed, or laid out otherwise than the states this
        pipeline makes (another plan, model or optimizer). Once per call: lengths, then
        the state's tree structures and shapes against the layouts already trusted;
        ``x`` (an input microbatch) serves only a pipeline that has made no state yet."""
        if not isinstance(state, PipelineState):
            other = (
                " (a DataParallel's state: run it with that DataParallel, or move the weights "
                "with state_from_variables(dp.variables(state), rng))"
                if type(state).__name__ == "DPState"
                else ""
            )
            raise PipelineError(
                f"state must be the PipelineState that this pipeline's init (or step, run) "
                f"returned, got a {type(state).__name__}{other}"
            )
        if any(
            isinstance(leaf, jax.Array) and leaf.is_deleted()
            for leaf in jax.tree.leaves((state.params, state.opt_state))
        ):
            raise PipelineError(
                "this state was consumed by an earlier step/run (the optimizer state is "
                "updated in place); pass the state that call returned"
            )
        problem = self._count_problem(state)
        layout = None if problem else state_layout(state)
        if problem is None and layout not in self._state_layouts:
            if not self._state_layouts:
                # nothing made here to compare with (a state of an equal pipeline): the
                # inputs must fit its weights, then it must be what init would make for them
                self._check_inputs(state, x, "the first microbatch")
                self._state_layouts.append(self._expected_layout(x))
            problem = self._layout_problem(state, layout, self._state_layouts[0])
        if problem is not None:
            raise PipelineError(
                f"{problem}: the state was made by another Pipeline (another plan, model or "
                "optimizer). Make it with this pipeline's init (or state_from_variables), "
                "or restore the checkpoint into a template made by this pipeline's init"
            )
        if layout != self._fits_layout:  # items were checked against other weights' shapes
            self._fits.clear()
            self._fits_layout = layout

    def _count_problem(self, state: PipelineState) -> str | None:
        """What in ``state``'s counts of stages and layers differs from this pipeline's."""
        S = self.stage_set.num_stages
        got: int | None
        for field in ("params", "model_state", "opt_state", "updates"):
            got = len(getattr(state, field))
            if got != S:
                return f"the state has {got} stages ({field}), this pipeline has {S} stages"
        for s, spec in enumerate(self.stage_set.specs):
            want = spec.last_layer - spec.first_layer + 1
            for field in ("params", "model_state"):
                tree = getattr(state, field)[s]
                got = len(tree) if isinstance(tree, (list, tuple)) else None
                if got != want:
                    return (
                        f"the state's stage {s} holds {got} layers ({field}), this pipeline's "
                        f"stage {s} holds {want} layers ({spec.first_layer}-{spec.last_layer})"
                    )
        return None

    def _layout_problem(self, state: PipelineState, got: Any, want: Any) -> str | None:
        """The first difference between the layout ``got`` of ``state`` and ``want``."""
        names = {
            "params": "parameters",
            "model_state": "model state",
            "opt_state": "optimizer state",
        }
        for f, (field, name) in enumerate(names.items()):
            for s, ((gdef, gshapes), (wdef, wshapes)) in enumerate(
                zip(got[f], want[f], strict=True)
            ):
                if field == "opt_state" and gdef != wdef:
                    return (
                        f"stage {s}'s optimizer state is {_brief(gdef)}, but this pipeline's "
                        f"optimizer makes {_brief(wdef)}"
                    )
                if gdef != wdef:
                    return (
                        f"stage {s}'s {name} is {_brief(gdef)}, this "
                        f"pipeline's model makes {_brief(wdef)} there"
                    )
                if gshapes != wshapes:
                    i = next(
                        i for i, (a, b) in enumerate(zip(gshapes, wshapes, strict=True)) if a != b
                    )
                    path = jax.tree_util.tree_flatten_with_path(getattr(state, field)[s])[0][i][0]
                    if field != "opt_state":  # per layer: name the model's layer
                        layer = self.stage_set.specs[s].first_layer + path[0].idx
                        name, path = f"{name} of layer {layer}", path[1:]
                    return (
                        f"stage {s}'s {name}, leaf {jax.tree_util.keystr(path)}, has shape "
                        f"{list(gshapes[i])}, this pipeline makes {list(wshapes[i])}"
                    )
        return None

    def _expected_layout(self, x: PyTree) -> Any:
        """The layout of the state init would make on a sample like ``x`` (shapes only;
        it settles the ties and the optimizer as :meth:`state_from_variables` does)."""
        variables, _ = self._trace_layers(abstract(x), None)
        layers = [variables[sp.first_layer : sp.last_layer + 1] for sp in self.stage_set.specs]
        params = [[v.get("params", {}) for v in vs] for vs in layers]
        model_state = [[{k: a for k, a in v.items() if k != "params"} for v in vs] for vs in layers]
        views, optimizer = self.settle(params)
        opt_state = [jax.eval_shape(optimizer.init, v) for v in views]
        return _layout(params, model_state, opt_state)

    def _state_variables(self, state: PipelineState) -> list[Variables]:
        """The per-layer variables of ``state``, as shapes."""
        return [
            {**ms, "params": p}
            for ps, mss in zip(state.params, state.model_state, strict=True)
            for p, ms in zip(ps, mss, strict=True)
        ]

    def _check_inputs(self, state: PipelineState, x: PyTree, where: str) -> Any:
        """Traces the model on ``x`` with ``state``'s weights (shapes only); returns the
        shapes of its output, or raises naming the layer and the shapes that fail."""
        check_arrays((("inputs", x),), f"{where}: ")
        try:
            return self.check_shapes(x, abstract(self._state_variables(state)))
        except PipelineError as e:
            seen = self.init_shapes
            raise PipelineError(
                f"{where}'s inputs do not fit the model's weights: {str(e).rstrip('.')}. "
                + (f"This pipeline's init saw inputs [{seen}]; give " if seen else "Give ")
                + "inputs of those shapes past the batch dimension (any number of rows), "
                "or a state made for these inputs"
            ) from e

    def check_items(
        self, state: PipelineState, items: Sequence[Any], what: str, with_targets: bool
    ) -> list[int]:
        """Per item (an ``(inputs, targets)`` pair, or inputs), its rows, after checking
        once per layout that every leaf has those rows, that the model takes the inputs
        with ``state``'s weights and the loss function the targets. Cheap once the call's
        layout is known: one flatten of all the items (the loop over thousands of actions
        that follows must not wait on checks)."""
        whole = _layout_key(items)
        known: list[int] | None = self._fits.get(whole)
        if known is not None:
            return known
        rows = []
        for k, item in enumerate(items):
            key = _layout_key(item)
            n = self._fits.get(key)
            if n is None:
                where = f"{what} {k}"
                parts: tuple[tuple[str, PyTree], ...]
                if with_targets:
                    parts = (("inputs", item[0]), ("targets", item[1]))
                else:
                    parts = (("inputs", item),)
                n = shared_rows(parts, f"{where}: ")
                y = self._check_inputs(state, parts[0][1], where)
                if with_targets:
                    _check_loss(self.loss_fn, y, item[1], where)
                self._fits[key] = n
            rows.append(n)
        if len(self._fits) > 256:  # calls of ever new lengths or shapes: keep it bounded
            self._fits.clear()
        self._fits[whole] = rows
        return rows


def state_layout(state: PipelineState) -> Any:
    """Per field (params, model state, optimizer state), per stage, the tree structure
    and the leaf shapes: what a state must share with the states a pipeline makes (not
    the dtypes, which a caller may change, as a cast to bfloat16 does)."""
    return _layout(state.params, state.model_state, state.opt_state)


def _layout(
    params: Sequence[PyTree], model_state: Sequence[PyTree], opt_state: Sequence[PyTree]
) -> Any:
    """:func:`_state_layout` of a state's three per-stage fields."""

    def per_stage(trees: Sequence[PyTree]) -> tuple[Any, ...]:
        out = []
        for tree in trees:
            leaves, treedef = jax.tree.flatten(tree)
            out.append((treedef, tuple(np.shape(a) for a in leaves)))
        return tuple(out)

    return per_stage(params), per_stage(model_state), per_stage(opt_state)


@contextlib.contextmanager
def _naming(s: int, i: int, name: str, x: PyTree) -> Iterator[None]:
    """Turns a failure to trace layer ``i`` (of stage ``s``) on ``x`` into a
    :class:`PipelineError` that names them (pdjax's own errors pass as they are)."""
    try:
        yield
    except PdjaxError:
        raise
    except Exception as e:
        what = "the inputs" if i == 0 else "the output of the layer before it"
        raise PipelineError(
            f"stage {s}, layer {i} ({name}) cannot take {what}, shapes "
            f"[{shapes_text(x)}]: {type(e).__name__}: {e}"
        ) from e


def _shape_key(tree: PyTree) -> Any:
    """A hashable key of ``tree``'s structure and leaves' shapes, dtypes and weak types:
    all that a trace on shapes depends on."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple(
        [(np.shape(a), jnp.result_type(a), getattr(a, "weak_type", False)) for a in leaves]
    )


def _layout_key(tree: PyTree) -> Any:
    """A hashable key of ``tree``'s structure, leaf shapes and dtypes (cheap: one flatten)."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple([(np.shape(a), getattr(a, "dtype", None)) for a in leaves])


def shared_rows(parts: Sequence[tuple[str, PyTree]], where: str) -> int:
    """The rows (leading dimension) that every leaf of the named trees ``parts`` (e.g.
    ``(("inputs", x), ("targets", t))``) shares. Targets with other rows than their
    inputs would be cut at other samples (trained on the wrong targets) or fail deep in
    XLA, so they are refused here, naming the leaf (as a leaf that is not an array of
    numbers: a string, an object)."""
    check_arrays(parts, where)
    named: list[tuple[str, tuple[int, ...]]] = [
        (name + jax.tree_util.keystr(path), np.shape(a))
        for name, tree in parts
        for path, a in jax.tree_util.tree_flatten_with_path(tree)[0]
    ]
    if not named:
        raise PipelineError(f"{where}{' and '.join(n for n, _ in parts)} hold no arrays")
    for leaf, shape in named:
        if not shape:
            raise PipelineError(
                f"{where}{leaf} is a scalar, with no leading (batch) dimension: every leaf "
                "of the inputs and targets needs one row per sample"
            )
    first, (n, *_) = named[0]
    for leaf, shape in named:
        if shape[0] != n:
            raise PipelineError(
                f"{where}{leaf} has {shape[0]} rows but {first} has {n}: every leaf of the "
                "inputs and targets needs one row per sample (the same leading dimension); "
                "pass the targets that belong to these inputs"
            )
    return n


def _check_loss(loss_fn: LossFn, y: Any, t: PyTree, where: str) -> None:
    """Traces ``loss_fn`` on the model's output shapes ``y`` and targets ``t``: a loss
    that is not a scalar raises :func:`split_loss`'s error, targets it cannot take raise
    one naming both shapes (rather than an XLA error from inside a stage program)."""
    try:
        jax.eval_shape(lambda y, t: split_loss(loss_fn(y, t)), y, abstract(t))
    except PdjaxError:
        raise
    except Exception as e:
        raise PipelineError(
            f"{where}: loss_fn cannot take the model's outputs [{shapes_text(y)}] and the "
            f"targets [{shapes_text(t)}]: {type(e).__name__}: {str(e).rstrip('.')}. Give "
            "targets that fit "
            "the model's outputs, one row per input row"
        ) from e


def _brief(treedef: Any, limit: int = 160) -> str:
    """A tree structure as text, cut to ``limit`` characters (an optimizer's can be long)."""
    text = str(treedef).removeprefix("PyTreeDef(").removesuffix(")")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_pairs(items: Sequence[Any], call: str, what: str) -> None:
    """Refuses an item of ``items`` that is not an ``(inputs, targets)`` pair: the whole
    batch passed where its microbatches belong would unpack as inputs and targets."""
    for k, item in enumerate(items):
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            shape = f" of shape {list(np.shape(item))}" if hasattr(item, "shape") else ""
            raise PipelineError(
                f"{call} takes a sequence of {what}, each an (inputs, targets) pair; item "
                f"{k} is a {type(item).__name__}{shape}. For one whole batch use "
                + (
                    "run(state, pipe.split_batch((inputs, targets))) or step(state, "
                    "(inputs, targets))"
                    if call == "run"
                    else f"{call}(state, [(inputs, targets)])"
                )
            )


def split_batch(
    batch: tuple[PyTree, PyTree], M: int, replicas: Sequence[int]
) -> list[tuple[PyTree, PyTree]]:
    """``batch = (inputs, targets)`` as ``M`` equal microbatches along axis 0 (see
    :meth:`Pipeline.split_batch <pdjax.pipeline.Pipeline.split_batch>`), each divisible by
    every device group's ``replicas``."""
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise PipelineError(
            f"split_batch takes one (inputs, targets) pair, got a {type(batch).__name__}"
            + (f" of {len(batch)} items" if isinstance(batch, (tuple, list)) else "")
        )
    inputs, targets = batch
    n = shared_rows((("inputs", inputs), ("targets", targets)), "")
    if n < M:
        raise PipelineError(
            f"a batch of {n} samples cannot be split into {M} microbatches: every "
            f"microbatch needs at least one sample; use microbatches <= the batch size "
            f"(Pipeline(..., microbatches=...)) or a batch of at least {M} samples"
        )
    need = [M * r for r in replicas]
    for s, k in enumerate(need):
        if n % k:
            raise PipelineError(
                f"batch of {n} samples cannot be split into {M} microbatches of equal "
                f"size, each divisible by stage {s}'s {replicas[s]} batch shards; use a "
                f"batch size that is a multiple of {int(np.lcm.reduce(need))}"
            )
    size = n // M
    return [
        jax.tree.map(lambda a, k=k: a[k * size : (k + 1) * size], (inputs, targets))
        for k in range(M)
    ]
