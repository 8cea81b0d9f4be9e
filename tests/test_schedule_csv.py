"""torch.distributed.pipelining's CSV schedules: round trips, hand-written files, errors.

The fixtures in ``fixtures/torch_schedules`` are written by hand in torch's format (one
row per rank, ``<stage><type>[<microbatch>]`` cells, empty cells for idle steps,
communication cells as torch's ``compute_comms`` lowering places them); the makespans
below are worked out by hand from the rows.
"""

from __future__ import annotations

import io
import itertools
import re
from pathlib import Path

import pytest

from pdjax.errors import ScheduleError
from pdjax.schedules import Action, Schedule, generate, gpipe, one_f_one_b, validate
from pdjax.schedules.torch_csv import read_torch_csv, write_torch_csv
from pdjax.simulator import simulate, unit_costs

FIXTURES = Path(__file__).parent / "fixtures" / "torch_schedules"


def read_text(text: str, **kwargs: object) -> Schedule:
    return read_torch_csv(io.StringIO(text), **kwargs)  # type: ignore[arg-type]


def csv_text(schedule: Schedule, **kwargs: object) -> str:
    out = io.StringIO()
    write_torch_csv(schedule, out, **kwargs)  # type: ignore[arg-type]
    return out.getvalue()


def compute(schedule: Schedule) -> list[list[str]]:
    return [
        [f"{a.stage}{a.kind}{a.mb}" for a in acts if a.kind != "U"] for acts in schedule.actions
    ]


# ----------------------------------------------------------------------------- round trips


def _flush_schedules() -> list[Schedule]:
    out = []
    for name, P, M, steps in itertools.product(
        ("gpipe", "1f1b", "zb-h1"), (1, 2, 3, 4), (1, 2, 3, 5, 8), (1, 2)
    ):
        out.append(generate(name, P, M, steps=steps))
    for P, v, times, steps in itertools.product((1, 2, 3, 4), (2, 3), (1, 2), (1, 2)):
        out.append(generate("interleaved", P, P * times, chunks=v, steps=steps))
    out.append(generate("interleaved", 3, 5, chunks=1))
    for name, P, M, steps in itertools.product(("zb-h2", "zb-v"), (1, 2, 3), (1, 2, 5), (1, 2)):
        out.append(generate(name, P, M, steps=steps))
    return out


@pytest.mark.parametrize("aligned", [True, False])
def test_round_trip_of_every_flush_schedule(aligned: bool) -> None:
    for schedule in _flush_schedules():
        text = csv_text(schedule, aligned=aligned)
        back = read_text(
            text, name=schedule.name, microbatches_per_step=schedule.microbatches_per_step
        )
        assert back == schedule, (schedule.name, schedule.num_groups, schedule.num_microbatches)


def test_round_trip_through_a_file(tmp_path: Path) -> None:
    schedule = generate("zb-h1", 4, 6)
    path = tmp_path / "zb.csv"
    write_torch_csv(schedule, path)
    assert read_torch_csv(path, name="zb-h1") == schedule
    assert read_torch_csv(str(path), name="zb-h1") == schedule


def test_written_rows_are_torch_compute_cells_in_unit_time_steps() -> None:
    schedule = one_f_one_b(3, 4, steps=2)
    text = csv_text(schedule)
    assert text.endswith("\r\n")  # csv.writer's line ends, as torch's _dump_csv writes
    rows = [line.split(",") for line in text.splitlines()]
    assert len(rows) == 3
    cells = [[c for c in row if c] for row in rows]
    assert cells == compute(schedule)  # the updates and the versions are dropped
    assert not any("U" in c or "v" in c for row in rows for c in row)
    # a cell's index is its unit-time tick: a consumer is always in a later cell
    tick = {c: t for row in rows for t, c in enumerate(row) if c}
    for c, t in tick.items():
        stage, kind, mb = int(c[0]), c[1], c[2:]
        if kind == "F" and stage > 0:
            assert t > tick[f"{stage - 1}F{mb}"]
        if kind == "B" and stage < 2:
            assert t > tick[f"{stage + 1}B{mb}"]
    assert rows[0][:6] == ["0F0", "0F1", "0F2", "", "", "0B0"]  # waits for 2B0, then 1B0


def test_unaligned_rows_have_no_empty_cells() -> None:
    text = csv_text(one_f_one_b(2, 3), aligned=False)
    assert text.replace("\r", "") == "0F0,0F1,0B0,0F2,0B1,0B2\n1F0,1B0,1F1,1B1,1F2,1B2\n"


def test_multi_step_read_back_needs_microbatches_per_step() -> None:
    schedule = one_f_one_b(2, 2, steps=2)
    text = csv_text(schedule)
    one_step = read_text(text)  # torch runs the file as one step of 4 microbatches
    assert (one_step.num_microbatches, one_step.microbatches_per_step) == (4, 4)
    assert compute(one_step) == compute(schedule)
    assert read_text(text, microbatches_per_step=2) == schedule
    with pytest.raises(ScheduleError, match="not a whole number of steps"):
        read_text(text, microbatches_per_step=3)


def test_write_refuses_what_torch_cannot_say() -> None:
    with pytest.raises(ScheduleError, match="pipedream updates inside its stream"):
        csv_text(generate("pipedream", 2, 4))
    with pytest.raises(ScheduleError, match="round-robin"):
        csv_text(gpipe(2, 2, replicas=(2, 1), replication="round-robin"))


# ----------------------------------------------------------------------------- hand-written files


def test_hand_written_1f1b_two_ranks_four_microbatches() -> None:
    # 0F0,0F1,,0B0,0F2,0B1,0F3,0B2,,0B3,0REDUCE_GRAD  (CRLF, as csv.writer writes)
    # ,1F0,1B0,1F1,1B1,1F2,1B2,1F3,1B3,1REDUCE_GRAD
    schedule = read_torch_csv(FIXTURES / "1f1b_2rank_4mb.csv", name="1f1b")
    validate(schedule)
    assert schedule == one_f_one_b(2, 4)
    assert schedule.actions[0][-1] == Action("U", 0, 0, 0)
    # F = 1, B = 2, free transfers: stage 1 runs F/B pairs from t=1 ([1,2] 1F0, [2,4] 1B0,
    # [4,5] 1F1, ... each waiting for 0F_k, which waits for 0B_{k-1} at [4,6], [7,9], ...);
    # stage 0's last backward waits for 1B3 ([11,13]) and ends at 15 = (M + P - 1)(F + B).
    sim = simulate(schedule, unit_costs(2))
    assert sim.makespan == 15.0
    assert sim.bubble_fraction == pytest.approx(1 - 2 * 12 / (2 * 15))


def test_hand_written_interleaved_zero_bubble_with_communication() -> None:
    path = FIXTURES / "interleaved_zb_2rank_2mb_comms.csv"
    schedule = read_torch_csv(path, name="interleaved")
    validate(schedule)
    assert (schedule.num_stages, schedule.num_groups, schedule.num_microbatches) == (4, 2, 2)
    assert schedule.stage_device == (0, 1, 0, 1)
    assert compute(schedule) == [
        "0F0 0F1 2F0 2F1 2I0 2W0 2I1 0I0 2W1 0I1 0W0 0W1".split(),
        "1F0 1F1 3F0 3I0 3W0 3F1 3I1 1I0 3W1 1I1 1W0 1W1".split(),
    ]
    assert [a for a in schedule.actions[0] if a.kind == "U"] == [
        Action("U", 0, 0, 0),
        Action("U", 2, 0, 0),
    ]
    # Every F, I, W one unit per virtual stage. By hand, [start, end):
    #   rank 0: 0F0 [0,1] 0F1 [1,2] 2F0 [2,3] 2F1 [3,4] 2I0 [5,6] (after 3I0) 2W0 [6,7]
    #           2I1 [8,9] (after 3I1) 0I0 [9,10] 2W1 [10,11] 0I1 [11,12] 0W0 [12,13] 0W1 [13,14]
    #   rank 1: 1F0 [1,2] 1F1 [2,3] 3F0 [3,4] 3I0 [4,5] 3W0 [5,6] 3F1 [6,7] 3I1 [7,8]
    #           1I0 [8,9] 3W1 [9,10] 1I1 [10,11] 1W0 [11,12] 1W1 [12,13]
    sim = simulate(schedule, unit_costs(4))
    assert sim.makespan == 14.0
    assert sim.bubble_fraction == pytest.approx(1 - 24 / 28)
    starts = {str(s.action): s.start for s in sim.timeline.spans}
    assert (starts["2I0"], starts["1I0"], starts["0W1"]) == (5.0, 8.0, 13.0)


def test_hand_written_files_write_back_to_their_compute_cells() -> None:
    for path in sorted(FIXTURES.glob("*.csv")):
        name = "interleaved" if "interleaved" in path.name else "1f1b"
        schedule = read_torch_csv(path, name=name)
        rows = path.read_text().splitlines()
        expected = [[c for c in row.split(",") if re.fullmatch(r"\d+[FBIW]\d+", c)] for row in rows]
        written = csv_text(schedule, aligned=False).replace("\r", "").splitlines()
        assert [row.split(",") for row in written] == expected, path.name


def test_overlap_f_b_cells_run_their_sub_actions_in_order() -> None:
    text = "0F0,0F1,0B1,0B0\n1F0,(1F1;1B0)OVERLAP_F_B,1B1\n"
    schedule = read_text(text, name="gpipe")
    assert compute(schedule)[1] == ["1F0", "1F1", "1B0", "1B1"]


def test_empty_trailing_rows_and_whitespace_are_ignored() -> None:
    text = " 0F0 , 0B0 ,,\n1F0,1B0\n\n,,\n"
    assert compute(read_text(text)) == [["0F0", "0B0"], ["1F0", "1B0"]]


# ----------------------------------------------------------------------------- errors

GOOD = "0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n"


@pytest.mark.parametrize(
    ("text", "where", "what"),
    [
        # cells that are not torch actions
        ("0F0,0X0,0B0\n1F0,1B0\n", r"rank 0 \(row 1\), cell 2 '0X0'", "not a torch pipelining"),
        ("0F0,0B0\n1F0,F0,1B0\n", r"rank 1 \(row 2\), cell 2 'F0'", "<stage><type>"),
        ("0F0,0BW0\n1F0,1B0\n", r"rank 0 \(row 1\), cell 2 '0BW0'", "spelled the full backward"),
        ("0F0,0B0,0U0\n1F0,1B0\n", r"cell 3 '0U0'", "pdjax's update U"),
        ("0F0,0B0v1\n1F0,1B0\n", r"cell 2 '0B0v1'", "versions"),
        ("0F,0B0\n1F0,1B0\n", r"rank 0 \(row 1\), cell 1 '0F'", "needs its microbatch"),
        ("0F0,0B0\n1F0,(1B0;1X)OVERLAP_F_B\n", r"cell 2 '\(1B0;1X\)OVERLAP_F_B'", "'1X'"),
        # a stage on two ranks
        ("0F0,0B0\n1F0,0F1,1B0\n", r"rank 1 \(row 2\), cell 2 '0F1'", "already runs on rank 0"),
        # communication on the wrong rank, or of no stage
        ("0F0,1SEND_F0,0B0\n1F0,1B0\n", r"cell 2 '1SEND_F0'", "move it to row 2"),
        ("0F0,0B0\n1F0,1B0,2RECV_F0\n", r"cell 3 '2RECV_F0'", "no row computes"),
        # missing and repeated work
        ("0F0,0F1,0B0,0B1\n1F0,1B0,1B1\n", r"rank 1 \(row 2\), cell 3 '1B1'", "no forward '1F1'"),
        ("0F0,0B0,0F1\n1F0,1B0,1F1,1B1\n", r"cell 3 '0F1' has no backward", "add '0B1'"),
        ("0F0,0F1,0B0,0B1\n1F0,1B0\n", r"stage 1 \(rank 1, row 2\)", "add '1F1' to row 2"),
        ("0B0,0F0\n1F0,1B0\n", r"cell 1 '0B0' runs before its forward .*cell 2 '0F0'", "move"),
        ("0F0,0B0,0I0,0W0\n1F0,1B0\n", r"cell 3 '0I0'.* cell 2 '0B0'", "or the pair I then W"),
        ("0F0,0B0,0W0\n1F0,1B0\n", r"cell 3 '0W0'.*cell 2 '0B0'", "rename that B to '0I0'"),
        ("0F0,0W0,0B0\n1F0,1B0\n", r"cell 2 '0W0'", "whole backward '0B0' later"),
        ("0F0,0W0\n1F0,1B0\n", r"cell 2 '0W0'", "no input gradient '0I0'"),
        ("0F0,0W0,0I0\n1F0,1B0\n", r"cell 2 '0W0' runs before its input gradient", "cell 3"),
        ("0F0,0I0\n1F0,1B0\n", r"cell 2 '0I0' has no weight gradient", "add '0W0'"),
        ("0F0,0F0,0B0\n1F0,1B0\n", r"cell 2 '0F0' repeats rank 0 \(row 1\), cell 1", "once"),
        # layouts pdjax does not run
        ("0F0,0B0\n\n2F0,2B0\n", r"rank 1 \(row 2\) has no compute actions", "drop the row"),
        ("0F0,0B0\n2F0,2B0\n", "no row computes stage 1", "add stage 1"),
        ("0F0,3F0,3B0,0B0\n1F0,2F0,2B0,1B0\n", r"rank 1 \(row 2\), cell 2 '2F0'", "V-shaped"),
        ("0F0,2F0,2B0,0B0\n1F0,3F0,3B0,1B0\n", r"rank 0 \(row 1\) holds stages 0, 2", "name='int"),
        ("0F0,2F0,2B0,0B0\n1F0,1B0\n", "3 stages over 2 ranks", "same number of stages"),
    ],
)
def test_bad_input_names_the_row_and_the_cell(text: str, where: str, what: str) -> None:
    with pytest.raises(ScheduleError) as info:
        read_text(text)
    assert info.match(where)
    assert what in str(info.value)


def test_a_deadlock_names_the_waiting_cells() -> None:
    # rank 0 waits for 1B0 before its 0F1, rank 1 for 0F1 before its 1B0
    text = "0F0,0B0,0F1,0B1\n1F0,1F1,1B0,1B1\n"
    with pytest.raises(ScheduleError, match="deadlock") as info:
        read_text(text, name="gpipe")
    message = str(info.value)
    assert "rank 0 (row 1), cell 2 '0B0'" in message
    assert "rank 1 (row 2), cell 2 '1F1'" in message
    assert "device group" not in message


def test_more_in_flight_than_the_name_allows() -> None:
    # interleaved allows 3 microbatches in flight on rank 1 of 2 (v = 2); 3F1 makes 4
    text = (
        "0F0,0F1,2F0,2F1,2I0,2W0,2I1,0I0,2W1,0I1,0W0,0W1\n"
        "1F0,1F1,3F0,3I0,3F1,3W0,3I1,1I0,3W1,1I1,1W0,1W1\n"
    )
    with pytest.raises(ScheduleError, match="in-flight bound") as info:
        read_text(text, name="interleaved")
    assert info.match(r"rank 1 \(row 2\), cell 5 '3F1'")
    assert info.match(r"interleaved allows \[4, 3\] microbatches in flight per rank")
    with pytest.raises(ScheduleError, match=r"rank 1 \(row 2\), cell 2 '1F1'.*in-flight") as info:
        read_text("0F0,0F1,0B0,0B1\n1F0,1F1,1B0,1B1\n", name="1f1b")
    # the advice names the names the file does read under (each tried)
    assert info.match(r"1f1b allows \[2, 1\] .*; the file reads as gpipe and .*: give name='gpipe'")
    assert read_text("0F0,0F1,0B0,0B1\n1F0,1F1,1B0,1B1\n", name="gpipe").name == "gpipe"


def test_a_step_started_before_the_last_one_ended() -> None:
    text = "0F0,0F1,0F2,0B0,0B1,0B2,0F3,0B3\n1F0,1B0,1F1,1B1,1F2,1B2,1F3,1B3\n"
    with pytest.raises(ScheduleError) as info:
        read_text(text, name="gpipe", microbatches_per_step=2)
    assert info.match(r"rank 0 \(row 1\), cell 3 '0F2' belongs to step 1")
    assert info.match(r"before rank 0 \(row 1\), cell 5 '0B1' of step 0")


def test_names_and_arguments() -> None:
    with pytest.raises(ScheduleError, match="one flush step"):
        read_text(GOOD, name="pipedream")
    with pytest.raises(ScheduleError, match="microbatches_per_step must be"):
        read_text(GOOD, microbatches_per_step=0)
    with pytest.raises(ScheduleError, match="no rows"):
        read_text("\n\n")
    with pytest.raises(ScheduleError, match="cannot read"):
        read_torch_csv(FIXTURES / "missing.csv")
    assert read_text(GOOD, replicas=(2, 1)).replicas == (2, 1)


def test_errors_start_with_the_file_they_come_from(tmp_path: Path) -> None:
    path = tmp_path / "bad.csv"
    path.write_text("0F0,0B0\n1F0,1X0\n")
    with pytest.raises(ScheduleError, match=rf"^{re.escape(str(path))}: rank 1 \(row 2\)"):
        read_torch_csv(path)
    path.write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(ScheduleError, match="cannot read"):
        read_torch_csv(path)


def test_interleaved_with_fewer_microbatches_than_ranks() -> None:
    # torch's interleaved schedules do not need M to be a multiple of P; pdjax's generator
    # does, so the bounds come from the documented formula: min(2 (P - d - 1) + (v - 1) P + 1, M v)
    text = "0F0,2F0,2B0,0B0\n1F0,3F0,3B0,1B0\n"
    schedule = read_text(text, name="interleaved")
    assert schedule.in_flight_bound == (2, 2)
    assert simulate(schedule, unit_costs(4)).makespan == 12.0  # 4 F then 4 B, one chain


def test_hand_written_zbv_two_ranks_with_communication() -> None:
    # torch's ZBV layout: rank 0 holds stages 0 and 3, rank 1 stages 1 and 2 (a V); the turn
    # (1 -> 2) stays on rank 1, so only 0 <-> 1 and 2 <-> 3 cross ranks
    text = (
        "0F0,0SEND_F0,0F1,0SEND_F1,0RECV_F0,3F0,3I0,3W0,0RECV_F1,3F1,3I1,3SEND_B0,3W1,"
        "3SEND_B1,0RECV_B0,0I0,0W0,0RECV_B1,0I1,0W1\n"
        "1RECV_F0,1F0,1RECV_F1,1F1,2F0,2F1,2SEND_F0,2SEND_F1,2RECV_B0,2I0,2W0,2RECV_B1,"
        "2I1,2W1,1I0,1SEND_B0,1I1,1SEND_B1,1W0,1W1\n"
    )
    schedule = read_text(text, name="zb-v")
    validate(schedule)
    assert schedule.stage_device == (0, 1, 1, 0)
    assert [a for a in schedule.actions[1] if a.kind == "U"] == [
        Action("U", 1, 0, 0),
        Action("U", 2, 0, 0),
    ]
    # written back, the compute cells are the file's, in order
    assert compute(schedule) == [
        "0F0 0F1 3F0 3I0 3W0 3F1 3I1 3W1 0I0 0W0 0I1 0W1".split(),
        "1F0 1F1 2F0 2F1 2I0 2W0 2I1 2W1 1I0 1I1 1W0 1W1".split(),
    ]
    with pytest.raises(ScheduleError, match="name='zb-v'"):
        read_text(text, name="zb-h1")
    with pytest.raises(ScheduleError, match=r"stage 2 runs on rank 0, but zb-v places .* = 1"):
        read_text("0F0,2F0,2B0,0B0\n1F0,3F0,3B0,1B0\n", name="zb-v")
    with pytest.raises(ScheduleError, match="expected 4"):
        read_text("0F0,0B0\n1F0,1B0\n", name="zb-v")


# torch's ScheduleInterleavedZeroBubble (ZB1P over interleaved stages) for 2 ranks, 2 stages
# each, 2 microbatches, as its current CSV writes it with communication: I and W split, each
# W deferred after its I (torch's num_1f1b_microbatches = rank), so rank 1 holds 4
# microbatches in flight at 3F1 (3I0 done, 3W0 not yet) where interleaved 1F1B holds 3.
TORCH_INTERLEAVED_ZB = (
    "0F0,0SEND_F0,0F1,0SEND_F1,2RECV_F0,2F0,2SEND_F0,2RECV_F1,2F1,2SEND_F1,2RECV_B0,2I0,"
    "2SEND_B0,2W0,2RECV_B1,2I1,2SEND_B1,2W1,0RECV_B0,0I0,0W0,0RECV_B1,0I1,0W1\n"
    "1RECV_F0,1F0,1SEND_F0,1RECV_F1,1F1,1SEND_F1,3RECV_F0,3F0,3I0,3SEND_B0,3RECV_F1,3F1,"
    "3I1,3SEND_B1,3W0,1RECV_B0,1I0,1SEND_B0,3W1,1RECV_B1,1I1,1SEND_B1,1W0,1W1\n"
)


def test_torch_interleaved_zero_bubble_is_refused_with_advice_that_leads_somewhere() -> None:
    """No pdjax schedule holds torch's interleaved zero bubble (its deferred W's keep more
    in flight than interleaved allows): every name the user is sent to by an error
    either reads a file or ends at the pdjax schedules to run instead, never back at
    the name they came from."""
    with pytest.raises(ScheduleError, match=r"cell 12 '3F1'.*in-flight bound") as info:
        read_text(TORCH_INTERLEAVED_ZB, name="interleaved")
    message = str(info.value)
    assert "ScheduleInterleavedZeroBubble" in message and "gpipe" not in message
    assert "--stages 2 --microbatches 2 --schedule zb-v" in message
    assert "'--schedule interleaved --chunks 2'" in message
    # the other names send the user to interleaved, which ends above
    for name in ("gpipe", "1f1b", "zb-h1", "zb-h2"):
        with pytest.raises(ScheduleError, match="read it with name='interleaved'"):
            read_text(TORCH_INTERLEAVED_ZB, name=name)
    # what it advises runs: zb-v and interleaved of the file's P, M and chunks
    for name, chunks in (("zb-v", 2), ("interleaved", 2)):
        schedule = generate(name, 2, 2, chunks=chunks)
        assert read_text(csv_text(schedule), name=name) == schedule
        assert simulate(schedule, unit_costs(4)).makespan > 0
