"""What :func:`~pdjax.layers.split_model` reads from a model before cutting it: the
marker equation bound at each split unit's call, the module method calls a model makes
(recorded through ``flax.linen.intercept_methods``), which of them are the cuts
(``at="blocks"`` or named submodules), how train/eval reaches the model (``mode=``:
bool fields, dotted into dataclass fields, or ``__call__`` arguments), how the model's
inputs travel as the layers' one input (:class:`InputForm`), and the axis names its
modules reduce over (bound to size-1 axes: :func:`on_named_axes`).
"""

from __future__ import annotations

import dataclasses
import inspect
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from pdjax.errors import LayerError

__all__ = [
    "MARK",
    "MODE_NAMES",
    "PARENT",
    "Call",
    "InputForm",
    "auto_units",
    "axis_names_of",
    "call_args",
    "call_path",
    "check_at",
    "check_streams",
    "choose_units",
    "control_flow_error",
    "describe_calls",
    "field_paths",
    "input_form",
    "is_lifted",
    "mark_call",
    "marked",
    "on_named_axes",
    "record_calls",
    "resolve_at",
    "resolve_mode",
    "stream_keys",
    "top_calls",
    "transform_hint",
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


# A marker is the identity under every transform too, so that one left in a transform's
# body (a call inside ``nnx.scan``, ``jax.vmap``, a remat) is inert there: differentiated,
# batched and compiled as what it is. The cuts are only ever at top-level markers.
def _mark_jvp(primals: Sequence[Any], tangents: Sequence[Any], **params: Any) -> Any:
    return MARK.bind(*primals, **params), list(tangents)


def _mark_batch(args: Sequence[Any], dims: Sequence[Any], **params: Any) -> Any:
    return MARK.bind(*args, **params), list(dims)


ad.primitive_jvps[MARK] = _mark_jvp
batching.primitive_batchers[MARK] = _mark_batch
mlir.register_lowering(MARK, lambda ctx, *xs, **_: list(xs))


#: the marker's ``unit`` at the call of the cuts' parent module (no cut: it tells where the
#: parent's own call runs, at the top of the program or inside a transform's body)
PARENT = "<parent>"


def marked(values: tuple[Any, ...], unit: str) -> list[Any]:
    return list(MARK.bind(*values, unit=unit))


def mark_call(a: Any, kw: Any, unit: str) -> tuple[Any, Any]:
    """A call's arguments through a marker for ``unit`` (one of a zero scalar where it
    takes no array)."""
    leaves, tree = jax.tree.flatten((a, kw))
    arrays = [n for n, v in enumerate(leaves) if isinstance(v, jax.Array)]
    if not arrays:
        marked((jax.numpy.zeros((), "float32"),), unit)
        return a, kw
    new = marked(tuple(leaves[n] for n in arrays), unit)
    for n, v in zip(arrays, new, strict=True):
        leaves[n] = v
    a, kw = jax.tree.unflatten(tree, leaves)
    return a, kw


# -- the call structure ---------------------------------------------------------------

#: A call's parent module path from its own path (linen: the path less its last part; nnx:
#: the nearest enclosing called module, containers looked through).
ParentOf = Callable[[tuple[str, ...]], tuple[str, ...]]


def path_parent(path: tuple[str, ...]) -> tuple[str, ...]:
    return path[:-1]


@dataclasses.dataclass(frozen=True)
class Call:
    path: tuple[str, ...]  # the module's path
    method: str
    kind: str  # the module's class name
    depth: int  # how many intercepted calls enclose it


def is_lifted(module: Any) -> bool:
    """Whether a linen module is a lifted transform's (``nn.scan(Block)``, ``nn.remat``,
    ``nn.vmap``...: a class that flax makes)."""
    return type(module).__module__ == "flax.linen.transforms"


def transform_hint(kind: str) -> str:
    """What a transform around a submodule call (a ``scan`` equation, a lifted
    ``ScanBlock``) means for a cut."""
    if kind.lower().startswith("scan"):
        return (
            "a scanned stack (nn.scan, nnx.scan, jax.lax.scan) is one equation of the model's "
            "program, its blocks' parameters stacked in one array each, so pdjax keeps it in "
            "one layer (cut before or after it); to cut between its blocks, unroll it: call "
            "the block in a Python loop, `for i in range(n): x = Block(..., "
            "name=f'block_{i}')(x)` (its parameters are then one subtree per block)"
        )
    return (
        f"the body of a transform ({kind}) is one equation of the model's program, so pdjax "
        "cuts before or after it, not inside it"
    )


class Nesting:
    """How many marked or recorded module calls an interceptor is inside: ``enter`` runs a
    call one level deeper (the interceptors of linen and nnx skip or record by depth)."""

    def __init__(self) -> None:
        self.depth = 0

    def enter(self, call: Callable[..., Any], a: Any, kw: Any) -> Any:
        """``call(*a, **kw)``, with :attr:`depth` one more while it runs."""
        self.depth += 1
        try:
            return call(*a, **kw)
        finally:
            self.depth -= 1


def call_path(context: Any) -> tuple[str, ...] | None:
    """The path of an intercepted linen method call, or None for one that is no call of
    a bound module's method (``setup``; flax's own abstract check of a lifted module's
    setup, made from a scope of its own)."""
    module = context.module
    scope = module.scope
    if scope is None or context.method_name in ("setup", "__post_init__"):
        return None
    path = tuple(scope.path)
    if module.name is not None and (not path or path[-1] != module.name):
        return None
    return path


def record_calls(
    fn: Callable[..., Any], *args: Any, seen: Callable[[Any], None] | None = None
) -> tuple[list[Call], Any]:
    """Every module method call made by ``fn(*args)`` (abstractly), in order; ``seen`` is
    called with each intercepted module."""
    calls: list[Call] = []
    nesting = Nesting()

    def interceptor(next_fun: Any, a: Any, kw: Any, context: Any) -> Any:
        if seen is not None:
            seen(context.module)
        path = call_path(context)
        if path is None:
            return next_fun(*a, **kw)
        calls.append(Call(path, context.method_name, type(context.module).__name__, nesting.depth))
        return nesting.enter(next_fun, a, kw)

    with nn.intercept_methods(interceptor):
        out = jax.eval_shape(fn, *args)
    return calls, out


def is_child(path: tuple[str, ...], parent: tuple[str, ...], parent_of: ParentOf) -> bool:
    return len(path) > len(parent) and parent_of(path) == parent


def top_calls(
    calls: list[Call], parent: tuple[str, ...], parent_of: ParentOf = path_parent
) -> list[Call]:
    """The calls of ``parent``'s direct children made while no other child's call runs."""
    out = []
    active_depth: int | None = None
    for c in calls:
        if active_depth is not None and c.depth > active_depth:
            continue
        active_depth = None
        if is_child(c.path, parent, parent_of):
            out.append(c)
            active_depth = c.depth
    return out


def unit_name(path: tuple[str, ...], parent: tuple[str, ...]) -> str:
    """A child's name under its parent (``"blocks/1"`` for an nnx list's element)."""
    return "/".join(path[len(parent) :])


def auto_units(
    calls: list[Call], parent_of: ParentOf = path_parent, note: str = ""
) -> tuple[tuple[str, ...], list[str]]:
    """The parent and its repeated children: of the shallowest parent that calls two or
    more distinct children of one class, the class with the most (the decoder blocks)."""
    best: tuple[int, int, tuple[str, ...], list[str]] | None = None
    parents = sorted(dict.fromkeys(parent_of(c.path) for c in calls if c.path), key=len)
    for parent in parents:
        top = top_calls(calls, parent, parent_of)
        by_kind: dict[str, list[str]] = {}
        for c in top:
            names = by_kind.setdefault(c.kind, [])
            if unit_name(c.path, parent) not in names:
                names.append(unit_name(c.path, parent))
        for names in by_kind.values():
            if len(names) >= 2 and (best is None or len(names) > best[0]):
                best = (len(names), -len(parent), parent, names)
        if best is not None:
            break  # the shallowest parent with a repeated child class
    if best is None:
        raise LayerError(
            "split_model(at='blocks') found no repeated submodule (two or more of one "
            "class called by one parent); name the cuts: at=['<submodule>', ...] with "
            f"submodules of {describe_calls(calls)}{note}"
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


def resolve_at(
    calls: list[Call], at: Sequence[str], parent_of: ParentOf = path_parent
) -> tuple[tuple[str, ...], list[str]]:
    """``at`` names as ``(parent path, [child names under it])``; a name is a path
    ``"a/b"`` or the last part(s) of exactly one submodule's path."""
    known = describe_calls(calls)
    paths: list[tuple[str, ...]] = []
    for name in at:
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
    parents = {parent_of(p) for p in paths}
    if len(parents) != 1:
        raise LayerError(
            f"split_model(at={list(at)}): the cuts must be children of one parent module, "
            f"got parents {sorted('/'.join(p) or '<the model>' for p in parents)}"
        )
    parent = parents.pop()
    return parent, [unit_name(p, parent) for p in paths]


def check_at(at: Any) -> None:
    """Refuses an ``at=`` that :func:`~pdjax.layers.split_model` does not take: ``None``,
    ``"blocks"`` or a list of submodule names (strings)."""
    if at is None or at == "blocks":
        return
    if isinstance(at, str):
        raise LayerError(
            f"at={at!r}: give 'blocks' (cut before each repeated block) or a list of "
            "submodule names, e.g. at=['blocks_2']"
        )
    if not isinstance(at, Sequence) or isinstance(at, (bytes, bytearray)):
        raise LayerError(
            f"at= is 'blocks' or a list of submodule names (strings), e.g. at=['blocks_2'], "
            f"got {type(at).__name__} {at!r}"
        )
    for name in at:
        if not isinstance(name, str) or not name:
            raise LayerError(f"at= lists submodule names as strings, got {name!r}")


def choose_units(
    calls: list[Call], at: Any, parent_of: ParentOf = path_parent, note: str = ""
) -> tuple[tuple[str, ...], list[Call], list[str]]:
    """``(the cuts' parent, its children's calls in order, the cut units)`` for ``at``
    (checked by :func:`check_at`): each cut once, in call order, leaving no layer empty.
    Under ``at="blocks"`` a repeated child that is the parent's first call starts the
    first layer instead of cutting; ``note`` ends the message where none repeats."""
    auto = at is None or at == "blocks"
    if auto:
        parent, units = auto_units(calls, parent_of, note)
    else:
        parent, units = resolve_at(calls, at, parent_of)
    top = top_calls(calls, parent, parent_of)
    first_call: dict[str, int] = {}
    for n, c in enumerate(top):
        first_call.setdefault(unit_name(c.path, parent), n)
    positions = [first_call[u] for u in units]
    if len(set(units)) != len(units) or positions != sorted(positions):
        raise LayerError(
            f"split_model(at={units}): each cut once, in the order the model calls "
            f"them ({[unit_name(c.path, parent) for c in top]})"
        )
    if auto:
        if positions and positions[0] == 0:
            units = units[1:]
    elif positions and positions[0] == 0:
        raise LayerError(
            f"split_model: the cut {units[0]!r} is the model's first submodule call, "
            f"so the layer before it would be empty; drop it from at= ({units})"
        )
    if not units:
        raise LayerError("split_model: no cut left; the model would be one layer")
    return parent, top, units


# -- the model's inputs, its random streams and its named axes ------------------------------


@dataclasses.dataclass(frozen=True)
class InputForm:
    """How the model's inputs travel as the layers' one input (and the pipeline's ``x``):
    one positional input without keywords is that input itself; otherwise the tuple of the
    positional inputs, with the dict of the keyword inputs last where keywords were given
    (``split_model(m, tokens, positions, sample_kwargs={"mask": mask})``: the layers take
    ``(tokens, positions, {"mask": mask})``)."""

    n_args: int
    keywords: tuple[str, ...] | None  # None: no keyword inputs

    @property
    def single(self) -> bool:
        return self.n_args == 1 and self.keywords is None

    def pack(self, args: Sequence[Any], kwargs: Mapping[str, Any] | None) -> Any:
        if self.single:
            return args[0]
        return (*args, dict(kwargs or {})) if self.keywords is not None else tuple(args)

    def unpack(self, x: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``(positional inputs, keyword inputs)`` from the layers' input."""
        if self.single:
            return (x,), {}
        if not isinstance(x, (tuple, list)) or len(x) != self.n_args + (self.keywords is not None):
            raise LayerError(
                f"the split model takes its {self.n_args} positional input(s)"
                + (f" and keywords {list(self.keywords)}" if self.keywords is not None else "")
                + " as one tuple"
                + (" with the keywords' dict last" if self.keywords is not None else "")
                + f", got {type(x).__name__}"
            )
        if self.keywords is None:
            return tuple(x), {}
        return tuple(x[: self.n_args]), dict(x[self.n_args])


def _leaf_problem(leaf: Any) -> str | None:
    if isinstance(leaf, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)):
        return None
    return type(leaf).__name__


def input_form(
    args: Sequence[Any], kwargs: Mapping[str, Any] | None, switched: Sequence[str]
) -> tuple[InputForm, Any]:
    """The :class:`InputForm` of a sample and the packed sample.

    Raises:
      LayerError: for no input, a keyword that ``mode=`` switches, or a leaf that is not
        an array (a Python list of numbers is a pytree of Python scalars to JAX).
    """
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise LayerError(
            f"sample_kwargs= maps the model's keyword inputs to arrays, got {type(kwargs).__name__}"
        )
    if not args and not kwargs:
        raise LayerError("split_model needs the model's input: split_model(model, x)")
    for name in kwargs or {}:
        if not isinstance(name, str):
            raise LayerError(f"sample_kwargs= names keyword inputs by strings, got {name!r}")
        if name in switched:
            raise LayerError(
                f"sample_kwargs[{name!r}]: pdjax sets {name!r} per call (train/eval, "
                f"mode=); drop it, or pass mode={{}} to leave the model as it is"
            )
    for n, value in enumerate(args):
        for path, leaf in jax.tree_util.tree_flatten_with_path(value)[0]:
            bad = _leaf_problem(leaf)
            if bad is not None:
                raise LayerError(
                    f"split_model: input {n}{jax.tree_util.keystr(path)} is a Python {bad}, "
                    "not an array; give arrays (jnp.asarray(sample)): a Python list or "
                    "number is a pytree of Python scalars to JAX, not one input array"
                )
    for name, value in (kwargs or {}).items():
        for path, leaf in jax.tree_util.tree_flatten_with_path(value)[0]:
            bad = _leaf_problem(leaf)
            if bad is not None:
                raise LayerError(
                    f"split_model: sample_kwargs[{name!r}]{jax.tree_util.keystr(path)} is a "
                    f"Python {bad}, not an array; give arrays (jnp.asarray(...))"
                )
    form = InputForm(len(args), None if kwargs is None else tuple(kwargs))
    return form, form.pack(args, kwargs)


def check_streams(streams: Any) -> tuple[str, ...]:
    """``rng_streams=`` as a tuple of stream names."""
    if isinstance(streams, str) or not isinstance(streams, Sequence):
        raise LayerError(
            f"rng_streams= is a list of the RNG stream names the model draws from, e.g. "
            f"('dropout', 'noise'), got {streams!r}"
        )
    for s in streams:
        if not isinstance(s, str) or not s or s == "params":
            raise LayerError(
                f"rng_streams= names the streams the model draws from when applied "
                f"(not 'params', which only init uses), got {s!r}"
            )
    return tuple(dict.fromkeys(streams))


def stream_keys(rng: Any, streams: Sequence[str]) -> dict[str, Any]:
    """Each stream's key from one ``rng``: ``"dropout"`` is ``rng`` itself, any other
    ``fold_in(rng, crc32(name))``."""
    return {
        s: rng if s == "dropout" else jax.random.fold_in(rng, zlib.crc32(s.encode()) & 0x7FFFFFFF)
        for s in streams
    }


def axis_names_of(module: Any) -> set[str]:
    """The axis names a module reduces over (``BatchNorm(axis_name="batch")``)."""
    value = getattr(module, "axis_name", None)
    if isinstance(value, str):
        return {value}
    if isinstance(value, (tuple, list)):
        return {v for v in value if isinstance(v, str)}
    return set()


def on_named_axes(fn: Callable[..., Any], names: Sequence[str]) -> Callable[..., Any]:
    """``fn`` with each axis name in ``names`` bound to an axis of size 1 (``jax.vmap``
    over nothing): a model's collective over a named axis (BatchNorm's cross-replica mean)
    then reduces over the one call it is, as if run on one replica."""
    if not names:
        return fn

    def run(*args: Any) -> Any:
        g: Callable[[], Any] = lambda: fn(*args)  # noqa: E731
        for name in sorted(names):
            g = jax.vmap(g, axis_name=name, axis_size=1, out_axes=None)
        return g()

    return run


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


def resolve_mode(
    module: nn.Module, mode: Mapping[str, str] | None, given: Sequence[str] = ()
) -> dict[str, str]:
    """``mode=`` checked, or found (``given``: ``__call__`` arguments the user passes)."""
    fields, args = field_paths(module), call_args(module)
    if mode is None:
        found = {}
        for name in fields:
            last = name.rsplit(".", 1)[-1]
            if last in MODE_NAMES:
                found[name] = MODE_NAMES[last]
        for name in args:
            if name in MODE_NAMES and name not in given:
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
