"""The registry of schedules: every registered :class:`~pdjax.schedules.ScheduleKind`
generates and validates, its placement and chunk rules hold, the name lists and the
command line's choices are derived from it, and an unknown name is refused as before."""

from __future__ import annotations

import dataclasses

import pytest

from pdjax.errors import ScheduleError
from pdjax.schedules import (
    FLUSHING,
    MODULO,
    ROUND_ROBIN,
    SCHEDULE_KINDS,
    SCHEDULES,
    SEMANTICS,
    STALE,
    STREAMING,
    V_SHAPE,
    GenerateArgs,
    ScheduleKind,
    ScheduleSpec,
    generate,
    schedule_kind,
    semantics,
    stage_groups,
    validate,
)
from pdjax.schedules.registry import FAMILY_MODULES


def test_the_registry_keeps_the_listing_order():
    assert SCHEDULES == ("gpipe", "1f1b", "pipedream", "2bw", "interleaved", "zb-h1",
                         "zb-h2", "zb-v")  # fmt: skip
    assert tuple(SEMANTICS) == SCHEDULES
    assert all(SEMANTICS[n] is SCHEDULE_KINDS[n].semantics for n in SCHEDULES)
    assert all(isinstance(k, ScheduleKind) and k.name == n for n, k in SCHEDULE_KINDS.items())
    assert len(FAMILY_MODULES) == len(set(FAMILY_MODULES))


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize(("P", "M"), [(1, 1), (2, 2), (3, 6), (4, 8)])
def test_every_schedule_generates_and_validates(name, P, M):
    kind = schedule_kind(name)
    s = generate(name, P, M)
    validate(s)
    assert s.name == name
    assert s.chunks == kind.chunks_for(2)  # generate's default chunks is 2
    assert s.stage_device == kind.stage_groups(P, s.chunks) == stage_groups(name, P, s.chunks)
    # the lookup and the call are the same thing
    assert kind.build(GenerateArgs(P, ScheduleSpec(name, M, chunks=kind.chunks_for(2)))) == s


def test_placements():
    assert [n for n in SCHEDULES if schedule_kind(n).placement is V_SHAPE] == ["zb-v"]
    assert all(schedule_kind(n).placement in (MODULO, V_SHAPE) for n in SCHEDULES)
    for n in SCHEDULES:
        assert (schedule_kind(n).placement is V_SHAPE) == semantics(n).v_shaped
    assert MODULO.groups(3, 2) == (0, 1, 2, 0, 1, 2)
    assert V_SHAPE.groups(3, 2) == (0, 1, 2, 2, 1, 0)
    assert stage_groups("dp", 2, 2) == (0, 1, 0, 1)  # any other name: s % P


def test_chunk_rules():
    chunks = {n: schedule_kind(n).chunks for n in SCHEDULES}
    assert chunks == {"gpipe": 1, "1f1b": 1, "pipedream": 1, "2bw": 1, "interleaved": None,
                      "zb-h1": 1, "zb-h2": 1, "zb-v": 2}  # fmt: skip
    assert [n for n in SCHEDULES if schedule_kind(n).default_chunks != 1] == ["zb-v"]
    assert schedule_kind("interleaved").chunks_for(3) == 3
    assert schedule_kind("zb-v").chunks_for(3) == 2
    assert schedule_kind("1f1b").chunks_for(3) == 1
    for n in SCHEDULES:  # a chunked schedule does not run a plan's stages as they are
        kind = schedule_kind(n)
        assert kind.runs_plan_stages == (kind.chunks == 1)
    assert generate("interleaved", 2, 4, chunks=3).chunks == 3
    with pytest.raises(ScheduleError, match="zb-v runs two chunks per device group"):
        generate("zb-v", 2, 4, chunks=3)


def test_what_the_other_parts_read():
    kinds = [schedule_kind(n) for n in SCHEDULES]
    assert [k.name for k in kinds if k.takes("extra_in_flight")] == ["pipedream"]
    assert [k.name for k in kinds if k.takes("vertical_sync")] == ["pipedream"]
    assert [k.name for k in kinds if k.needs_microbatches_per_stage] == ["2bw"]
    assert [k.name for k in kinds if k.stream_in_steps] == ["2bw"]
    assert [k.name for k in kinds if k.round_robin_by_default] == ["pipedream"]
    # the planner's knobs are the planner's (pdjax.partition.pricing.traits), not the kinds'
    from pdjax.partition import SCHEDULE_TRAITS as T

    assert {n: T[n].priced for n in SCHEDULES if T[n].priced != n} == {
        "zb-h2": "zb-h1",
        "zb-v": "zb-h1",
    }
    assert [n for n in SCHEDULES if T[n].depth is None] == ["gpipe"]
    assert [n for n in SCHEDULES if not T[n].round_trip] == ["gpipe", "interleaved"]
    assert not {"planned_as", "planner_depth", "planner_round_trip", "benched"} & {
        f.name for f in dataclasses.fields(schedule_kind("1f1b"))
    }


def test_labels():
    label = {n: schedule_kind(n).label(generate(n, 2, 4)) for n in SCHEDULES}
    assert label["interleaved"] == "interleaved (v=2)"
    assert label["1f1b"] == "1f1b"
    pd = generate("pipedream", 2, 4, vertical_sync=True, weight_stashing=False)
    assert schedule_kind("pipedream").label(pd) == "pipedream (vsync, no stash)"
    rr = generate("1f1b", 2, 4, replicas=(2, 1), replication="round-robin")
    assert schedule_kind("1f1b").label(rr) == "1f1b rr"


def test_derived_lists():
    assert STREAMING == tuple(n for n in SCHEDULES if SEMANTICS[n].streams)
    assert FLUSHING == tuple(n for n in SCHEDULES if not SEMANTICS[n].streams)
    assert STALE == tuple(n for n in SCHEDULES if SEMANTICS[n].stale)
    assert ROUND_ROBIN == tuple(n for n in SCHEDULES if SEMANTICS[n].round_robin)


def test_the_command_line_and_bench_lists_come_from_the_registry():
    from pdjax.apps.bench import BENCH_SCHEDULES
    from pdjax.apps.train import SCHEDULE_CHOICES
    from pdjax.partition import SCHEDULE_TRAITS

    assert SCHEDULE_CHOICES == (*SCHEDULES, "dp", "auto")
    assert set(BENCH_SCHEDULES) < set(SCHEDULES)
    assert tuple(SCHEDULE_TRAITS) == SCHEDULES


def test_unknown_names_are_refused_as_before():
    assert SCHEDULES[:8] == ("gpipe", "1f1b", "pipedream", "2bw", "interleaved", "zb-h1",
                             "zb-h2", "zb-v")  # fmt: skip
    message = f"unknown schedule 'dp'; accepted: {', '.join(SCHEDULES)}"
    for call in (lambda: generate("dp", 2, 2), lambda: schedule_kind("dp"),
                 lambda: semantics("dp")):  # fmt: skip
        with pytest.raises(ScheduleError) as err:
            call()
        assert str(err.value) == message
    with pytest.raises(ScheduleError, match="unknown schedule 'dp'"):
        generate("dp", 2, 2, extra_in_flight=1)
    with pytest.raises(ScheduleError, match="interleaved has no round-robin form"):
        generate("interleaved", 2, 2, replicas=(2, 1), replication="round-robin")


def test_a_kind_is_plain_data():
    kind = schedule_kind("1f1b")
    with pytest.raises(dataclasses.FrozenInstanceError):
        kind.chunks = 2  # type: ignore[misc]
