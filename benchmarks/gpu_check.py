"""GPU check: pdjax's pipeline machinery on one accelerator, and its roofline profile.

Two questions that a CPU-only machine cannot answer, each measured on the one device the
script finds (``jax.devices()[0]``; an NVIDIA H200 in the full run):

1. **Machinery overhead.** A model of ~350M parameters (``--model gpt``, the default:
   ``GPTConfig.medium()``, 369M; ``--model llama``: ``LlamaConfig.paper()``, 336M; float32,
   where XLA may run float32 matmuls as TF32 on the GPU, see ``matmul_precision`` in the
   output, or ``--precision bf16``: every layer under pdjax's mixed policy, float32
   weights, bfloat16 compute, the one-jit baseline and floors included) is split into 4
   stages, *all on the same device*, and trained with ``schedule="1f1b"``
   (``Pipeline.step``, M microbatches per step) and ``schedule="pipedream"``
   (``Pipeline.run`` over a stream of microbatches).
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
   from ``RunMetrics.host_seconds / RunMetrics.actions``. **MFU** per runner: the model's
   training FLOPs per sample (``pdjax.apps.train.throughput.model_flops_per_sample``: XLA's
   cost analysis of the whole model's forward and backward, the figure ``pdjax train``
   reports) times its samples/s over the device's peak for the compute dtype
   (``peak_flops``: the roofline preset the device kind names, e.g. H200 float32 67
   TFLOP/s, bfloat16 989; on a CPU a measured matmul rate).
2. **Roofline accuracy.** ``pdjax.profile(..., device_model="h200")`` (what ``pdjax
   profile --device-model h200`` prints) against ``pdjax.profile(..., measure=True)`` on
   this device: per layer, per stage of the 4-stage split and in total, predicted vs
   measured forward + backward milliseconds on one microbatch.

Results: a markdown table printed and written to ``OUT/results.md``, and every figure in
``OUT/results.json`` (rewritten after each phase, so a run cut short keeps what it
measured). ``--tiny`` runs the very same functions on the family's tiny config with a
small batch (seconds on a CPU; the test suite runs it so that the script cannot rot).

    python benchmarks/gpu_check.py [--model gpt|llama] [--precision float32|bf16] [--tiny]
        [--out out/gpu_check] [--batch 16] [--microbatches 4] [--steps 4] [--rounds 5]
        [--device-model h200 | --skip-profile] [--budget-s 420]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import optax

import pdjax
from pdjax.apps.train.throughput import Peak, model_flops_per_sample, peak_flops
from pdjax.layers import PyTree
from pdjax.models import ModelSpec
from pdjax.partition import StagePlan
from pdjax.profile import DEVICE_MODELS, Profile

# Run as a script, Python puts this folder on sys.path; loaded by its file path (as the
# tests load it), nothing does, and the check's own modules must be found either way.
_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.append(_HERE)

from gpucheck.placement import make_pipeline, shared_plan, spread_plan  # noqa: E402
from gpucheck.progress import CompileCounter, Log  # noqa: E402
from gpucheck.report import render_markdown, write_outputs  # noqa: E402
from gpucheck.roofline import compare_profiles, roofline_check  # noqa: E402
from gpucheck.runners import (  # noqa: E402
    Batch,
    Dispatched,
    JitStepRunner,
    LossFn,
    MicrobatchLoopRunner,
    PipelineRunner,
    Runner,
    Timed,
    timed_round,
)
from gpucheck.sizes import (  # noqa: E402
    BASELINE,
    FULL,
    MODELS,
    OVERHEAD_GOAL,
    PIPELINES,
    PRECISIONS,
    TINY,
    Sizes,
    build_spec,
)
from gpucheck.throughput import (  # noqa: E402
    build_runners,
    loss_agreement,
    make_data,
    measure_throughput,
    summarise_throughput,
)

# The names the script held before it was split into gpucheck/: the tests load the script
# by its path and reach its parts through it.
__all__ = [
    "BASELINE",
    "FULL",
    "MODELS",
    "OVERHEAD_GOAL",
    "PIPELINES",
    "PRECISIONS",
    "TINY",
    "Batch",
    "CompileCounter",
    "Dispatched",
    "JitStepRunner",
    "Log",
    "LossFn",
    "MicrobatchLoopRunner",
    "PipelineRunner",
    "Runner",
    "Sizes",
    "Timed",
    "build_runners",
    "build_spec",
    "compare_profiles",
    "compute_dtype",
    "environment",
    "loss_agreement",
    "main",
    "make_data",
    "make_pipeline",
    "measure_throughput",
    "mfu_rows",
    "parse_args",
    "render_markdown",
    "resolve_sizes",
    "shared_plan",
    "spread_plan",
    "summarise_throughput",
    "timed_round",
    "write_outputs",
]


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
    ap.add_argument(
        "--model",
        default="gpt",
        choices=MODELS,
        help="model family: gpt (GPTConfig.medium, 369M) or llama (LlamaConfig.paper, 336M)",
    )
    ap.add_argument(
        "--precision",
        default="float32",
        choices=PRECISIONS,
        help="float32, or bf16: every layer (and the one-jit baseline) under the mixed "
        "policy (float32 weights and layer outputs, bfloat16 compute)",
    )
    ap.add_argument(
        "--tiny", action="store_true", help="the family's tiny config, small batch (CPU, tests)"
    )
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
    ap.add_argument(
        "--skip-profile",
        action="store_true",
        help="part 1 only (overhead, MFU): no roofline profile (its ~3 programs per "
        "distinct layer are a large share of the compile time)",
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


def use_compile_cache(option: str, out: Path) -> str:
    """Turns on the persistent XLA cache (``--compile-cache``; default ``OUT/xla-cache``,
    ``none`` disables it); returns its folder, or "" when off."""
    cache = "" if option == "none" else option or str(out / "xla-cache")
    if cache:
        # Set before the first compilation: JAX decides once per process whether to use
        # it. The 24 identical blocks (profile) and stages (two pipelines) then compile
        # once each, which is most of this check's wall time on a GPU.
        jax.config.update("jax_compilation_cache_dir", cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return cache


def describe_config(
    args: argparse.Namespace,
    sizes: Sizes,
    spec: ModelSpec,
    plan: Sequence[StagePlan],
    cache: str,
) -> dict[str, Any]:
    """The results' ``config``: what was run (``placement`` and ``rounds`` are filled in
    once the runners are built and timed)."""
    return {
        "mode": "tiny" if args.tiny else "full",
        "family": args.model,
        "model": sizes.model,
        "model_config": dataclasses.asdict(spec.model_config),
        "num_params": spec.num_params(),
        "num_layers": len(spec.layers),
        "precision": args.precision,
        "dtype": (
            "float32 params and compute"
            if args.precision == "float32"
            else "float32 params and layer outputs, bfloat16 compute (every runner)"
        ),
        "batch": sizes.batch,
        "microbatches": sizes.microbatches,
        "microbatch": sizes.microbatch,
        "steps": sizes.steps,
        "rounds": sizes.rounds,
        "stages": sizes.stages,
        "stage_layers": ", ".join(f"{s.first_layer}-{s.last_layer}" for s in plan),
        "placement": "",
        "optimizer": f"adam({args.lr:g})",
        "device_model": "" if args.skip_profile else args.device_model,
        "compile_cache": cache or "off",
    }


@dataclasses.dataclass(frozen=True)
class ThroughputCheck:
    """What part 1 leaves for the results and for part 2.

    Attributes:
      throughput: the results' ``throughput``: per-runner rows, goal, loss agreement.
      compilation: the results' ``compilation`` so far (warm-up and timed rounds).
      placement: per pipeline, where its stages went.
      rounds: timed rounds every runner got (fewer than asked if the budget ran out).
      sample: one microbatch ``(inputs, targets)``, for the FLOP count and the profile.
    """

    throughput: dict[str, Any]
    compilation: dict[str, Any]
    placement: str
    rounds: int
    sample: Batch


def check_throughput(
    spec: ModelSpec,
    sizes: Sizes,
    optimizer: optax.GradientTransformation,
    args: argparse.Namespace,
    device: jax.Device,
    log: Log,
    compiles: CompileCounter,
) -> ThroughputCheck:
    """Part 1: the same training on every runner, timed in interleaved rounds.

    The runners, their weights and batches are local, so they are freed on return and
    the device is free for the profile.
    """
    batches, split = make_data(spec, sizes, device, args.seed)
    runners, notes = build_runners(
        spec,
        sizes,
        optimizer,
        batches=batches,
        split=split,
        key=jax.random.key(args.seed),
        device=device,
    )
    log("runners built")
    first, rounds, compile_info = measure_throughput(runners, sizes, log, args.budget_s, compiles)
    rows = summarise_throughput(first, rounds, sizes)
    throughput = {
        "rows": rows,
        "goal_met": {
            r["runner"]: r["overhead_vs_jit"] <= OVERHEAD_GOAL
            for r in rows
            if r["runner"] in PIPELINES
        },
        "loss_agreement": loss_agreement(first, sizes),
    }
    return ThroughputCheck(
        throughput=throughput,
        compilation=compile_info,
        placement="; ".join(f"{k}: {v}" for k, v in notes.items()),
        rounds=min(len(ts) for ts in rounds.values()),
        sample=split[0][0],
    )


def compute_dtype(precision: str) -> str:
    """The dtype the layers compute in under ``--precision``, whose peak MFU is taken
    against (as ``pdjax train`` does)."""
    return "bfloat16" if precision == "bf16" else "float32"


def mfu_rows(
    rows: list[dict[str, Any]], spec: ModelSpec, sample: Batch, peak: Peak
) -> dict[str, Any]:
    """Adds ``model_tflops`` and ``mfu`` to every throughput row; returns the figures
    they come from (the results' ``mfu``).

    Model FLOPs per sample are XLA's cost analysis of the whole model's forward and
    backward on ``sample`` (lowered, not run; the optimizer's update left out), the same
    for every runner: MFU compares runners doing the same work, whatever each executes.
    """
    per_sample = model_flops_per_sample(spec, *sample)
    for r in rows:
        r["model_tflops"] = r["samples_per_second"] * per_sample / 1e12
        r["mfu"] = r["samples_per_second"] * per_sample / peak.flops
    return {
        "flops_per_sample": per_sample,
        "peak_tflops": peak.flops / 1e12,
        "peak_source": peak.source,
    }


def measure_profiles(
    spec: ModelSpec, sample: PyTree, device: jax.Device, sizes: Sizes, device_model: str, log: Log
) -> tuple[Profile, Profile]:
    """Part 2's two profiles of one microbatch: measured on ``device``, and predicted by
    the roofline of ``device_model``."""
    log("profile: measured")
    measured = pdjax.profile(
        spec.layers, sample, measure=True, device=device, repeats=sizes.profile_repeats
    )
    log(f"profile: device model {device_model}")
    predicted = pdjax.profile(spec.layers, sample, device_model=device_model)
    return measured, predicted


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
    cache = use_compile_cache(args.compile_cache, out)
    device = jax.devices()[0]
    spec = build_spec(sizes.model, args.model, args.precision)
    dtype = compute_dtype(args.precision)
    optimizer = optax.adam(args.lr)
    plan = shared_plan(len(spec.layers), sizes.stages)
    cfg = describe_config(args, sizes, spec, plan, cache)
    results: dict[str, Any] = {
        "complete": False,
        "environment": environment(device),
        "config": cfg,
    }
    log(
        f"{device.device_kind}: {args.model} {sizes.model} ({args.precision}), "
        f"{cfg['num_params']:,} params, {len(spec.layers)} layers"
    )
    with CompileCounter() as compiles:
        part1 = check_throughput(
            spec, sizes, optimizer, args=args, device=device, log=log, compiles=compiles
        )
        cfg["placement"] = part1.placement
        cfg["rounds"] = part1.rounds
        results["throughput"] = part1.throughput
        results["compilation"] = part1.compilation
        log("model FLOPs (XLA cost analysis) and the device's peak")
        results["mfu"] = {
            "dtype": dtype,
            **mfu_rows(part1.throughput["rows"], spec, part1.sample, peak_flops([device], dtype)),
        }
        results["wall_seconds"] = log.elapsed
        write_outputs(out, results)  # partial: kept if the profile does not finish

        if args.skip_profile:
            log("profile skipped (--skip-profile)")
        else:
            before = compiles.snapshot()
            measured, predicted = measure_profiles(
                spec,
                part1.sample[0],
                device=device,
                sizes=sizes,
                device_model=args.device_model,
                log=log,
            )
            results["compilation"]["profile"] = compiles.since(before)
            rows = part1.throughput["rows"]
            floor = next(r for r in rows if r["runner"] == "jit per microbatch, accumulate")
            results["profile"] = roofline_check(
                measured,
                predicted,
                plan,
                device_model=args.device_model,
                floor_ms_per_microbatch=floor["ms_per_step"] / sizes.microbatches,
                dtype=dtype,
            )
            measured.save(out / "profile-measured.json")
            predicted.save(out / "profile-predicted.json")

    results["wall_seconds"] = log.elapsed
    results["complete"] = True
    print(write_outputs(out, results))
    log(f"done; wrote {out / 'results.md'} and {out / 'results.json'}")
    return results


if __name__ == "__main__":
    main()
