"""Does XLA's CPU client run a program on the thread that dispatches it?

    python benchmarks/bench_dispatch.py               # this process's CPU devices
    python benchmarks/bench_dispatch.py --one-core    # as a cluster worker: one pinned
                                                      # core, XLA's intra-op threads off

For jitted programs from a few microseconds to tens of milliseconds of work it prints, side
by side: the time the dispatching call takes to return, the time until the result is
ready, and their ratio (near 1: the program ran on the calling thread; near 0: it runs
asynchronously while the driver goes on). Then how many programs one device takes in flight
before a dispatch blocks: the driver of a pipeline can run ahead of its devices by that
many programs, no further.

No pdjax code is timed: this measures what pdjax's runtime stands on (see
``pdjax/_xla_cpu.py``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def _args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument(
        "--one-core", action="store_true", help="pin to core 0, no intra-op threads"
    )
    parser.add_argument("--repeats", type=int, default=15, help="timed calls per program")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    if args.one_core:  # before jax starts its client
        flags = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()
        os.sched_setaffinity(0, {0})
    import jax
    import jax.numpy as jnp

    threads = "one pinned core, no intra-op threads" if args.one_core else "default threads"
    devices = f"{jax.device_count()} {jax.devices()[0].platform} devices"
    print(f"jax {jax.__version__}, {devices}, {threads}")
    print()
    print("| program | dispatch returns, us | result ready, us | returns / ready |")
    print("|---|---:|---:|---:|")
    for width in (16, 128, 512, 1024, 2048):
        x = jnp.ones((128, width), jnp.float32)
        w = jnp.ones((width, width), jnp.float32) / width
        step = jax.jit(lambda x, w: jnp.tanh(jnp.tanh(x @ w) @ w))
        step(x, w).block_until_ready()  # compile
        back, ready = [], []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            out = step(x, w)
            t1 = time.perf_counter()
            out.block_until_ready()
            t2 = time.perf_counter()
            back.append(t1 - t0)
            ready.append(t2 - t0)
        b, r = statistics.median(back), statistics.median(ready)
        row = f"| two {width}-wide layers, 128 rows | {b * 1e6:.0f} | {r * 1e6:.0f} |"
        print(f"{row} {b / r:.2f} |")
    x = jnp.ones((256, 1024), jnp.float32)
    w = jnp.ones((1024, 1024), jnp.float32) / 1024
    step = jax.jit(lambda x, w: jnp.tanh(x @ w))
    step(x, w).block_until_ready()
    run = []
    t_all = time.perf_counter()
    for _ in range(64):
        t0 = time.perf_counter()
        run.append(step(x, w))
        run_t = time.perf_counter() - t0
        if run_t > 1e-3:
            break
    blocked_at = len(run)
    jax.block_until_ready(run)
    per = (time.perf_counter() - t_all) / len(run)
    print()
    if blocked_at < 64:
        print(f"A device takes {blocked_at - 1} programs in flight: dispatch number "
              f"{blocked_at} waited (programs of {per * 1e3:.1f} ms each).")  # fmt: skip
    else:
        print(f"64 programs of {per * 1e3:.1f} ms dispatched without waiting.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
