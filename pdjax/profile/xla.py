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
median of several timed runs). A layer without parameters has ``W = 0`` and ``I`` = its
backward; one without input gradient has ``I = 0`` and ``W`` = its backward: neither
needs another program.

Known limits of XLA's counts: a ``scan``/``fori_loop`` body (e.g. an LSTM over time) is
counted once, not once per iteration — measure such models; convolution FLOPs exclude
padded taps.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pdjax.errors import ProfileError
from pdjax.layers import Layer, LayerSequence, PyTree, Variables
from pdjax.profile.devices import DeviceModel, get_device_model
from pdjax.profile.profile import LayerProfile, Profile

__all__ = ["cost_analysis", "profile"]


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
    """The jitted functions of one layer, built once and reused for counts and timing."""

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


def _compile(lowered: Any, run: bool) -> Any:
    """Compiles ``lowered``. A program only counted, never run, skips the backend's code
    optimisations on XLA's CPU client: the counts and the memory analysis come from the
    optimised HLO, which is the same, and compiling a transformer block's forward takes
    ~0.3 s instead of ~2.7 s."""
    if run or jax.default_backend() != "cpu":
        return lowered.compile()
    return lowered.compile({"xla_backend_optimization_level": 0})


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
        which are made with ``jnp.ones`` from the sample's shapes if abstract).
      device: where to measure (default ``jax.devices()[0]``).
      device_model: a preset name (``"h100"``, ``"v100"``, ...) or :class:`DeviceModel`
        whose roofline turns FLOPs and bytes into seconds; ``"measured"`` = ``measure``.
      warmup: untimed runs before timing.
      repeats: timed runs; the median is kept.
      meta: extra provenance stored in the profile.

    Returns:
      The :class:`Profile` (a chain), seconds from the measurement or the device model
      (None without either).

    Raises:
      ProfileError: for a sample without batch dimension, both ``measure`` and a device
        model preset, or bad ``warmup``/``repeats``.
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
                lambda s: jnp.ones(s.shape, s.dtype) if isinstance(s, jax.ShapeDtypeStruct) else s,
                sample,
            ),
            device,
        )
        if any(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(variables)):
            variables = jax.jit(layers.init)(rng, x_real)
        variables = jax.device_put(variables, device)

    results = []
    dtypes = set()
    for i, layer in enumerate(layers):
        fold = jax.random.fold_in(rng, i)
        v_spec = var_specs[i]
        params = v_spec.get("params", {})
        rest = {k: v for k, v in v_spec.items() if k != "params"}
        x_spec, y_spec = boundaries[i], boundaries[i + 1]
        input_grad = i > 0 and any(_is_float(leaf) for leaf in jax.tree.leaves(x_spec))
        fns = _LayerFns(layer, train, fold, input_grad)
        dtypes.update(str(leaf.dtype) for leaf in jax.tree.leaves(params))

        pullback_spec, residual_bytes = _trace_vjp(fns, params, rest, x_spec)
        if measure:
            # lower on the real arguments, so that the programs timed are the ones counted
            v_real = variables[i]
            p_real = v_real.get("params", {})
            r_real = {k: v for k, v in v_real.items() if k != "params"}
            fwd_args: tuple[Any, ...] = (p_real, r_real, x_real)
            y_real, pullback = fns.forward_vjp(p_real, r_real, x_real)
            ct = jax.tree.map(
                lambda y: (
                    jnp.ones_like(y) if _is_float(y) else np.zeros(y.shape, jax.dtypes.float0)
                ),
                y_real,
            )
            bwd_args: tuple[Any, ...] = (pullback, ct)
        else:
            fwd_args = (params, rest, x_spec)
            ct_spec = jax.tree.map(
                lambda s: jax.ShapeDtypeStruct(
                    s.shape, s.dtype if _is_float(s) else jax.dtypes.float0
                ),
                y_spec,
            )
            bwd_args = (pullback_spec, ct_spec)
        fwd = _compile(fns.forward.lower(*fwd_args), measure)
        bwd = _compile(fns.backward.lower(*bwd_args), measure)
        peak = _peak_bytes(fwd, bwd)
        # zero bubble's split: programs of their own only where both halves have work
        has_params = bool(jax.tree.leaves(params))
        split = has_params and input_grad
        igr = _compile(fns.input_grad_only.lower(*bwd_args), measure) if split else None
        wgr = _compile(fns.weight_grad_only.lower(*bwd_args), measure) if split else None
        counts = {"fwd": cost_analysis(fwd), "bwd": cost_analysis(bwd)}
        if split:
            counts["igr"], counts["wgr"] = cost_analysis(igr), cost_analysis(wgr)

        secs: dict[str, float | None] = dict.fromkeys(("fwd", "bwd", "igr", "wgr"))
        if measure:
            secs["fwd"] = _median_seconds(fwd, fwd_args, warmup, repeats)
            secs["bwd"] = _median_seconds(bwd, bwd_args, warmup, repeats)
            if split:
                secs["igr"] = _median_seconds(igr, bwd_args, warmup, repeats)
                secs["wgr"] = _median_seconds(wgr, bwd_args, warmup, repeats)
            x_real = y_real
        elif model is not None:
            dtype = str(jax.tree.leaves(params)[0].dtype) if has_params else "float32"
            for key, ca in counts.items():
                secs[key] = model.seconds(
                    ca.get("flops", 0.0), ca.get("bytes accessed", 0.0), dtype
                )
        flops = {key: float(ca.get("flops", 0.0)) for key, ca in counts.items()}
        if not split:  # one half is the whole backward, the other nothing
            whole, other = ("wgr", "igr") if has_params else ("igr", "wgr")
            flops[whole], flops[other] = flops["bwd"], 0.0
            if secs["bwd"] is not None:
                secs[whole], secs[other] = secs["bwd"], 0.0
        fwd_ca, bwd_ca = counts["fwd"], counts["bwd"]
        fwd_s, bwd_s = secs["fwd"], secs["bwd"]

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
                residual_bytes=residual_bytes,
                peak_bytes=peak,
                forward_seconds=fwd_s,
                backward_seconds=bwd_s,
                output_shape=_render(y_spec),
                input_grad_flops=flops["igr"],
                weight_grad_flops=flops["wgr"],
                input_grad_seconds=secs["igr"],
                weight_grad_seconds=secs["wgr"],
            )
        )

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
