"""Sharded stages on 8 in-process CPU devices: Llama small, side by side in one run.

Six runners train the same model on the same batches (rounds interleaved, so the
machine's noise falls on every runner alike):

* ``pipe 2 x (fsdp 2 x tensor 2)``: two pipeline stages, each sharded over 4 devices;
* ``pipe 4 x (tensor 2)``: four stages, each tensor-parallel over 2 devices;
* ``pipe 2 x (data 4)``, ``pipe 4 x (data 2)``: the same stages replicated, as before
  meshes;
* ``dp fsdp 8``: data parallelism with every parameter split 8 ways (ZeRO-3 by the
  model's annotations);
* ``dp data 8``: plain data parallelism, weights replicated.

Pipelines run ``1f1b`` with ``M`` microbatches per step; a data-parallel step is one
update on the whole batch. Reported: samples/s (median over rounds) and its ratio to
``dp data 8``, and the bytes of weights and Adam state one device of the first stage (or
of the mesh) holds, measured from live buffers, against the replicated layout.

    python benchmarks/bench_sharded.py [--rounds 5] [--steps 3] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Any

import jax

jax.config.update("jax_num_cpu_devices", 8)

import optax  # noqa: E402

from pdjax.models import get_model  # noqa: E402
from pdjax.pipeline import Pipeline, even_stages  # noqa: E402
from pdjax.runners import DataParallel  # noqa: E402
from pdjax.schedules import ScheduleSpec  # noqa: E402


def _pipeline(spec: Any, stages: int, mesh: dict[str, int] | None, M: int) -> Pipeline:
    width = 8 // stages
    plan = tuple(
        dataclasses.replace(st, mesh=mesh)
        for st in even_stages(len(spec.layers), stages, replicas=width)
    )
    return Pipeline(
        spec.layers,
        plan,
        spec.loss,
        optax.adamw(1e-3),
        schedule=ScheduleSpec("1f1b", microbatches=M),
    )


def _held(state: Any, device: jax.Device) -> int:
    """Bytes of weights and optimizer state ``device`` holds."""
    trees = (
        (state.params[0], state.opt_state[0])
        if hasattr(state, "updates")
        else (state.params, state.opt_state)
    )
    return sum(
        sh.data.nbytes
        for a in jax.tree.leaves(trees)
        for sh in a.addressable_shards
        if sh.device == device
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps per runner and round")
    ap.add_argument("--batch", type=int, default=32, help="sequences per step")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    spec = get_model("llama", "small")
    M, B = args.microbatches, args.batch
    x, y = spec.sample_batch(B, jax.random.key(0))
    mbs = [jax.tree.map(lambda a, k=k: a[k * B // M : (k + 1) * B // M], (x, y)) for k in range(M)]
    runners: dict[str, Any] = {
        "pipe 2 x (fsdp 2 x tensor 2)": _pipeline(spec, 2, {"fsdp": 2, "tensor": 2}, M),
        "pipe 4 x (tensor 2)": _pipeline(spec, 4, {"tensor": 2}, M),
        "pipe 2 x (data 4)": _pipeline(spec, 2, None, M),
        "pipe 4 x (data 2)": _pipeline(spec, 4, None, M),
        "dp fsdp 8": DataParallel(spec.layers, spec.loss, optax.adamw(1e-3), mesh={"fsdp": 8}),
        "dp data 8": DataParallel(spec.layers, spec.loss, optax.adamw(1e-3)),
    }
    states: dict[str, Any] = {}
    held: dict[str, int] = {}

    def step(name: str) -> None:
        runner, state = runners[name], states[name]
        if isinstance(runner, Pipeline):
            state, metrics = runner.run(state, mbs)
        else:
            state, metrics = runner.step(state, (x, y))
        jax.block_until_ready(metrics.losses)
        states[name] = state

    for name, runner in runners.items():
        states[name] = runner.init(
            jax.random.key(1), mbs[0][0] if isinstance(runner, Pipeline) else x
        )
        device = runner.stages[0].devices[0] if isinstance(runner, Pipeline) else runner.devices[0]
        held[name] = _held(states[name], device)
        step(name)  # compiles
    rates: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(args.rounds):
        for name in runners:
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step(name)
            rates[name].append(args.steps * B / (time.perf_counter() - t0))
    base = statistics.median(rates["dp data 8"])
    rows = []
    for name in runners:
        rate = statistics.median(rates[name])
        replicated = {"pipe 2": held["pipe 2 x (data 4)"], "pipe 4": held["pipe 4 x (data 2)"]}.get(
            name[:6], held["dp data 8"]
        )
        rows.append(
            {
                "runner": name,
                "samples_per_s": rate,
                "vs_dp_data_8": rate / base,
                "bytes_per_device": held[name],
                "vs_replicated": held[name] / replicated if replicated else None,
            }
        )
    print(f"Llama small, batch {B}, M={M} (pipelines), {args.rounds} rounds x {args.steps} steps")
    print(f"{'runner':32} {'samples/s':>10} {'vs dp data 8':>13} {'MB/device':>10} {'vs repl.':>9}")
    for r in rows:
        ratio = "-" if r["vs_replicated"] is None else f"{r['vs_replicated']:.3f}"
        print(
            f"{r['runner']:32} {r['samples_per_s']:10.1f} {r['vs_dp_data_8']:13.2f} "
            f"{r['bytes_per_device'] / 1e6:10.2f} {ratio:>9}"
        )
    if args.out is not None:
        args.out.write_text(json.dumps({"rows": rows, "rates": rates}, indent=1) + "\n")


if __name__ == "__main__":
    main()
