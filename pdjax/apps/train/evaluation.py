"""Evaluation on the test split: a runner's state (:func:`evaluate_runner`, through a
pipeline's stages, in one process or several) or variables gathered on one device
(:func:`evaluate`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from pdjax.apps import data as data_lib
from pdjax.apps.data import stream
from pdjax.errors import PipelineError
from pdjax.models import ModelSpec
from pdjax.pipeline import Pipeline


def evaluate(
    spec: ModelSpec, variables: list[Any], ds: data_lib.Dataset, batch_size: int = 256
) -> tuple[float, float]:
    """Mean loss and accuracy of ``variables`` on the test split (eval mode, one device).

    A model with its own loss (or accuracy) is evaluated with it, batch by batch, each
    batch's mean weighted by its rows; its accuracy is NaN if it has none."""
    device = jax.local_devices()[0]  # this process's (several processes: each has its own)
    variables = jax.device_put(jax.tree.map(_local_copy, variables), device)
    fn = _eval_fn(spec)
    if _own_metrics(spec):
        total_loss = total_acc = 0.0
        for lo in range(0, ds.num_test, batch_size):
            x, y = ds.test_x[lo : lo + batch_size], ds.test_y[lo : lo + batch_size]
            loss, acc = fn(variables, x, y)
            total_loss += float(loss) * len(x)
            total_acc += float(acc) * len(x)
        return total_loss / ds.num_test, total_acc / ds.num_test
    total_loss = total_acc = count = 0.0
    for x, y, mask in data_lib.eval_batches(ds.test_x, ds.test_y, batch_size):
        loss, acc = fn(variables, x, y, mask)
        total_loss += float(loss)
        total_acc += float(acc)
        count += float(mask.sum())
    return total_loss / count, total_acc / count


def _local_copy(leaf: Any) -> Any:
    """This process's copy of a value replicated over several processes (data
    parallelism's weights): ``device_put`` takes only what this process holds."""
    if not isinstance(leaf, jax.Array) or leaf.is_fully_addressable:
        return leaf
    if not leaf.sharding.is_fully_replicated:
        raise PipelineError(
            f"cannot evaluate a weight of shape {leaf.shape} sharded over several processes "
            "on one device; gather it first"
        )
    return leaf.addressable_data(0)


#: Evaluation batches a pipeline reads, places and evaluates at a time
#: (:func:`evaluate_runner`): the memory evaluation holds, whatever the test split's size.
EVAL_CHUNK = 8


def evaluate_runner(
    spec: ModelSpec, runner: Any, state: Any, ds: data_lib.Dataset, batch_size: int = 256
) -> tuple[float, float]:
    """Mean loss and accuracy of ``runner``'s ``state`` on the test split, in eval mode.

    A pipeline evaluates through its stages (:meth:`~pdjax.pipeline.Pipeline.evaluate`:
    forward only, each stage on its devices, nothing gathered), :data:`EVAL_CHUNK`
    batches at a time (the split is streamed: read as it is evaluated), in one process or
    across several (collective there: every process calls it, and all get the same
    numbers); data parallelism evaluates the gathered variables on one device, batch by
    batch (:func:`evaluate`)."""
    if not isinstance(runner, Pipeline):
        return evaluate(spec, runner.variables(state), ds, batch_size)
    loss = accuracy = 0.0
    samples = 0
    metric = _accuracy_metric(spec)
    # streamed: EVAL_CHUNK batches read, placed and evaluated at a time, whatever the split
    for batches in stream.eval_chunks(ds.test_x, ds.test_y, batch_size, EVAL_CHUNK):
        got = runner.evaluate(state, batches, metrics=metric)
        n = int(got["samples"])
        loss += got["loss"] * n
        accuracy += float(got.get("_accuracy", math.nan)) * n
        samples += n
    return loss / samples, accuracy / samples


def scalar_accuracy(spec: ModelSpec, value: Any) -> jax.Array:
    """``value``, what ``spec``'s accuracy returned, as a float32 scalar; anything else (a
    vector, a string, a complex number) is refused naming the model's accuracy function.

    Raises:
      PipelineError: ``value`` is not one real number (an array of shape ``()``).
    """
    dtype = getattr(value, "dtype", None)
    if isinstance(value, int | float) and not isinstance(value, bool):
        return jnp.asarray(value, jnp.float32)
    ok = (
        dtype is not None
        and getattr(value, "shape", None) == ()
        and (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer))
    )
    if not ok:
        got = (
            f"{jnp.dtype(dtype).name}{list(value.shape)}"
            if dtype is not None and hasattr(value, "shape")
            else f"a {type(value).__name__} {_short(value)}"
        )
        raise PipelineError(
            f"the accuracy of model {spec.name!r} (CustomModel(accuracy=...)) returned {got}; "
            "it must return one number in [0, 1], the fraction correct over the batch "
            "(reduce it with .mean())"
        )
    return jnp.asarray(value, jnp.float32)


def _short(value: Any) -> str:
    text = " ".join(repr(value).split())
    return text if len(text) <= 40 else text[:37] + "..."


_METRICS: dict[int, tuple[ModelSpec, Callable[..., Any] | None]] = {}


def _accuracy_metric(spec: ModelSpec) -> Callable[..., Any] | None:
    """``spec``'s accuracy as an evaluation metric (one function object per spec, so the
    pipeline's evaluation programs compile once), or None without one."""
    cached = _METRICS.get(id(spec))
    if cached is None or cached[0] is not spec:
        fn = None
        if spec.has_accuracy:

            def fn(outputs: Any, targets: Any) -> dict[str, jax.Array]:
                return {"_accuracy": scalar_accuracy(spec, spec.accuracy(outputs, targets))}

        _METRICS.clear()
        _METRICS[id(spec)] = (spec, fn)
    return _METRICS[id(spec)][1]


_EVAL_FNS: dict[int, tuple[ModelSpec, Callable[..., Any]]] = {}


def _own_metrics(spec: ModelSpec) -> bool:
    return spec.loss_fn is not None or spec.accuracy_fn is not None


def _own_eval(spec: ModelSpec) -> Callable[..., Any]:
    def fn(variables: Any, x: Any, y: Any) -> tuple[jax.Array, jax.Array]:
        out, _ = spec.layers.apply(variables, x, train=False)
        loss = spec.loss(out, y)
        if isinstance(loss, tuple | list):  # (loss, aux)
            loss = loss[0]
        acc = scalar_accuracy(spec, spec.accuracy(out, y)) if spec.has_accuracy else jnp.nan
        return jnp.asarray(loss, jnp.float32), jnp.asarray(acc, jnp.float32)

    return fn


def _eval_fn(spec: ModelSpec) -> Callable[..., Any]:
    """The jitted evaluation of ``spec`` (cached per spec object, which the cache holds)."""
    cached = _EVAL_FNS.get(id(spec))
    if cached is None or cached[0] is not spec:

        def fn(variables: Any, x: Any, y: Any, mask: Any) -> tuple[jax.Array, jax.Array]:
            out, _ = spec.layers.apply(variables, x, train=False)
            per = optax.softmax_cross_entropy_with_integer_labels(out, y)
            correct = (jnp.argmax(out, axis=-1) == y).astype(jnp.float32)
            axes = tuple(range(1, per.ndim))
            per, correct = per.mean(axis=axes), correct.mean(axis=axes)
            m = mask.astype(jnp.float32)
            return (per * m).sum(), (correct * m).sum()

        _EVAL_FNS.clear()  # one model at a time: keep one compiled evaluation
        _EVAL_FNS[id(spec)] = (spec, jax.jit(_own_eval(spec) if _own_metrics(spec) else fn))
    return _EVAL_FNS[id(spec)][1]
