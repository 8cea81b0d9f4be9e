"""The dynamic program of one level of the topology (see :mod:`pdjax.partition.search.pipedream`):
its vectorised min-max recurrence (:func:`solve_level`), its table of values and choices
(:class:`Table`), the stages of a choice (:func:`level_stages`), and the configuration tree
the levels make (:class:`Node`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

__all__ = ["Node", "Table", "level_stages", "solve_level"]

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
class Table:
    """One level's solution. ``value[m, s, j]``: best value of layers ``start(s)..j`` on ``m``
    units; ``code``: 0 replicated whole, -1 use ``m-1`` units, ``m' > 0`` split off a last
    stage on ``m'`` units, -2 infeasible."""

    n: int
    value: np.ndarray
    code: np.ndarray
    x_fn: Callable[[int, int], np.ndarray]


def solve_level(
    n: int,
    num_layers: int,
    *,
    all_starts: bool,
    whole_fn: Callable[[int], np.ndarray],
    x_fn: Callable[[int, int], np.ndarray],
    x_depends_on_m: bool,
    straight: bool,
    fewer: bool,
) -> Table:
    """The dynamic program of one level on ``n`` units (see
    :mod:`pdjax.partition.search.pipedream`): ``whole_fn(m)`` the ranges replicated whole on ``m``
    units, ``x_fn(m, m')`` the last stage on ``m'`` of them with its cut (cached over ``m``
    unless ``x_depends_on_m``); every start layer or only 0 (``all_starts``)."""
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
    return Table(n, value, code, x_fn)


def level_stages(table: Table, row: int, i: int, j: int, m: int) -> list[tuple[int, int, int]]:
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
