"""From a Plan and its Profile to the simulator's :class:`PipelineCosts`.

:func:`costs_from_plan` is the seam between the planner and the simulator: it prices each
stage of a :class:`~pdjax.partition.Plan` the way the planner's ``pdjax`` cost model does
(:mod:`pdjax.partition.pricing.cost`), so that
``simulate(schedule, costs_from_plan(plan, profile))``
plays the plan's stages on the plan's links.

The mapping, for a stage holding layers ``i..j`` on ``r`` devices, a microbatch of ``b``
samples and a profile of batch ``B`` (``scale = b / B``):

=====================  =====================================================================
``forward``            ``sum_l forward_seconds[l] * scale / r``
``input_grad``         ``sum_l backward_seconds[l] * (1 - w_l) * scale / r``
``weight_grad``        ``sum_l backward_seconds[l] * w_l * scale / r``
``update``             0 (profiles do not time the optimizer; the all-reduce is the
                       simulator's, from ``param_bytes`` and ``allreduce_bandwidth``)
``activation_bytes``   bytes crossing the cut after layer ``j``, ``cut[j] * scale``
``param_bytes``        ``sum_l param_bytes[l]`` (a whole copy on every replica)
``stash_bytes``        ``sum_l stash_bytes[l] * scale / r`` (each replica keeps its share)
``optimizer_bytes``    ``param_bytes * optimizer_state_factor`` (``plan.options``, default 2)
``input_bytes``        the model's input per microbatch at the first stage, its targets at
                       the last (:class:`~pdjax.partition.pricing.cost.CallArrays`: the smaller of
                       the model's output and input), both at a single stage; 0 between
``cotangent_bytes``    ``sum_l output_bytes[l] * scale / r``: zero bubble's cotangents at
                       the layers' outputs
=====================  =====================================================================

A *sharded* stage (:attr:`StagePlan.mesh <pdjax.plan.StagePlan.mesh>` with ``fsdp``,
``tensor`` or another axis besides ``data``) is priced per device from its weight ways
``w`` (the product of its axes other than ``data``) and batch ways ``b`` (``data`` x
``fsdp``; :func:`~pdjax.partition.pricing.cost.mesh_ways`), as the planner's memory
model prices it: ``param_bytes`` and ``optimizer_bytes`` are one device's share (``/ w``:
the profile has no per-parameter annotations, so every parameter is taken as split);
``stash_bytes`` and ``cotangent_bytes`` are divided by ``b`` instead of ``r`` (the rows a
device holds; activations split over ``tensor`` inside the stage are counted whole, an
over-count); ``input_bytes`` is the microbatch's times ``r / b`` (the simulator divides
it by ``r``; each row block is on ``r / b`` devices). Times are the replicated stage's:
compute ``/ r``, and the all-reduce a ring of the *whole* parameter bytes over the ``r``
devices (``PipelineCosts.allreduce_seconds``), as the planner prices it; the collectives
a sharded stage really runs (gathers, reduce-scatters, tensor-parallel all-reduces) are
not priced yet. The activations in transit, which the simulator divides by ``r``, are
under-counted by the factor ``r / b`` on a stage with ``tensor`` > 1 (each device holds
its rows whole).

The last two are counted by the simulator's ``runtime`` memory model only
(``dataclasses.replace(costs, memory_model="runtime")``), which then counts what the
planner's ``pdjax`` memory terms charge (:mod:`pdjax.partition.pricing.cost`).

``w_l``, the weight-gradient share of layer ``l``'s backward (:func:`weight_grad_fraction`;
only ``zb-h1``, which defers ``W``, depends on it). The runtime computes zero bubble's ``I``
and ``W`` layer by layer (:mod:`pdjax.pipeline.stage`): ``I`` runs each layer's pullback
keeping its input cotangent and the cotangent at each layer's output, ``W`` applies each
layer's pullback to that cotangent for the weights only. The profiler
(:func:`pdjax.profile.profile`) compiles those two programs for every layer, counts their
FLOPs and, with ``measure=True`` (or a device model), their seconds. ``w_l`` is, in order
of preference:

1. measured (or modelled): ``weight_grad_seconds / (input_grad_seconds +
   weight_grad_seconds)``;
2. counted: ``weight_grad_flops / (input_grad_flops + weight_grad_flops)``;
3. for profiles without the split (PipeDream's ``graph.txt``, older pdjax profiles), a
   heuristic: the weight gradient is the forward's contraction with one operand swapped
   (dense, convolution: the forward's FLOPs), so ``w_l = min(1, forward_flops /
   backward_flops)``; ``1/2`` without FLOPs.

A layer without parameters has ``w_l = 0``; one whose input needs no gradient (the first
layer) has ``w_l = 1``. ``I`` and ``W`` split the *measured backward* (``(1 - w_l) B`` and
``w_l B``), so a stage's ``I + W`` is what its ``B`` costs. That is what the runtime runs
for a layer that is one contraction (dense, convolution: ``I`` and ``W`` share no work,
their FLOPs sum exactly to ``B``'s). For a composite layer (a transformer block), ``W``
replays the layer's pullback through its interior to reach the inner weights, so the
runtime's ``I + W`` exceeds ``B`` (GPT's block: by about half of ``B`` in FLOPs); the
simulator prices ``zb-h1`` without that repeated work.

Layers are read as the planner reads them (:func:`pdjax.partition.pricing.cost.model_arrays`):
an ``Input`` source layer (data loading) and unused ``__getitem__`` sinks of PipeDream's
profiles cost nothing, and the cut bytes are :meth:`~pdjax.profile.Profile.cut_bytes`
without those sinks. Links come from the plan's topology:

- the cut between stages ``s`` and ``s + 1`` runs on the innermost level ``k`` that joins a
  device of one to a device of the other (:meth:`~pdjax.partition.Topology.link_level`),
  at that level's bandwidth times the number of level-``k`` groups holding devices of both
  stages: when a replicated server-level stage runs the same sub-pipeline in ``m`` servers,
  its inner cuts are ``m`` parallel links each carrying ``1/m`` of the microbatch, as in
  the planner's recursion;
- a replicated stage all-reduces over the outermost level its devices span, at that
  level's bandwidth (a flat ring: for replicas spread over servers this is the slower,
  pessimistic side of the planner's hierarchical estimate).

The costs are per replica whatever the plan's replication mode: a round-robin stage
(``plan.replication``) runs ``r`` whole microbatches side by side, and the simulator
charges each of its actions ``r`` times these costs (see :mod:`pdjax.simulator.engine`).
Pass both ``replicas=plan.replicas`` and ``replication=plan.replication`` to the schedule
generator.

Planner and simulator (steady state of ``pipedream``) price a stage identically on one
level: with free transfers the simulator's time per microbatch is the planner's
``time_per_microbatch`` (the slowest stage: compute / ``r`` plus its all-reduce, once per
microbatch when split, once per ``r`` when round-robin). On a hierarchical topology the
planner's all-reduce is per level (a ring inside each server, then one between servers),
the simulator's a flat ring at the slowest level's bandwidth, so a stage replicated across
servers simulates slower. Two more systematic differences remain, both in the transfers:

- **Cuts.** The planner charges a cut ``2 a / B`` (activation forward and its gradient
  backward on one link); the simulator has one link per direction, busy ``a / B`` per
  microbatch. A plan whose bottleneck is a cut can simulate faster than predicted.
- **Round-trip latency (Little's law).** 1F1B admits exactly ``P - s`` microbatches in
  flight at stage ``s``: enough to hide the pipeline's compute, not its transfers. The
  simulator's period is at least one microbatch's round trip from stage ``s`` to the last
  stage and back (compute, all-reduce and ``2 a / B`` per cut crossed) divided by
  ``P - s``; the planner ignores this term, so it is optimistic whenever transfers are
  comparable to compute. PipeDream's VGG-16 profile on 4 workers at 10 Gbit/s (plan 3-1,
  ~100 MB crossing the cut per microbatch of 128): planner 178.8 ms, simulator 252.0 ms,
  round-trip bound 250.8 ms; with free links or at 1 Tbit/s the two agree within 0.2%.
  Round-robin stages run 1F1B over groups (``q_s`` groups of ``n_s`` microbatches in
  flight), and a stage returns the gradient of a group's last microbatch only after the
  forwards of the next group's first ones: a round-robin stage's backward waits for those
  to cross the cut and come back. On PipeDream's VGG-16 profile on 4 servers x 4 at
  10 Gbit/s, plan ``12rr-2rr-1-1``: planner 61.2 ms, simulator 66.6 ms (the first stage
  idles 51 ms per group of 12).

The cut model is optimistic for a stage that shares a server with the next stage but has
most of its devices elsewhere (PipeDream's ``15-1`` on 4 servers x 4: 12 of stage 0's 15
devices send to stage 1 over the network, the simulator gives the whole cut the
intra-server link).

With interleaving (``chunks = v > 1``), the model is re-cut into ``P v`` contiguous virtual
stages, virtual stage ``k`` on device group ``k mod P`` (the plan's stage ``k mod P``, with
its devices and replicas): the placement the executor runs for ``interleaved``
(:class:`pdjax.pipeline.executor.Pipeline`). The cut points minimise the planner's
``pdjax`` objective over the virtual stages (the largest stage time per device, all-reduce
included once per step, and ``2 a / B`` per cut; a small dynamic program). The plan's own
stage boundaries are not kept: stage ``d``'s layers cannot be both contiguous and spread
over ``v`` chunks in model order.

Calibrated costs (``calibration=``, a :class:`pdjax.calibrate.Calibration` measured for
this model, microbatch size and devices): each stage's ``forward``, backward and ``update``
are the stage's compiled programs measured on one of its devices (the backward is split
into ``I`` and ``W`` by the profile's weight-gradient share over the range); a replicated
stage's all-reduce is the measured one (``allreduce_seconds``: the stage's own gradient
tree when measured, else the device group's latency/bandwidth fit); each cut's
``link_bandwidth`` (forward direction) and ``link_bandwidth_back`` (gradient direction)
are the measured links between the two stages' first devices, ``link_latency`` the mean
of the two directions' latencies; ``send_seconds``, the host seconds a stage's device
spends to post a transfer, is the measured sender time of its outgoing links. A stage the
calibration did not measure is refused, or with ``partial=True`` priced from the profile
times the calibration's profile ratio (the whole model measured as one program over the
profile's sum).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from pdjax.errors import CalibrationError, PlanError, ScheduleError
from pdjax.partition.pricing import cost
from pdjax.plan.plan import Plan
from pdjax.profile import Profile
from pdjax.simulator import PipelineCosts, StageCosts

__all__ = ["costs_from_plan", "weight_grad_fraction"]

#: Optimizer state bytes per parameter byte when the plan does not record it (Adam).
DEFAULT_OPTIMIZER_STATE_FACTOR = 2.0


def weight_grad_fraction(profile: Profile) -> np.ndarray:
    """Per layer, the share of its backward seconds that is the weight gradient ``W``.

    0 for a layer without parameters; else, from the first of these the layer has (see the
    module doc): the measured (or modelled) seconds of ``W`` over those of ``I + W``; the
    FLOPs of ``W`` over those of ``I + W``; ``min(1, forward_flops / backward_flops)``;
    1/2.

    >>> from pdjax.profile import LayerProfile
    >>> layers = [LayerProfile("relu"), LayerProfile("dense", param_bytes=4,
    ...           forward_flops=2.0, backward_flops=4.0), LayerProfile("w", param_bytes=4),
    ...           LayerProfile("split", param_bytes=4, input_grad_flops=3.0,
    ...                        weight_grad_flops=1.0, input_grad_seconds=1.0,
    ...                        weight_grad_seconds=4.0)]
    >>> weight_grad_fraction(Profile.chain(layers, batch_size=1)).tolist()
    [0.0, 0.5, 0.5, 0.8]
    """
    out = np.zeros(len(profile.layers))
    for i, layer in enumerate(profile.layers):
        if layer.param_bytes <= 0:
            continue
        share = _share(layer.input_grad_seconds, layer.weight_grad_seconds)
        if share is None:
            share = _share(layer.input_grad_flops, layer.weight_grad_flops)
        f, b = layer.forward_flops, layer.backward_flops
        if share is None and f is not None and b is not None and f > 0 and b > 0:
            share = min(1.0, f / b)
        out[i] = 0.5 if share is None else share
    return out


def _share(input_grad: float | None, weight_grad: float | None) -> float | None:
    """``weight_grad / (input_grad + weight_grad)``, or None if unknown or both 0."""
    if input_grad is None or weight_grad is None or input_grad < 0 or weight_grad < 0:
        return None
    total = input_grad + weight_grad
    return weight_grad / total if total > 0 else None


def costs_from_plan(
    plan: Plan,
    profile: Profile,
    *,
    chunks: int = 1,
    calibration: Any = None,
    partial: bool = False,
) -> PipelineCosts:
    """Per-stage costs of ``plan`` for the simulator (see the module doc for the formulas).

    Args:
        plan: the plan (its stages, devices, topology, microbatch size and options).
        profile: the profile the plan was made from (same number of layers, with times).
        chunks: ``v``; with ``v > 1`` the costs describe ``P v`` virtual stages for the
            ``interleaved`` schedule, virtual stage ``k`` on the plan's stage ``k mod P``.
        calibration: a :class:`pdjax.calibrate.Calibration` for this model, microbatch
            size and devices: each stage's forward, backward and update seconds, its
            all-reduce, and each cut's latency, bandwidth (both directions) and sender
            host seconds come from it (see "Calibrated costs" in the module doc).
        partial: with a calibration, price stages it did not measure from the profile
            (times its profile ratio) instead of refusing them.

    Returns:
        One :class:`StageCosts` per (virtual) stage, the cut bandwidths and the all-reduce
        bandwidths; pass ``replicas=plan.replicas`` and ``replication=plan.replication``
        to the schedule generator.

    Raises:
        PlanError: the profile does not match the plan (layer count), or has no times.
        CalibrationError: the calibration is for another model, microbatch size or device
            set, or (without ``partial``) lacks a stage of the plan.
        ScheduleError: ``chunks`` is not a positive integer, or the model has fewer layers
            that may be cut than ``P v`` virtual stages need.

    >>> from pdjax.partition import Topology, plan_uniform
    >>> from pdjax.profile import LayerProfile
    >>> layers = [LayerProfile(f"l{i}", forward_seconds=1.0, backward_seconds=2.0,
    ...                        output_bytes=10) for i in range(4)]
    >>> profile = Profile.chain(layers, batch_size=8)
    >>> costs = costs_from_plan(plan_uniform(profile, Topology.flat(2, 100.0), 2), profile)
    >>> [(st.forward, st.backward, st.activation_bytes) for st in costs.stages]
    [(2.0, 4.0, 10), (2.0, 4.0, 0)]
    >>> costs.link_bandwidth
    (100.0,)
    """
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ScheduleError(f"chunks must be an integer >= 1; got {chunks!r}")
    if plan.num_layers != len(profile.layers):
        raise PlanError(
            f"the plan covers {plan.num_layers} layers but the profile has "
            f"{len(profile.layers)}; simulate a plan with the profile it was made from"
        )
    arrays = cost.model_arrays(profile, plan.microbatch_size)
    P, K, topo = plan.num_stages, plan.num_stages * chunks, plan.topology
    groups = [plan.stages[k % P] for k in range(K)]
    positions = [[topo.position(d) for d in st.devices] for st in groups]
    links = [cost.cut_bandwidth(topo, positions[k], positions[k + 1]) for k in range(K - 1)]
    allreduce = [cost.outer_allreduce_bandwidth(topo, pos) for pos in positions]
    if chunks == 1:
        ranges = [(st.first_layer, st.last_layer) for st in plan.stages]
    else:
        ranges = _balanced_ranges(
            arrays,
            [st.replicas for st in groups],
            links,
            allreduce,
            cost.updates_per_microbatch("interleaved", plan.num_microbatches),
        )
    replicas = [st.replicas for st in groups]
    ways = [cost.mesh_ways(st.mesh, st.replicas) for st in groups]
    stages = _stage_costs(plan, profile, arrays=arrays, ranges=ranges, replicas=replicas, ways=ways)
    costs = PipelineCosts(
        tuple(stages),
        tuple(links),
        tuple(allreduce),
        allreduce_seconds=_sharded_allreduce(arrays, ranges, replicas, ways, allreduce),
    )
    if calibration is None:
        return costs
    if chunks != 1:
        raise PlanError("calibrated costs are per plan stage: simulate interleaving uncalibrated")
    return _calibrated(plan, profile, costs, calibration, partial)


def _stage_costs(
    plan: Plan,
    profile: Profile,
    *,
    arrays: cost.ModelArrays,
    ranges: Sequence[tuple[int, int]],
    replicas: Sequence[int],
    ways: Sequence[tuple[int, int]],
) -> list[StageCosts]:
    """Per (virtual) stage, layers ``first..last`` of ``ranges`` on ``replicas`` devices
    split ``ways`` (weight ways, batch ways: :func:`~pdjax.partition.pricing.cost.mesh_ways`):
    its costs from the profile (see the module doc)."""
    # The planner's view: free layers (Input, dropped sinks) have compute 0.
    priced = arrays.compute > 0
    forward = np.where(priced, profile.forward_seconds(), 0.0) * arrays.scale
    backward = np.where(priced, profile.backward_seconds(), 0.0) * arrays.scale
    w_share = weight_grad_fraction(profile)
    input_grad = backward * (1.0 - w_share)
    weight_grad = backward * w_share
    factor = float(plan.options.get("optimizer_state_factor", DEFAULT_OPTIMIZER_STATE_FACTOR))
    stages = []
    K = len(ranges)
    inputs, targets = getattr(arrays, "inputs", 0.0), getattr(arrays, "targets", 0.0)
    for k, ((first, last), r, (shards, rows)) in enumerate(
        zip(ranges, replicas, ways, strict=True)
    ):
        sl = slice(first, last + 1)
        params = math.fsum(arrays.params[sl]) / shards
        placed = (inputs if k == 0 else 0.0) + (targets if k == K - 1 else 0.0)
        stages.append(
            StageCosts(
                forward=math.fsum(forward[sl]) / r,
                input_grad=math.fsum(input_grad[sl]) / r,
                weight_grad=math.fsum(weight_grad[sl]) / r,
                activation_bytes=round(float(arrays.cut[last])),
                param_bytes=round(params),
                stash_bytes=round(math.fsum(arrays.stash[sl]) / rows),
                optimizer_bytes=round(params * factor),
                # the simulator divides by the group's devices: r / rows copies of each row
                input_bytes=round(placed * r / rows),
                cotangent_bytes=round(math.fsum(arrays.act[sl]) / rows),
            )
        )
    return stages


def _sharded_allreduce(
    arrays: cost.ModelArrays,
    ranges: Sequence[tuple[int, int]],
    replicas: Sequence[int],
    ways: Sequence[tuple[int, int]],
    bandwidth: Sequence[float],
) -> tuple[float | None, ...] | None:
    """Per (virtual) stage, the seconds of a sharded stage's all-reduce: the ring over its
    devices of its whole parameter bytes, as the planner prices it (its ``param_bytes``
    are one device's share); None for the others (the simulator's ring), or None for all
    where no stage is sharded."""
    if all(w == 1 for w, _ in ways):
        return None
    out: list[float | None] = []
    for (first, last), r, (w, _), bw in zip(ranges, replicas, ways, bandwidth, strict=True):
        whole = math.fsum(arrays.params[first : last + 1])
        out.append(float(cost.ring_allreduce(whole, r, bw)) if w > 1 else None)
    return tuple(out)


def _calibrated(
    plan: Plan, profile: Profile, costs: PipelineCosts, calibration: Any, partial: bool
) -> PipelineCosts:
    """``costs`` with what ``calibration`` measured (see "Calibrated costs")."""
    names = [layer.name for layer in profile.layers]
    calibration.check(layers=names, plan=plan, require_stages=not partial)
    stages, allreduce_seconds = _calibrated_stages(plan, profile, costs, calibration)
    latency, forward_bw, back_bw = _calibrated_links(plan, costs, calibration, partial)
    sends = _send_seconds(plan, calibration)
    stages = [dataclasses.replace(c, send_seconds=x) for c, x in zip(stages, sends, strict=True)]
    # a transfer starts once its sender has produced it: the runtime posts receives ahead
    # of its devices (pdjax._xla_cpu), and on the cluster benchmark this model fitted the
    # runs better than receives posted in program order (31 against 22 of 57 rows within
    # 10%); PipelineCosts.posted_receives keeps the other model
    return dataclasses.replace(
        costs,
        stages=tuple(stages),
        link_bandwidth=tuple(forward_bw),
        link_bandwidth_back=tuple(back_bw),
        link_latency=tuple(latency) if latency else 0.0,
        allreduce_seconds=tuple(allreduce_seconds),
    )


def _calibrated_stages(
    plan: Plan, profile: Profile, costs: PipelineCosts, calibration: Any
) -> tuple[list[StageCosts], list[float | None]]:
    """Per plan stage, its costs with the measured seconds (unmeasured: the profile's times
    the calibration's profile ratio), and its all-reduce seconds (None: one device)."""
    w_share = weight_grad_fraction(profile)
    backward = profile.backward_seconds()
    ratio = calibration.profile_ratio
    stages, allreduce_seconds = [], []
    for k, st in enumerate(plan.stages):
        c = costs.stages[k]
        m = calibration.stage(st.first_layer, st.last_layer, st.replicas, st.replication)
        if m is None:
            if ratio is None:
                raise CalibrationError(
                    f"stage {st.first_layer}-{st.last_layer} x{st.replicas} was not measured "
                    "and the calibration has no profile ratio for unmeasured stages; "
                    "calibrate the whole model too"
                )
            c = dataclasses.replace(
                c,
                forward=c.forward * ratio,
                input_grad=c.input_grad * ratio,
                weight_grad=c.weight_grad * ratio,
            )
            stages.append(c)
        else:
            sl = slice(st.first_layer, st.last_layer + 1)
            total_b = math.fsum(backward[sl])
            share = math.fsum(backward[sl] * w_share[sl]) / total_b if total_b > 0 else 0.5
            stages.append(
                dataclasses.replace(
                    c,
                    forward=m.forward,
                    input_grad=m.backward * (1.0 - share),
                    weight_grad=m.backward * share,
                    update=m.update,
                )
            )
        seconds = None
        if st.replicas > 1:
            if m is not None and m.allreduce is not None:
                seconds = m.allreduce
            else:
                shards, _ = cost.mesh_ways(st.mesh, st.replicas)  # the whole stage's bytes
                seconds = calibration.allreduce_seconds(c.param_bytes * shards, st.devices)
        allreduce_seconds.append(seconds)
    return stages, allreduce_seconds


def _calibrated_links(
    plan: Plan, costs: PipelineCosts, calibration: Any, partial: bool
) -> tuple[list[float], list[float], list[float]]:
    """Per cut: latency (mean of both ways) and bandwidth of each direction, measured
    (with ``partial``, the uncalibrated costs' where a cut was not measured)."""
    latency, forward_bw, back_bw = [], [], []
    for k in range(len(plan.stages) - 1):
        a, b = plan.stages[k].devices[0], plan.stages[k + 1].devices[0]
        there, back = calibration.link(a, b), calibration.link(b, a)
        if there is None or back is None:
            if not partial:
                raise CalibrationError(
                    f"the link between devices {a} and {b} (cut {k}) was not measured both "
                    "ways; calibrate with these devices"
                )
            latency.append(costs.link_latency if isinstance(costs.link_latency, float) else 0.0)
            forward_bw.append(costs.link_bandwidth[k])
            back_bw.append(costs.link_bandwidth[k])
            continue
        latency.append((there.latency + back.latency) / 2)
        forward_bw.append(there.bandwidth)
        back_bw.append(back.bandwidth)
    return latency, forward_bw, back_bw


def _send_seconds(plan: Plan, calibration: Any) -> list[float]:
    """Per plan stage, the host seconds to post each transfer it sends (the mean over its
    measured links to its neighbours)."""
    sends = []
    for k, st in enumerate(plan.stages):
        out = [
            calibration.link(st.devices[0], plan.stages[j].devices[0])
            for j in (k - 1, k + 1)
            if 0 <= j < len(plan.stages)
        ]
        posted = [ln.send_seconds for ln in out if ln is not None]
        sends.append(sum(posted) / len(posted) if posted else 0.0)
    return sends


def _balanced_ranges(
    arrays: cost.ModelArrays,
    replicas: list[int],
    link_bandwidth: list[float],
    allreduce_bandwidth: list[float],
    updates_per_microbatch: float,
) -> list[tuple[int, int]]:
    """Contiguous layer ranges, one per virtual stage ``k``, minimising the planner's
    ``pdjax`` objective: the largest of each virtual stage's time per microbatch (compute
    on ``replicas[k]`` devices plus its share of the all-reduce) and each cut's ``2 a / B``
    (``link_bandwidth[k]`` between virtual stages ``k`` and ``k + 1``). No cut where
    ``arrays.cut_ok`` forbids one."""
    K, L = len(replicas), arrays.num_layers
    cuttable = int(np.count_nonzero(arrays.cut_ok))
    if K - 1 > cuttable:
        raise ScheduleError(
            f"interleaving needs {K} virtual stages but the model has {L} layers and allows "
            f"only {cuttable} cuts; use fewer chunks or fewer stages"
        )
    compute, weights = arrays.range_sum(arrays.compute), arrays.range_sum(arrays.params)

    def stage(k: int) -> np.ndarray:  # [i, j]: layers i..j as virtual stage k
        return cost.stage_time(
            "pdjax",
            compute,
            weights,
            replicas[k],
            allreduce_bandwidth[k],
            updates_per_microbatch=updates_per_microbatch,
        )

    # best[k, j]: the objective of virtual stages 0..k holding layers 0..j;
    # arg[k, j]: the first layer of stage k there.
    best = np.full((K, L), np.inf)
    arg = np.zeros((K, L), dtype=np.int64)
    best[0] = stage(0)[0]
    for k in range(1, K):
        time_k = stage(k)
        cut = np.where(arrays.cut_ok, 2.0 * arrays.cut / link_bandwidth[k - 1], np.inf)
        for j in range(k, L):
            starts = np.arange(1, j + 1)  # stage k holds starts..j, cut after starts - 1
            vals = np.maximum(best[k - 1, starts - 1], cut[starts - 1])
            vals = np.maximum(vals, time_k[starts, j])
            i = int(np.argmin(vals))
            best[k, j], arg[k, j] = vals[i], starts[i]
    ranges, j = [], L - 1
    for k in range(K - 1, 0, -1):
        ranges.append((int(arg[k, j]), j))
        j = int(arg[k, j]) - 1
    ranges.append((0, j))
    return ranges[::-1]
