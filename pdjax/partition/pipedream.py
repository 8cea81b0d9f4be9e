"""PipeDream's partitioning optimizer: a dynamic program over layers, devices and levels.

For a topology of levels ``0..K-1`` (innermost first), level ``k`` joining ``n_k`` units::

    A_k(i..j, m) = min( stage_k(i..j, m) [replicated whole],
                        A_k(i..j, m-1)            [with fewer_machines],
                        min over s in i..j-1, m' in 1..m-1 of
                            max( A_k(i..s, m-m'), cut_k(s, m'), stage_k(s+1..j, m') ) )

where ``stage_k`` is the cost model's stage time (see :mod:`pdjax.partition.cost`) of a
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
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np

from pdjax.errors import PlanError
from pdjax.partition import cost
from pdjax.partition.plan import Plan, StagePlan
from pdjax.partition.topology import Topology
from pdjax.profile.profile import Profile

__all__ = ["plan_pipedream"]

# Elements per temporary array of the vectorised min-max step (float64: 32 MiB).
_BUDGET = 1 << 22
# Columns (range ends) per block of that step: blocks skip the cuts after the range's end.
_BLOCK = 128
# Largest cache of per-m' cut-and-stage arrays kept across m (bytes).
_CACHE_BYTES = 1 << 28


@dataclasses.dataclass(frozen=True)
class Node:
    """A stage of a hierarchical configuration: layers ``first..last`` on ``units`` units of
    its level, each running the configuration ``inner`` one level down (None at level 0)."""

    first: int
    last: int
    units: int
    inner: list[Node] | None


@dataclasses.dataclass
class _Table:
    """One level's solution. ``value[m, s, j]``: best value of layers ``start(s)..j`` on ``m``
    units; ``code``: 0 replicated whole, -1 use ``m-1`` units, ``m' > 0`` split off a last
    stage on ``m'`` units, -2 infeasible."""

    n: int
    value: np.ndarray
    code: np.ndarray
    x_fn: Callable[[int, int], np.ndarray]


def _solve_level(
    n: int,
    num_layers: int,
    all_starts: bool,
    whole_fn: Callable[[int], np.ndarray],
    x_fn: Callable[[int, int], np.ndarray],
    x_depends_on_m: bool,
    straight: bool,
    fewer: bool,
) -> _Table:
    """The dynamic program of one level (see the module doc)."""
    L = num_layers
    S = L if all_starts else 1
    value = np.full((n + 1, S, L), np.inf)
    code = np.full((n + 1, S, L), -2, dtype=np.int16)
    cache: dict[int, np.ndarray] = {}
    cacheable = not x_depends_on_m and n * L * L * 8 <= _CACHE_BYTES

    def x_of(m: int, mp: int) -> np.ndarray:
        if not cacheable:
            return x_fn(m, mp)
        if mp not in cache:
            cache[mp] = x_fn(m, mp)
        return cache[mp]

    for m in range(1, n + 1):
        cur, cur_code = value[m], code[m]
        if m == 1 or not straight:
            whole = whole_fn(m)[:S]
            cur[...] = whole
            cur_code[np.isfinite(whole)] = 0
        if fewer and m > 1:
            better = value[m - 1] < cur
            cur[better] = value[m - 1][better]
            cur_code[better] = -1
        splits = [1] if straight else list(range(1, m))
        splits = [mp for mp in splits if mp < m]
        if not splits:
            continue
        for mp in splits:
            x = x_of(m, mp)
            prevs = value[m - mp]
            best = np.full((S, L), np.inf)
            s0 = 0
            while s0 < S:
                width = L - s0
                rows = max(1, _BUDGET // (width * min(width, _BLOCK)))
                s1 = min(S, s0 + rows)
                # Rows s >= s0 have no prefix ending before s0, and the last stage of a
                # range ending at j starts after the cut: only cuts in s0..j1-1 matter.
                for j0 in range(s0, L, _BLOCK):
                    j1 = min(L, j0 + _BLOCK)
                    best[s0:s1, j0:j1] = np.maximum(
                        prevs[s0:s1, s0:j1, None], x[None, s0:j1, j0:j1]
                    ).min(axis=1)
                s0 = s1
            better = best < cur
            cur[better] = best[better]
            cur_code[better] = mp
    return _Table(n, value, code, x_fn)


def _level_stages(table: _Table, row: int, i: int, j: int, m: int) -> list[tuple[int, int, int]]:
    """Stages ``(first, last, units)`` of the best configuration of ``i..j`` on ``m`` units."""
    out = []
    while True:
        c = int(table.code[m, row, j])
        if c == -2:
            raise AssertionError(f"no feasible configuration at {(row, i, j, m)}")
        if c == -1:
            m -= 1
            continue
        if c == 0:
            out.append((i, j, m))
            break
        x = table.x_fn(m, c)
        k = int(np.argmin(np.maximum(table.value[m - c, row], x[:, j])))
        out.append((k + 1, j, c))
        j, m = k, m - c
    return out[::-1]


class _Search:
    """The hierarchical program for one profile, topology and cost model (private)."""

    def __init__(
        self,
        arrays: cost.ModelArrays,
        topology: Topology,
        model: str,
        schedule: str,
        *,
        straight: bool,
        fewer: bool,
        memory_limit: float | None,
        num_microbatches: int,
        optimizer_state_factor: float,
        objective: str = "time",
        round_robin: bool = False,
    ) -> None:
        self.arrays = arrays
        self.topology = topology
        self.model = model
        self.traits = cost.schedule_traits(schedule)
        # Round-robin changes the pdjax model only; paper and pipedream-code price
        # PipeDream's replication already.
        self.rr = round_robin and model == "pdjax"
        self.straight = straight
        self.fewer = fewer
        self.limit = memory_limit
        self.M = num_microbatches
        self.opt = optimizer_state_factor
        self.objective = objective
        L = arrays.num_layers
        self.L = L
        self.valid = np.triu(np.ones((L, L), dtype=bool))
        self.compute = arrays.range_sum(arrays.compute)
        self.weights = arrays.range_sum(arrays.params)
        self.stash = arrays.range_sum(arrays.stash)
        self.act = arrays.range_sum(arrays.act)
        self.layers_after = (L - 1 - np.arange(L))[None, :]
        self.u = 1.0 if self.traits.update_per_microbatch else 1.0 / num_microbatches
        self.cut_ok = arrays.cut_ok
        self.cut = arrays.cut
        self._shift_level: int | None = None
        self._shift: tuple[np.ndarray, np.ndarray, np.ndarray] = ()  # type: ignore[assignment]
        self._whole_num: dict[int, np.ndarray] = {}
        self._whole_shift: dict[int, np.ndarray] = {}

    def _u(self, m: int) -> float:
        """All-reduces per microbatch of a stage on ``m`` units (see pdjax.partition.cost)."""
        if self.rr and self.traits.update_per_microbatch:
            return self.u / m
        return self.u

    def _prices_whole(self, k: int) -> bool:
        """Whether level ``k`` also prices ranges replicated whole at every level below
        (round-robin under ``pipedream``: their all-reduce is rarer than ``u = m`` says)."""
        return (
            self.rr
            and k > 0
            and self.traits.update_per_microbatch
            and self.objective == "time"
            and not self.straight
        )

    def _whole_numerator(self, k: int) -> np.ndarray:
        """``(L, L)``: compute plus the all-reduces of levels ``0..k-1`` of each range
        replicated whole at every level below ``k`` (inf where that does not fit)."""
        if k not in self._whole_num:
            num = self.compute.copy()
            for lower in self.topology.levels[:k]:
                n = lower.workers
                num = num + 2.0 * (n - 1) / n * self.weights / lower.bandwidth
            if self.limit is not None:
                n0 = self.topology.levels[0].workers
                mem = self.own_memory(0, n0, 0)
                if mem is not None:
                    num = np.where(mem <= self.limit, num, np.inf)
            self._whole_num[k] = np.where(self.valid, num, np.inf)
        return self._whole_num[k]

    def _whole_time(self, k: int, m: int, num: np.ndarray, weights: np.ndarray) -> np.ndarray:
        """Time per microbatch of ranges replicated whole below level ``k``, on ``m`` units:
        one group of ``m G`` microbatches (``G``: devices per unit), then the all-reduces."""
        level = self.topology.levels[k]
        ar = 2.0 * (m - 1) / m * weights / level.bandwidth
        return (num + ar) / (m * self.topology.group_size(k))

    # -- per-level terms ------------------------------------------------------------------

    def own_memory(self, k: int, r: int, units_after: int) -> np.ndarray | None:
        """Bytes per device the memory check charges a stage at level ``k``, or None."""
        if self.model == "pipedream-code":
            return cost.stage_memory(
                self.model,
                weights=self.weights,
                stash=0.0,
                act=self.act,
                replicas=r,
                in_flight_count=0,
                versions=0,
                optimizer_state_factor=0.0,
                units_after=units_after,
            )
        if k > 0:
            return None
        levels = self.topology.levels
        outer = self.topology.num_devices - levels[0].workers
        if self.rr:
            return self._round_robin_memory(r, units_after + outer)
        bound = 1 + np.minimum(units_after + outer, self.layers_after)
        if not self.traits.pipelined_in_flight:
            inflight = np.full_like(bound, self.M)
        elif self.traits.flush:
            inflight = np.minimum(bound, self.M)
        else:
            inflight = bound
        versions = inflight if self.traits.versions == "in_flight" else int(self.traits.versions)
        return cost.stage_memory(
            self.model,
            weights=self.weights,
            stash=self.stash,
            act=self.act,
            replicas=r,
            in_flight_count=inflight,
            versions=versions,
            optimizer_state_factor=self.opt,
        )

    def _round_robin_memory(self, r: int, after: int) -> np.ndarray:
        """Bytes per device of a stage on ``r`` devices of the innermost level, ``after``
        devices after it, in a pipeline whose replicated stages are round-robin (the bound
        in :mod:`pdjax.partition.cost`: ``q`` whole stashes and, under ``pipedream``, ``q``
        versions per device)."""
        # pipedream only (the planner has no round-robin for the other schedules).
        q = np.where(self.layers_after == 0, 1, max(1, (2 * (r + after) - 2) // r))
        return cost.stage_memory(
            "pdjax",
            weights=self.weights,
            stash=self.stash,
            act=self.act,
            replicas=r,
            in_flight_count=q * r,
            versions=q,
            optimizer_state_factor=self.opt,
        )

    def stage_value(
        self, k: int, inner: np.ndarray, m: int, units_after: int, first: bool
    ) -> np.ndarray:
        """``(L, L)``: value of stage ``i..j`` on ``m`` units of level ``k`` (inf: invalid)."""
        level = self.topology.levels[k]
        mem = self.own_memory(k, m, units_after)
        if self.objective == "memory":
            out = inner if mem is None else np.maximum(inner, mem)
        else:
            out = cost.stage_time(
                self.model,
                inner,
                self.weights,
                m,
                level.bandwidth,
                updates_per_microbatch=self._u(m),
                first=first,
                inner_units=self.topology.levels[k - 1].workers if k > 0 else 1,
            )
            if self._prices_whole(k):
                whole = self._whole_time(k, m, self._whole_numerator(k), self.weights)
                out = np.minimum(out, whole)
            if self.limit is not None and mem is not None:
                out = np.where(mem <= self.limit, out, np.inf)
        return np.where(self.valid, out, np.inf)

    def split_value(self, k: int, inner: np.ndarray, m: int, mp: int) -> np.ndarray:
        """``(L, L)`` at ``[s, j]``: the last stage ``s+1..j`` on ``mp`` of ``m`` units, with
        the cut after ``s`` (inf where no cut may be)."""
        n = self.topology.levels[k].workers
        bw = self.topology.levels[k].bandwidth
        if self.objective == "time" and not self._checks_memory(k):
            # No memory check at this level: shifted inputs are computed once per level.
            inner_s, weights_s, cut_s = self._shifted(k, inner)
            out = cost.stage_time(
                self.model,
                inner_s,
                weights_s,
                mp,
                bw,
                updates_per_microbatch=self._u(mp),
                inner_units=self.topology.levels[k - 1].workers if k > 0 else 1,
            )
            if self._prices_whole(k):
                if k not in self._whole_shift:
                    shifted = np.full((self.L, self.L), np.inf)
                    shifted[:-1] = self._whole_numerator(k)[1:]
                    shifted[~self.cut_ok] = np.inf
                    self._whole_shift[k] = shifted
                whole = self._whole_time(k, mp, self._whole_shift[k], weights_s)
                out = np.minimum(out, whole, out=out)
            cut = cut_s / mp if self.model == "pipedream-code" else cut_s
            return np.maximum(out, cut, out=out)
        stage = self.stage_value(k, inner, mp, n - m, first=False)
        out = np.full((self.L, self.L), np.inf)
        out[:-1] = stage[1:]
        if self.objective == "time":
            cuts = cost.cut_time(self.model, self.cut[:, None], self.cut[None, :], mp, bw)
            out = np.maximum(out, cuts)
        out[~self.cut_ok] = np.inf
        return out

    def _checks_memory(self, k: int) -> bool:
        """Whether the time objective prunes stages of level ``k`` by memory."""
        return self.limit is not None and (self.model == "pipedream-code" or k == 0)

    def _shifted(self, k: int, inner: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Level ``k``'s stage inputs (``inner``: the time one level down) shifted to
        ``[s, j]`` = range ``s+1..j``, inf where no such stage or cut may be, and the cut
        term for one replica. Computed once per level."""
        if self._shift_level != k:
            valid = np.zeros((self.L, self.L), dtype=bool)
            valid[:-1] = self.valid[1:]
            valid &= self.cut_ok[:, None]
            inner_s = np.full((self.L, self.L), np.inf)
            inner_s[:-1] = inner[1:]
            inner_s[~valid] = np.inf
            weights_s = np.zeros((self.L, self.L))
            weights_s[:-1] = self.weights[1:]
            bw = self.topology.levels[k].bandwidth
            cut_s = cost.cut_time(self.model, self.cut[:, None], self.cut[None, :], 1, bw)
            if self.model != "pipedream-code":
                cut_s = cut_s[:, :1]  # the same for every range end: broadcast a column
            self._shift = (inner_s, weights_s, np.ascontiguousarray(cut_s))
            self._shift_level = k
        return self._shift

    # -- the program --------------------------------------------------------------------

    def solve(self) -> list[_Table]:
        levels = self.topology.levels
        inner = self.compute if self.objective == "time" else np.zeros((self.L, self.L))
        tables = []
        for k, level in enumerate(levels):
            n = level.workers
            final = k == len(levels) - 1

            def whole_fn(m: int, k: int = k, inner: np.ndarray = inner, n: int = n) -> np.ndarray:
                return self.stage_value(k, inner, m, n - m, first=True)

            def x_fn(m: int, mp: int, k: int = k, inner: np.ndarray = inner) -> np.ndarray:
                return self.split_value(k, inner, m, mp)

            depends = self.objective == "memory" or self._checks_memory(k)
            table = _solve_level(
                n, self.L, not final, whole_fn, x_fn, depends, self.straight, self.fewer
            )
            tables.append(table)
            inner = table.value[n]
        return tables

    def best(self, tables: list[_Table]) -> float:
        return float(tables[-1].value[tables[-1].n, 0, self.L - 1])

    def tree(self, tables: list[_Table]) -> list[Node]:
        """The best configuration as a tree: top-level stages, each with the stages one of
        its units runs one level down."""
        top = len(tables) - 1

        def whole(k: int, a: int, b: int) -> list[Node]:  # replicated whole below level k+1
            inner = whole(k - 1, a, b) if k > 0 else None
            return [Node(a, b, self.topology.levels[k].workers, inner)]

        def expand(k: int, i: int, j: int, m: int) -> list[Node]:
            row = 0 if k == top else i
            out = []
            for a, b, r in _level_stages(tables[k], row, i, j, m):
                inner = None
                if k > 0 and self._whole_wins(tables, k, a, b, r):
                    inner = whole(k - 1, a, b)
                elif k > 0:
                    inner = expand(k - 1, a, b, self.topology.levels[k - 1].workers)
                out.append(Node(a, b, r, inner))
            return out

        return expand(top, 0, self.L - 1, tables[top].n)

    def _whole_wins(self, tables: list[_Table], k: int, a: int, b: int, m: int) -> bool:
        """Whether the program priced stage ``a..b`` on ``m`` units of level ``k`` as
        replicated whole at every level below (rather than with the optimal inner
        configuration), so that the tree must say so."""
        if not self._prices_whole(k):
            return False
        lower = tables[k - 1]
        level = self.topology.levels[k]
        w = float(self.weights[a, b])
        general = float(lower.value[lower.n, a, b]) / m
        general += 2.0 * (m - 1) / m * w / level.bandwidth * self._u(m)
        num = np.array(self._whole_numerator(k)[a, b])
        return float(self._whole_time(k, m, num, np.array(w))) <= general

    def flatten(self, tree: list[Node]) -> list[tuple[int, int, list[int]]]:
        """Pipeline stages ``(first, last, device positions)`` of a configuration tree.

        Units are taken in order at every level; a stage replicated on ``r`` units of level
        ``k`` runs the same inner stages in each, so inner stage ``u`` gets the matching
        devices of all ``r`` units (a replica set stays inside the units the program put it
        in: inside one server when it was replicated at the innermost level).
        """

        def place(nodes: list[Node], k: int, base: int) -> list[tuple[int, int, list[int]]]:
            unit = self.topology.group_size(k)
            out: list[tuple[int, int, list[int]]] = []
            offset = 0
            for node in nodes:
                bases = [base + (offset + q) * unit for q in range(node.units)]
                offset += node.units
                if node.inner is None:
                    out.append((node.first, node.last, bases))
                    continue
                subs = [place(node.inner, k - 1, ub) for ub in bases]
                for u, (first, last, _) in enumerate(subs[0]):
                    out.append((first, last, [d for sub in subs for d in sub[u][2]]))
            return out

        return place(tree, len(self.topology.levels) - 1, 0)

    def data_parallel_time(self) -> float:
        return cost.data_parallel_time(
            self.arrays,
            self.topology,
            self.model,
            self.u,
            per_round=self.traits.update_per_microbatch,
        )


def _max_stages(arrays: cost.ModelArrays) -> int:
    return 1 + int(np.count_nonzero(arrays.cut_ok))


def check_options(
    topology: Topology,
    schedule: str,
    cost_model: str,
    num_microbatches: int | None,
    optimizer_state_factor: float,
    memory_limit: float | None,
) -> tuple[int, float | None]:
    """Validates the planner's options; returns ``M`` and the memory limit in force."""
    cost.check_cost_model(cost_model)
    cost.schedule_traits(schedule)
    if not isinstance(topology, Topology):
        raise PlanError(f"topology must be a pdjax Topology, got {type(topology).__name__}")
    if num_microbatches is None:
        num_microbatches = topology.num_devices
    if num_microbatches < 1:
        raise PlanError(f"num_microbatches must be at least 1, got {num_microbatches}")
    if not optimizer_state_factor >= 0 or not math.isfinite(optimizer_state_factor):
        raise PlanError(
            f"optimizer_state_factor must be >= 0 (Adam: 2, SGD: 0), got {optimizer_state_factor}"
        )
    limit = memory_limit if memory_limit is not None else topology.memory_per_device
    if limit is not None and (not limit > 0 or not math.isfinite(limit)):
        raise PlanError(f"memory_limit must be positive bytes, got {limit!r}")
    return int(num_microbatches), None if limit is None else float(limit)


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
) -> Plan:
    """The optimal pipeline configuration by PipeDream's dynamic program.

    Args:
      profile: per-layer costs (a layer sequence or a DAG in topological order).
      topology: workers and bandwidths per level.
      cost_model: ``"pdjax"`` (default), ``"paper"`` or ``"pipedream-code"`` (see
        :mod:`pdjax.partition.cost`).
      schedule: the schedule the plan is for: ``"pipedream"`` (default), ``"1f1b"``,
        ``"gpipe"``, ``"2bw"``, ``"interleaved"``, ``"zb-h1"``; sets the in-flight counts,
        the weight versions and (``pdjax``) how often a replicated stage all-reduces.
      straight: no replication: every unit of every level holds its own stage.
      fewer_machines: allow configurations that leave devices idle when that is faster.
      memory_limit: bytes per device, or None for ``topology.memory_per_device``; stages
        that may not fit are pruned (a sound, possibly conservative check).
      num_microbatches: ``M`` per step (flush schedules, ``2bw``); None: the number of
        devices.
      microbatch_size: samples per microbatch; None: the profile's batch size. Times and
        activation bytes scale linearly with it, parameter bytes do not.
      optimizer_state_factor: optimizer state bytes per parameter byte (Adam 2, SGD 0).
      replication: how replicated stages share their work (see :mod:`pdjax.partition.cost`):
        ``"split"`` (each microbatch split across the stage's devices), ``"round-robin"``
        (PipeDream's: whole microbatches per device, one all-reduce per group; planned for
        ``pipedream`` only, where it all-reduces less: under the other schedules both modes
        all-reduce once per step, and :func:`~pdjax.partition.evaluate_partition` prices a
        round-robin partition for ``gpipe``, ``1f1b`` and ``2bw``), or ``"auto"`` (default):
        round-robin under ``pipedream`` with the ``pdjax`` cost model (under a memory limit,
        the faster of the round-robin and the split plan), else split. Recorded per stage
        (:attr:`StagePlan.replication`; a one-device stage is split); ``paper`` and
        ``pipedream-code`` price PipeDream's replication whatever is recorded.

    Returns:
      The plan; ``plan.time_per_microbatch`` is the program's optimum.

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
    common = dict(
        cost_model=cost_model,
        schedule=schedule,
        straight=straight,
        fewer_machines=fewer_machines,
        memory_limit=memory_limit,
        num_microbatches=num_microbatches,
        microbatch_size=microbatch_size,
        optimizer_state_factor=optimizer_state_factor,
    )
    cost.check_replication(replication, schedule, cost_model)
    mode = cost.resolve_replication(replication, schedule, cost_model)
    limit = memory_limit if memory_limit is not None else topology.memory_per_device
    if replication == "auto" and mode == "round-robin" and limit is not None:
        # Round-robin all-reduces less but may stash more per device: try both.
        found, errors = [], []
        for candidate in ("round-robin", "split"):
            try:
                found.append(solve(profile, topology, replication=candidate, **common))
            except PlanError as e:
                errors.append(e)
        if not found:
            raise errors[-1]
        search, tables = min(found, key=lambda st: st[0].best(st[1]))
    else:
        search, tables = solve(profile, topology, replication=mode, **common)
    flat = search.flatten(search.tree(tables))
    # Under paper and pipedream-code the mode is only recorded (their time is the same).
    rr = search.rr if cost_model == "pdjax" else mode == "round-robin"
    modes = ["round-robin" if rr and len(pos) > 1 else "split" for _, _, pos in flat]
    return build_plan(
        profile,
        topology,
        search.arrays,
        flat,
        cost_model=cost_model,
        schedule=schedule,
        partitioner="pipedream",
        num_microbatches=search.M,
        time_per_microbatch=search.best(tables),
        data_parallel_time=search.data_parallel_time(),
        memory_limit=search.limit,
        optimizer_state_factor=float(optimizer_state_factor),
        options={
            "straight": straight,
            "fewer_machines": fewer_machines,
            "replication": replication,
        },
        microbatch_size=microbatch_size,
        replication=modes,
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
) -> tuple[_Search, list[_Table]]:
    """Validates, checks the memory limit, and runs the program (see :func:`plan_pipedream`).

    ``replication`` is ``"split"`` or ``"round-robin"`` (``"auto"`` is resolved by
    :func:`pdjax.partition.cost.resolve_replication`, without comparing the two).

    Returns the search and its solved tables: ``search.best(tables)`` is the optimum and
    ``search.tree(tables)`` the configuration.
    """
    cost.check_replication(replication, schedule, cost_model)
    replication = cost.resolve_replication(replication, schedule, cost_model)
    if replication == "round-robin" and schedule != "pipedream":
        raise PlanError(
            f"the planner prices round-robin replication for pipedream only: under {schedule} "
            "a replicated stage all-reduces once per step in either mode, and round-robin "
            "stashes whole microbatches per device; plan with replication='split' (or "
            "'auto'), or price a round-robin partition with evaluate_partition"
        )
    M, limit = check_options(
        topology, schedule, cost_model, num_microbatches, optimizer_state_factor, memory_limit
    )
    arrays = cost.model_arrays(profile, microbatch_size)
    n_total = topology.num_devices
    if straight and not fewer_machines and n_total > _max_stages(arrays):
        raise PlanError(
            f"a straight pipeline on {n_total} devices needs {n_total} stages, but the profile "
            f"allows at most {_max_stages(arrays)} ({arrays.num_layers} layers, no cut after "
            "an input layer); pass fewer_machines=True (--fewer-machines), allow replication, "
            "or use fewer devices"
        )
    common = dict(
        straight=straight,
        fewer=fewer_machines,
        num_microbatches=M,
        optimizer_state_factor=float(optimizer_state_factor),
        round_robin=replication == "round-robin",
    )
    if limit is not None:
        mem_search = _Search(
            arrays, topology, cost_model, schedule, memory_limit=None, objective="memory", **common
        )
        smallest = mem_search.best(mem_search.solve())
        if smallest > limit:
            raise PlanError(
                f"no configuration fits in {limit:.6g} bytes per device under the "
                f"{cost_model} cost model and the {schedule} schedule with {replication} "
                f"replication; the smallest limit that "
                f"works is {smallest:.6g} bytes ({smallest / 1e9:.4g} GB). Raise the limit, use "
                "more devices, a smaller microbatch_size, or a schedule that keeps fewer "
                "weight versions (1f1b, 2bw)"
            )
    search = _Search(arrays, topology, cost_model, schedule, memory_limit=limit, **common)
    tables = search.solve()
    if not math.isfinite(search.best(tables)):
        raise PlanError("no feasible configuration (a bug if the options were valid)")
    return search, tables


def build_plan(
    profile: Profile,
    topology: Topology,
    arrays: cost.ModelArrays,
    flat: list[tuple[int, int, list[int]]],
    *,
    cost_model: str,
    schedule: str,
    partitioner: str,
    num_microbatches: int,
    time_per_microbatch: float,
    data_parallel_time: float,
    memory_limit: float | None,
    optimizer_state_factor: float,
    options: dict,
    microbatch_size: int | None,
    replication: list[str] | tuple[str, ...] | None = None,
) -> Plan:
    """Builds a :class:`Plan` from flattened stages, with exact in-flight and memory.

    ``replication``: per stage ``"split"`` or ``"round-robin"`` (None: all split); the
    in-flight counts and versions are those of the schedule with these modes
    (:func:`pdjax.partition.cost.exact_in_flight`)."""
    P = len(flat)
    if schedule == "2bw" and num_microbatches < P:
        raise PlanError(
            f"the 2bw schedule needs at least as many microbatches per step as stages: the "
            f"plan has {P} stages but num_microbatches={num_microbatches}; raise it to {P} or more"
        )
    replicas = [len(positions) for _, _, positions in flat]
    modes = tuple(replication) if replication is not None else ("split",) * P
    modes = tuple("split" if r == 1 else m for m, r in zip(modes, replicas, strict=True))
    units = cost.stage_units(replicas, modes)
    if schedule in ("1f1b", "gpipe", "2bw"):
        for r, n in zip(replicas, units, strict=True):
            if num_microbatches % n:
                raise PlanError(
                    f"a round-robin stage on {r} devices takes groups of {r} microbatches, "
                    f"but the {schedule} step has num_microbatches={num_microbatches}; use a "
                    f"multiple of {n} or replication='split'"
                )
    counts = cost.exact_in_flight(schedule, replicas, modes, num_microbatches)
    stages = []
    memory_model = "pdjax" if cost_model == "pdjax" else "paper"
    for s, (first, last, positions) in enumerate(flat):
        r = len(positions)
        inflight, versions = counts[s]
        sl = slice(first, last + 1)
        memory = cost.stage_memory(
            memory_model,
            weights=math.fsum(arrays.params[sl]),
            stash=math.fsum(arrays.stash[sl]),
            act=math.fsum(arrays.act[sl]),
            replicas=r,
            in_flight_count=inflight,
            versions=versions,
            optimizer_state_factor=optimizer_state_factor,
        )
        stages.append(
            StagePlan(
                first_layer=first,
                last_layer=last,
                devices=tuple(topology.device_id(p) for p in positions),
                in_flight=inflight,
                compute_seconds=math.fsum(arrays.compute[sl]) / r,
                memory_bytes=float(memory),
                replication=modes[s],
            )
        )
    used = sum(len(p) for _, _, p in flat)
    source = profile.meta.get("source", "") if hasattr(profile, "meta") else ""
    return Plan(
        stages=tuple(stages),
        num_layers=arrays.num_layers,
        topology=topology,
        cost_model=cost_model,
        schedule=schedule,
        partitioner=partitioner,
        num_microbatches=num_microbatches,
        microbatch_size=int(microbatch_size or profile.batch_size),
        time_per_microbatch=float(time_per_microbatch),
        single_device_time=cost.single_device_time(arrays),
        data_parallel_time=float(data_parallel_time),
        noam=cost.ceil_div(used, len(flat[0][2])),
        memory_limit=memory_limit,
        options={**options, "optimizer_state_factor": optimizer_state_factor},
        profile_source=str(source),
    )
