"""Whether the user's optimizer, run on each pipeline stage's parameters alone, equals one
update of the whole model: :func:`stage_coupling`, decided from traced jaxprs.

The analysis runs nothing on data. It builds the whole model's parameter tree (one private
pytree node with one child per stage), traces ``optimizer.init`` and ``optimizer.update``
on abstract values with :func:`jax.make_jaxpr` and reads the jaxprs twice
(:mod:`pdjax.pipeline.optim_jaxpr`): a dependency pass (which input leaves each output
depends on) and a structural pass (hash-consed ids). Stage ``s``'s part of the whole-model
trace must have the same ids as the trace of the optimizer on stage ``s`` alone. This
catches what no data flow shows, such as a constant computed from the whole model's shapes
(a parameter count), or a dtype chosen over all leaves.

Optimizer state is attributed to stages by structure: a state subtree that mirrors the
parameters (adam's ``mu``) is an instance of the private node type, so its child ``s`` is
stage ``s``'s; every other state leaf (``count``, injected hyperparameters) is *shared*:
each stage keeps its own copy, which is exact only if it is computed from shared state and
constants alone (then every stage computes it identically). The per-stage state must have
exactly the layout of the whole-model state with each mirror replaced by its child ``s``.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Hashable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.extend import core as jcore

from pdjax.errors import PipelineError
from pdjax.pipeline.optim_jaxpr import Interner, deps, ids

__all__ = ["GRADIENTS", "PARAMS", "STATE", "Coupling", "stage_coupling"]

PyTree = Any

#: Input kinds a stage's update can read from another stage.
GRADIENTS, STATE, PARAMS = "gradients", "state", "params"

# ---------------------------------------------------------------------------------------
# The whole model as one tree, and labels for its leaves
# ---------------------------------------------------------------------------------------


class Stages:
    """The whole model's parameters (or any tree that mirrors them): one child per stage.

    A private pytree node type rather than a tuple, so that a state subtree mirroring the
    parameters is recognised by its type: ``optax.chain``'s state is a plain tuple too.
    """

    __slots__ = ("stages",)

    def __init__(self, stages: Iterable[PyTree]) -> None:
        self.stages = tuple(stages)

    def __repr__(self) -> str:
        return f"Stages({self.stages!r})"


jax.tree_util.register_pytree_with_keys(
    Stages,
    lambda n: ([(jax.tree_util.GetAttrKey(f"stage{s}"), c) for s, c in enumerate(n.stages)], None),
    lambda _, children: Stages(children),
    flatten_func=lambda n: (n.stages, None),
)


def _is_stages(x: Any) -> bool:
    return isinstance(x, Stages)


class _Tag:
    """A leaf carrying a label (an unregistered class, so pytrees treat it as a leaf)."""

    __slots__ = ("label",)

    def __init__(self, label: tuple[Hashable, ...]) -> None:
        self.label = label


def abstract(tree: PyTree) -> PyTree:
    """``tree`` with ``jax.ShapeDtypeStruct`` leaves (arrays are accepted too)."""
    # jax leaves ShapeDtypeStruct.__init__ unannotated
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)),
        tree,
    )


def _split(tree: PyTree, s: int) -> PyTree:
    """Stage ``s``'s part of a whole-model tree: every mirror replaced by its child ``s``."""
    return jax.tree.map(lambda x: x.stages[s] if _is_stages(x) else x, tree, is_leaf=_is_stages)


# Not pdjax._trees.key_str: a whole path in jax's ['a'][0] form, for messages and labels.
def keystr(path: tuple[Any, ...]) -> str:
    return jax.tree_util.keystr(path) or "<root>"


@dataclasses.dataclass(frozen=True)
class _StateLayout:
    """The whole-model state's leaves, in flatten order: labels, paths, and which are shared.

    A mirrored leaf is labelled ``("st", mirror, stage, index in that stage's child)``, a
    shared one ``("sh", k)``.
    """

    labels: list[tuple[Hashable, ...]]
    paths: list[str]
    shared: list[int]  # flat indices of the shared leaves, in order (k -> flat index)

    @staticmethod
    def of(state: PyTree) -> _StateLayout:
        labels: list[tuple[Hashable, ...]] = []
        paths: list[str] = []
        shared: list[int] = []
        top = jax.tree_util.tree_flatten_with_path(state, is_leaf=_is_stages)[0]
        mirror = 0
        for path, node in top:
            if _is_stages(node):
                for s, child in enumerate(node.stages):
                    sub = jax.tree_util.tree_flatten_with_path(child)[0]
                    for i, (p, _) in enumerate(sub):
                        labels.append(("st", mirror, s, i))
                        paths.append(keystr((*path, jax.tree_util.GetAttrKey(f"stage{s}"), *p)))
                mirror += 1
            else:
                shared.append(len(labels))
                labels.append(("sh", len(shared) - 1))
                paths.append(keystr(path))
        return _StateLayout(labels, paths, shared)

    def stage_of(self, k: int) -> int | None:
        """The stage a flat state leaf belongs to, or None for shared leaves."""
        label = self.labels[k]
        return int(label[2]) if label[0] == "st" else None  # type: ignore[call-overload]


# ---------------------------------------------------------------------------------------
# The analysis
# ---------------------------------------------------------------------------------------


Source = tuple[str, int]  # (kind: gradients | state | params, stage)


@dataclasses.dataclass(frozen=True)
class Coupling:
    """What :func:`stage_coupling` found about an optimizer on a split of the model.

    Attributes:
      stages: the number of stages.
      coupled: True unless running the optimizer on each stage's tree alone is exactly
        the whole-model update (sound: True whenever the analysis is unsure).
      analysed: False when the optimizer could not be traced (``coupled`` is then True).
      splittable: the optimizer state splits per stage (mirrors + shared leaves) into
        exactly the per-stage optimizer's state layout.
      exact_per_stage: the structural check passed: every stage's update and state are,
        operation for operation, the whole-model computation's part for that stage.
      sources: per stage ``s``, the other stages' inputs ``(kind, t)`` (kind ``gradients``,
        ``state`` or ``params``) that its updates or state depend on, directly or through
        shared state.
      shared_state: paths of the state leaves not split per stage (e.g. ``count``); each
        stage keeps a copy.
      stage_dependent_state: the shared leaves whose value depends on stages' data (each
        stage's copy would differ from the whole model's).
      shared_sources: per shared leaf (in ``shared_state``'s order), the stages' inputs
        its value depends on, over any number of steps.
      reasons: human-readable findings, naming what couples which stages.
      summary: the same in one short sentence (for error messages).
    """

    stages: int
    coupled: bool
    analysed: bool = True
    splittable: bool = True
    exact_per_stage: bool = True
    sources: tuple[frozenset[Source], ...] = ()
    shared_state: tuple[str, ...] = ()
    stage_dependent_state: tuple[str, ...] = ()
    shared_sources: tuple[frozenset[Source], ...] = ()
    reasons: tuple[str, ...] = ()
    summary: str = ""

    @property
    def gradients_only(self) -> bool:
        """Coupled, and only through other stages' *gradients* (the data flow allows an
        exchange derived from gradients, such as their global norm; whether one scalar is
        enough is what :func:`coupled_through_grad_norm` checks)."""
        if not (self.coupled and self.analysed and self.splittable):
            return False
        used = set().union(*self.sources, *self.shared_sources)
        return bool(used) and all(kind == GRADIENTS for kind, _ in used)

    def describe(self) -> str:
        """One paragraph: the verdict and the reasons."""
        head = "couples the pipeline stages" if self.coupled else "acts on each stage alone"
        return f"the optimizer {head}" + "".join(f"; {r}" for r in self.reasons)


def _sources_of(bits: int, masks: dict[Source, int]) -> set[Source]:
    return {src for src, m in masks.items() if bits & m}


def _join(words: Sequence[str]) -> str:
    return ", ".join(words[:-1]) + " and " + words[-1] if len(words) > 1 else "".join(words)


def _names(srcs: Iterable[Source]) -> str:
    """``{("gradients", 1), ("params", 1)}`` -> "the gradients and params of stage 1"."""
    stages_of: dict[str, list[int]] = {}
    for kind, t in sorted(srcs):
        stages_of.setdefault(kind, []).append(t)
    kinds_of: dict[tuple[int, ...], list[str]] = {}
    for kind, of_kind in stages_of.items():
        kinds_of.setdefault(tuple(of_kind), []).append(kind)
    parts = []
    for ts, kinds in kinds_of.items():
        word = "stage" if len(ts) == 1 else "stages"
        parts.append(f"the {_join(kinds)} of {word} {', '.join(map(str, ts))}")
    return " and ".join(parts)


def stage_coupling(
    optimizer: optax.GradientTransformation, stage_params: Sequence[PyTree]
) -> Coupling:
    """Whether ``optimizer`` run on each stage's parameters alone equals one update of the
    whole model, decided from traced jaxprs (nothing runs on data).

    Args:
      optimizer: any optax ``GradientTransformation`` called as ``update(grads, state,
        params)``.
      stage_params: per stage, its parameter tree (``jax.ShapeDtypeStruct`` leaves, or
        arrays), exactly as the stage passes it to the optimizer.

    Returns:
      a :class:`Coupling`; ``coupled`` is True whenever stage ``s``'s update, or its state
      (mirrored part or its copy of a shared leaf), could differ from the whole-model
      computation: it reads another stage's gradients, parameters or state, a shared leaf
      accumulates stage data, the state does not split per stage, the per-stage computation
      differs structurally (e.g. constants from the whole model's shapes), or the optimizer
      cannot be traced on the whole model's parameters as one tree.

    Raises:
      PipelineError: the optimizer fails on a stage's own parameters (its ``init`` or
        ``update`` raises, chained): its own failure, which no split of the model causes.
    """
    stages = [abstract(p) for p in stage_params]
    n = len(stages)
    if n == 0:
        raise ValueError("stage_coupling needs at least one stage")
    if n == 1:
        return Coupling(stages=1, coupled=False, reasons=("one stage: the whole model",))
    own = _StageTraces.of(optimizer, stages)  # the optimizer's own failure: raised
    try:
        traces = _Traces.of(optimizer, stages, own)
    except Exception as err:  # it runs per stage, but not on the whole model as one tree
        what = _failure(err)
        return Coupling(
            stages=n,
            coupled=True,
            analysed=False,
            splittable=False,
            exact_per_stage=False,
            reasons=(
                "it runs on each stage's parameters but could not be traced on the whole "
                "model's as one tree, as update(grads, state, params) "
                f"({what}), so pdjax cannot show it acts on each stage alone",
            ),
            summary=f"it runs on each stage's parameters but not on the whole model's ({what})",
        )
    return _analyse(traces, stages)


def _failure(err: BaseException) -> str:
    """``err`` in one line (at most 300 characters of its message)."""
    text = " ".join(str(err).split())
    text = text if len(text) <= 300 else text[:297] + "..."
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


@dataclasses.dataclass(frozen=True)
class _StageTraces:
    """The optimizer traced on each stage's parameters alone (abstract values)."""

    states: list[PyTree]
    inits: list[jcore.ClosedJaxpr]
    updates: list[jcore.ClosedJaxpr]

    @staticmethod
    def of(optimizer: optax.GradientTransformation, stages: list[PyTree]) -> _StageTraces:
        """The traces of ``optimizer`` on each of ``stages``.

        Raises:
          PipelineError: its ``init`` or ``update`` fails on a stage's own parameters (the
            optimizer's own error, not a coupling), the error chained.
        """
        states, inits, updates = [], [], []
        for s, p in enumerate(stages):
            call = "init(params)"
            try:
                inits.append(jax.make_jaxpr(optimizer.init)(p))
                states.append(jax.eval_shape(optimizer.init, p))
                call = "update(grads, state, params)"
                updates.append(jax.make_jaxpr(optimizer.update)(p, states[-1], p))
            except Exception as err:  # the user's optimizer: its own error, with context
                raise PipelineError(
                    f"the optimizer fails on the parameters of pipeline stage {s}: its "
                    f"{call} raised {_failure(err)} (pdjax runs it on each stage's "
                    "parameters, abstract arrays of their shapes and dtypes, before any "
                    "work); fix the optimizer, which fails this way on its own"
                ) from err
        return _StageTraces(states, inits, updates)


@dataclasses.dataclass(frozen=True)
class _Traces:
    """The optimizer traced on the whole model and on each stage alone (abstract values)."""

    state: PyTree  # the whole-model state (abstract)
    init: jcore.ClosedJaxpr  # params -> state
    update: jcore.ClosedJaxpr  # (grads, state, params) -> (updates, state)
    out_shapes: tuple[PyTree, PyTree]  # update's (updates, state), abstract
    stage_states: list[PyTree]
    stage_inits: list[jcore.ClosedJaxpr]
    stage_updates: list[jcore.ClosedJaxpr]

    @staticmethod
    def of(
        optimizer: optax.GradientTransformation, stages: list[PyTree], own: _StageTraces
    ) -> _Traces:
        """The whole model's traces beside ``own``, the stages' (:class:`_StageTraces`)."""
        full = Stages(stages)
        state = jax.eval_shape(optimizer.init, full)
        update, out_shapes = jax.make_jaxpr(optimizer.update, return_shape=True)(full, state, full)
        return _Traces(
            state=state,
            init=jax.make_jaxpr(optimizer.init)(full),
            update=update,
            out_shapes=out_shapes,
            stage_states=own.states,
            stage_inits=own.inits,
            stage_updates=own.updates,
        )


def _analyse(traces: _Traces, stages: list[PyTree]) -> Coupling:
    n = len(stages)
    full = Stages(stages)
    upd_shape, new_shape = traces.out_shapes
    layout = _StateLayout.of(traces.state)
    if not (
        # jaxlib ships no type stub for PyTreeDef (its == is unknown to mypy)
        jax.tree.structure(upd_shape) == jax.tree.structure(full)  # type: ignore[operator]
        and jax.tree.structure(new_shape) == jax.tree.structure(traces.state)  # type: ignore[operator]
        and len(jax.tree.leaves(traces.state)) == len(layout.labels)
    ):
        return Coupling(
            stages=n,
            coupled=True,
            splittable=False,
            exact_per_stage=False,
            reasons=("its update does not return trees shaped like the parameters and state",),
            summary="its update does not return trees shaped like the parameters and state",
        )
    reasons: list[str] = []
    splittable, stage_labels = _split_per_stage(traces, n, layout, reasons)
    flow = _Flow.of(traces, stages, layout)
    src = flow.shared_src
    dependent = [j for j in range(len(src)) if src[j]]
    for j in dependent:
        reasons.append(
            f"the state leaf {layout.paths[layout.shared[j]]} is shared by all stages but "
            f"computed from {_names(src[j])}"
        )
    sources, summary = _foreign_sources(flow, stages, reasons)
    if dependent:
        kinds = sorted({kind for j in dependent for kind, _ in src[j]})
        names = [layout.paths[layout.shared[j]] for j in dependent]
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        summary.append(
            f"the state {', '.join(names[:3])}{more}, shared by all stages, is computed from "
            f"the stages' {_join(kinds)}"
        )
    exact = splittable
    if splittable:
        exact, mismatch = _structurally_equal(traces, stages, stage_labels, layout)
        if not exact and not any(sources) and not dependent:
            reasons.append(
                f"{mismatch} is not the whole-model computation's part for that stage although "
                "no data flows between stages (something depends on the whole model's shapes "
                "or number of leaves: a parameter count, random keys split per leaf)"
            )
    if not splittable:
        summary.append("its state does not split per stage")
    elif not exact and not summary:
        summary.append(
            f"{mismatch} differs from its part of the whole-model computation (it depends on "
            "the whole model's shapes or number of leaves)"
        )
    coupled = not (exact and splittable) or any(sources) or bool(dependent)
    if not coupled:
        reasons.append("each stage's update and state are exactly its part of the whole model's")
    return Coupling(
        stages=n,
        coupled=coupled,
        splittable=splittable,
        exact_per_stage=exact,
        sources=tuple(sources),
        shared_state=tuple(layout.paths[k] for k in layout.shared),
        stage_dependent_state=tuple(layout.paths[layout.shared[j]] for j in dependent),
        shared_sources=tuple(frozenset(x) for x in src),
        reasons=tuple(reasons),
        summary="; ".join(summary),
    )


def _split_per_stage(
    traces: _Traces, n: int, layout: _StateLayout, reasons: list[str]
) -> tuple[bool, list[list[tuple[Hashable, ...]]]]:
    """Whether the state splits per stage into the per-stage optimizer's layout (a reason
    appended per stage where it does not), and per stage its state leaves' labels."""
    state = traces.state
    splittable = True
    tags = jax.tree.unflatten(jax.tree.structure(state), [_Tag(lb) for lb in layout.labels])
    stage_labels = []
    for s in range(n):
        own = traces.stage_states[s]
        expected = _split(state, s)
        same = jax.tree.structure(own) == jax.tree.structure(expected) and all(  # type: ignore[operator]
            (a.shape, a.dtype) == (b.shape, b.dtype)
            for a, b in zip(jax.tree.leaves(own), jax.tree.leaves(expected), strict=True)
        )
        if not same:
            splittable = False
            reasons.append(
                f"stage {s}'s own optimizer state is not the whole-model state's part for "
                "that stage (the state does not split per stage)"
            )
        stage_labels.append([t.label for t in jax.tree.leaves(_split(tags, s))])
    return splittable, stage_labels


@dataclasses.dataclass(frozen=True)
class _Flow:
    """The dependency pass over the traced ``init`` and ``update``, as bitsets (Python
    ints: they exceed 64 bits) over the update's inputs, grads (``n_params`` leaves) |
    state | params (``n_params``), and over ``init``'s params.

    Attributes:
      layout: the whole-model state's leaves.
      n_params: parameter leaves of the whole model.
      upd_deps: per update output (updates, then new state leaves), its inputs.
      init_deps: per initial state leaf, its inputs.
      masks: per source ``(kind, stage)``, its bits among the update's inputs.
      init_masks: per source ``("params", stage)``, its bits among ``init``'s inputs.
      shared_src: per shared state leaf, the sources its value depends on over any number
        of steps.
    """

    layout: _StateLayout
    n_params: int
    upd_deps: list[int]
    init_deps: list[int]
    masks: dict[Source, int]
    init_masks: dict[Source, int]
    shared_src: list[set[Source]]

    @staticmethod
    def of(traces: _Traces, stages: list[PyTree], layout: _StateLayout) -> _Flow:
        sizes = [len(jax.tree.leaves(s)) for s in stages]
        param_stage = [s for s in range(len(stages)) for _ in range(sizes[s])]
        n_params, n_state = len(param_stage), len(layout.labels)
        upd_deps = deps(traces.update, [1 << k for k in range(2 * n_params + n_state)])
        init_deps = deps(traces.init, [1 << k for k in range(n_params)])
        masks: dict[Source, int] = {}
        init_masks: dict[Source, int] = {}
        for k in range(n_params):
            t = param_stage[k]
            masks[(GRADIENTS, t)] = masks.get((GRADIENTS, t), 0) | 1 << k
            masks[(PARAMS, t)] = masks.get((PARAMS, t), 0) | 1 << (n_params + n_state + k)
            init_masks[(PARAMS, t)] = init_masks.get((PARAMS, t), 0) | 1 << k
        for k in range(n_state):
            owner = layout.stage_of(k)
            if owner is not None:
                masks[(STATE, owner)] = masks.get((STATE, owner), 0) | 1 << (n_params + k)
        new_state_deps = upd_deps[n_params:]
        shared_bit = [1 << (n_params + k) for k in layout.shared]
        uses = [
            [j for j, b in enumerate(shared_bit) if new_state_deps[k] & b] for k in layout.shared
        ]
        src = [
            _sources_of(new_state_deps[k], masks) | _sources_of(init_deps[k], init_masks)
            for k in layout.shared
        ]
        changed = True
        while changed:  # a shared leaf carries whatever the shared leaves it reads carry
            changed = False
            for j in range(len(src)):
                grown = src[j].union(*(src[i] for i in uses[j]))
                if grown != src[j]:
                    src[j], changed = grown, True
        return _Flow(
            layout=layout,
            n_params=n_params,
            upd_deps=upd_deps,
            init_deps=init_deps,
            masks=masks,
            init_masks=init_masks,
            shared_src=src,
        )

    def shared_used(self, bits: int) -> list[int]:
        """The shared state leaves (by index among them) that ``bits`` include."""
        n = self.n_params
        return [j for j, k in enumerate(self.layout.shared) if bits & (1 << (n + k))]

    def closure(self, bits: int) -> set[Source]:
        """The sources of ``bits``, directly or through shared state."""
        used = self.shared_used(bits)
        return _sources_of(bits, self.masks).union(*(self.shared_src[j] for j in used))


def _foreign_sources(
    flow: _Flow, stages: list[PyTree], reasons: list[str]
) -> tuple[list[frozenset[Source]], list[str]]:
    """Per stage, the other stages' inputs its updates and state depend on (a reason
    appended per stage that has any), and the summary's first sentence, if any."""
    layout, n_params = flow.layout, flow.n_params
    offsets = [0, *itertools.accumulate(len(jax.tree.leaves(s)) for s in stages)]
    param_paths = [
        keystr(p) for st in stages for p, _ in jax.tree_util.tree_flatten_with_path(st)[0]
    ]
    sources: list[frozenset[Source]] = []
    summary: list[str] = []
    for s in range(len(stages)):
        outs: list[tuple[str, set[Source]]] = []
        for k in range(offsets[s], offsets[s + 1]):
            outs.append((f"update of {param_paths[k]}", flow.closure(flow.upd_deps[k])))
        for k in range(len(layout.labels)):
            if layout.stage_of(k) == s:
                new = flow.closure(flow.upd_deps[n_params + k])
                outs.append((f"state {layout.paths[k]}", new))
                init = _sources_of(flow.init_deps[k], flow.init_masks)
                outs.append((f"initial state {layout.paths[k]}", init))
        foreign: set[Source] = set()
        first = ""
        for what, srcs in outs:
            bad = {x for x in srcs if x[1] != s}
            if bad and not first:
                first = what
            foreign |= bad
        sources.append(frozenset(foreign))
        if foreign:
            reasons.append(f"stage {s} (e.g. its {first}) depends on {_names(foreign)}")
            if not summary:
                kinds = sorted({kind for kind, _ in foreign})
                summary.append(
                    f"each stage reads other stages' {_join(kinds)} (e.g. stage {s}'s {first} "
                    f"depends on {_names(foreign)})"
                )
    return sources, summary


def _structurally_equal(
    traces: _Traces,
    stages: list[PyTree],
    stage_labels: list[list[tuple[Hashable, ...]]],
    layout: _StateLayout,
) -> tuple[bool, str]:
    """Compares, by structural ids, each stage's own init/update jaxprs with its part of the
    whole-model ones. Inputs are labelled so that stage ``s``'s leaves get the same ids in
    both traces (and other stages' leaves ids that cannot occur in stage ``s``'s own)."""
    intern = Interner()
    n = len(stages)
    leaves = [jax.tree.leaves(s) for s in stages]
    state_leaves = jax.tree.leaves(traces.state)

    def tag(label: tuple[Hashable, ...], aval: Any) -> int:
        return intern(("in", label, str(aval.shape), str(aval.dtype)))

    g_ids = [tag(("g", s, i), a) for s in range(n) for i, a in enumerate(leaves[s])]
    p_ids = [tag(("p", s, i), a) for s in range(n) for i, a in enumerate(leaves[s])]
    st_ids = [tag(lb, a) for lb, a in zip(layout.labels, state_leaves, strict=True)]
    full_init = ids(traces.init, None, p_ids, intern)
    full_upd = ids(traces.update, None, g_ids + st_ids + p_ids, intern)
    position = {lb: k for k, lb in enumerate(layout.labels)}
    n_params = len(g_ids)
    offset = 0
    for s in range(n):
        own_g = [tag(("g", s, i), a) for i, a in enumerate(leaves[s])]
        own_p = [tag(("p", s, i), a) for i, a in enumerate(leaves[s])]
        own_st_leaves = jax.tree.leaves(traces.stage_states[s])
        own_st = [tag(lb, a) for lb, a in zip(stage_labels[s], own_st_leaves, strict=True)]
        own_init = ids(traces.stage_inits[s], None, own_p, intern)
        own_upd = ids(traces.stage_updates[s], None, own_g + own_st + own_p, intern)
        size = len(leaves[s])
        if own_upd[:size] != full_upd[offset : offset + size]:
            return False, f"stage {s}'s update"
        for j, lb in enumerate(stage_labels[s]):
            k = position[lb]
            if own_upd[size + j] != full_upd[n_params + k]:
                return False, f"stage {s}'s new state {layout.paths[k]}"
            if own_init[j] != full_init[k]:
                return False, f"stage {s}'s initial state {layout.paths[k]}"
        offset += size
    return True, ""
