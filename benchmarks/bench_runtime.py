"""The pipeline runtime's machinery cost on in-process CPU devices, side by side.

XLA's CPU devices in one process share one thread pool, so on a 2-core machine a pipeline
cannot beat one device that already uses both cores. What this shows is the cost of the
machinery (per-action dispatch, transfers, weight versions), against the same model on one
device, on the same samples, two ways: one jitted train step over the whole batch, and a
plain loop of jitted per-microbatch gradient steps with one update per step (the same work
as the pipeline without a pipeline: the honest floor of the machinery):

* throughput ratios, rounds interleaved (the machine's noise hits every runner alike);
* host microseconds per schedule action (the driver's loop over the program, divided by
  the actions it carries out), on the compute-bound model and on a width-16 one where
  compute is negligible (``--host-width``);
* peak live bytes per device group (measured after every action) against the
  simulator's memory prediction for the same plan.

    python benchmarks/bench_runtime.py [--width 512] [--layers 8] [--batch 128] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax

jax.config.update("jax_num_cpu_devices", 4)

import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from pdjax.layers import sequential  # noqa: E402
from pdjax.partition import Topology, evaluate_partition  # noqa: E402
from pdjax.pipeline import Pipeline, costs_from_plan, even_stages, generate, simulate  # noqa: E402
from pdjax.profile import profile  # noqa: E402


class Block(nn.Module):
    width: int

    @nn.compact
    def __call__(self, x):
        return nn.gelu(nn.Dense(self.width)(x))


def xent(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _per_device_bytes(arrays) -> dict:
    out: dict = {}
    for a in arrays:
        if isinstance(a, jax.Array) and not a.is_deleted():
            for shard in a.addressable_shards:
                out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=128, help="samples per optimizer step")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4, help="optimizer steps per timed round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--host-width", type=int, default=16, help="width of the dispatch-bound run")
    args = ap.parse_args()
    host_only = _host_per_action(args) if args.host_width else {}

    W, L, B, M = args.width, args.layers, args.batch, args.microbatches
    layers = sequential(*[Block(W) for _ in range(L - 1)], nn.Dense(10))
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((args.steps, B, W)).astype(np.float32)
    ys = rng.integers(0, 10, (args.steps, B)).astype(np.int32)
    mb = B // M
    optimizer = optax.adam(1e-4)
    dev0 = jax.devices()[0]
    variables = jax.jit(layers.init)(jax.random.key(0), jnp.asarray(xs[0, :mb]))

    # -- the baseline: one jitted train step on one device ---------------------------
    params = jax.device_put([v["params"] for v in variables], dev0)
    opt_state = optimizer.init(params)

    @jax.jit
    def single_step(params, opt_state, x, y):
        def loss(p):
            out, _ = layers.apply([{"params": q} for q in p], x)
            return xent(out, y)

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    def run_single():
        nonlocal params, opt_state
        for t in range(args.steps):
            params, opt_state, _ = single_step(params, opt_state, xs[t], ys[t])
        jax.block_until_ready(params)

    # -- the floor: per-microbatch gradient steps and one update per step, one device -----
    loop_params = jax.device_put([v["params"] for v in variables], dev0)
    loop_opt = optimizer.init(loop_params)

    @jax.jit
    def grad_step(params, acc, x, y):
        def loss(p):
            out, _ = layers.apply([{"params": q} for q in p], x)
            return xent(out, y)

        value, grads = jax.value_and_grad(loss)(params)
        return jax.tree.map(jnp.add, acc, grads), value

    @jax.jit
    def apply_step(params, opt_state, acc):
        acc = jax.tree.map(lambda g: g * jnp.float32(1.0 / M), acc)
        updates, opt_state = optimizer.update(acc, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def run_loop():
        nonlocal loop_params, loop_opt
        for t in range(args.steps):
            acc = jax.tree.map(jnp.zeros_like, loop_params)
            for k in range(M):
                sl = slice(k * mb, (k + 1) * mb)
                acc, _ = grad_step(loop_params, acc, xs[t, sl], ys[t, sl])
            loop_params, loop_opt = apply_step(loop_params, loop_opt, acc)
        jax.block_until_ready(loop_params)

    # -- pipelines ------------------------------------------------------------------------
    configs = {}
    for P in (2, 4):
        for name in ("1f1b", "pipedream"):
            pipe = Pipeline(
                layers, even_stages(L, P), xent, optimizer, schedule=name, microbatches=M
            )
            state = pipe.state_from_variables(variables, jax.random.key(1))
            configs[f"{name} P={P}"] = [pipe, state]

    microbatches = [
        (xs[t, k * mb : (k + 1) * mb], ys[t, k * mb : (k + 1) * mb])
        for t in range(args.steps)
        for k in range(M)
    ]
    host_per_action: dict[str, list[float]] = {k: [] for k in configs}

    def run_pipeline(key):
        pipe, state = configs[key]
        state, metrics = pipe.run(state, microbatches)
        jax.block_until_ready(state)
        configs[key][1] = state
        host_per_action[key].append(metrics.host_seconds / metrics.actions)

    each_params = jax.device_put([v["params"] for v in variables], dev0)
    each_opt = optimizer.init(each_params)

    @jax.jit
    def each_step(params, opt_state, x, y):
        def loss(p):
            out, _ = layers.apply([{"params": q} for q in p], x)
            return xent(out, y)

        grads = jax.grad(loss)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def run_each():  # PipeDream's work: an update after every microbatch
        nonlocal each_params, each_opt
        for t in range(args.steps):
            for k in range(M):
                sl = slice(k * mb, (k + 1) * mb)
                each_params, each_opt = each_step(each_params, each_opt, xs[t, sl], ys[t, sl])
        jax.block_until_ready(each_params)

    runners = {
        "single device, one jit": run_single,
        "single device, loop of M jits": run_loop,
        "single device, loop of M jits, update each": run_each,
    }
    runners.update({k: (lambda k=k: run_pipeline(k)) for k in configs})
    for fn in runners.values():  # compile everything first
        fn()
    for key in host_per_action:
        host_per_action[key].clear()
    times: dict[str, list[float]] = {k: [] for k in runners}
    for _ in range(args.rounds):
        for key, fn in runners.items():  # interleaved: the machine's noise hits all alike
            t0 = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - t0)

    samples = args.steps * B
    base = statistics.median(times["single device, one jit"])
    floors = {
        "flush": statistics.median(times["single device, loop of M jits"]),
        "each": statistics.median(times["single device, loop of M jits, update each"]),
    }
    print(
        f"model: {L} dense layers of width {W}; {samples} samples per round; median of "
        f"{args.rounds} interleaved rounds; {jax.device_count()} CPU devices in one process"
    )
    print()
    print(
        f"| runner | samples/s | vs one jit | vs its loop of M jits | host us / action | "
        f"host us / action, width {args.host_width} |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for key, ts in times.items():
        t = statistics.median(ts)
        # the floor with the same work: PipeDream updates after every microbatch
        floor = floors["each" if "pipedream" in key or "update each" in key else "flush"]
        host = statistics.median(host_per_action[key]) * 1e6 if key in host_per_action else None
        tiny = host_only.get(key)
        print(
            f"| {key} | {samples / t:,.0f} | {base / t:.2f}x | {floor / t:.2f}x | "
            + ("-" if host is None else f"{host:.0f}")
            + " | "
            + ("-" if tiny is None else f"{tiny:.0f}")
            + " |"
        )

    # -- memory: measured peak live bytes per device group vs the simulator -------------
    print()
    print("| runner | group | measured peak | predicted peak | measured / predicted |")
    print("|---|---:|---:|---:|---:|")
    prof = profile(layers, jnp.asarray(xs[0, :mb]), measure=True)
    topology = Topology.from_devices(jax.devices())
    for key, (pipe, state) in configs.items():
        name = pipe.schedule_name
        stages = [(s.first_layer, s.last_layer, 1) for s in pipe.stage_specs]
        plan = evaluate_partition(prof, topology, stages, schedule=name, num_microbatches=M)
        n = len(microbatches)
        sched = generate(name, pipe.num_stages, M if name != "pipedream" else n, steps=n // M)
        sim = simulate(sched, costs_from_plan(plan, prof), check=False)
        # the other runners' arrays live on the same devices: count only this pipeline's
        others = _per_device_bytes(jax.live_arrays())
        for device, used in _per_device_bytes(jax.tree.leaves(state)).items():
            others[device] -= used
        _, metrics = pipe.run(state, microbatches, timeline=True)
        peaks = [
            peak - others.get(pipe.stages[g].devices[0], 0)
            for g, peak in enumerate(metrics.peak_bytes)
        ]
        for g, (got, want) in enumerate(zip(peaks, sim.peak_memory, strict=True)):
            print(
                f"| {key} | {g} | {got / 2**20:.2f} MiB | {want / 2**20:.2f} MiB | "
                f"{got / want:.2f} |"
            )


def _host_per_action(args: argparse.Namespace) -> dict[str, float]:
    """Median host microseconds per schedule action on a width-``host_width`` model (compute
    negligible: what is left is the driver, dispatch and transfers)."""
    W, L, M = args.host_width, args.layers, args.microbatches
    layers = sequential(*[Block(W) for _ in range(L - 1)], nn.Dense(10))
    rng = np.random.default_rng(1)
    mb = args.batch // M
    n = args.steps * M
    xs = rng.standard_normal((n, mb, W)).astype(np.float32)
    ys = rng.integers(0, 10, (n, mb)).astype(np.int32)
    stream = [(xs[k], ys[k]) for k in range(n)]
    out = {}
    for P in (2, 4):
        for name in ("1f1b", "pipedream"):
            pipe = Pipeline(
                layers, even_stages(L, P), xent, optax.adam(1e-4), schedule=name, microbatches=M
            )
            state = pipe.init(jax.random.key(0), xs[0])
            per = []
            for r in range(args.rounds + 2):
                state, metrics = pipe.run(state, stream)
                jax.block_until_ready(state)
                if r >= 2:  # after compiling
                    per.append(metrics.host_seconds / metrics.actions * 1e6)
            out[f"{name} P={P}"] = statistics.median(per)
    return out


if __name__ == "__main__":
    main()
