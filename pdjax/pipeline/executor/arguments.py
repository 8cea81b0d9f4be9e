"""The type checks of the runners' public arguments, shared by :class:`Pipeline
<pdjax.pipeline.Pipeline>` and :class:`DataParallel <pdjax.runners.DataParallel>`: the
model, the loss function, the optimizer, the PRNG key and the arrays of a batch. Each
refuses a wrong value with one :class:`~pdjax.errors.PipelineError` naming the argument,
what it got and what to pass, before anything is traced or compiled (a string as inputs, or
an int as the key, would otherwise fail deep inside JAX with a raw ``TypeError``)."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pdjax.errors import PipelineError
from pdjax.layers import LayerSequence

__all__ = [
    "check_arrays",
    "check_callback",
    "check_devices",
    "check_flag",
    "check_key",
    "check_layers",
    "check_loss_fn",
    "check_optimizer",
    "check_stream",
]


def _brief(value: Any) -> str:
    """``value``'s type and a repr cut to 40 characters, for messages."""
    text = " ".join(repr(value).split())  # a module's repr spans lines
    if len(text) > 40:
        text = text[:37] + "..."
    return f"{type(value).__name__} {text}"


def check_layers(layers: Any, who: str) -> LayerSequence:
    """``layers`` if it is a :class:`~pdjax.layers.LayerSequence`; a plain list of modules
    (or anything else) is refused: its layer names, tied parameters and precision are what
    :func:`pdjax.sequential` declares.

    Raises:
      PipelineError: naming ``who`` (e.g. ``"Pipeline"``) and what to pass.
    """
    if isinstance(layers, LayerSequence):
        return layers
    if isinstance(layers, list | tuple):
        raise PipelineError(
            f"{who} layers must be a pdjax layer sequence, got a plain {type(layers).__name__} "
            f"of {len(layers)} items: wrap them with pdjax.sequential(...), e.g. "
            "pdjax.sequential(*modules) (it names the layers and declares tied parameters)"
        )
    raise PipelineError(
        f"{who} layers must be a pdjax layer sequence, got {_brief(layers)}: build it with "
        "pdjax.sequential(module, ...) (a flax nn.Sequential: pdjax.sequential(*its layers))"
    )


def check_loss_fn(loss_fn: Any, who: str) -> None:
    """Refuses a ``loss_fn`` that cannot be called.

    Raises:
      PipelineError: naming ``who`` and the value given.
    """
    if not callable(loss_fn):
        raise PipelineError(
            f"{who} loss_fn must be a function loss_fn(outputs, targets) -> scalar loss (or "
            f"(loss, aux)), got {_brief(loss_fn)}"
        )


def check_optimizer(optimizer: Any, who: str) -> None:
    """Refuses an ``optimizer`` that is not an optax ``GradientTransformation`` (callable
    ``init`` and ``update``), e.g. ``optax.adam`` itself rather than ``optax.adam(1e-3)``.

    Raises:
      PipelineError: naming ``who`` and the value given.
    """
    if not (
        callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None))
    ):
        hint = " (call it: e.g. optax.adam(1e-3))" if callable(optimizer) else ""
        raise PipelineError(
            f"{who} optimizer must be an optax GradientTransformation such as "
            f"optax.adam(1e-3), got {_brief(optimizer)}{hint}"
        )


@functools.cache
def _raw_key_shape() -> tuple[int, ...]:
    """The shape of a raw ``uint32`` key (``jax.random.PRNGKey``) of the default PRNG
    implementation, from a trace (nothing runs)."""
    return tuple(jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0))).shape)


def check_key(rng: Any, who: str) -> None:
    """Refuses an ``rng`` that is not one PRNG key: a typed key of shape ``()``
    (``jax.random.key(0)``) or a raw ``uint32`` key (``jax.random.PRNGKey(0)``).

    Raises:
      PipelineError: naming ``who`` (e.g. ``"init"``) and what to pass.
    """
    if isinstance(rng, jax.Array | np.ndarray):
        if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key) and rng.shape == ():
            return
        if rng.dtype == np.uint32 and tuple(rng.shape) == _raw_key_shape():
            return
        got = f"an array {rng.dtype}{list(rng.shape)}"
    else:
        got = _brief(rng)
    raise PipelineError(
        f"{who} rng must be one PRNG key, e.g. jax.random.key(0), got {got}; for a seed n "
        "pass jax.random.key(n)"
    )


def check_arrays(parts: Sequence[tuple[str, Any]], where: str) -> None:
    """Refuses a leaf of the named trees ``parts`` (e.g. ``(("inputs", x),)``) that is not
    an array or number: a string, bytes, an object or string array, or any other object
    JAX cannot take.

    Raises:
      PipelineError: naming the leaf (``inputs['ids']``), what it is, and what to pass.
    """
    for name, tree in parts:
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            dtype = getattr(leaf, "dtype", None)
            if isinstance(leaf, bool | int | float | complex):
                continue
            if dtype is not None and hasattr(leaf, "shape") and _numeric(dtype):
                continue
            kind = f"an array of {dtype}" if dtype is not None else _brief(leaf)
            raise PipelineError(
                f"{where}{name}{jax.tree_util.keystr(path)} is {kind}, not an array of "
                "numbers: every leaf of the inputs and targets must be a NumPy or JAX "
                "array with one row per sample (encode text as token ids first)"
            )


def _numeric(dtype: Any) -> bool:
    """True for the dtypes JAX computes with: numbers (bfloat16 and float8 too), bools and
    PRNG keys; not strings, bytes, objects or dates."""
    try:
        return bool(
            jnp.issubdtype(dtype, np.number)
            or jnp.issubdtype(dtype, np.bool_)
            or jnp.issubdtype(dtype, jax.dtypes.prng_key)
        )
    except TypeError:
        return False


def check_flag(name: str, value: Any) -> bool:
    """``value`` of the option ``name`` as a ``bool``; anything else (``"no"``, 0, None)
    is refused rather than read by its truth.

    Raises:
      PipelineError: naming the option and the value.
    """
    if not isinstance(value, bool | np.bool_):
        raise PipelineError(f"{name} must be True or False, got {_brief(value)}")
    return bool(value)


def check_callback(name: str, value: Any, form: str) -> None:
    """Refuses a ``value`` for the callback ``name`` that is neither None nor callable
    (``form``: how it is called, e.g. ``"on_loss(k, loss)"``).

    Raises:
      PipelineError: naming the argument and what it got.
    """
    if value is not None and not callable(value):
        raise PipelineError(f"{name} must be None or a function {form}, got {_brief(value)}")


def check_devices(devices: Any, who: str) -> list[jax.Device] | None:
    """``devices`` as a list of ``jax.Device`` (None: the default); a count, ids or
    anything else is refused, saying how to pass the first ``n`` devices.

    Raises:
      PipelineError: naming ``who`` and what it got.
    """
    if devices is None:
        return None
    how = "pass jax.Device objects, e.g. devices=jax.devices()[:4] for the first 4"
    if isinstance(devices, str | bytes) or not isinstance(devices, Iterable):
        raise PipelineError(
            f"{who} devices must be a sequence of jax.Device, got {_brief(devices)}; {how}"
        )
    listed = list(devices)
    for i, d in enumerate(listed):
        if not isinstance(d, jax.Device):
            raise PipelineError(f"{who} devices[{i}] is {_brief(d)}, not a jax.Device; {how}")
    return listed


def check_stream(name: str, items: Any, call: str) -> list[Any]:
    """The items of ``items`` (a sequence or any iterable of batches) as a list; a
    string, a mapping, None or a number is refused.

    Raises:
      PipelineError: naming the call and what it got.
    """
    if isinstance(items, str | bytes | Mapping) or not isinstance(items, Iterable):
        raise PipelineError(
            f"{call} takes a sequence of {name}, each an (inputs, targets) pair, got "
            f"{_brief(items)}"
        )
    return list(items)
