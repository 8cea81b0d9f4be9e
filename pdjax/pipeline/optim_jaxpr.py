"""Two passes over a traced optimizer's jaxpr, for :mod:`pdjax.pipeline.optim_coupling`.

- :func:`_deps`, a *dependency* pass: for each output, the bitset of the inputs it depends
  on, recursing into the sub-jaxprs of ``jit``/``custom_jvp_call``/``custom_vjp_call``/
  ``remat`` (as calls), ``cond`` (per output, plus the branch index) and ``while``/``scan``
  (a fixpoint over the carry); any other primitive makes each output depend on all its
  inputs, which is sound because a jaxpr equation is a pure function of its operands;
- :func:`_ids`, a *structural* pass: each value gets an exact hash-consed id (primitive,
  parameters, operand ids), so two outputs with equal ids are the same expression of the
  same inputs.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core as jcore

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


def deps(body: jcore.ClosedJaxpr | jcore.Jaxpr, ins: Sequence[int]) -> list[int]:
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
        return deps(body, ins)
    if name == "cond":
        index, ops = ins[0], ins[1:]
        outs = [index] * len(eqn.outvars)
        for branch in eqn.params["branches"]:
            outs = [o | d for o, d in zip(outs, deps(branch, ops), strict=True)]
        return outs
    if name == "while":
        cn, bn = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
        cconsts, bconsts, carry = ins[:cn], ins[cn : cn + bn], ins[cn + bn :]
        while True:  # monotone over a finite lattice: terminates
            (pred,) = deps(eqn.params["cond_jaxpr"], cconsts + carry)
            body_out = deps(eqn.params["body_jaxpr"], bconsts + carry)
            new = [c | b | pred for c, b in zip(carry, body_out, strict=True)]
            if new == carry:
                return carry
            carry = new
    if name == "scan":
        nc, nk = eqn.params["num_consts"], eqn.params["num_carry"]
        consts, carry, xs = ins[:nc], ins[nc : nc + nk], ins[nc + nk :]
        while True:
            out = deps(eqn.params["jaxpr"], consts + carry + xs)
            new = [c | o for c, o in zip(carry, out[:nk], strict=True)]
            if new == carry:
                return carry + out[nk:]
            carry = new
    every = 0
    for d in ins:
        every |= d
    return [every] * len(eqn.outvars)


class Interner:
    """Hash-consing: equal keys get equal ids, different keys different ids (no collisions,
    unlike a hash), so equal ids mean structurally equal expressions."""

    def __init__(self) -> None:
        self._ids: dict[Hashable, int] = {}

    def __call__(self, key: Hashable) -> int:
        return self._ids.setdefault(key, len(self._ids))


def _canon(x: Any, intern: Interner) -> Hashable:
    """A hashable, exact stand-in for an equation parameter or a constant."""
    if isinstance(x, jcore.ClosedJaxpr | jcore.Jaxpr):
        jaxpr, consts = _open(x)
        args = [intern(("arg", k, str(v.aval))) for k, v in enumerate(jaxpr.invars)]
        cvars = [intern(("cvar", k, str(v.aval))) for k, v in enumerate(jaxpr.constvars)]
        known = [intern(("const", _canon(c, intern))) for c in consts]
        return ("jaxpr", tuple(ids(jaxpr, known + cvars[len(known) :], args, intern)))
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


def ids(
    body: jcore.ClosedJaxpr | jcore.Jaxpr,
    const_ids: Sequence[int] | None,
    ins: Sequence[int],
    intern: Interner,
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
            outs = ids(sub, None, args, intern)
        elif eqn.primitive.name == "cond" and "branches" in eqn.params:
            branches = [ids(b, None, args[1:], intern) for b in eqn.params["branches"]]
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
