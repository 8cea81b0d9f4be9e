"""Schedules as data: generators, the validator, text and JSON forms.

The literal grids below are written out by hand from the schedules' definitions (each
action one tick, as early as its group and its inputs allow); they are not generated.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest

from pdjax.errors import ScheduleError
from pdjax.schedules import (
    SCHEDULES,
    Action,
    Schedule,
    format_actions,
    generate,
    gpipe,
    interleaved,
    live_versions,
    one_f_one_b,
    parse_actions,
    parse_grid,
    pipedream,
    pipedream_2bw,
    validate,
    zb_h1,
    zb_h2,
    zb_v,
)

STAGES = range(1, 9)
MICROBATCHES = range(1, 33)


def rows(text: str) -> list[list[str]]:
    return [line.split() for line in text.strip().splitlines()]


def assert_grid(schedule: Schedule, expected: str) -> None:
    assert rows(schedule.grid()) == rows(expected)
    assert parse_grid(expected) == schedule.actions


def acts(text: str) -> tuple[Action, ...]:
    return tuple(Action.parse(t) for t in text.split())


def replace_group(schedule: Schedule, group: int, text: str) -> Schedule:
    actions = list(schedule.actions)
    actions[group] = acts(text)
    return dataclasses.replace(schedule, actions=tuple(actions))


# ----------------------------------------------------------------------------- actions


def test_action_compact_strings_round_trip():
    for a in [Action("F", 2, 0), Action("B", 1, 7, 3), Action("U", 0, 2, 2), Action("W", 11, 31)]:
        assert Action.parse(str(a)) == a
    assert str(Action("F", 2, 0)) == "2F0"
    assert str(Action("B", 1, 7, 3)) == "1B7v3"
    assert Action.parse("0U2v2") == Action("U", 0, 2, 2)


@pytest.mark.parametrize("text", ["F0", "2X0", "2F", "2F0v", "-1F0", "2f0", ""])
def test_action_parse_rejects_malformed(text):
    with pytest.raises(ScheduleError, match="cannot read action"):
        Action.parse(text)


def test_format_and_parse_actions_round_trip():
    s = pipedream(3, 7)
    assert parse_actions(format_actions(s.actions)) == s.actions
    with pytest.raises(ScheduleError, match="expected 'g1"):
        parse_actions("g0: 0F0\ng2: 1F0")


# ----------------------------------------------------------------------------- literal grids


def test_gpipe_grids():
    assert_grid(
        gpipe(2, 2),
        """
        t  g0   g1
        0  0F0  .
        1  0F1  1F0
        2  .    1F1
        3  .    1B1
        4  0B1  1B0
        5  0B0  1U0
        6  0U0  .
        """,
    )
    assert_grid(
        gpipe(3, 2),
        """
        t  g0   g1   g2
        0  0F0  .    .
        1  0F1  1F0  .
        2  .    1F1  2F0
        3  .    .    2F1
        4  .    .    2B1
        5  .    1B1  2B0
        6  0B1  1B0  2U0
        7  0B0  1U0  .
        8  0U0  .    .
        """,
    )
    assert_grid(
        gpipe(4, 3),
        """
        t   g0   g1   g2   g3
        0   0F0  .    .    .
        1   0F1  1F0  .    .
        2   0F2  1F1  2F0  .
        3   .    1F2  2F1  3F0
        4   .    .    2F2  3F1
        5   .    .    .    3F2
        6   .    .    .    3B2
        7   .    .    2B2  3B1
        8   .    1B2  2B1  3B0
        9   0B2  1B1  2B0  3U0
        10  0B1  1B0  2U0  .
        11  0B0  1U0  .    .
        12  0U0  .    .    .
        """,
    )


def test_one_f_one_b_grids():
    assert_grid(
        one_f_one_b(2, 2),
        """
        t  g0   g1
        0  0F0  .
        1  0F1  1F0
        2  .    1B0
        3  0B0  1F1
        4  .    1B1
        5  0B1  1U0
        6  0U0  .
        """,
    )
    assert_grid(
        one_f_one_b(3, 3),
        """
        t   g0   g1   g2
        0   0F0  .    .
        1   0F1  1F0  .
        2   0F2  1F1  2F0
        3   .    .    2B0
        4   .    1B0  2F1
        5   0B0  1F2  2B1
        6   .    1B1  2F2
        7   0B1  .    2B2
        8   .    1B2  2U0
        9   0B2  1U0  .
        10  0U0  .    .
        """,
    )
    assert_grid(
        one_f_one_b(4, 4),
        """
        t   g0   g1   g2   g3
        0   0F0  .    .    .
        1   0F1  1F0  .    .
        2   0F2  1F1  2F0  .
        3   0F3  1F2  2F1  3F0
        4   .    .    .    3B0
        5   .    .    2B0  3F1
        6   .    1B0  2F2  3B1
        7   0B0  1F3  2B1  3F2
        8   .    1B1  2F3  3B2
        9   0B1  .    2B2  3F3
        10  .    1B2  .    3B3
        11  0B2  .    2B3  3U0
        12  .    1B3  2U0  .
        13  0B3  1U0  .    .
        14  0U0  .    .    .
        """,
    )


def test_zb_h1_grids():
    assert_grid(
        zb_h1(2, 2),
        """
        t  g0   g1
        0  0F0  .
        1  0F1  1F0
        2  .    1I0
        3  0I0  1F1
        4  0W0  1I1
        5  0I1  1W0
        6  0W1  1W1
        7  0U0  1U0
        """,
    )
    assert_grid(
        zb_h1(3, 3),
        """
        t   g0   g1   g2
        0   0F0  .    .
        1   0F1  1F0  .
        2   0F2  1F1  2F0
        3   .    .    2I0
        4   .    1I0  2F1
        5   0I0  1F2  2I1
        6   0W0  1I1  2F2
        7   0I1  1W0  2I2
        8   0W1  1I2  2W0
        9   0I2  1W1  2W1
        10  0W2  1W2  2W2
        11  0U0  1U0  2U0
        """,
    )
    assert_grid(
        zb_h1(4, 4),
        """
        t   g0   g1   g2   g3
        0   0F0  .    .    .
        1   0F1  1F0  .    .
        2   0F2  1F1  2F0  .
        3   0F3  1F2  2F1  3F0
        4   .    .    .    3I0
        5   .    .    2I0  3F1
        6   .    1I0  2F2  3I1
        7   0I0  1F3  2I1  3F2
        8   0W0  1I1  2F3  3I2
        9   0I1  1W0  2I2  3F3
        10  0W1  1I2  2W0  3I3
        11  0I2  1W1  2I3  3W0
        12  0W2  1I3  2W1  3W1
        13  0I3  1W2  2W2  3W2
        14  0W3  1W3  2W3  3W3
        15  0U0  1U0  2U0  3U0
        """,
    )


def test_interleaved_grids():
    s = interleaved(2, 2, 2)
    assert s.stage_device == (0, 1, 0, 1)
    assert s.stages_of(0) == (0, 2)
    assert_grid(
        s,
        """
        t   g0   g1
        0   0F0  .
        1   0F1  1F0
        2   2F0  1F1
        3   2F1  3F0
        4   .    3B0
        5   2B0  3F1
        6   .    3B1
        7   2B1  1B0
        8   0B0  1B1
        9   0B1  1U0
        10  0U0  3U0
        11  2U0  .
        """,
    )
    assert_grid(
        interleaved(2, 4, 2),
        """
        t   g0   g1
        0   0F0  .
        1   0F1  1F0
        2   2F0  1F1
        3   2F1  3F0
        4   0F2  3B0
        5   2B0  3F1
        6   0F3  3B1
        7   2B1  1F2
        8   2F2  1B0
        9   0B0  1F3
        10  2F3  1B1
        11  0B1  3F2
        12  .    3B2
        13  2B2  3F3
        14  .    3B3
        15  2B3  1B2
        16  0B2  1B3
        17  0B3  1U0
        18  0U0  3U0
        19  2U0  .
        """,
    )
    assert_grid(
        interleaved(3, 3, 2),
        """
        t   g0   g1   g2
        0   0F0  .    .
        1   0F1  1F0  .
        2   0F2  1F1  2F0
        3   3F0  1F2  2F1
        4   3F1  4F0  2F2
        5   3F2  4F1  5F0
        6   .    4F2  5B0
        7   .    4B0  5F1
        8   3B0  .    5B1
        9   .    4B1  5F2
        10  3B1  .    5B2
        11  .    4B2  2B0
        12  3B2  1B0  2B1
        13  0B0  1B1  2B2
        14  0B1  1B2  2U0
        15  0B2  1U0  5U0
        16  0U0  4U0  .
        17  3U0  .    .
        """,
    )
    assert_grid(
        interleaved(4, 4, 2),
        """
        t   g0   g1   g2   g3
        0   0F0  .    .    .
        1   0F1  1F0  .    .
        2   0F2  1F1  2F0  .
        3   0F3  1F2  2F1  3F0
        4   4F0  1F3  2F2  3F1
        5   4F1  5F0  2F3  3F2
        6   4F2  5F1  6F0  3F3
        7   4F3  5F2  6F1  7F0
        8   .    5F3  6F2  7B0
        9   .    .    6B0  7F1
        10  .    5B0  6F3  7B1
        11  4B0  .    6B1  7F2
        12  .    5B1  .    7B2
        13  4B1  .    6B2  7F3
        14  .    5B2  .    7B3
        15  4B2  .    6B3  3B0
        16  .    5B3  2B0  3B1
        17  4B3  1B0  2B1  3B2
        18  0B0  1B1  2B2  3B3
        19  0B1  1B2  2B3  3U0
        20  0B2  1B3  2U0  7U0
        21  0B3  1U0  6U0  .
        22  0U0  5U0  .    .
        23  4U0  .    .    .
        """,
    )


def test_interleaved_with_one_chunk_is_one_f_one_b():
    for P, M in [(1, 3), (3, 5), (4, 8)]:
        assert interleaved(P, M, 1).actions == one_f_one_b(P, M).actions


# ----------------------------------------------------------------------------- versions


def test_pipedream_versions_match_the_table():
    P, N = 4, 12
    s = pipedream(P, N)
    for group in s.actions:
        for a in group:
            if a.kind in "FB":
                assert a.version == max(0, a.mb - (P - a.stage) + 1)
            else:
                assert a.version == a.mb
    vs = pipedream(P, N, vertical_sync=True)
    assert all(a.version == max(0, a.mb - P + 1) for g in vs.actions for a in g if a.kind in "FB")
    stale = pipedream(P, N, weight_stashing=False)
    for group in stale.actions:
        for a in group:
            if a.kind == "F":
                assert a.version == max(0, a.mb - (P - a.stage) + 1)
            if a.kind == "B":  # the newest weights: updates 0 .. k-1 have run
                assert a.version == a.mb
    # Stage 0 keeps P versions (stashed for its P in-flight microbatches), the last stage 1.
    assert [max(live_versions(s.actions[g], g)) for g in range(P)] == [4, 3, 2, 1]
    assert [max(live_versions(vs.actions[g], g)) for g in range(P)] == [4, 4, 4, 4]
    assert [max(live_versions(stale.actions[g], g)) for g in range(P)] == [1, 1, 1, 1]


def test_2bw_and_flush_versions():
    P, M = 3, 4
    s = pipedream_2bw(P, M, 4 * M)
    for group in s.actions:
        for a in group:
            expected = a.mb if a.kind == "U" else max(0, a.mb // M - 1)
            assert a.version == expected
    assert [max(live_versions(s.actions[g], g)) for g in range(P)] == [2, 2, 2]
    assert format_actions(s.actions).count("U") == P * 4
    flush = one_f_one_b(P, M, steps=3)
    assert all(
        a.version == (a.mb if a.kind == "U" else a.mb // M) for g in flush.actions for a in g
    )
    assert flush.num_steps == 3
    validate(flush)


# ----------------------------------------------------------------------------- every generator


def _family(P: int, M: int) -> list[Schedule]:
    out = [
        gpipe(P, M),
        one_f_one_b(P, M),
        zb_h1(P, M),
        zb_h2(P, M),
        zb_v(P, M),
        interleaved(P, M, 1),
        pipedream(P, M),
        pipedream(P, M, vertical_sync=True),
        pipedream(P, M, weight_stashing=False),
        pipedream(P, M, vertical_sync=True, weight_stashing=False),
    ]
    if M % P == 0:
        out += [interleaved(P, M, 2), interleaved(P, M, 3)]
    if M >= P:
        out += [pipedream_2bw(P, M, M), pipedream_2bw(P, M, 3 * M)]
    return out


@pytest.mark.parametrize("P", STAGES)
def test_every_generator_passes_the_validator(P):
    for M in MICROBATCHES:
        for s in _family(P, M):
            validate(s)
            assert Schedule.from_json(s.to_json()) == s


@pytest.mark.parametrize("P", [2, 3, 5, 8])
def test_steps_and_replicas(P):
    for name in ("gpipe", "1f1b", "zb-h1", "zb-h2", "zb-v", "interleaved", "2bw"):
        s = generate(name, P, 2 * P, steps=2, replicas=[2] * P)
        validate(s)
        assert s.replicas == (2,) * P
        assert s.num_steps == 2


def test_bounds_are_reached():
    """The documented bounds are exact, not loose, once there are enough microbatches."""
    P = 5
    fam = [one_f_one_b(P, 8), pipedream(P, 20), pipedream_2bw(P, P, 4 * P), gpipe(P, 3)]
    for s in [*fam, zb_h2(P, 9), zb_h2(P, 4), zb_v(P, 9), zb_v(P, 12)]:
        for g, group in enumerate(s.actions):
            in_flight = peak = 0
            for a in group:
                in_flight += a.kind == "F"
                peak = max(peak, in_flight)
                in_flight -= a.kind in "BW"
            assert peak == s.in_flight_bound[g], (s.name, g)
    assert one_f_one_b(P, 8).in_flight_bound == (5, 4, 3, 2, 1)
    assert zb_h1(P, 8).in_flight_bound == (5,) * 5
    assert zb_h2(P, 8).in_flight_bound == (8,) * 5
    assert zb_h2(P, 12).in_flight_bound == (9,) * 5
    assert zb_v(P, 8).in_flight_bound == (10,) * 5
    assert interleaved(4, 8, 2).in_flight_bound == (11, 9, 7, 5)


def test_generate_dispatches_and_rejects_unknown_names():
    for name in SCHEDULES:
        s = generate(name, 2, 4, stream=8)
        assert s.name == name
        validate(s)
    assert generate("pipedream", 2, 4).num_microbatches == 4
    assert generate("2bw", 2, 4, steps=3).num_microbatches == 12
    with pytest.raises(ScheduleError, match="unknown schedule 'dapple'; accepted: gpipe"):
        generate("dapple", 2, 4)


def test_json_round_trip_and_bad_json():
    s = interleaved(2, 4, 2, steps=2, replicas=[1, 3])
    text = s.to_json()
    assert Schedule.from_json(text) == s
    assert Schedule.from_json(text).to_json() == text
    with pytest.raises(ScheduleError, match="does not parse"):
        Schedule.from_json("{")
    with pytest.raises(ScheduleError, match="not a pdjax schedule"):
        Schedule.from_json('{"name": "1f1b"}')
    with pytest.raises(ScheduleError, match="malformed 'actions'"):
        Schedule.from_json(text.replace('"actions": [', '"actions": [7, '))
    with pytest.raises(ScheduleError, match="missing keys"):
        Schedule.from_json('{"format": "pdjax.schedule/1", "name": "1f1b"}')


def test_grid_round_trip_for_every_kind():
    for s in [pipedream(3, 6), pipedream_2bw(2, 2, 6), zb_h1(3, 5, steps=2)]:
        assert parse_grid(s.grid()) == s.actions
    with pytest.raises(ScheduleError, match="header"):
        parse_grid("0 0F0")
    with pytest.raises(ScheduleError, match="1 cells, expected 2"):
        parse_grid("t g0 g1\n0 0F0")


# ----------------------------------------------------------------------------- bad parameters


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda: pipedream_2bw(4, 2, 8),
            r"2bw needs microbatches_per_step \(M\) >= .*M=2, P=4.*\[4, inf\)",
        ),
        (lambda: pipedream_2bw(2, 4, 10), r"multiple of microbatches_per_step \(M=4\); got N=10"),
        (lambda: interleaved(4, 6, 2), r"multiple of num_stages \(P=4\); got M=6.*\{4, 8, 12"),
        (
            lambda: interleaved(4, 8, 3, num_layers=16),
            r"divisible by P \* chunks = 12.*chunks.*\[1, 2, 4\]",
        ),
        (lambda: gpipe(0, 4), r"num_stages \(P\) must be an integer >= 1; got 0"),
        (lambda: one_f_one_b(2, 0), r"num_microbatches \(M\) must be an integer >= 1; got 0"),
        (lambda: zb_h1(2, 2, steps=0), r"steps must be an integer >= 1"),
        (lambda: interleaved(2, 2, 0), r"chunks \(v\) must be an integer >= 1"),
        (lambda: pipedream(2, 2.5), r"stream length\) must be an integer >= 1; got 2.5"),
        (
            lambda: one_f_one_b(3, 4, replicas=[1, 2]),
            r"replicas has 2 entries but .* 3 device groups",
        ),
        (lambda: gpipe(2, 4, replicas=[1, 0]), r"every replica count must be an integer >= 1"),
    ],
)
def test_impossible_parameters_are_named(call, message):
    with pytest.raises(ScheduleError, match=message):
        call()


def test_interleaved_layer_count_that_fits():
    validate(interleaved(4, 8, 2, num_layers=16))


# ----------------------------------------------------------------------------- hand-broken


def test_catches_backward_before_forward():
    s = replace_group(one_f_one_b(2, 2), 1, "1B0 1F0 1F1 1B1 1U0")
    with pytest.raises(
        ScheduleError, match=r"group 1, position 0: B\(stage=1, mb=0.*before its forward"
    ):
        validate(s)


def test_catches_weight_grad_before_input_grad():
    s = replace_group(zb_h1(2, 2), 1, "1F0 1W0 1I0 1F1 1I1 1W1 1U0")
    with pytest.raises(ScheduleError, match=r"W\(stage=1, mb=0.*before its input gradient I"):
        validate(s)


@pytest.mark.parametrize("field", ["stage", "mb", "version"])
def test_catches_an_index_that_is_not_an_int(field):
    """A schedule built in Python (not parsed) may carry a float index that compares equal
    to the right int; the validator names it instead of passing it on to a TypeError."""
    s = gpipe(2, 2)
    first = s.actions[1][0]
    bad = first._replace(**{field: float(getattr(first, field))})
    broken = dataclasses.replace(s, actions=(s.actions[0], (bad, *s.actions[1][1:])))
    with pytest.raises(ScheduleError, match=rf"group 1, position 0.*{field} must be an int"):
        validate(broken)


def test_catches_cross_stage_dependency_cycle():
    # group 0 wants group 1's backward of mb 0 before forwarding mb 1; group 1 wants
    # group 0's forward of mb 1 before running that backward.
    s = replace_group(gpipe(2, 2), 0, "0F0 0B0 0F1 0B1 0U0")
    with pytest.raises(ScheduleError, match="cross-stage dependency") as info:
        validate(s)
    assert "group 0, position 1: B(stage=0, mb=0" in str(info.value)
    assert "group 1, position 1: F(stage=1, mb=1" in str(info.value)


def test_catches_repeated_and_dropped_work():
    with pytest.raises(ScheduleError, match=r"position 2: F\(stage=1, mb=0.*repeats work"):
        validate(replace_group(gpipe(2, 2), 1, "1F0 1F1 1F0 1B1 1B0 1U0"))
    with pytest.raises(ScheduleError, match=r"drops work: stage 1, mb 0 has no B"):
        validate(replace_group(gpipe(2, 2), 1, "1F0 1F1 1B1 1U0"))
    with pytest.raises(ScheduleError, match=r"drops work: F\(stage=1, mb=1\) is missing"):
        validate(replace_group(gpipe(2, 2), 1, "1F0 1B1 1B0 1U0"))
    with pytest.raises(ScheduleError, match=r"drops work: stage 0, mb 1 has no W"):
        validate(replace_group(zb_h1(2, 2), 0, "0F0 0F1 0I0 0W0 0I1 0U0"))
    with pytest.raises(ScheduleError, match=r"drops work: U\(stage=1, step=0\) is missing"):
        validate(replace_group(gpipe(2, 2), 1, "1F0 1F1 1B1 1B0"))
    with pytest.raises(ScheduleError, match=r"has both B and I"):
        validate(replace_group(zb_h1(2, 1), 1, "1F0 1I0 1B0 1W0 1U0"))


def test_catches_in_flight_bound():
    # Two forwards before a backward on 1F1B's last stage, whose bound is P - s = 1.
    s = replace_group(one_f_one_b(3, 3), 2, "2F0 2F1 2B0 2B1 2F2 2B2 2U0")
    with pytest.raises(
        ScheduleError, match=r"group 2, position 1: F\(stage=2, mb=1.*in-flight bound: 2 > 1"
    ):
        validate(s)


def test_catches_wrong_version():
    s = replace_group(pipedream(2, 3), 1, "1F0 1B0 1U0 1F1 1B1v1 1U1v1 1F2v2 1B2v2 1U2v2")
    with pytest.raises(
        ScheduleError,
        match=r"F\(stage=1, mb=1, version=0\) uses weight version 0.*requires version 1",
    ):
        validate(s)
    flush = one_f_one_b(2, 2)
    broken = replace_group(flush, 0, "0F0 0F1v1 0B0 0B1 0U0")
    with pytest.raises(ScheduleError, match=r"1f1b runs every microbatch of step 0 with version 0"):
        validate(broken)
    stale = replace_group(pipedream(2, 2, weight_stashing=False), 1, "1F0 1B0 1U0 1F1v1 1B1 1U1v1")
    with pytest.raises(ScheduleError, match=r"newest weights, version 1"):
        validate(stale)


def test_catches_version_not_yet_made():
    s = replace_group(
        one_f_one_b(2, 2, steps=2), 1, "1F0 1B0 1F1 1B1 1F2v1 1U0 1B2v1 1F3v1 1B3v1 1U1v1"
    )
    with pytest.raises(
        ScheduleError,
        match=r"F\(stage=1, mb=2, version=1\) needs weight version 1, which does not exist yet",
    ):
        validate(s)


def test_catches_update_before_its_gradients():
    s = replace_group(gpipe(2, 2), 1, "1F0 1F1 1B1 1U0 1B0")
    with pytest.raises(
        ScheduleError, match=r"U\(stage=1, step=0.*before the backward of microbatch 0"
    ):
        validate(s)


def test_catches_version_bound():
    # Without weight stashing a stage keeps one version: running F(0, 3) (version 2) after
    # the update that makes version 3 needs two at once.
    s = pipedream(2, 5, weight_stashing=False)
    broken = replace_group(
        s, 0, "0F0 0F1 0B0 0U0 0F2v1 0B1v1 0U1v1 0B2v2 0U2v2 0F3v2 0B3v3 0U3v3 0F4v3 0B4v4 0U4v4"
    )
    with pytest.raises(
        ScheduleError,
        match=r"position 9: F\(stage=0, mb=3, version=2\): stage 0 keeps 2 weight versions "
        r"here, more than pipedream's bound of 1",
    ):
        validate(broken)


def test_catches_misplaced_and_out_of_range_actions():
    s = gpipe(2, 1)
    with pytest.raises(ScheduleError, match="stage 1 lives on device group 1, not 0"):
        validate(dataclasses.replace(s, actions=(acts("0F0 1F0 0B0 0U0"), acts("1B0 1U0"))))
    with pytest.raises(ScheduleError, match=r"microbatch out of range \[0, 1\)"):
        validate(replace_group(s, 1, "1F0 1F1 1B0 1U0"))
    with pytest.raises(ScheduleError, match=r"step out of range \[0, 1\)"):
        validate(replace_group(s, 1, "1F0 1B0 1U0 1U1v1"))
    with pytest.raises(ScheduleError, match=r"stage out of range \[0, 2\)"):
        validate(replace_group(s, 1, "1F0 1B0 1U0 5F0"))


def test_catches_bad_headers():
    s = one_f_one_b(3, 4)
    cases = [
        (dataclasses.replace(s, name="dapple"), "unknown schedule name 'dapple'"),
        (
            dataclasses.replace(s, in_flight_bound=(4, 4, 4)),
            "in_flight_bound=4 but 1f1b holds at most 3",
        ),
        (dataclasses.replace(s, version_bound=(2, 1, 1)), "version_bound=2 but 1f1b keeps 1"),
        (dataclasses.replace(s, stage_device=(0, 2, 1)), r"stage_device must be \[0, 1, 2\]"),
        (dataclasses.replace(s, replicas=(1, 1)), "replicas has 2 entries, expected 3"),
        (dataclasses.replace(s, microbatches_per_step=3), "not a multiple"),
        (dataclasses.replace(s, vertical_sync=True), "pipedream options only"),
        (dataclasses.replace(s, num_stages=6), "only interleaved and zb-v put several stages"),
    ]
    v = zb_v(2, 4)
    cases += [
        (
            dataclasses.replace(v, stage_device=(0, 1, 0, 1)),
            r"stage_device must be \[0, 1, 1, 0\] \(the V: stage s on group min\(s, 2P - 1 - s\)\)",
        ),
        (
            dataclasses.replace(v, in_flight_bound=(3, 4)),
            "in_flight_bound=3 but zb-v holds at most 4",
        ),
        (dataclasses.replace(zb_h2(3, 6), in_flight_bound=(6, 5, 5)), "zb-h2 holds at most 5"),
    ]
    for broken, message in cases:
        with pytest.raises(ScheduleError, match=message):
            validate(broken)


def test_every_single_swap_of_a_valid_schedule_is_judged_consistently():
    """Swapping two adjacent actions either keeps a valid schedule or names an action."""
    s = zb_h1(3, 3)
    for g in range(3):
        for i in range(len(s.actions[g]) - 1):
            _check_swap(s, g, i)


def _check_swap(s: Schedule, g: int, i: int) -> None:
    group = list(s.actions[g])
    group[i], group[i + 1] = group[i + 1], group[i]
    try:
        validate(replace_group(s, g, " ".join(map(str, group))))
    except ScheduleError as e:
        assert "stage=" in str(e)


def _broken_variants(s: Schedule) -> list[tuple[str, Schedule]]:
    """Generic hand-breakages that apply to any schedule: drop, repeat, re-version, reorder."""
    group = list(s.actions[-1])
    first_backward = next(i for i, a in enumerate(group) if a.kind in "BI")
    a = group[first_backward]
    forward = group.index(
        next(x for x in group if x.kind == "F" and x.mb == a.mb and x.stage == a.stage)
    )
    reordered = group.copy()
    reordered.insert(forward, reordered.pop(first_backward))
    reversioned = group.copy()
    reversioned[0] = reversioned[0]._replace(version=reversioned[0].version + 1)

    def put(actions: list[Action]) -> Schedule:
        return replace_group(s, s.num_groups - 1, " ".join(map(str, actions)))

    return [
        ("drops work", put(group[:-1])),
        ("repeats work", put([*group, group[0]])),
        ("uses weight version", put(reversioned)),
        ("before its forward", put(reordered)),
    ]


@pytest.mark.parametrize("name", SCHEDULES)
def test_catches_hand_broken_schedules_of_each_kind(name):
    for message, broken in _broken_variants(generate(name, 3, 6, stream=12)):
        with pytest.raises(ScheduleError, match=message):
            validate(broken)


def test_pipedream_extra_in_flight_grid_and_bounds():
    """Latency hiding: stage 0 of 2 keeps 3 microbatches in flight (one more version),
    the last stage still alternates F and B."""
    s = pipedream(2, 6, extra_in_flight=1)
    validate(s)
    assert format_actions(s.actions) == (
        "g0: 0F0 0F1 0F2 0B0 0U0 0F3v1 0B1 0U1v1 0F4v2 0B2 0U2v2 0F5v3 0B3v1 0U3v3 0B4v2 "
        "0U4v4 0B5v3 0U5v5\n"
        "g1: 1F0 1B0 1U0 1F1v1 1B1v1 1U1v1 1F2v2 1B2v2 1U2v2 1F3v3 1B3v3 1U3v3 1F4v4 1B4v4 "
        "1U4v4 1F5v5 1B5v5 1U5v5"
    )
    assert s.in_flight_bound == (3, 1) and s.version_bound == (3, 1)
    assert Schedule.from_json(s.to_json()) == s
    with pytest.raises(ScheduleError, match="extra_in_flight must be an integer >= 0"):
        pipedream(2, 6, extra_in_flight=-1)
    with pytest.raises(ScheduleError, match="option of pipedream"):
        generate("1f1b", 2, 4, extra_in_flight=1)
    # a schedule claiming the extra microbatches without running them is refused
    fake = dataclasses.replace(pipedream(2, 6), extra_in_flight=1)
    with pytest.raises(ScheduleError):
        validate(fake)


# ----------------------------------------------------------------------------- round-robin


def test_round_robin_pipedream_grid_and_versions():
    """Stage 0 on 2 round-robin replicas takes microbatches two at a time: q_0 =
    ceil((2 + 1) / 2) = 2 groups in flight, group g at version max(0, g - 1), one update
    per group; stage 1 is plain PipeDream (one in flight, version k)."""
    s = generate("pipedream", 2, 8, replicas=(2, 1), replication="round-robin")
    validate(s)
    assert format_actions(s.actions) == (
        "g0: 0F0 0F2 0B0 0U0 0F4v1 0B2 0U1v1 0F6v2 0B4v1 0U2v2 0B6v2 0U3v3\n"
        "g1: 1F0 1B0 1U0 1F1v1 1B1v1 1U1v1 1F2v2 1B2v2 1U2v2 1F3v3 1B3v3 1U3v3 "
        "1F4v4 1B4v4 1U4v4 1F5v5 1B5v5 1U5v5 1F6v6 1B6v6 1U6v6 1F7v7 1B7v7 1U7v7"
    )
    assert s.in_flight_bound == (4, 1) and s.version_bound == (2, 1)
    assert [s.group_size(st) for st in range(2)] == [2, 1]
    assert s.updates_of(0) == 4 and s.updates_of(1) == 8
    assert Schedule.from_json(s.to_json()) == s


def test_round_robin_groups_of_different_sizes_do_not_deadlock_and_run_at_full_rate():
    """Stage 0 (2 replicas) feeds stage 1 (3 replicas): stage 0's oldest group {0, 1} needs
    stage 1's group {0, 1, 2} back, which needs stage 0's next group too (at least 3 groups
    in flight); a group leaves all at once and queues at the next stage, so full rate
    takes one more (q_0 = 4). With unit costs every such pipeline runs at one microbatch
    per 3 units (F = 1, B = 2 per microbatch on one device), like a pipeline of single
    devices."""
    from pdjax.schedules import round_robin_in_flight
    from pdjax.simulator import simulate, stream_length, unit_costs

    s = generate("pipedream", 2, 12, replicas=(2, 3), replication="round-robin")
    validate(s)
    assert s.in_flight_bound == (8, 3)
    assert round_robin_in_flight([1, 1, 1, 1]) == (4, 3, 2, 1)
    assert round_robin_in_flight([2, 3], extra=1) == (5, 1)
    for reps in [(1, 2), (2, 3), (12, 2, 1, 1), (3, 2, 1), (1, 3, 1), (2, 1, 1)]:
        P = len(reps)
        N = stream_length("pipedream", P, replicas=reps, replication="round-robin")
        sched = generate("pipedream", P, N, replicas=reps, replication="round-robin")
        steady = simulate(sched, unit_costs(P)).time_per_microbatch
        assert steady == pytest.approx(3.0, abs=0.05), (reps, steady)
    # every mix of replicas, modes and schedules is valid (deadlock-free, right versions)
    for reps in itertools.product((1, 2, 3), repeat=3):
        for modes in itertools.product(("split", "round-robin"), repeat=3):
            units = [r if m == "round-robin" else 1 for r, m in zip(reps, modes, strict=True)]
            L = math.lcm(*units)
            kw = {"replicas": reps, "replication": modes}
            validate(generate("pipedream", 3, 4 * L, extra_in_flight=1, **kw))
            validate(generate("1f1b", 3, 2 * L, steps=2, **kw))
            validate(generate("gpipe", 3, L, **kw))
            validate(generate("2bw", 3, 3 * L, stream=6 * L, **kw))


def test_round_robin_refusals_and_validator():
    with pytest.raises(ScheduleError, match="no round-robin form"):
        generate("zb-h1", 2, 4, replicas=(2, 1), replication="round-robin")
    with pytest.raises(ScheduleError, match="not a multiple of device group 0's 2"):
        generate("1f1b", 2, 3, replicas=(2, 1), replication="round-robin")
    with pytest.raises(ScheduleError, match="weight stashing"):
        generate("pipedream", 2, 4, replicas=(2, 1), replication="round-robin", vertical_sync=True)
    with pytest.raises(ScheduleError, match="must be 'split' or 'round-robin'"):
        generate("1f1b", 2, 4, replicas=(2, 1), replication="rr")
    # one replica round-robin is split: the schedule is the plain one
    assert generate("1f1b", 2, 4, replication="round-robin") == generate("1f1b", 2, 4)
    s = generate("pipedream", 2, 8, replicas=(2, 1), replication="round-robin")
    acts = list(s.actions[0])
    acts[4] = acts[4]._replace(version=0)  # group 2 needs version 1
    with pytest.raises(ScheduleError, match="max\\(0, g - q_s \\+ 1\\)"):
        validate(dataclasses.replace(s, actions=(tuple(acts), s.actions[1])))
    acts = list(s.actions[0])
    acts[1] = acts[1]._replace(mb=1)  # not a group's first microbatch
    with pytest.raises(ScheduleError, match="round-robin over 2"):
        validate(dataclasses.replace(s, actions=(tuple(acts), s.actions[1])))


def _unit_rate_played(units, q):
    """The reference for ``inflight.unit_rate``: the same orders as a :class:`Schedule`,
    played by the general simulator ``play.play``."""
    from pdjax.schedules import Action, Schedule, play
    from pdjax.schedules.inflight import group_order, unit_stream

    P = len(units)
    N = unit_stream(units, q)
    assert all(N % n == 0 for n in units)  # play needs whole groups
    actions = tuple(
        tuple(Action(kind, st, g * n) for kind, g in group_order(N // n, q[st] - 1))
        for st, n in enumerate(units)
    )
    sched = Schedule(
        name="pipedream",
        num_stages=P,
        num_microbatches=N,
        microbatches_per_step=1,
        actions=actions,
        stage_device=tuple(range(P)),
        replicas=tuple(units),
        in_flight_bound=(0,) * P,
        version_bound=(0,) * P,
        replication=tuple("round-robin" if n > 1 else "split" for n in units),
    )
    _, ends, _ = play(sched, lambda a: (1 if a.kind == "F" else 2) * units[a.stage], None)
    done = [e for a, e in zip(actions[0], ends[0], strict=True) if a.kind == "B"]
    lo, hi = int(len(done) * 0.4), int(len(done) * 0.6)
    return (done[hi] - done[lo]) / ((hi - lo) * units[0])


@pytest.mark.parametrize("seed", range(4))
def test_unit_rate_equals_the_general_simulator(seed):
    """The planner's fast in-flight search plays the same game as ``play``: equal rates
    for random groups and in-flight counts, at, below and above the searched counts."""
    from pdjax.schedules import round_robin_in_flight
    from pdjax.schedules.inflight import unit_rate, unstuck

    rng = np.random.default_rng(seed)
    for _ in range(6):
        units = tuple(int(x) for x in rng.integers(1, 6, size=int(rng.integers(2, 6))))
        searched = round_robin_in_flight(units)
        for q in (searched, unstuck(units, [1] * len(units)),
                  tuple(x + int(rng.integers(0, 3)) for x in searched)):  # fmt: skip
            q = unstuck(units, list(q))
            assert unit_rate(units, q) == pytest.approx(_unit_rate_played(units, q)), (units, q)


def test_unit_rate_with_groups_cut_short_reads_the_same_steady_state():
    """Where a multiple of every group size would be a long stream, the stages' last groups
    are cut short: the middle of the stream reads the same rate as a whole-group stream
    (exactly 3 at full rate, within a percent below it)."""
    from pdjax.schedules import round_robin_in_flight
    from pdjax.schedules.inflight import unit_rate, unit_stream, unstuck

    for units in [(5, 7, 3), (4, 9, 5, 1), (7, 1, 6, 1, 5)]:
        period = math.lcm(*units)
        for q in (round_robin_in_flight(units), unstuck(units, [1] * len(units))):
            N = unit_stream(units, q)
            whole = period * -(-max(N, 12 * period) // period)
            cut = unit_rate(units, q, length=whole + 1)  # every stage's last group short
            assert cut == pytest.approx(unit_rate(units, q, length=whole), rel=0.01)
            if unit_rate(units, q, length=whole) == 3.0:
                assert cut == 3.0
