"""What `split_model` costs: the time to split a whole model, to build and compile its
pipeline, and a steady step, beside one `jax.jit` train step of the same model, side by
side in one run, as the number of blocks (and so of cuts) grows.

Each split layer traces the whole model once per input shape and mode and keeps its own
segment, so splitting and compiling should grow with the cuts; this measures by how much.

    python benchmarks/bench_split.py                 # blocks 2, 4, 8 (a few minutes)
    python benchmarks/bench_split.py --blocks 2      # one size
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", 3)  # before any device is used (the example's too)

import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import split_transformer as lm  # noqa: E402

import pdjax  # noqa: E402
from pdjax.schedules import ScheduleSpec  # noqa: E402


def _seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(blocks: int, steps: int) -> dict[str, float]:
    config = lm.TransformerConfig(num_layers=blocks, deterministic=True)
    model = lm.TransformerLM(config)
    batch = lm.batches(1, 32, config.vocab_size, 8, 0)[0]
    x, y = jnp.asarray(batch[0]), jnp.asarray(batch[1])
    opt = optax.sgd(0.1)

    # one jit of the whole train step
    t0 = time.perf_counter()
    variables = model.init(jax.random.key(0), x[:8])
    opt_state = opt.init(variables)

    @jax.jit
    def jit_step(v, s):
        loss, g = jax.value_and_grad(lambda v: lm.loss_fn(model.apply(v, x), y)[0])(v)
        u, s = opt.update(g, s, v)
        return optax.apply_updates(v, u), s, loss

    variables, opt_state, _ = jit_step(variables, opt_state)
    jax.block_until_ready(variables)
    jit_first = time.perf_counter() - t0

    def jit_once():
        nonlocal variables, opt_state
        variables, opt_state, loss = jit_step(variables, opt_state)
        return loss

    jit_steady = _seconds(jit_once, steps)

    # the same model split at its blocks, 1f1b over 3 devices
    t0 = time.perf_counter()
    layers = pdjax.split_model(model, x[:8])
    split_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    stages = min(3, len(layers))
    pipe = pdjax.Pipeline(
        layers,
        pdjax.even_stages(len(layers), stages),
        lm.loss_fn,
        opt,
        schedule=ScheduleSpec("1f1b", microbatches=4),
    )
    state = pipe.init(jax.random.key(0), x[:8])
    state, metrics = pipe.step(state, (x, y))
    jax.block_until_ready(metrics.losses)
    pipe_first = time.perf_counter() - t0

    def pipe_once():
        nonlocal state
        state, m = pipe.step(state, (x, y))
        return m.losses

    pipe_steady = _seconds(pipe_once, steps)
    return {
        "blocks": blocks,
        "layers": len(layers),
        "split_s": split_s,
        "pipe_first_s": pipe_first,
        "jit_first_s": jit_first,
        "pipe_steady_ms": 1e3 * pipe_steady,
        "jit_steady_ms": 1e3 * jit_steady,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", default="2,4,8", help="comma-separated block counts")
    parser.add_argument("--steps", type=int, default=10, help="steady steps timed (median)")
    args = parser.parse_args()
    print(
        "| blocks | layers | split_model s | pipeline init + first step s | jit first step s "
        "| ratio | steady step ms: pipeline / jit |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    measure(1, 1)  # warm-up: the process's first compiles (XLA, the runtime) counted nowhere
    for blocks in (int(b) for b in args.blocks.split(",")):
        r = measure(blocks, args.steps)
        first = r["split_s"] + r["pipe_first_s"]
        print(
            f"| {r['blocks']} | {r['layers']} | {r['split_s']:.2f} | {r['pipe_first_s']:.2f} "
            f"| {r['jit_first_s']:.2f} | {first / r['jit_first_s']:.1f}x "
            f"| {r['pipe_steady_ms']:.1f} / {r['jit_steady_ms']:.1f} |"
        )


if __name__ == "__main__":
    main()
