"""The round-trip bound on one level (``pdjax``; see :mod:`pdjax.partition.pricing.cost`): the
probe "is there a configuration of period at most ``T``, round trip included?"
(:class:`Prober`) and the search over ``T`` that finds the configuration of least period
(:func:`search_round_trip`).

Each schedule's in-flight counts come from the schedule itself, as the plan's exact period
takes them: :func:`pdjax.partition.pricing.cost.exact_in_flight` of ``P`` split stages, i.e.
the planner's depth per kind (``_PRICING`` in :mod:`pdjax.partition.pricing.traits`, read
by :func:`~pdjax.partition.pricing.cost.in_flight`): ``P - s`` under ``pipedream`` and ``2bw``,
``min(P - s, M)`` under ``1f1b`` and ``zb-h1``, ``min(2P - 1, M)`` at every stage under
``zb-h2`` and ``min(P, M)`` under ``zb-v`` (``gpipe`` and ``interleaved`` have no round
trip). :func:`round_trip_passes` reads the table ``T_s(P)`` of every pipeline length and
finds a form the suffix program decides exactly (:class:`Bound`):

* a count of the stages from ``s`` on, ``T_s = f(P - s)`` (``pipedream``, ``2bw``,
  ``1f1b``, ``zb-h1``): every suffix's condition ``RT_s <= T f(P - s)``;
* one count per pipeline, ``T_s = c(P)`` (``zb-h2``, ``zb-v``): only the whole pipeline's
  condition ``RT_0 <= T c(P)``, since ``RT_s <= RT_0``;
* otherwise (no schedule has it yet) one pass per length ``P``, every stage's count known.

A linear count (``f(k) = a k + b``: ``P - s``; ``2P - 1`` with ``M >= 2P - 1``) is additive,
``RT - a T k``, and costs one program; otherwise the program tracks the stages of a suffix
up to where the count stops changing (``M`` under ``1f1b`` with ``M`` below the device
count), which multiplies its cost by that many.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import numpy as np

from pdjax.partition.pricing import cost
from pdjax.partition.search.space import Search

__all__ = [
    "Bound",
    "Prober",
    "round_trip_exact",
    "round_trip_passes",
    "search_round_trip",
    "split_counts",
]

#: Pipeline stages ``(first, last, device positions)``.
Flat = list[tuple[int, int, list[int]]]


def round_trip_exact(search: Search) -> bool:
    """Whether :meth:`Prober.probe` decides "period <= T" exactly: for split stages under
    every schedule with a round trip (the counts of :func:`round_trip_passes`). With
    round-robin stages (``pipedream`` only) it is not: the probe takes ``T_s = n_s + ... +
    n_{P-1}``, at most the schedule's ``q_s n_s``
    (:func:`~pdjax.partition.pricing.cost.groups_in_flight`, which depends on every group
    of the plan), so it may miss a plan (a restriction); every plan it finds is evaluated
    exactly."""
    return not search.rr


@dataclasses.dataclass(frozen=True)
class Bound:
    """One pass of the suffix program: the round trip's condition on a suffix of ``k``
    stages (its *key*, ``min(k, keys)`` when ``saturate``) in a form the program decides.

    The program keeps, per (first layer, devices, key), the least ``V = RT - a T k`` of
    the suffixes meeting every condition inside them (``RT``: the suffix's round trip,
    ``a``: :attr:`per_stage`); the key and ``V`` decide every condition of any longer
    suffix, so the least ``V`` is optimal for all that extend it.

    Attributes:
      per_stage: ``a``.
      keys: the keys ``1..keys``; 1 for an additive form.
      saturate: a suffix of more than ``keys`` stages keeps key ``keys`` (else it is not
        allowed: a pass for one pipeline length).
      suffix: per key, the bound on ``V / T`` of every suffix with that key (inf: none).
      final: per key, the bound on ``V / T`` of the whole pipeline (inf: none; -inf: that
        key is not a whole pipeline).
    """

    per_stage: float
    keys: int
    saturate: bool
    suffix: tuple[float, ...]
    final: tuple[float, ...]


def _linear(values: Sequence[int]) -> tuple[float, float] | None:
    """``(a, b)`` with ``values[k - 1] = a k + b`` for every ``k``, or None."""
    a = float(values[1] - values[0]) if len(values) > 1 else 0.0
    b = float(values[0]) - a
    if all(v == a * k + b for k, v in enumerate(values, start=1)):
        return a, b
    return None


def _saturation(values: Sequence[int]) -> int:
    """The least ``K`` with ``values[k - 1] = values[K - 1]`` for every ``k >= K``."""
    K = len(values)
    while K > 1 and values[K - 2] == values[-1]:
        K -= 1
    return K


def round_trip_passes(
    counts: Sequence[Sequence[int]], *, general: bool = False
) -> tuple[Bound, ...]:
    """The passes of the suffix program that decide ``RT_s <= T T_s`` for every stage
    ``s`` exactly, from ``counts[P - 1][s]``, the in-flight count ``T_s`` of stage ``s`` of
    ``P`` split stages, ``P = 1..len(counts)`` (the module doc). ``general``: one pass per
    ``P`` whatever the form (what a count of no simpler form gets).

    >>> [b.keys for b in round_trip_passes([[1], [2, 1], [3, 2, 1]])]
    [1]
    >>> [(b.per_stage, b.final) for b in round_trip_passes([[1], [3, 3], [5, 5, 5]])]
    [(2.0, (-1.0,))]
    >>> [(b.keys, b.suffix) for b in round_trip_passes([[1], [2, 1], [2, 2, 1]])]
    [(2, (1.0, 2.0))]
    """
    Pmax = len(counts)
    inf = math.inf
    options: list[Bound] = []
    f = list(counts[-1][::-1])  # f[k - 1]: the count of a stage with k - 1 stages after it
    if not general and all(
        counts[P - 1][s] == f[P - s - 1] for P in range(1, Pmax + 1) for s in range(P)
    ):
        line = _linear(f)
        if line is not None:
            options.append(Bound(line[0], 1, True, (line[1],), (inf,)))
        else:
            K = _saturation(f)
            options.append(Bound(0.0, K, True, tuple(float(x) for x in f[:K]), (inf,) * K))
    c = [row[0] for row in counts]  # c[P - 1]: the count of every stage of P
    if not general and all(x == row[0] for row in counts for x in row):
        line = _linear(c)
        if line is not None:
            options.append(Bound(line[0], 1, True, (inf,), (line[1],)))
        else:
            K = _saturation(c)
            options.append(Bound(0.0, K, True, (inf,) * K, tuple(float(x) for x in c[:K])))
    if options:
        return (min(options, key=lambda b: b.keys),)
    return tuple(
        Bound(
            0.0,
            P,
            False,
            tuple(float(counts[P - 1][P - k]) for k in range(1, P + 1)),
            (-inf,) * (P - 1) + (inf,),
        )
        for P in range(1, Pmax + 1)
    )


def split_counts(search: Search) -> list[list[int]]:
    """``counts[P - 1][s]``: the in-flight count of stage ``s`` of ``P`` split stages under
    the search's schedule, as the exact period takes it
    (:func:`pdjax.partition.pricing.cost.exact_in_flight`), for every ``P`` up to the
    devices (and layers)."""
    Pmax = max(1, min(search.topology.num_devices, search.L))
    return [
        [c for c, _ in cost.exact_in_flight(search.schedule, [1] * P, ("split",) * P, search.M)]
        for P in range(1, Pmax + 1)
    ]


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
      passes: the round trip's conditions (:func:`round_trip_passes`; round-robin: the
        relaxed ``T_s = n_s + ... + n_{P-1}``).
    """

    search: Search
    times: dict[int, np.ndarray]
    weights: dict[int, float]
    after_max: dict[int, np.ndarray]
    cut: np.ndarray
    passes: tuple[Bound, ...]

    @classmethod
    def of(cls, search: Search, *, general: bool = False) -> Prober:
        """The probe's terms of ``search`` (``general``: :func:`round_trip_passes`')."""
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
        if search.rr:  # the groups' counts: relaxed to the devices from s on
            passes: tuple[Bound, ...] = (Bound(1.0, 1, True, (0.0,), (math.inf,)),)
        else:
            passes = round_trip_passes(split_counts(search), general=general)
        cut = np.where(search.cut_ok, cut, np.inf)
        return cls(search, times, weights, after_max, cut, passes)

    def probe(self, T: float) -> list[tuple[int, int, int]] | None:
        """Stages ``(first, last, replicas)`` of a one-level configuration whose period,
        round trip included, is at most ``T`` (see :func:`round_trip_exact`), or None.

        The condition is, for every stage ``s``, ``RT_s = sum_{t>=s} (n_t C_t + 2 cut_t) <=
        T T_s`` (``cut_{P-1} = 0``), with every ``C_t <= T`` and ``cut_t <= T``; each pass
        (:class:`Bound`) is a suffix program over (key, first layer, devices) keeping the
        least ``V`` of each suffix among those meeting every condition inside it:
        ``O(K N^2 L^2)`` per pass with ``K`` keys (``O(K N L^2)`` straight)."""
        for bound in self.passes:
            found = self._probe(T, bound)
            if found is not None:
                return found
        return None

    def _probe(self, T: float, bound: Bound) -> list[tuple[int, int, int]] | None:
        """:meth:`probe` for one pass."""
        fewer = self.search.fewer
        N, L = self.search.topology.num_devices, self.search.L
        K, a = bound.keys, bound.per_stage
        slack = 1e-12 * T
        cut2 = np.where(self.cut <= T + slack, 2.0 * self.cut, np.inf)[: L - 1]
        h = {}
        for r, tm in self.times.items():
            w = self.weights[r]
            h[r] = np.where(tm <= T + slack, w * (tm - a * T), np.inf)

        def limit(b: float) -> float:
            return T * b + 1e-11 * T * max(1.0, abs(b)) if math.isfinite(b) else b

        suffix = [limit(b) for b in bound.suffix]
        # F[k, m, i]: key k (0: the empty suffix, at i = L only), m devices, from layer i
        F = np.full((K + 1, N + 1, L + 1), np.inf)
        F[0, 0, L] = 0.0
        if fewer:
            F[0, :, L] = 0.0
        cj = np.zeros((K + 1, N + 1, L), dtype=np.int32)
        cr = np.zeros((K + 1, N + 1, L), dtype=np.int32)
        cf = np.zeros((K + 1, N + 1, L), dtype=bool)
        rows = np.arange(L)
        checked = self.search.limit is not None
        for m in range(1, N + 1):
            best = np.full((K + 1, L), np.inf)
            for r in h:
                if r > m:
                    break
                hr = h[r]
                if checked:  # the memory check with m - r devices after the stage
                    hr = np.where(self.after_max[r] < m - r, np.inf, hr)
                for k in range(1, min(K, m) + 1):
                    rest = F[k - 1, m - r]
                    if bound.saturate and k == K:  # key K, one stage longer, keeps key K
                        rest = np.minimum(rest, F[K, m - r])
                    if not np.isfinite(rest).any():
                        continue
                    add = np.empty(L)
                    add[: L - 1] = cut2 + rest[1:L]
                    add[L - 1] = rest[L]
                    val = hr + add[None, :]
                    j = np.argmin(val, axis=1)
                    v = val[rows, j]
                    v[v > suffix[k - 1]] = np.inf  # (the least over j: none is below)
                    better = v < best[k]
                    best[k][better] = v[better]
                    cj[k, m][better] = j[better]
                    cr[k, m][better] = r
            for k in range(1, min(K, m) + 1):
                F[k, m, :L] = best[k]
                if fewer and m > 1:
                    use = F[k, m - 1, :L] < F[k, m, :L]
                    F[k, m, :L][use] = F[k, m - 1, :L][use]
                    cf[k, m][use] = True
        final = [limit(b) for b in bound.final]
        ends = [
            k for k in range(1, K + 1) if np.isfinite(F[k, N, 0]) and F[k, N, 0] <= final[k - 1]
        ]
        if not ends:
            return None
        out, m, i, k = [], N, 0, ends[0]
        while i < L:
            if cf[k, m, i]:
                m -= 1
                continue
            j, r = int(cj[k, m, i]), int(cr[k, m, i])
            out.append((i, j, r))
            i, m = j + 1, m - r
            if i < L and not (bound.saturate and k == K and F[K, m, i] <= F[k - 1, m, i]):
                k -= 1
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
    ``1e-12``), interleaved with bisection; when it is not (round-robin,
    :func:`round_trip_exact`), bisection to relative ``1e-6`` on it, and the better of its
    plan and the program's, evaluated exactly."""
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
