"""The semantics table against the validator's own recomputation, and its lookups.

The generators read their in-flight and versions-kept bounds from the table
(``pdjax.schedules.semantics``); the validator recomputes them independently
(``pdjax.schedules.validate``). Here the two meet over a grid of schedules,
device groups, microbatches and replicas.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from pdjax.errors import ScheduleError
from pdjax.schedules import (
    CHUNKED,
    FLUSHING,
    ROUND_ROBIN,
    SCHEDULES,
    SEMANTICS,
    SPLIT_BACKWARD,
    STALE,
    STREAMING,
    Shape,
    generate,
    semantics,
    stage_groups,
    validate,
)
from pdjax.schedules.validate import expected_in_flight, expected_versions

REPLICAS = [None, (2, 1), (1, 3), (2, 2, 1), (1, 1, 2), (3, 1, 1, 1), (1, 2, 1, 2)]


def _schedules():
    """Every schedule name over P = 1..4, M = 1..8, replicas split and round-robin,
    pipedream's options (whatever the generators accept)."""
    options = {
        "pipedream": [{}, {"vertical_sync": True}, {"weight_stashing": False},
                      {"extra_in_flight": 1}, {"extra_in_flight": 2}],
        "interleaved": [{"chunks": 1}, {"chunks": 2}, {"chunks": 3}],
    }  # fmt: skip
    for name, P, M in itertools.product(SCHEDULES, range(1, 5), range(1, 9)):
        for reps, mode in itertools.product([None, *REPLICAS], [None, "round-robin"]):
            if reps is not None and len(reps) != P:
                continue
            for kw in options.get(name, [{}]):
                try:
                    yield generate(name, P, M, replicas=reps, replication=mode, **kw)
                except ScheduleError:
                    continue  # a combination the generator refuses (e.g. 2bw with M < P)


def test_the_table_agrees_with_the_validators_recomputation():
    seen = set()
    for s in _schedules():
        row, shape = semantics(s.name), Shape.of(s)
        for d in range(s.num_groups):
            assert row.in_flight(shape, d) == expected_in_flight(s, d), (s.name, shape, d)
        for st in range(s.num_stages):
            assert row.versions(shape, st) == expected_versions(s, st), (s.name, shape, st)
        validate(s)
        seen.add((s.name, bool(s.replication)))
    # every schedule was checked, and every round-robin one with round-robin stages
    assert {name for name, _ in seen} == set(SCHEDULES)
    assert {name for name, rr in seen if rr} == set(ROUND_ROBIN)


def test_the_validator_rejects_bounds_other_than_the_tables():
    """The recomputation is not the declared bound read back: a bound one off fails."""
    for name in SCHEDULES:
        s = generate(name, 3, 6)
        for field in ("in_flight_bound", "version_bound"):
            bound = getattr(s, field)
            wrong = dataclasses.replace(s, **{field: (bound[0] + 1, *bound[1:])})
            with pytest.raises(ScheduleError, match=field):
                validate(wrong)


def test_the_table_mirrors_the_design():
    """The classifications the table of ``docs/semantics.md#the-schedules-at-a-glance``
    states, one row each."""
    assert SCHEDULES == ("gpipe", "1f1b", "pipedream", "2bw", "interleaved", "zb-h1",
                         "zb-h2", "zb-v")  # fmt: skip
    assert STREAMING == STALE == ("pipedream", "2bw")
    assert FLUSHING == ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v")
    assert CHUNKED == ("interleaved", "zb-v")
    assert ROUND_ROBIN == ("gpipe", "1f1b", "pipedream", "2bw")
    assert SPLIT_BACKWARD == ("zb-h1", "zb-h2", "zb-v")
    assert [n for n in SCHEDULES if SEMANTICS[n].updates_per_microbatch] == ["pipedream"]
    assert [n for n in SCHEDULES if SEMANTICS[n].v_shaped] == ["zb-v"]
    assert all(SEMANTICS[n].flushes != SEMANTICS[n].streams for n in SCHEDULES)
    assert semantics("2bw").versions(Shape(4, 4, 8), 3) == 2
    assert semantics("pipedream").versions(Shape(4, 1, 8), 1) == 3  # P - s
    assert semantics("pipedream").versions(Shape(4, 1, 8, vertical_sync=True), 3) == 4
    assert semantics("pipedream").versions(Shape(4, 1, 8, weight_stashing=False), 0) == 1
    assert all(row.update_rule and row.weights for row in SEMANTICS.values())


def test_unknown_names():
    with pytest.raises(ScheduleError, match="unknown schedule 'dp'; accepted: gpipe, 1f1b"):
        semantics("dp")
    assert stage_groups("dp", 2, 2) == (0, 1, 0, 1)  # s % P for any name but the V
