"""The user's optimizer across pipeline stages: when running it per stage is exact, and an
exact scalar exchange for optimizers coupled through the gradients' global norm.

A pipeline splits the model's parameters into stages and each stage runs the user's optax
optimizer on its own parameters and gradients. That equals one optimizer step over the whole
model (what sequential training computes) only when the optimizer treats the stages' leaves
independently. ``optax.chain(optax.clip_by_global_norm(c), ...)`` does not: its clipping
factor is a function of *every* gradient, so per-stage updates would be silently wrong.
This module decides, before training, which case an optimizer is in, and either makes the
per-stage run exact or refuses with a :class:`~pdjax.errors.PipelineError`.

The analysis (:func:`stage_coupling`) runs nothing on data. It builds the whole model's
parameter tree (one private pytree node with one child per stage), traces
``optimizer.init`` and ``optimizer.update`` on abstract values with :func:`jax.make_jaxpr`
and reads the jaxprs twice:

- a *dependency* pass: for each output leaf (an update, a new state leaf) the set of input
  leaves (gradients, state, parameters) it depends on, recursing into the sub-jaxprs of
  ``jit``/``custom_jvp_call``/``custom_vjp_call``/``remat`` (as calls), ``cond`` (per
  output, plus the branch index) and ``while``/``scan`` (a fixpoint over the carry); any
  other primitive makes each output depend on all its inputs, which is sound because a
  jaxpr equation is a pure function of its operands;
- a *structural* pass: each value gets an exact hash-consed id (primitive, parameters,
  operand ids), so two outputs with equal ids are the same expression of the same inputs.
  Stage ``s``'s part of the whole-model trace must have the same ids as the trace of the
  optimizer on stage ``s`` alone. This catches what no data flow shows, such as a constant
  computed from the whole model's shapes (a parameter count), or a dtype chosen over all
  leaves.

Optimizer state is attributed to stages by structure: a state subtree that mirrors the
parameters (adam's ``mu``) is an instance of the private node type, so its child ``s`` is
stage ``s``'s; every other state leaf (``count``, injected hyperparameters) is *shared*:
each stage keeps its own copy, which is exact only if it is computed from shared state and
constants alone (then every stage computes it identically). The per-stage state must have
exactly the layout of the whole-model state with each mirror replaced by its child ``s``.

Coupled optimizers whose cross-stage inputs are only other stages' gradients may be
coupled through the gradients' global norm; :class:`StageOptimizer` then makes them exact
with one scalar per stage: each stage computes :func:`sum_squares` of its gradients, the
pipeline exchanges the scalars, and each stage runs the optimizer on its tree plus one
*phantom* gradient leaf ``sqrt(others' sum of squares)`` (and a zero phantom parameter), so
``optax.tree.norm`` over the stage's tree is the whole model's global norm; the phantom's
update is dropped. Whether that is exact for the given optimizer is checked once, by running
both on random inputs of the true shapes on CPU (a sample, not a proof: see
:func:`coupled_through_grad_norm`).

>>> import jax, jax.numpy as jnp, optax
>>> stages = [{"w": jax.ShapeDtypeStruct((4, 3), jnp.float32)},
...           {"w": jax.ShapeDtypeStruct((3, 2), jnp.float32)}]
>>> stage_coupling(optax.adam(1e-3), stages).coupled
False
>>> c = stage_coupling(optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1)), stages)
>>> c.coupled, c.gradients_only
(True, True)
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Hashable, Iterable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.extend import core as jcore

from pdjax.errors import PipelineError

__all__ = [
    "Coupling",
    "StageOptimizer",
    "coupled_through_grad_norm",
    "exchange_mismatch",
    "others_sum_squares",
    "stage_coupling",
    "sum_squares",
]

PyTree = Any

#: Input kinds a stage's update can read from another stage.
GRADIENTS, STATE, PARAMS = "gradients", "state", "params"

# ---------------------------------------------------------------------------------------
# The whole model as one tree, and labels for its leaves
# ---------------------------------------------------------------------------------------


class _Stages:
    """The whole model's parameters (or any tree that mirrors them): one child per stage.

    A private pytree node type rather than a tuple, so that a state subtree mirroring the
    parameters is recognised by its type: ``optax.chain``'s state is a plain tuple too.
    """

    __slots__ = ("stages",)

    def __init__(self, stages: Iterable[PyTree]) -> None:
        self.stages = tuple(stages)

    def __repr__(self) -> str:
        return f"_Stages({self.stages!r})"


jax.tree_util.register_pytree_with_keys(
    _Stages,
    lambda n: ([(jax.tree_util.GetAttrKey(f"stage{s}"), c) for s, c in enumerate(n.stages)], None),
    lambda _, children: _Stages(children),
    flatten_func=lambda n: (n.stages, None),
)


def _is_stages(x: Any) -> bool:
    return isinstance(x, _Stages)


class _Tag:
    """A leaf carrying a label (an unregistered class, so pytrees treat it as a leaf)."""

    __slots__ = ("label",)

    def __init__(self, label: tuple[Hashable, ...]) -> None:
        self.label = label


def _abstract(tree: PyTree) -> PyTree:
    """``tree`` with ``jax.ShapeDtypeStruct`` leaves (arrays are accepted too)."""
    # jax leaves ShapeDtypeStruct.__init__ unannotated
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)),
        tree,
    )


def _split(tree: PyTree, s: int) -> PyTree:
    """Stage ``s``'s part of a whole-model tree: every mirror replaced by its child ``s``."""
    return jax.tree.map(lambda x: x.stages[s] if _is_stages(x) else x, tree, is_leaf=_is_stages)


def _keystr(path: tuple[Any, ...]) -> str:
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
                        paths.append(_keystr((*path, jax.tree_util.GetAttrKey(f"stage{s}"), *p)))
                mirror += 1
            else:
                shared.append(len(labels))
                labels.append(("sh", len(shared) - 1))
                paths.append(_keystr(path))
        return _StateLayout(labels, paths, shared)

    def stage_of(self, k: int) -> int | None:
        """The stage a flat state leaf belongs to, or None for shared leaves."""
        label = self.labels[k]
        return int(label[2]) if label[0] == "st" else None  # type: ignore[call-overload]


# ---------------------------------------------------------------------------------------
# Jaxpr passes: dependencies and structural ids
# ---------------------------------------------------------------------------------------

#: Primitives that call a sub-jaxpr with their operands and return its outputs (for the
#: primal values, which is all the optimizer computes): analysed by inlining.
_CALLS = frozenset(
    {
        "jit",
        "pjit",
        "closed_call",
        "core_call",
        "custom_jvp_call",
        "custom_vjp_call",
        "custom_vjp_call_jaxpr",
        "remat",
        "remat2",
        "checkpoint",
    }
)


def _call_body(eqn: jcore.JaxprEqn) -> jcore.ClosedJaxpr | jcore.Jaxpr | None:
    """The sub-jaxpr a call-like equation runs on its operands, or None (not a call)."""
    if eqn.primitive.name not in _CALLS:
        return None
    for name in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        body = eqn.params.get(name)
        inner = body.jaxpr if isinstance(body, jcore.ClosedJaxpr) else body
        if (
            isinstance(inner, jcore.Jaxpr)
            and not (isinstance(body, jcore.Jaxpr) and body.constvars)
            and len(inner.invars) == len(eqn.invars)
            and len(inner.outvars) == len(eqn.outvars)
        ):
            return body
    return None


def _open(body: jcore.ClosedJaxpr | jcore.Jaxpr) -> tuple[jcore.Jaxpr, list[Any]]:
    if isinstance(body, jcore.ClosedJaxpr):
        return body.jaxpr, list(body.consts)
    return body, []


def _deps(body: jcore.ClosedJaxpr | jcore.Jaxpr, ins: Sequence[int]) -> list[int]:
    """Per output of ``body``, the bitset (an int) of the inputs it depends on, given each
    input's own bitset ``ins``. Constants depend on nothing."""
    jaxpr, consts = _open(body)
    env: dict[Any, int] = {v: 0 for v in jaxpr.constvars[: len(consts)]}
    # an open jaxpr's constvars are unknown values: depend on everything, to stay sound
    every = 0
    for d in ins:
        every |= d
    env.update({v: every for v in jaxpr.constvars[len(consts) :]})
    env.update(zip(jaxpr.invars, ins, strict=True))

    def read(v: Any) -> int:
        return 0 if isinstance(v, jcore.Literal) else env[v]

    for eqn in jaxpr.eqns:
        outs = _eqn_deps(eqn, [read(v) for v in eqn.invars])
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]


#: The parameters the structured rules below read, per primitive (a JAX version that renames
#: them gets the conservative rule instead of an error).
_STRUCTURED = {
    "cond": ("branches",),
    "while": ("cond_nconsts", "body_nconsts", "cond_jaxpr", "body_jaxpr"),
    "scan": ("num_consts", "num_carry", "jaxpr"),
}


def _eqn_deps(eqn: jcore.JaxprEqn, ins: list[int]) -> list[int]:
    """Per output of ``eqn``, its dependency bitset given its operands' ``ins``."""
    name = eqn.primitive.name
    if not all(k in eqn.params for k in _STRUCTURED.get(name, ())):
        name = "<unknown>"
    body = _call_body(eqn)
    if body is not None:
        return _deps(body, ins)
    if name == "cond":
        index, ops = ins[0], ins[1:]
        outs = [index] * len(eqn.outvars)
        for branch in eqn.params["branches"]:
            outs = [o | d for o, d in zip(outs, _deps(branch, ops), strict=True)]
        return outs
    if name == "while":
        cn, bn = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
        cconsts, bconsts, carry = ins[:cn], ins[cn : cn + bn], ins[cn + bn :]
        while True:  # monotone over a finite lattice: terminates
            (pred,) = _deps(eqn.params["cond_jaxpr"], cconsts + carry)
            body_out = _deps(eqn.params["body_jaxpr"], bconsts + carry)
            new = [c | b | pred for c, b in zip(carry, body_out, strict=True)]
            if new == carry:
                return carry
            carry = new
    if name == "scan":
        nc, nk = eqn.params["num_consts"], eqn.params["num_carry"]
        consts, carry, xs = ins[:nc], ins[nc : nc + nk], ins[nc + nk :]
        while True:
            out = _deps(eqn.params["jaxpr"], consts + carry + xs)
            new = [c | o for c, o in zip(carry, out[:nk], strict=True)]
            if new == carry:
                return carry + out[nk:]
            carry = new
    every = 0
    for d in ins:
        every |= d
    return [every] * len(eqn.outvars)


class _Interner:
    """Hash-consing: equal keys get equal ids, different keys different ids (no collisions,
    unlike a hash), so equal ids mean structurally equal expressions."""

    def __init__(self) -> None:
        self._ids: dict[Hashable, int] = {}

    def __call__(self, key: Hashable) -> int:
        return self._ids.setdefault(key, len(self._ids))


def _canon(x: Any, intern: _Interner) -> Hashable:
    """A hashable, exact stand-in for an equation parameter or a constant."""
    if isinstance(x, jcore.ClosedJaxpr | jcore.Jaxpr):
        jaxpr, consts = _open(x)
        args = [intern(("arg", k, str(v.aval))) for k, v in enumerate(jaxpr.invars)]
        cvars = [intern(("cvar", k, str(v.aval))) for k, v in enumerate(jaxpr.constvars)]
        known = [intern(("const", _canon(c, intern))) for c in consts]
        return ("jaxpr", tuple(_ids(jaxpr, known + cvars[len(known) :], args, intern)))
    if isinstance(x, tuple | list):
        return (type(x).__name__, tuple(_canon(v, intern) for v in x))
    if isinstance(x, dict):
        items = sorted(((repr(k), _canon(v, intern)) for k, v in x.items()), key=lambda t: t[0])
        return ("dict", tuple(items))
    if isinstance(x, np.ndarray | np.generic | jax.Array):
        try:
            a = np.asarray(x)
        except Exception:  # e.g. a typed PRNG key: equal only to itself (conservative)
            return ("object", id(x))
        return ("array", str(a.dtype), a.shape, a.tobytes())
    if isinstance(x, bool | int | float | complex | str | type(None)):
        return (type(x).__name__, repr(x))
    # dtypes, enums, shardings, dimension numbers: their repr; callables' reprs carry their
    # address, so two distinct closures never compare equal (conservative)
    return (type(x).__module__, type(x).__qualname__, repr(x))


def _ids(
    body: jcore.ClosedJaxpr | jcore.Jaxpr,
    const_ids: Sequence[int] | None,
    ins: Sequence[int],
    intern: _Interner,
) -> list[int]:
    """Per output of ``body``, its structural id given the inputs' ids ``ins`` (and, for an
    open jaxpr, its constvars' ``const_ids``)."""
    jaxpr, consts = _open(body)
    if const_ids is None:
        const_ids = [intern(("const", _canon(c, intern))) for c in consts]
    env: dict[Any, int] = dict(zip(jaxpr.constvars, const_ids, strict=True))
    env.update(zip(jaxpr.invars, ins, strict=True))

    def read(v: Any) -> int:
        if isinstance(v, jcore.Literal):
            aval = v.aval
            return intern(("lit", _canon(v.val, intern), str(aval), getattr(aval, "weak_type", 0)))
        return env[v]

    for eqn in jaxpr.eqns:
        args = [read(v) for v in eqn.invars]
        sub = _call_body(eqn)
        if sub is not None:
            outs = _ids(sub, None, args, intern)
        elif eqn.primitive.name == "cond" and "branches" in eqn.params:
            branches = [_ids(b, None, args[1:], intern) for b in eqn.params["branches"]]
            outs = [
                intern(("cond", args[0], tuple(b[j] for b in branches)))
                for j in range(len(eqn.outvars))
            ]
        else:
            prim = eqn.primitive
            key = intern((prim.name, id(prim), _canon(eqn.params, intern), tuple(args)))
            outs = [
                intern((key, j, str(v.aval), getattr(v.aval, "weak_type", 0)))
                for j, v in enumerate(eqn.outvars)
            ]
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]


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
      cannot be traced.
    """
    stages = [_abstract(p) for p in stage_params]
    n = len(stages)
    if n == 0:
        raise ValueError("stage_coupling needs at least one stage")
    if n == 1:
        return Coupling(stages=1, coupled=False, reasons=("one stage: the whole model",))
    try:
        traces = _Traces.of(optimizer, stages)
    except Exception as err:  # anything the user's optimizer raises while tracing
        return Coupling(
            stages=n,
            coupled=True,
            analysed=False,
            splittable=False,
            exact_per_stage=False,
            reasons=(
                "it could not be traced on abstract parameters as update(grads, state, "
                f"params) ({type(err).__name__}: {err}), so pdjax cannot show it acts on "
                "each stage alone",
            ),
            summary=f"it cannot be traced as update(grads, state, params) ({type(err).__name__})",
        )
    return _analyse(traces, stages)


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
    def of(optimizer: optax.GradientTransformation, stages: list[PyTree]) -> _Traces:
        full = _Stages(stages)
        state = jax.eval_shape(optimizer.init, full)
        update, out_shapes = jax.make_jaxpr(optimizer.update, return_shape=True)(full, state, full)
        stage_states = [jax.eval_shape(optimizer.init, p) for p in stages]
        return _Traces(
            state=state,
            init=jax.make_jaxpr(optimizer.init)(full),
            update=update,
            out_shapes=out_shapes,
            stage_states=stage_states,
            stage_inits=[jax.make_jaxpr(optimizer.init)(p) for p in stages],
            stage_updates=[
                jax.make_jaxpr(optimizer.update)(p, st, p)
                for p, st in zip(stages, stage_states, strict=True)
            ],
        )


def _analyse(traces: _Traces, stages: list[PyTree]) -> Coupling:
    n = len(stages)
    full = _Stages(stages)
    state = traces.state
    init_jaxpr, update_jaxpr = traces.init, traces.update
    upd_shape, new_shape = traces.out_shapes
    layout = _StateLayout.of(state)
    sizes = [len(jax.tree.leaves(s)) for s in stages]
    offsets = [0, *itertools.accumulate(sizes)]  # Python ints: the bitsets exceed 64 bits
    n_params, n_state = offsets[-1], len(layout.labels)
    param_paths = [
        _keystr(p) for st in stages for p, _ in jax.tree_util.tree_flatten_with_path(st)[0]
    ]
    param_stage = [s for s in range(n) for _ in range(sizes[s])]
    reasons: list[str] = []
    summary: list[str] = []

    # -- does the state split per stage into the per-stage optimizer's layout? -----------
    if not (
        # jaxlib ships no type stub for PyTreeDef (its == is unknown to mypy)
        jax.tree.structure(upd_shape) == jax.tree.structure(full)  # type: ignore[operator]
        and jax.tree.structure(new_shape) == jax.tree.structure(state)  # type: ignore[operator]
        and len(jax.tree.leaves(state)) == n_state
    ):
        return Coupling(
            stages=n,
            coupled=True,
            splittable=False,
            exact_per_stage=False,
            reasons=("its update does not return trees shaped like the parameters and state",),
            summary="its update does not return trees shaped like the parameters and state",
        )
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

    # -- dependency pass -----------------------------------------------------------------
    # update inputs: grads (n_params) | state (n_state) | params (n_params)
    upd_in = [1 << k for k in range(2 * n_params + n_state)]
    upd_deps = _deps(update_jaxpr, upd_in)
    init_deps = _deps(init_jaxpr, [1 << k for k in range(n_params)])
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
    shared_bit = [1 << (n_params + k) for k in layout.shared]

    def shared_used(bits: int) -> list[int]:
        return [j for j, b in enumerate(shared_bit) if bits & b]

    n_shared = len(layout.shared)
    new_state_deps = upd_deps[n_params:]
    src = [
        _sources_of(new_state_deps[k], masks) | _sources_of(init_deps[k], init_masks)
        for k in layout.shared
    ]
    uses = [shared_used(new_state_deps[k]) for k in layout.shared]
    changed = True
    while changed:  # a shared leaf carries whatever the shared leaves it reads carry
        changed = False
        for j in range(n_shared):
            grown = src[j].union(*(src[i] for i in uses[j]))
            if grown != src[j]:
                src[j], changed = grown, True
    dependent = [j for j in range(n_shared) if src[j]]
    for j in dependent:
        reasons.append(
            f"the state leaf {layout.paths[layout.shared[j]]} is shared by all stages but "
            f"computed from {_names(src[j])}"
        )

    def closure(bits: int) -> set[Source]:
        return _sources_of(bits, masks).union(*(src[j] for j in shared_used(bits)))

    sources: list[frozenset[Source]] = []
    for s in range(n):
        outs: list[tuple[str, set[Source]]] = []
        for k in range(offsets[s], offsets[s + 1]):
            outs.append((f"update of {param_paths[k]}", closure(upd_deps[k])))
        for k in range(n_state):
            if layout.stage_of(k) == s:
                outs.append((f"state {layout.paths[k]}", closure(new_state_deps[k])))
                outs.append(
                    (f"initial state {layout.paths[k]}", _sources_of(init_deps[k], init_masks))
                )
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
    if dependent:
        kinds = sorted({kind for j in dependent for kind, _ in src[j]})
        names = [layout.paths[layout.shared[j]] for j in dependent]
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        summary.append(
            f"the state {', '.join(names[:3])}{more}, shared by all stages, is computed from "
            f"the stages' {_join(kinds)}"
        )

    # -- structural pass -----------------------------------------------------------------
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


def _structurally_equal(
    traces: _Traces,
    stages: list[PyTree],
    stage_labels: list[list[tuple[Hashable, ...]]],
    layout: _StateLayout,
) -> tuple[bool, str]:
    """Compares, by structural ids, each stage's own init/update jaxprs with its part of the
    whole-model ones. Inputs are labelled so that stage ``s``'s leaves get the same ids in
    both traces (and other stages' leaves ids that cannot occur in stage ``s``'s own)."""
    intern = _Interner()
    n = len(stages)
    leaves = [jax.tree.leaves(s) for s in stages]
    state_leaves = jax.tree.leaves(traces.state)

    def tag(label: tuple[Hashable, ...], aval: Any) -> int:
        return intern(("in", label, str(aval.shape), str(aval.dtype)))

    g_ids = [tag(("g", s, i), a) for s in range(n) for i, a in enumerate(leaves[s])]
    p_ids = [tag(("p", s, i), a) for s in range(n) for i, a in enumerate(leaves[s])]
    st_ids = [tag(lb, a) for lb, a in zip(layout.labels, state_leaves, strict=True)]
    full_init = _ids(traces.init, None, p_ids, intern)
    full_upd = _ids(traces.update, None, g_ids + st_ids + p_ids, intern)
    position = {lb: k for k, lb in enumerate(layout.labels)}
    n_params = len(g_ids)
    offset = 0
    for s in range(n):
        own_g = [tag(("g", s, i), a) for i, a in enumerate(leaves[s])]
        own_p = [tag(("p", s, i), a) for i, a in enumerate(leaves[s])]
        own_st_leaves = jax.tree.leaves(traces.stage_states[s])
        own_st = [tag(lb, a) for lb, a in zip(stage_labels[s], own_st_leaves, strict=True)]
        own_init = _ids(traces.stage_inits[s], None, own_p, intern)
        own_upd = _ids(traces.stage_updates[s], None, own_g + own_st + own_p, intern)
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


# ---------------------------------------------------------------------------------------
# The exchange: one scalar per stage
# ---------------------------------------------------------------------------------------


def _accumulator_dtype(tree: PyTree) -> Any:
    """float32, or float64 when a leaf is (the phantom must not lose the model's precision)."""
    dtypes = [jnp.result_type(x) for x in jax.tree.leaves(tree)]
    # jax leaves finfo unannotated
    wide = any(jnp.finfo(d).bits >= 64 for d in dtypes if jnp.issubdtype(d, jnp.inexact))
    return jnp.float64 if wide else jnp.float32


def sum_squares(grads: PyTree) -> jax.Array:
    """The sum of the squared magnitudes of all (floating) gradient leaves, in float32
    (float64 if a leaf is 64-bit): a stage's share of the squared global norm. Pure,
    jittable."""
    dtype = _accumulator_dtype(grads)
    total = jnp.zeros((), dtype)
    for g in jax.tree.leaves(grads):
        g = jnp.asarray(g)
        if not jnp.issubdtype(g.dtype, jnp.inexact):
            continue
        sq = jnp.real(g) ** 2 + jnp.imag(g) ** 2 if jnp.iscomplexobj(g) else jnp.square(g)
        total = total + jnp.sum(sq.astype(dtype))
    return total


def others_sum_squares(stage_sums: Sequence[jax.Array | float], stage: int) -> jax.Array:
    """``sum(stage_sums[t] for t != stage)``: the scalar stage ``stage`` passes to
    :meth:`StageOptimizer.update`. Summed directly rather than as total minus own, which
    could round below zero."""
    others = [jnp.asarray(x) for t, x in enumerate(stage_sums) if t != stage]
    total = jnp.zeros((), jnp.result_type(*others) if others else jnp.float32)
    for x in others:
        total = total + x
    return total


class _PhantomExchange:
    """``optimizer`` on ``(stage tree, phantom)``: the phantom gradient is ``sqrt(others')``,
    its parameter zero, its update dropped."""

    def __init__(self, optimizer: optax.GradientTransformation) -> None:
        self.optimizer = optimizer

    def init(self, params: PyTree) -> optax.OptState:
        return self.optimizer.init((params, jnp.zeros((), _accumulator_dtype(params))))

    def update(
        self, grads: PyTree, opt_state: optax.OptState, params: PyTree, others_sq: Any
    ) -> tuple[PyTree, optax.OptState]:
        dtype = _accumulator_dtype(grads if params is None else params)
        phantom = jnp.sqrt(jnp.maximum(jnp.asarray(others_sq, dtype), 0))
        full_params = None if params is None else (params, jnp.zeros((), dtype))
        updates, opt_state = self.optimizer.update((grads, phantom), opt_state, full_params)
        return updates[0], opt_state


# ---------------------------------------------------------------------------------------
# The numerical check of the exchange
# ---------------------------------------------------------------------------------------

#: Global gradient norms of the check's steps: both sides of any threshold from 1e-3 to 1e3.
_CHECK_NORMS = (10.0, 1e-3, 1e3, 0.1, 1.0, 100.0)


def _random_tree(rng: np.random.Generator, tree: PyTree) -> list[np.ndarray]:
    """Standard normal leaves of ``tree``'s shapes (float64 or complex128, flat), drawn on
    the host (numpy: no random-number kernels to compile); zeros for integer leaves."""
    out = []
    for a in jax.tree.leaves(tree):
        x = np.zeros(a.shape)
        if jnp.issubdtype(a.dtype, jnp.inexact):
            x = rng.standard_normal(a.shape)
        if jnp.issubdtype(a.dtype, jnp.complexfloating):
            x = x + 1j * rng.standard_normal(a.shape)
        out.append(x)
    return out


def _cast(leaves: list[np.ndarray], tree: PyTree, scale: float = 1.0) -> PyTree:
    """``leaves * scale`` in ``tree``'s structure and dtypes."""
    return jax.tree.unflatten(
        jax.tree.structure(tree),
        [(x * scale).astype(a.dtype) for x, a in zip(leaves, jax.tree.leaves(tree), strict=True)],
    )


def _excess(mine: jax.Array, full: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(violation, relative error)`` of one update leaf: ``violation <= 0`` when every
    element is within ``rtol * (|full| + m)`` of the whole model's (``m`` the larger of the
    two leaves' largest magnitudes, ``rtol`` from the dtype) and NaNs sit at the same
    places; the relative error is ``max |mine - full| / m``, for the message."""
    dtype = jnp.result_type(full)
    if not jnp.issubdtype(dtype, jnp.inexact):
        bad = jnp.any(mine != full)
        return bad.astype(jnp.float32), bad.astype(jnp.float32)
    info = jnp.finfo(dtype)
    rtol = max(1e-4, 64 * float(info.eps))
    wide = jnp.promote_types(info.dtype, jnp.float32)
    x, y = jnp.asarray(mine).astype(wide), jnp.asarray(full).astype(wide)
    nan_x, nan_y = jnp.isnan(x), jnp.isnan(y)
    ax, ay = jnp.abs(jnp.where(nan_x, 0, x)), jnp.abs(jnp.where(nan_y, 0, y))
    m = jnp.maximum(jnp.max(ax, initial=0.0), jnp.max(ay, initial=0.0))
    diff = jnp.abs(jnp.where(nan_x | nan_y, 0, x - y))
    violation = jnp.max(diff - rtol * (ay + m), initial=-jnp.inf)
    violation = jnp.where(jnp.any(nan_x != nan_y), jnp.inf, violation)
    rel = jnp.where(m > 0, jnp.max(diff, initial=0.0) / jnp.where(m > 0, m, 1), 0)
    return violation.astype(jnp.float32), rel.astype(jnp.float32)


def exchange_mismatch(
    optimizer: optax.GradientTransformation, stage_params: Sequence[PyTree], *, seed: int = 0
) -> str | None:
    """Runs one whole-model optimizer and the per-stage exchange side by side on random
    inputs of the true shapes and dtypes, and describes the first update that disagrees
    beyond float rounding, or returns None.

    A few steps (optimizer state evolves), each with gradients scaled to a global norm
    from 1e-3 to 1e3 so that norm thresholds bite on both sides, parameters advanced by the
    whole model's updates; all in one program compiled for the host CPU.

    True shapes, not small stand-ins: optimizers change behaviour with shape (adafactor
    factors only large dimensions; muon treats matrices apart), so a stand-in could pass
    where the real model fails. The cost is one whole-model program on the host.
    """
    stages = [_abstract(p) for p in stage_params]
    n = len(stages)
    exchange = _PhantomExchange(optimizer)
    rng = np.random.default_rng(seed)

    def init(params: list[PyTree]) -> tuple[optax.OptState, list[optax.OptState]]:
        return optimizer.init(_Stages(params)), [exchange.init(p) for p in params]

    def step(
        full_state: optax.OptState,
        states: list[optax.OptState],
        params: list[PyTree],
        grads: list[PyTree],
    ) -> tuple[Any, ...]:
        updates, full_state = optimizer.update(_Stages(grads), full_state, _Stages(params))
        sums = [sum_squares(g) for g in grads]
        report = []
        for s in range(n):
            mine, states[s] = exchange.update(
                grads[s], states[s], params[s], others_sum_squares(sums, s)
            )
            pairs = zip(jax.tree.leaves(mine), jax.tree.leaves(updates.stages[s]), strict=True)
            report.append([_excess(a, b) for a, b in pairs])
        params = [optax.apply_updates(p, u) for p, u in zip(params, updates.stages, strict=True)]
        return full_state, states, params, report

    reports = []
    try:
        with jax.default_device(jax.devices("cpu")[0]):
            params = [_cast(_random_tree(rng, s), s) for s in stages]
            full_state, states = jax.jit(init)(params)
            run_step = jax.jit(step)
            for norm in _CHECK_NORMS:
                raw = [_random_tree(rng, s) for s in stages]
                total = np.sqrt(sum(np.sum(np.abs(x) ** 2) for leaves in raw for x in leaves))
                scale = norm / max(float(total), 1e-30)
                grads = [_cast(r, s, scale) for r, s in zip(raw, stages, strict=True)]
                full_state, states, params, report = run_step(full_state, states, params, grads)
                reports.append(jax.device_get(report))
    except Exception as err:  # the user's optimizer, e.g. on a tree with the phantom leaf
        return (
            "the optimizer fails on the check's inputs (the whole model, or a stage's tree "
            f"plus the phantom leaf): {type(err).__name__}: {err}"
        )
    paths = [[_keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(s)[0]] for s in stages]
    for k, (norm, per_stage) in enumerate(zip(_CHECK_NORMS, reports, strict=True)):
        for s, leaves in enumerate(per_stage):
            for i, (violation, rel) in enumerate(leaves):
                if not violation <= 0:
                    return (
                        f"at step {k} (gradients of global norm {norm:g}) stage {s}'s update "
                        f"of {paths[s][i]} differs from the whole model's by {float(rel):.2g} "
                        "relative"
                    )
    return None


def coupled_through_grad_norm(
    optimizer: optax.GradientTransformation, stage_params: Sequence[PyTree]
) -> bool:
    """Whether ``optimizer`` couples the stages, but only through the gradients' global sum
    of squares, so that :class:`StageOptimizer`'s one-scalar exchange reproduces the
    whole-model update.

    Two tests: the analysis must find other stages' *gradients* as the only cross-stage
    inputs (parameters or state of other stages rule it out for sure: a DoG-style
    parameter-distance norm), and :func:`exchange_mismatch` must find no disagreement on its
    random inputs. The second is a sample: an optimizer that departs from a function of the
    global norm only outside the sampled norms (1e-3 to 1e3) would pass it.
    """
    coupling = stage_coupling(optimizer, stage_params)
    return coupling.gradients_only and exchange_mismatch(optimizer, stage_params) is None


# ---------------------------------------------------------------------------------------
# What a stage runs
# ---------------------------------------------------------------------------------------

_ADVICE = (
    "To train with this pipeline, make the optimizer act on each parameter on its own (e.g. "
    "per-leaf clipping optax.clip(...) or optax.clip_by_block_rms(...) instead of a global "
    "norm), or pass optimizer_scope='stage' to accept per-stage semantics (each stage runs "
    "the optimizer on its own parameters only, which is not sequential training)."
)


class StageOptimizer:
    """The user's optimizer as each stage runs it, exact for the whole model or refused.

    One object serves every stage (its functions take one stage's trees). Three modes:

    - the optimizer acts on each stage alone (:func:`stage_coupling`): ``init``/``update``
      are the optimizer's own, the state layout is unchanged, ``others_sq`` is ignored;
    - it is coupled only through the gradients' global norm (``needs_exchange``): each
      stage computes :meth:`sum_squares` of its gradients, the caller gives every stage the
      sum of the *other* stages' scalars (:func:`others_sum_squares`) and :meth:`update`
      runs the optimizer with a phantom leaf carrying it. The state is the optimizer's state
      over ``(stage params, phantom scalar)``;
    - otherwise the constructor raises :class:`~pdjax.errors.PipelineError` naming what
      couples the stages.

    ``scope="stage"`` skips all checks: the optimizer runs on each stage alone, knowingly.

    Args:
      optimizer: the user's optax transformation.
      stage_params: per stage, its parameter tree (abstract or concrete).
      scope: ``"model"`` (exact whole-model semantics, or an error) or ``"stage"``.
      check: run :func:`exchange_mismatch` before accepting an exchange (one whole-model
        update on the host CPU; turn off only for an optimizer already checked).
    """

    def __init__(
        self,
        optimizer: optax.GradientTransformation,
        stage_params: Sequence[PyTree],
        *,
        scope: Literal["model", "stage"] = "model",
        check: bool = True,
    ) -> None:
        if scope not in ("model", "stage"):
            raise ValueError(f"scope must be 'model' or 'stage', not {scope!r}")
        self.optimizer = optimizer
        self.scope = scope
        self.coupling: Coupling | None = None
        self._exchange: _PhantomExchange | None = None
        if scope == "stage":
            return
        self.coupling = coupling = stage_coupling(optimizer, stage_params)
        if not coupling.coupled:
            return
        if not coupling.gradients_only:
            raise PipelineError(
                "the optimizer couples the pipeline stages in a way pdjax cannot make exact "
                f"per stage: {coupling.summary}. Between stages pdjax can exchange only the "
                "gradients' global norm (what optax.clip_by_global_norm needs). " + _ADVICE
            )
        if check:
            mismatch = exchange_mismatch(optimizer, stage_params)
            if mismatch is not None:
                raise PipelineError(
                    "the optimizer couples the pipeline stages through their gradients "
                    f"({coupling.summary}), but not only through the gradients' global norm, "
                    f"the one scalar pdjax exchanges between stages: with that exchange, "
                    f"{mismatch}. " + _ADVICE
                )
        self._exchange = _PhantomExchange(optimizer)

    @property
    def needs_exchange(self) -> bool:
        """Whether :meth:`update` needs the other stages' sum of squares."""
        return self._exchange is not None

    def init(self, params: PyTree) -> optax.OptState:
        """The optimizer state of one stage with parameters ``params``."""
        if self._exchange is not None:
            return self._exchange.init(params)
        return self.optimizer.init(params)

    @staticmethod
    def sum_squares(grads: PyTree) -> jax.Array:
        """This stage's scalar for the exchange (:func:`sum_squares`): compute it from the
        gradients exactly as they will be passed to :meth:`update` (after any scaling)."""
        return sum_squares(grads)

    def update(
        self,
        grads: PyTree,
        opt_state: optax.OptState,
        params: PyTree = None,
        others_sq: jax.Array | float | None = None,
    ) -> tuple[PyTree, optax.OptState]:
        """``-> (updates, new state)`` for one stage, as ``optax`` would compute them for
        this stage's part of the whole model. Pure; call it inside the stage's jitted
        update. ``others_sq`` (required when :attr:`needs_exchange`) is the sum of the other
        stages' :meth:`sum_squares`."""
        if self._exchange is None:
            out: tuple[PyTree, optax.OptState] = self.optimizer.update(grads, opt_state, params)
            return out
        if others_sq is None:
            raise PipelineError(
                "this optimizer is coupled through the gradients' global norm: pass "
                "others_sq, the sum of the other stages' sum_squares(grads)"
            )
        return self._exchange.update(grads, opt_state, params, others_sq)
