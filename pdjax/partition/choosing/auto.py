"""``plan_auto``: the planner chooses everything a pipeline run needs.

For one model (a profile), devices (a topology) and a batch of ``B`` samples per optimizer
step, :func:`plan_auto` searches

* the **schedule**: ``gpipe``, ``1f1b``, ``interleaved`` (``v`` chunks), ``zb-h1`` and the
  other flush schedules pdjax generates; ``pipedream`` and ``2bw`` (stale weights) only
  when the caller allows them;
* the **microbatches** per step ``M`` (divisors of ``B``; the microbatch size is ``B / M``);
* the **stages and replication**: every configuration on all the ``P`` devices when there
  are few (at most ``exhaustive``; contiguous layers, replica counts summing to ``P``; with
  ``straight``, one stage per device: ``sum_k C(L - 1, k - 1) C(P - 1, k - 1)``
  configurations with ``k`` stages, ``C(L - 1, P - 1)`` straight); else
  PipeDream's dynamic program for each (schedule, M), with and without the memory limit,
  each partition then improved by moving one stage boundary at a time while the simulator
  says it is faster (the program prices stages apart, the simulator the whole schedule:
  its optimum may not be the simulator's, chiefly in how many replicas a stage gets);
* per-stage **memory policies** (remat, :mod:`pdjax._memory_policy`): a stage whose
  device group would not fit the memory limit keeps less for its backward, taking the
  policies in order of the time they add (least first, each kept only where it saves more
  than the ones before it): the named ``jax.checkpoint`` policies the profile prices
  (``"dots"``, ``"dots-no-batch"``; ``"offload"`` on request: the planner does not price
  its host transfers), then ``"full"`` recomputation, until it fits;
* for ``pipedream``, the **in-flight depth** (``extra_in_flight``) and, for round-robin
  stages, the **groups in flight** (``in_flight``: ``"full-rate"``, and PipeDream's own
  ``"paper"`` count on request; the two differ only at round-robin stages, where paper
  keeps fewer groups, so less memory and staleness, and runs slower where they differ).
  The combinations the schedule refuses (``"paper"`` with ``extra_in_flight``, ``"paper"``
  for round-robin groups it would deadlock on, e.g. replicas 1-5-2) are skipped, not
  raised: why is in ``plan.options["refused"]``;

and ranks every candidate by the simulator (:func:`pdjax.simulator.simulate` over
:func:`pdjax.partition.costs_from_plan`): predicted seconds per sample (a flush step's
makespan, fill and drain included, over its ``B`` samples; the steady-state period of the
asynchronous schedules), among those whose simulated peak memory fits. The dynamic program
prunes; the simulator decides.

The returned :class:`~pdjax.partition.Plan` holds the choice in its
:attr:`~pdjax.partition.Plan.schedule` (a :class:`~pdjax.schedules.ScheduleSpec`: the
schedule, M, chunks, the memory policy per stage, the in-flight depth and mode) and its
stages, and the diagnostics in ``plan.options["auto"]`` (read with :func:`auto_choice`:
predicted time per sample, peak memory overall and per device group, peak microbatches in flight per
stage, the memory limit held to: the simulator's figures; the plan's own per-stage
``in_flight`` and ``memory_bytes`` are the dynamic program's, priced for another schedule
or at full rate) and, under ``"alternatives"``, the best candidate of every other schedule
(or why none fits), so a user sees why; where ``in_flight`` lists more than one value,
``"alternatives"`` also holds the best candidate of each other value of the winner's
schedule (keyed ``"<schedule> in_flight=<value>"``).

Memory: a candidate fits where the simulator's peak per device group fits the limit. The
simulator prices its planner memory model over the schedule's own stream (one step of
``M``; a ``pipedream`` stream long enough for a steady state), which leaves out what the
runtime holds for a call besides (:mod:`pdjax.simulator.engine`): the inputs and targets
of every microbatch of the call, placed up front, the gradient sum and the weights the
call started from. A caller whose calls are long (``pdjax train`` runs an epoch per call)
gives ``samples_per_call``: each candidate must then also fit by the ``pdjax`` memory
model of its partition for a call of that many samples
(:func:`pdjax.partition.search.evaluate.stage_memory_bytes`, the dynamic program's terms, as it
prices the schedule, with the candidate's recomputation and ``in_flight``), recorded per
plan stage as ``call_memory``; the cap holds the larger of the two.

The simulator's pricing of one candidate is in :mod:`pdjax.partition.choosing.candidates`.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from pdjax._memory_policy import CHECKPOINTED, MEMORY_POLICIES, OFFLOADED, memory_policies
from pdjax.errors import PlanError, ScheduleError
from pdjax.mesh import mesh_size
from pdjax.partition.choosing import meshes as meshes_mod
from pdjax.partition.choosing.candidates import (
    Candidate,
    HostCosts,
    evaluate_candidate,
    policy_arrays,
    policy_deltas,
    price,
    stage_specs,
)
from pdjax.partition.pricing import cost
from pdjax.partition.pricing.traits import SCHEDULE_TRAITS
from pdjax.partition.search.evaluate import stage_memory_bytes
from pdjax.partition.search.partitioners import evaluate_partition
from pdjax.partition.search.pipedream import plan_pipedream
from pdjax.plan.plan import AUTO_DECISION, Plan
from pdjax.plan.topology import Topology
from pdjax.profile import Profile
from pdjax.schedules import IN_FLIGHT, SCHEDULE_KINDS, SCHEDULES, STALE

__all__ = [
    "Candidate",
    "HostCosts",
    "auto_choice",
    "evaluate_candidate",
    "plan_auto",
]

if TYPE_CHECKING:
    from pdjax.partition.choosing.meshes import MeshSearch

_NO_LIMIT = 1e30  # bytes: "no memory limit" for the dynamic program


@dataclasses.dataclass(frozen=True)
class _Space:
    """What every candidate of one :func:`plan_auto` call shares, and the search's knobs."""

    profile: Profile
    topology: Topology
    limit: float | None
    remat: tuple[str, ...]
    batch: int
    straight: bool
    cost_model: str
    factor: float
    host: HostCosts | None
    calibration: Any
    chunks: Sequence[int]
    extra_in_flight: Sequence[int]
    in_flight: Sequence[str]
    exhaustive: int
    samples_per_call: int | None = None
    arrays: dict[int, cost.CallArrays] = dataclasses.field(default_factory=dict)
    #: the mesh search's unit (:mod:`pdjax.partition.choosing.meshes`): stages are split
    #: (a mesh runs no round-robin) and each microbatch splits over a stage's units and
    #: the unit's ``fsdp`` rows
    split_only: bool = False
    unit_rows: int = 1

    def calls(self, name: str, M: int) -> int | None:
        """``N``, the microbatches of one call of schedule ``name`` with ``M`` per step
        (:attr:`samples_per_call` over the microbatch size; whole steps of ``M`` where the
        schedule updates per step, as ``pdjax train`` cuts its epochs), or None."""
        if self.samples_per_call is None:
            return None
        n = self.samples_per_call // (self.batch // M)
        if not SCHEDULE_KINDS[name].semantics.updates_per_microbatch:
            n -= n % M
        return max(n, 1)

    def arrays_of(self, microbatch_size: int) -> cost.CallArrays:
        """The profile's arrays for one microbatch of ``microbatch_size`` samples (kept)."""
        if microbatch_size not in self.arrays:
            self.arrays[microbatch_size] = cost.model_arrays(self.profile, microbatch_size)
        return self.arrays[microbatch_size]


class _Found(NamedTuple):
    """The best fitting plan found for one (schedule, M, v, e, in_flight), with the
    candidate that priced it and whether its partitions were searched exhaustively
    (nothing to refine)."""

    plan: Plan
    candidate: Candidate
    complete: bool


@dataclasses.dataclass
class _Tally:
    """The search's state: per schedule its best fitting candidate (and per schedule and
    ``in_flight`` option), the candidate of least peak memory, why schedules have none,
    the option combinations refused and why, and the best plan per (schedule, M, v, e,
    in_flight)."""

    best: dict[str, Candidate] = dataclasses.field(default_factory=dict)
    closest: Candidate | None = None
    reasons: dict[str, str] = dataclasses.field(default_factory=dict)
    refused: dict[str, str] = dataclasses.field(default_factory=dict)
    plans: dict[tuple[str, int, int, int, str], _Found] = dataclasses.field(default_factory=dict)
    by_option: dict[tuple[str, str], Candidate] = dataclasses.field(default_factory=dict)

    def refuse(self, what: str, why: str) -> None:
        """Records why the option combination ``what`` was skipped (the first reason)."""
        self.refused.setdefault(what, why)

    def consider(self, c: Candidate) -> None:
        if self.closest is None or c.held_memory < self.closest.held_memory:
            self.closest = c
        if not c.fits:
            return
        old = self.best.get(c.schedule)
        if old is None or c.time_per_sample < old.time_per_sample:
            self.best[c.schedule] = c
        key = (c.schedule, c.in_flight_option)
        mine = self.by_option.get(key)
        if mine is None or c.time_per_sample < mine.time_per_sample:
            self.by_option[key] = c


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def plan_auto(
    profile: Profile,
    topology: Topology,
    *,
    batch_size: int | None = None,
    schedules: Sequence[str] | None = None,
    allow_stale: bool = False,
    microbatches: Sequence[int] | None = None,
    memory_limit: float | None = None,
    remat: bool | Sequence[str] = True,
    straight: bool = False,
    cost_model: str = "pdjax",
    optimizer_state_factor: float = 2.0,
    chunks: Sequence[int] = (2,),
    extra_in_flight: Sequence[int] = (0, 1, 2),
    in_flight: Sequence[str] = ("full-rate",),
    refine: bool = True,
    exhaustive: int = 256,
    refine_top: int = 3,
    host: HostCosts | None = None,
    calibration: Any = None,
    samples_per_call: int | None = None,
    meshes: MeshSearch | None = None,
) -> Plan:
    """The fastest configuration the simulator finds that fits the memory limit.

    Args:
      profile: per-layer costs (with times).
      topology: the devices.
      batch_size: ``B``, samples per optimizer step (default: the profile's batch size times the
        topology's devices).
      schedules: the schedules to search (default: every flush schedule pdjax generates, plus
        ``pipedream`` and ``2bw`` with ``allow_stale``).
      allow_stale: also search ``pipedream`` and ``2bw`` (stale weights: not sequential training).
      microbatches: candidate ``M`` (default: every divisor of ``B`` up to ``4 x`` the devices).
      memory_limit: bytes per device (None: ``topology.memory_per_device``; no limit if that is).
      remat: the memory policies a stage may take to fit the limit besides ``"none"``:
        ``True`` (``"dots"`` and ``"dots-no-batch"`` where the profile prices them, and
        ``"full"``), ``False`` (none), or their names (``"offload"`` only so: its host
        transfers are not priced). A policy the profile does not price is refused.
      straight: no replication.
      cost_model: the dynamic program's cost model.
      optimizer_state_factor: optimizer state bytes per parameter byte.
      chunks: ``v`` candidates for ``interleaved``.
      extra_in_flight: candidates for ``pipedream``'s extra depth.
      in_flight: candidates for ``pipedream``'s ``in_flight`` option (``"full-rate"``,
        ``"paper"``; :data:`pdjax.schedules.IN_FLIGHT`), searched for the schedules that
        take it; combinations the schedule refuses are skipped (``options["refused"]``).
      refine: improve the ``refine_top`` fastest configurations of each schedule by moving one
        stage boundary at a time while the simulator finds them faster.
      host: rank candidates no faster than their driver and shared pool allow (:class:`HostCosts`;
        e.g. in-process CPU devices). Default: the simulator alone.
      calibration: price candidates from measured stages, links and all-reduces
        (:class:`pdjax.calibrate.Calibration` for this model, microbatch size and devices; give
        ``microbatches`` so the microbatch size is the calibrated one). The dynamic program still
        prunes on the profile.
      exhaustive: search every configuration of stages and replicas on all the devices when there
        are at most this many (the module doc counts them): small cases are then exact; beyond it,
        the dynamic program's partitions and ``refine``.
      samples_per_call: the samples of one ``Pipeline.run`` call, whose inputs and targets
        the runtime places up front (``pdjax train`` calls it once per epoch, on the whole
        training split): a candidate of ``M`` microbatches of ``B / M`` samples then runs
        calls of ``N = samples_per_call // (B / M)`` microbatches (whole steps of ``M``
        where the schedule updates per step), the dynamic program plans for them, and each
        candidate must fit by the ``pdjax`` memory of such a call too (the module doc).
        None: the dynamic program's shortest steady call
        (:func:`pdjax.partition.pricing.cost.microbatches_per_call`) and the simulator's peak
        alone. Recorded in ``options["auto"]``.
      meshes: also choose each stage's mesh (:mod:`pdjax.partition.choosing.meshes`): a
        :class:`~pdjax.partition.choosing.meshes.MeshSearch` for this profile's model and
        batch (:func:`~pdjax.partition.choosing.meshes.search_meshes`). Every unit it holds
        is searched with everything else; the fastest plan that fits wins, and
        ``plan.options["meshes"]`` records each unit's best (or why none fits).

    Returns:
      The plan of the best candidate (its ``schedule`` the chosen spec),
      ``plan.options["auto"]`` the diagnostics (:func:`auto_choice`) and
      ``plan.options["alternatives"]`` the best candidate of each other schedule
      (``Candidate.to_dict`` form) or why it has none.

    Raises:
      PlanError: for bad options, or a memory limit no candidate fits (the message gives
        the smallest peak memory any candidate reached, and which).
    """
    B = _batch(profile, topology, batch_size)
    names = _schedule_names(schedules, allow_stale)
    counts_in_flight = _in_flight_options(in_flight)
    if samples_per_call is not None and (
        isinstance(samples_per_call, bool) or not isinstance(samples_per_call, int)
    ):
        raise PlanError(f"samples_per_call must be an integer, got {samples_per_call!r}")
    if samples_per_call is not None and samples_per_call < B:
        raise PlanError(f"samples_per_call={samples_per_call} is less than one step of {B} samples")
    space = _Space(
        profile=profile,
        topology=topology,
        limit=topology.memory_per_device if memory_limit is None else memory_limit,
        remat=_allowed_policies(remat, profile),
        batch=B,
        straight=straight,
        cost_model=cost_model,
        factor=optimizer_state_factor,
        host=host,
        calibration=calibration,
        chunks=chunks,
        extra_in_flight=extra_in_flight,
        in_flight=counts_in_flight,
        exhaustive=exhaustive,
        samples_per_call=samples_per_call,
    )
    counts = _microbatch_counts(B, microbatches, topology.num_devices)
    if meshes is not None:
        if calibration is not None:
            raise PlanError(
                "a calibration measured replicated stages: it cannot price meshes; "
                "drop the calibration or the mesh search"
            )
        return _plan_meshes(space, meshes, names, counts, refine=refine, refine_top=refine_top)
    tally = _searched(space, names, counts, refine=refine, refine_top=refine_top)
    return _chosen(space, tally, names)


def _plan_meshes(
    base: _Space,
    search: MeshSearch,
    names: list[str],
    counts: list[int],
    *,
    refine: bool,
    refine_top: int,
) -> Plan:
    """:func:`plan_auto` once per unit of ``search`` (on the topology of units, with the
    unit's per-device profile), the fastest fitting plan on the devices, each unit's best
    in ``options["meshes"]``."""
    topology = base.topology
    found: list[tuple[float, Plan]] = []
    record: list[dict[str, Any]] = []
    misses: list[str] = []  # the units whose closest plan is over the limit
    for unit in search.units():
        label = meshes_mod.describe_unit(unit)
        coarse = meshes_mod.coarse_topology(topology, mesh_size(unit))
        if coarse is None:  # a MeshSearch made for another topology
            record.append({"unit": label, "none": "its devices do not tile the topology"})
            continue
        profile = (
            base.profile
            if unit == meshes_mod.ONE
            else meshes_mod.unit_profile(
                base.profile,
                search.costs[unit],
                topology,
                unit,
                search.rows.get(unit),
                search.collectives,
            )
        )
        host = base.host
        if host is not None:  # each simulated replica is a unit of devices on the pool
            host = dataclasses.replace(host, devices_per_replica=mesh_size(unit))
        space = dataclasses.replace(
            base,
            profile=profile,
            topology=coarse,
            host=host,
            split_only=unit != meshes_mod.ONE,
            unit_rows=dict(unit).get("fsdp", 1),
            arrays={},
        )
        tally = _searched(space, names, counts, refine=refine, refine_top=refine_top)
        if not tally.best:
            c = tally.closest
            if c is None:
                why = "; ".join(f"{k}: {v}" for k, v in tally.reasons.items()) or "no plan"
                record.append({"unit": label, "none": why})
                continue
            per_stage = _over_by(c, space)
            record.append({"unit": label, "none": f"closest {c.label}: {per_stage}"})
            misses.append(label)
            continue
        plan = _chosen(space, tally, names)
        auto = plan.options["auto"]
        record.append(
            {
                "unit": label,
                "time_per_sample": auto["time_per_sample"],
                "peak_memory": auto["peak_memory"],
                "label": min(
                    tally.best.values(), key=lambda c: (c.time_per_sample, c.peak_memory)
                ).label,  # the winner, as _chosen picks it
            }
        )
        found.append((auto["time_per_sample"], meshes_mod.expand(plan, topology, unit)))
    if not found:
        limit = base.limit
        every = "; ".join(f"{r['unit']}: {r['none']}" for r in record)
        if limit is None or not misses:  # nothing could be planned at all
            raise PlanError(f"no mesh could be planned for this model and topology: {every}")
        raise PlanError(
            f"no plan on any mesh fits {limit:.4g} bytes per device; per mesh: {every}: "
            "raise the limit, use more devices, or allow more memory policies"
        )
    _, best = min(found, key=lambda tp: tp[0])
    options = dict(best.options)
    options["meshes"] = {
        "searched": record,
        "annotated": search.annotated,
        "fsdp": search.fsdp,
        "note": None
        if search.annotated
        else "the model has no sharding annotations: only data and fsdp='auto' were searched",
    }
    return dataclasses.replace(best, options=options)


def _over_by(c: Candidate, space: _Space) -> str:
    """Per plan stage, the bytes per device a candidate needs and how far over the limit."""
    from pdjax._units import fmt_bytes

    limit = space.limit or math.inf
    held = c.call_memory or c.group_peak_memory
    peaks = [max(a, b) for a, b in zip(c.group_peak_memory, held, strict=True)]
    return ", ".join(
        f"stage {s} {fmt_bytes(p)}" + (f" ({fmt_bytes(p - limit)} over)" if p > limit else "")
        for s, p in enumerate(peaks)
    )


def _allowed_policies(remat: Any, profile: Profile) -> tuple[str, ...]:
    """The memory policies besides ``"none"`` that :func:`plan_auto`'s ``remat`` allows
    (see there); PlanError for an unknown one, or a named one the profile does not price."""
    priced = [
        p for p in CHECKPOINTED if all(layer.policy(p) is not None for layer in profile.layers)
    ]
    if isinstance(remat, (bool, np.bool_)):
        return (*[p for p in priced if p not in OFFLOADED], "full") if remat else ()
    names = (remat,) if isinstance(remat, str) else tuple(remat)
    bad = [p for p in names if p not in MEMORY_POLICIES]
    if bad:
        raise PlanError(f"remat must be a bool or memory policies of {MEMORY_POLICIES}; got {bad}")
    unpriced = [p for p in names if p in CHECKPOINTED and p not in priced]
    if unpriced:
        raise PlanError(
            f"the profile does not price memory policies {unpriced}: profile the model with "
            "memory_policies=True, or allow only 'full'"
        )
    return tuple(dict.fromkeys(p for p in names if p != "none"))


def _ladders(space: _Space, plan: Plan, name: str, v: int) -> list[list[str]]:
    """Per plan stage, the policies to try in turn while its group does not fit: the
    allowed named ones by the time they add (each only where it keeps less than the ones
    before it), then ``"full"``. Named policies only where each plan stage is one
    simulated stage."""
    kind = SCHEDULE_KINDS[name]
    one = kind.chunks_for(v) == 1 and not kind.semantics.v_shaped
    named = [p for p in space.remat if p != "full"] if one else []
    P = plan.num_stages
    deltas = {p: policy_deltas(plan, space.profile, (p,) * P) for p in named}
    ladders = []
    for s in range(P):
        ladder: list[str] = []
        best = 0.0
        for p in sorted(named, key=lambda p: (deltas[p][s][1], -deltas[p][s][0])):
            if deltas[p][s][0] > best:
                ladder.append(p)
                best = deltas[p][s][0]
        if "full" in space.remat:
            ladder.append("full")
        ladders.append(ladder)
    return ladders


def _batch(profile: Profile, topology: Topology, batch_size: int | None) -> int:
    """``B``: ``batch_size``, by default the profile's batch size on every device."""
    B = batch_size if batch_size is not None else profile.batch_size * topology.num_devices
    if B < 1:
        raise PlanError(f"batch_size must be >= 1, got {batch_size}")
    return B


def _in_flight_options(in_flight: Sequence[str]) -> tuple[str, ...]:
    """The ``in_flight`` candidates, each once, in order; PlanError for an unknown one."""
    if isinstance(in_flight, str):
        in_flight = (in_flight,)
    out = tuple(dict.fromkeys(in_flight))
    bad = [x for x in out if x not in IN_FLIGHT]
    if bad or not out:
        raise PlanError(f"in_flight must list values of {IN_FLIGHT}; got {list(in_flight)}")
    return out


def _schedule_names(schedules: Sequence[str] | None, allow_stale: bool) -> list[str]:
    """The schedules to search: the table's, updates equal to sequential training by
    default, stale weights on request."""
    if schedules is None:
        names = [s for s in SCHEDULES if s not in STALE]
        if allow_stale:
            names += list(STALE)
        return names
    names = list(schedules)
    unknown = [s for s in names if s not in SCHEDULES]
    if unknown:
        raise PlanError(f"unknown schedules {unknown}; choose from {SCHEDULES}")
    stale = [s for s in names if s in STALE]
    if stale and not allow_stale:
        raise PlanError(
            f"{stale} update with stale weights (not sequential training); pass "
            "allow_stale=True (CLI: --allow-stale) to search them"
        )
    return names


def _microbatch_counts(B: int, microbatches: Sequence[int] | None, devices: int) -> list[int]:
    """Candidate ``M``: the given ones (dividing ``B``), or every divisor of ``B`` up to
    ``4 x`` the devices."""
    if microbatches is None:
        return [d for d in _divisors(B) if d <= 4 * devices] or [B]
    counts = sorted(set(int(m) for m in microbatches))
    bad = [m for m in counts if m < 1 or B % m]
    if bad:
        raise PlanError(f"microbatches {bad} do not divide the batch of {B} samples")
    return counts


def _searched(
    space: _Space, names: list[str], counts: list[int], *, refine: bool, refine_top: int
) -> _Tally:
    """The tally of every (schedule, ``M``) searched, then (``refine``) refined."""
    tally = _Tally()
    for name, M in itertools.product(names, counts):
        _search(space, tally, name, M)
    if refine:  # the simulator moves the boundaries of each schedule's best few only
        for name in names:
            _refine_best(space, tally, name, refine_top)
    return tally


def _search(space: _Space, tally: _Tally, name: str, M: int) -> None:
    """Simulates every partition of (schedule ``name``, ``M``) with each chunk count and
    in-flight depth the schedule takes, keeping the best fitting plan of each."""
    try:
        partitions, complete = _partitions(space, name, M, exhaustive=space.exhaustive)
    except (PlanError, ScheduleError) as err:
        tally.reasons.setdefault(name, str(err))
        return
    kind = SCHEDULE_KINDS[name]
    counts = space.in_flight if kind.takes("in_flight") else ("full-rate",)
    for v in space.chunks if kind.chunks is None else (1,):  # the chunks it takes
        for e in space.extra_in_flight if kind.takes("extra_in_flight") else (0,):
            for f in counts:
                if f != "full-rate" and e:  # the schedule refuses it: skipped, said why
                    tally.refuse(
                        f"{name} in_flight={f} +{e}",
                        f"in_flight={f!r} keeps PipeDream's own count; extra_in_flight={e} "
                        "would add to it (the schedule refuses the pair)",
                    )
                    continue
                for plan in partitions:
                    c = _evaluate(space, plan, name, v=v, e=e, f=f, tally=tally)
                    if c is None:
                        continue
                    tally.consider(c)
                    key = (name, M, v, e, f)
                    if c.fits and (key not in tally.plans or _better(c, tally.plans[key])):
                        tally.plans[key] = _Found(plan, c, complete)


def _refine_best(space: _Space, tally: _Tally, name: str, refine_top: int) -> None:
    """:func:`_refine` on the ``refine_top`` fastest plans of schedule ``name``."""
    plans = tally.plans
    mine = sorted(
        (k for k in plans if k[0] == name),
        key=lambda k: plans[k].candidate.time_per_sample,
    )
    for key in mine[:refine_top]:
        found = plans[key]
        if found.complete:
            continue
        c, better = _refine(
            space, found.candidate, found.plan, name, v=key[2], e=key[3], f=key[4], tally=tally
        )
        tally.consider(c)
        if c.fits and c.time_per_sample < found.candidate.time_per_sample:
            plans[key] = _Found(better, c, False)


def _chosen(space: _Space, tally: _Tally, names: list[str]) -> Plan:
    """The winner's plan, with the choice and the alternatives in its options."""
    best, limit = tally.best, space.limit
    if not best:
        if tally.closest is None:
            raise PlanError(
                "no schedule could be planned for this model and topology: "
                + "; ".join(f"{k}: {v}" for k, v in tally.reasons.items())
            )
        raise PlanError(
            f"no configuration fits {limit:.4g} bytes per device; the smallest peak memory "
            f"found is {tally.closest.held_memory:.4g} bytes ({tally.closest.label}"
            + (
                f", for calls of {space.samples_per_call} samples"
                if space.samples_per_call is not None
                else ""
            )
            + "): raise the limit to at least that, or use more devices"
        )
    winner = min(best.values(), key=lambda c: (c.time_per_sample, c.peak_memory))
    plan = next(f.plan for f in tally.plans.values() if f.candidate == winner)
    options = dict(plan.options)
    # the decision is the plan's spec; the diagnostics stay in the options
    options["auto"] = {k: v for k, v in winner.to_dict().items() if k not in AUTO_DECISION}
    if space.host is not None:
        options["auto"]["host"] = dataclasses.asdict(space.host)
    options["auto"]["calibrated"] = space.calibration is not None
    options["auto"]["memory_limit"] = limit  # the limit every candidate was held to
    options["auto"]["samples_per_call"] = space.samples_per_call
    options["alternatives"] = {
        name: (
            best[name].to_dict() if name in best else {"none": tally.reasons.get(name, "no fit")}
        )
        for name in names
        if name != winner.schedule
    }
    if len(space.in_flight) > 1 and SCHEDULE_KINDS[winner.schedule].takes("in_flight"):
        for f in space.in_flight:  # the winner's schedule with each other in-flight count
            if f == winner.in_flight_option:
                continue
            other = tally.by_option.get((winner.schedule, f))
            options["alternatives"][f"{winner.schedule} in_flight={f}"] = (
                other.to_dict()
                if other is not None
                else {"none": tally.refused.get(f"{winner.schedule} in_flight={f}", "no fit")}
            )
    if tally.refused:
        options["refused"] = dict(tally.refused)
    return dataclasses.replace(plan, schedule=winner.spec, options=options)


def auto_choice(plan: Plan) -> dict[str, Any] | None:
    """What :func:`plan_auto` chose for ``plan`` and why, as one record: the decision from
    the plan's spec and stages (``schedule``, ``microbatches``, ``chunks``,
    ``extra_in_flight``, ``in_flight_option``, ``policies``, ``remat``, ``stages``, in
    :meth:`Candidate.to_dict`'s form) with the diagnostics ``plan.options["auto"]`` keeps
    (predicted time per sample, peak memory, the limit held to, ...); None for a plan
    ``plan_auto`` did not make. The one reader of ``options["auto"]``."""
    diagnostics = plan.options.get("auto")
    if not isinstance(diagnostics, dict):
        return None
    spec = plan.schedule
    policies = memory_policies(spec.remat, plan.num_stages, PlanError)
    return {
        "schedule": spec.kind,
        "microbatches": spec.microbatches,
        "chunks": spec.chunks,
        "extra_in_flight": spec.extra_in_flight,
        "in_flight_option": spec.in_flight,
        "remat": [p != "none" for p in policies],
        "policies": list(policies),
        "stages": [[st.first_layer, st.last_layer, st.replicas] for st in plan.stages],
        **diagnostics,
    }


def _better(c: Candidate, found: _Found) -> bool:
    return c.time_per_sample < found.candidate.time_per_sample


def _dp_schedule(name: str) -> str:
    """The schedule the dynamic program prices for ``name`` (the newer zero-bubble
    schedules keep 1F1B's or more in flight: price them as ``zb-h1``)."""
    return SCHEDULE_TRAITS[name].priced


def _replication(name: str) -> str:
    """The dynamic program's replication option for ``name``: ``"auto"`` where it prices
    round-robin (a schedule that updates every microbatch), else ``"split"``."""
    return "auto" if SCHEDULE_KINDS[name].semantics.updates_per_microbatch else "split"


def _partitions(
    space: _Space, name: str, M: int, *, exhaustive: int = 0
) -> tuple[list[Plan], bool]:
    """The dynamic program's plans for (schedule, M): under the memory limit, and without
    it (recomputation may make it fit), replicated and straight; with at most
    ``exhaustive`` configurations on every device (:func:`_configurations`), every one of
    them instead (then the second value is True: the list is complete)."""
    profile, topology, limit, straight = space.profile, space.topology, space.limit, space.straight
    cost_model, factor, size = space.cost_model, space.factor, space.batch // M
    L = len(profile.layers)
    mode = "split" if space.split_only else _replication(name)
    configs = _configurations(L, topology.num_devices, straight, exhaustive)
    plans = []
    for stages in configs or ():
        try:
            plan = evaluate_partition(
                profile,
                topology,
                stages,
                cost_model=cost_model,
                schedule=_dp_schedule(name),
                num_microbatches=M,
                microbatch_size=size,
                optimizer_state_factor=factor,
                memory_limit=limit,
                partitioner="auto",
                replication=mode,
                microbatches_per_call=space.calls(name, M),
            )
        except (PlanError, ScheduleError):  # a form the schedule has not: the others
            continue
        # the runtime splits each microbatch evenly over a split stage's devices
        rows = space.unit_rows
        if all(st.replication != "split" or size % (st.replicas * rows) == 0 for st in plan.stages):
            plans.append(plan)
    if plans:
        return plans, True
    out: list[Plan] = []
    error: Exception | None = None
    # the straight pipeline too (one device per stage): a replicated stage's devices must
    # divide the microbatch, and the program prices neither that nor recomputation
    for mem in [limit, _NO_LIMIT] if limit is not None else [_NO_LIMIT]:
        for pure in (True,) if straight else (False, True):
            try:
                plan = plan_pipedream(
                    profile,
                    topology,
                    memory_limit=mem,
                    cost_model=cost_model,
                    schedule=_dp_schedule(name),
                    straight=pure,
                    num_microbatches=M,
                    microbatch_size=size,
                    optimizer_state_factor=factor,
                    replication=mode,
                    microbatches_per_call=space.calls(name, M),
                )
            except PlanError as e:
                error = e
                continue
            # the program ran without a limit (none, or this cut did not fit it): the plan
            # states the caller's, so that fits_memory and the JSON say what holds
            plan = dataclasses.replace(plan, memory_limit=limit)
            if not any(stage_specs(plan) == stage_specs(p) for p in out):
                out.append(plan)
    if not out and error is not None:
        raise error
    return out, False


def _configurations(
    L: int, P: int, straight: bool, limit: int
) -> list[list[tuple[int, int, int]]] | None:
    """Every ``(first_layer, last_layer, replicas)`` stage list of ``L`` layers that uses
    the ``P`` devices (``straight``: one stage per device), or None when there are more
    than ``limit``: ``C(L - 1, k - 1) C(P - 1, k - 1)`` with ``k`` stages (contiguous
    layers, replica counts summing to ``P``)."""
    ks = [P] if straight else list(range(1, min(L, P) + 1))
    if straight and (P < 2 or P > L):
        return None
    if sum(math.comb(L - 1, k - 1) * math.comb(P - 1, k - 1) for k in ks) > limit:
        return None
    out = []
    for k in ks:
        for cuts in itertools.combinations(range(1, L), k - 1):
            bounds = (0, *cuts, L)
            for splits in itertools.combinations(range(1, P), k - 1):
                devices = (0, *splits, P)
                out.append(
                    [(bounds[i], bounds[i + 1] - 1, devices[i + 1] - devices[i]) for i in range(k)]
                )
    return out


def _evaluate(
    space: _Space, plan: Plan, name: str, *, v: int, e: int, f: str, tally: _Tally
) -> Candidate | None:
    """The candidate of ``plan`` run with schedule ``name``, ``v`` chunks, in-flight depth
    ``e`` and ``in_flight`` option ``f``, with the least recomputation that fits (or none;
    ``tally.reasons`` says why, and ``tally.refused`` where ``f`` is not full rate)."""
    reasons = tally.reasons
    limit = space.limit
    P = plan.num_stages
    policies = ["none"] * P
    uneven = [
        st.replicas * space.unit_rows
        for st in plan.stages
        if st.replication == "split" and plan.microbatch_size % (st.replicas * space.unit_rows)
    ]
    if uneven:  # the runtime splits each microbatch evenly over a split stage's devices
        reasons.setdefault(
            name,
            f"microbatches of {plan.microbatch_size} samples do not split over {uneven[0]} devices",
        )
        return None

    def run() -> tuple[float, tuple[float, ...], tuple[int, ...]]:
        return price(
            plan,
            space.profile,
            name,
            chunks=v,
            remat=policies,
            extra_in_flight=e,
            batch_size=space.batch,
            host=space.host,
            calibration=space.calibration,
            in_flight=f,
        )

    def held(peaks: tuple[float, ...]) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """Per plan stage the call's ``pdjax`` memory (empty without a call length), and
        the larger of it and the simulated peak."""
        if space.samples_per_call is None:
            return (), peaks
        call = _call_memory(space, plan, name, policies, f)
        return call, tuple(max(a, b) for a, b in zip(peaks, call, strict=True))

    try:
        seconds, peaks, in_flight = run()
        call, most = held(peaks)
        if limit is not None and space.remat:
            # only the device groups over the limit keep less: the next policy of each
            ladders = _ladders(space, plan, name, v)
            step = [0] * P
            while True:
                over = [d for d, b in enumerate(most) if b > limit and step[d] < len(ladders[d])]
                if not over:
                    break
                for d in over:
                    policies[d] = ladders[d][step[d]]
                    step[d] += 1
                seconds, peaks, in_flight = run()
                call, most = held(peaks)
    except (PlanError, ScheduleError) as err:
        reasons.setdefault(name, str(err))
        if f != "full-rate":
            tally.refuse(f"{name} in_flight={f}", str(err))
        return None
    peak = max(peaks)
    return Candidate(
        schedule=name,
        microbatches=plan.num_microbatches,
        chunks=v,
        extra_in_flight=e,
        remat=tuple(p != "none" for p in policies),
        policies=tuple(policies),
        stages=stage_specs(plan),
        time_per_sample=seconds,
        peak_memory=peak,
        group_peak_memory=peaks,
        in_flight=in_flight,
        in_flight_option=f,
        call_memory=call,
        fits=limit is None or max(most) <= limit,
    )


def _call_memory(
    space: _Space, plan: Plan, name: str, remat: Sequence[str], in_flight: str
) -> tuple[float, ...]:
    """Bytes per device of each plan stage for one call of :attr:`_Space.samples_per_call`
    samples by the ``pdjax`` memory model, as the dynamic program prices schedule ``name``
    (:func:`~pdjax.partition.search.evaluate.stage_memory_bytes`): with the inputs and targets of
    the whole call placed up front, which the simulated stream leaves out. A stage that
    recomputes keeps only its input per microbatch in flight, and one under a named policy
    each layer's input and the residuals the policy keeps, as the simulator's costs have
    it."""
    priced = SCHEDULE_TRAITS[name].priced
    arrays = space.arrays_of(plan.microbatch_size)
    arrays = policy_arrays(arrays, plan, space.profile, remat)
    topology = plan.topology
    flat = [
        (st.first_layer, st.last_layer, [topology.position(d) for d in st.devices])
        for st in plan.stages
    ]
    takes = SCHEDULE_KINDS[priced].takes("in_flight")
    memory = stage_memory_bytes(
        arrays,
        flat,
        plan.replication,
        topology=topology,
        cost_model="pdjax",
        schedule=priced,
        num_microbatches=plan.num_microbatches,
        optimizer_state_factor=space.factor,
        microbatches_per_call=space.calls(name, plan.num_microbatches),
        in_flight=in_flight if takes else "full-rate",
    )
    return tuple(memory)


def _refine(
    space: _Space,
    c: Candidate,
    plan: Plan,
    name: str,
    *,
    v: int,
    e: int,
    f: str,
    tally: _Tally,
) -> tuple[Candidate, Plan]:
    """Moves one stage boundary by one layer at a time while the simulator finds the
    result faster (or, not fitting yet, smaller)."""

    def key(x: Candidate) -> tuple[bool, float]:
        return (not x.fits, x.time_per_sample if x.fits else x.peak_memory)

    for _ in range(4 * len(space.profile.layers)):
        improved = False
        stages = list(c.stages)
        for b in range(len(stages) - 1):
            for delta in (-1, 1):
                first, last, r = stages[b]
                _, nxt_last, nxt_r = stages[b + 1]
                cut = last + delta
                if cut < first or cut + 1 > nxt_last:
                    continue
                moved = list(stages)
                moved[b] = (first, cut, r)
                moved[b + 1] = (cut + 1, nxt_last, nxt_r)
                try:
                    other = evaluate_partition(
                        space.profile,
                        space.topology,
                        moved,
                        cost_model=space.cost_model,
                        schedule=_dp_schedule(name),
                        num_microbatches=plan.num_microbatches,
                        microbatch_size=plan.microbatch_size,
                        optimizer_state_factor=space.factor,
                        memory_limit=space.limit,
                        partitioner="auto",
                        replication=list(plan.replication),
                        microbatches_per_call=space.calls(name, plan.num_microbatches),
                    )
                except (PlanError, ScheduleError):
                    continue
                d = _evaluate(space, other, name, v=v, e=e, f=f, tally=tally)
                if d is not None and key(d) < key(c):
                    c, plan, improved = d, other, True
                    break
            if improved:
                break
        if not improved:
            break
    return c, plan
