"""The simulator against closed-form results, and the ``pdjax simulate`` command."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from pdjax.commands import simulate as simulate_command
from pdjax.errors import PlanError, ScheduleError
from pdjax.pipeline import (
    PipelineCosts,
    StageCosts,
    Timeline,
    gpipe,
    interleaved,
    one_f_one_b,
    pipedream,
    pipedream_2bw,
    simulate,
    unit_costs,
    zb_h1,
)

STAGES = range(1, 9)
MICROBATCHES = range(1, 33)


# ----------------------------------------------------------------------------- unit costs


@pytest.mark.parametrize("P", STAGES)
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1(P):
    costs = unit_costs(P)  # F = 1, B = I + W = 2, free transfers and updates
    for M in MICROBATCHES:
        for make in (gpipe, one_f_one_b):
            sim = simulate(make(P, M), costs)
            assert sim.bubble_fraction == pytest.approx((P - 1) / (M + P - 1), abs=1e-12)
            assert sim.step_time == pytest.approx(3 * (M + P - 1))
            assert sim.time_per_microbatch == pytest.approx(3 * (M + P - 1) / M)


@pytest.mark.parametrize("P", STAGES)
def test_1f1b_holds_at_most_p_minus_s_in_flight(P):
    for M in MICROBATCHES:
        sim = simulate(one_f_one_b(P, M), unit_costs(P))
        assert sim.peak_in_flight == tuple(min(P - s, M) for s in range(P))
    assert simulate(gpipe(P, 5), unit_costs(P)).peak_in_flight == (5,) * P


@pytest.mark.parametrize("P", STAGES)
def test_pipedream_and_2bw_steady_state_has_no_bubble(P):
    costs = unit_costs(P)
    for N in (2 * P, 4 * P, 32):
        for sim in [
            simulate(pipedream(P, N), costs),
            simulate(pipedream(P, N, vertical_sync=True), costs),
            simulate(pipedream(P, N, weight_stashing=False), costs),
        ]:
            assert sim.steady_state
            assert sim.bubble_fraction == pytest.approx(0.0, abs=1e-12)
            assert sim.time_per_microbatch == pytest.approx(3.0)
            assert sim.step_time == pytest.approx(3.0)  # one update per microbatch
    for M in (P, P + 1, 2 * P):
        sim = simulate(pipedream_2bw(P, M, 4 * M), costs)
        assert sim.steady_state
        assert sim.bubble_fraction == pytest.approx(0.0, abs=1e-12)
        assert sim.step_time == pytest.approx(3.0 * M)


@pytest.mark.parametrize("P", STAGES)
def test_zb_h1_bubble_is_a_third_of_1f1b(P):
    costs = unit_costs(P, 1, 1, 1)  # F = I = W = 1
    for M in range(P, 33):
        zero_bubble_idle = simulate(zb_h1(P, M), costs).step_time - 3 * M
        one_f_one_b_idle = simulate(one_f_one_b(P, M), costs).step_time - 3 * M
        assert zero_bubble_idle == pytest.approx(P - 1)
        assert one_f_one_b_idle == pytest.approx(3 * (P - 1))


@pytest.mark.parametrize("P", STAGES)
def test_interleaved_divides_1f1b_bubble_by_v(P):
    for v in (2, 3, 4):
        costs = unit_costs(P, chunks=v)  # each chunk F = 1/v, B = 2/v
        assert len(costs.stages) == P * v
        for M in range(P, 33, P):
            idle = simulate(interleaved(P, M, v), costs).step_time - 3 * M
            assert idle == pytest.approx(3 * (P - 1) / v)


def test_short_stream_has_no_steady_state():
    sim = simulate(pipedream(4, 5), unit_costs(4))
    assert not sim.steady_state
    assert sim.step_time == pytest.approx(sim.makespan / 5)


def test_steps_of_a_flush_schedule_each_pay_the_bubble():
    sim = simulate(one_f_one_b(3, 4, steps=3), unit_costs(3))
    assert sim.makespan == pytest.approx(3 * 3 * (4 + 3 - 1))
    assert sim.step_time == pytest.approx(3 * (4 + 3 - 1))


# ----------------------------------------------------------------------------- costs


def test_transfers_take_bytes_over_bandwidth_plus_latency():
    stage0 = StageCosts(1.0, 1.0, 1.0, activation_bytes=100)
    stage1 = StageCosts(1.0, 1.0, 1.0)
    costs = PipelineCosts.build([stage0, stage1], link_bandwidth=50.0, link_latency=0.5)
    sim = simulate(one_f_one_b(2, 1), costs)
    starts = {str(s.action): (s.start, s.end) for s in sim.timeline.spans}
    # F0 [0, 1], activation [1, 3.5], F1 [3.5, 4.5], B1 [4.5, 6.5], gradient [6.5, 9], B0.
    assert starts["0F0"] == (0.0, 1.0)
    assert starts["1F0"] == (3.5, 4.5)
    assert starts["1B0"] == (4.5, 6.5)
    assert starts["0B0"] == (9.0, 11.0)
    assert [(t.src, t.dst, t.start, t.end) for t in sim.timeline.transfers] == [
        (0, 1, 1.0, 3.5),
        (1, 0, 6.5, 9.0),
    ]
    assert sim.step_time == pytest.approx(11.0)


def test_a_link_carries_one_tensor_at_a_time():
    costs = PipelineCosts.build(
        [StageCosts(1.0, 1.0, 1.0, activation_bytes=2), StageCosts(1.0, 1.0, 1.0)],
        link_bandwidth=1.0,
    )
    sim = simulate(gpipe(2, 2), costs)
    forward = [(t.start, t.end) for t in sim.timeline.transfers if t.src == 0]
    assert forward == [(1.0, 3.0), (3.0, 5.0)]  # the second waits for the first
    starts = {str(s.action): s.start for s in sim.timeline.spans}
    assert starts["1F0"] == 3.0
    assert starts["1F1"] == 5.0


def test_allreduce_is_charged_at_every_update():
    stage = StageCosts(1.0, 1.0, 1.0, update=0.5, param_bytes=100)
    costs = PipelineCosts.build([stage, stage], allreduce_bandwidth=10.0)
    # Ring all-reduce over r = 2: 2 (r - 1) / r * 100 B / 10 B/s = 10 s, plus the update.
    flush = simulate(one_f_one_b(2, 4, replicas=[2, 1]), costs)
    updates = [(s.group, s.end - s.start) for s in flush.timeline.spans if s.action.kind == "U"]
    assert updates == [(0, 10.5), (1, 0.5)]
    stream = simulate(pipedream(2, 4, replicas=[2, 1]), costs)
    updates = [s.end - s.start for s in stream.timeline.spans if s.action.kind == "U"]
    assert sorted(updates) == [0.5] * 4 + [10.5] * 4  # once per microbatch
    twobw = simulate(pipedream_2bw(2, 2, 4, replicas=[1, 4]), costs)
    updates = [s.end - s.start for s in twobw.timeline.spans if s.action.kind == "U"]
    assert sorted(updates) == [0.5, 0.5, 15.5, 15.5]  # 2 * 3/4 * 100 / 10 = 15, per step


def test_peak_memory_counts_versions_stash_and_optimizer_state():
    stage = StageCosts(1.0, 1.0, 1.0, param_bytes=1000, stash_bytes=10, optimizer_bytes=7)
    costs = PipelineCosts.build([stage] * 3)
    # weights x versions kept + optimizer state + stash x microbatches in flight
    assert simulate(pipedream(3, 12), costs).peak_memory == (3037, 2027, 1017)
    assert simulate(pipedream_2bw(3, 3, 12), costs).peak_memory == (2037, 2027, 2017)
    assert simulate(one_f_one_b(3, 6), costs).peak_memory == (1037, 1027, 1017)
    assert simulate(gpipe(3, 6), costs).peak_memory == (1067, 1067, 1067)
    zb = simulate(zb_h1(3, 6), costs)  # deferred W keep their stash: 1F1B's peak everywhere
    assert zb.peak_in_flight == (3, 3, 3)
    assert zb.peak_memory == (1037, 1037, 1037)
    both = simulate(interleaved(2, 4, 2), PipelineCosts.build([stage] * 4))
    assert both.peak_in_flight == (4, 3, 2, 1)
    assert both.peak_memory == (2 * 1007 + 5 * 10, 2 * 1007 + 3 * 10)


def test_costs_and_schedule_must_agree_on_stages():
    with pytest.raises(ScheduleError, match="costs describe 3 stages but the 1f1b schedule has"):
        simulate(one_f_one_b(4, 8), unit_costs(3))
    with pytest.raises(ScheduleError, match=r"use costs.interleave\(2\)"):
        simulate(interleaved(4, 8, 2), unit_costs(4))


def test_bad_costs_are_rejected():
    with pytest.raises(ScheduleError, match=r"StageCosts\.forward must be a finite number >= 0"):
        StageCosts(-1.0, 1.0, 1.0)
    with pytest.raises(ScheduleError, match=r"StageCosts\.weight_grad"):
        StageCosts(1.0, 1.0, math.inf)
    stage = StageCosts(1.0, 1.0, 1.0)
    with pytest.raises(ScheduleError, match="link_bandwidth has 1 entries; expected 2"):
        PipelineCosts.build([stage] * 3, link_bandwidth=[1.0])
    with pytest.raises(ScheduleError, match="allreduce_bandwidth must be > 0"):
        PipelineCosts.build([stage] * 2, allreduce_bandwidth=0.0)
    with pytest.raises(ScheduleError, match="at least one stage"):
        PipelineCosts.build([])
    with pytest.raises(ScheduleError, match="chunks must be an integer >= 1"):
        unit_costs(2).interleave(0)


def test_interleave_splits_each_stage_into_chunks():
    stages = [
        StageCosts(2.0, 4.0, 6.0, activation_bytes=10, param_bytes=100),
        StageCosts(2.0, 4.0, 6.0, activation_bytes=30, param_bytes=100),
        StageCosts(2.0, 4.0, 6.0, param_bytes=100),
    ]
    costs = PipelineCosts.build(stages, link_bandwidth=[5.0, 7.0])
    split = costs.interleave(2)
    assert len(split.stages) == 6
    assert split.stages[4] == StageCosts(1.0, 2.0, 3.0, activation_bytes=30, param_bytes=50)
    assert split.stages[2].activation_bytes == 30  # the wrap-around cut: the widest
    assert split.link_bandwidth == (5.0, 7.0, 5.0, 5.0, 7.0)
    assert costs.interleave(1) is costs


def test_summary_is_plain_json():
    sim = simulate(pipedream_2bw(2, 2, 8), unit_costs(2))
    data = json.loads(json.dumps(sim.summary()))
    assert data["schedule"] == "2bw"
    assert data["steady_state"] is True
    assert data["peak_in_flight"] == [2, 1]


def test_timeline_json_round_trip():
    costs = PipelineCosts.build(
        [StageCosts(1.0, 1.0, 1.0, activation_bytes=4), StageCosts(1.0, 1.0, 1.0)],
        link_bandwidth=2.0,
    )
    tl = simulate(zb_h1(2, 3), costs).timeline
    assert Timeline.from_json(tl.to_json()) == tl
    assert tl.busy(0) == pytest.approx(9.0)
    with pytest.raises(ScheduleError, match="not a pdjax timeline"):
        Timeline.from_json("{}")
    with pytest.raises(ScheduleError, match="timeline JSON is malformed"):
        Timeline.from_json('{"format": "pdjax.timeline/1", "name": "x"}')


# ----------------------------------------------------------------------------- the command


def _run(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="pdjax")
    simulate_command.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["simulate", *argv])
    return args.func(args)


def test_cli_compares_all_schedules_as_json(capsys):
    code = _run("--unit-costs", "1,1,1", "--stages", "4", "--schedule", "all", "--json")
    assert code == 0
    rows = {r["schedule"]: r for r in json.loads(capsys.readouterr().out)["schedules"]}
    assert list(rows) == ["gpipe", "1f1b", "pipedream", "2bw", "interleaved", "zb-h1"]
    assert rows["1f1b"]["bubble_fraction"] == pytest.approx(3 / 11)
    assert rows["zb-h1"]["step_time"] == pytest.approx(3 * 8 + 3)
    assert rows["interleaved"]["step_time"] == pytest.approx(3 * 8 + 9 / 2)
    assert rows["pipedream"]["bubble_fraction"] == pytest.approx(0.0, abs=1e-12)
    assert rows["pipedream"]["num_microbatches"] == 32  # the default stream: 4 M


def test_cli_table_and_pictures(tmp_path, capsys):
    trace, png = tmp_path / "out.json", tmp_path / "out.png"
    code = _run(
        "--unit-costs",
        "1,0.5,0.5",
        "--stages",
        "3",
        "--schedule",
        "all",
        "--microbatches",
        "2",
        "--trace",
        str(trace),
        "--png",
        str(png),
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "zb-h1" in out
    assert "not run: 2bw needs" in out  # M = 2 < P = 3
    assert "not run: interleaved with chunks=2" in out
    assert json.loads(trace.read_text())["traceEvents"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_single_schedule_options(capsys):
    _run("--unit-costs", "1,1,1", "--stages", "3", "--schedule", "pipedream", "--stream", "12")
    assert "steady state, stream N=12" in capsys.readouterr().out
    _run("--unit-costs", "1,1,1", "--stages", "2", "--schedule", "pipedream", "--vertical-sync")
    assert "pipedream (vsync)" in capsys.readouterr().out
    _run(
        "--unit-costs", "1,1,1", "--stages", "2", "--schedule", "pipedream", "--no-weight-stashing"
    )
    assert "pipedream (no stash)" in capsys.readouterr().out
    _run("--unit-costs", "1,1,1", "--stages", "2", "--schedule", "interleaved", "--chunks", "3")
    assert "interleaved (v=3)" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--unit-costs", "1,1,1"], "--unit-costs needs --stages P"),
        (["--unit-costs", "1,1", "--stages", "2"], "three numbers >= 0, 'F,I,W'"),
        (["--unit-costs", "1,a,1", "--stages", "2"], "three numbers"),
        (["--unit-costs", "1,1,1", "--stages", "0"], "--stages must be >= 1"),
        ([], "needs costs: --plan PLAN.json --profile PROFILE.json, or --unit-costs"),
        (["--unit-costs", "1,1,1", "--stages", "2", "--plan", "p.json"], "either --unit-costs"),
        (
            ["--unit-costs", "1,1,1", "--stages", "4", "--schedule", "2bw", "--microbatches", "2"],
            r"2bw needs microbatches_per_step \(M\) >= num_stages \(P\)",
        ),
    ],
)
def test_cli_errors_name_the_fix(argv, message):
    with pytest.raises(ScheduleError, match=message):
        _run(*argv)


def test_cli_missing_plan_file_is_a_clear_error():
    with pytest.raises(PlanError, match=r"cannot read plan plan\.json"):
        _run("--plan", "plan.json", "--profile", "profile.json")
