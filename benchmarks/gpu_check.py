"""GPU check: pdjax's pipeline machinery on one accelerator, and its roofline profile.

Two questions that a CPU-only machine cannot answer, each measured on the one device the
script finds (``jax.devices()[0]``; an NVIDIA H200 in the full run):

1. **Machinery overhead.** A GPT of ~350M parameters (``GPTConfig.medium()``, float32:
   pdjax's GPT layers have no dtype option; XLA may run float32 matmuls as TF32 on the
   GPU, see ``matmul_precision`` in the output) is split into 4 stages, *all on the same
   device*, and trained with ``schedule="1f1b"`` (``Pipeline.step``, M microbatches per
   step) and ``schedule="pipedream"`` (``Pipeline.run`` over a stream of microbatches).
   With one device there is no parallelism to gain, so any slowdown against the same
   model as ONE jitted train step (``value_and_grad`` + optax update over the whole batch,
   parameters and optimizer state donated) is the cost of the machinery: per-action
   dispatch, smaller programs, weight versions. Two honest floors on the same device: a
   plain loop of jitted per-microbatch gradient programs summed into one update per step
   (what 1F1B computes, without a pipeline) and the same loop updating after every
   microbatch (as PipeDream does at every stage). Every runner starts from
   the same weights and sees the same batches; runners are timed in interleaved rounds
   (the machine's noise hits all alike), medians are reported, and the clock stops only
   after ``jax.block_until_ready`` on the round's results. Host seconds per action come
   from ``RunMetrics.host_seconds / RunMetrics.actions``.
2. **Roofline accuracy.** ``pdjax.profile(..., device_model="h200")`` (what ``pdjax
   profile --device-model h200`` prints) against ``pdjax.profile(..., measure=True)`` on
   this device: per layer, per stage of the 4-stage split and in total, predicted vs
   measured forward + backward milliseconds on one microbatch.

Results: a markdown table printed and written to ``OUT/results.md``, and every figure in
``OUT/results.json`` (rewritten after each phase, so a run cut short keeps what it
measured). ``--tiny`` runs the very same functions on pdjax's tiny GPT with a small batch
(seconds on a CPU; the test suite runs it so that the script cannot rot).

    python benchmarks/gpu_check.py [--tiny] [--out out/gpu_check] [--batch 16]
        [--microbatches 4] [--steps 4] [--rounds 5] [--device-model h200]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import pdjax
from pdjax.errors import PipelineError
from pdjax.layers import LayerSequence, PyTree, Variables
from pdjax.models import ModelSpec, get_model
from pdjax.models.gpt import GPTConfig, make_spec
from pdjax.partition import StagePlan
from pdjax.pipeline import Pipeline, PipelineState, RunMetrics
from pdjax.profile import DEVICE_MODELS, Profile, get_device_model

Batch = tuple[PyTree, jax.Array]
LossFn = Callable[[jax.Array, jax.Array], jax.Array]

#: The runner every ratio is taken against.
BASELINE = "one jit per batch"
#: The runners whose overhead the check is about.
PIPELINES = ("1f1b", "pipedream")
#: Machinery overhead goal: a pipeline takes at most this much longer per sample.
OVERHEAD_GOAL = 0.05


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What differs between the full and the tiny run (nothing else does).

    Attributes:
      model: ``"350m"`` (:meth:`GPTConfig.medium`) or ``"tiny"`` (pdjax's tiny GPT).
      batch: samples per optimizer step (all runners).
      microbatches: ``M``, microbatches per step; ``batch`` must be divisible by it.
      steps: optimizer steps per timed round (pipedream: one stream of ``steps * M``).
      rounds: timed rounds after the two warm-up rounds.
      stages: pipeline stages, all on one device.
      profile_repeats: timed runs per layer in the measured profile (median kept).
    """

    model: str
    batch: int
    microbatches: int
    steps: int
    rounds: int
    stages: int
    profile_repeats: int

    @property
    def microbatch(self) -> int:
        return self.batch // self.microbatches


#: Batch 16: XLA's buffer assignment for one jitted step of the 350m GPT over 16 samples
#: of 512 tokens needs ~43 GB of temporaries (the attention scores are materialised), 32
#: samples ~85 GB: too much next to five runners' weights and Adam states (~4.4 GB each).
FULL = Sizes("350m", batch=16, microbatches=4, steps=4, rounds=5, stages=4, profile_repeats=5)
TINY = Sizes("tiny", batch=8, microbatches=4, steps=1, rounds=2, stages=4, profile_repeats=2)


def build_spec(model: str) -> ModelSpec:
    """The GPT to measure, without dropout in both sizes.

    Without dropout every runner computes the same loss on the same weights and batch (a
    check that they do the same work); with it, each would draw its own masks.
    """
    if model == "tiny":
        return get_model("gpt", "tiny", dropout=0.0)
    if model == "350m":
        return make_spec(GPTConfig.medium(), "350m")
    raise ValueError(f"unknown model size {model!r}; choose 350m or tiny")


# -- logging and output -----------------------------------------------------------------


class Log:
    """Timestamped progress lines on stderr, so a run that is cut short shows where."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def __call__(self, message: str) -> None:
        print(f"[{self.elapsed:7.1f} s] {message}", file=sys.stderr, flush=True)


class CompileCounter:
    """Counts XLA compilations and persistent-cache hits (``jax.monitoring`` events).

    Compilation dominates this check's wall time on a GPU; the counts say where it went,
    and a compilation inside a timed round would void that round.
    """

    def __init__(self) -> None:
        self.compiles = 0
        self.compile_seconds = 0.0
        self.cache_hits = 0

    def _on_duration(self, event: str, duration: float, **_: Any) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            self.compiles += 1
            self.compile_seconds += duration

    def _on_event(self, event: str, **_: Any) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            self.cache_hits += 1

    def __enter__(self) -> CompileCounter:
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)
        jax.monitoring.register_event_listener(self._on_event)
        return self

    def __exit__(self, *exc: object) -> None:
        jax.monitoring.unregister_event_duration_listener(self._on_duration)
        jax.monitoring.unregister_event_listener(self._on_event)

    def snapshot(self) -> tuple[int, float, int]:
        return self.compiles, self.compile_seconds, self.cache_hits

    def since(self, before: tuple[int, float, int]) -> dict[str, Any]:
        """Compilations (backend compiles, cache hits included), their seconds, and how
        many were persistent-cache hits, since ``before``."""
        c, s, h = self.snapshot()
        return {
            "compiles": c - before[0],
            "compile_seconds": s - before[1],
            "cache_hits": h - before[2],
        }


def _clean(value: Any) -> Any:
    """JSON-safe: non-finite floats become ``None`` (strict JSON has no NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if isinstance(value, (np.floating, np.integer)):
        return _clean(value.item())
    return value


def _write(path: Path, text: str) -> None:
    """Atomically: a reader (or a run cut short) never leaves half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def write_outputs(out: Path, results: dict[str, Any]) -> str:
    """Writes ``results.json`` (strict JSON) and ``results.md``; returns the markdown."""
    _write(out / "results.json", json.dumps(_clean(results), indent=2, allow_nan=False) + "\n")
    text = render_markdown(results)
    _write(out / "results.md", text + "\n")
    return text


# -- placement --------------------------------------------------------------------------


def shared_plan(num_layers: int, num_stages: int) -> tuple[StagePlan, ...]:
    """``even_stages`` layer ranges, every stage on device 0: the pipeline's own work
    with nothing to overlap, so its slowdown against one jit is pure machinery."""
    return tuple(
        StagePlan(s.first_layer, s.last_layer, (0,))
        for s in pdjax.even_stages(num_layers, num_stages)
    )


def spread_plan(num_layers: int, num_stages: int, num_devices: int) -> tuple[StagePlan, ...]:
    """The fallback if a runtime refuses stages sharing a device: stage ``s`` on device
    ``s % num_devices`` (still all on device 0 when only one is visible)."""
    return tuple(
        StagePlan(s.first_layer, s.last_layer, (i % num_devices,))
        for i, s in enumerate(pdjax.even_stages(num_layers, num_stages))
    )


def make_pipeline(
    spec: ModelSpec,
    optimizer: optax.GradientTransformation,
    schedule: str,
    sizes: Sizes,
    pipeline_cls: Callable[..., Pipeline] = Pipeline,
) -> tuple[Pipeline, str]:
    """A pipeline of ``spec`` with all stages on device 0, and a note on the placement.

    If the runtime refuses stages that share a device, falls back to
    :func:`spread_plan` and says why in the note (the results carry it).
    """

    def build(plan: tuple[StagePlan, ...]) -> Pipeline:
        return pipeline_cls(
            spec.layers,
            plan,
            spec.loss,
            optimizer,
            schedule=schedule,
            microbatches=sizes.microbatches,
        )

    try:
        return build(shared_plan(len(spec.layers), sizes.stages)), "all stages on device 0"
    except PipelineError as e:
        n = len(jax.devices())
        plan = spread_plan(len(spec.layers), sizes.stages, n)
        note = f"stages sharing device 0 refused ({e}); stage s on device s % {n}: " + ", ".join(
            str(s.devices[0]) for s in plan
        )
        return build(plan), note


# -- runners ----------------------------------------------------------------------------


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


# -- part 1: throughput ----------------------------------------------------------------


def make_data(
    spec: ModelSpec, sizes: Sizes, device: jax.Device, seed: int
) -> tuple[list[Batch], list[list[Batch]]]:
    """``steps`` batches on ``device`` and each one's ``M`` microbatches, cut beforehand
    (the runners that take microbatches should not time the slicing)."""
    batches = [
        jax.device_put(spec.sample_batch(sizes.batch, seed + t), device) for t in range(sizes.steps)
    ]
    mb = sizes.microbatch
    split = [
        [
            jax.tree.map(lambda a, k=k: a[k * mb : (k + 1) * mb], b)
            for k in range(sizes.microbatches)
        ]
        for b in batches
    ]
    return batches, jax.block_until_ready(split)


def build_runners(
    spec: ModelSpec,
    sizes: Sizes,
    optimizer: optax.GradientTransformation,
    batches: list[Batch],
    split: list[list[Batch]],
    key: jax.Array,
    device: jax.Device,
) -> tuple[list[Runner], dict[str, str]]:
    """Every runner, all starting from the weights ``Pipeline.init`` draws from ``key``.

    Returns the runners (baseline first) and, per pipeline, the note on its placement.
    """
    stream = [mb for mbs in split for mb in mbs]
    pipelines: list[PipelineRunner] = []
    notes: dict[str, str] = {}
    variables: list[Variables] | None = None
    for schedule in PIPELINES:
        pipe, notes[schedule] = make_pipeline(spec, optimizer, schedule, sizes)
        state = pipe.init(key, split[0][0][0])
        if variables is None:
            variables = pipe.variables(state)
        pipelines.append(PipelineRunner(schedule, pipe, state, batches, stream))
    assert variables is not None
    common = {
        "layers": spec.layers,
        "loss_fn": spec.loss,
        "optimizer": optimizer,
        "variables": variables,
        "rng": jax.random.fold_in(key, 1),
        "device": device,
    }
    runners: list[Runner] = [
        JitStepRunner(BASELINE, batches=batches, **common),
        MicrobatchLoopRunner("jit per microbatch, accumulate", groups=split, **common),
        MicrobatchLoopRunner(
            "jit per microbatch, update each", groups=[[mb] for mb in stream], **common
        ),
        *pipelines,
    ]
    return runners, notes


def loss_agreement(first: dict[str, Timed], sizes: Sizes) -> dict[str, float]:
    """Relative loss differences on the first (warm-up) step, all runners from the same
    weights and batch: the same work must give the same loss, up to float reordering.

    The accumulation loop's per-microbatch losses are the reference: 1F1B's must match
    each; the one-jit loss is their mean; PipeDream's first microbatch and the
    update-each loop's first microbatch run at the initial weights everywhere.
    """
    m = sizes.microbatches
    ref = np.asarray(first["jit per microbatch, accumulate"].losses[:m])

    def rel(a: Sequence[float] | float, b: Sequence[float] | float) -> float:
        a_, b_ = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return float(np.max(np.abs(a_ - b_) / np.maximum(np.abs(b_), 1e-12)))

    return {
        BASELINE: rel(first[BASELINE].losses[0], float(ref.mean())),
        "1f1b": rel(first["1f1b"].losses[:m], ref),
        "pipedream (microbatch 0)": rel(first["pipedream"].losses[0], ref[0]),
        "jit per microbatch, update each (microbatch 0)": rel(
            first["jit per microbatch, update each"].losses[0], ref[0]
        ),
    }


def measure_throughput(
    runners: list[Runner], sizes: Sizes, log: Log, deadline: float, compiles: CompileCounter
) -> tuple[dict[str, Timed], dict[str, list[Timed]], dict[str, Any]]:
    """Two warm-up rounds per runner, then interleaved timed rounds.

    Two, not one: a second call can still compile (when a first call's inputs are placed
    unlike the outputs it returns, the jit cache tells them apart; a pipeline's first
    step may differ from later ones). XLA compilations during the timed rounds are
    counted (should be 0). Stops
    adding rounds once ``log.elapsed`` passes ``deadline`` (at least one is always timed),
    so a slow machine still leaves time for the profile.

    Returns the first warm-up round per runner, the timed rounds, and compile counts.
    """
    first: dict[str, Timed] = {}
    warmup: dict[str, Any] = {}
    for r in runners:
        log(f"warm-up (compiles) {r.name}")
        before = compiles.snapshot()
        first[r.name] = timed_round(r)
        second = timed_round(r)
        warmup[r.name] = {
            **compiles.since(before),
            "first_round_seconds": first[r.name].seconds,
            "second_round_seconds": second.seconds,
        }
        log(
            f"  {r.name}: {first[r.name].seconds:.1f} s + {second.seconds:.2f} s, "
            f"{warmup[r.name]['compiles']} compilations"
        )
    rounds: dict[str, list[Timed]] = {r.name: [] for r in runners}
    before = compiles.snapshot()
    for i in range(sizes.rounds):
        if i > 0 and log.elapsed > deadline:
            log(f"time budget reached: {i} timed rounds instead of {sizes.rounds}")
            break
        for r in runners:
            rounds[r.name].append(timed_round(r))
        log(
            f"round {i + 1}/{sizes.rounds}: "
            + ", ".join(f"{name} {ts[-1].seconds * 1e3:.1f} ms" for name, ts in rounds.items())
        )
    return first, rounds, {"warmup": warmup, "timed_rounds": compiles.since(before)}


def summarise_throughput(
    first: dict[str, Timed], rounds: dict[str, list[Timed]], sizes: Sizes
) -> list[dict[str, Any]]:
    """Per runner: medians over the timed rounds, and ratios against the baseline and
    against the floor that computes the same updates on one device."""
    samples = sizes.batch * sizes.steps
    median_s = {name: statistics.median(t.seconds for t in ts) for name, ts in rounds.items()}
    floors = {
        "1f1b": "jit per microbatch, accumulate",
        "pipedream": "jit per microbatch, update each",
    }
    rows = []
    for name, ts in rounds.items():
        t = median_s[name]
        host = [x.host_seconds / x.actions for x in ts if x.host_seconds is not None]
        floor = floors.get(name)
        rows.append(
            {
                "runner": name,
                "rounds": len(ts),
                "dispatches_per_step": ts[0].actions / sizes.steps,
                "ms_per_step": t / sizes.steps * 1e3,
                "samples_per_second": samples / t,
                "ratio_vs_jit": median_s[BASELINE] / t,
                "overhead_vs_jit": t / median_s[BASELINE] - 1,
                "floor": floor,
                "ratio_vs_floor": median_s[floor] / t if floor else None,
                "host_us_per_action": statistics.median(host) * 1e6 if host else None,
                "first_round_seconds": first[name].seconds,
                "round_seconds": [x.seconds for x in ts],
                "final_loss": ts[-1].losses[-1],
            }
        )
    return rows


# -- part 2: roofline vs measured ----------------------------------------------------------


def compare_profiles(
    measured: Profile, predicted: Profile, plan: Sequence[StagePlan]
) -> dict[str, Any]:
    """Per layer, per stage and in total: measured vs predicted forward + backward ms.

    Error is ``predicted / measured - 1`` (negative: the device model is too optimistic).
    Achieved TFLOP/s uses XLA's FLOP counts (forward + backward) over measured time.
    """

    def row(name: str, idx: Sequence[int]) -> dict[str, Any]:
        layers_m = [measured.layers[i] for i in idx]
        layers_p = [predicted.layers[i] for i in idx]
        fwd = sum(_secs(lp.forward_seconds) for lp in layers_m)
        bwd = sum(_secs(lp.backward_seconds) for lp in layers_m)
        pfwd = sum(_secs(lp.forward_seconds) for lp in layers_p)
        pbwd = sum(_secs(lp.backward_seconds) for lp in layers_p)
        flops = sum((lp.forward_flops or 0.0) + (lp.backward_flops or 0.0) for lp in layers_m)
        total, ptotal = fwd + bwd, pfwd + pbwd
        return {
            "name": name,
            "layers": [idx[0], idx[-1]],
            "measured_fwd_ms": fwd * 1e3,
            "measured_bwd_ms": bwd * 1e3,
            "measured_ms": total * 1e3,
            "predicted_fwd_ms": pfwd * 1e3,
            "predicted_bwd_ms": pbwd * 1e3,
            "predicted_ms": ptotal * 1e3,
            "error": ptotal / total - 1 if total > 0 else math.nan,
            "measured_tflops": flops / total / 1e12 if total > 0 else math.nan,
        }

    layers = [row(lp.name, [i]) for i, lp in enumerate(measured.layers)]
    stages = [
        row(f"stage {s}", list(range(st.first_layer, st.last_layer + 1)))
        for s, st in enumerate(plan)
    ]
    total = row("total", list(range(len(measured.layers))))
    return {
        "batch_size": measured.batch_size,
        "measured_source": measured.time_source,
        "predicted_source": predicted.time_source,
        "layers": layers,
        "stages": stages,
        "total": total,
        "median_abs_layer_error": statistics.median(abs(r["error"]) for r in layers),
    }


def _secs(value: float | None) -> float:
    return math.nan if value is None else float(value)


# -- report ------------------------------------------------------------------------------


def _f(value: Any, fmt: str = ".2f", suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:{fmt}}{suffix}"


def render_markdown(results: dict[str, Any]) -> str:
    """The report: environment, throughput, loss agreement, profile comparison."""
    env, cfg = results["environment"], results["config"]
    lines = [
        f"# pdjax GPU check ({cfg['mode']})",
        "",
        "| | |",
        "|---|---|",
        f"| device | {env['device_kind']} ({env['platform']}, {env['device_count']} visible) |",
        f"| jax / jaxlib | {env['jax']} / {env['jaxlib']} |",
        f"| platform version | {env['platform_version']} |",
        f"| matmul precision | {env['matmul_precision']} |",
        f"| model | GPT {cfg['model']}: {cfg['num_params']:,} params, {cfg['num_layers']} "
        "layers; " + ", ".join(f"{k}={v}" for k, v in cfg["model_config"].items()) + " |",
        f"| dtype | {cfg['dtype']} |",
        f"| batch | {cfg['batch']} samples per step = {cfg['microbatches']} microbatches of "
        f"{cfg['microbatch']}; steps per round: {cfg['steps']}; median of "
        f"{cfg['rounds']} interleaved rounds after 2 warm-up rounds |",
        f"| optimizer | {cfg['optimizer']} |",
        f"| pipeline | {cfg['stages']} stages, layers {cfg['stage_layers']}; {cfg['placement']} |",
        f"| wall time | {results.get('wall_seconds', math.nan):.0f} s |",
        "",
    ]
    tp = results.get("throughput")
    if tp:
        lines += [
            "## Machinery overhead (same device, same samples)",
            "",
            "| runner | dispatches / step | ms / step | samples/s | vs one jit | "
            "overhead vs jit | vs its floor | host us / action | model TFLOP/s |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in tp["rows"]:
            lines.append(
                f"| {r['runner']} | {r['dispatches_per_step']:.0f} | {r['ms_per_step']:.1f} | "
                f"{r['samples_per_second']:,.1f} | {r['ratio_vs_jit']:.3f}x | "
                f"{r['overhead_vs_jit'] * 100:+.1f}% | "
                f"{_f(r['ratio_vs_floor'], '.3f', 'x')} | "
                f"{_f(r['host_us_per_action'], '.0f')} | {_f(r.get('model_tflops'), '.3g')} |"
            )
        lines += [
            "",
            "Overhead = time per sample / one jit's - 1. "
            f"Goal: overhead vs one jit <= {OVERHEAD_GOAL:.0%}: "
            + ", ".join(f"{k} {'met' if v else 'NOT met'}" for k, v in tp["goal_met"].items())
            + ". Floors: 1f1b against the accumulation loop, pipedream against the "
            "update-each loop (it updates every stage after every microbatch).",
            "",
            "First-step loss, relative difference against the accumulation loop (same "
            "weights, same batch): "
            + ", ".join(f"{k} {v:.1e}" for k, v in tp["loss_agreement"].items()),
            "",
        ]
    comp = results.get("compilation")
    if comp:
        lines += [
            "## Compilation (XLA backend compiles, persistent-cache hits included)",
            "",
            "| phase | compilations | cache hits | compile s | first + second round s |",
            "|---|---:|---:|---:|---:|",
        ]
        for name, c in comp["warmup"].items():
            lines.append(
                f"| warm-up: {name} | {c['compiles']} | {c['cache_hits']} | "
                f"{c['compile_seconds']:.1f} | {c['first_round_seconds']:.1f} + "
                f"{c['second_round_seconds']:.2f} |"
            )
        for name in ("timed_rounds", "profile"):
            if name in comp:
                c = comp[name]
                lines.append(
                    f"| {name.replace('_', ' ')} | {c['compiles']} | {c['cache_hits']} | "
                    f"{c['compile_seconds']:.1f} | |"
                )
        lines.append("")
    pr = results.get("profile")
    if pr:
        dm = pr["device_model"]
        lines += [
            f"## Roofline ({pr['predicted_source']}) vs measured, one microbatch of "
            f"{pr['batch_size']}",
            "",
            f"Device model {dm['name']}: {dm['dtype']} peak {dm['peak_tflops']:.0f} TFLOP/s, "
            f"memory {dm['memory_tb_per_s']:.2f} TB/s, efficiency {dm['efficiency']:g}; "
            "each layer's forward and backward take max(FLOPs / peak, bytes / bandwidth) "
            "with XLA's counts. Measured: median of timed runs on this device.",
            "",
            "| # | layer / stage | measured fwd ms | measured bwd ms | measured ms | "
            "predicted ms | predicted / measured | error | measured TFLOP/s |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for i, r in enumerate(pr["layers"]):
            lines.append(_profile_row(str(i), r))
        for r in pr["stages"]:
            lines.append(_profile_row(f"{r['layers'][0]}-{r['layers'][1]}", r))
        lines.append(_profile_row("all", pr["total"], bold=True))
        lines += [
            "",
            f"Total error {pr['total']['error'] * 100:+.1f}%; median |error| per layer "
            f"{pr['median_abs_layer_error'] * 100:.1f}%. Error = predicted / measured - 1.",
            "",
        ]
        if "sum_of_layers_vs_floor" in pr:
            s = pr["sum_of_layers_vs_floor"]
            lines += [
                f"Sum of measured layers per microbatch: {s['sum_of_layers_ms']:.2f} ms; "
                f"accumulation loop per microbatch (incl. its share of the update): "
                f"{s['floor_ms_per_microbatch']:.2f} ms.",
                "",
            ]
    return "\n".join(lines)


def _profile_row(index: str, r: dict[str, Any], bold: bool = False) -> str:
    name = f"**{r['name']}**" if bold else r["name"]
    ms = [r[k] for k in ("measured_fwd_ms", "measured_bwd_ms", "measured_ms", "predicted_ms")]
    return (
        f"| {index} | {name} | "
        + " | ".join(_f(v, ".4g") for v in ms)
        + f" | {_f(r['error'] + 1, '.3g')} | {r['error'] * 100:+.1f}% | "
        + f"{_f(r['measured_tflops'], '.3g')} |"
    )


# -- main -----------------------------------------------------------------------------------


def environment(device: jax.Device) -> dict[str, Any]:
    """Where the figures come from."""
    import jaxlib

    client = getattr(device, "client", None)
    return {
        "device_kind": device.device_kind,
        "platform": device.platform,
        "device_count": jax.device_count(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        # one line: a GPU client's version spans several
        "platform_version": " ".join(str(getattr(client, "platform_version", "?")).split()),
        "matmul_precision": str(jax.config.jax_default_matmul_precision or "default")
        + " (with the default, NVIDIA GPUs since Ampere may run float32 dots as TF32)",
        "python": sys.version.split()[0],
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--tiny", action="store_true", help="tiny GPT, small batch (CPU, tests)")
    ap.add_argument("--out", default="out/gpu_check", help="folder for results.md/.json")
    ap.add_argument("--batch", type=int, help="samples per optimizer step")
    ap.add_argument("--microbatches", type=int, help="M, microbatches per step")
    ap.add_argument("--steps", type=int, help="optimizer steps per timed round")
    ap.add_argument("--rounds", type=int, help="timed rounds (median reported)")
    ap.add_argument("--profile-repeats", type=int, help="timed runs per layer in the profile")
    ap.add_argument(
        "--device-model",
        default="h200",
        choices=sorted(DEVICE_MODELS),
        help="roofline preset to check against the measured times",
    )
    ap.add_argument("--lr", type=float, default=1e-4, help="Adam learning rate")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--budget-s",
        type=float,
        default=420.0,
        help="stop adding timed rounds after this many seconds since start (>= 1 round)",
    )
    ap.add_argument(
        "--compile-cache",
        default="",
        help="persistent XLA cache folder (default OUT/xla-cache; 'none' disables); "
        "identical transformer blocks and stages then compile once",
    )
    return ap.parse_args(argv)


def resolve_sizes(args: argparse.Namespace) -> Sizes:
    """The full or tiny sizes with the command line's overrides."""
    overrides = {
        "batch": args.batch,
        "microbatches": args.microbatches,
        "steps": args.steps,
        "rounds": args.rounds,
        "profile_repeats": args.profile_repeats,
    }
    sizes = dataclasses.replace(
        TINY if args.tiny else FULL, **{k: v for k, v in overrides.items() if v is not None}
    )
    if min(sizes.batch, sizes.microbatches, sizes.steps, sizes.rounds) < 1:
        raise SystemExit("--batch, --microbatches, --steps and --rounds must be >= 1")
    if sizes.batch % sizes.microbatches:
        raise SystemExit(f"--batch {sizes.batch} is not divisible by M={sizes.microbatches}")
    return sizes


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs the check; returns the results it wrote to ``OUT/results.json``."""
    args = parse_args(argv)
    log = Log()
    sizes = resolve_sizes(args)
    # Read when the GPU client starts (the first device query below): JAX's default pool
    # of 75% of the device fits this check; 90% leaves more room. No effect on CPU.
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.90")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cache = "" if args.compile_cache == "none" else args.compile_cache or str(out / "xla-cache")
    if cache:
        # Set before the first compilation: JAX decides once per process whether to use
        # it. The 24 identical blocks (profile) and stages (two pipelines) then compile
        # once each, which is most of this check's wall time on a GPU.
        jax.config.update("jax_compilation_cache_dir", cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    device = jax.devices()[0]
    spec = build_spec(sizes.model)
    optimizer = optax.adam(args.lr)
    plan = shared_plan(len(spec.layers), sizes.stages)
    results: dict[str, Any] = {
        "complete": False,
        "environment": environment(device),
        "config": {
            "mode": "tiny" if args.tiny else "full",
            "model": sizes.model,
            "model_config": dataclasses.asdict(spec.model_config),
            "num_params": spec.num_params(),
            "num_layers": len(spec.layers),
            "dtype": "float32 params and compute (pdjax's GPT layers have no dtype option)",
            "batch": sizes.batch,
            "microbatches": sizes.microbatches,
            "microbatch": sizes.microbatch,
            "steps": sizes.steps,
            "rounds": sizes.rounds,
            "stages": sizes.stages,
            "stage_layers": ", ".join(f"{s.first_layer}-{s.last_layer}" for s in plan),
            "placement": "",
            "optimizer": f"adam({args.lr:g})",
            "device_model": args.device_model,
            "compile_cache": cache or "off",
        },
    }
    cfg = results["config"]
    log(
        f"{device.device_kind}: GPT {sizes.model}, {cfg['num_params']:,} params, "
        f"{len(spec.layers)} layers"
    )
    with CompileCounter() as compiles:
        # -- part 1: the same training on every runner ---------------------------------
        batches, split = make_data(spec, sizes, device, args.seed)
        runners, notes = build_runners(
            spec, sizes, optimizer, batches, split, jax.random.key(args.seed), device
        )
        log("runners built")
        cfg["placement"] = "; ".join(f"{k}: {v}" for k, v in notes.items())
        first, rounds, compile_info = measure_throughput(
            runners, sizes, log, args.budget_s, compiles
        )
        rows = summarise_throughput(first, rounds, sizes)
        cfg["rounds"] = min(len(ts) for ts in rounds.values())
        results["throughput"] = {
            "rows": rows,
            "goal_met": {
                r["runner"]: r["overhead_vs_jit"] <= OVERHEAD_GOAL
                for r in rows
                if r["runner"] in PIPELINES
            },
            "loss_agreement": loss_agreement(first, sizes),
        }
        results["compilation"] = compile_info
        results["wall_seconds"] = log.elapsed
        write_outputs(out, results)  # partial: kept if the profile does not finish
        sample = split[0][0][0]
        del runners, first, rounds, batches, split  # free the device for the profile

        # -- part 2: the device model against measured layer times ------------------------
        before = compiles.snapshot()
        log("profile: measured")
        measured = pdjax.profile(
            spec.layers, sample, measure=True, device=device, repeats=sizes.profile_repeats
        )
        log(f"profile: device model {args.device_model}")
        predicted = pdjax.profile(spec.layers, sample, device_model=args.device_model)
        results["compilation"]["profile"] = compiles.since(before)
    comparison = compare_profiles(measured, predicted, plan)
    model = get_device_model(args.device_model)
    comparison["device_model"] = {
        "name": model.name,
        "dtype": predicted.dtype,
        "peak_tflops": model.flops_per_second(predicted.dtype) / 1e12,
        "memory_tb_per_s": model.memory_bandwidth / 1e12,
        "efficiency": model.efficiency,
    }
    floor = next(r for r in rows if r["runner"] == "jit per microbatch, accumulate")
    comparison["sum_of_layers_vs_floor"] = {
        "sum_of_layers_ms": comparison["total"]["measured_ms"],
        "floor_ms_per_microbatch": floor["ms_per_step"] / sizes.microbatches,
    }
    results["profile"] = comparison
    flops_per_sample = (
        sum((lp.forward_flops or 0.0) + (lp.backward_flops or 0.0) for lp in measured.layers)
        / measured.batch_size
    )
    for r in rows:
        r["model_tflops"] = r["samples_per_second"] * flops_per_sample / 1e12
    measured.save(out / "profile-measured.json")
    predicted.save(out / "profile-predicted.json")

    results["wall_seconds"] = log.elapsed
    results["complete"] = True
    print(write_outputs(out, results))
    log(f"done; wrote {out / 'results.md'} and {out / 'results.json'}")
    return results


if __name__ == "__main__":
    main()
