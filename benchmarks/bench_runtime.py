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
  compute is negligible (``--host-width``): wall time, which includes the driver's waits
  for its devices (a device takes about 32 programs in flight) and for a core, and the
  driver thread's own CPU time (``RunMetrics.host_cpu_seconds``), what the driver costs;
* peak live bytes per device group against the simulator's memory prediction for the same
  plan: measured with the unfused program one operation at a time, after each operation
  (``RunMetrics.peak_bytes``) and while it runs (its results next to the inputs it frees);
  predicted by the simulator's ``planner`` memory model and its ``runtime`` one, with the
  inputs placed up front and zero bubble's cotangents filled in, and by the planner's own
  ``pdjax`` memory terms for a call of the same microbatches (``--memory-only`` runs this
  table alone, for the schedules in ``--memory-schedules``).

    python benchmarks/bench_runtime.py [--width 512] [--layers 8] [--batch 128] [--rounds 5]
    python benchmarks/bench_runtime.py --memory-only --memory-schedules 1f1b,pipedream,2bw
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax

jax.config.update("jax_num_cpu_devices", 4)

import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from pdjax.layers import LayerSequence, sequential  # noqa: E402
from pdjax.partition import Topology, costs_from_plan, evaluate_partition  # noqa: E402
from pdjax.partition.pricing import cost  # noqa: E402
from pdjax.partition.search.evaluate import stage_memory_bytes  # noqa: E402
from pdjax.pipeline import Pipeline, even_stages  # noqa: E402
from pdjax.pipeline.executor.interpreter import live_bytes_per_device  # noqa: E402
from pdjax.profile import profile  # noqa: E402
from pdjax.schedules import ScheduleSpec  # noqa: E402
from pdjax.simulator import simulate  # noqa: E402


class Block(nn.Module):
    width: int

    @nn.compact
    def __call__(self, x):
        return nn.gelu(nn.Dense(self.width)(x))


def xent(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _per_device_bytes(arrays) -> dict:
    """Live bytes per device, each buffer once (the runtime's own count)."""
    return live_bytes_per_device(list(arrays))


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=128, help="samples per optimizer step")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4, help="optimizer steps per timed round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--host-width", type=int, default=16, help="width of the dispatch-bound run")
    ap.add_argument(
        "--memory-only",
        action="store_true",
        help="only the memory table (no timing): measured peak bytes vs the simulator",
    )
    ap.add_argument(
        "--memory-schedules",
        default="1f1b,pipedream",
        help="with --memory-only: the schedules whose memory to measure, comma-separated",
    )
    return ap.parse_args()


def _model_loss(layers: LayerSequence) -> Callable:
    """``(params, x, y) -> loss`` of the whole model on one device."""

    def loss(params, x, y):
        out, _ = layers.apply([{"params": q} for q in params], x)
        return xent(out, y)

    return loss


def _one_jit_runner(layers, variables, optimizer, xs, ys, steps: int) -> Callable[[], None]:
    """The baseline: one jitted train step per batch on one device."""
    dev0 = jax.devices()[0]
    params = jax.device_put([v["params"] for v in variables], dev0)
    opt_state = optimizer.init(params)
    loss = _model_loss(layers)

    @jax.jit
    def single_step(params, opt_state, x, y):
        value, grads = jax.value_and_grad(loss)(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    def run_single():
        nonlocal params, opt_state
        for t in range(steps):
            params, opt_state, _ = single_step(params, opt_state, xs[t], ys[t])
        jax.block_until_ready(params)

    return run_single


def _accumulate_loop_runner(layers, variables, optimizer, xs, ys, args) -> Callable[[], None]:
    """The floor of the flush schedules: per-microbatch gradient steps and one update per
    step, one device (the pipeline's work without a pipeline)."""
    M, mb = args.microbatches, args.batch // args.microbatches
    dev0 = jax.devices()[0]
    loop_params = jax.device_put([v["params"] for v in variables], dev0)
    loop_opt = optimizer.init(loop_params)
    loss = _model_loss(layers)

    @jax.jit
    def grad_step(params, acc, x, y):
        value, grads = jax.value_and_grad(loss)(params, x, y)
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

    return run_loop


def _update_each_runner(layers, variables, optimizer, xs, ys, args) -> Callable[[], None]:
    """PipeDream's floor: an update after every microbatch, one device."""
    M, mb = args.microbatches, args.batch // args.microbatches
    dev0 = jax.devices()[0]
    each_params = jax.device_put([v["params"] for v in variables], dev0)
    each_opt = optimizer.init(each_params)
    loss = _model_loss(layers)

    @jax.jit
    def each_step(params, opt_state, x, y):
        grads = jax.grad(loss)(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def run_each():
        nonlocal each_params, each_opt
        for t in range(args.steps):
            for k in range(M):
                sl = slice(k * mb, (k + 1) * mb)
                each_params, each_opt = each_step(each_params, each_opt, xs[t, sl], ys[t, sl])
        jax.block_until_ready(each_params)

    return run_each


def _pipelines(layers, variables, optimizer, args) -> dict[str, list]:
    """``1f1b`` and ``pipedream`` on 2 and 4 stages: per name, ``[pipeline, state]``."""
    configs = {}
    for P in (2, 4):
        for name in ("1f1b", "pipedream"):
            pipe = Pipeline(
                layers,
                even_stages(args.layers, P),
                xent,
                optimizer,
                schedule=ScheduleSpec(name, microbatches=args.microbatches),
            )
            state = pipe.state_from_variables(variables, jax.random.key(1))
            configs[f"{name} P={P}"] = [pipe, state]
    return configs


def _pipeline_runner(configs, key: str, microbatches, host_per_action) -> Callable[[], None]:
    """One ``Pipeline.run`` over the round's microbatches; keeps its state in ``configs``
    and its host seconds per action in ``host_per_action[key]``."""

    def run_pipeline():
        pipe, state = configs[key]
        state, metrics = pipe.run(state, microbatches)
        jax.block_until_ready(state)
        configs[key][1] = state
        host_per_action[key].append(
            (metrics.host_seconds / metrics.actions, metrics.host_cpu_seconds / metrics.actions)
        )

    return run_pipeline


def _time_rounds(runners: dict[str, Callable[[], None]], rounds: int) -> dict[str, list[float]]:
    """Seconds per round of every runner, rounds interleaved."""
    times: dict[str, list[float]] = {k: [] for k in runners}
    for _ in range(rounds):
        for key, fn in runners.items():  # interleaved: the machine's noise hits all alike
            t0 = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - t0)
    return times


def _print_throughput(times, host_per_action, host_only, args) -> None:
    """The throughput table: ratios against one jit and against each runner's floor."""
    samples = args.steps * args.batch
    base = statistics.median(times["single device, one jit"])
    floors = {
        "flush": statistics.median(times["single device, loop of M jits"]),
        "each": statistics.median(times["single device, loop of M jits, update each"]),
    }
    print(
        f"model: {args.layers} dense layers of width {args.width}; {samples} samples per "
        f"round; median of {args.rounds} interleaved rounds; {jax.device_count()} CPU devices "
        "in one process"
    )
    print()
    print(
        f"| runner | samples/s | vs one jit | vs its loop of M jits | host us / action "
        f"(wall, driver CPU) | host us / action, width {args.host_width} (wall, driver CPU) |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for key, ts in times.items():
        t = statistics.median(ts)
        # the floor with the same work: PipeDream updates after every microbatch
        floor = floors["each" if "pipedream" in key or "update each" in key else "flush"]
        host = _medians(host_per_action[key]) if key in host_per_action else None
        tiny = host_only.get(key)
        print(
            f"| {key} | {samples / t:,.0f} | {base / t:.2f}x | {floor / t:.2f}x | "
            + ("-" if host is None else f"{host[0]:.0f}, {host[1]:.0f}")
            + " | "
            + ("-" if tiny is None else f"{tiny[0]:.0f}, {tiny[1]:.0f}")
            + " |"
        )


def _medians(pairs: list[tuple[float, float]]) -> tuple[float, float]:
    """Median wall and driver-CPU microseconds per action of ``(wall, cpu)`` seconds."""
    return (
        statistics.median(p[0] for p in pairs) * 1e6,
        statistics.median(p[1] for p in pairs) * 1e6,
    )


def main() -> None:
    args = parse_args()
    if args.memory_only:
        _memory_only(args)
        return
    host_only = _host_per_action(args) if args.host_width else {}

    M = args.microbatches
    layers, xs, ys = _model_and_data(args)
    mb = args.batch // M
    optimizer = optax.adam(1e-4)
    variables = jax.jit(layers.init)(jax.random.key(0), jnp.asarray(xs[0, :mb]))
    common = {"layers": layers, "variables": variables, "optimizer": optimizer, "xs": xs, "ys": ys}
    runners = {
        "single device, one jit": _one_jit_runner(steps=args.steps, **common),
        "single device, loop of M jits": _accumulate_loop_runner(args=args, **common),
        "single device, loop of M jits, update each": _update_each_runner(args=args, **common),
    }
    configs = _pipelines(layers, variables, optimizer, args)
    microbatches = [
        (xs[t, k * mb : (k + 1) * mb], ys[t, k * mb : (k + 1) * mb])
        for t in range(args.steps)
        for k in range(M)
    ]
    host_per_action: dict[str, list[float]] = {k: [] for k in configs}
    runners.update(
        {k: _pipeline_runner(configs, k, microbatches, host_per_action) for k in configs}
    )
    for fn in runners.values():  # compile everything first
        fn()
    for key in host_per_action:
        host_per_action[key].clear()
    times = _time_rounds(runners, args.rounds)
    _print_throughput(times, host_per_action, host_only, args)

    # -- memory: measured peak live bytes per device group vs the simulator -------------
    print()
    _memory_table(layers, xs, mb, configs, microbatches)


def _unshared(tree):
    """``tree`` with every array copied into a buffer of its own (PRNG keys as they are)."""

    def one(a):
        if not isinstance(a, jax.Array) or jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            return a
        return jnp.array(a, copy=True)

    return jax.tree.map(one, tree)


def _planner_memory(
    arrays: Any, plan: Any, topology: Any, schedule: str, M: int, calls: int
) -> list[float]:
    """The planner's (``pdjax`` cost model) peak bytes per stage of ``plan`` for a call of
    ``calls`` microbatches under Adam, from the per-layer ``arrays`` it prices."""
    return stage_memory_bytes(
        arrays,
        [
            (s.first_layer, s.last_layer, [topology.position(d) for d in s.devices])
            for s in plan.stages
        ],
        plan.replication,
        topology=topology,
        cost_model="pdjax",
        schedule=schedule,
        num_microbatches=M,
        optimizer_state_factor=2.0,  # Adam
        microbatches_per_call=calls,
    )


def _runtime_costs(costs, plan, prof, microbatch):
    """``costs`` with what the runtime holds besides the planner's terms filled in (the
    simulator's ``runtime`` memory model): the inputs and targets the call places on the
    first and last stage (the bytes of this benchmark's microbatch), and the cotangents
    zero bubble's ``I`` keeps for ``W`` (each layer's output, per replica)."""
    scale = plan.microbatch_size / prof.batch_size
    x_bytes, y_bytes = (sum(a.nbytes for a in jax.tree.leaves(t)) for t in microbatch)
    last = len(costs.stages) - 1
    stages = []
    for s, (st, spec) in enumerate(zip(costs.stages, plan.stages, strict=True)):
        outputs = sum(
            prof.layers[i].output_bytes for i in range(spec.first_layer, spec.last_layer + 1)
        )
        stages.append(
            dataclasses.replace(
                st,
                input_bytes=(x_bytes if s == 0 else 0) + (y_bytes if s == last else 0),
                cotangent_bytes=round(outputs * scale / spec.replicas),
            )
        )
    return dataclasses.replace(costs, stages=tuple(stages), memory_model="runtime")


def _model_and_data(args: argparse.Namespace) -> tuple[LayerSequence, np.ndarray, np.ndarray]:
    """The benchmark's layers and its synthetic batches (one per step)."""
    W, L, B = args.width, args.layers, args.batch
    layers = sequential(*[Block(W) for _ in range(L - 1)], nn.Dense(10))
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((args.steps, B, W)).astype(np.float32)
    ys = rng.integers(0, 10, (args.steps, B)).astype(np.int32)
    return layers, xs, ys


def _memory_only(args: argparse.Namespace) -> None:
    """The memory table alone, for ``--memory-schedules`` at P = 2 and 4 (what the timing
    part runs, without running it)."""
    W, L, B, M = args.width, args.layers, args.batch, args.microbatches
    layers, xs, ys = _model_and_data(args)
    mb = B // M
    variables = jax.jit(layers.init)(jax.random.key(0), jnp.asarray(xs[0, :mb]))
    configs = {}
    for P in (2, 4):
        for name in args.memory_schedules.split(","):
            pipe = Pipeline(
                layers,
                even_stages(L, P),
                xent,
                optax.adam(1e-4),
                schedule=ScheduleSpec(name, microbatches=M),
            )
            configs[f"{name} P={P}"] = [
                pipe,
                pipe.state_from_variables(variables, jax.random.key(1)),
            ]
    microbatches = [
        (xs[t, k * mb : (k + 1) * mb], ys[t, k * mb : (k + 1) * mb])
        for t in range(args.steps)
        for k in range(M)
    ]
    print(
        f"model: {L} dense layers of width {W}; {B} samples per step, M = {M}, "
        f"{args.steps} steps per call"
    )
    _memory_table(layers, xs, mb, configs, microbatches)


def _memory_table(layers, xs, mb: int, configs: dict, microbatches: list) -> None:
    """Measured peak live bytes per device group against the simulator's prediction for the
    same plan and schedule: its ``planner`` memory model (weights x versions, optimizer
    state, stash x in flight) and its ``runtime`` one (also the gradient sum, the call's
    starting weights, the inputs placed up front, zero bubble's cotangents and the
    activations in transit); and the planner's own figure, its ``pdjax`` memory terms
    (:func:`pdjax.partition.search.evaluate.stage_memory_bytes`) for a call of these
    microbatches. Measured with the unfused program of ``timeline=True``, one operation at
    a time: after each operation (what ``RunMetrics.peak_bytes`` records) and while it runs
    (its outputs next to the inputs it frees, which the simulator counts)."""
    print(
        "| runner | group | measured, after each op | measured, during each op | "
        "predicted, planner model | predicted, runtime model | planner's terms | "
        "during / runtime | planner / during |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    prof = profile(layers, jnp.asarray(xs[0, :mb]), measure=True)
    topology = Topology.from_devices(jax.devices())
    for key, (pipe, state) in configs.items():
        # A state whose arrays were device_put onto the device they were on shares their
        # buffers with the source arrays, which their cached shards keep alive: live_arrays()
        # then lists each buffer twice, and donating the optimizer state deletes both (the
        # count drops by the alias, counted in "others"). Measure on buffers of its own.
        state = _unshared(state)
        configs[key][1] = None
        name = pipe.schedule_name
        stages = [(s.first_layer, s.last_layer, 1) for s in pipe.stage_specs]
        M = pipe.microbatches
        plan = evaluate_partition(prof, topology, stages, schedule=name, num_microbatches=M)
        sched = pipe.schedule(len(microbatches))  # the schedule the runtime plays
        planner = costs_from_plan(plan, prof)
        runtime = _runtime_costs(planner, plan, prof, microbatches[0])
        old = simulate(sched, planner, check=False).peak_memory
        new = simulate(sched, runtime, check=False).peak_memory
        arrays = cost.model_arrays(prof, plan.microbatch_size)
        ours = _planner_memory(arrays, plan, topology, name, M, len(microbatches))
        after, during = _measure(pipe, state, microbatches)
        for g in range(len(new)):
            sizes = (after[g], during[g], old[g], new[g], ours[g])
            cells = [f"{b / 2**20:.2f} MiB" for b in sizes]
            ratios = f" | {during[g] / new[g]:.2f} | {ours[g] / during[g]:.2f} |"
            print(f"| {key} | {g} | " + " | ".join(cells) + ratios)


def _measure(pipe, state, microbatches) -> tuple[list[int], list[int]]:
    """Per device group, the most live bytes of this pipeline on one of its devices, after
    each operation and while it runs (its results stored, the inputs it reads for the last
    time not yet dropped). The interpreter of ``Pipeline.run(..., timeline=True)``, with a
    second count before the drops."""
    # the other runners' arrays live on the same devices: count only this pipeline's
    others = _per_device_bytes(jax.live_arrays())
    for device, used in _per_device_bytes(jax.tree.leaves(state)).items():
        others[device] -= used
    prog = pipe.program(len(microbatches), timeline=True)
    code, slots = pipe._bind(prog, state, microbatches[0][0], None)
    reg: list = [None] * len(slots)
    for slot, value in pipe._inputs(state, microbatches).items():
        if slot in slots:
            reg[slots[slot]] = value
    del state  # consumed: its optimizer state is donated; the caller's weights stay alive
    sched = pipe.schedule(len(microbatches))
    group = {d: sched.stage_device[s] for s, st in enumerate(pipe.stages) for d in st.devices}
    after, during = [0] * sched.num_groups, [0] * sched.num_groups

    def track(peaks: list[int]) -> None:
        for device, used in _per_device_bytes(jax.live_arrays()).items():
            if device in group:
                g = group[device]
                peaks[g] = max(peaks[g], used - others.get(device, 0))

    for fn, ins, outs, frees in code:
        res = fn(*[reg[i] for i in ins])
        jax.block_until_ready(res)
        for i, v in zip(outs, res, strict=True):
            reg[i] = v
        del res
        track(during)
        for i in frees:
            reg[i] = None
        track(after)
    return after, during


def _host_per_action(args: argparse.Namespace) -> dict[str, tuple[float, float]]:
    """Median host microseconds per schedule action, wall and driver CPU, on a
    width-``host_width`` model (compute negligible: what is left is the driver, dispatch,
    transfers, and XLA's per-program cost on the devices)."""
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
                layers,
                even_stages(L, P),
                xent,
                optax.adam(1e-4),
                schedule=ScheduleSpec(name, microbatches=M),
            )
            state = pipe.init(jax.random.key(0), xs[0])
            per = []
            for r in range(args.rounds + 2):
                state, metrics = pipe.run(state, stream)
                jax.block_until_ready(state)
                if r >= 2:  # after compiling
                    per.append(
                        (
                            metrics.host_seconds / metrics.actions,
                            metrics.host_cpu_seconds / metrics.actions,
                        )
                    )
            out[f"{name} P={P}"] = _medians(per)
    return out


if __name__ == "__main__":
    main()
