"""The profiler: per-layer costs of a layer sequence from XLA, and optionally measured.

For each layer, on its input's shape (the previous layer's output), pdjax compiles

* the forward ``apply(variables, x) -> y``,
* the backward alone: the VJP's residuals and an output cotangent in, parameter
  gradients (and, past the first layer, the input gradient) out — exactly the work a
  pipeline stage's backward does,
* for a layer with parameters that also computes its input gradient, that backward split
  in two as zero bubble (``zb-h1``) runs it: the input gradient alone (``I``: the same
  pullback keeping only the input's cotangent) and the weight gradient alone (``W``:
  keeping only the parameters'); XLA drops the other half of each,
and reads FLOPs and bytes accessed from ``compiled.cost_analysis()``. Compiling needs
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
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from pdjax.errors import ProfileError
from pdjax.layers import FnLayer, Layer, LayerSequence, LinenLayer, NnxLayer, PyTree, Variables
from pdjax.profile.devices import DeviceModel, get_device_model
from pdjax.profile.profile import LayerProfile, Profile

__all__ = ["ProgressCallback", "cost_analysis", "profile"]


class ProgressCallback(Protocol):
    """What :func:`profile` calls to report progress: ``callback(done, total, current)``
    before each layer (``done`` layers finished, ``current`` the name of the one starting)
    and once at the end (``done == total``, ``current`` None)."""

    def __call__(self, done: int, total: int, current: str | None) -> None: ...


def cost_analysis(compiled: Any) -> dict[str, float]:
    """``compiled.cost_analysis()`` as a dict (older JAX returns a one-element list)."""
    ca = compiled.cost_analysis()
    if isinstance(ca, (list, tuple)):
        ca = ca[0] if ca else {}
    return dict(ca or {})


def _nbytes(tree: PyTree) -> int:
    return int(
        sum(
            np.prod(leaf.shape, dtype=np.int64) * leaf.dtype.itemsize
            for leaf in jax.tree.leaves(tree)
        )
    )


def _spec(tree: PyTree) -> PyTree:
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


def _is_float(leaf: Any) -> bool:
    return jnp.issubdtype(leaf.dtype, jnp.inexact)


def _render(tree: PyTree) -> str:
    parts = [f"{leaf.dtype}{list(leaf.shape)}" for leaf in jax.tree.leaves(tree)]
    return parts[0] if len(parts) == 1 else "(" + ", ".join(parts) + ")"


class _LayerFns:
    """The jitted functions of one layer, lowered once each for counts and timing."""

    def __init__(self, layer: Layer, train: bool, rng: jax.Array, input_grad: bool) -> None:
        self.input_grad = input_grad

        def apply(params: PyTree, rest: Variables, x: PyTree) -> PyTree:
            return layer.apply({**rest, "params": params}, x, train=train, rng=rng)[0]

        def vjp(params: PyTree, rest: Variables, x: PyTree) -> tuple[PyTree, Any]:
            if input_grad:
                return jax.vjp(lambda p, x: apply(p, rest, x), params, x)
            return jax.vjp(lambda p: apply(p, rest, x), params)

        def backward(pullback: Any, ct: PyTree) -> Any:
            return pullback(ct)

        def input_grad_only(pullback: Any, ct: PyTree) -> PyTree:
            return pullback(ct)[1]

        def weight_grad_only(pullback: Any, ct: PyTree) -> PyTree:
            return pullback(ct)[0]

        self.apply = apply
        self.vjp = vjp
        self.forward = jax.jit(apply)
        self.forward_vjp = jax.jit(vjp)
        self.backward = jax.jit(backward)
        self.input_grad_only = jax.jit(input_grad_only)
        self.weight_grad_only = jax.jit(weight_grad_only)


def _trace_vjp(fns: _LayerFns, params: PyTree, rest: Variables, x: PyTree) -> tuple[Any, int]:
    """One abstract trace of the VJP: its pullback (shapes) and the bytes of its residuals
    that are neither a parameter nor the layer's input."""
    found: list[int] = []

    def probe(params: PyTree, rest: Variables, x: PyTree) -> Any:
        _, pullback = fns.vjp(params, rest, x)
        inputs = {id(leaf) for leaf in jax.tree.leaves((params, rest, x))}
        found.append(
            sum(
                _nbytes(leaf)
                for leaf in jax.tree.leaves(pullback)
                if id(leaf) not in inputs and hasattr(leaf, "shape")
            )
        )
        return pullback

    pullback_spec = jax.eval_shape(probe, params, rest, x)
    return pullback_spec, found[0]


def _compile(lowered: Any, timed: bool) -> Any:
    """Compiles ``lowered``, once: the executable returned serves the cost analysis and,
    where ``timed``, the timing.

    A program that is not timed (only counted, or run once to make inputs for the timed
    ones) skips the backend's code optimisations on XLA's CPU client: the counts and the
    memory analysis come from the optimised HLO, which is the same, and compiling a
    transformer block's forward takes ~0.3 s instead of ~2.7 s."""
    if timed or jax.default_backend() != "cpu":
        return lowered.compile()
    return lowered.compile({"xla_backend_optimization_level": 0})


@dataclasses.dataclass(frozen=True)
class _Programs:
    """The compiled programs of one layer and what XLA counted in them; identical layers
    share one.

    Attributes:
      fwd: the forward.
      bwd: the whole backward (pullback and output cotangent in).
      igr: the input gradient alone, or None where the backward is not split.
      wgr: the weight gradient alone, or None.
      counts: ``cost_analysis`` of each program by key (``fwd``, ``bwd``, ``igr``, ``wgr``).
      peak_bytes: the larger footprint of ``fwd`` and ``bwd``, or None.
      residual_bytes: the residuals' bytes beyond the parameters and the input.
      bwd_args: measuring, for a layer that recurs, the backward's real inputs (pullback
        and cotangent), on which the later identical layers' backwards are timed; else
        None.
    """

    fwd: Any
    bwd: Any
    igr: Any | None
    wgr: Any | None
    counts: dict[str, dict[str, float]]
    peak_bytes: int | None
    residual_bytes: int
    bwd_args: tuple[Any, ...] | None = None


def _arg_key(tree: PyTree) -> tuple[Any, ...]:
    """The structure, shapes, dtypes (weak types) and shardings of arguments: what an
    executable compiled for them checks on a call."""
    leaves, treedef = jax.tree.flatten(tree)
    return (
        treedef,
        tuple(
            (
                tuple(leaf.shape),
                str(leaf.dtype),
                bool(getattr(leaf, "weak_type", False)),
                getattr(leaf, "sharding", None) if isinstance(leaf, jax.Array) else None,
            )
            for leaf in leaves
        ),
    )


class _Same:
    """Wraps an object compared by identity (a function: equal code is not the same
    closure)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


def _reuse_key(layer: Layer, train: bool, input_grad: bool, args: PyTree) -> Any:
    """What makes two layers' programs the same, or None where pdjax cannot tell (a layer
    class of the user's own: it is always compiled).

    The module decides the program given the arguments' shapes: a linen module through its
    fields (its dataclass equality, which ``nn.jit`` also trusts), an nnx module through
    its graph definition (classes, static attributes and variable metadata: ``nnx.jit``'s
    cache key), a function through its identity. Module fields that do not compare (an
    array) make keys that never match, so such layers are compiled each."""
    # exact classes: a subclass may change what the module computes
    if type(layer) is LinenLayer:
        module: Any = ("linen", type(layer.module), layer.module)
    elif type(layer) is NnxLayer:
        module = ("nnx", layer._graphdef, layer._mode, tuple(layer._streams), layer._takes_rngs)
    elif type(layer) is FnLayer:
        module = ("fn", _Same(layer.fn))
    else:
        return None
    return (module, train, input_grad, _arg_key(args))


def _same(a: Any, b: Any) -> bool:
    """Whether two reuse keys are equal: never for None, nor where comparing fails."""
    if a is None or b is None:
        return False
    try:
        return bool(a == b)
    except Exception:  # a module field that does not compare, e.g. an array
        return False


def _find(cache: list[tuple[Any, _Programs]], key: Any) -> _Programs | None:
    """The programs compiled under ``key``; None for a new key (or None)."""
    return next((programs for known, programs in cache if _same(known, key)), None)


def _recurring(keys: list[Any]) -> list[bool]:
    """For each layer's reuse key, whether a later layer has the same."""
    return [any(_same(key, later) for later in keys[i + 1 :]) for i, key in enumerate(keys)]


def _compile_programs(
    fns: _LayerFns,
    args: tuple[Any, ...],
    bwd_args: tuple[Any, ...],
    split: bool,
    timed: bool,
    residual_bytes: int,
    keep: bool,
) -> _Programs:
    """Compiles a layer's forward, backward and (where ``split``) its input- and
    weight-gradient halves, each once, on ``args`` and ``bwd_args`` (arrays or shapes);
    ``keep`` keeps ``bwd_args`` for the layers that will share the programs."""
    fwd = _compile(fns.forward.lower(*args), timed)
    bwd = _compile(fns.backward.lower(*bwd_args), timed)
    igr = _compile(fns.input_grad_only.lower(*bwd_args), timed) if split else None
    wgr = _compile(fns.weight_grad_only.lower(*bwd_args), timed) if split else None
    counts = {"fwd": cost_analysis(fwd), "bwd": cost_analysis(bwd)}
    if igr is not None and wgr is not None:
        counts["igr"], counts["wgr"] = cost_analysis(igr), cost_analysis(wgr)
    return _Programs(
        fwd=fwd,
        bwd=bwd,
        igr=igr,
        wgr=wgr,
        counts=counts,
        peak_bytes=_peak_bytes(fwd, bwd),
        residual_bytes=residual_bytes,
        bwd_args=bwd_args if keep else None,
    )


def _median_seconds(
    fn: Callable[..., Any], args: tuple[Any, ...], warmup: int, repeats: int
) -> float:
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


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
) -> Profile:
    """Profiles every layer of ``layers`` on the batch ``sample``.

    Args:
      layers: the model as a layer sequence.
      sample: one batch of inputs (arrays or ``jax.ShapeDtypeStruct``s; only shapes are
        needed unless ``measure``). Its leading dimension is the profile's batch size.
      variables: per-layer variables; default: initialised abstractly from ``rng``.
      rng: PRNG key for initialisation and dropout (default ``jax.random.key(0)``).
      train: profile the training-mode forward (dropout on, BatchNorm batch statistics).
      measure: also time forward and backward on ``device`` (needs concrete inputs,
        which are made with ones of the sample's shapes if abstract). The executables
        timed are the ones counted, each compiled once.
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

    Returns:
      The :class:`Profile` (a chain), seconds from the measurement or the device model
      (None without either).

    Raises:
      ProfileError: for a sample without batch dimension, both ``measure`` and a device
        model preset, bad ``warmup``/``repeats``, or a ``progress`` of another kind.
    """
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
    batch_size = _batch_size(sample)
    report = _reporter(progress, len(layers))
    rng = jax.random.key(0) if rng is None else rng
    sample_spec = _spec(sample)
    if variables is None:
        variables = jax.eval_shape(layers.init, rng, sample_spec)
    var_specs = [_spec(v) for v in variables]
    boundaries = layers.boundary_specs(var_specs, sample_spec)
    device = device if device is not None else jax.devices()[0]

    if measure:
        x_real = jax.device_put(
            jax.tree.map(
                lambda s: np.ones(s.shape, s.dtype) if isinstance(s, jax.ShapeDtypeStruct) else s,
                sample,
            ),
            device,
        )
        if any(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(variables)):
            init = _compile(jax.jit(layers.init).lower(rng, x_real), timed=False)
            variables = init(rng, x_real)
        variables = jax.device_put(variables, device)

    results = []
    dtypes: set[str] = set()
    # each layer's parameters, state, input: which layers will share programs is known
    # before any compiles
    steps = []
    for i, layer in enumerate(layers):
        params = var_specs[i].get("params", {})
        rest = {k: v for k, v in var_specs[i].items() if k != "params"}
        input_grad = i > 0 and any(_is_float(leaf) for leaf in jax.tree.leaves(boundaries[i]))
        key = _reuse_key(layer, train, input_grad, (params, rest, boundaries[i]))
        steps.append((params, rest, input_grad, key))
    recurs = _recurring([key for *_, key in steps])
    cache: list[tuple[Any, _Programs]] = []
    for i, layer in enumerate(layers):
        report(i, layer.name)
        params, rest, input_grad, _ = steps[i]
        x_spec, y_spec = boundaries[i], boundaries[i + 1]
        dtypes.update(str(leaf.dtype) for leaf in jax.tree.leaves(params))
        # zero bubble's split: programs of their own only where both halves have work
        has_params = bool(jax.tree.leaves(params))
        split = has_params and input_grad

        if measure:
            # lower on the real arguments, so that the programs timed are the ones counted
            v_real = variables[i]
            p_real = v_real.get("params", {})
            r_real = {k: v for k, v in v_real.items() if k != "params"}
            args: tuple[Any, ...] = (p_real, r_real, x_real)
        else:
            args = (params, rest, x_spec)
        key = _reuse_key(layer, train, input_grad, args)
        programs = _find(cache, key)
        if programs is not None and measure and programs.bwd_args is None:
            programs = None  # not foreseen to recur (a weak type?): compile its own
        bwd_args: tuple[Any, ...]
        if programs is None:
            fns = _LayerFns(layer, train, jax.random.fold_in(rng, i), input_grad)
            pullback_spec, residual_bytes = _trace_vjp(fns, params, rest, x_spec)
            if measure:
                # the forward returning the pullback only makes the backward's inputs,
                # once: it is not timed
                vjp = _compile(fns.forward_vjp.lower(*args), timed=False)
                y_real, pullback = vjp(*args)
                bwd_args = (pullback, _cotangent(y_real, device))
            else:
                bwd_args = (pullback_spec, _cotangent_spec(y_spec))
            programs = _compile_programs(
                fns, args, bwd_args, split, measure, residual_bytes, keep=measure and recurs[i]
            )
            if key is not None:
                cache.append((key, programs))
        elif measure:
            assert programs.bwd_args is not None
            y_real, bwd_args = programs.fwd(*args), programs.bwd_args
        counts = programs.counts

        secs: dict[str, float | None] = dict.fromkeys(("fwd", "bwd", "igr", "wgr"))
        if measure:
            secs["fwd"] = _median_seconds(programs.fwd, args, warmup, repeats)
            secs["bwd"] = _median_seconds(programs.bwd, bwd_args, warmup, repeats)
            if programs.igr is not None and programs.wgr is not None:
                secs["igr"] = _median_seconds(programs.igr, bwd_args, warmup, repeats)
                secs["wgr"] = _median_seconds(programs.wgr, bwd_args, warmup, repeats)
            x_real = y_real
        elif model is not None:
            dtype = _compute_dtype(y_spec, x_spec, params)
            for name, ca in counts.items():
                secs[name] = model.seconds(
                    ca.get("flops", 0.0), ca.get("bytes accessed", 0.0), dtype
                )
        flops = {name: float(ca.get("flops", 0.0)) for name, ca in counts.items()}
        if not split:  # one half is the whole backward, the other nothing
            whole, other = ("wgr", "igr") if has_params else ("igr", "wgr")
            flops[whole], flops[other] = flops["bwd"], 0.0
            if secs["bwd"] is not None:
                secs[whole], secs[other] = secs["bwd"], 0.0
        fwd_ca, bwd_ca = counts["fwd"], counts["bwd"]

        results.append(
            LayerProfile(
                name=layer.name,
                kind=_kind(layer),
                forward_flops=float(fwd_ca.get("flops", 0.0)),
                backward_flops=float(bwd_ca.get("flops", 0.0)),
                forward_bytes_accessed=float(fwd_ca.get("bytes accessed", 0.0)),
                backward_bytes_accessed=float(bwd_ca.get("bytes accessed", 0.0)),
                param_bytes=_nbytes(params),
                state_bytes=_nbytes(rest),
                input_bytes=_nbytes(x_spec),
                output_bytes=_nbytes(y_spec),
                residual_bytes=programs.residual_bytes,
                peak_bytes=programs.peak_bytes,
                forward_seconds=secs["fwd"],
                backward_seconds=secs["bwd"],
                output_shape=_render(y_spec),
                input_grad_flops=flops["igr"],
                weight_grad_flops=flops["wgr"],
                input_grad_seconds=secs["igr"],
                weight_grad_seconds=secs["wgr"],
            )
        )
    report(len(layers), None)

    if measure:
        time_source = f"measured:{device.platform}:{device.device_kind}"
    elif model is not None:
        time_source = f"model:{model.name}"
    else:
        time_source = "none"
    info = {
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "train": str(train),
        **({"efficiency": str(model.efficiency)} if model is not None else {}),
        **dict(meta or {}),
    }
    return Profile.chain(
        results,
        batch_size=batch_size,
        time_source=time_source,
        dtype=sorted(dtypes)[0] if len(dtypes) == 1 else ("mixed" if dtypes else "float32"),
        meta=info,
    )


def _peak_bytes(*compiled: Any) -> int | None:
    """The largest of the compiled functions' footprints (arguments + outputs + temps)."""
    peaks = []
    for c in compiled:
        mem = c.memory_analysis()
        if mem is None:
            return None
        peaks.append(
            mem.argument_size_in_bytes
            + mem.output_size_in_bytes
            + mem.temp_size_in_bytes
            - mem.alias_size_in_bytes
        )
    return int(max(peaks))


def _kind(layer: Layer) -> str:
    module = getattr(layer, "module", None)
    if module is not None:
        return type(module).__name__
    return getattr(layer, "kind", type(layer).__name__)
