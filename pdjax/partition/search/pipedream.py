"""PipeDream's partitioning optimizer: a dynamic program over layers, devices and levels.

For a topology of levels ``0..K-1`` (innermost first), level ``k`` joining ``n_k`` units::

    A_k(i..j, m) = min( stage_k(i..j, m) [replicated whole],
                        A_k(i..j, m-1)            [with fewer_machines],
                        min over s in i..j-1, m' in 1..m-1 of
                            max( A_k(i..s, m-m'), cut_k(s, m'), stage_k(s+1..j, m') ) )

where ``stage_k`` is the cost model's stage time (see :mod:`pdjax.partition.pricing.cost`) of a
range whose time one level down is ``A_{k-1}(i..j, n_{k-1})`` (at level 0, the range's
compute), and ``cut_k`` the transfer across the cut after ``s``. The top level is solved for
ranges starting at layer 0 only; the lower levels for every range, as the original does.
The result is the minimum over all hierarchical configurations of the slowest stage or link.

Cuts follow the profile's topological order: a stage holds a contiguous range of it, so
for a DAG (ResNet, GNMT, Inception) every cut is an antichain cut along one topological
order, and the bytes crossing it are every output produced before the cut and consumed
after it. PipeDream's own optimizer searches the cuts of all topological orders (all
antichains); for chains (VGG, AlexNet) the two coincide.

The program is vectorised with NumPy: the inner ``min over s`` of a ``max`` is one
array reduction per ``(m, m')``.

Replication modes (``pdjax`` cost model): the program prices every replicated stage either
as *split* (each microbatch split across the stage's devices) or as *round-robin*
(PipeDream's: whole microbatches per device, one all-reduce per group), and records the
mode in each :class:`~pdjax.partition.StagePlan`. ``replication="auto"`` (the default)
takes round-robin where it is cheaper, i.e. under ``pipedream``, whose split stages
all-reduce every microbatch; under a memory limit it solves both ways and keeps the faster
plan. The modes are chosen per plan, not mixed within one: a round-robin plan's one-device
stages are split (the two are the same on one device).

Calibration (``pdjax`` only): ``stage_seconds(first_layer, last_layer, replicas,
replication) -> seconds or None`` is the measured seconds per microbatch of a stage's
compute (forward + backward + update) on one of its devices, for its share of the
microbatch; it replaces ``C / m`` where it returns a number. The program asks it for every
range and every replica count of the innermost level (``L (L+1) / 2`` calls per count:
cache or tabulate expensive measurements); on more levels ``replicas`` there is the count
inside a unit of the innermost level, and the plan's final evaluation asks again with each
stage's total replicas. ``allreduce_seconds(param_bytes, devices) -> seconds or None`` is
the measured seconds of one all-reduce; ``devices`` is a count inside the program
(innermost level; once per distinct byte count and count) and the tuple of device
positions in the final evaluation. Plans made with either record
``plan.options["calibrated"]``.

The modules: :mod:`~pdjax.partition.search.levels` (one level's program),
:mod:`~pdjax.partition.search.space` (the levels, their terms and memory checks),
:mod:`~pdjax.partition.search.round_trip` (the round-trip bound on one level),
:mod:`~pdjax.partition.search.evaluate` (a partition priced and made a plan); this one drives them.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from pdjax.errors import PlanError
from pdjax.partition.pricing import cost
from pdjax.partition.search.evaluate import (
    Flat,
    build_plan,
    calibrated_options,
    check_options,
    pipeline_time,
)
from pdjax.partition.search.levels import Table
from pdjax.partition.search.round_trip import round_trip_exact, search_round_trip
from pdjax.partition.search.space import Search
from pdjax.plan.plan import Plan
from pdjax.plan.topology import Topology
from pdjax.profile import Profile

__all__ = ["plan_pipedream", "solve"]


def plan_pipedream(
    profile: Profile,
    topology: Topology,
    *,
    cost_model: str = "pdjax",
    schedule: str = "pipedream",
    straight: bool = False,
    fewer_machines: bool = False,
    memory_limit: float | None = None,
    num_microbatches: int | None = None,
    microbatch_size: int | None = None,
    optimizer_state_factor: float = 2.0,
    replication: str = "auto",
    stage_seconds: cost.StageSeconds | None = None,
    allreduce_seconds: cost.AllreduceSeconds | None = None,
    microbatches_per_call: int | None = None,
    in_flight: str = "full-rate",
) -> Plan:
    """The optimal pipeline configuration by PipeDream's dynamic program.

    Args:
      profile: per-layer costs (a layer sequence or a DAG in topological order).
      topology: workers and bandwidths per level.
      cost_model: ``"pdjax"`` (default), ``"paper"`` or ``"pipedream-code"`` (see
        :mod:`pdjax.partition.pricing.cost`).
      schedule: the schedule the plan is for: ``"pipedream"`` (default), ``"1f1b"``,
        ``"gpipe"``, ``"2bw"``, ``"interleaved"``, ``"zb-h1"``; sets the in-flight counts,
        the weight versions and (``pdjax``) how often a replicated stage all-reduces.
      straight: no replication: every unit of every level holds its own stage.
      fewer_machines: allow configurations that leave devices idle when that is faster.
      memory_limit: bytes per device, or None for ``topology.memory_per_device``; how it
        is checked: :mod:`pdjax.partition.pricing.cost` (``plan.options["memory_check"]``).
      num_microbatches: ``M`` per step (flush schedules, ``2bw``); None: the number of devices.
      microbatch_size: samples per microbatch; None: the profile's batch size. Times and
        activation bytes scale linearly with it, parameter bytes do not.
      optimizer_state_factor: optimizer state bytes per parameter byte (Adam 2, SGD 0).
      replication: how replicated stages share their work (the module doc): ``"split"``,
        ``"round-robin"`` (planned for ``pipedream`` only, where it all-reduces less;
        :func:`~pdjax.partition.evaluate_partition` prices a round-robin partition for ``gpipe``,
        ``1f1b`` and ``2bw``), or ``"auto"`` (default): round-robin under ``pipedream`` with the
        ``pdjax`` cost model (the faster plan of both under a memory limit), else split. Recorded
        per stage (:attr:`StagePlan.replication`; a one-device stage is split).
      stage_seconds, allreduce_seconds: calibration (``pdjax`` only; the module doc):
        measured seconds of a stage's compute share and of one all-reduce, or None for the
        formulas.
      microbatches_per_call: ``pdjax``'s memory terms: the microbatches of one
        ``Pipeline.run`` call, whose inputs the runtime places up front (None: the shortest
        steady call, :func:`pdjax.partition.pricing.cost.microbatches_per_call`).
      in_flight: ``pipedream``'s option, ``"full-rate"`` (default) or ``"paper"``. The
        two counts differ only at round-robin stages, and there the program's round-trip
        bound (Little's law over microbatches) does not price paper's: its groups move
        whole and serialise (replicas 1-3-1 with unit costs: the bound gives 4 with
        paper's counts, 3 with full rate's; the schedule runs at 7). So ``"paper"`` is
        planned only without round-robin stages (``replication="split"``, or ``straight``;
        the counts are then ``P - s`` either way); for round-robin, plan at full rate and
        let the simulator price paper (:func:`~pdjax.partition.plan_auto` with
        ``in_flight=("paper",)``, :func:`~pdjax.partition.choosing.candidates.evaluate_candidate`).

    Returns:
      The plan; ``plan.time_per_microbatch`` is its period under the cost model: the
      program's optimum, with the round-trip bound (``pdjax``; see the module doc).

    Raises:
      PlanError: a bad profile or option, a straight pipeline with more devices than the
        profile has stages, or a memory limit no configuration satisfies (the message gives
        the smallest limit that works).

    >>> from pdjax.profile import LayerProfile, Profile
    >>> layers = [LayerProfile(f"l{i}", forward_seconds=t, backward_seconds=2 * t,
    ...                        param_bytes=1000, output_bytes=100)
    ...           for i, t in enumerate([0.01, 0.01, 0.04, 0.03])]
    >>> plan = plan_pipedream(Profile.chain(layers, batch_size=8), Topology.flat(2, 1e9),
    ...                       straight=True)
    >>> plan.describe().splitlines()[0]
    '1-1: stage 0 = layers 0-2 x1, stage 1 = layers 3-3 x1'
    """
    cost.check_replication(replication, schedule, cost_model)
    cost.check_calibration(stage_seconds, allreduce_seconds, cost_model)
    cost.check_in_flight(schedule, in_flight)
    common: dict[str, Any] = dict(  # forwarded to solve
        cost_model=cost_model,
        schedule=schedule,
        straight=straight,
        fewer_machines=fewer_machines,
        memory_limit=memory_limit,
        num_microbatches=num_microbatches,
        microbatch_size=microbatch_size,
        optimizer_state_factor=optimizer_state_factor,
        stage_seconds=stage_seconds,
        allreduce_seconds=allreduce_seconds,
        microbatches_per_call=microbatches_per_call,
    )
    options = {"straight": straight, "fewer_machines": fewer_machines, "replication": replication}
    options.update(calibrated_options(stage_seconds, allreduce_seconds))
    modes = _modes_to_try(replication, schedule, cost_model, memory_limit, topology)
    if in_flight != "full-rate":
        _check_paper_priced(modes, straight, topology)
        options["in_flight"] = in_flight
    return _fastest(profile, topology, modes, options, common)


def _check_paper_priced(modes: tuple[str, ...], straight: bool, topology: Topology) -> None:
    """Raises PlanError where the program would plan round-robin stages for ``in_flight=
    "paper"``: its round-trip bound cannot price paper's groups (:func:`plan_pipedream`)."""
    if straight or topology.num_devices == 1 or "round-robin" not in modes:
        return
    raise PlanError(
        "in_flight='paper' cannot be planned by the dynamic program with round-robin "
        "stages: its round-trip bound (Little's law over microbatches) does not price "
        "paper's whole groups (replicas 1-3-1 with unit costs: a bound of 4 against 7 "
        "simulated). Plan with in_flight='full-rate', or replication='split' (the counts "
        "are then P - s either way), or let the simulator price paper: plan_auto(..., "
        "in_flight=('paper',)) or evaluate_candidate(..., in_flight='paper')"
    )


def _modes_to_try(
    replication: str,
    schedule: str,
    cost_model: str,
    memory_limit: float | None,
    topology: Topology,
) -> tuple[str, ...]:
    """The replication modes to plan with: the one ``replication`` stands for, or, for
    ``"auto"`` resolved to round-robin under a memory limit, round-robin and split."""
    mode = cost.resolve_replication(replication, schedule, cost_model)
    limit = memory_limit if memory_limit is not None else topology.memory_per_device
    # Round-robin all-reduces less but may stash more per device: under a limit, try both.
    both = replication == "auto" and mode == "round-robin" and limit is not None
    return ("round-robin", "split") if both else (mode,)


def _fastest(
    profile: Profile,
    topology: Topology,
    modes: tuple[str, ...],
    options: dict[str, Any],
    common: dict[str, Any],
) -> Plan:
    """The faster of the plans of ``modes`` (:func:`_plan_mode`); the last error if none."""
    found, errors = [], []
    for mode in modes:
        try:
            found.append(_plan_mode(profile, topology, mode, options, common))
        except PlanError as e:
            errors.append(e)
    if not found:
        raise errors[-1]
    return min(found, key=lambda plan: plan.time_per_microbatch)


def _plan_mode(
    profile: Profile,
    topology: Topology,
    mode: str,
    options: dict[str, Any],
    common: dict[str, Any],
) -> Plan:
    """The plan for one replication mode: under ``pdjax`` with a memory limit, the program
    with the optimistic memory check first, kept if its plan fits (then optimal among all
    that fit), else the program with the sound check."""
    limit = common["memory_limit"]
    if limit is None:
        limit = topology.memory_per_device
    if common["cost_model"] == "pdjax" and limit is not None:
        try:
            search, tables = solve(
                profile, topology, replication=mode, memory_mode="optimistic", **common
            )
        except PlanError:
            pass  # nothing fits even optimistically: the sound program says how much it needs
        else:
            plan = _finish(
                search, tables, profile, topology, {**options, "memory_check": "verified"}
            )
            if plan.fits_memory:
                return plan
        search, tables = solve(profile, topology, replication=mode, memory_mode="bound", **common)
        return _finish(search, tables, profile, topology, {**options, "memory_check": "bound"})
    search, tables = solve(profile, topology, replication=mode, **common)
    extra = {} if limit is None else {"memory_check": "bound"}
    return _finish(search, tables, profile, topology, {**options, **extra})


def _finish(
    search: Search,
    tables: list[Table],
    profile: Profile,
    topology: Topology,
    options: dict[str, Any],
) -> Plan:
    """The plan of a solved program: its configuration, with the round trip (``pdjax``)
    optimised on one level, evaluated on more (see the module doc)."""
    flat = search.flatten(search.tree(tables))
    time = search.best(tables)
    rr = search.rr

    def modes_of(stages: Flat) -> list[str]:
        return ["round-robin" if rr and len(pos) > 1 else "split" for _, _, pos in stages]

    def terms(stages: Flat) -> tuple[float, float]:
        """``(slowest term, round trip)`` of ``stages`` (:func:`pipeline_time`)."""
        return pipeline_time(
            search.arrays,
            topology,
            stages,
            modes_of(stages),
            cost_model=search.model,
            schedule=search.schedule,
            num_microbatches=search.M,
            stage_seconds=search.stage_seconds,
            allreduce_seconds=search.allreduce_seconds,
        )

    def exact(stages: Flat) -> float:
        return max(terms(stages))

    if cost.has_round_trip(search.schedule, search.model):
        _, trip = terms(flat)
        # (within rounding of the program's optimum, the program's value stands)
        trip = trip if trip > time * (1 + 1e-12) else 0.0
        if trip > time and topology.num_levels == 1:
            flat, time = search_round_trip(search, flat, time, max(time, trip), exact)
            options = {
                **options,
                "round_trip": "optimal" if round_trip_exact(search) else "relaxed",
            }
        elif trip > time:
            time = trip
            options = {**options, "round_trip": "evaluated"}
    if search.model == "pdjax":
        # Under paper and pipedream-code the mode is only recorded (their time is the same).
        modes = modes_of(flat)
    else:
        rr_recorded = options.get("replication") == "round-robin"
        modes = ["round-robin" if rr_recorded and len(pos) > 1 else "split" for _, _, pos in flat]
    return build_plan(
        profile,
        topology,
        search.arrays,
        flat,
        cost_model=search.model,
        schedule=search.schedule,
        partitioner="pipedream",
        num_microbatches=search.M,
        time_per_microbatch=time,
        data_parallel_time=search.data_parallel_time(),
        memory_limit=search.limit,
        optimizer_state_factor=float(search.opt),
        options=options,
        microbatch_size=search.microbatch_size,
        replication=modes,
        microbatches_per_call=search.calls,
        in_flight=str(options.get("in_flight", "full-rate")),
    )


def solve(
    profile: Profile,
    topology: Topology,
    *,
    cost_model: str = "pdjax",
    schedule: str = "pipedream",
    straight: bool = False,
    fewer_machines: bool = False,
    memory_limit: float | None = None,
    num_microbatches: int | None = None,
    microbatch_size: int | None = None,
    optimizer_state_factor: float = 2.0,
    replication: str = "split",
    memory_mode: str = "bound",
    stage_seconds: cost.StageSeconds | None = None,
    allreduce_seconds: cost.AllreduceSeconds | None = None,
    microbatches_per_call: int | None = None,
) -> tuple[Search, list[Table]]:
    """Validates, checks the memory limit, and runs the program (see :func:`plan_pipedream`).

    ``replication`` is ``"split"`` or ``"round-robin"`` (``"auto"`` is resolved by
    :func:`pdjax.partition.pricing.cost.resolve_replication`, without comparing the two).
    ``memory_mode``: ``"bound"`` (the sound check) or ``"optimistic"`` (``pdjax``: a lower
    bound; the plan must be verified).

    Returns the search and its solved tables: ``search.best(tables)`` is the optimum and
    ``search.tree(tables)`` the configuration.
    """
    cost.check_replication(replication, schedule, cost_model)
    cost.check_calibration(stage_seconds, allreduce_seconds, cost_model)
    if memory_mode not in ("bound", "optimistic"):
        raise PlanError(f"memory_mode must be 'bound' or 'optimistic', got {memory_mode!r}")
    replication = cost.resolve_replication(replication, schedule, cost_model)
    _check_priced_replication(replication, schedule)
    M, limit = check_options(
        topology,
        schedule=schedule,
        cost_model=cost_model,
        num_microbatches=num_microbatches,
        optimizer_state_factor=optimizer_state_factor,
        memory_limit=memory_limit,
    )
    arrays = cost.model_arrays(profile, microbatch_size)
    _check_straight(arrays, topology.num_devices, straight=straight, fewer=fewer_machines)
    common: dict[str, Any] = dict(  # forwarded to both searches
        straight=straight,
        fewer=fewer_machines,
        num_microbatches=M,
        optimizer_state_factor=float(optimizer_state_factor),
        round_robin=replication == "round-robin",
        memory_mode=memory_mode,
        microbatches_per_call=microbatches_per_call,
    )
    if limit is not None:
        mem_search = Search(
            arrays, topology, cost_model, schedule, memory_limit=None, objective="memory", **common
        )
        _check_fits(
            mem_search.best(mem_search.solve()),
            limit,
            cost_model=cost_model,
            schedule=schedule,
            replication=replication,
            memory_mode=memory_mode,
        )
    search = Search(
        arrays,
        topology,
        cost_model,
        schedule,
        memory_limit=limit,
        stage_seconds=stage_seconds,
        allreduce_seconds=allreduce_seconds,
        **common,
    )
    search.microbatch_size = microbatch_size
    tables = search.solve()
    if not math.isfinite(search.best(tables)):
        raise PlanError("no feasible configuration (a bug if the options were valid)")
    return search, tables


def _check_priced_replication(replication: str, schedule: str) -> None:
    """Raises PlanError for round-robin under a schedule the planner does not price it
    for: it does where every microbatch updates (one all-reduce per group instead)."""
    if replication != "round-robin" or cost.schedule_traits(schedule).update_per_microbatch:
        return
    priced = [n for n, t in cost.SCHEDULE_TRAITS.items() if t.update_per_microbatch]
    raise PlanError(
        f"the planner prices round-robin replication for {', '.join(priced)} only: under "
        f"{schedule} a replicated stage all-reduces once per step in either mode, and "
        "round-robin stashes whole microbatches per device; plan with replication='split' "
        "(or 'auto'), or price a round-robin partition with evaluate_partition"
    )


def _check_straight(arrays: cost.ModelArrays, devices: int, *, straight: bool, fewer: bool) -> None:
    """Raises PlanError for a straight pipeline with more devices than the profile allows
    stages (without ``fewer_machines``)."""
    most = 1 + int(np.count_nonzero(arrays.cut_ok))
    if straight and not fewer and devices > most:
        raise PlanError(
            f"a straight pipeline on {devices} devices needs {devices} stages, but the profile "
            f"allows at most {most} ({arrays.num_layers} layers, no cut after "
            "an input layer); pass fewer_machines=True (--fewer-machines), allow replication, "
            "or use fewer devices"
        )


def _check_fits(
    smallest: float,
    limit: float,
    *,
    cost_model: str,
    schedule: str,
    replication: str,
    memory_mode: str,
) -> None:
    """Raises PlanError when the least memory any configuration needs (``smallest``) is
    over ``limit``."""
    if smallest <= limit:
        return
    if memory_mode == "optimistic":
        raise PlanError(f"no configuration needs less than {smallest:.6g} bytes")
    raise PlanError(
        f"no configuration fits in {limit:.6g} bytes per device under the "
        f"{cost_model} cost model and the {schedule} schedule with {replication} "
        f"replication; the smallest limit that "
        f"works is {smallest:.6g} bytes ({smallest / 1e9:.4g} GB). Raise the limit, use "
        "more devices, a smaller microbatch_size, or a schedule that keeps fewer "
        "weight versions (1f1b, 2bw)"
    )
