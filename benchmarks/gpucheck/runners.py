"""The GPU check's runners: one jitted step per batch, two loops of jitted microbatch
programs (the single-device floors) and a pdjax pipeline, each timed a round at a time."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from pdjax.layers import LayerSequence, PyTree, Variables
from pdjax.pipeline import Pipeline, PipelineState, RunMetrics

Batch = tuple[PyTree, jax.Array]
LossFn = Callable[[jax.Array, jax.Array], jax.Array]


@dataclasses.dataclass
class Dispatched:
    """What one round of a runner dispatched (nothing waited for yet).

    Attributes:
      pending: arrays to block on before the clock stops (new weights, losses).
      losses: per microbatch or per batch, the loss as a device array.
      actions: programs dispatched (pipeline actions, or jitted calls).
      host_seconds: pipeline driver's dispatch time (``RunMetrics``); None for plain jit.
    """

    pending: PyTree
    losses: list[jax.Array]
    actions: int
    host_seconds: float | None


def _place(tree: PyTree, device: jax.Device) -> PyTree:
    """Fresh buffers committed to ``device`` with a plain single-device sharding.

    Fresh (``may_alias=False``): a runner donates its weights, which must not delete
    another runner's (the pipeline's arrays are where these come from). Committed and
    single-device: a jitted step returns its outputs that way, and its cache tells a
    differently placed input apart (the pipeline's arrays carry a one-device mesh
    sharding, ``optimizer.init``'s step counter none), which would compile every
    program a second time.
    """
    return jax.device_put(tree, device, may_alias=False)


def _split_params(variables: Sequence[Variables]) -> tuple[list[PyTree], list[Variables]]:
    params = [v.get("params", {}) for v in variables]
    rest = [{k: x for k, x in v.items() if k != "params"} for v in variables]
    return params, rest


def _objective(
    layers: LayerSequence, loss_fn: LossFn, rest: list[Variables], rng: jax.Array
) -> Callable[[list[PyTree], PyTree, jax.Array], jax.Array]:
    """``(params, x, y) -> loss`` of the whole model in train mode, the mode the stages
    run in (dropout would draw from ``rng``; the check's GPTs have none)."""

    def objective(params: list[PyTree], x: PyTree, y: jax.Array) -> jax.Array:
        variables = [{**r, "params": p} for p, r in zip(params, rest, strict=True)]
        out, _ = layers.apply(variables, x, train=True, rng=rng)
        return loss_fn(out, y)

    return objective


class JitStepRunner:
    """The baseline: one jitted train step (``value_and_grad`` + optax update) per batch.

    One program per optimizer step over the whole batch, parameters and optimizer state
    donated (updated in place): the least work and dispatch a step can take.
    """

    def __init__(
        self,
        name: str,
        layers: LayerSequence,
        loss_fn: LossFn,
        optimizer: optax.GradientTransformation,
        variables: Sequence[Variables],
        batches: Sequence[Batch],
        rng: jax.Array,
        device: jax.Device,
    ) -> None:
        self.name = name
        self.batches = list(batches)
        self.params, self.rest = _place(_split_params(variables), device)
        self.opt_state = _place(optimizer.init(self.params), device)

        def step(
            params: list[PyTree], opt_state: optax.OptState, rest: Any, x: PyTree, y: jax.Array
        ) -> tuple[list[PyTree], optax.OptState, jax.Array]:
            objective = _objective(layers, loss_fn, rest, rng)
            value, grads = jax.value_and_grad(objective)(params, x, y)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, value

        self._step = jax.jit(step, donate_argnums=(0, 1))

    def round(self) -> Dispatched:
        losses = []
        for x, y in self.batches:
            self.params, self.opt_state, loss = self._step(
                self.params, self.opt_state, self.rest, x, y
            )
            losses.append(loss)
        pending = (self.params, self.opt_state, losses)
        return Dispatched(pending, losses, len(self.batches), None)


class MicrobatchLoopRunner:
    """A plain loop of jitted per-microbatch gradient programs, one update per group.

    The honest single-device floors: the microbatch-sized programs a pipeline runs
    (smaller than one whole-batch step, so XLA cannot fuse across microbatches), with no
    pipeline bookkeeping. Groups of ``M`` microbatches sum their gradients into one
    mean-gradient update per step (what ``1f1b`` computes); groups of one update after
    every microbatch (as ``pipedream`` does at every stage). A group's first microbatch
    starts the sum (no zeroed accumulator to add to); the sum is donated to the next
    gradient program and to the update. Both floors share the gradient program, so with
    the persistent compilation cache the second one does not compile it again.
    """

    def __init__(
        self,
        name: str,
        layers: LayerSequence,
        loss_fn: LossFn,
        optimizer: optax.GradientTransformation,
        variables: Sequence[Variables],
        groups: Sequence[Sequence[Batch]],
        rng: jax.Array,
        device: jax.Device,
    ) -> None:
        self.name = name
        self.groups = [list(g) for g in groups]
        self.params, self.rest = _place(_split_params(variables), device)
        self.opt_state = _place(optimizer.init(self.params), device)

        def grad_first(
            params: list[PyTree], rest: Any, x: PyTree, y: jax.Array
        ) -> tuple[list[PyTree], jax.Array]:
            value, grads = jax.value_and_grad(_objective(layers, loss_fn, rest, rng))(params, x, y)
            return grads, value

        def grad_add(
            params: list[PyTree], acc: list[PyTree], rest: Any, x: PyTree, y: jax.Array
        ) -> tuple[list[PyTree], jax.Array]:
            value, grads = jax.value_and_grad(_objective(layers, loss_fn, rest, rng))(params, x, y)
            return jax.tree.map(jnp.add, acc, grads), value

        def update(
            params: list[PyTree], opt_state: optax.OptState, acc: list[PyTree], count: int
        ) -> tuple[list[PyTree], optax.OptState]:
            grads = jax.tree.map(lambda g: g / count, acc)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        self._grad_first = jax.jit(grad_first)
        self._grad_add = jax.jit(grad_add, donate_argnums=(1,))
        self._update = jax.jit(update, donate_argnums=(0, 1, 2), static_argnums=(3,))

    def round(self) -> Dispatched:
        losses = []
        actions = 0
        for group in self.groups:
            (x, y), rest = group[0], group[1:]
            acc, loss = self._grad_first(self.params, self.rest, x, y)
            losses.append(loss)
            for x, y in rest:
                acc, loss = self._grad_add(self.params, acc, self.rest, x, y)
                losses.append(loss)
            self.params, self.opt_state = self._update(self.params, self.opt_state, acc, len(group))
            actions += len(group) + 1
        pending = (self.params, self.opt_state, losses)
        return Dispatched(pending, losses, actions, None)


class PipelineRunner:
    """A :class:`pdjax.Pipeline` through its public API only.

    Flush schedules (``1f1b``) take one ``Pipeline.step`` per batch (the pipeline splits
    it into M microbatches); asynchronous ones (``pipedream``) take one ``Pipeline.run``
    over the round's stream of microbatches (fill at the start, drain at the end).
    """

    def __init__(
        self,
        name: str,
        pipe: Pipeline,
        state: PipelineState,
        batches: Sequence[Batch],
        stream: Sequence[Batch],
    ) -> None:
        self.name = name
        self.pipe = pipe
        self.state = state
        self.batches = list(batches)
        self.stream = list(stream)

    def round(self) -> Dispatched:
        metrics: list[RunMetrics] = []
        if self.pipe.schedule_name == "pipedream":
            self.state, m = self.pipe.run(self.state, self.stream)
            metrics.append(m)
        else:
            for batch in self.batches:
                self.state, m = self.pipe.step(self.state, batch)
                metrics.append(m)
        losses = [loss for m in metrics for loss in m.losses]
        return Dispatched(
            (self.state, losses),
            losses,
            sum(m.actions for m in metrics),
            sum(m.host_seconds for m in metrics),
        )


Runner = JitStepRunner | MicrobatchLoopRunner | PipelineRunner


@dataclasses.dataclass
class Timed:
    """One round of one runner, after ``jax.block_until_ready``."""

    seconds: float
    losses: list[float]
    actions: int
    host_seconds: float | None


def timed_round(runner: Runner) -> Timed:
    """Dispatches a round and waits for all of it before the clock stops."""
    start = time.perf_counter()
    out = runner.round()
    jax.block_until_ready(out.pending)
    seconds = time.perf_counter() - start
    return Timed(seconds, [float(x) for x in out.losses], out.actions, out.host_seconds)
