"""The profiler: per-layer costs of a layer sequence from XLA, and optionally measured.

For each layer, on its input's shape (the previous layer's output), pdjax compiles

* the forward ``apply(variables, x) -> y``,
* the backward alone: the VJP's residuals and an output cotangent in, parameter
  gradients (and, past the first layer, the input gradient) out — exactly the work a
  pipeline stage's backward does,
* for a layer with parameters that also computes its input gradient, that backward split
  in two as zero bubble (``zb-h1``) runs it: the input gradient alone (``I``: the same
  pullback keeping only the input's cotangent) and the weight gradient alone (``W``:
  keeping only the parameters'); XLA drops the other half of each.

It reads FLOPs and bytes accessed from each one's ``compiled.cost_analysis()``. Compiling needs
only shapes, so paper-size models profile without allocating their weights. With
``measure=True`` the same compiled programs are also run on a device (warm-up, then the
median of several timed runs): each program is compiled once, and the executable that is
counted is the one that is timed. A layer without parameters has ``W = 0`` and ``I`` = its
backward; one without input gradient has ``I = 0`` and ``W`` = its backward: neither
needs another program.

Identical layers share their programs: a layer whose module equals an earlier layer's (a
linen module's fields, an nnx module's graph definition, the same function object) and
whose parameters, state and input have the same shapes and dtypes is not compiled again
(the repeated blocks of a transformer compile once). It gets the earlier layer's counts
and, measured, its own times from the shared executables: the forward on its own
parameters and input (drawing the earlier layer's dropout masks: the same work), the
backward on the earlier layer's residuals and cotangent (the same shapes, real values).

Known limits of XLA's counts: a ``scan``/``fori_loop`` body (e.g. an LSTM over time) is
counted once, not once per iteration — measure such models; convolution FLOPs exclude
padded taps.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from pdjax._timing import median_seconds
from pdjax.errors import ProfileError
from pdjax.layers import Layer, LayerSequence, PyTree, Variables
from pdjax.profile.devices import DeviceModel, get_device_model
from pdjax.profile.profile import LayerProfile, Profile
from pdjax.profile.programs import (
    LayerFns,
    Programs,
    compile,
    compile_programs,
    cost_analysis,
    find,
    nbytes,
    policy_costs,
    recurring,
    reuse_key,
    trace_vjp,
)

__all__ = ["ProgressCallback", "cost_analysis", "profile"]


class ProgressCallback(Protocol):
    """What :func:`profile` calls to report progress: ``callback(done, total, current)``
    before each layer (``done`` layers finished, ``current`` the name of the one starting)
    and once at the end (``done == total``, ``current`` None)."""

    def __call__(self, done: int, total: int, current: str | None) -> None: ...


def _spec(tree: PyTree) -> PyTree:
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


def _is_float(leaf: Any) -> bool:
    return jnp.issubdtype(leaf.dtype, jnp.inexact)


def _render(tree: PyTree) -> str:
    parts = [f"{leaf.dtype}{list(leaf.shape)}" for leaf in jax.tree.leaves(tree)]
    return parts[0] if len(parts) == 1 else "(" + ", ".join(parts) + ")"


def _batch_size(sample: PyTree) -> int:
    leaves = jax.tree.leaves(sample)
    if not leaves or not getattr(leaves[0], "shape", ()):
        raise ProfileError(
            "the sample batch needs a leading batch dimension (got a scalar or an empty pytree)"
        )
    return int(leaves[0].shape[0])


def _compute_dtype(y: PyTree, x: PyTree, params: PyTree) -> str:
    """The dtype a layer computes in, for the device model's peak: that of its first
    floating-point output (a mixed-precision layer keeping float32 parameters computes in
    the dtype it casts to, which is what it returns), else its input's, else its
    parameters', else float32."""
    for tree in (y, x, params):
        for leaf in jax.tree.leaves(tree):
            if _is_float(leaf):
                return str(leaf.dtype)
    return "float32"


def _cotangent(y: PyTree, device: jax.Device) -> PyTree:
    """Ones shaped like the output (``float0`` zeros for its integer parts), made on the
    host: no program is compiled for them."""
    return jax.tree.map(
        lambda leaf: (
            jax.device_put(np.ones(leaf.shape, leaf.dtype), device)
            if _is_float(leaf)
            else np.zeros(leaf.shape, jax.dtypes.float0)
        ),
        y,
    )


def _cotangent_spec(y: PyTree) -> PyTree:
    return jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype if _is_float(s) else jax.dtypes.float0),
        y,
    )


def _reporter(progress: Any, total: int) -> Callable[[int, str | None], None]:
    """``report(done, current)`` for ``progress``: nothing, a :class:`ProgressCallback`, or
    a ``rich.progress.Progress`` (which gets a task of its own)."""
    if progress is None:
        return lambda done, current: None
    if hasattr(progress, "add_task") and hasattr(progress, "update"):
        task = progress.add_task("profiling", total=total)

        def advance(done: int, current: str | None) -> None:
            text = f"profiling {current}" if current is not None else "profiled"
            progress.update(task, completed=done, description=text)

        return advance
    if callable(progress):
        return lambda done, current: progress(done, total, current)
    raise ProfileError(
        f"progress must be a callable (done, total, current) or a rich Progress, "
        f"got {type(progress).__name__}"
    )


def profile(
    layers: LayerSequence,
    sample: PyTree,
    *,
    variables: list[Variables] | None = None,
    rng: jax.Array | None = None,
    train: bool = True,
    measure: bool = False,
    device: jax.Device | None = None,
    device_model: str | DeviceModel | None = None,
    warmup: int = 2,
    repeats: int = 5,
    meta: Mapping[str, str] | None = None,
    progress: ProgressCallback | Any | None = None,
    memory_policies: bool = False,
    loss_fn: Callable[[PyTree, PyTree], Any] | None = None,
    targets: PyTree | None = None,
) -> Profile:
    """Profiles every layer of ``layers`` on the batch ``sample``.

    Args:
      layers: the model as a layer sequence.
      sample: one batch of inputs (arrays or ``jax.ShapeDtypeStruct``s; only shapes are
        needed unless ``measure``). Its leading dimension is the profile's batch size.
      variables: per-layer variables; default: initialised abstractly from ``rng``.
      rng: PRNG key for initialisation and dropout (default ``jax.random.key(0)``).
      train: profile the training-mode forward (dropout on, BatchNorm batch statistics).
      measure: also time forward and backward on ``device`` (needs concrete inputs: ones of the
        sample's shapes if abstract); the timed executables are the counted ones, compiled once.
      device: where to measure (default ``jax.devices()[0]``).
      device_model: a preset name (``"h100"``, ``"v100"``, ...) or :class:`DeviceModel`
        whose roofline turns FLOPs and bytes into seconds; ``"measured"`` = ``measure``.
        A layer is costed at the peak of the dtype it computes in: that of its
        floating-point output (else its input's, else its parameters'), so a layer that
        keeps float32 parameters but casts them to bfloat16 gets the bfloat16 peak.
      warmup: untimed runs before timing.
      repeats: timed runs; the median is kept.
      meta: extra provenance stored in the profile.
      progress: where to report progress, layer by layer (default: nowhere): a
        :class:`ProgressCallback` ``(done, total, current)``, or a
        ``rich.progress.Progress``, to which a task is added and advanced.
      memory_policies: also price each named memory policy per layer (off by default:
        about half again the profiling time)
        (:attr:`LayerProfile.policies`: residual bytes and the share of the forward
        recomputed, from abstract traces and XLA's counts of lowered programs, nothing
        compiled or run), which :func:`pdjax.partition.plan_auto` chooses among.
      loss_fn: the model's loss ``loss_fn(output, targets)``, with ``targets`` (a batch of
        them, or their shapes): the residuals its VJP keeps (e.g. the softmax of the
        logits), which the last stage holds per microbatch in flight beside its layers',
        are added to the last layer's ``residual_bytes`` and to each of its policies'
        (the loss is never checkpointed). Without it they are not counted.

    Returns:
      The :class:`Profile` (a chain), seconds from the measurement or the device model
      (None without either).

    Raises:
      ProfileError: for a sample without batch dimension, both ``measure`` and a device
        model preset, bad ``warmup``/``repeats``, or a ``progress`` of another kind.
    """
    measure, model = _timing(measure, device_model, warmup, repeats)
    batch_size = _batch_size(sample)
    report = _reporter(progress, len(layers))
    rng = jax.random.key(0) if rng is None else rng
    sample_spec = _spec(sample)
    if variables is None:
        variables = jax.eval_shape(layers.init, rng, sample_spec)
    var_specs = [_spec(v) for v in variables]
    boundaries = layers.boundary_specs(var_specs, sample_spec)
    setup = _Setup(
        train=train,
        rng=rng,
        measure=measure,
        device=device if device is not None else jax.devices()[0],
        model=model,
        warmup=warmup,
        repeats=repeats,
        policies=memory_policies,
    )
    x_real, variables = (
        _real_inputs(layers, sample, variables, rng, setup.device) if measure else (None, variables)
    )
    steps = _steps(layers, var_specs, boundaries, train)
    results = _profile_layers(
        layers, steps, setup=setup, variables=variables, x_real=x_real, report=report
    )
    report(len(layers), None)
    if loss_fn is not None:
        results[-1] = _with_loss(results[-1], loss_fn, boundaries[-1], targets)
    return Profile.chain(
        results,
        batch_size=batch_size,
        time_source=_time_source(setup),
        dtype=_params_dtype(steps),
        meta=_provenance(train, model, meta),
    )


def _with_loss(
    layer: LayerProfile, loss_fn: Callable[[PyTree, PyTree], Any], y: PyTree, targets: PyTree
) -> LayerProfile:
    """The last layer's profile with the loss's residuals added (see :func:`profile`)."""
    if targets is None:
        raise ProfileError("loss_fn needs targets: a batch of the loss's targets (or shapes)")
    found: list[int] = []

    def probe(y: PyTree, t: PyTree) -> Any:
        _, pullback = jax.vjp(lambda out: loss_fn(out, t), y)
        leaves = jax.tree.leaves(pullback)
        found.append(
            nbytes([a for a in {id(a): a for a in leaves}.values() if hasattr(a, "shape")])
        )
        return pullback

    jax.eval_shape(probe, y, _spec(targets))
    extra = found[0]
    return dataclasses.replace(
        layer,
        residual_bytes=layer.residual_bytes + extra,
        policies=tuple(
            dataclasses.replace(p, residual_bytes=p.residual_bytes + extra) for p in layer.policies
        ),
    )


def _timing(
    measure: bool, device_model: str | DeviceModel | None, warmup: int, repeats: int
) -> tuple[bool, DeviceModel | None]:
    """``(measure, device model)`` that :func:`profile`'s arguments ask for, checked."""
    if isinstance(device_model, str) and device_model.lower() == "measured":
        measure, device_model = True, None
    if measure and device_model is not None:
        raise ProfileError(
            "choose measured times (measure=True) or a device model, not both; "
            "a profile holds one set of seconds"
        )
    if measure and (warmup < 0 or repeats < 1):
        raise ProfileError(f"need warmup >= 0 and repeats >= 1, got {warmup}, {repeats}")
    model = get_device_model(device_model) if isinstance(device_model, str) else device_model
    return measure, model


def _real_inputs(
    layers: LayerSequence,
    sample: PyTree,
    variables: list[Variables],
    rng: jax.Array,
    device: jax.Device,
) -> tuple[PyTree, list[Variables]]:
    """The sample and the variables as arrays on ``device``, for measuring: ones where
    the sample is abstract, the variables initialised where they are."""
    x_real = jax.device_put(
        jax.tree.map(
            lambda s: np.ones(s.shape, s.dtype) if isinstance(s, jax.ShapeDtypeStruct) else s,
            sample,
        ),
        device,
    )
    if any(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(variables)):
        init = compile(jax.jit(layers.init).lower(rng, x_real), timed=False)
        variables = init(rng, x_real)
    return x_real, jax.device_put(variables, device)


@dataclasses.dataclass(frozen=True)
class _Setup:
    """What every layer of one :func:`profile` call is profiled under (its arguments)."""

    train: bool
    rng: jax.Array
    measure: bool
    device: jax.Device
    model: DeviceModel | None
    warmup: int
    repeats: int
    policies: bool = True


@dataclasses.dataclass(frozen=True)
class _Step:
    """One layer's arguments as shapes, and its key for sharing programs.

    Attributes:
      params, rest: its parameters and other collections.
      x_spec, y_spec: its input and output.
      input_grad: whether its backward computes the input's gradient.
      key: its reuse key (:func:`_reuse_key`) on these shapes.
    """

    params: PyTree
    rest: Variables
    x_spec: PyTree
    y_spec: PyTree
    input_grad: bool
    key: Any

    @property
    def has_params(self) -> bool:
        return bool(jax.tree.leaves(self.params))

    @property
    def split(self) -> bool:
        """Zero bubble's split: programs of their own only where both halves have work."""
        return self.has_params and self.input_grad


def _steps(
    layers: LayerSequence, var_specs: list[Variables], boundaries: list[PyTree], train: bool
) -> list[_Step]:
    """Each layer's parameters, state, input and output: which layers will share programs
    is known before any compiles."""
    steps = []
    for i, layer in enumerate(layers):
        params = var_specs[i].get("params", {})
        rest = {k: v for k, v in var_specs[i].items() if k != "params"}
        input_grad = i > 0 and any(_is_float(leaf) for leaf in jax.tree.leaves(boundaries[i]))
        key = reuse_key(layer, train, input_grad, (params, rest, boundaries[i]))
        steps.append(
            _Step(
                params=params,
                rest=rest,
                x_spec=boundaries[i],
                y_spec=boundaries[i + 1],
                input_grad=input_grad,
                key=key,
            )
        )
    return steps


def _profile_layers(
    layers: LayerSequence,
    steps: list[_Step],
    *,
    setup: _Setup,
    variables: list[Variables],
    x_real: PyTree,
    report: Callable[[int, str | None], None],
) -> list[LayerProfile]:
    """Every layer's profile in turn; measuring, each layer runs on the previous one's
    real output (``x_real``: the sample's, for the first)."""
    recurs = recurring([step.key for step in steps])
    cache: list[tuple[Any, Programs]] = []
    results = []
    for i, layer in enumerate(layers):
        report(i, layer.name)
        step = steps[i]
        if setup.measure:
            # lower on the real arguments, so that the programs timed are the ones counted
            p_real = variables[i].get("params", {})
            r_real = {k: v for k, v in variables[i].items() if k != "params"}
            args: tuple[Any, ...] = (p_real, r_real, x_real)
        else:
            args = (step.params, step.rest, step.x_spec)
        programs, bwd_args, y_real = _layer_programs(
            layer,
            i,
            step=step,
            setup=setup,
            args=args,
            cache=cache,
            keep=setup.measure and recurs[i],
        )
        secs = _layer_seconds(programs, args, bwd_args, setup, step)
        if setup.measure:
            x_real = y_real
        results.append(_layer_profile(layer, step, programs, secs))
    return results


def _layer_programs(
    layer: Layer,
    i: int,
    *,
    step: _Step,
    setup: _Setup,
    args: tuple[Any, ...],
    cache: list[tuple[Any, Programs]],
    keep: bool,
) -> tuple[Programs, tuple[Any, ...] | None, PyTree]:
    """Layer ``i``'s programs, from ``cache`` (an identical earlier layer's) or compiled
    and added there, with the backward's arguments and, measuring, the real output
    (``(programs, bwd_args, y_real)``; ``bwd_args`` None when the shared programs are
    only counted)."""
    key = reuse_key(layer, setup.train, step.input_grad, args)
    programs = find(cache, key)
    if programs is not None and setup.measure and programs.bwd_args is None:
        programs = None  # not foreseen to recur (a weak type?): compile its own
    if programs is not None:
        if not setup.measure:
            return programs, None, None
        assert programs.bwd_args is not None
        return programs, programs.bwd_args, programs.fwd(*args)
    fns = LayerFns(layer, setup.train, jax.random.fold_in(setup.rng, i), step.input_grad)
    pullback_spec, residual_bytes = trace_vjp(fns, step.params, step.rest, step.x_spec)
    y_real = None
    bwd_args: tuple[Any, ...]
    if setup.measure:
        # the forward returning the pullback only makes the backward's inputs, once: it
        # is not timed
        vjp = compile(fns.forward_vjp.lower(*args), timed=False)
        y_real, pullback = vjp(*args)
        bwd_args = (pullback, _cotangent(y_real, setup.device))
    else:
        bwd_args = (pullback_spec, _cotangent_spec(step.y_spec))
    programs = compile_programs(
        fns,
        args,
        bwd_args,
        split=step.split,
        timed=setup.measure,
        residual_bytes=residual_bytes,
        keep=keep,
    )
    if setup.policies and (step.has_params or step.input_grad):
        costs = policy_costs(fns, step.params, step.rest, step.x_spec, _cotangent_spec(step.y_spec))
        programs = dataclasses.replace(programs, policies=costs)
    if key is not None:
        cache.append((key, programs))
    return programs, bwd_args, y_real


def _layer_seconds(
    programs: Programs,
    args: tuple[Any, ...],
    bwd_args: tuple[Any, ...] | None,
    setup: _Setup,
    step: _Step,
) -> dict[str, float | None]:
    """Seconds of each program (``fwd``, ``bwd``, ``igr``, ``wgr``): timed when measuring,
    else from the device model (None without one, and for a program not compiled)."""
    secs: dict[str, float | None] = dict.fromkeys(("fwd", "bwd", "igr", "wgr"))
    warmup, repeats = setup.warmup, setup.repeats
    if setup.measure:
        assert bwd_args is not None
        secs["fwd"] = median_seconds(functools.partial(programs.fwd, *args), warmup, repeats)
        secs["bwd"] = median_seconds(functools.partial(programs.bwd, *bwd_args), warmup, repeats)
        if programs.igr is not None and programs.wgr is not None:
            secs["igr"] = median_seconds(
                functools.partial(programs.igr, *bwd_args), warmup, repeats
            )
            secs["wgr"] = median_seconds(
                functools.partial(programs.wgr, *bwd_args), warmup, repeats
            )
    elif setup.model is not None:
        dtype = _compute_dtype(step.y_spec, step.x_spec, step.params)
        for name, ca in programs.counts.items():
            secs[name] = setup.model.seconds(
                ca.get("flops", 0.0), ca.get("bytes accessed", 0.0), dtype
            )
    return secs


def _layer_profile(
    layer: Layer, step: _Step, programs: Programs, secs: dict[str, float | None]
) -> LayerProfile:
    """One layer's :class:`LayerProfile` from its programs' counts and seconds."""
    counts = programs.counts
    flops = {name: float(ca.get("flops", 0.0)) for name, ca in counts.items()}
    secs = dict(secs)
    if not step.split:  # one half is the whole backward, the other nothing
        whole, other = ("wgr", "igr") if step.has_params else ("igr", "wgr")
        flops[whole], flops[other] = flops["bwd"], 0.0
        if secs["bwd"] is not None:
            secs[whole], secs[other] = secs["bwd"], 0.0
    fwd_ca, bwd_ca = counts["fwd"], counts["bwd"]
    return LayerProfile(
        name=layer.name,
        kind=_kind(layer),
        forward_flops=float(fwd_ca.get("flops", 0.0)),
        backward_flops=float(bwd_ca.get("flops", 0.0)),
        forward_bytes_accessed=float(fwd_ca.get("bytes accessed", 0.0)),
        backward_bytes_accessed=float(bwd_ca.get("bytes accessed", 0.0)),
        param_bytes=nbytes(step.params),
        state_bytes=nbytes(step.rest),
        input_bytes=nbytes(step.x_spec),
        output_bytes=nbytes(step.y_spec),
        residual_bytes=programs.residual_bytes,
        peak_bytes=programs.peak_bytes,
        forward_seconds=secs["fwd"],
        backward_seconds=secs["bwd"],
        output_shape=_render(step.y_spec),
        input_grad_flops=flops["igr"],
        weight_grad_flops=flops["wgr"],
        input_grad_seconds=secs["igr"],
        weight_grad_seconds=secs["wgr"],
        policies=programs.policies,
    )


def _time_source(setup: _Setup) -> str:
    """Where the profile's seconds come from, for :attr:`Profile.time_source`."""
    if setup.measure:
        return f"measured:{setup.device.platform}:{setup.device.device_kind}"
    if setup.model is not None:
        return f"model:{setup.model.name}"
    return "none"


def _params_dtype(steps: list[_Step]) -> str:
    """The parameters' one dtype, ``"mixed"``, or ``"float32"`` where there are none."""
    dtypes = {str(leaf.dtype) for step in steps for leaf in jax.tree.leaves(step.params)}
    return sorted(dtypes)[0] if len(dtypes) == 1 else ("mixed" if dtypes else "float32")


def _provenance(
    train: bool, model: DeviceModel | None, meta: Mapping[str, str] | None
) -> dict[str, str]:
    """The profile's ``meta``: versions, backend, mode, the device model's efficiency and
    the caller's ``meta``."""
    return {
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "train": str(train),
        **({"efficiency": str(model.efficiency)} if model is not None else {}),
        **dict(meta or {}),
    }


def _kind(layer: Layer) -> str:
    module = getattr(layer, "module", None)
    if module is not None:
        return type(module).__name__
    return getattr(layer, "kind", type(layer).__name__)
