"""Greedy generation through a pipeline's stages on in-process CPU devices: with the
key/value cache against rerunning the window per token, side by side.

One pipeline (Llama ``small``'s shapes, its context raised to ``--context``, no dropout,
random weights; ``--stages`` stages of one CPU device each) continues the same ``--batch``
prompts of ``--prompt`` tokens by ``--new`` tokens three ways:

* **uncached**: ``Pipeline.generate(..., cache=False)``, every new token reruns the whole
  window (prompt and tokens so far, padded to one width) through every stage;
* **cached**: ``cache=True``, the prompts through the stages once, then one position per
  token, each stage updating its own layers' key/value caches in place;
* **cached, M microbatches**: the same with the prompts cut into ``--microbatches`` row
  blocks, dispatched as a wavefront (stage ``s`` on block ``k``, stage ``s + 1`` on
  ``k - 1``) to show whether the stages overlap.

Each way runs once to compile, then ``--rounds`` times, the ways interleaved per round
(the machine's noise hits them alike); the table gives the median seconds per call and
new tokens per second (``batch x new / seconds``), and the speed-up over uncached. The
cached tokens are checked equal to the uncached ones. Writes the table to ``--out``
(default ``benchmarks/results/generate.md``).

    python benchmarks/bench_generate.py [--stages 2] [--batch 4] [--prompt 128] [--new 128]
        [--context 256] [--microbatches 4] [--rounds 3] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
import time
from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
import optax  # noqa: E402

from pdjax.models.llama import LlamaConfig, make_spec  # noqa: E402
from pdjax.pipeline import Pipeline, even_stages  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "generate.md"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, default=2, help="pipeline stages, one CPU device each")
    ap.add_argument("--batch", type=int, default=4, help="prompts per call")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    ap.add_argument("--new", type=int, default=128, help="new tokens per prompt")
    ap.add_argument("--context", type=int, default=256, help="the model's context")
    ap.add_argument("--microbatches", type=int, default=4, help="M of the third way")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=RESULTS, help="where to write the table")
    args = ap.parse_args()

    config = dataclasses.replace(
        LlamaConfig.small(), context=args.context, seq_len=args.context, dropout=0.0
    )
    spec = make_spec(config, "small, context raised")
    layers = len(spec.layers)
    pipe = Pipeline(spec.layers, even_stages(layers, args.stages), spec.loss, optax.sgd(0.1))
    state = pipe.init(jax.random.key(0), spec.sample_input(2, jax.random.key(1)))
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, config.vocab_size, (args.batch, args.prompt)).astype(np.int32)
    ways = {
        "uncached": {"cache": False},
        "cached": {"cache": True},
        f"cached, {args.microbatches} microbatches": {
            "cache": True,
            "microbatches": args.microbatches,
        },
    }
    tokens = {}
    for name, kw in ways.items():  # compile
        tokens[name] = pipe.generate(state, prompts, args.new, **kw)
    for name, got in tokens.items():
        if not np.array_equal(got, tokens["uncached"]):
            raise SystemExit(f"{name}: tokens differ from the uncached path's")
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.rounds):
        for name, kw in ways.items():
            t = time.perf_counter()
            pipe.generate(state, prompts, args.new, **kw)
            seconds[name].append(time.perf_counter() - t)

    made = args.batch * args.new
    base = statistics.median(seconds["uncached"])
    head = (
        f"Llama small's shapes ({config.num_params():,} parameters, context "
        f"{config.context}, vocabulary {config.vocab_size}), {args.stages} stages on "
        f"{args.stages} in-process CPU devices, batch {args.batch}, prompt {args.prompt} + "
        f"{args.new} new tokens, {args.rounds} rounds; {platform.machine()}, "
        f"{os.cpu_count()} cores"
    )
    lines = [
        "| way | seconds per call (median) | new tokens/s | speed-up over uncached |",
        "|---|---:|---:|---:|",
    ]
    for name in ways:
        med = statistics.median(seconds[name])
        rounds = ", ".join(f"{s:.3f}" for s in seconds[name])
        lines.append(f"| {name} | {med:.3f} ({rounds}) | {made / med:,.0f} | {base / med:.1f}x |")
    several = statistics.median(seconds[f"cached, {args.microbatches} microbatches"])
    one = statistics.median(seconds["cached"])
    lines.append(
        f"\n{args.microbatches} microbatches against one, cached: {one / several:.2f}x the "
        "tokens/s (above 1: the stages overlapped by more than the extra dispatches cost)"
    )
    table = "\n".join(lines)
    print(head)
    print(table)
    command = (
        f"python benchmarks/bench_generate.py --stages {args.stages} --batch {args.batch} "
        f"--prompt {args.prompt} --new {args.new} --context {args.context} "
        f"--microbatches {args.microbatches} --rounds {args.rounds}"
    )
    args.out.write_text(
        "# Greedy generation: key/value cache against rerunning the window\n\n"
        f"Made by `{command}`. {head}. The cached tokens equal the uncached ones (checked "
        "by the benchmark). Seconds per round in parentheses: on a machine shared with other "
        "jobs the rounds are noisy.\n\n"
        f"{table}\n"
    )


if __name__ == "__main__":
    main()
