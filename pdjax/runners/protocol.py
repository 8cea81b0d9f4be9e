"""What every runner is: the :class:`Runner` protocol, its state (:class:`RunnerState`) and
what a call measures (:class:`RunResult`).

A runner trains a model on devices: :class:`pdjax.Pipeline` (stages and a schedule) and
:class:`pdjax.DataParallel` (one jitted step over a mesh) are the two. Checkpoints
(:mod:`pdjax.runners.checkpoint`), the training loop, the benchmarks and the cluster runs
are written against these protocols, so they take either runner (or a new one) without
asking which it is.

Both runners count the same way: a call of :meth:`Runner.run` takes a stream of
microbatches, and ``runner.microbatches`` of them make one batch (``M`` for a pipeline;
1 for data parallelism, whose microbatch is the whole batch): one optimizer update per
batch, except under ``pipedream``, which updates after every microbatch.

>>> import jax, optax
>>> from pdjax.models import get_model
>>> from pdjax.runners import DataParallel
>>> spec = get_model("mlp")
>>> x, y = spec.sample_batch(8)
>>> dp = DataParallel(spec.layers, spec.loss, optax.sgd(0.1), devices=jax.devices()[:1])
>>> isinstance(dp, Runner)
True
>>> state, metrics = dp.run(dp.init(jax.random.key(0), x), [(x, y), (x, y)])
>>> isinstance(state, RunnerState), state.updates, state.microbatches, len(metrics.losses)
(True, (2,), 2, 2)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

import jax

from pdjax.layers import LayerSequence, PyTree, Variables

__all__ = ["ARRAY_FIELDS", "RunResult", "Runner", "RunnerState", "counter_fields"]

#: The fields of a :class:`RunnerState` that hold arrays (pytrees of them). Every other
#: field of the state is a counter: a Python int or a tuple of ints.
ARRAY_FIELDS: tuple[str, ...] = ("params", "model_state", "opt_state", "rng")


@runtime_checkable
class RunnerState(Protocol):
    """A runner's state between calls: a ``NamedTuple`` (so a pytree) whose
    :data:`ARRAY_FIELDS` hold arrays and whose other fields are Python int counters.

    A checkpoint stores the arrays (by their paths in the state) and the counters (as
    JSON) and rebuilds the state with ``template._replace(**fields)``; the training loop
    reads the counters through :attr:`updates` and :attr:`microbatches`, which every state
    has, as a field or a property.

    Attributes:
      params: the parameters, as the runner lays them out (per stage, per layer...).
      model_state: the layers' other collections (BatchNorm statistics), laid out alike.
      opt_state: the optimizer state.
      updates: per stage (one for data parallelism), optimizer updates applied so far.
      microbatches: microbatches consumed so far (seeds the per-microbatch dropout RNG).
      rng: the base PRNG key for dropout.
    """

    @property
    def _fields(self) -> tuple[str, ...]:
        """The ``NamedTuple``'s field names, in order."""
        ...

    @property
    def params(self) -> Any: ...

    @property
    def model_state(self) -> Any: ...

    @property
    def opt_state(self) -> Any: ...

    @property
    def updates(self) -> tuple[int, ...]: ...

    @property
    def microbatches(self) -> int: ...

    @property
    def rng(self) -> jax.Array: ...


def counter_fields(state: RunnerState) -> tuple[str, ...]:
    """The fields of ``state`` that are counters (Python ints): all but :data:`ARRAY_FIELDS`.

    >>> from pdjax.runners import DPState, PipelineState
    >>> counter_fields(PipelineState((), (), (), (), 0, None))
    ('updates', 'microbatches')
    >>> counter_fields(DPState([], [], (), 0, None))
    ('step',)
    """
    return tuple(f for f in state._fields if f not in ARRAY_FIELDS)


@runtime_checkable
class RunResult(Protocol):
    """What one :meth:`Runner.run` or :meth:`Runner.step` measured.

    Attributes:
      losses: per microbatch, its loss (a device scalar, possibly not computed yet).
      host_seconds: wall time spent dispatching (excludes waiting for the devices).
      actions: the actions dispatched (a pipeline's forwards, backwards, updates...; a
        data-parallel step is one).
      aux: per microbatch, the loss function's auxiliary outputs, or ``None``.
    """

    @property
    def losses(self) -> list[jax.Array]: ...

    @property
    def host_seconds(self) -> float: ...

    @property
    def actions(self) -> int: ...

    @property
    def aux(self) -> list[PyTree] | None: ...

    @property
    def loss(self) -> float:
        """The mean loss over the microbatches (blocks until they are computed)."""
        ...


StateT = TypeVar("StateT", bound=RunnerState)


@runtime_checkable
class Runner(Protocol[StateT]):
    """A model trained on devices: :class:`pdjax.Pipeline` and :class:`pdjax.DataParallel`.

    Every method that takes a state and returns one consumes the state it is given (its
    buffers may be reused): keep the one returned.
    """

    @property
    def layers(self) -> LayerSequence:
        """The model."""
        ...

    @property
    def microbatches(self) -> int:
        """Microbatches per batch (the unit of :meth:`run`'s stream; one update per batch,
        except under ``pipedream``: one per microbatch)."""
        ...

    def init(self, rng: jax.Array, sample: PyTree) -> StateT:
        """A fresh state: the layers initialised from ``fold_in(rng, 0)`` on ``sample``
        (one microbatch of inputs), dropout seeded by ``fold_in(rng, 1)``."""
        ...

    def state_from_variables(
        self, variables: Sequence[Variables] | Mapping[str, Any], rng: jax.Array
    ) -> StateT:
        """A fresh state from given per-layer (or merged) variables; optimizer anew."""
        ...

    def step(self, state: StateT, batch: tuple[PyTree, PyTree]) -> tuple[StateT, RunResult]:
        """One optimizer update on ``batch = (inputs, targets)`` (split into
        :attr:`microbatches`)."""
        ...

    def run(
        self,
        state: StateT,
        microbatches: Sequence[tuple[PyTree, PyTree]],
        *,
        on_loss: Callable[[int, jax.Array], None] | None = None,
    ) -> tuple[StateT, RunResult]:
        """Trains on a stream of ``(inputs, targets)`` microbatches; ``on_loss(k, loss)``
        is called when microbatch ``k``'s loss is dispatched."""
        ...

    def variables(self, state: StateT) -> list[Variables]:
        """The per-layer variables (params and model state) of the newest weights."""
        ...

    def params(self, state: StateT) -> dict[str, Any]:
        """The full parameter tree ``{layer name: params}``."""
        ...

    def predict(self, state: StateT, inputs: PyTree, *, batch_size: int | None = None) -> PyTree:
        """The model's outputs for ``inputs`` in eval mode (``state`` not consumed)."""
        ...
