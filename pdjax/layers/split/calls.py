"""What :func:`~pdjax.layers.split_model` reads from a model before cutting it: the
marker equation bound at each split unit's call, the module method calls a model makes
(recorded through ``flax.linen.intercept_methods``), which of them are the cuts
(``at="blocks"`` or named submodules), and how train/eval reaches the model (``mode=``:
bool fields, dotted into dataclass fields, or ``__call__`` arguments).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
from jax.extend.core import Primitive

from pdjax.errors import LayerError

__all__ = [
    "MARK",
    "MODE_NAMES",
    "Call",
    "auto_units",
    "call_args",
    "control_flow_error",
    "describe_calls",
    "field_paths",
    "marked",
    "record_calls",
    "resolve_at",
    "resolve_mode",
    "top_calls",
    "with_field",
]

#: ``__call__`` arguments and fields that switch train/eval, and whether True means eval.
MODE_NAMES = {
    "train": "train",
    "training": "train",
    "deterministic": "eval",
    "use_running_average": "eval",
}

# -- the marker equation: identity, bound at the start of each split unit's call ---------

MARK = Primitive("pdjax_split_mark")
MARK.multiple_results = True
MARK.def_impl(lambda *xs, **_: list(xs))
MARK.def_abstract_eval(lambda *avals, **_: list(avals))


def marked(values: tuple[Any, ...], unit: str) -> list[Any]:
    return list(MARK.bind(*values, unit=unit))


# -- the call structure ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Call:
    path: tuple[str, ...]  # the module's scope path
    method: str
    kind: str  # the module's class name
    depth: int  # how many intercepted calls enclose it


def record_calls(fn: Callable[..., Any], *args: Any) -> tuple[list[Call], Any]:
    """Every module method call made by ``fn(*args)`` (abstractly), in order."""
    calls: list[Call] = []
    depth = [0]

    def interceptor(next_fun: Any, a: Any, kw: Any, context: Any) -> Any:
        module = context.module
        scope = module.scope
        if scope is None or context.method_name in ("setup", "__post_init__"):
            return next_fun(*a, **kw)
        calls.append(Call(tuple(scope.path), context.method_name, type(module).__name__, depth[0]))
        depth[0] += 1
        try:
            return next_fun(*a, **kw)
        finally:
            depth[0] -= 1

    with nn.intercept_methods(interceptor):
        out = jax.eval_shape(fn, *args)
    return calls, out


def top_calls(calls: list[Call], parent: tuple[str, ...]) -> list[Call]:
    """The calls of ``parent``'s direct children made while no other child's call runs."""
    out = []
    active_depth: int | None = None
    for c in calls:
        if active_depth is not None and c.depth > active_depth:
            continue
        active_depth = None
        if len(c.path) == len(parent) + 1 and c.path[: len(parent)] == parent:
            out.append(c)
            active_depth = c.depth
    return out


def auto_units(calls: list[Call]) -> tuple[tuple[str, ...], list[str]]:
    """The parent and its repeated children: of the shallowest parent that calls two or
    more distinct children of one class, the class with the most (the decoder blocks)."""
    best: tuple[int, int, tuple[str, ...], list[str]] | None = None
    parents = sorted({c.path[:-1] for c in calls if c.path}, key=len)
    for parent in parents:
        top = top_calls(calls, parent)
        by_kind: dict[str, list[str]] = {}
        for c in top:
            names = by_kind.setdefault(c.kind, [])
            if c.path[-1] not in names:
                names.append(c.path[-1])
        for names in by_kind.values():
            if len(names) >= 2 and (best is None or len(names) > best[0]):
                best = (len(names), -len(parent), parent, names)
        if best is not None:
            break  # the shallowest parent with a repeated child class
    if best is None:
        raise LayerError(
            "split_model(at='blocks') found no repeated submodule (two or more of one "
            "class called by one parent); name the cuts: at=['<submodule>', ...] with "
            f"submodules of {describe_calls(calls)}"
        )
    return best[2], best[3]


def describe_calls(calls: list[Call]) -> list[str]:
    seen: list[str] = []
    for c in calls:
        if c.path:
            name = "/".join(c.path)
            if name not in seen:
                seen.append(name)
    return seen


def resolve_at(calls: list[Call], at: Sequence[str]) -> tuple[tuple[str, ...], list[str]]:
    """``at`` names as ``(parent path, [child names])``; a name is a path ``"a/b"`` or the
    last part of exactly one submodule's path."""
    known = describe_calls(calls)
    paths: list[tuple[str, ...]] = []
    for name in at:
        if not isinstance(name, str) or not name:
            raise LayerError(f"at= lists submodule names as strings, got {name!r}")
        hits = [p for p in known if p == name or p.endswith("/" + name)]
        if len(hits) != 1:
            what = "names no submodule" if not hits else f"is ambiguous ({hits})"
            shown = [p for p in known if p.count("/") < 2]
            more = f" and {len(known) - len(shown)} deeper ones" if len(shown) < len(known) else ""
            raise LayerError(
                f"split_model(at=...): {name!r} {what}; the submodules called are {shown}"
                f"{more} (write one, or its path with '/')"
            )
        paths.append(tuple(hits[0].split("/")))
    parents = {p[:-1] for p in paths}
    if len(parents) != 1:
        raise LayerError(
            f"split_model(at={list(at)}): the cuts must be children of one parent module, "
            f"got parents {sorted('/'.join(p) or '<the model>' for p in parents)}"
        )
    return paths[0][:-1], [p[-1] for p in paths]


# -- the train/eval switch --------------------------------------------------------------


def field_paths(module: nn.Module) -> list[str]:
    """Dotted names of the module's bool fields and its dataclass fields' bool fields."""
    out = []
    for f in dataclasses.fields(module):
        if f.name in ("parent", "name"):
            continue
        value = getattr(module, f.name, None)
        if isinstance(value, bool):
            out.append(f.name)
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            for g in dataclasses.fields(value):
                if isinstance(getattr(value, g.name, None), bool):
                    out.append(f"{f.name}.{g.name}")
    return out


def call_args(module: nn.Module) -> list[str]:
    try:
        return list(inspect.signature(type(module).__call__).parameters)[1:]
    except (TypeError, ValueError):
        return []


def resolve_mode(module: nn.Module, mode: Mapping[str, str] | None) -> dict[str, str]:
    fields, args = field_paths(module), call_args(module)
    if mode is None:
        found = {}
        for name in fields:
            last = name.rsplit(".", 1)[-1]
            if last in MODE_NAMES:
                found[name] = MODE_NAMES[last]
        for name in args:
            if name in MODE_NAMES:
                found[name] = MODE_NAMES[name]
        return found
    if not isinstance(mode, Mapping):
        raise LayerError(
            f"mode= maps a field or __call__ argument to 'train' or 'eval' (when it is "
            f"True), e.g. {{'config.deterministic': 'eval'}}; got {mode!r}"
        )
    for name, when in mode.items():
        if when not in ("train", "eval"):
            raise LayerError(
                f"mode[{name!r}] = {when!r}: say when the flag is True, 'train' or 'eval'"
            )
        if name not in fields and name not in args:
            raise LayerError(
                f"mode names {name!r}, which is neither a bool field of "
                f"{type(module).__name__} ({fields}) nor an argument of its __call__ ({args})"
            )
    return dict(mode)


def with_field(obj: Any, dotted: str, value: bool) -> Any:
    head, _, rest = dotted.partition(".")
    inner = getattr(obj, head)
    new = with_field(inner, rest, value) if rest else value
    if isinstance(obj, nn.Module):
        changes: dict[str, Any] = {head: new}
        return obj.clone(**changes)
    return dataclasses.replace(obj, **{head: new})


def control_flow_error(e: Exception) -> LayerError:
    return LayerError(
        "split_model: the model's Python control flow depends on the data (an if or loop "
        "on an array value), which a split cannot follow; write it with jnp.where, "
        f"jax.lax.cond or jax.lax.fori_loop, or compute it from shapes ({type(e).__name__})"
    )
