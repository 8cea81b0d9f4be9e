"""Pipeline.init's compile time, side by side: one program per stage (the runtime before
pdjax.layers.init_programs) against programs shared by identical layers, on 4 in-process
CPU devices, rounds interleaved.

* ``per stage``: every stage's layers initialised by one program of their own (what
  ``init_programs`` still does for layers it cannot share);
* ``shared, first``: a pipeline's first ``init`` in a fresh process: one program per
  distinct layer, run on the first stage's first device, the values then moved;
* ``shared, next``: ``init`` of a second pipeline of an equal model built anew (new module
  objects), as ``pdjax train --compare``, ``pdjax bench`` or a planner measuring
  candidates build them: nothing left to compile.

Wall seconds of ``init`` to the last array ready (compiling is most of it); medians over
the rounds, and each one's ratio to ``per stage``.

    python benchmarks/bench_init.py [--rounds 3] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

jax.config.update("jax_num_cpu_devices", 4)

import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import pdjax  # noqa: E402
from pdjax.layers import init_programs  # noqa: E402
from pdjax.models import get_model  # noqa: E402
from pdjax.pipeline import Pipeline, even_stages  # noqa: E402
from pdjax.schedules import ScheduleSpec  # noqa: E402


class Block(nn.Module):
    width: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return x + nn.Dense(self.width)(jax.nn.gelu(nn.LayerNorm()(x)))


def _blocks() -> tuple[Any, Any, Callable[..., Any]]:
    """16 identical residual blocks and a head: the shape of most deep models."""
    layers = pdjax.sequential(*[Block(64) for _ in range(16)], nn.Dense(10))
    return layers, jnp.ones((8, 64)), lambda y, t: jnp.mean((y - t) ** 2)


def _gpt() -> tuple[Any, Any, Callable[..., Any]]:
    spec = get_model("gpt", "tiny")
    return spec.layers, spec.sample_input(8, jax.random.key(0)), spec.loss


MODELS = {"16 blocks": _blocks, "gpt tiny": _gpt}


def _init_seconds(model: Callable[[], tuple[Any, Any, Callable[..., Any]]]) -> float:
    layers, x, loss = model()
    pipe = Pipeline(
        layers,
        even_stages(len(layers), 4),
        loss,
        optax.sgd(0.1),
        schedule=ScheduleSpec("1f1b", microbatches=2),
    )
    t0 = time.perf_counter()
    jax.block_until_ready(pipe.init(jax.random.key(0), x))
    return time.perf_counter() - t0


def _round(model: Callable[[], tuple[Any, Any, Callable[..., Any]]]) -> dict[str, float]:
    share_key = init_programs._share_key
    init_programs._share_key = lambda layer: None  # every layer unshared: a run per stage
    try:
        per_stage = _init_seconds(model)
    finally:
        init_programs._share_key = share_key
    init_programs._shared.clear()  # nothing compiled yet
    first = _init_seconds(model)
    return {"per stage": per_stage, "shared, first": first, "shared, next": _init_seconds(model)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    times: dict[str, dict[str, list[float]]] = {m: collections.defaultdict(list) for m in MODELS}
    for _ in range(args.rounds):
        for name, model in MODELS.items():
            for way, seconds in _round(model).items():
                times[name][way].append(seconds)
    rows = []
    print(f"{'model':10} {'way':14} {'init s':>7} {'/ per stage':>11}")
    for name, ways in times.items():
        base = statistics.median(ways["per stage"])
        for way, values in ways.items():
            med = statistics.median(values)
            rows.append({"model": name, "way": way, "seconds": med, "ratio": med / base})
            print(f"{name:10} {way:14} {med:7.3f} {med / base:11.2f}")
    if args.out:
        args.out.write_text(json.dumps({"rounds": args.rounds, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
