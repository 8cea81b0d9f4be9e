"""Part 1 of the GPU check: the same training on every runner, timed in interleaved
rounds, and its summary (ratios against one jit and against each pipeline's floor)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import optax

from pdjax.layers import Variables
from pdjax.models import ModelSpec

from .placement import make_pipeline
from .progress import CompileCounter, Log
from .runners import (
    Batch,
    JitStepRunner,
    MicrobatchLoopRunner,
    PipelineRunner,
    Runner,
    Timed,
    timed_round,
)
from .sizes import BASELINE, PIPELINES, Sizes


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
