"""Moving a pipeline checkpoint into another plan of the same model and optimizer, or
into data parallelism: :func:`replan_names` says which saved array each array of the new
state comes from, and the steps around it check that the move is possible, read each saved
array straight onto the sharding it is going to, and build the leaves.

Weights and model state move layer by layer; an optimizer's per-parameter state (the
subtrees shaped like the parameters) moves with its parameters; every other optimizer
leaf is the same in every saved stage. Each array is read by orbax onto the sharding of
the new state's leaf (another stage's devices, another mesh: another ``fsdp`` x ``tensor``
split), so each device reads its own part and no array is gathered whole in host memory;
only the leaves every saved stage holds (an optimizer's step count) are compared there.

A :class:`~pdjax.runners.DPState` is moved as the state of a pipeline of one stage
(:func:`one_stage_view`): its ``params`` are the per-layer list of all the layers, its
optimizer runs over that list (no tied copies, which data parallelism refuses, and no
phantom: it sees the whole model, so a global-norm coupling needs none), and its ``step``
is the update count.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.tree_util import DictKey, GetAttrKey, SequenceKey

from pdjax._trees import key_str
from pdjax.errors import CheckpointError
from pdjax.pipeline.executor import ParamLayout, PipelineState
from pdjax.runners.checkpoint.arrays import (
    array_leaves,
    is_key,
    own_copy,
    path_name,
    same_bits,
)
from pdjax.runners.checkpoint.format import shape_str

# A tied group's copy: (its global layer, its path in the layer as text keys).
_Copy = tuple[int, tuple[str, ...]]
# Per array name, the saved names it comes from.
_Sources = Iterator[tuple[str, list[str]]]
# The source of a leaf the new plan keeps as its template has it: a coupled optimizer's
# phantom state where the saved plan had no phantom (it drives only its own update).
_TEMPLATE = "<template>"


def replan_names(
    pipeline: Any,
    template: PipelineState,
    saved_layers: Sequence[int],
    saved: Mapping[str, Any],
) -> dict[str, list[str]]:
    """Where each array of ``template`` (a state of ``pipeline``'s plan) comes from in a
    checkpoint saved under a plan with ``saved_layers`` layers per stage: per template
    array name, the saved names that hold it (several for a value every stage keeps, such
    as an optimizer's step count: they must agree).

    Weights and model state move layer by layer. The optimizer state of each stage is
    searched for the subtrees shaped like the stage's parameters as its optimizer sees them
    (``optax`` keeps ``mu``, ``nu``, momentum... that way): their leaves move with their
    parameters (a tied group's with the group); every other leaf must be in every saved
    stage.

    Raises:
      CheckpointError: for an array with no source (an optimizer whose state is not per
        parameter, e.g. ``optax.masked``, or another model).
    """
    layout = _Layout.of(pipeline, template, saved_layers)
    found = itertools.chain(
        _layer_sources(template, layout),
        [("rng", ["rng"])],
        _opt_state_sources(pipeline, template, layout, saved),
    )
    # checked as they are found: the first array without a source is the one named
    return {name: _checked(name, sources, saved) for name, sources in found}


@dataclass(frozen=True)
class OneStage:
    """A runner that holds every layer in one program, as :func:`replan_names` sees a
    pipeline: one stage of ``layers`` (their count), whose optimizer sees every
    parameter (no tied copy hidden from it, no phantom). Data parallelism is one."""

    layers: tuple[int, ...]

    def param_layout(self) -> tuple[ParamLayout, ...]:
        return (ParamLayout(stage=0, tied=(), hidden=frozenset(), phantom=False),)


def one_stage_view(state: Any) -> tuple[PipelineState, OneStage]:
    """A :class:`~pdjax.runners.DPState` as the state of a pipeline of one stage and that
    pipeline (:class:`OneStage`): the same leaves, in the same order, under the names a
    one-stage pipeline's state has (``params.0.<layer>...``: the stage level added)."""
    view = PipelineState(
        params=(state.params,),
        model_state=(state.model_state,),
        opt_state=(state.opt_state,),
        updates=(state.step,),
        microbatches=state.step,
        rng=state.rng,
    )
    return view, OneStage(tuple(range(len(state.params))))


@dataclass(frozen=True)
class _Layout:
    """Where the layers of the template's plan were in the saved plan."""

    old_at: tuple[tuple[int, int], ...]  # global layer -> (saved stage, index in it)
    new_first: tuple[int, ...]  # the template's stage -> its first global layer
    saved_stages: int
    # tied group -> its copy that holds the group's optimizer state in the saved plan
    old_visible: Mapping[str, _Copy]
    # the copy that holds a tied group's optimizer state in the new plan -> the group
    group_of: Mapping[_Copy, str]

    @classmethod
    def of(cls, pipeline: Any, template: PipelineState, saved_layers: Sequence[int]) -> _Layout:
        old_at = _stage_layer(saved_layers)
        new_counts = [len(p) for p in template.params]
        tied = tuple(getattr(pipeline.layers, "tied_leaves", ()))
        old_visible = _visible_copies(tied, [s for s, _ in old_at])
        new_visible = _visible_copies(tied, [s for s, _ in _stage_layer(new_counts)])
        return cls(
            old_at=tuple(old_at),
            new_first=tuple(itertools.accumulate(new_counts, initial=0))[:-1],
            saved_stages=len(saved_layers),
            old_visible=old_visible,
            group_of={v: name for name, v in new_visible.items()},
        )

    def saved_name(self, field: str, layer: int, rest: tuple[Any, ...]) -> str:
        """The saved name of ``field``'s leaf at ``rest`` in global layer ``layer``."""
        s, j = self.old_at[layer]
        return path_name((GetAttrKey(field), SequenceKey(s), SequenceKey(j), *rest))

    def saved_place(self, layer: int, rest: tuple[Any, ...]) -> tuple[int, int, tuple[Any, ...]]:
        """Where the optimizer state of the parameter at ``rest`` in global layer ``layer``
        was saved: (saved stage, layer in it, path in the layer). A tied group's state is at
        the group's copy in the saved plan."""
        group = self.group_of.get((layer, tuple(key_str(k) for k in rest)))
        if group is not None:
            layer, keys = self.old_visible[group]
            rest = tuple(DictKey(k) for k in keys)
        s, j = self.old_at[layer]
        return s, j, rest


@dataclass(frozen=True)
class _OptimizerView:
    """A stage's parameters as its optimizer sees them."""

    stage: int
    # the paths of the parameters it updates (not the tied copies hidden from it)
    visible: tuple[tuple[Any, ...], ...]
    # coupled through the global norm: it sees (parameters, phantom scalar)
    phantom: bool
    treedef: Any  # the tree structure of what it sees

    @classmethod
    def of(cls, layout: ParamLayout, params: Any) -> _OptimizerView:
        """From the pipeline's layout of the stage (:meth:`Pipeline.param_layout`) and
        the stage's parameters in the template."""
        flat = jax.tree_util.tree_flatten_with_path(params)[0]
        return cls(
            stage=layout.stage,
            visible=tuple(path for k, (path, _) in enumerate(flat) if k not in layout.hidden),
            phantom=layout.phantom,
            treedef=layout.optimizer_structure(params),
        )

    def shaped(self, tree: Any) -> bool:
        """Whether ``tree`` is shaped like what the optimizer sees (a per-parameter
        state subtree)."""
        same: bool = jax.tree.structure(tree) == self.treedef
        return same


def _stage_layer(layers_per_stage: Sequence[int]) -> list[tuple[int, int]]:
    """Per global layer, its (stage, index in the stage)."""
    return [(s, j) for s, n in enumerate(layers_per_stage) for j in range(n)]


def _visible_copies(
    tied: Sequence[tuple[str, tuple[_Copy, ...]]],
    stage_of: Sequence[int],
) -> dict[str, _Copy]:
    """Per tied group, the copy its optimizer state belongs to under a plan (``stage_of``:
    each layer's stage): the first listed copy on the first stage holding one."""
    out = {}
    for name, copies in tied:
        owner = min(stage_of[i] for i, _ in copies)
        out[name] = next((i, path) for i, path in copies if stage_of[i] == owner)
    return out


def _checked(name: str, sources: list[str], saved: Mapping[str, Any]) -> list[str]:
    """``sources``, once each is in the checkpoint."""
    missing = [n for n in sources if n not in saved and n != _TEMPLATE]
    if not sources or missing:
        raise CheckpointError(
            f"the checkpoint has no source for {name} of the new plan"
            f"{' (looked for ' + ', '.join(missing) + ')' if missing else ''}; the model "
            "or the optimizer differ from the run that saved it, or the optimizer's "
            "state is not kept per parameter (e.g. optax.masked), which pdjax cannot "
            "move between plans (nor into data parallelism): restore it under its own "
            "plan"
        )
    return sources


def _opt_name(stage: int, *path: Any) -> str:
    return path_name((GetAttrKey("opt_state"), SequenceKey(stage), *path))


def _layer_sources(template: PipelineState, layout: _Layout) -> _Sources:
    """The weights and model state: each leaf from its layer in the saved plan."""
    for field in ("params", "model_state"):
        for s, tree in enumerate(getattr(template, field)):
            for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
                name = path_name((GetAttrKey(field), SequenceKey(s), *path))
                layer = layout.new_first[s] + path[0].idx
                yield name, [layout.saved_name(field, layer, path[1:])]


def _opt_state_sources(
    pipeline: Any, template: PipelineState, layout: _Layout, saved: Mapping[str, Any]
) -> _Sources:
    """The optimizer state of each stage: a per-parameter subtree's leaves from their
    parameters' places, any other leaf from every saved stage."""
    layouts = pipeline.param_layout()
    for s, (params, opt) in enumerate(zip(template.params, template.opt_state, strict=True)):
        view = _OptimizerView.of(layouts[s], params)
        for prefix, sub in jax.tree_util.tree_flatten_with_path(opt, is_leaf=view.shaped)[0]:
            if view.shaped(sub):
                yield from _per_parameter_sources(view, prefix, sub, layout, saved)
            else:  # not per parameter: the same in every saved stage
                saved_names = [_opt_name(o, *prefix) for o in range(layout.saved_stages)]
                yield _opt_name(s, *prefix), saved_names


def _saved_phantom(saved: Mapping[str, Any], stage: int, prefix: tuple[Any, ...]) -> bool:
    """Whether saved stage ``stage`` kept its per-parameter state at ``prefix`` over
    ``(parameters, phantom scalar)``: coupled through the global norm under the saved plan
    (a plan's stages are coupled or not by its own cut: a single stage never is). The
    phantom is the one leaf right at ``prefix.1``; uncoupled, ``prefix.1`` is the stage's
    second layer, a tree of named parameters, never a leaf itself."""
    return _opt_name(stage, *prefix, SequenceKey(1)) in saved


def _per_parameter_sources(
    view: _OptimizerView,
    prefix: tuple[Any, ...],
    sub: Any,
    layout: _Layout,
    saved: Mapping[str, Any],
) -> _Sources:
    """The leaves of one subtree shaped like the parameters (at ``prefix`` in the stage's
    optimizer state), each from where its parameter's state was saved."""
    s = view.stage
    sub_paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(sub)[0]]
    prefix_in: tuple[Any, ...] = ()
    if view.phantom:
        # the phantom's state only drives its own (dropped) update: any saved stage's
        # does, and where the saved plan had none, the template's own
        inner = sub_paths.pop()
        coupled = [o for o in range(layout.saved_stages) if _saved_phantom(saved, o, prefix)]
        o = min(s, len(coupled) - 1)
        source = [_opt_name(coupled[o], *prefix, *inner)] if coupled else [_TEMPLATE]
        yield _opt_name(s, *prefix, *inner), source
        sub_paths = [p[1:] for p in sub_paths]
        prefix_in = (SequenceKey(0),)
    if len(sub_paths) != len(view.visible):
        raise CheckpointError(
            f"opt_state of stage {s}: a subtree shaped like its parameters holds "
            f"{len(sub_paths)} arrays for {len(view.visible)} parameters"
        )
    for inner, ppath in zip(sub_paths, view.visible, strict=True):
        o, j, rest = layout.saved_place(layout.new_first[s] + ppath[0].idx, ppath[1:])
        saved_in = (SequenceKey(0),) if _saved_phantom(saved, o, prefix) else ()
        yield (
            _opt_name(s, *prefix, *prefix_in, *inner),
            [_opt_name(o, *prefix, *saved_in, SequenceKey(j), *rest)],
        )


def check_replannable(
    where: str, meta: Mapping[str, Any], template: PipelineState, pipeline: Any, *, multi: bool
) -> None:
    """Refuses a move into another plan that cannot be done: without the template's
    pipeline, across processes, into another model, or of stages at different updates."""
    saved_layers = list(meta["stage_layers"])
    mine = [len(p) for p in template.params]
    if pipeline is None:
        raise CheckpointError(
            f"{where} was saved under another plan (layers per stage {saved_layers}; "
            f"the template's {mine}): pass pipeline=<the template's Pipeline> to "
            "restore(...) to move it into this plan"
        )
    if multi:
        raise CheckpointError(
            f"{where} was saved under another plan; restoring into a different plan "
            "runs in one process: restore and save it there once, then resume"
        )
    if sum(saved_layers) != len(pipeline.layers):
        raise CheckpointError(
            f"{where} holds {sum(saved_layers)} layers, the pipeline's model has "
            f"{len(pipeline.layers)}: it is another model"
        )
    updates = list(meta["ints"]["updates"])
    if len(set(updates)) != 1:
        raise CheckpointError(
            f"{where} has stages at different update counts {updates} (their weights "
            "are different versions), so it cannot be cut into other stages; restore "
            "it under its own plan"
        )


def check_moved_shapes(
    where: str,
    template: PipelineState,
    sources: Mapping[str, list[str]],
    saved: Mapping[str, Mapping[str, Any]],
) -> None:
    """Refuses a move where an array of the new state would come from a saved array of
    another shape or dtype (another model or optimizer), before anything is read."""
    for name, leaf in array_leaves(template).items():
        names = sources[name]
        if names == [_TEMPLATE]:
            continue
        entry = saved[names[0]]
        mine = jax.eval_shape(jax.random.key_data, leaf) if is_key(leaf) else leaf
        if list(entry["shape"]) != list(mine.shape) or entry["dtype"] != str(mine.dtype):
            raise CheckpointError(
                f"{where}: {name} ({shape_str({'shape': mine.shape, 'dtype': mine.dtype})}) "
                f"would come from {names[0]} ({shape_str(entry)}); the model or the "
                "optimizer differ from the run that saved it"
            )


def _target(leaf: Any) -> Any:
    """Where an array read for ``leaf`` goes: its sharding (a committed array, or a
    ``ShapeDtypeStruct`` with one), or None for host memory (an uncommitted array, such as
    :meth:`Pipeline.init`'s PRNG key, which jit moves where it is needed)."""
    if isinstance(leaf, jax.Array) and not leaf.committed:
        return None
    return getattr(leaf, "sharding", None)


def read_targets(
    template: PipelineState,
    sources: Mapping[str, list[str]],
    saved: Mapping[str, Mapping[str, Any]],
) -> dict[str, Any]:
    """The saved arrays a move reads, each as orbax is to read it: a
    ``jax.ShapeDtypeStruct`` on the sharding of the first leaf of the new state it goes
    to (each device reads its own part), or a host array where that leaf has none (or
    for a saved stage's copy of a leaf every stage holds, of another shape than the first
    stage's: found to differ once read)."""
    out: dict[str, Any] = {}
    for name, leaf in array_leaves(template).items():
        names = sources[name]
        for src in names:
            if src == _TEMPLATE or src in out:
                continue
            shape, dtype = tuple(saved[src]["shape"]), np.dtype(saved[src]["dtype"])
            sharding = _target(leaf)
            if sharding is None or saved[src]["shape"] != saved[names[0]]["shape"]:
                out[src] = np.empty(shape, dtype)
            else:  # jax leaves ShapeDtypeStruct.__init__ unannotated
                out[src] = jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    return out


def replanned_leaves(
    where: str,
    template: PipelineState,
    sources: Mapping[str, list[str]],
    read: Mapping[str, Any],
    saved: Mapping[str, Mapping[str, Any]],
) -> list[Any]:
    """The template's array leaves, in its tree order, from the saved arrays ``read`` (by
    :func:`read_targets`, by ``sources``): those from several saved stages checked to
    agree, each placed on its template leaf's sharding (moved device to device where it
    was read onto another leaf's), a buffer of its own (the runners donate them)."""
    leaves = []
    handed: set[str] = set()  # the saved arrays given to a leaf already
    for name, leaf in array_leaves(template).items():
        names = sources[name]
        if names == [_TEMPLATE]:
            leaves.append(leaf)
            continue
        value = read[names[0]]
        for other in names[1:]:
            if not same_bits(value, read[other], gather=True):
                raise CheckpointError(
                    f"{where}: {name} of the new plan would come from {names[0]} and "
                    f"{other}, which differ; the optimizer state of this optimizer "
                    "cannot be moved between plans (nor into data parallelism)"
                )
        sharding = _target(leaf)
        if sharding is None:
            array = jnp.asarray(np.asarray(value))
        elif names[0] in handed:  # given to another leaf already: buffers of its own
            array = own_copy(value, sharding)
        else:
            array = jax.device_put(value, sharding)
        handed.add(names[0])
        impl = saved[names[0]].get("key_impl")
        leaves.append(array if impl is None else jax.random.wrap_key_data(array, impl=impl))
    return leaves
