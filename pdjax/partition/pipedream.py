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
from typing import Any

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
        memory_mode: str = "bound",
        stage_seconds: cost.StageSeconds | None = None,
        allreduce_seconds: cost.AllreduceSeconds | None = None,
    ) -> None:
        self.arrays = arrays
        self.schedule = schedule
        self.memory_mode = memory_mode if model == "pdjax" else "bound"
        self.stage_seconds = stage_seconds if model == "pdjax" else None
        self.allreduce_seconds = allreduce_seconds if model == "pdjax" else None
        self.calibrated = self.stage_seconds is not None or self.allreduce_seconds is not None
        self._cal: dict[int, tuple[np.ndarray, np.ndarray | None]] = {}
        self.update_copies = cost.update_copies(schedule, optimizer_state_factor)
        self.microbatch_size: int | None = None
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
                num = num + cost.ring_allreduce(
                    self.weights, lower.workers, lower.bandwidth, lower.latency
                )
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
        ar = cost.ring_allreduce(weights, m, level.bandwidth, level.latency)
        seconds: np.ndarray = (num + ar) / (m * self.topology.group_size(k))
        return seconds

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
        if self.memory_mode == "optimistic":
            return self._optimistic_memory(r)
        levels = self.topology.levels
        outer = self.topology.num_devices - levels[0].workers
        if self.rr:
            return self._round_robin_memory(r, units_after + outer)
        inflight, versions = self._in_flight(1 + np.minimum(units_after + outer, self.layers_after))
        return self._memory(self.model, r, inflight, versions)

    def _in_flight(self, bound: np.ndarray) -> tuple[np.ndarray, Any]:
        """``(in flight, versions)`` per range under the schedule, from the microbatches a
        pipelined stage holds (``bound``)."""
        if not self.traits.pipelined_in_flight:
            inflight = np.full_like(bound, self.M)
        elif self.traits.flush:
            inflight = np.minimum(bound, self.M)
        else:
            inflight = bound
        versions = inflight if self.traits.versions == "in_flight" else int(self.traits.versions)
        return inflight, versions

    def _memory(self, model: str, replicas: int, inflight: Any, versions: Any) -> np.ndarray:
        """:func:`pdjax.partition.cost.stage_memory` of every range on ``replicas`` devices."""
        return cost.stage_memory(
            model,
            weights=self.weights,
            stash=self.stash,
            act=self.act,
            replicas=replicas,
            in_flight_count=inflight,
            versions=versions,
            optimizer_state_factor=self.opt,
            update_copies=self.update_copies if model == "pdjax" else 0.0,
        )

    def _optimistic_memory(self, r: int) -> np.ndarray:
        """A lower bound of the ``pdjax`` bytes per device of a stage on ``r`` devices of the
        innermost level, whatever the rest of the plan: in flight at least 2 before the
        model's last stage (1 for it), and replicated on at most ``r`` devices of each unit
        of the outer levels. A plan the program finds under it must be verified."""
        last = self.layers_after == 0
        bound = np.where(last, 1, 2)
        if self.rr:
            return self._memory("pdjax", r, bound * r, bound)
        inflight, versions = self._in_flight(bound)
        outer = self.topology.num_devices // self.topology.levels[0].workers
        return self._memory("pdjax", r * outer, inflight, versions)

    def _round_robin_memory(self, r: int, after: int) -> np.ndarray:
        """Bytes per device of a stage on ``r`` devices of the innermost level, ``after``
        devices after it, in a pipeline whose replicated stages are round-robin (the bound
        in :mod:`pdjax.partition.cost`: ``q`` whole stashes and, under ``pipedream``, ``q``
        versions per device)."""
        # pipedream only (the planner has no round-robin for the other schedules).
        q = np.where(self.layers_after == 0, 1, max(1, (2 * (r + after) - 2) // r))
        return self._memory("pdjax", r, q * r, q)

    def _calibrated(self, m: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Innermost level, ``m`` devices: ``(inner, allreduce)``, the ranges' compute as
        the stage time divides it (``m`` times the measured seconds where
        ``stage_seconds`` answers, else the profile's sum) and the measured all-reduce
        seconds (None: the formula). ``stage_seconds`` is called once per range and ``m``
        (``L (L+1) / 2`` calls per replica count), ``allreduce_seconds`` once per distinct
        parameter size and ``m``."""
        if m not in self._cal:
            inner = self.compute.copy()
            mode = "round-robin" if self.rr and m > 1 else "split"
            L = self.L
            if self.stage_seconds is not None:
                for i in range(L):
                    for j in range(i, L):
                        got = cost.calibrated(self.stage_seconds(i, j, m, mode), "stage_seconds")
                        if got is not None:
                            inner[i, j] = got * m
            ar = None
            if self.allreduce_seconds is not None and m > 1:
                level = self.topology.levels[0]
                ar = cost.ring_allreduce(self.weights, m, level.bandwidth, level.latency)
                seen: dict[float, float | None] = {}
                for i in range(L):
                    for j in range(i, L):
                        w = float(self.weights[i, j])
                        if w not in seen:
                            seen[w] = cost.calibrated(
                                self.allreduce_seconds(w, m), "allreduce_seconds"
                            )
                        if seen[w] is not None:
                            ar[i, j] = seen[w]
            self._cal[m] = (inner, ar)
        return self._cal[m]

    def stage_time_matrix(self, k: int, inner: np.ndarray, m: int, first: bool) -> np.ndarray:
        """``(L, L)``: time per microbatch of stage ``i..j`` on ``m`` units of level ``k``,
        without the memory check (not masked to ``i <= j``)."""
        level = self.topology.levels[k]
        allreduce = None
        if k == 0 and self.calibrated:
            inner, allreduce = self._calibrated(m)
        out = cost.stage_time(
            self.model,
            inner,
            self.weights,
            m,
            level.bandwidth,
            updates_per_microbatch=self._u(m),
            first=first,
            inner_units=self.topology.levels[k - 1].workers if k > 0 else 1,
            latency=level.latency,
            allreduce=allreduce,
        )
        if self._prices_whole(k):
            whole = self._whole_time(k, m, self._whole_numerator(k), self.weights)
            out = np.minimum(out, whole)
        return out

    def stage_value(
        self, k: int, inner: np.ndarray, m: int, units_after: int, first: bool
    ) -> np.ndarray:
        """``(L, L)``: value of stage ``i..j`` on ``m`` units of level ``k`` (inf: invalid)."""
        mem = self.own_memory(k, m, units_after)
        if self.objective == "memory":
            out = inner if mem is None else np.maximum(inner, mem)
        else:
            out = self.stage_time_matrix(k, inner, m, first)
            if self.limit is not None and mem is not None:
                out = np.where(mem <= self.limit, out, np.inf)
        return np.where(self.valid, out, np.inf)

    def split_value(self, k: int, inner: np.ndarray, m: int, mp: int) -> np.ndarray:
        """``(L, L)`` at ``[s, j]``: the last stage ``s+1..j`` on ``mp`` of ``m`` units, with
        the cut after ``s`` (inf where no cut may be)."""
        n = self.topology.levels[k].workers
        bw = self.topology.levels[k].bandwidth
        lat = self.topology.levels[k].latency
        calibrated = k == 0 and self.calibrated
        if self.objective == "time" and not self._checks_memory(k) and not calibrated:
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
                latency=lat,
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
            slowest: np.ndarray = np.maximum(out, cut, out=out)
            return slowest
        stage = self.stage_value(k, inner, mp, n - m, first=False)
        out = np.full((self.L, self.L), np.inf)
        out[:-1] = stage[1:]
        if self.objective == "time":
            cuts = cost.cut_time(self.model, self.cut[:, None], self.cut[None, :], mp, bw, lat)
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
            lat = self.topology.levels[k].latency
            cut_s = cost.cut_time(self.model, self.cut[:, None], self.cut[None, :], 1, bw, lat)
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
        general += float(cost.ring_allreduce(w, m, level.bandwidth, level.latency)) * self._u(m)
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
            stage_seconds=self.stage_seconds,
            allreduce_seconds=self.allreduce_seconds,
        )

    # -- the round-trip bound on one level ------------------------------------------------

    def round_trip_exact(self) -> bool:
        """Whether :meth:`round_trip_probe` decides "period <= T" exactly (split stages and
        ``T_s = P - s``); otherwise it is a relaxation (round-robin: ``T_s = q_s n_s >=
        n_s + ... + n_{P-1}``; a flush schedule with ``M`` below the device count:
        ``min(P - s, M) <= P - s``)."""
        if self.rr:
            return False
        return not (self.traits.flush and self.M < self.topology.num_devices)

    def _round_trip_setup(self) -> None:
        """Per replica count ``r``: the stage times ``tm[r]`` (inf: invalid range), the
        weights ``n_r`` of the round trip, and ``ua_max[r]``, the most devices after the
        stage with which its memory check passes (-1: never)."""
        if hasattr(self, "_rt_tm"):
            return
        N, L = self.topology.num_devices, self.L
        rs = [1] if self.straight else list(range(1, N + 1))
        self._rt_tm, self._rt_ua, self._rt_w = {}, {}, {}
        for r in rs:
            tm = self.stage_time_matrix(0, self.compute, r, first=False)
            self._rt_tm[r] = np.where(self.valid, tm, np.inf)
            self._rt_w[r] = float(r) if self.rr and r > 1 else 1.0
            ua_max = np.full((L, L), N, dtype=np.int32)
            if self.limit is not None:
                ua_max[...] = -1
                still = np.ones((L, L), dtype=bool)
                for ua in range(0, N - r + 1):
                    mem = self.own_memory(0, r, ua)
                    assert mem is not None  # level 0 always has a memory check
                    still &= np.broadcast_to(mem <= self.limit, (L, L))
                    ua_max[still] = ua
            self._rt_ua[r] = ua_max
        cut = cost.cut_time(
            self.model,
            self.cut,
            0.0,
            1,
            self.topology.levels[0].bandwidth,
            self.topology.levels[0].latency,
        )
        self._rt_cut = np.where(self.cut_ok, cut, np.inf)

    def round_trip_probe(self, T: float) -> list[tuple[int, int, int]] | None:
        """Stages ``(first, last, replicas)`` of a one-level configuration whose period,
        round trip included, is at most ``T`` (see :meth:`round_trip_exact`), or None.

        The condition is, for every suffix of stages ``s..P-1``, ``sum_{t>=s} (n_t (C_t - T)
        + 2 cut_t) <= 0`` (``cut_{P-1} = 0``), with every ``C_t <= T`` and ``cut_t <= T``.
        A suffix program over (first layer, devices) keeps the least sum of each suffix
        among those meeting every condition inside it, which is optimal for the suffixes
        that extend it: ``O(N^2 L^2)`` per probe (``O(N L^2)`` straight)."""
        self._round_trip_setup()
        N, L = self.topology.num_devices, self.L
        slack = 1e-12 * T
        cut2 = np.where(self._rt_cut <= T + slack, 2.0 * self._rt_cut, np.inf)[: L - 1]
        h = {}
        for r, tm in self._rt_tm.items():
            w = self._rt_w[r]
            h[r] = np.where(tm <= T + slack, w * (tm - T), np.inf)
        F = np.full((N + 1, L + 1), np.inf)
        F[0, L] = 0.0
        if self.fewer:
            F[:, L] = 0.0
        cj = np.zeros((N + 1, L), dtype=np.int32)
        cr = np.zeros((N + 1, L), dtype=np.int32)
        cf = np.zeros((N + 1, L), dtype=bool)
        rows = np.arange(L)
        tol = 1e-11 * T
        for m in range(1, N + 1):
            best = np.full(L, np.inf)
            for r in h:
                if r > m:
                    break
                rest = F[m - r]
                add = np.empty(L)
                add[: L - 1] = cut2 + rest[1:L]
                add[L - 1] = rest[L]
                val = h[r] + add[None, :]
                val[self._rt_ua[r] < m - r] = np.inf
                val[val > tol] = np.inf
                j = np.argmin(val, axis=1)
                v = val[rows, j]
                better = v < best
                best[better] = v[better]
                cj[m][better] = j[better]
                cr[m][better] = r
            F[m, :L] = best
            if self.fewer and m > 1:
                use = F[m - 1, :L] < F[m, :L]
                F[m, :L][use] = F[m - 1, :L][use]
                cf[m][use] = True
        if not np.isfinite(F[N, 0]):
            return None
        out, m, i = [], N, 0
        while i < L:
            if cf[m][i]:
                m -= 1
                continue
            j, r = int(cj[m][i]), int(cr[m][i])
            out.append((i, j, r))
            i, m = j + 1, m - r
        return out


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
    stage_seconds: cost.StageSeconds | None = None,
    allreduce_seconds: cost.AllreduceSeconds | None = None,
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
      memory_limit: bytes per device, or None for ``topology.memory_per_device``. Under
        ``pdjax`` the program first prunes stages by an optimistic bound and keeps its plan
        if the plan's exact memory fits (then it is optimal among all plans that fit:
        ``plan.options["memory_check"] == "verified"``), else prunes by a sound, possibly
        conservative bound (``"bound"``, as the other models always do).
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
      stage_seconds: calibration (``pdjax`` only): ``(first_layer, last_layer, replicas,
        replication) -> seconds or None``, the measured seconds per microbatch of the
        stage's compute (forward + backward + update) on one of its devices, for its share
        of the microbatch; replaces ``C / m`` where it returns a number. The program asks
        it for every range and every replica count of the innermost level (``L (L+1) / 2``
        calls per count: cache or tabulate expensive measurements); on more levels
        ``replicas`` there is the count inside a unit of the innermost level, and the plan's
        final evaluation asks again with each stage's total replicas.
      allreduce_seconds: calibration (``pdjax`` only): ``(param_bytes, devices) -> seconds
        or None``, the measured seconds of one all-reduce; ``devices`` is a count inside
        the program (innermost level; once per distinct byte count and count) and the
        tuple of device positions in the final evaluation. Plans made with either record
        ``plan.options["calibrated"]``.

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
    mode = cost.resolve_replication(replication, schedule, cost_model)
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
    )
    limit = memory_limit if memory_limit is not None else topology.memory_per_device
    options = {
        "straight": straight,
        "fewer_machines": fewer_machines,
        "replication": replication,
    }
    options.update(calibrated_options(stage_seconds, allreduce_seconds))
    if replication == "auto" and mode == "round-robin" and limit is not None:
        # Round-robin all-reduces less but may stash more per device: try both.
        candidates: tuple[str, ...] = ("round-robin", "split")
    else:
        candidates = (mode,)
    found, errors = [], []
    for candidate in candidates:
        try:
            found.append(_plan_mode(profile, topology, candidate, options, common))
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


def pipeline_time(
    arrays: cost.ModelArrays,
    topology: Topology,
    flat: list[tuple[int, int, list[int]]],
    modes: list[str] | tuple[str, ...],
    *,
    cost_model: str,
    schedule: str,
    num_microbatches: int,
    stage_seconds: cost.StageSeconds | None = None,
    allreduce_seconds: cost.AllreduceSeconds | None = None,
) -> tuple[float, float]:
    """``(slowest term, round-trip bound)`` of the stages ``(first, last, positions)``
    with their replication modes (:func:`pdjax.partition.cost.partition_terms`,
    :func:`~pdjax.partition.cost.round_trip_time`; the bound is 0 where the model and
    schedule have none)."""
    stage_terms, cut_terms = cost.partition_terms(
        arrays,
        topology,
        flat,
        modes,
        model=cost_model,
        schedule=schedule,
        num_microbatches=num_microbatches,
        stage_seconds=stage_seconds,
        allreduce_seconds=allreduce_seconds,
    )
    slowest = max(stage_terms + cut_terms)
    if not cost.has_round_trip(schedule, cost_model):
        return slowest, 0.0
    replicas = [len(pos) for _, _, pos in flat]
    counts = cost.exact_in_flight(schedule, replicas, modes, num_microbatches)
    units = cost.stage_units(replicas, modes)
    return slowest, cost.round_trip_time(stage_terms, cut_terms, [c for c, _ in counts], units)


def calibrated_options(stage_seconds: Any, allreduce_seconds: Any) -> dict[str, list[str]]:
    """``{"calibrated": [hooks given]}`` for a plan's options, or ``{}`` without hooks."""
    given = [
        name
        for name, fn in (("stage_seconds", stage_seconds), ("allreduce_seconds", allreduce_seconds))
        if fn is not None
    ]
    return {"calibrated": given} if given else {}


def _finish(
    search: _Search,
    tables: list[_Table],
    profile: Profile,
    topology: Topology,
    options: dict[str, Any],
) -> Plan:
    """The plan of a solved program: its configuration, with the round trip (``pdjax``)
    optimised on one level, evaluated on more (see the module doc)."""
    flat = search.flatten(search.tree(tables))
    time = search.best(tables)
    rr = search.rr

    def modes_of(stages: list[tuple[int, int, list[int]]]) -> list[str]:
        return ["round-robin" if rr and len(pos) > 1 else "split" for _, _, pos in stages]

    def terms(stages: list[tuple[int, int, list[int]]]) -> tuple[float, float]:
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

    def exact(stages: list[tuple[int, int, list[int]]]) -> float:
        return max(terms(stages))

    if cost.has_round_trip(search.schedule, search.model):
        _, trip = terms(flat)
        # (within rounding of the program's optimum, the program's value stands)
        trip = trip if trip > time * (1 + 1e-12) else 0.0
        if trip > time and topology.num_levels == 1:
            flat, time = _round_trip_search(search, flat, time, max(time, trip), exact)
            options = {
                **options,
                "round_trip": "optimal" if search.round_trip_exact() else "relaxed",
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
    )


def _round_trip_search(
    search: _Search,
    flat: list[tuple[int, int, list[int]]],
    lo: float,
    hi: float,
    exact: Callable[[list[tuple[int, int, list[int]]]], float],
) -> tuple[list[tuple[int, int, list[int]]], float]:
    """The one-level configuration of least period, round trip included: a search over the
    period ``T`` with :meth:`_Search.round_trip_probe` ("is there a plan of period at most
    ``T``?"), between ``lo`` (the program's optimum without the round trip, a lower bound)
    and ``hi`` (the period of its plan). Each plan a probe finds has its exact period
    evaluated; the best is kept. When the probe is exact, after each found plan a probe
    just below its period either finds a better one or proves it optimal (relative
    ``1e-12``), interleaved with bisection; when it is a relaxation (round-robin), bisection
    to relative ``1e-6`` on it, and the better of its plan and the program's, evaluated
    exactly."""

    def placed(stages: list[tuple[int, int, int]]) -> list[tuple[int, int, list[int]]]:
        out, base = [], 0
        for a, b, r in stages:
            out.append((a, b, list(range(base, base + r))))
            base += r
        return out

    best_flat, best = flat, hi
    exact_probe = search.round_trip_exact()
    if not exact_probe:
        # A relaxation: bisect on it, then evaluate only its final plan (an exact
        # evaluation of a round-robin plan plays its schedule: too slow for every probe).
        found = search.round_trip_probe(lo)
        top, last = hi, None
        while found is None and top - lo > 1e-6 * top:
            mid = 0.5 * (lo + top)
            got = search.round_trip_probe(mid)
            if got is None:
                lo = mid
            else:
                top, last = mid, got
        if found is None:
            found = last if last is not None else search.round_trip_probe(top)
        if found is not None:
            cand = placed(found)
            value = exact(cand)
            if value < best:
                best_flat, best = cand, value
        return best_flat, best
    eps = 1e-12

    def probe(T: float) -> bool:
        nonlocal best_flat, best
        got = search.round_trip_probe(T)
        if got is None:
            return False
        cand = placed(got)
        value = exact(cand)
        if value < best:
            best_flat, best = cand, value
        return True

    if probe(lo):  # a plan as fast as the program's optimum meets its round trip
        return best_flat, best
    top = hi
    for _ in range(200):
        top = min(top, best)
        below = top * (1 - eps)
        if below <= lo or not probe(below):
            break
        top = min(top, best)
        if top - lo <= eps * top:
            break
        mid = 0.5 * (lo + top)
        if probe(mid):
            top = min(mid, best)
        else:
            lo = mid
    return best_flat, best


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
) -> tuple[_Search, list[_Table]]:
    """Validates, checks the memory limit, and runs the program (see :func:`plan_pipedream`).

    ``replication`` is ``"split"`` or ``"round-robin"`` (``"auto"`` is resolved by
    :func:`pdjax.partition.cost.resolve_replication`, without comparing the two).
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
    common: dict[str, Any] = dict(  # forwarded to both searches
        straight=straight,
        fewer=fewer_machines,
        num_microbatches=M,
        optimizer_state_factor=float(optimizer_state_factor),
        round_robin=replication == "round-robin",
        memory_mode=memory_mode,
    )
    if limit is not None:
        mem_search = _Search(
            arrays, topology, cost_model, schedule, memory_limit=None, objective="memory", **common
        )
        smallest = mem_search.best(mem_search.solve())
        if smallest > limit:
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
    search = _Search(
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
    options: dict[str, Any],
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
            update_copies=(
                cost.update_copies(schedule, optimizer_state_factor)
                if memory_model == "pdjax"
                else 0.0
            ),
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
        profile_hash=profile.content_hash() if hasattr(profile, "content_hash") else None,
    )
