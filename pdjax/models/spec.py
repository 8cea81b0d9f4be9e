"""``ModelSpec``: one configured model, as the rest of pdjax consumes it.

A spec bundles the layer sequence (what pdjax profiles, partitions and runs), the same
model written as one ordinary Flax module (the reference the sequence must equal), a
sampler of synthetic batches with valid shapes and token ranges, and the task's loss.

A model of your own needs less: :class:`CustomModel` (or a dict, a NamedTuple or any
object with the same fields) holds its layers, its loss, a sample batch and optionally
an accuracy, and :func:`as_model_spec` turns it into a ``ModelSpec`` (``task="custom"``,
no monolith). That is what ``--model package.module:factory`` does with what the factory
returns (:func:`pdjax.models.load_model`).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable, Mapping
from typing import Any, Literal

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from pdjax.errors import LaunchInterrupted, LayerError
from pdjax.layers import LayerSequence, PyTree, Variables, sequential

__all__ = [
    "CustomModel",
    "FixedSampler",
    "ImageSampler",
    "LMSampler",
    "ModelSpec",
    "Sampler",
    "Seq2SeqSampler",
    "Task",
    "as_model_spec",
]

#: ``"custom"``: a model of your own (:class:`CustomModel`), whose loss and accuracy are
#: its own functions.
Task = Literal["classification", "language_model", "seq2seq", "custom"]
#: ``(batch_size, key) -> (inputs, targets)``; the same key always gives the same batch.
Sampler = Callable[[int, jax.Array], tuple[PyTree, jax.Array]]


def _as_key(rng: jax.Array | int | None) -> jax.Array:
    if rng is None:
        return jax.random.key(0)
    if isinstance(rng, int):
        return jax.random.key(rng)
    return rng


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A model family at one configuration: layers, monolith, synthetic data and loss.

    Attributes:
      name: the family's registry name, e.g. ``"vgg16"`` (a custom model: its name, or
        the ``package.module:factory`` it came from).
      config: the configuration's name, ``"tiny"`` or ``"paper"`` (overrides keep it).
      model_config: the family's frozen config dataclass, with any overrides applied
        (None for a custom model).
      layers: the model as a :class:`~pdjax.layers.LayerSequence` of Flax modules.
      monolith: the same model as one linen module whose top-level submodules are named
        as the layers, so ``layers.split(monolith.init(...))`` gives per-layer variables.
        Call it as ``monolith.apply(variables, x, train=...)``. None for a custom model.
      task: ``"classification"``, ``"language_model"``, ``"seq2seq"`` or ``"custom"``.
      num_classes: number of classes, or the (target) vocabulary size for language
        models and seq2seq models; the last axis of the output logits. 0: unknown (a
        custom model that does not say).
      sampler: ``(batch_size, key) -> (inputs, targets)`` drawing a synthetic batch.
      loss_fn: the model's own ``loss_fn(outputs, targets)``, or None for the mean
        softmax cross-entropy (:meth:`loss`).
      accuracy_fn: the model's own ``accuracy_fn(outputs, targets)``, or None for the
        arg-max accuracy (:meth:`accuracy`; a custom model without one has none).

    Specs built from equal configs compare and hash equal.
    """

    name: str
    config: str
    model_config: Any
    layers: LayerSequence
    monolith: nn.Module | None
    task: Task
    num_classes: int
    sampler: Sampler
    loss_fn: Callable[[Any, Any], Any] | None = None
    accuracy_fn: Callable[[Any, Any], Any] | None = None

    def sample_batch(
        self, batch_size: int, rng: jax.Array | int | None = None
    ) -> tuple[PyTree, jax.Array]:
        """Draws a synthetic ``(inputs, targets)`` batch.

        Args:
          batch_size: number of examples, at least 1.
          rng: a PRNG key or an integer seed; ``None`` means seed 0. The same ``rng``
            always gives the same batch, and :meth:`sample_input` / :meth:`sample_target`
            with that ``rng`` return its two halves.

        Returns:
          ``(inputs, targets)``: inputs as the first layer takes them (float images
          ``(B, ...)``, int32 tokens ``(B, T)``, or a tuple ``(src (B, S), tgt_in (B, T))``
          for seq2seq); int32 targets ``(B,)`` for classification, ``(B, T)`` otherwise,
          all in ``[0, num_classes)``.

        Raises:
          LayerError: if ``batch_size < 1``.
        """
        if batch_size < 1:
            raise LayerError(f"batch_size must be at least 1, got {batch_size}")
        return self.sampler(batch_size, _as_key(rng))

    def sample_input(self, batch_size: int, rng: jax.Array | int | None = None) -> PyTree:
        """The inputs of :meth:`sample_batch` (same arguments)."""
        return self.sample_batch(batch_size, rng)[0]

    def sample_target(self, batch_size: int, rng: jax.Array | int | None = None) -> jax.Array:
        """The targets of :meth:`sample_batch` (same arguments)."""
        return self.sample_batch(batch_size, rng)[1]

    def loss(self, outputs: Any, targets: Any) -> Any:
        """The model's loss: :attr:`loss_fn` if it has one, else the mean softmax
        cross-entropy with integer labels.

        Args:
          outputs: logits ``(..., num_classes)`` (a custom model: its outputs).
          targets: int labels of shape ``outputs.shape[:-1]`` (a custom model: its targets).

        Returns:
          A float32 scalar, averaged over every label position; a language model's
          negative targets (padding, ``IGNORE = -1``) are left out of the mean (a custom
          loss: what it returns, the scalar mean loss or ``(loss, aux)``).
        """
        if self.loss_fn is not None:
            return self.loss_fn(outputs, targets)
        if self.task == "language_model":
            kept = targets >= 0  # a negative target (IGNORE, -1) is padding: no loss
            per = optax.softmax_cross_entropy_with_integer_labels(
                outputs, jnp.where(kept, targets, 0)
            )
            return _kept_mean(per, kept)
        return optax.softmax_cross_entropy_with_integer_labels(outputs, targets).mean()

    @property
    def has_accuracy(self) -> bool:
        """Whether :meth:`accuracy` means something: every bundled model, and a custom
        model that gives an accuracy function."""
        return self.accuracy_fn is not None or self.task != "custom"

    def accuracy(self, outputs: Any, targets: Any) -> jax.Array:
        """Fraction of label positions whose arg-max logit is the target (a scalar in
        [0, 1]; a language model's negative targets, padding, are left out), or
        :attr:`accuracy_fn`'s value if the model has its own.

        Raises:
          LayerError: for a custom model without an accuracy function.
        """
        if self.accuracy_fn is not None:
            custom: jax.Array = self.accuracy_fn(outputs, targets)
            return custom
        if self.task == "custom":
            raise LayerError(
                f"model {self.name!r} has no accuracy function; give one as "
                "CustomModel(accuracy=...) (a function (outputs, targets) -> scalar in [0, 1])"
            )
        correct = jnp.argmax(outputs, axis=-1) == targets
        if self.task == "language_model":
            return _kept_mean(correct, targets >= 0)
        return jnp.mean(correct)

    def abstract_variables(self, batch_size: int = 1) -> list[Variables]:
        """Per-layer variables as ``jax.ShapeDtypeStruct`` trees, with no FLOPs or allocation."""
        x = self.sample_input(batch_size)
        shapes: list[Variables] = jax.eval_shape(self.layers.init, jax.random.key(0), x)
        return shapes

    def num_params(self) -> int:
        """Number of parameters (the ``"params"`` collections), computed abstractly."""
        variables = self.abstract_variables()
        return sum(leaf.size for v in variables for leaf in jax.tree.leaves(v.get("params", {})))


def _kept_mean(values: jax.Array, kept: jax.Array) -> jax.Array:
    """The mean of ``values`` over the positions ``kept`` (0 when none is): with every
    position kept, the plain mean, summed in the same order."""
    total = jnp.sum(jnp.where(kept, values, 0), dtype=jnp.float32)
    return total / jnp.maximum(jnp.sum(kept, dtype=jnp.float32), 1.0)


# Samplers are frozen dataclasses rather than closures so that two specs built from the
# same config compare (and hash) equal.


@dataclasses.dataclass(frozen=True)
class ImageSampler:
    """Standard-normal float32 inputs ``(B, *shape)`` and int32 labels ``(B,)``."""

    shape: tuple[int, ...]
    num_classes: int

    def __call__(self, batch_size: int, key: jax.Array) -> tuple[jax.Array, jax.Array]:
        kx, ky = jax.random.split(key)
        # Drawn flat and reshaped: XLA:CPU compiles random draws of rank >= 3 several times
        # slower (up to ~1 s each) than flat ones.
        size = batch_size * math.prod(self.shape)
        x = jax.random.normal(kx, (size,), jnp.float32).reshape(batch_size, *self.shape)
        y = jax.random.randint(ky, (batch_size,), 0, self.num_classes, jnp.int32)
        return x, y


@dataclasses.dataclass(frozen=True)
class LMSampler:
    """int32 tokens ``(B, seq_len)`` and their next tokens ``(B, seq_len)`` as targets."""

    seq_len: int
    vocab_size: int

    def __call__(self, batch_size: int, key: jax.Array) -> tuple[jax.Array, jax.Array]:
        shape = (batch_size, self.seq_len + 1)
        tokens = jax.random.randint(key, shape, 0, self.vocab_size, jnp.int32)
        return tokens[:, :-1], tokens[:, 1:]


@dataclasses.dataclass(frozen=True)
class Seq2SeqSampler:
    """``((src (B, S), tgt_in (B, T)), tgt_out (B, T))`` int32 token batches."""

    src_len: int
    tgt_len: int
    src_vocab: int
    tgt_vocab: int

    def __call__(
        self, batch_size: int, key: jax.Array
    ) -> tuple[tuple[jax.Array, jax.Array], jax.Array]:
        ks, kt = jax.random.split(key)
        src = jax.random.randint(ks, (batch_size, self.src_len), 0, self.src_vocab, jnp.int32)
        shape = (batch_size, self.tgt_len + 1)
        tgt = jax.random.randint(kt, shape, 0, self.tgt_vocab, jnp.int32)
        # Teacher forcing: the decoder reads tgt[:, :-1] and predicts tgt[:, 1:].
        return (src, tgt[:, :-1]), tgt[:, 1:]


# -- models of your own -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class CustomModel:
    """A model of your own, as a factory for ``--model package.module:factory`` returns it.

    >>> import flax.linen as nn, jax.numpy as jnp, numpy as np, optax, pdjax
    >>> model = CustomModel(
    ...     layers=pdjax.sequential(nn.Dense(32), nn.relu, nn.Dense(10)),
    ...     loss=lambda out, y: optax.softmax_cross_entropy_with_integer_labels(out, y).mean(),
    ...     sample_batch=(np.zeros((4, 64), np.float32), np.zeros((4,), np.int32)),
    ...     accuracy=lambda out, y: jnp.mean(jnp.argmax(out, -1) == y),
    ... )
    >>> spec = as_model_spec(model, name="mine")
    >>> [a.shape for a in spec.sample_batch(6)]
    [(6, 64), (6,)]

    A dict, a NamedTuple or any object with these fields does the same (``loss_fn`` is
    accepted for ``loss``, ``accuracy_fn`` and ``metric`` for ``accuracy``).

    Attributes:
      layers: the model as ``pdjax.sequential(...)`` (a list of modules is made into one).
      loss: ``loss(outputs, targets)``: the scalar mean loss over a batch (or ``(loss,
        aux)``), where ``outputs`` is what the last layer returns.
      sample_batch: one batch ``(x, y)`` (arrays, or pytrees of arrays, with one leading
        batch axis of any size): its shapes and dtypes are the model's; pdjax repeats its
        rows to make batches of other sizes (profiles, benchmarks, shape checks). Or a
        function ``(batch_size) -> (x, y)`` or ``(batch_size, key) -> (x, y)``.
      accuracy: optional ``accuracy(outputs, targets)``: a scalar in [0, 1], the mean over
        the batch. ``pdjax train`` reports it as the test accuracy and stops at
        ``--target-accuracy`` with it; without one it reports the test loss alone.
      num_classes: classes (or vocabulary size) of the outputs, if that means something:
        ``pdjax train`` checks a dataset's integer labels against it. 0: do not check.
      name: the model's name in tables and plots (default: where it came from).
    """

    layers: Any
    loss: Callable[[Any, Any], Any]
    sample_batch: Any
    accuracy: Callable[[Any, Any], Any] | None = None
    num_classes: int = 0
    name: str | None = None


@dataclasses.dataclass(frozen=True, eq=False)
class FixedSampler:
    """Batches made from one sample batch ``(x, y)``: row ``i`` of a batch is row
    ``i mod n`` of the sample (``n`` its rows), whatever the key."""

    x: PyTree
    y: PyTree

    @property
    def rows(self) -> int:
        """Rows of the sample batch."""
        return len(jax.tree.leaves(self.x)[0])

    def __call__(self, batch_size: int, key: jax.Array) -> tuple[PyTree, PyTree]:
        idx = np.arange(batch_size) % self.rows
        x, y = jax.tree.map(lambda a: a[idx], (self.x, self.y))
        return x, y


@dataclasses.dataclass(frozen=True, eq=False)
class _CallableSampler:
    """A user's ``sample_batch(batch_size[, key])`` function as a :data:`Sampler`."""

    fn: Callable[..., Any]
    takes_key: bool

    def __call__(self, batch_size: int, key: jax.Array) -> tuple[PyTree, PyTree]:
        out = self.fn(batch_size, key) if self.takes_key else self.fn(batch_size)
        if not (isinstance(out, tuple | list) and len(out) == 2):
            raise LayerError(
                f"sample_batch({batch_size}) returned a {type(out).__name__}; it must return "
                "one batch (x, y)"
            )
        return tuple(out)


_FIELDS: dict[str, tuple[str, ...]] = {
    "layers": ("layers",),
    "loss": ("loss", "loss_fn"),
    "sample_batch": ("sample_batch",),
    "accuracy": ("accuracy", "accuracy_fn", "metric"),
    "num_classes": ("num_classes",),
    "name": ("name",),
}
_REQUIRED = ("layers", "loss", "sample_batch")
_FORM = (
    "a pdjax.models.ModelSpec, or a pdjax.models.CustomModel(layers=pdjax.sequential(...), "
    "loss=loss_fn, sample_batch=(x, y), accuracy=None) (a dict, NamedTuple or object with "
    "those fields works too)"
)


def _fields_of(obj: Any, where: str) -> dict[str, Any]:
    """The fields of a CustomModel-like ``obj`` by canonical name (aliases resolved)."""
    if isinstance(obj, Mapping):
        known = {alias for aliases in _FIELDS.values() for alias in aliases}
        unknown = sorted(str(k) for k in obj if k not in known)
        if unknown:
            raise LayerError(
                f"{where} has the unknown key(s) {unknown}; a model dict takes "
                f"{', '.join(_FIELDS)} (loss_fn for loss, accuracy_fn or metric for accuracy)"
            )

        def get(key: str) -> Any:
            return obj.get(key)
    else:

        def get(key: str) -> Any:
            return getattr(obj, key, None)

    fields: dict[str, Any] = {}
    for field, aliases in _FIELDS.items():
        given = [(a, get(a)) for a in aliases if get(a) is not None]
        if len(given) > 1:
            raise LayerError(
                f"{where} gives {field} twice, as {' and '.join(a for a, _ in given)}; keep one"
            )
        fields[field] = given[0][1] if given else None
    missing = [f for f in _REQUIRED if fields[f] is None]
    if missing:
        what = f"a {type(obj).__name__}"
        if isinstance(obj, LayerSequence):
            what = "a bare LayerSequence"
        elif isinstance(obj, Mapping):
            what = f"a dict without {', '.join(missing)}"
        elif not any(fields[f] is not None for f in _REQUIRED):
            what = f"a {type(obj).__name__} ({_short(obj)})"
        else:
            what = f"a {type(obj).__name__} without {', '.join(missing)}"
        raise LayerError(f"{where} is {what}; a model is {_FORM}")
    return fields


def _short(obj: Any) -> str:
    text = repr(obj)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_batch(batch: Any, where: str) -> tuple[PyTree, PyTree]:
    """``batch`` as ``(x, y)`` of numpy arrays with one common leading length."""
    if not (isinstance(batch, tuple | list) and len(batch) == 2):
        raise LayerError(
            f"{where} is a {type(batch).__name__}; it must be one batch (x, y) (arrays with "
            "a leading batch axis), or a function batch_size -> (x, y)"
        )
    out = []
    rows: set[int] = set()
    for part, name in zip(batch, "xy", strict=True):
        leaves, treedef = jax.tree.flatten(part)
        if not leaves:
            raise LayerError(f"{where}: {name} holds no arrays")
        arrays = []
        for leaf in leaves:
            try:
                a = np.asarray(leaf)
            except Exception as e:  # anything numpy cannot read as an array
                raise LayerError(f"{where}: {name} holds a {type(leaf).__name__}: {e}") from e
            if a.ndim == 0 or (a.dtype.kind not in "biuf" and a.dtype.name != "bfloat16"):
                raise LayerError(
                    f"{where}: {name} holds a {a.dtype}{list(a.shape)} value; every array "
                    "needs a leading batch axis and a numeric dtype"
                )
            rows.add(len(a))
            arrays.append(a)
        out.append(jax.tree.unflatten(treedef, arrays))
    if len(rows) != 1 or 0 in rows:
        raise LayerError(
            f"{where}: the arrays of (x, y) have {sorted(rows)} rows; they need the same "
            "number of rows, at least 1"
        )
    return out[0], out[1]


def as_model_spec(
    obj: Any,
    *,
    name: str = "custom",
    config: str = "custom",
    where: str | None = None,
) -> ModelSpec:
    """A :class:`ModelSpec` for ``obj``: a ``ModelSpec`` (returned as it is) or a
    :class:`CustomModel`-like value (a ``CustomModel``, dict, NamedTuple or object with
    its fields).

    Args:
      obj: the model.
      name: the spec's name unless ``obj`` gives one.
      config: the spec's config name.
      where: how error messages name ``obj`` (default ``"the model"``).

    Returns:
      The spec; for a custom model ``task="custom"``, no monolith or config dataclass,
      its loss and accuracy as :attr:`ModelSpec.loss_fn` and :attr:`ModelSpec.accuracy_fn`.

    Raises:
      LayerError: for anything else, a missing or ill-typed field (the message says
        which), or a sample batch that is not ``(x, y)`` with one leading batch axis.
    """
    where = where or "the model"
    if isinstance(obj, ModelSpec):
        return obj
    fields = _fields_of(obj, where)
    layers = fields["layers"]
    if isinstance(layers, list | tuple):
        layers = sequential(*layers)
    if not isinstance(layers, LayerSequence):
        raise LayerError(
            f"{where}: layers is a {type(layers).__name__}; give the layers as "
            "pdjax.sequential(module, module, ...) (or a list of Flax modules)"
        )
    for field in ("loss", "accuracy"):
        fn = fields[field]
        if fn is not None and not callable(fn):
            raise LayerError(
                f"{where}: {field} is a {type(fn).__name__}, not a function; give a function "
                f"{field}(outputs, targets) -> scalar"
            )
    sample = fields["sample_batch"]
    if callable(sample):
        sampler: Sampler = _CallableSampler(sample, _takes_two(sample))
        _check_batch(_sample_two(sampler, where), f"{where}: sample_batch(2)")
    else:
        sampler = FixedSampler(*_check_batch(sample, f"{where}: sample_batch"))
    num_classes = fields["num_classes"] or 0
    if not isinstance(num_classes, int | np.integer) or num_classes < 0:
        raise LayerError(f"{where}: num_classes must be an integer >= 0, got {num_classes!r}")
    return ModelSpec(
        name=str(fields["name"] or name),
        config=config,
        model_config=None,
        layers=layers,
        monolith=None,
        task="custom",
        num_classes=int(num_classes),
        sampler=sampler,
        loss_fn=fields["loss"],
        accuracy_fn=fields["accuracy"],
    )


def _sample_two(sampler: Sampler, where: str) -> Any:
    """``sampler(2, key)``: a user's sampler's own failure as one :class:`LayerError`
    (KeyboardInterrupt, and a launcher's signal, go on)."""
    try:
        return sampler(2, jax.random.key(0))
    except (KeyboardInterrupt, LaunchInterrupted):
        raise
    except BaseException as e:
        raise LayerError(
            f"{where}: sample_batch(2) failed: {describe_failure(e)}{DEBUG_HINT}"
        ) from e


#: How a message about a user's code that failed ends: where its traceback is.
DEBUG_HINT = "; see the traceback with PDJAX_DEBUG=1"


def describe_failure(e: BaseException) -> str:
    """``e`` in one line, for a message about a user's code that raised it: its type and
    message (``RuntimeError: boom``), or for ``sys.exit(3)`` ``SystemExit: it called
    sys.exit(3)``; long messages are cut at 300 characters."""
    if isinstance(e, SystemExit):
        code = "" if e.code is None else repr(e.code)
        return f"SystemExit: it called sys.exit({code})"
    text = " ".join(str(e).split())
    if len(text) > 300:
        text = text[:297] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _takes_two(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` can be called with two positional arguments."""
    try:
        inspect.signature(fn).bind(0, None)
    except TypeError:
        return False
    except ValueError:  # no signature (a builtin): assume (batch_size, key)
        return True
    return True
