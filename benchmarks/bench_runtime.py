"""The pipeline runtime's machinery cost on in-process CPU devices, side by side.

XLA's CPU devices in one process share one thread pool, so on a 2-core machine a pipeline
cannot beat one device that already uses both cores. What this shows is the cost of the
machinery (per-action dispatch, transfers, weight versions), against the same model as
one jitted train step on one device, on the same samples:

* throughput ratio (pipeline samples/s over single-device samples/s), rounds interleaved;
* host seconds per dispatched action;
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
    args = ap.parse_args()

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

    runners = {"single device, one jit": run_single}
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
    print(
        f"model: {L} dense layers of width {W}; {samples} samples per round; median of "
        f"{args.rounds} interleaved rounds; {jax.device_count()} CPU devices in one process"
    )
    print()
    print("| runner | samples/s | vs one jit | host us / action |")
    print("|---|---:|---:|---:|")
    for key, ts in times.items():
        t = statistics.median(ts)
        host = statistics.median(host_per_action[key]) * 1e6 if key in host_per_action else None
        print(
            f"| {key} | {samples / t:,.0f} | {base / t:.2f}x | "
            + ("-" if host is None else f"{host:.0f}")
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


if __name__ == "__main__":
    main()
