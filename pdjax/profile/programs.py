"""The compiled programs of one layer, as :func:`pdjax.profile.profile` makes and counts
them: the jitted forward, backward and zero bubble halves (:class:`_LayerFns`), compiling
each once (:func:`_compile_programs`), XLA's counts and memory footprint, and the keys
under which identical layers share their programs (:func:`_reuse_key`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from pdjax._memory_policy import CHECKPOINTED, checkpointed, residual_split
from pdjax.layers import FnLayer, Layer, LinenLayer, NnxLayer, PyTree, Variables
from pdjax.profile.profile import PolicyCost

__all__ = ["cost_analysis"]


def cost_analysis(compiled: Any) -> dict[str, float]:
    """``compiled.cost_analysis()`` as a dict (older JAX returns a one-element list)."""
    ca = compiled.cost_analysis()
    if isinstance(ca, (list, tuple)):
        ca = ca[0] if ca else {}
    return dict(ca or {})


def nbytes(tree: PyTree) -> int:
    return int(
        sum(
            np.prod(leaf.shape, dtype=np.int64) * leaf.dtype.itemsize
            for leaf in jax.tree.leaves(tree)
        )
    )


class LayerFns:
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


def trace_vjp(fns: LayerFns, params: PyTree, rest: Variables, x: PyTree) -> tuple[Any, int]:
    """One abstract trace of the VJP: its pullback (shapes) and the bytes of its residuals
    that are neither a parameter nor the layer's input."""
    found: list[int] = []

    def probe(params: PyTree, rest: Variables, x: PyTree) -> Any:
        _, pullback = fns.vjp(params, rest, x)
        inputs = {id(leaf) for leaf in jax.tree.leaves((params, rest, x))}
        found.append(
            sum(
                nbytes(leaf)
                for leaf in jax.tree.leaves(pullback)
                if id(leaf) not in inputs and hasattr(leaf, "shape")
            )
        )
        return pullback

    pullback_spec = jax.eval_shape(probe, params, rest, x)
    return pullback_spec, found[0]


def policy_costs(
    fns: LayerFns, params: PyTree, rest: Variables, x: PyTree, ct: PyTree
) -> tuple[PolicyCost, ...]:
    """What the layer keeps and recomputes under each named memory policy, from abstract
    traces only (nothing is compiled): its VJP taken of ``jax.checkpoint(layer, policy)``,
    whose residuals beyond the parameters and input are split by memory space, and XLA's
    FLOP counts (transcendentals included) of the lowered backward against the plain
    one's, over the forward's (:class:`PolicyCost`'s ``recompute``). ``ct``: the output
    cotangent's shapes."""

    def vjp_of(policy: str) -> Any:
        def fn(p: PyTree, x: PyTree) -> PyTree:
            return fns.apply(p, rest, x)

        f = checkpointed(fn, policy)
        if fns.input_grad:
            return lambda p, r, x: jax.vjp(f, p, x)[1]
        return lambda p, r, x: jax.vjp(lambda q: f(q, x), p)[1]

    def counted(lowered: Any) -> float:
        ca = cost_analysis(lowered)
        return float(ca.get("flops", 0.0) + ca.get("transcendentals", 0.0))

    def backward_counts(policy: str) -> tuple[Any, float]:
        pullback = vjp_of(policy)
        found: list[tuple[int, int]] = []

        def probe(p: PyTree, r: Variables, x: PyTree) -> Any:
            pb = pullback(p, r, x)
            found.append(residual_split(jax.tree.leaves(pb), jax.tree.leaves((p, r, x))))
            return pb

        spec = jax.eval_shape(probe, params, rest, x)
        return found[0], counted(jax.jit(lambda pb, c: pb(c)).lower(spec, ct))

    fwd = counted(jax.jit(fns.apply).lower(params, rest, x))
    _, plain = backward_counts("none")
    out = []
    for policy in CHECKPOINTED:
        (device, host), counts = backward_counts(policy)
        share = (counts - plain) / fwd if fwd > 0 else 0.0
        out.append(PolicyCost(policy, device, host, float(min(max(share, 0.0), 1.0))))
    return tuple(out)


def compile(lowered: Any, timed: bool) -> Any:
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
class Programs:
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
      policies: what each named memory policy keeps and recomputes.
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
    policies: tuple[PolicyCost, ...] = ()


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


def reuse_key(layer: Layer, train: bool, input_grad: bool, args: PyTree) -> Any:
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


def find(cache: list[tuple[Any, Programs]], key: Any) -> Programs | None:
    """The programs compiled under ``key``; None for a new key (or None)."""
    return next((programs for known, programs in cache if _same(known, key)), None)


def recurring(keys: list[Any]) -> list[bool]:
    """For each layer's reuse key, whether a later layer has the same."""
    return [any(_same(key, later) for later in keys[i + 1 :]) for i, key in enumerate(keys)]


def compile_programs(
    fns: LayerFns,
    args: tuple[Any, ...],
    bwd_args: tuple[Any, ...],
    *,
    split: bool,
    timed: bool,
    residual_bytes: int,
    keep: bool,
) -> Programs:
    """Compiles a layer's forward, backward and (where ``split``) its input- and
    weight-gradient halves, each once, on ``args`` and ``bwd_args`` (arrays or shapes);
    ``keep`` keeps ``bwd_args`` for the layers that will share the programs."""
    fwd = compile(fns.forward.lower(*args), timed)
    bwd = compile(fns.backward.lower(*bwd_args), timed)
    igr = compile(fns.input_grad_only.lower(*bwd_args), timed) if split else None
    wgr = compile(fns.weight_grad_only.lower(*bwd_args), timed) if split else None
    counts = {"fwd": cost_analysis(fwd), "bwd": cost_analysis(bwd)}
    if igr is not None and wgr is not None:
        counts["igr"], counts["wgr"] = cost_analysis(igr), cost_analysis(wgr)
    return Programs(
        fwd=fwd,
        bwd=bwd,
        igr=igr,
        wgr=wgr,
        counts=counts,
        peak_bytes=_peak_bytes(fwd, bwd),
        residual_bytes=residual_bytes,
        bwd_args=bwd_args if keep else None,
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
