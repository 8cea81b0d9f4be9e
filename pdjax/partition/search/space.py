"""The hierarchical dynamic program for one profile, topology, cost model and schedule
(:class:`Search`; see :mod:`pdjax.partition.search.pipedream`): per level its stage and split
terms with the memory checks, the levels solved in turn, and the best configuration as a
tree and as flat pipeline stages.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from pdjax.partition.pricing import cost
from pdjax.partition.search.levels import Node, Table, level_stages, solve_level
from pdjax.plan.topology import Topology

__all__ = ["Search"]


class Search:
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
        microbatches_per_call: int | None = None,
    ) -> None:
        self.arrays = arrays
        self.schedule = schedule
        self.memory_mode = memory_mode if model == "pdjax" else "bound"
        self.stage_seconds = stage_seconds if model == "pdjax" else None
        self.allreduce_seconds = allreduce_seconds if model == "pdjax" else None
        self.calibrated = self.stage_seconds is not None or self.allreduce_seconds is not None
        self._cal: dict[int, tuple[np.ndarray, np.ndarray | None]] = {}
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
        self._runtime_terms(microbatches_per_call)
        self._shift_level: int | None = None
        self._shift: tuple[np.ndarray, np.ndarray, np.ndarray] = ()  # type: ignore[assignment]
        self._whole_num: dict[int, np.ndarray] = {}
        self._whole_shift: dict[int, np.ndarray] = {}

    def _runtime_terms(self, calls: int | None) -> None:
        """The ``pdjax`` memory model's terms of what the runtime holds (see
        :mod:`pdjax.partition.pricing.cost`): per range, the bytes per microbatch in flight (with
        zero bubble's cotangents) and the call's inputs and values in transit; the
        parameter-sized copies; the in-flight bounds from the semantics table."""
        L, arrays = self.L, self.arrays
        self.calls = cost.microbatches_per_call(self.schedule, self.M, calls)
        self.weight_copies = cost.weight_copies(self.schedule, self.M, self.calls)
        self.waiting = cost.waiting_bytes(self.schedule, self.stash, self.act)
        # a plain ModelArrays (no profile behind it) places nothing up front
        placed = np.zeros((L, L))
        placed[0, :] += getattr(arrays, "inputs", 0.0)
        placed[:, L - 1] += getattr(arrays, "targets", 0.0)
        self.placed = placed
        before = np.concatenate([[0.0], self.cut[:-1]])
        self.cut_before, self.cut_after = before[:, None], self.cut[None, :]
        # Transfer seconds of each cut: the slowest level's (the program does not know
        # where a cut falls).
        taus = [
            cost.cut_time("pdjax", self.cut, 0.0, 1, level.bandwidth, level.latency)
            for level in self.topology.levels
        ]
        tau = np.max(taus, axis=0)
        tau_before = np.concatenate([[0.0], tau[:-1]])
        self.tau_before, self.tau_after = tau_before[:, None], tau[None, :]
        # The actions that feed the links: the forward, and the backward (zero bubble's
        # I, no longer than the forward or the backward) that sends a gradient back.
        forward = getattr(arrays, "forward", None)
        backward = getattr(arrays, "backward", None)
        if forward is None or backward is None:  # a plain ModelArrays: the whole compute
            forward = backward = arrays.compute
        if self.traits.semantics.split_backward:
            backward = np.minimum(forward, backward)
        self.forward_seconds = arrays.range_sum(forward)
        self.gradient_seconds = arrays.range_sum(backward)
        self.outer_units = self.topology.num_devices // self.topology.levels[0].workers
        self.update_microbatches = cost.update_microbatches(self.schedule, self.M)
        most = min(self.topology.num_devices, L)
        self._depth_upper, self._depth_lower = cost.memory_in_flight_bounds(
            self.schedule, self.M, most
        )

    def _u(self, m: int) -> float:
        """All-reduces per microbatch of a stage on ``m`` units (see
        pdjax.partition.pricing.cost)."""
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
        # (replicated across the outer levels too, a stage computes faster than on r devices)
        return self._memory(self.model, r, inflight, versions, sharing=r * self.outer_units)

    def _in_flight(self, bound: np.ndarray, *, least: bool = False) -> tuple[np.ndarray, Any]:
        """``(in flight, versions)`` per range under the schedule, for a stage with at most
        (``least``: at least) ``bound - 1`` stages after it: under ``pdjax`` the semantics
        table's count, what the runtime stashes
        (:func:`pdjax.partition.pricing.cost.memory_in_flight_bounds`); under ``paper`` the
        planner's depth (``P - s``, at most ``M`` if the schedule flushes, or ``M``)."""
        if self.model == "pdjax":
            inflight = (self._depth_lower if least else self._depth_upper)[bound]
        elif not self.traits.pipelined_in_flight:
            inflight = np.full_like(bound, self.M)
        elif self.traits.flush:
            inflight = np.minimum(bound, self.M)
        else:
            inflight = bound
        versions = inflight if self.traits.versions == "in_flight" else int(self.traits.versions)
        return inflight, versions

    def _memory(
        self,
        model: str,
        replicas: int,
        inflight: Any,
        versions: Any,
        *,
        group: int = 1,
        sharing: int | None = None,
    ) -> np.ndarray:
        """:func:`pdjax.partition.pricing.cost.stage_memory` of every range on ``replicas`` devices,
        its neighbours sending or taking up to ``group`` microbatches at once (round-robin
        groups), its compute shared by ``sharing`` devices (default ``replicas``) where it
        decides whether a link keeps up (:class:`pdjax.partition.pricing.cost.RuntimeCall`)."""
        if model != "pdjax":
            return cost.stage_memory(
                model,
                weights=self.weights,
                stash=self.stash,
                act=self.act,
                replicas=replicas,
                in_flight_count=inflight,
                versions=versions,
                optimizer_state_factor=self.opt,
            )
        call = self._call(group, replicas if sharing is None else sharing)
        terms: dict[str, Any] = {
            "weights": self.weights,
            "stash": self.waiting,
            "in_flight_count": inflight,
            "versions": versions,
        }
        common: dict[str, Any] = {
            "act": 0.0,
            "replicas": replicas,
            "optimizer_state_factor": self.opt,
            "weight_copies": self.weight_copies,
        }
        memory = cost.stage_memory("pdjax", **terms, **common, call=call)
        # What the call places up front sits on the first stage (ranges from layer 0) and
        # the last (ranges to layer L - 1): priced there alone, the rest has only stash.
        shape = (self.L, self.L)
        for where in ((0, slice(None)), (slice(None), self.L - 1)):
            part = {name: _part(value, shape, where) for name, value in terms.items()}
            edge = dataclasses.replace(
                call,
                placed=self.placed[where],
                cut_before=_part(call.cut_before, shape, where),
                cut_after=_part(call.cut_after, shape, where),
                slow_before=_part(call.slow_before, shape, where),
                slow_after=_part(call.slow_after, shape, where),
            )
            memory[where] = cost.stage_memory("pdjax", **part, **common, call=edge)
        return memory

    def _call(self, group: int, sharing: int) -> cost.RuntimeCall:
        """The call's terms of every range: its neighbours' groups at most ``group``, its
        compute shared by ``sharing`` devices. The sound check queues sent values behind
        every link slower than the stage's own compute (the stages around it may be
        slower still and feed it less: the plan's exact memory knows); the optimistic
        one queues none."""
        queues = self.memory_mode == "bound"
        return cost.RuntimeCall(
            calls=self.calls,
            cut_before=self.cut_before * group,
            cut_after=self.cut_after * group,
            slow_before=queues & (self.tau_before > self.gradient_seconds / sharing),
            slow_after=queues & (self.tau_after > self.forward_seconds / sharing),
            update_microbatches=self.update_microbatches,
        )

    def _optimistic_memory(self, r: int) -> np.ndarray:
        """A lower bound of the ``pdjax`` bytes per device of a stage on ``r`` devices of the
        innermost level, whatever the rest of the plan: in flight at least 2 before the
        model's last stage (1 for it), and replicated on at most ``r`` devices of each unit
        of the outer levels. A plan the program finds under it must be verified."""
        last = self.layers_after == 0
        bound = np.where(last, 1, min(2, len(self._depth_lower) - 1))
        if self.rr:  # as many groups in flight as devices share the stage: at most r per
            # unit of the outer levels (a stage the outer levels replicate holds less of
            # the call's inputs per device than one on r devices alone)
            shared = r * self.outer_units
            return self._memory("pdjax", shared, bound * shared, bound, sharing=r)
        inflight, versions = self._in_flight(bound, least=True)
        return self._memory("pdjax", r * self.outer_units, inflight, versions, sharing=r)

    def _round_robin_memory(self, r: int, after: int) -> np.ndarray:
        """Bytes per device of a stage on ``r`` devices of the innermost level, ``after``
        devices after it, in a pipeline whose replicated stages are round-robin (the bound
        in :mod:`pdjax.partition.pricing.cost`: ``q`` whole stashes and, under ``pipedream``, ``q``
        versions per device)."""
        # pipedream only (the planner has no round-robin for the other schedules).
        q = np.where(self.layers_after == 0, 1, max(1, (2 * (r + after) - 2) // r))
        # a neighbour's group may be as large as all the other devices
        group = max(r, self.topology.num_devices - r)
        return self._memory("pdjax", r, q * r, q, group=group, sharing=r * self.outer_units)

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
            cuts = cost.cut_time(
                self.model,
                cut_before=self.cut[:, None],
                cut_after=self.cut[None, :],
                m=mp,
                bandwidth=bw,
                latency=lat,
            )
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
            cut_s = cost.cut_time(
                self.model,
                cut_before=self.cut[:, None],
                cut_after=self.cut[None, :],
                m=1,
                bandwidth=bw,
                latency=lat,
            )
            if self.model != "pipedream-code":
                cut_s = cut_s[:, :1]  # the same for every range end: broadcast a column
            self._shift = (inner_s, weights_s, np.ascontiguousarray(cut_s))
            self._shift_level = k
        return self._shift

    # -- the program --------------------------------------------------------------------

    def solve(self) -> list[Table]:
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

            table = solve_level(
                n,
                self.L,
                all_starts=not final,
                whole_fn=whole_fn,
                x_fn=x_fn,
                x_depends_on_m=self.objective == "memory" or self._checks_memory(k),
                straight=self.straight,
                fewer=self.fewer,
            )
            tables.append(table)
            inner = table.value[n]
        return tables

    def best(self, tables: list[Table]) -> float:
        return float(tables[-1].value[tables[-1].n, 0, self.L - 1])

    def tree(self, tables: list[Table]) -> list[Node]:
        """The best configuration as a tree: top-level stages, each with the stages one of
        its units runs one level down."""
        top = len(tables) - 1

        def whole(k: int, a: int, b: int) -> list[Node]:  # replicated whole below level k+1
            inner = whole(k - 1, a, b) if k > 0 else None
            return [Node(a, b, self.topology.levels[k].workers, inner)]

        def expand(k: int, i: int, j: int, m: int) -> list[Node]:
            row = 0 if k == top else i
            out = []
            for a, b, r in level_stages(tables[k], row, i, j, m):
                inner = None
                if k > 0 and self._whole_wins(tables, k, a, b, r):
                    inner = whole(k - 1, a, b)
                elif k > 0:
                    inner = expand(k - 1, a, b, self.topology.levels[k - 1].workers)
                out.append(Node(a, b, r, inner))
            return out

        return expand(top, 0, self.L - 1, tables[top].n)

    def _whole_wins(self, tables: list[Table], k: int, a: int, b: int, m: int) -> bool:
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


def _part(value: Any, shape: tuple[int, int], where: tuple[Any, Any]) -> Any:
    """``value`` (a scalar, or an array broadcasting to ``shape``) at ``where``."""
    if np.ndim(value) == 0:
        return value
    return np.broadcast_to(value, shape)[where]
