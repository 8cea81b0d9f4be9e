"""The user's optimizer across pipeline stages: when running it per stage is exact, and an
exact scalar exchange for optimizers coupled through the gradients' global norm.

A pipeline splits the model's parameters into stages and each stage runs the user's optax
optimizer on its own parameters and gradients. That equals one optimizer step over the whole
model (what sequential training computes) only when the optimizer treats the stages' leaves
independently. ``optax.chain(optax.clip_by_global_norm(c), ...)`` does not: its clipping
factor is a function of *every* gradient, so per-stage updates would be silently wrong.
This module decides, before training, which case an optimizer is in, and either makes the
per-stage run exact or refuses with a :class:`~pdjax.errors.PipelineError`.

The analysis (:func:`stage_coupling`, in :mod:`pdjax.pipeline.optim_coupling`) runs
nothing on data: it traces ``optimizer.init`` and ``optimizer.update`` on the whole model
and on each stage alone, and compares the jaxprs' data flow and structure.

Coupled optimizers whose cross-stage inputs are only other stages' gradients may be
coupled through the gradients' global norm; :class:`StageOptimizer` then makes them exact
with one scalar per stage: each stage computes :func:`sum_squares` of its gradients, the
pipeline exchanges the scalars, and each stage runs the optimizer on its tree plus one
*phantom* gradient leaf ``sqrt(others' sum of squares)`` (and a zero phantom parameter), so
``optax.tree.norm`` over the stage's tree is the whole model's global norm; the phantom's
update is dropped. Whether that is exact for the given optimizer is checked once, by running
both on random inputs of the true shapes on CPU (a sample, not a proof: see
:func:`coupled_through_grad_norm`).

float16's dynamic loss scaling (:func:`pdjax.precision.loss_scaled`) is such an optimizer:
its step is skipped unless *every* gradient is finite. Through the exchange each stage's
check covers its own gradients and the phantom, ``sqrt`` of the other stages' sums of
squares, which is not finite when any of theirs is; so all stages skip together and keep
one scale. (A sum of squares can also overflow float32 from finite gradients; that needs
gradients near 1e19, far beyond what float16 compute makes.)

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

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pdjax.errors import PipelineError
from pdjax.pipeline.optim_coupling import Coupling, Stages, abstract, keystr, stage_coupling
from pdjax.precision import LossScaled, loss_scale_of

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
    stages = [abstract(p) for p in stage_params]
    n = len(stages)
    exchange = _PhantomExchange(optimizer)
    rng = np.random.default_rng(seed)

    def init(params: list[PyTree]) -> tuple[optax.OptState, list[optax.OptState]]:
        return optimizer.init(Stages(params)), [exchange.init(p) for p in params]

    def step(
        full_state: optax.OptState,
        states: list[optax.OptState],
        params: list[PyTree],
        grads: list[PyTree],
    ) -> tuple[Any, ...]:
        updates, full_state = optimizer.update(Stages(grads), full_state, Stages(params))
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
            f"plus the phantom leaf, named {PHANTOM_NAME!r} among the model's own names): "
            f"{type(err).__name__}: {err}"
        )
    paths = [[keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(s)[0]] for s in stages]
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
# The model's own names: what an optimizer of split_model's layers sees
# ---------------------------------------------------------------------------------------

#: The name of the phantom leaf (:class:`_PhantomExchange`) in a tree of the model's own
#: names: a mask or label function sees it beside the stage's parameters.
PHANTOM_NAME = "pdjax_phantom"


def keeps_model_tree(layers: Any) -> bool:
    """Whether ``layers`` keep their variables in the model's own tree
    (:func:`~pdjax.layers.split_model`'s: each layer's parameters a part of ``params`` of
    the whole model, under the model's names), so that the optimizer is to see each
    stage's parameters as that part (:class:`StageOptimizer`'s ``model_tree``)."""
    from pdjax.layers.split import SplitLayers

    return isinstance(layers, SplitLayers)


def on_model_names(
    optimizer: optax.GradientTransformation, layers: Any
) -> optax.GradientTransformation:
    """``optimizer`` run on the model's own names where ``layers`` keep the model's tree
    (:func:`keeps_model_tree`), for a runner that holds all the layers' parameters as one
    per-layer list (the data-parallel runner): a mask or label function then reads the
    names of the user's tree, and the state keeps the runner's structure. Other layers:
    ``optimizer`` itself."""
    if not keeps_model_tree(layers):
        return optimizer
    named: dict[Any, _ModelNamed] = {}

    def on(tree: PyTree) -> _ModelNamed:
        key = jax.tree.structure(tree)
        if key not in named:
            named[key] = _ModelNamed(optimizer, [abstract(tree)])
        return named[key]

    def init(params: PyTree) -> optax.OptState:
        return on(params).init(params)

    def update(
        updates: PyTree, state: optax.OptState, params: PyTree = None, **extra: Any
    ) -> tuple[PyTree, optax.OptState]:
        return on(updates).update(updates, state, params, **extra)

    return optax.GradientTransformation(init, update)


def _merge(into: dict[Any, Any], tree: Any) -> bool:
    """Merges the nested dict ``tree`` into ``into``, leaving out what holds no leaf (a tied
    copy hidden from the optimizer); False where a name would hold two values."""
    if not isinstance(tree, Mapping):
        return False
    for k, v in tree.items():
        if not jax.tree.leaves(v):
            continue
        if isinstance(v, Mapping):
            node = into.setdefault(k, {})
            if not isinstance(node, dict) or not _merge(node, v):
                return False
        elif k in into:
            return False
        else:
            into[k] = v
    return True


class _Naming:
    """One tree as pdjax holds it (``own``: a stage's per-layer list, the whole model's
    :class:`~pdjax.pipeline.optim_coupling.Stages`, or a stage with the phantom) and as
    the model names it (one nested dict): the same leaves, in another structure."""

    def __init__(self, own: Any, named: Any, order: list[int]) -> None:
        self.own = own  # pdjax's structure (treedef)
        self.named = named  # the model's (treedef)
        self.order = order  # per leaf of the named tree, its position in pdjax's

    @staticmethod
    def of(tree: PyTree, phantom: bool = False) -> _Naming | None:
        """The naming of ``tree`` (a stage's per-layer list, or ``Stages`` of them; with
        ``phantom``, ``(tree, phantom scalar)``), or None where the layers' dicts do not
        merge into one (a name holding two values)."""
        own = jax.tree.structure((tree, 0) if phantom else tree)
        count = len(jax.tree.leaves((tree, 0) if phantom else tree))
        tags = jax.tree.unflatten(own, list(range(count)))
        layers = tags[0] if phantom else tags
        if isinstance(layers, Stages):
            layers = [layer for stage in layers.stages for layer in stage]
        named: dict[Any, Any] = {}
        if not isinstance(layers, list | tuple) or not all(_merge(named, v) for v in layers):
            return None
        if phantom:
            if PHANTOM_NAME in named:
                return None
            named[PHANTOM_NAME] = tags[1]
        leaves, treedef = jax.tree.flatten(named)
        if sorted(leaves) != list(range(count)):
            return None
        return _Naming(own, treedef, leaves)

    def to_named(self, tree: PyTree) -> PyTree:
        """A tree of pdjax's structure (down to its leaves' places) in the model's."""
        parts = self.own.flatten_up_to(tree)
        return self.named.unflatten([parts[i] for i in self.order])

    def to_own(self, tree: PyTree) -> PyTree:
        """The inverse of :meth:`to_named`."""
        parts: list[Any] = [None] * len(self.order)
        for i, part in zip(self.order, self.named.flatten_up_to(tree), strict=True):
            parts[i] = part
        return self.own.unflatten(parts)

    def _mirrors(self, treedef: Any) -> Any:
        def mirrors(x: Any) -> bool:
            try:
                treedef.flatten_up_to(x)
            except (ValueError, TypeError):
                return False
            return True

        return mirrors

    def state_to_own(self, state: PyTree) -> PyTree:
        """An optimizer state with every subtree shaped like the named tree (adam's
        ``mu``...) in pdjax's structure."""
        named = self._mirrors(self.named)
        return jax.tree.map(lambda x: self.to_own(x) if named(x) else x, state, is_leaf=named)

    def state_to_named(self, state: PyTree) -> PyTree:
        """The inverse of :meth:`state_to_own`."""
        own = self._mirrors(self.own)
        return jax.tree.map(lambda x: self.to_named(x) if own(x) else x, state, is_leaf=own)


class _ModelNamed:
    """The user's optimizer run on the model's own names: each tree pdjax gives it (a
    stage's parameters, the whole model's in the analysis, a stage's with the phantom) is
    passed as the part of the model's ``params`` tree it is, under the model's names, so
    that a mask or label function reading them (``flax.traverse_util.flatten_dict``) finds
    the names the user's tree has; its state is kept in pdjax's structure (a subtree shaped
    like the parameters mirrors pdjax's tree), and its updates given back so. A tree of any
    other structure is passed as it is."""

    def __init__(
        self, optimizer: optax.GradientTransformation, stage_params: Sequence[PyTree]
    ) -> None:
        self.optimizer = optimizer
        self._namings: dict[Any, _Naming] = {}
        trees = [*stage_params, Stages(stage_params)]
        for tree, phantom in [(t, False) for t in trees] + [(p, True) for p in stage_params]:
            naming = _Naming.of(tree, phantom)
            if naming is not None:
                self._namings[naming.own] = naming

    def _naming(self, tree: PyTree) -> _Naming | None:
        return self._namings.get(jax.tree.structure(tree))

    def init(self, params: PyTree) -> optax.OptState:
        naming = self._naming(params)
        if naming is None:
            return self.optimizer.init(params)
        return naming.state_to_own(self.optimizer.init(naming.to_named(params)))

    def update(
        self, updates: PyTree, state: optax.OptState, params: PyTree = None, **extra: Any
    ) -> tuple[PyTree, optax.OptState]:
        naming = self._naming(updates)
        if naming is None:
            out: tuple[PyTree, optax.OptState] = self.optimizer.update(
                updates, state, params, **extra
            )
            return out
        new, state = self.optimizer.update(
            naming.to_named(updates),
            naming.state_to_named(state),
            None if params is None else naming.to_named(params),
            **extra,
        )
        return naming.to_own(new), naming.state_to_own(state)


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

    With ``model_tree`` (layers that keep the model's own tree: :func:`keeps_model_tree`)
    the optimizer sees each stage's parameters as the part of the model's ``params`` they
    are, one dict under the model's names (the layers' dicts merged, a tied copy once),
    and the whole model's in the analysis as that whole tree: a mask or label function
    (``optax.masked``, ``optax.adamw(mask=...)``, ``optax.multi_transform``) that reads the
    names finds the user's. With the exchange, the phantom leaf is one more name,
    :data:`PHANTOM_NAME`. The state keeps pdjax's structure either way.

    Args:
      optimizer: the user's optax transformation.
      stage_params: per stage, its parameter tree (abstract or concrete): the stage's
        per-layer list, as the stage passes it to the optimizer.
      scope: ``"model"`` (exact whole-model semantics, or an error) or ``"stage"``.
      check: run :func:`exchange_mismatch` before accepting an exchange (one whole-model
        update on the host CPU; turn off only for an optimizer already checked).
      model_tree: give the optimizer the model's own names (see above).

    Raises:
      PipelineError: the optimizer couples the stages in a way pdjax cannot make exact,
        or it fails on a stage's own parameters (its ``init`` or ``update`` raises: the
        message carries the optimizer's own error).
    """

    def __init__(
        self,
        optimizer: optax.GradientTransformation,
        stage_params: Sequence[PyTree],
        *,
        scope: Literal["model", "stage"] = "model",
        check: bool = True,
        model_tree: bool = False,
    ) -> None:
        if scope not in ("model", "stage"):
            raise ValueError(f"scope must be 'model' or 'stage', not {scope!r}")
        self.optimizer = optimizer
        self.scope = scope
        #: what runs the optimizer: itself, or on the model's own names
        self._run = optimizer
        if model_tree and stage_params:
            named = _ModelNamed(optimizer, abstract(stage_params))
            self._run = optax.GradientTransformation(named.init, named.update)
        #: a :func:`pdjax.precision.loss_scaled` optimizer: the last stage seeds its
        #: backward with the loss scale of its state (:meth:`loss_scale`)
        self.loss_scaled = isinstance(optimizer, LossScaled)
        self.coupling: Coupling | None = None
        self._exchange: _PhantomExchange | None = None
        if scope == "stage":
            return
        self.coupling = coupling = stage_coupling(self._run, stage_params)
        if not coupling.coupled:
            return
        if not coupling.gradients_only:
            raise PipelineError(
                "the optimizer couples the pipeline stages in a way pdjax cannot make exact "
                f"per stage: {coupling.summary}. Between stages pdjax can exchange only the "
                "gradients' global norm (what optax.clip_by_global_norm needs). " + _ADVICE
            )
        if check:
            mismatch = exchange_mismatch(self._run, stage_params)
            if mismatch is not None:
                raise PipelineError(
                    "the optimizer couples the pipeline stages through their gradients "
                    f"({coupling.summary}), but not only through the gradients' global norm, "
                    f"the one scalar pdjax exchanges between stages: with that exchange, "
                    f"{mismatch}. " + _ADVICE
                )
        self._exchange = _PhantomExchange(self._run)

    @property
    def needs_exchange(self) -> bool:
        """Whether :meth:`update` needs the other stages' sum of squares."""
        return self._exchange is not None

    def init(self, params: PyTree) -> optax.OptState:
        """The optimizer state of one stage with parameters ``params``."""
        if self._exchange is not None:
            return self._exchange.init(params)
        return self._run.init(params)

    def loss_scale(self, opt_state: optax.OptState) -> jax.Array:
        """The current loss scale in a stage's optimizer state (a :func:`loss_scaled
        <pdjax.precision.loss_scaled>` optimizer's, with or without the exchange's phantom
        leaf)."""
        scale = loss_scale_of(opt_state)
        if scale is None:
            raise PipelineError("the optimizer is not loss_scaled: its state has no loss scale")
        return scale

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
            out: tuple[PyTree, optax.OptState] = self._run.update(grads, opt_state, params)
            return out
        if others_sq is None:
            raise PipelineError(
                "this optimizer is coupled through the gradients' global norm: pass "
                "others_sq, the sum of the other stages' sum_squares(grads)"
            )
        return self._exchange.update(grads, opt_state, params, others_sq)
