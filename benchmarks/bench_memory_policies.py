"""Per-stage memory policies on Llama ``small``: measured peak memory per stage against the
planner's and the simulator's predictions.

For each memory policy (``none``, ``dots``, ``dots-no-batch``, ``offload``, ``full``) and
schedule (``1f1b``, ``gpipe``), the same 2-stage pipeline of Llama ``small``
(:meth:`pdjax.models.llama.LlamaConfig.small`, a shorter sequence on request) runs one call
one operation at a time, and the most live device bytes per stage are recorded while each
operation runs (``benchmarks/bench_runtime.py``'s ``_measure``: its outputs next to the
inputs it frees; arrays in the host's pinned memory, where ``offload`` keeps its
residuals, are counted apart: the most host bytes at once, both stages together). Beside
it:

* the planner's prediction: its ``pdjax`` memory terms
  (:func:`pdjax.partition.search.evaluate.stage_memory_bytes`) for a call of the same
  microbatches, the stash under the policy
  (:func:`pdjax.partition.choosing.candidates.policy_arrays`);
* the simulator's: its ``runtime`` memory model over the schedule the runtime plays, the
  costs under the policy (:func:`pdjax.partition.choosing.candidates.costs_under`), with the inputs
  placed up front (``bench_runtime._runtime_costs``).

The profile prices each policy (``profile(..., memory_policies=True)``: residual bytes per
layer by abstract traces) and counts the loss's residuals on the last layer
(``loss_fn=``: the softmax of the logits, which the last stage keeps per microbatch in
flight under every policy but ``full``; ``--no-loss`` leaves them out, as profiles made
without the loss do). The goal: both predictions within 10% of the measurement.

    python benchmarks/bench_memory_policies.py [--seq-len 128] [--microbatch 4] [--M 4]
        [--schedules 1f1b,gpipe] [--policies none,dots,...] [--no-loss]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_runtime as br
import jax
import optax

from pdjax._memory_policy import MEMORY_POLICIES, check_available
from pdjax.errors import PdjaxError
from pdjax.models.llama import LlamaConfig, make_spec
from pdjax.partition import Topology, costs_from_plan, evaluate_partition
from pdjax.partition.choosing.candidates import costs_under, policy_arrays
from pdjax.partition.pricing import cost
from pdjax.pipeline import Pipeline, even_stages
from pdjax.profile import profile
from pdjax.schedules import ScheduleSpec
from pdjax.simulator import simulate

_BYTES = br._per_device_bytes
_HOST_PEAK = [0]  # the most bytes seen in the host's pinned memory since the last reset


def _device_bytes(arrays) -> dict:
    """``bench_runtime._per_device_bytes`` over the arrays in device memory only; the
    bytes in pinned host memory (offloaded residuals) go to :data:`_HOST_PEAK`."""
    arrays = [a for a in arrays if not (isinstance(a, jax.Array) and a.is_deleted())]
    host = [
        a for a in arrays if isinstance(a, jax.Array) and a.sharding.memory_kind == "pinned_host"
    ]
    _HOST_PEAK[0] = max(_HOST_PEAK[0], sum(a.nbytes for a in host))
    return _BYTES(a for a in arrays if not any(a is h for h in host))


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--microbatch", type=int, default=4, help="samples per microbatch")
    ap.add_argument("--M", type=int, default=4, help="microbatches per step")
    ap.add_argument("--steps", type=int, default=1, help="steps in the measured call")
    ap.add_argument("--schedules", default="1f1b,gpipe")
    ap.add_argument("--policies", default=",".join(MEMORY_POLICIES))
    ap.add_argument("--no-loss", action="store_true", help="profile without the loss's residuals")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    config = dataclasses.replace(LlamaConfig.small(), seq_len=args.seq_len)
    spec = make_spec(config, "small")
    L, P, M, mb = len(spec.layers), 2, args.M, args.microbatch
    n = M * args.steps
    key = jax.random.key(0)
    x, y = spec.sample_input(n * mb, key), spec.sample_target(n * mb, key)
    microbatches = [jax.tree.map(lambda a, k=k: a[k * mb : (k + 1) * mb], (x, y)) for k in range(n)]
    t0 = time.perf_counter()
    prof = profile(
        spec.layers,
        microbatches[0][0],
        device_model="h100",
        memory_policies=True,
        loss_fn=None if args.no_loss else spec.loss,
        targets=microbatches[0][1],
    )
    print(
        f"Llama small (d={config.d_model}, {config.num_layers} blocks, seq {args.seq_len}), "
        f"{L} layers on {P} stages, microbatches of {mb}, M = {M}, {n} microbatches per call; "
        f"profiled in {time.perf_counter() - t0:.1f} s; jax {jax.__version__} on "
        f"{jax.devices()[0].platform}"
    )
    print()
    print(
        "| schedule | policy | stage | measured (device) | host | planner | simulator | "
        "planner / measured | simulator / measured |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    topology = Topology.from_devices(jax.devices())
    variables = None
    br._per_device_bytes = _device_bytes  # _measure counts device memory only
    for name in args.schedules.split(","):
        for policy in args.policies.split(","):
            try:
                check_available(policy, jax.devices()[:P])
            except PdjaxError as err:
                print(f"| {name} | {policy} | - | refused: {err} |")
                continue
            pipe = Pipeline(
                spec.layers,
                even_stages(L, P),
                spec.loss,
                optax.adam(1e-4),
                schedule=ScheduleSpec(name, microbatches=M, remat=policy),
            )
            if variables is None:
                variables = pipe.variables(pipe.init(jax.random.key(1), microbatches[0][0]))
            state = br._unshared(pipe.state_from_variables(variables, jax.random.key(1)))
            stages = [(s.first_layer, s.last_layer, 1) for s in pipe.stage_specs]
            plan = evaluate_partition(prof, topology, stages, schedule=name, num_microbatches=M)
            policies = (policy,) * P
            sched = pipe.schedule(n)
            costs = costs_under(costs_from_plan(plan, prof), plan, prof, policies, name)
            runtime = br._runtime_costs(costs, plan, prof, microbatches[0])
            simulated = simulate(sched, runtime, check=False).peak_memory
            arrays = cost.model_arrays(prof, plan.microbatch_size)
            planner = br._planner_memory(
                policy_arrays(arrays, plan, prof, policies), plan, topology, name, M, n
            )
            _HOST_PEAK[0] = 0
            _, during = br._measure(pipe, state, microbatches)
            host = _HOST_PEAK[0]  # both stages' together
            for g in range(P):
                m = during[g]
                print(
                    f"| {name} | {policy} | {g} | {m / 2**20:.2f} MiB | "
                    f"{max(host, 0) / 2**20:.2f} MiB | {planner[g] / 2**20:.2f} MiB | "
                    f"{simulated[g] / 2**20:.2f} MiB | {planner[g] / m:.2f} | "
                    f"{simulated[g] / m:.2f} |"
                )
            del pipe, state
    br._per_device_bytes = _BYTES


if __name__ == "__main__":
    main()
