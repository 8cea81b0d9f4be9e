"""The traced functions of a stage's programs, one builder per operation kind.

:meth:`~pdjax.pipeline.stage.Stage.program` jits what :func:`program_body` returns: the
function of an operation's kind and flags, over exactly the arguments and results that
:mod:`pdjax.pipeline.lowering.program` tables for that kind, and the argument positions it donates.
The functions are built from the stage's per-layer forward, VJP chain and update, which
this module reads through :class:`StageFunctions` (it does not import the stage: the
dependency runs one way, :mod:`pdjax.pipeline.stage` on this module).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import optax

from pdjax.layers import PyTree, Variables
from pdjax.pipeline.lowering.types import OpFlag, OpKind
from pdjax.pipeline.optim import StageOptimizer
from pdjax.pipeline.stage_ties import StageTies

__all__ = ["StageFunctions", "keys_body", "program_body"]

_Body = tuple[Callable[..., Any], tuple[int, ...]]
_Pullbacks = list[Callable[..., Any]]


class StageFunctions(Protocol):
    """What a stage's programs are built from (:class:`~pdjax.pipeline.stage.Stage`
    provides it; see its methods for each)."""

    index: int
    is_last: bool
    optimizer: StageOptimizer
    ties: StageTies | None

    def apply(
        self, params: list[PyTree], state: list[Variables], x: PyTree, key: jax.Array, tgt: Any
    ) -> tuple[PyTree, list[Variables]]: ...

    def forward_vjp(
        self, params: list[PyTree], state: list[Variables], x: PyTree, key: jax.Array, tgt: Any
    ) -> tuple[PyTree, list[Variables], _Pullbacks, Any]: ...

    def keep(self, params: list[PyTree], x: PyTree, pbs: _Pullbacks) -> list[jax.Array]: ...

    def rebuild(
        self, params: list[PyTree], x: PyTree, residuals: list[jax.Array]
    ) -> _Pullbacks: ...

    def chain(
        self,
        pbs: _Pullbacks,
        ct: PyTree | None,
        want: str,
        first: bool,
        w: list[PyTree] | None = None,
    ) -> tuple[list[PyTree] | None, PyTree | None, list[PyTree]]: ...

    def weight_grads(self, pbs: _Pullbacks, cts: list[PyTree]) -> list[PyTree]: ...

    def reduce(self, g: list[PyTree]) -> list[PyTree]: ...

    def scaled(self, g: list[PyTree]) -> list[PyTree]: ...

    def fused_update(
        self, g: list[PyTree], w: list[PyTree], tail: Sequence[Any], newest: bool
    ) -> tuple[list[PyTree], optax.OptState, tuple[Any, ...]]: ...

    def update(
        self, g: list[PyTree], w: list[PyTree], o: optax.OptState, rest: Sequence[Any]
    ) -> tuple[list[PyTree], optax.OptState, tuple[Any, ...]]: ...


def program_body(stage: StageFunctions, kind: OpKind, flags: frozenset[OpFlag]) -> _Body:
    """The traced function of a program and the arguments it donates.

    Args:
      stage: the stage the program runs on.
      kind: the operation's kind (``F``, ``B``, ``I``, ``W``, ``BU``, ``FB``, ``FBU``,
        ``U``, ``SQ``, ``TG``; ``KEYS`` is :func:`keys_body`, shared by the stages).
      flags: the operation's flags (``acc``, ``recompute``, ``newest``, ``donate_w``).

    Returns:
      ``(function, donated argument positions)``.

    Raises:
      ValueError: for a kind no stage program has.
    """
    if kind is OpKind.F:
        return _forward(stage, recompute=OpFlag.RECOMPUTE in flags), ()
    if kind in (OpKind.B, OpKind.I, OpKind.W, OpKind.BU):
        return _backward(stage, kind, flags)
    if kind in (OpKind.FB, OpKind.FBU):
        return _forward_backward(stage, kind, flags)
    if kind is OpKind.U:

        def update(g: Any, w: Any, o: Any, *rest: Any) -> tuple[Any, ...]:
            new_w, new_o, sent = stage.update(g, w, o, rest)
            return (new_w, new_o, *sent)

        return update, (0, 2)  # the gradient sum takes the new weights' place
    if kind is OpKind.SQ:

        def sum_squares(g: Any, *incoming: Any) -> tuple[jax.Array]:
            g = stage.scaled(stage.reduce(g))
            if stage.ties is not None:
                g = stage.ties.grad_view(g, incoming)
            return (stage.optimizer.sum_squares(g),)

        return sum_squares, ()
    if kind is OpKind.TG:

        def tied_grads(g: Any) -> tuple[Any, ...]:
            assert stage.ties is not None
            return stage.ties.partials(stage.scaled(stage.reduce(g)))

        return tied_grads, ()
    raise ValueError(f"no stage program of kind {kind!r}")


def keys_body(group: int) -> Callable[..., tuple[jax.Array, ...]]:
    """``KEYS``: microbatch ``k``'s key ``fold_in(rng, k)`` for ``count`` microbatches from
    ``offset``; with ``group`` r > 0 (a round-robin stage), one stacked ``[r]`` key array
    per group of r. It reads nothing of a stage but that, so stages share its program."""

    def keys(rng: jax.Array, offset: jax.Array, count: int) -> tuple[jax.Array, ...]:
        ks = jax.vmap(lambda k: jax.random.fold_in(rng, k))(
            offset + jnp.arange(count, dtype=jnp.int32)
        )
        if group:
            return tuple(ks[i : i + group] for i in range(0, count, group))
        return tuple(ks[i] for i in range(count))

    return keys


def _forward(stage: StageFunctions, *, recompute: bool) -> Callable[..., tuple[Any, ...]]:
    last = stage.is_last

    def forward(w: Any, st: Any, x: Any, key: Any, *tgt: Any) -> tuple[Any, ...]:
        t = tgt[0] if last else None
        if recompute:  # keeps nothing: the backward recomputes
            y, new_st = stage.apply(w, st, x, key, t)
            return y, new_st
        y, new_st, pbs, (wv, xv) = stage.forward_vjp(w, st, x, key, t)
        return y, new_st, stage.keep(wv, xv, pbs)

    return forward


def _backward(stage: StageFunctions, kind: OpKind, flags: frozenset[OpFlag]) -> _Body:
    """``B``, ``I``, ``W`` or ``BU``: ``(w, x, R, [c], [d], [g], [w_newest] [o])``."""
    last, first = stage.is_last, stage.index == 0
    recompute, acc = OpFlag.RECOMPUTE in flags, OpFlag.ACC in flags
    newest = OpFlag.NEWEST in flags
    # residual arguments: the forward's kept residuals, or what recomputing needs
    nres = (3 if last else 2) if recompute else 1
    nct = 0 if last else 1
    want = {OpKind.B: "both", OpKind.BU: "both", OpKind.I: "input", OpKind.W: "weights"}[kind]
    upd = kind is OpKind.BU

    def backward(*args: Any) -> tuple[Any, ...]:
        w, x = args[0], args[1]
        res = args[2 : 2 + nres]
        i = 2 + nres
        pbs = _pullbacks(stage, w, x, res, recompute=recompute)
        # None: I (no weight gradients)
        g: list[PyTree] | None
        out_g: list[PyTree] | None
        if kind is OpKind.W:
            cts = args[i]
            i += 1
            g = stage.weight_grads(pbs, cts)
            out_g = g
        else:
            ct = args[i] if nct else None
            i += nct
            g, e, cts = stage.chain(pbs, ct, want, first, w)
            out_g = g
        if acc:
            out_g = jax.tree.map(jnp.add, args[i], out_g)
            i += 1
        e_out = () if first or kind is OpKind.W else (e,)
        if kind is OpKind.I:
            return (*e_out, cts)
        if not upd:
            return (out_g, *e_out)
        assert out_g is not None  # BU's chain computes both: the weight gradients
        new_w, new_o, _ = stage.fused_update(out_g, w, args[i:], newest)
        return (new_w, new_o, *e_out)

    first_tail = 2 + nres + (1 if kind is OpKind.W else nct)
    donate_w = OpFlag.DONATE_W in flags
    donate = _donated(first_tail, acc=acc, update=upd, newest=newest, donate_w=donate_w)
    return backward, donate


def _pullbacks(
    stage: StageFunctions, w: Any, x: Any, res: Sequence[Any], *, recompute: bool
) -> list[Callable[..., Any]]:
    """The per-layer VJPs: rebuilt from kept residuals, or by recomputing."""
    if recompute:
        st, key = res[0], res[1]
        tgt = res[2] if stage.is_last else None
        return stage.forward_vjp(w, st, x, key, tgt)[2]
    return stage.rebuild(w, x, res[0])


def _forward_backward(stage: StageFunctions, kind: OpKind, flags: frozenset[OpFlag]) -> _Body:
    """``FB`` or ``FBU`` on the last stage: ``(w, st, x, key, t, [g], [w_newest] [o])``."""
    first = stage.index == 0
    acc, newest = OpFlag.ACC in flags, OpFlag.NEWEST in flags
    upd = kind is OpKind.FBU

    def forward_backward(w: Any, st: Any, x: Any, key: Any, t: Any, *rest: Any) -> Any:
        y, new_st, pbs, _ = stage.forward_vjp(w, st, x, key, t)
        g, e, _ = stage.chain(pbs, None, "both", first, w)
        assert g is not None  # "both": the weight gradients are there
        i = 0
        if acc:
            g = jax.tree.map(jnp.add, rest[0], g)
            i = 1
        e_out = () if first else (e,)
        if not upd:
            return (y, new_st, g, *e_out)
        new_w, new_o, _ = stage.fused_update(g, w, rest[i:], newest)
        return (y, new_st, new_w, new_o, *e_out)

    donate = _donated(5, acc=acc, update=upd, newest=newest, donate_w=OpFlag.DONATE_W in flags)
    return forward_backward, donate


def _donated(
    first_tail: int, *, acc: bool, update: bool, newest: bool, donate_w: bool
) -> tuple[int, ...]:
    """Argument positions a backward program donates: the gradient sum (``acc``, at
    ``first_tail``), and with a fused update the optimizer state and, when nothing reads
    them later (``donate_w``), the newest weights (argument 0 when they are the ones read,
    else passed after the sum)."""
    donate: list[int] = []
    pos = first_tail
    if acc:
        donate.append(pos)
        pos += 1
    if update:
        if not newest:
            if donate_w:
                donate.append(pos)
            pos += 1
        elif donate_w:
            donate.append(0)
        donate.append(pos)
    return tuple(donate)
