"""The round-trip bound on one level (``pdjax``; see :mod:`pdjax.partition.pricing.cost`): the
probe "is there a configuration of period at most ``T``, round trip included?"
(:class:`Prober`) and the search over ``T`` that finds the configuration of least period
(:func:`search_round_trip`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from pdjax.partition.pricing import cost
from pdjax.partition.search.space import Search

__all__ = ["Prober", "round_trip_exact", "search_round_trip"]

#: Pipeline stages ``(first, last, device positions)``.
Flat = list[tuple[int, int, list[int]]]


def round_trip_exact(search: Search) -> bool:
    """Whether :meth:`Prober.probe` decides "period <= T" exactly (split stages and
    ``T_s = P - s``); otherwise it is a relaxation (round-robin: ``T_s = q_s n_s >=
    n_s + ... + n_{P-1}``; a flush schedule with ``M`` below the device count:
    ``min(P - s, M) <= P - s``)."""
    if search.rr:
        return False
    return not (search.traits.flush and search.M < search.topology.num_devices)


@dataclasses.dataclass(frozen=True)
class Prober:
    """The probe's terms on the innermost level, per replica count ``r``.

    Attributes:
      search: the program whose terms these are.
      times: ``r -> (L, L)`` stage times (inf: invalid range).
      weights: ``r -> n_r``, the stage's weight in the round trip.
      after_max: ``r -> (L, L)``, the most devices after the stage with which its memory
        check passes (-1: never).
      cut: ``(L,)`` the cut term after each layer (inf: no cut may follow).
    """

    search: Search
    times: dict[int, np.ndarray]
    weights: dict[int, float]
    after_max: dict[int, np.ndarray]
    cut: np.ndarray

    @classmethod
    def of(cls, search: Search) -> Prober:
        """The probe's terms of ``search``."""
        N, L = search.topology.num_devices, search.L
        rs = [1] if search.straight else list(range(1, N + 1))
        times, weights, after_max = {}, {}, {}
        for r in rs:
            tm = search.stage_time_matrix(0, search.compute, r, first=False)
            times[r] = np.where(search.valid, tm, np.inf)
            weights[r] = float(r) if search.rr and r > 1 else 1.0
            ua_max = np.full((L, L), N, dtype=np.int32)
            if search.limit is not None:
                ua_max[...] = -1
                still = np.ones((L, L), dtype=bool)
                for ua in range(0, N - r + 1):
                    mem = search.own_memory(0, r, ua)
                    assert mem is not None  # level 0 always has a memory check
                    still &= np.broadcast_to(mem <= search.limit, (L, L))
                    ua_max[still] = ua
            after_max[r] = ua_max
        level = search.topology.levels[0]
        cut = cost.cut_time(
            search.model,
            cut_before=search.cut,
            cut_after=0.0,
            m=1,
            bandwidth=level.bandwidth,
            latency=level.latency,
        )
        return cls(search, times, weights, after_max, np.where(search.cut_ok, cut, np.inf))

    def probe(self, T: float) -> list[tuple[int, int, int]] | None:
        """Stages ``(first, last, replicas)`` of a one-level configuration whose period,
        round trip included, is at most ``T`` (see :func:`round_trip_exact`), or None.

        The condition is, for every suffix of stages ``s..P-1``, ``sum_{t>=s} (n_t (C_t - T)
        + 2 cut_t) <= 0`` (``cut_{P-1} = 0``), with every ``C_t <= T`` and ``cut_t <= T``.
        A suffix program over (first layer, devices) keeps the least sum of each suffix
        among those meeting every condition inside it, which is optimal for the suffixes
        that extend it: ``O(N^2 L^2)`` per probe (``O(N L^2)`` straight)."""
        fewer = self.search.fewer
        N, L = self.search.topology.num_devices, self.search.L
        slack = 1e-12 * T
        cut2 = np.where(self.cut <= T + slack, 2.0 * self.cut, np.inf)[: L - 1]
        h = {}
        for r, tm in self.times.items():
            h[r] = np.where(tm <= T + slack, self.weights[r] * (tm - T), np.inf)
        F = np.full((N + 1, L + 1), np.inf)
        F[0, L] = 0.0
        if fewer:
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
                val[self.after_max[r] < m - r] = np.inf
                val[val > tol] = np.inf
                j = np.argmin(val, axis=1)
                v = val[rows, j]
                better = v < best
                best[better] = v[better]
                cj[m][better] = j[better]
                cr[m][better] = r
            F[m, :L] = best
            if fewer and m > 1:
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


def _placed(stages: list[tuple[int, int, int]]) -> Flat:
    """``(first, last, replicas)`` stages on consecutive device positions."""
    out, base = [], 0
    for a, b, r in stages:
        out.append((a, b, list(range(base, base + r))))
        base += r
    return out


def search_round_trip(
    search: Search,
    flat: Flat,
    lo: float,
    hi: float,
    exact: Callable[[Flat], float],
) -> tuple[Flat, float]:
    """The one-level configuration of least period, round trip included: a search over the
    period ``T`` with :meth:`Prober.probe` ("is there a plan of period at most ``T``?"),
    between ``lo`` (the program's optimum without the round trip, a lower bound) and
    ``hi`` (the period of its plan, ``flat``). Each plan a probe finds has its exact period
    evaluated (``exact``); the best is kept. When the probe is exact, after each found plan
    a probe just below its period either finds a better one or proves it optimal (relative
    ``1e-12``), interleaved with bisection; when it is a relaxation (round-robin),
    bisection to relative ``1e-6`` on it, and the better of its plan and the program's,
    evaluated exactly."""
    prober = Prober.of(search)
    if not round_trip_exact(search):
        return _relaxed_search(prober, flat, lo, hi, exact)
    return _exact_search(prober, flat, lo, hi, exact)


def _relaxed_search(
    prober: Prober, flat: Flat, lo: float, hi: float, exact: Callable[[Flat], float]
) -> tuple[Flat, float]:
    """Bisection on a relaxed probe, then the exact evaluation of its final plan only (an
    exact evaluation of a round-robin plan plays its schedule: too slow for every probe)."""
    best_flat, best = flat, hi
    found = prober.probe(lo)
    top, last = hi, None
    while found is None and top - lo > 1e-6 * top:
        mid = 0.5 * (lo + top)
        got = prober.probe(mid)
        if got is None:
            lo = mid
        else:
            top, last = mid, got
    if found is None:
        found = last if last is not None else prober.probe(top)
    if found is not None:
        cand = _placed(found)
        value = exact(cand)
        if value < best:
            best_flat, best = cand, value
    return best_flat, best


def _exact_search(
    prober: Prober, flat: Flat, lo: float, hi: float, exact: Callable[[Flat], float]
) -> tuple[Flat, float]:
    """Probes just below the best period found, interleaved with bisection, until one
    fails (then the best is optimal to relative ``1e-12``)."""
    best_flat, best = flat, hi
    eps = 1e-12

    def probe(T: float) -> bool:
        nonlocal best_flat, best
        got = prober.probe(T)
        if got is None:
            return False
        cand = _placed(got)
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
