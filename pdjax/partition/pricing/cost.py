"""Cost models: what one stage, one cut and one device's memory cost, per microbatch.

Three models, selected by name (``cost_model=``). Notation, for a stage holding layers
``i..j`` at a level with bandwidth ``B`` (bytes/s):

* ``C``: the stage's time per microbatch (seconds) one level down: at the innermost level
  the sum of the layers' forward + backward seconds; at an outer level, the optimal time
  of layers ``i..j`` on one whole unit of the level below (a server's pipeline);
* ``W``: parameter bytes of layers ``i..j``;
* ``a_s``: activation bytes crossing a cut after layer ``s`` (for a DAG, every output of
  layers ``0..s`` consumed after ``s``); the cut's time covers the activation forward and
  its gradient backward;
* ``m``: the units (devices, servers, ...) the stage is replicated on at this level.

``pdjax`` (the default; what pdjax's runtime and simulator do): a replicated stage on ``m``
units costs ``C / m`` per microbatch in steady state, and all-reduces its weight gradients
once per optimizer update, a ring all-reduce of ``2 (m-1)`` messages: ``2 (m-1) * lat +
2 (m-1)/m * W / B`` seconds (``lat``: the level's per-message
:attr:`~pdjax.partition.Level.latency`). The update needs the reduced gradient before the
next forward, so the all-reduce adds to compute. Links are full duplex, one per direction
(as in the simulator): the activation goes forward on one, its gradient comes back on the
other, so a cut costs one transfer's time per microbatch::

    stage(i..j, m) = C / m + (2 (m-1) * lat + 2 (m-1)/m * W / B) / u
    cut(s)         = a_s / B + lat

``u`` is the number of microbatches per all-reduce, which depends on the stage's
*replication* mode (``docs/semantics.md#replication``):

* ``split``: the stage splits each microbatch across its units and updates as the schedule
  does: ``u = 1`` under ``pipedream``, ``M`` (the step's microbatches) under the flush
  schedules and ``2bw``;
* ``round-robin`` (PipeDream's own): each unit takes whole microbatches, ``m`` consecutive
  ones at once, and the stage updates once per such group: ``u = m`` under ``pipedream``,
  ``M`` under ``gpipe``, ``1f1b`` and ``2bw`` (the same as split there: the modes differ in
  memory only). The other schedules (``interleaved``, ``zb-h1``, ``zb-h2``, ``zb-v``) have
  no round-robin form (:data:`~pdjax.schedules.ROUND_ROBIN`).

One level up, a unit runs the sub-pipeline, and the recursion divides the whole
sub-pipeline time by ``m``. Split: each unit takes ``1/m`` of the microbatch; the inner
all-reduce is divided by ``m`` too, which is exact when no inner stage is replicated and
optimistic by at most ``(1-1/m)`` times the inner all-reduce otherwise. Round-robin: each
unit takes whole microbatches, so dividing by ``m`` is exact for the compute and for the
inner all-reduces (an inner stage on ``r`` devices of each of the ``m`` units all-reduces
once per ``m r`` microbatches). The level's own all-reduce, over the ``m`` units, happens
once per ``m r`` microbatches for each inner stage on ``r`` devices per unit; the program
does not carry ``r`` up a level, so it charges ``u = m`` (``r = 1``, pessimistic), except
for a range replicated whole at every level below (``r`` = the devices of a unit, ``G``),
which it prices exactly as well, ``(C + sum of the all-reduces of the levels below + this
level's) / (m G)``, and takes the cheaper: for such a range on all ``N`` devices this is
data parallelism's time (below).

``paper`` (PipeDream, SOSP'19, section 3.1; whole microbatches routed round-robin to the
``m`` replicas, compute and communication overlapped)::

    stage(i..j, m) = max(C, 2 (m-1) W / B) / m
    cut(s)         = 2 a_s / B

``pipedream-code`` (``optimizer_graph_hierarchical.py`` of msr-fiddle/pipedream, run with
``--activation_compression_ratio 1``): compute and all-reduce summed, factor 4, transfers
divided by the receiving stage's replica count::

    stage(i..j, m)       = (C + 4 (m-1) W / (B m)) / m
    first stage (whole)  = (C + 4 (m-1) W / (B m) / g) / m     g: units of the level below
                                                               (1 at the innermost level)
    cut before a stage   = 2 a_s / (B m')                      m': that stage's replicas
    cut after a stage    = 2 a_j / (B m')   unless j is the model's last layer

The "first stage" form is the original's initial value ``A[i][j][m]`` (the range replicated
whole, used both for one-stage ranges and for a split's prefix); the original divides the
all-reduce by ``g`` there and not in the last-stage term, and pdjax reproduces that.

In every model the objective is the slowest term: the maximum over stages and cuts, the
time per microbatch of the pipeline in steady state. ``pdjax`` adds the *round-trip bound*
under every schedule whose :attr:`ScheduleTraits.round_trip` is set (:func:`has_round_trip`:
all but ``gpipe`` and ``interleaved``). Stage ``s`` holds at most ``T_s`` microbatches in
flight between its forward and its backward (:func:`exact_in_flight`, from
:func:`in_flight`: ``P - s`` under ``pipedream`` and ``2bw``, ``min(P - s, M)`` under
``1f1b`` and ``zb-h1``, ``min(2P - 1, M)`` under ``zb-h2``, ``min(P, M)`` under ``zb-v``):
by Little's law stage ``s`` cannot finish more than ``T_s`` microbatches per round trip of
one microbatch from ``s`` to the last stage and back, so with ``C_t`` the stage term of
stage ``t`` and ``cut_t`` the term of the cut after it::

    RT_s   = sum_{t >= s} n_t C_t + 2 sum_{s <= t < P-1} cut_t
    period = max( max_t C_t, max_t cut_t, max_s RT_s / T_s )

``n_t`` is 1 for a split stage; a round-robin stage (below) holds a microbatch for a whole
group's action, ``n_t = r_t`` times its per-microbatch term, and ``T_s = q_s n_s``
(:func:`groups_in_flight`). ``gpipe`` (``M`` in flight, its flush bubble is outside every
model) and ``interleaved`` (its in-flight count depends on the chunks, which the planner
does not know) get no round-trip term. The dynamic program's treatment of this term is in
:mod:`pdjax.partition.search.pipedream`; :func:`partition_terms` and :func:`round_trip_time`
compute it for given stages, and every plan's ``time_per_microbatch`` includes it.

Calibration (``pdjax`` only): ``stage_seconds(first, last, replicas, replication)`` may
return measured seconds per microbatch of a stage's compute on one of its devices (its
share: what replaces ``C / m``), and ``allreduce_seconds(param_bytes, devices)`` measured
seconds of one all-reduce (what replaces ``2 (m-1) * lat + 2 (m-1)/m * W / B``); ``None``
falls back to the formulas.

Data parallelism (``data_parallel_time``, the baseline of ``speedup_over_data_parallel``)
under ``pdjax`` is what :class:`pdjax.runners.DataParallel` and ``pdjax.apps.cluster`` run:
each of the ``N`` devices takes one microbatch per step, then one all-reduce per step (a
hierarchical ring, each level's ``2 (n_k-1) * lat_k + 2 (n_k-1)/n_k * W / B_k``), whatever
the schedule: ``(C + sum_k allreduce_k) / N`` per microbatch.

Times and activation bytes are those of one microbatch: the profile's values (for
``Profile.batch_size`` samples) times ``microbatch_size / batch_size``; parameter bytes do
not scale. As PipeDream's optimizer does, an ``Input`` source layer (data loading) costs
nothing and no cut may follow it, and ``__getitem__`` sinks (unused LSTM outputs in the GNMT
profiles) cost nothing and hold no activation across a cut (:func:`model_arrays`).

Memory per device (bytes):

* ``pdjax``: what pdjax's runtime holds, as the simulator's ``runtime`` memory model
  (:mod:`pdjax.simulator.engine`) counts it, for one call of ``N`` microbatches
  (``Pipeline.run``; :func:`microbatches_per_call`: by default the least that reaches the
  steady state, ``(v + 1) M`` for a schedule that updates once per step and keeps ``v``
  versions, ``2 M`` for ``pipedream``; ``plan.options["microbatches_per_call"]``)::

      held(f) = max over f' >= f of (N - f') p + min(f', T) w      (at f' = f or f' = T)
      memory  = max( W (2 + k)     + held(1) / r,                  (before the first update)
                     W (v + k + c) + held(u) / r )                 (after it)
                + (a_before (1 + q_before) + a_after (1 + q_after)) n / r   (in transit)

  with ``r`` the devices of the stage, ``k`` the optimizer-state factor (2 for Adam),
  ``v`` the weight versions the schedule keeps (``pipedream``: the in-flight count,
  ``2bw``: 2, flush schedules: 1), ``c`` the copies besides them (:func:`weight_copies`:
  the step's gradient sum, which the update donates, so it is also the update's
  transient, and the weights the call started from, alive until it returns: 2, or 1 for
  a call too short to update past its versions), ``T`` the semantics table's in-flight
  count (:func:`memory_in_flight`: ``P - s``, at most ``M`` if the schedule flushes, ``M``
  for ``gpipe``, ``min(P, M)`` for ``zb-h1`` and ``min(2P - 1, M)`` for ``zb-h2``, whose
  stash lives until ``W``), ``w`` the bytes a microbatch in flight holds (the layers'
  :attr:`~pdjax.profile.LayerProfile.stash_bytes`, plus under zero bubble the cotangents
  at the layers' outputs that ``I`` keeps for ``W``, charged for every microbatch in
  flight: :func:`waiting_bytes`), ``p`` the bytes per microbatch the call places up front
  (:class:`CallArrays`: the model's input on the first stage, which becomes part of the
  stash when forwarded, the targets on the last), ``u`` the microbatches forwarded before
  the first update (``M``, or 1 under ``pipedream``), ``a_before`` and ``a_after`` the cut
  bytes on either side and ``n`` the larger round-robin group across the cut (1 if
  split): per cut one received copy waiting for its action and ``q`` sent ones whose
  transfers have not ended, ``q = 1`` where the transfer takes no longer than what
  feeds it, else ``T`` (a link slower than its stage queues what the stage makes, up to
  what it holds in flight; :func:`transit_bytes`). What feeds an activation sent on is
  the stage's forward on its devices and every stage and cut before it; a gradient sent
  back, its backward (zero bubble's ``I``, taken as no longer than the forward) and every
  stage and cut after it: a plan knows them all, the dynamic program only the stage's
  own time (on every device it may have) and the slowest level's link (the optimistic
  check: no queue). Each term is charged at its own
  peak (the two phases apart), so the figure is at least the runtime model's peak; on the
  profiles of ``tests/test_planner_memory.py`` it is within 10% of it (zero bubble's
  cotangents, charged for every microbatch in flight, are the largest excess). A
  round-robin stage holds ``q`` groups of ``r`` microbatches (``in_flight = q r``,
  :func:`groups_in_flight`), i.e. ``q`` whole stashes per device, and under ``pipedream``
  keeps ``q`` versions: the same formula;
* ``paper`` (weight stashing, whole microbatches per replica): with ``q = ceil(in_flight /
  r)``, ``W (q + k) + stash * q``;
* ``pipedream-code`` (the original's pruning rule): ``ceil(d / m) (A + W)``, with ``A`` the
  sum of the stage's output activations and ``d`` the units after the stage at this level.

A *sharded* stage (a plan stage whose mesh has ``fsdp``, ``tensor`` or another axis
besides ``data``; :attr:`pdjax.plan.StagePlan.mesh`) is priced per device of its mesh
(:func:`mesh_ways`): every parameter-sized term (``W`` above: the weight versions, the
optimizer state, the gradient sum and the call's starting weights) is divided by its
*weight ways*, the product of its axes other than ``data``, and every per-microbatch term
(the stash, zero bubble's cotangents, the inputs placed up front, the values in transit:
what ``r`` divides above) by its *batch ways*, ``data x fsdp``, instead of its devices.
A profile has no per-parameter annotations, so every parameter is taken as split over
every weight axis (a norm's scale the rules replicate, or a bias split over one axis, is
under-counted). The runtime holds a sharded stage's input, its output and the values
between its layers batch-sharded and whole along ``tensor``; the activations a
tensor-parallel layer splits over ``tensor`` inside itself (a Megatron MLP's hidden
units, attention heads) are counted whole, an over-count: on a pipeline of ``nn.Dense``
pairs on fsdp 2 x tensor 2 (``tests/test_sharded_memory.py``) the simulator's ``runtime``
model is within 5% of the runtime's measured peak per device under ``gpipe``, ``1f1b``,
``2bw`` and ``pipedream`` (bar the weight version ``pipedream``'s backward frees, as on
one device). On Llama tiny (2 stages, microbatches of 8) the second stage holds 0.81 to
0.86 of it (attention splits part of its residuals over ``tensor``), the first 1.08 to
1.10: XLA leaves the activations after the embedding split along ``embed`` over
``fsdp`` and whole along the batch, which the runtime does not constrain (with every
layer's output constrained to the batch sharding the first stage holds 0.80 to 0.82).
The time terms stay the replicated stage's (``C / r`` and the
all-reduce of the whole ``W`` over its ``r`` devices): the collectives a sharded stage
runs (gathers and reduce-scatters over ``fsdp``, all-reduces over ``tensor``) are not
priced yet.

The schedule's in-flight count is ``P - s`` (1F1B-style: ``pipedream``, ``1f1b``, ``2bw``,
``interleaved``, and ``zb-h1`` under ``paper``; at most ``M`` for the flush schedules) or
``M`` (``gpipe``); under ``pdjax`` the semantics table's (above). The dynamic program does
not know ``P - s`` while it builds a prefix, so its memory check bounds it by ``1 +`` the
devices after the stage (and the layers after it), taking the table's largest count over
the pipelines that allows (:func:`memory_in_flight_bounds`; for zero bubble, whose count
depends on ``P``, ``min(devices, M)``), and charges the values in transit of a round-robin
stage as if a neighbour's group held every other device; inside a server of a
hierarchical topology the devices of other servers count as "after" and replication across
servers is not credited. The check is sound (a plan it accepts fits) and can be
conservative. Under ``pdjax`` the planner therefore first runs the program with an
optimistic check (a lower bound: ``T_s >= 2`` before the last stage, replication credited
across every level) and verifies the plan it returns with its exact memory: a plan that
fits is optimal among all that fit; otherwise it runs the sound check
(``plan.options["memory_check"]`` says which: ``"verified"`` or ``"bound"``).
With round-robin stages the in-flight counts follow the group sizes
(:func:`groups_in_flight`): stage ``s`` holds ``T_s = q_s n_s`` microbatches, which is at
most ``2 D_s - 2`` for ``D_s`` the devices of stages ``s..P-1`` (``2 D_s - 1`` counting
the last stage; ``n_s``: the stage's replicas if round-robin, else 1) whatever the modes of
the stages after it; and a round-robin stage replicated across servers has more devices
than the ``r`` the innermost level sees, so ``T_s / r`` bounds its per-device share. The
round-robin memory check (the planner prices round-robin for ``pipedream`` only, where it
all-reduces less) charges ``q = max(1, floor(T / r))`` whole stashes and ``q`` versions per
device with ``T = 2 D - 2``, ``D = r +`` the devices after, and ``q = 1`` for the model's
last stage. It is sound for any mix of modes, and tight for PipeDream's ``15-1``
(``q_0 = 2``); a one-device stage before a large round-robin stage can be charged up to
twice its real count. ``pdjax`` and ``paper`` check at the innermost level, ``pipedream-code`` at
every level with that level's counts, as the original. A plan reports its exact memory with
the final ``P - s``: the ``pdjax`` formula under ``pdjax``, the ``paper`` formula under the
other two.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Literal

import numpy as np

from pdjax.errors import PlanError
from pdjax.mesh import MeshAxes, is_sharded, mesh_axes
from pdjax.partition.pricing.arrays import ModelArrays, check_profile
from pdjax.partition.pricing.arrays import model_arrays as layer_arrays
from pdjax.partition.pricing.traits import (
    REPLICATION_OPTIONS,
    SCHEDULE_TRAITS,
    ScheduleTraits,
    allreduces_per_microbatch,
    check_in_flight,
    check_replication,
    exact_in_flight,
    groups_in_flight,
    has_round_trip,
    in_flight,
    resolve_replication,
    schedule_traits,
    stage_units,
    updates_per_microbatch,
    versions_kept,
)
from pdjax.plan.topology import Topology
from pdjax.profile import Profile
from pdjax.schedules import SEMANTICS, Shape

# The schedules' traits (pdjax.partition.pricing.traits) and the profile's arrays
# (pdjax.partition.pricing.arrays) are re-exported: the cost terms are read as ``cost.<name>``.
__all__ = [
    "BATCH_AXES",
    "COST_MODELS",
    "REPLICATION_OPTIONS",
    "SCHEDULE_TRAITS",
    "AllreduceSeconds",
    "CallArrays",
    "CostModel",
    "ModelArrays",
    "RuntimeCall",
    "ScheduleTraits",
    "StageSeconds",
    "allreduces_per_microbatch",
    "calibrated",
    "ceil_div",
    "check_calibration",
    "check_cost_model",
    "check_in_flight",
    "check_profile",
    "check_replication",
    "cut_time",
    "data_parallel_time",
    "exact_in_flight",
    "groups_in_flight",
    "has_round_trip",
    "hierarchical_allreduce",
    "in_flight",
    "memory_in_flight",
    "memory_in_flight_bounds",
    "mesh_ways",
    "microbatches_per_call",
    "model_arrays",
    "partition_terms",
    "resolve_replication",
    "ring_allreduce",
    "round_trip_time",
    "schedule_traits",
    "single_device_time",
    "stage_memory",
    "stage_time",
    "stage_units",
    "transit_bytes",
    "update_microbatches",
    "updates_per_microbatch",
    "versions_kept",
    "waiting_bytes",
    "weight_copies",
]

CostModel = Literal["pdjax", "paper", "pipedream-code"]
COST_MODELS: tuple[str, ...] = ("pdjax", "paper", "pipedream-code")


#: Calibration hook ``stage_seconds(first_layer, last_layer, replicas, replication)``:
#: measured seconds per microbatch of that stage, or None for the profile's estimate.
StageSeconds = Callable[[int, int, int, str], float | None]

#: Calibration hook ``allreduce_seconds(param_bytes, devices)``: measured seconds of one
#: all-reduce over those device positions (or, in the search, that many replicas), or None
#: for the ring formula.
AllreduceSeconds = Callable[[float, tuple[int, ...] | int], float | None]


def check_cost_model(name: str) -> str:
    if name not in COST_MODELS:
        raise PlanError(f"unknown cost model {name!r}; choose one of {', '.join(COST_MODELS)}")
    return name


#: The mesh axes a sharded stage splits its batch over (the runtime's default rules,
#: :data:`pdjax.layers.sharding.DEFAULT_RULES`); every other axis splits its weights.
BATCH_AXES = ("data", "fsdp")


def mesh_ways(mesh: MeshAxes | dict[str, int] | None, devices: int) -> tuple[int, int]:
    """``(weight ways, batch ways)`` of a stage on ``devices`` devices with ``mesh``: the
    product of its axes other than ``data`` (``fsdp``, ``tensor``, any other), which the
    memory model divides every parameter-sized term by, and of :data:`BATCH_AXES`
    (``data`` and ``fsdp``), which it divides every per-microbatch term by. A replicated
    stage (``mesh`` None or only ``data``) is ``(1, devices)``.

    A profile has no per-parameter annotations, so this assumes that every parameter is
    split over every weight axis (a norm's scale, left replicated, or a bias split over
    one axis are counted split too: the model is slightly optimistic for them). The batch
    ways follow the runtime's default rules (``("batch", ("data", "fsdp"))``).

    >>> mesh_ways({"fsdp": 2, "tensor": 2}, 4), mesh_ways(None, 4)
    ((4, 2), (1, 4))
    >>> mesh_ways({"data": 2, "tensor": 2}, 4), mesh_ways({"data": 4}, 4)
    ((2, 2), (1, 4))
    """
    if mesh is None:
        return 1, int(devices)
    axes = mesh_axes(mesh)
    if not is_sharded(axes):
        return 1, int(devices)
    weight = math.prod(size for name, size in axes if name != "data")
    batch = math.prod(size for name, size in axes if name in BATCH_AXES)
    return int(weight), int(batch)


# -- cost terms -----------------------------------------------------------------------


def stage_time(
    model: str,
    inner: np.ndarray | float,
    weights: np.ndarray | float,
    m: int,
    bandwidth: float,
    *,
    updates_per_microbatch: float,
    first: bool = False,
    inner_units: int = 1,
    latency: float = 0.0,
    allreduce: np.ndarray | float | None = None,
) -> np.ndarray:
    """Seconds per microbatch of a stage replicated on ``m`` units (see the module doc).

    Args:
      model: the cost model.
      inner: ``C``, the stage's time one level down (seconds); array or scalar.
      weights: ``W``, its parameter bytes.
      m: replicas at this level.
      bandwidth: ``B``, bytes/s at this level.
      updates_per_microbatch: ``1/u`` (pdjax only).
      first: the range replicated whole (``pipedream-code``'s initial value).
      inner_units: ``g``, units of the level below (``pipedream-code`` only).
      latency: seconds per message at this level (``pdjax`` only).
      allreduce: seconds of one all-reduce, replacing the ring formula (``pdjax`` only;
        calibration).
    """
    inner = np.asarray(inner, dtype=np.float64)
    weights = np.asarray(weights, dtype=np.float64)
    if model == "pdjax":
        if allreduce is None:
            allreduce = ring_allreduce(weights, m, bandwidth, latency)
        return inner / m + np.asarray(allreduce, dtype=np.float64) * updates_per_microbatch
    if model == "paper":
        paper: np.ndarray = np.maximum(inner, 2.0 * (m - 1) * weights / bandwidth) / m
        return paper
    allreduce = 4.0 * (m - 1) * weights / (bandwidth * m)
    if first:
        allreduce = allreduce / inner_units
    return (inner + allreduce) / m


def ring_allreduce(
    weights: np.ndarray | float, m: int, bandwidth: float, latency: float = 0.0
) -> np.ndarray:
    """Seconds of a ring all-reduce of ``weights`` bytes over ``m`` units: ``2 (m-1)``
    messages of ``W / m`` bytes, ``2 (m-1) * latency + 2 (m-1)/m * W / B``.

    >>> float(ring_allreduce(100.0, 4, 10.0, 0.5))
    18.0
    """
    weights = np.asarray(weights, dtype=np.float64)
    seconds: np.ndarray = (2.0 * (m - 1) / m) * weights / bandwidth + 2.0 * (m - 1) * latency
    return seconds


def cut_time(
    model: str,
    cut_before: np.ndarray | float,
    cut_after: np.ndarray | float,
    m: int,
    bandwidth: float,
    latency: float = 0.0,
) -> np.ndarray:
    """Seconds per microbatch of the transfers charged to a stage that follows a cut.

    Args:
      model: the cost model.
      cut_before: bytes crossing the cut before the stage.
      cut_after: bytes crossing the cut after it (0 after the model's last layer); only
        ``pipedream-code`` charges them to this stage.
      m: the stage's replicas at this level.
      bandwidth: bytes/s at this level.
      latency: seconds per message (``pdjax`` only: full-duplex links, ``a / B + latency``).
    """
    before, after = np.broadcast_arrays(
        np.asarray(cut_before, dtype=np.float64), np.asarray(cut_after, dtype=np.float64)
    )
    seconds: np.ndarray
    if model == "pipedream-code":
        seconds = 2.0 * np.maximum(before, after) / (bandwidth * m)
    elif model == "pdjax":
        seconds = before / bandwidth + latency
    else:
        seconds = 2.0 * before / bandwidth
    return seconds


def stage_memory(
    model: str,
    *,
    weights: np.ndarray | float,
    stash: np.ndarray | float,
    act: np.ndarray | float,
    replicas: int,
    in_flight_count: np.ndarray | int,
    versions: np.ndarray | int,
    optimizer_state_factor: float,
    units_after: np.ndarray | int = 0,
    weight_copies: float = 0.0,
    call: RuntimeCall | None = None,
    weight_ways: int = 1,
) -> np.ndarray:
    """Bytes per device of a stage (see the module doc).

    Args:
      model: the cost model.
      weights: parameter bytes of the stage.
      stash: bytes held per in-flight microbatch (already scaled to the microbatch; under
        ``pdjax`` with zero bubble's cotangents, :func:`waiting_bytes`).
      act: sum of the stage's output activations (``pipedream-code``).
      replicas: devices (``pdjax``, ``paper``) or units (``pipedream-code``) of the stage;
        for a sharded stage its batch ways (:func:`mesh_ways`): what its per-microbatch
        terms are divided by.
      in_flight_count: microbatches in flight at the stage.
      versions: weight versions kept (``pdjax``).
      optimizer_state_factor: optimizer state bytes per parameter byte (Adam: 2, SGD: 0).
      units_after: units after the stage at this level (``pipedream-code``).
      weight_copies: parameter-sized buffers the runtime holds besides the versions and
        the optimizer state once the stage has updated (``pdjax``; :func:`weight_copies`).
      call: what one call of the runtime places on the stage and moves through it
        (``pdjax``; :class:`RuntimeCall`); None: nothing.
      weight_ways: the ways a sharded stage splits its weights (:func:`mesh_ways`): every
        parameter-sized term (weights, versions, optimizer state, weight copies) is
        divided by it; 1 for a replicated stage.
    """
    weights = np.asarray(weights, dtype=np.float64) / weight_ways
    bytes_per_device: np.ndarray
    if model == "pdjax":
        count = np.asarray(in_flight_count)
        stash = np.asarray(stash, dtype=np.float64)
        k = optimizer_state_factor
        steady = weights * (np.asarray(versions) + k + weight_copies)
        if call is None:
            bytes_per_device = steady + stash * count / replicas
            return bytes_per_device
        # Until its first update a stage holds version 0 and the gradient sum; from then
        # on its steady versions and copies, with at least one update's microbatches
        # forwarded (their inputs no longer wait).
        later = steady + call.held(stash, count, call.update_microbatches) / replicas
        if np.ndim(call.placed) == 0 and call.placed == 0:
            # nothing placed: the first phase holds no more (v + c >= 2)
            bytes_per_device = later
        else:
            first = weights * (2.0 + k) + call.held(stash, count, 1) / replicas
            bytes_per_device = np.maximum(first, later)
        bytes_per_device = bytes_per_device + call.transit(count) / replicas
    elif model == "paper":
        q = -(-np.asarray(in_flight_count) // replicas)
        bytes_per_device = weights * (q + optimizer_state_factor) + np.asarray(stash) * q
    else:
        q = -(-np.asarray(units_after) // replicas)
        bytes_per_device = q * (np.asarray(act) + weights)
    return bytes_per_device


# -- what the runtime holds besides (the pdjax memory model) ----------------------------


@dataclasses.dataclass(frozen=True)
class CallArrays(ModelArrays):
    """:class:`~pdjax.partition.pricing.arrays.ModelArrays` with the bytes per microbatch a call
    places up front (:func:`model_arrays`).

    Attributes:
      inputs: the model's input, placed on the first stage.
      targets: the targets, placed on the last stage: the smaller of the model's output and
        its input (a profile records no targets; labels are no larger than the logits, the
        targets of a language model are its input tokens shifted).
      forward: per layer, forward seconds of one microbatch (0 for a free layer); with
        ``backward``, what tells whether a link keeps up with the stage that feeds it
        (:func:`transit_bytes`).
      backward: per layer, backward seconds of one microbatch.
    """

    inputs: float = 0.0
    targets: float = 0.0
    forward: np.ndarray | None = None
    backward: np.ndarray | None = None


def model_arrays(profile: Profile, microbatch_size: int | None = None) -> CallArrays:
    """The profile's per-layer costs for one microbatch
    (:func:`pdjax.partition.pricing.arrays.model_arrays`), with what a call places up front
    (:class:`CallArrays`).

    Raises:
      PlanError: a bad profile, missing times, or a non-positive microbatch size.
    """
    arrays = layer_arrays(profile, microbatch_size)
    first, last = profile.layers[0], profile.layers[-1]
    # an Input source layer (PipeDream's profiles) is the data: its output is the input
    inputs = first.output_bytes if first.kind.startswith("Input") else first.input_bytes
    targets = min(last.output_bytes, inputs)
    fields = {f.name: getattr(arrays, f.name) for f in dataclasses.fields(arrays)}
    priced = arrays.compute > 0  # (free layers cost nothing, as in compute)
    return CallArrays(
        **fields,
        inputs=float(inputs) * arrays.scale,
        targets=float(targets) * arrays.scale,
        forward=np.where(priced, profile.forward_seconds(), 0.0) * arrays.scale,
        backward=np.where(priced, profile.backward_seconds(), 0.0) * arrays.scale,
    )


def microbatches_per_call(schedule: str, num_microbatches: int, calls: int | None = None) -> int:
    """``N``, the microbatches of one call of the runtime (``Pipeline.run``) that the
    ``pdjax`` memory model charges: ``calls``, or the least that reaches the steady state
    of the weights a call holds (:func:`weight_copies`): one step more than the weight
    versions the schedule keeps (``(v + 1) M``: ``2 M`` for the flush schedules, ``3 M``
    for ``2bw``), ``2 M`` under a schedule that updates every microbatch.

    >>> microbatches_per_call("1f1b", 4), microbatches_per_call("2bw", 4)
    (8, 12)

    Raises:
      PlanError: ``calls`` below 1.
    """
    if calls is None:
        return (_steps_held(schedule) + 1) * int(num_microbatches)
    if isinstance(calls, bool) or not isinstance(calls, int | np.integer) or calls < 1:
        raise PlanError(f"microbatches_per_call must be an integer >= 1, got {calls!r}")
    return int(calls)


def _steps_held(schedule: str) -> int:
    """Steps of updates a stage's weight versions span: the versions kept under a schedule
    that updates once per step (1, or 2 for ``2bw``), 1 under one that updates every
    microbatch."""
    versions = schedule_traits(schedule).versions
    return 1 if versions == "in_flight" else int(versions)


def weight_copies(schedule: str, num_microbatches: int, calls: int) -> float:
    """Parameter-sized buffers a ``pdjax`` stage holds besides its weight versions and
    optimizer state, as the runtime holds them (the simulator's ``runtime`` memory model):
    the step's gradient sum (the update donates it and the optimizer state, so it is also
    the update's transient) and the weights the call started from, alive until it returns,
    once the stage no longer computes with them: a call of ``calls`` microbatches longer
    than the steps its versions span (``v M``: ``M``, ``2 M`` under ``2bw``; one
    microbatch under ``pipedream``).

    >>> weight_copies("1f1b", 4, 8), weight_copies("2bw", 4, 8), weight_copies("2bw", 4, 12)
    (2.0, 1.0, 2.0)
    """
    traits = schedule_traits(schedule)
    step = 1 if traits.update_per_microbatch else num_microbatches
    return 2.0 if calls > _steps_held(schedule) * step else 1.0


def waiting_bytes(schedule: str, stash: np.ndarray | float, act: np.ndarray | float) -> np.ndarray:
    """Bytes a microbatch in flight holds at a stage: its stash, plus, under a schedule
    that splits the backward (zero bubble), the cotangents at the stage's layer outputs
    that ``I`` keeps for ``W`` (``act``; charged for every microbatch in flight, of which
    those between ``I`` and ``W`` are a part)."""
    stash = np.asarray(stash, dtype=np.float64)
    if schedule_traits(schedule).semantics.split_backward:
        return stash + np.asarray(act, dtype=np.float64)
    return stash


@dataclasses.dataclass(frozen=True)
class RuntimeCall:
    """What one call of the runtime (``Pipeline.run`` over ``calls`` microbatches) places
    on a stage and moves through it, for the ``pdjax`` memory model: bytes over all the
    stage's devices (:func:`stage_memory` divides them by its replicas).

    Attributes:
      calls: ``N``, the call's microbatches (:func:`microbatches_per_call`).
      placed: bytes per microbatch placed up front for all ``N`` microbatches, each until
        the stage forwards it (the model's input on the first stage, from there part of
        the stash; the targets on the last): per range, or one number.
      cut_before: bytes per microbatch crossing the cut before the stage (an activation
        in, its gradient out), times the larger round-robin group across it.
      cut_after: the same for the cut after it.
      slow_before: whether the link before the stage takes longer than the action that
        makes the gradients it sends back (the backward, zero bubble's ``I``).
      slow_after: whether the link after it takes longer than its forward.
      update_microbatches: microbatches the stage forwards before its first update, at
        least (``M`` under a schedule that updates once per step, else 1).
    """

    calls: int
    placed: np.ndarray | float = 0.0
    cut_before: np.ndarray | float = 0.0
    cut_after: np.ndarray | float = 0.0
    slow_before: np.ndarray | bool = False
    slow_after: np.ndarray | bool = False
    update_microbatches: int = 1

    def transit(self, in_flight_count: np.ndarray | int) -> np.ndarray:
        """Bytes in transit the stage holds at once (:func:`transit_bytes`), with
        ``in_flight_count`` sent copies queued behind a slow link."""
        # a link slower than the action that feeds it queues what the stage makes, up to
        # what it holds in flight; one that keeps up holds one copy
        return transit_bytes(
            self.cut_before,
            self.cut_after,
            sent_before=np.where(self.slow_before, in_flight_count, 1),
            sent_after=np.where(self.slow_after, in_flight_count, 1),
        )

    def held(self, stash: np.ndarray, in_flight_count: np.ndarray, forwarded: int) -> np.ndarray:
        """The most bytes of the placed inputs and the stash once at least ``forwarded``
        microbatches are forwarded: after ``f`` forwards ``(N - f) placed + min(f, T)
        stash`` (``T``: the in-flight count), whose largest value over ``f >= forwarded``
        is at ``f = forwarded`` or ``f = T``.

        >>> float(RuntimeCall(calls=8, placed=10.0).held(np.array(3.0), np.array(4), 1))
        73.0
        """
        N = self.calls
        T = np.minimum(in_flight_count, N)
        if np.ndim(self.placed) == 0 and self.placed == 0:  # (most stages: only the stash)
            stash_only: np.ndarray = T * stash
            return stash_only
        placed = np.asarray(self.placed, dtype=np.float64)
        f = min(forwarded, N)
        # (N - f) placed + f stash rises to f = T where the stash is the larger, then falls
        rising = np.maximum(T - f, 0) * np.maximum(stash - placed, 0.0)
        held: np.ndarray = (N - f) * placed + np.minimum(f, T) * stash + rising
        return held


def transit_bytes(
    cut_before: np.ndarray | float,
    cut_after: np.ndarray | float,
    *,
    sent_before: np.ndarray | float = 1.0,
    sent_after: np.ndarray | float = 1.0,
) -> np.ndarray:
    """Bytes in transit a stage holds at once: per microbatch crossing each of its cuts
    (``cut_before``, ``cut_after``; a round-robin neighbour's group sends or takes its
    whole group at once, so the caller multiplies by the larger group) one received copy
    waiting for its action, and the copies it sent whose transfers have not ended: one
    where the link keeps up with the action that makes them, else up to the stage's
    in-flight count (``sent_before``: gradients sent back, ``sent_after``: activations
    sent on; :meth:`RuntimeCall.transit`).

    >>> float(transit_bytes(0.0, 3.0)), float(transit_bytes(2.0, 3.0, sent_after=4))
    (6.0, 19.0)
    """
    before = np.asarray(cut_before, dtype=np.float64)
    after = np.asarray(cut_after, dtype=np.float64)
    transit: np.ndarray = before * (1.0 + np.asarray(sent_before)) + after * (
        1.0 + np.asarray(sent_after)
    )
    return transit


def update_microbatches(schedule: str, num_microbatches: int) -> int:
    """Microbatches a stage forwards before its first update, at least: a step's ``M``
    under a schedule that updates once per step, else 1."""
    return 1 if schedule_traits(schedule).update_per_microbatch else int(num_microbatches)


def memory_in_flight(schedule: str, num_stages: int, stage: int, num_microbatches: int) -> int:
    """Microbatches stage ``stage`` of ``num_stages`` (one device each, split) holds between
    its forward and the end of its backward (``B``, or zero bubble's ``W``): the semantics
    table's in-flight bound, what the runtime stashes.

    >>> memory_in_flight("zb-h1", 4, 3, 8), memory_in_flight("1f1b", 4, 3, 8)
    (4, 1)
    """
    steady = 4 * max(num_stages, num_microbatches)  # a stream that reaches every bound
    shape = Shape(groups=num_stages, microbatches=num_microbatches, stream=steady)
    return int(SEMANTICS[schedule].in_flight(shape, stage))


@functools.lru_cache(maxsize=256)
def memory_in_flight_bounds(
    schedule: str, num_microbatches: int, most_stages: int
) -> tuple[np.ndarray, np.ndarray]:
    """``(upper, lower)``, read-only, indexed by ``b`` in ``1..most_stages`` (index 0:
    unused): the most :func:`memory_in_flight` of a stage with at most ``b - 1`` stages
    after it, and the least of one with at least ``b - 1``, over pipelines of up to
    ``most_stages`` stages. The dynamic program knows bounds on the stages after a stage
    but not the stages before it: zero bubble holds ``min(P, M)`` microbatches at every
    stage, the others ``P - s`` (at most ``M`` if they flush) or ``M``.

    >>> [int(x) for x in memory_in_flight_bounds("zb-h1", 8, 4)[0][1:]]
    [4, 4, 4, 4]
    """
    most = {}
    least = {}
    for b in range(1, most_stages + 1):
        counts = [
            memory_in_flight(schedule, P, P - b, num_microbatches)
            for P in range(b, most_stages + 1)
        ]
        most[b], least[b] = max(counts), min(counts)
    upper = np.zeros(most_stages + 1, dtype=np.int64)
    lower = np.zeros(most_stages + 1, dtype=np.int64)
    for b in range(1, most_stages + 1):
        upper[b] = max(most[c] for c in range(1, b + 1))
        lower[b] = min(least[c] for c in range(b, most_stages + 1))
    upper.setflags(write=False)
    lower.setflags(write=False)
    return upper, lower


def calibrated(value: object, what: str) -> float | None:
    """A calibration callable's answer as seconds, or None. Raises PlanError for anything
    that is not None or a finite number >= 0."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float | np.floating | np.integer):
        raise PlanError(f"{what} must return seconds (a number) or None, got {value!r}")
    value = float(value)
    if not value >= 0 or not math.isfinite(value):
        raise PlanError(f"{what} must return finite seconds >= 0 or None, got {value!r}")
    return value


def check_calibration(stage_seconds: object, allreduce_seconds: object, cost_model: str) -> None:
    """Raises PlanError for calibration hooks that are not callables, or under a cost model
    other than ``pdjax`` (``paper`` and ``pipedream-code`` are published formulas)."""
    for name, fn in (("stage_seconds", stage_seconds), ("allreduce_seconds", allreduce_seconds)):
        if fn is None:
            continue
        if not callable(fn):
            raise PlanError(f"{name} must be a callable or None, got {type(fn).__name__}")
        if cost_model != "pdjax":
            raise PlanError(
                f"{name} calibrates the pdjax cost model only; {cost_model} reproduces a "
                "published formula"
            )


def partition_terms(
    arrays: ModelArrays,
    topology: Topology,
    stages: list[tuple[int, int, list[int]]] | list[tuple[int, int, tuple[int, ...]]],
    modes: tuple[str, ...] | list[str],
    *,
    model: str,
    schedule: str,
    num_microbatches: int,
    stage_seconds: StageSeconds | None = None,
    allreduce_seconds: AllreduceSeconds | None = None,
) -> tuple[list[float], list[float]]:
    """``(stage terms, cut terms)`` of a pipeline: per stage its time per microbatch, and
    (``pdjax``, ``paper``) per cut between stages ``t`` and ``t + 1`` its transfer time, or
    (``pipedream-code``) every transfer term the original charges.

    ``stages`` are ``(first, last, device positions)``. A stage's all-reduce is
    hierarchical, as the program and :func:`data_parallel_time` price it: a ring at each
    level up to the innermost one whose group holds all its devices, over the units of
    that level it occupies in one group of the level above (on one level: one ring over
    its ``r`` devices). A cut transfers at the bandwidth (and latency) of the innermost
    level holding both stages.
    """
    u = updates_per_microbatch(schedule, num_microbatches)
    levels = topology.levels

    def level_of(positions: Sequence[int]) -> int:
        return topology.link_level(min(positions), max(positions))

    stage_terms: list[float] = []
    for t, (a, b, positions) in enumerate(stages):
        r = len(positions)
        level = levels[level_of(positions)]
        sl = slice(a, b + 1)
        compute = math.fsum(arrays.compute[sl])
        weights = math.fsum(arrays.params[sl])
        if model == "pdjax":
            measured = None
            if stage_seconds is not None:
                measured = calibrated(stage_seconds(a, b, r, modes[t]), "stage_seconds")
            ar = None
            if allreduce_seconds is not None and r > 1:
                ar = calibrated(allreduce_seconds(weights, tuple(positions)), "allreduce_seconds")
            if ar is None:
                ar = hierarchical_allreduce(topology, positions, weights)
            per = allreduces_per_microbatch(schedule, num_microbatches, modes[t], r)
            own = compute / r if measured is None else measured
            stage_terms.append(own + ar * per)
        else:
            stage_terms.append(
                float(
                    stage_time(
                        model,
                        compute,
                        weights,
                        r,
                        level.bandwidth,
                        updates_per_microbatch=u,
                        first=t == 0,
                    )
                )
            )
    return stage_terms, _cut_terms(arrays, topology, stages, model)


def _cut_terms(
    arrays: ModelArrays,
    topology: Topology,
    stages: Sequence[tuple[int, int, Sequence[int]]],
    model: str,
) -> list[float]:
    """:func:`partition_terms`'s transfer terms: per cut (``pdjax``, ``paper``), or every
    transfer the original charges (``pipedream-code``)."""
    levels = topology.levels

    def level_of(positions: Sequence[int]) -> int:
        return topology.link_level(min(positions), max(positions))

    P = len(stages)
    cut_terms: list[float] = []
    for t in range(P - 1):
        both = list(stages[t][2]) + list(stages[t + 1][2])
        level = levels[level_of(both)]
        before = float(arrays.cut[stages[t][1]])
        if model == "pipedream-code":
            r_next = len(stages[t + 1][2])
            b_next = stages[t + 1][1]
            cut_terms.append(2.0 * before / (level.bandwidth * r_next))
            if t + 1 < P - 1:
                after_level = levels[level_of(list(stages[t + 1][2]) + list(stages[t + 2][2]))]
                cut_terms.append(2.0 * float(arrays.cut[b_next]) / (after_level.bandwidth * r_next))
        else:
            seconds = cut_time(
                model,
                cut_before=before,
                cut_after=0.0,
                m=1,
                bandwidth=level.bandwidth,
                latency=level.latency,
            )
            cut_terms.append(float(seconds))
    return cut_terms


def cut_bandwidth(topology: Topology, a: Sequence[int], b: Sequence[int]) -> float:
    """Bytes/s between device groups ``a`` and ``b`` (positions) when each device talks to
    its counterpart: the innermost level any pair shares, times the parallel links at that
    level (the level's units both groups occupy). The simulator's what-if splits
    (:func:`~pdjax.partition.costs_from_plan` with chunks) balance with it; the planner's
    own cut term (:func:`partition_terms`) charges the level spanning both groups."""
    level = min(topology.link_level(x, y) for x in a for y in b)
    size = topology.group_size(level + 1)
    parallel = len({x // size for x in a} & {y // size for y in b})
    return topology.levels[level].bandwidth * max(1, parallel)


def outer_allreduce_bandwidth(topology: Topology, group: Sequence[int]) -> float:
    """Bytes/s of a ring all-reduce over ``group`` (positions) at its outermost level's
    bandwidth: the simulator's what-if splits balance with it, where the planner prices
    the all-reduce level by level (:func:`hierarchical_allreduce`)."""
    level = max((topology.link_level(group[0], x) for x in group[1:]), default=0)
    return topology.levels[level].bandwidth


def hierarchical_allreduce(topology: Topology, positions: Iterable[int], weights: float) -> float:
    """Seconds of the all-reduce of ``weights`` bytes over the devices at ``positions``:
    at each level ``k`` up to the innermost one whose group holds them all, a ring over
    the level-``k`` units they occupy in one group of level ``k + 1`` (the most in any).

    >>> topo = Topology.from_levels([4, 2], [100.0, 10.0])
    >>> hierarchical_allreduce(topo, [0, 1, 4, 5], 100.0)  # 2 per server, 2 servers
    11.0
    """
    positions = list(positions)
    if len(positions) <= 1:
        return 0.0
    top = topology.link_level(min(positions), max(positions))
    total = 0.0
    for k in range(top + 1):
        unit, group = topology.group_size(k), topology.group_size(k + 1)
        per_group: dict[int, set[int]] = {}
        for p in positions:
            per_group.setdefault(p // group, set()).add(p // unit)
        n = max(len(units) for units in per_group.values())
        level = topology.levels[k]
        total += float(ring_allreduce(weights, n, level.bandwidth, level.latency))
    return total


def round_trip_time(
    stage_terms: list[float],
    cut_terms: list[float],
    in_flight_counts: list[int] | tuple[int, ...],
    units: list[int] | tuple[int, ...],
) -> float:
    """``max_s RT_s / T_s`` (the module doc): ``RT_s = sum_{t>=s} n_t C_t + 2 sum_{s<=t<P-1}
    cut_t``, ``T_s`` the in-flight count of stage ``s`` and ``n_t`` its group size.

    >>> round_trip_time([1.0, 1.0], [0.5], [2, 1], [1, 1])
    1.5
    """
    P = len(stage_terms)
    best = 0.0
    for s in range(P):
        trip = math.fsum(units[t] * stage_terms[t] for t in range(s, P))
        trip += 2.0 * math.fsum(cut_terms[s : P - 1])
        best = max(best, trip / in_flight_counts[s])
    return best


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def data_parallel_time(
    arrays: ModelArrays,
    topology: Topology,
    model: str,
    updates_per_microbatch: float,
    *,
    per_round: bool = False,
    stage_seconds: StageSeconds | None = None,
    allreduce_seconds: AllreduceSeconds | None = None,
) -> float:
    """Seconds per microbatch of data parallelism over the whole topology: every level
    replicates the whole model (PipeDream's data-parallel model, under ``model``).

    ``pdjax`` (whatever ``per_round`` says): data parallelism as
    :class:`pdjax.runners.DataParallel` and ``pdjax.apps.cluster`` run it, a step of ``N``
    microbatches, one per device, then one hierarchical all-reduce (each level's ring,
    ``2 (n_k-1) * lat_k + 2 (n_k-1)/n_k * W / B_k``): ``(C + sum_k allreduce_k) / N``.
    With calibration, ``stage_seconds(0, L-1, N, "round-robin")`` replaces ``C / N`` and
    ``allreduce_seconds(W, all positions)`` the sum of the rings. The other models: every
    level all-reduces ``updates_per_microbatch`` times per microbatch (PipeDream's
    data-parallel model)."""
    value = math.fsum(arrays.compute)
    weights = math.fsum(arrays.params)
    if model == "pdjax":
        N = topology.num_devices
        rings = None
        if allreduce_seconds is not None and N > 1:
            rings = calibrated(allreduce_seconds(weights, tuple(range(N))), "allreduce_seconds")
        if rings is None:
            rings = math.fsum(
                float(ring_allreduce(weights, level.workers, level.bandwidth, level.latency))
                for level in topology.levels
            )
        own = None
        if stage_seconds is not None:
            own = calibrated(
                stage_seconds(0, arrays.num_layers - 1, N, "round-robin" if N > 1 else "split"),
                "stage_seconds",
            )
        return (value / N if own is None else own) + rings / N
    for k, level in enumerate(topology.levels):
        value = float(
            stage_time(
                model,
                value,
                weights,
                level.workers,
                level.bandwidth,
                updates_per_microbatch=updates_per_microbatch,
                first=True,
                inner_units=topology.levels[k - 1].workers if k > 0 else 1,
            )
        )
    return value


def single_device_time(arrays: ModelArrays) -> float:
    """Seconds per microbatch of the whole model on one device."""
    return float(math.fsum(arrays.compute))
