"""The simulator against closed-form results, and the ``pdjax simulate`` command."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from cli_helpers import run_command

from pdjax.errors import PlanError, ScheduleError
from pdjax.schedules import gpipe, interleaved, one_f_one_b, pipedream, pipedream_2bw, zb_h1
from pdjax.simulator import PipelineCosts, StageCosts, Timeline, simulate, unit_costs

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


def test_latency_per_cut_adds_to_each_transfer_on_its_cut():
    stage = StageCosts(1.0, 1.0, 1.0)
    # One microbatch through 3 stages: 3 x (F + B) = 9 s of compute on the critical path,
    # and each cut crossed twice (activation, gradient).
    scalar = simulate(gpipe(3, 1), PipelineCosts.build([stage] * 3, link_latency=0.5))
    assert scalar.makespan == pytest.approx(9.0 + 4 * 0.5)
    per_cut = simulate(gpipe(3, 1), PipelineCosts.build([stage] * 3, link_latency=[1.0, 10.0]))
    assert per_cut.makespan == pytest.approx(9.0 + 2 * 1.0 + 2 * 10.0)
    took = sorted((t.src, t.dst, t.end - t.start) for t in per_cut.timeline.transfers)
    assert took == [(0, 1, 1.0), (1, 0, 1.0), (1, 2, 10.0), (2, 1, 10.0)]
    # the same latency on every cut, given either way, plays the same timeline
    timelines = [
        simulate(one_f_one_b(3, 6), PipelineCosts.build([stage] * 3, link_latency=x)).timeline
        for x in (0.5, (0.5, 0.5))
    ]
    assert timelines[0] == timelines[1]
    assert len(timelines[0].transfers) == 4 * 6


def test_gradients_travel_at_the_backward_bandwidth():
    stages = [StageCosts(1.0, 1.0, 1.0, activation_bytes=100), StageCosts(1.0, 1.0, 1.0)]
    costs = PipelineCosts.build(stages, link_bandwidth=50.0, link_bandwidth_back=25.0)
    sim = simulate(gpipe(2, 1), costs)
    # F0 [0, 1], activation 100 B at 50 B/s [1, 3], F1 [3, 4], B1 [4, 6], gradient at
    # 25 B/s [6, 10], B0 [10, 12].
    assert [(t.src, t.dst, t.start, t.end) for t in sim.timeline.transfers] == [
        (0, 1, 1.0, 3.0),
        (1, 0, 6.0, 10.0),
    ]
    assert sim.makespan == pytest.approx(12.0)
    symmetric = PipelineCosts.build(stages, link_bandwidth=50.0)
    assert simulate(gpipe(2, 1), symmetric).makespan == pytest.approx(10.0)


def test_measured_allreduce_replaces_the_ring_formula():
    stage = StageCosts(1.0, 1.0, 1.0, update=0.5, param_bytes=100)
    ring = PipelineCosts.build([stage, stage], allreduce_bandwidth=10.0)
    measured = PipelineCosts.build(
        [stage, stage], allreduce_bandwidth=10.0, allreduce_seconds=[3.0, None]
    )
    # ring over r = 2 for stage 0: 2 (r - 1) / r * 100 / 10 = 10 s; measured: 3 s
    for costs, want in [(ring, 10.5), (measured, 3.5)]:
        sim = simulate(one_f_one_b(2, 4, replicas=[2, 1]), costs)
        updates = [(s.group, s.end - s.start) for s in sim.timeline.spans if s.action.kind == "U"]
        assert updates == [(0, want), (1, 0.5)]
    # a stage given a number takes it whatever its replicas (here one device: the ring's 0)
    one = PipelineCosts.build([stage, stage], allreduce_seconds=[None, 2.0])
    sim = simulate(one_f_one_b(2, 4), one)
    updates = [(s.group, s.end - s.start) for s in sim.timeline.spans if s.action.kind == "U"]
    assert updates == [(0, 0.5), (1, 2.5)]
    assert one.allreduce(0, 4) == 0.0 and one.allreduce(1, 4) == 2.0


def test_send_seconds_occupy_the_sender_before_the_transfer():
    stages = [
        StageCosts(1.0, 1.0, 1.0, activation_bytes=10, send_seconds=0.5),
        StageCosts(1.0, 1.0, 1.0, send_seconds=0.25),
    ]
    sim = simulate(gpipe(2, 1), PipelineCosts.build(stages, link_bandwidth=10.0))
    spans = {str(s.action): (s.start, s.end) for s in sim.timeline.spans}
    # stage 0's F posts its activation (0.5 s) before the 1 s transfer; stage 1's B posts
    # the gradient (0.25 s); the last F and the first B send nothing.
    assert spans["0F0"] == (0.0, 1.5)
    assert spans["1F0"] == (2.5, 3.5)
    assert spans["1B0"] == (3.5, 5.75)
    assert spans["0B0"] == (6.75, 8.75)
    assert [(t.start, t.end) for t in sim.timeline.transfers] == [(1.5, 2.5), (5.75, 6.75)]
    # posting is per microbatch sent: a round-robin action over 2 posts twice
    rr = [StageCosts(1.0, 1.0, 1.0, send_seconds=0.5), StageCosts(1.0, 1.0, 1.0)]
    sim = simulate(
        pipedream(2, 4, replicas=[2, 1], replication="round-robin"), PipelineCosts.build(rr)
    )
    forward = [s.end - s.start for s in sim.timeline.spans if str(s.action).startswith("0F")]
    assert forward and all(d == pytest.approx(2 * 1.0 + 2 * 0.5) for d in forward)


def test_new_costs_are_validated():
    stage = StageCosts(1.0, 1.0, 1.0)
    with pytest.raises(
        ScheduleError, match=r"link_latency has 1 entries; expected 2 \(one per cut\)"
    ):
        PipelineCosts.build([stage] * 3, link_latency=[1.0])
    with pytest.raises(ScheduleError, match="link_latency must be finite numbers >= 0"):
        PipelineCosts.build([stage] * 3, link_latency=[1.0, -1.0])
    with pytest.raises(ScheduleError, match="link_latency must be a finite number >= 0"):
        PipelineCosts.build([stage] * 3, link_latency=-0.1)
    with pytest.raises(ScheduleError, match="link_latency must be a finite number >= 0"):
        PipelineCosts.build([stage] * 3, link_latency=math.inf)
    with pytest.raises(ScheduleError, match="link_bandwidth_back has 3 entries; expected 2"):
        PipelineCosts.build([stage] * 3, link_bandwidth_back=[1.0, 1.0, 1.0])
    with pytest.raises(ScheduleError, match="link_bandwidth_back must be > 0"):
        PipelineCosts.build([stage] * 3, link_bandwidth_back=0.0)
    with pytest.raises(
        ScheduleError, match=r"allreduce_seconds has 2 entries; expected 3 \(one per stage\)"
    ):
        PipelineCosts.build([stage] * 3, allreduce_seconds=[1.0, None])
    with pytest.raises(ScheduleError, match="allreduce_seconds must hold None or finite numbers"):
        PipelineCosts.build([stage] * 2, allreduce_seconds=[None, -1.0])
    with pytest.raises(ScheduleError, match=r"StageCosts\.send_seconds must be a finite number"):
        StageCosts(1.0, 1.0, 1.0, send_seconds=-1.0)
    with pytest.raises(ScheduleError, match=r"StageCosts\.input_bytes must be a finite number"):
        StageCosts(1.0, 1.0, 1.0, input_bytes=-1)
    with pytest.raises(ScheduleError, match="memory_model must be one of"):
        PipelineCosts.build([stage], memory_model="exact")
    # lists (as JSON gives them) become tuples: the costs stay hashable and comparable
    listed = PipelineCosts(
        stages=(stage, stage),
        link_bandwidth=(1.0,),
        allreduce_bandwidth=(1.0, 1.0),
        link_latency=[0.5],
        link_bandwidth_back=[2.0],
        allreduce_seconds=[None, 1.0],
    )
    assert listed == PipelineCosts.build(
        [stage, stage],
        link_bandwidth=1.0,
        allreduce_bandwidth=1.0,
        link_latency=[0.5],
        link_bandwidth_back=2.0,
        allreduce_seconds=(None, 1.0),
    )
    assert hash(listed) == hash(dataclasses.replace(listed))


def test_interleave_keeps_the_new_fields_per_virtual_stage():
    stages = [
        StageCosts(2.0, 4.0, 6.0, activation_bytes=10, input_bytes=8, send_seconds=0.1),
        StageCosts(2.0, 4.0, 6.0, input_bytes=3, cotangent_bytes=40, send_seconds=0.2),
    ]
    costs = PipelineCosts.build(
        stages,
        link_bandwidth=5.0,
        link_latency=[0.5],
        link_bandwidth_back=[4.0],
        allreduce_seconds=[2.0, None],
        memory_model="runtime",
    ).interleave(2)
    assert [st.input_bytes for st in costs.stages] == [8, 0, 0, 3]
    assert [st.cotangent_bytes for st in costs.stages] == [0, 20, 0, 20]
    assert [st.send_seconds for st in costs.stages] == [0.1, 0.2, 0.1, 0.2]
    assert costs.link_latency == (0.5, 0.5, 0.5)
    assert costs.link_bandwidth_back == (4.0, 4.0, 4.0)
    assert costs.allreduce_seconds == (1.0, None, 1.0, None)
    assert costs.memory_model == "runtime"


# ----------------------------------------------------------------------------- memory


def _memory(schedule, *stages, **options):
    return simulate(schedule, PipelineCosts.build(stages, **options)).memory_by_action


def test_runtime_memory_holds_the_gradient_sum_from_the_first_backward_to_the_update():
    stage = StageCosts(1.0, 1.0, 1.0, param_bytes=1000, optimizer_bytes=100, stash_bytes=10)
    schedule = gpipe(1, 2, steps=2)  # F0 F1 B1 B0 U | F2 F3 B3 B2 U
    assert _memory(schedule, stage) == ((1110, 1120, 1120, 1110, 1100) * 2,)
    runtime = _memory(schedule, stage, memory_model="runtime")
    # + 1000 from the first B of a step to its U (the gradient sum), and from the second
    # step on + 1000 for the weights the call started from, still alive
    assert runtime == ((1110, 1120, 2120, 2110, 2100, 2110, 2120, 3120, 3110, 3100),)
    placed = dataclasses.replace(stage, input_bytes=1)  # the microbatches not yet forwarded
    assert _memory(schedule, placed, memory_model="runtime") == (
        (1113, 1122, 2122, 2112, 2102, 2111, 2120, 3120, 3110, 3100),
    )
    # pipedream: the sum lives from each B to its U; version 0 stays alive after its update
    stream = pipedream(1, 3)  # F0 B0 U F1 B1 U F2 B2 U
    assert _memory(stream, stage) == ((1110, 1110, 1100) * 3,)
    assert _memory(stream, stage, memory_model="runtime") == (
        (1110, 2110, 2100, 2110, 3110, 3100, 2110, 3110, 3100),
    )


def test_runtime_memory_splits_placed_inputs_over_replicas():
    first = StageCosts(1.0, 1.0, 1.0, input_bytes=8)
    last = StageCosts(1.0, 1.0, 1.0, input_bytes=3)
    memory = _memory(one_f_one_b(2, 2, replicas=[2, 1]), first, last, memory_model="runtime")
    # group 0 (2 devices, 4 B per microbatch each): F0 F1 B0 B1 U; group 1: F0 B0 F1 B1 U
    assert memory == ((4, 0, 0, 0, 0), (3, 3, 0, 0, 0))
    assert _memory(one_f_one_b(2, 2, replicas=[2, 1]), first, last) == ((0,) * 5, (0,) * 5)


def test_runtime_memory_keeps_zero_bubble_cotangents_from_i_to_w():
    stage = StageCosts(1.0, 1.0, 1.0, stash_bytes=10, cotangent_bytes=5)
    schedule = zb_h1(1, 2)  # F0 I0 W0 F1 I1 W1 U
    assert _memory(schedule, stage) == ((10, 10, 10, 10, 10, 10, 0),)
    assert _memory(schedule, stage, memory_model="runtime") == ((10, 15, 15, 10, 15, 15, 0),)


def test_runtime_memory_counts_activations_in_transit():
    stages = [
        StageCosts(1.0, 1.0, 1.0, activation_bytes=100),
        StageCosts(3.0, 1.0, 1.0),
    ]
    # 2 s per transfer each way. Group 0: F0 [0, 1] F1 [1, 2] B1 [13, 15] B0 [15, 17];
    # activations on the link [1, 3] and [3, 5]. Group 1: F0 [3, 6] F1 [6, 9] B1 [9, 11]
    # B0 [11, 13] U [13, 13]; gradients on the link [11, 13] and [13, 15].
    sim = simulate(gpipe(2, 2), PipelineCosts.build(stages, link_bandwidth=50.0))
    assert sim.memory_by_action == ((0,) * 5, (0,) * 5)
    runtime = simulate(
        gpipe(2, 2), PipelineCosts.build(stages, link_bandwidth=50.0, memory_model="runtime")
    )
    spans = {str(s.action): (s.start, s.end) for s in runtime.timeline.spans}
    assert spans["1F1"] == (6.0, 9.0) and spans["0B0"] == (15.0, 17.0)
    # group 0: the sent activation of mb 0 until 3 (F0, F1), of mb 1 until 5 (F1); the
    # received gradients up to the B that reads each (mb 1 at B1, mb 0 at B0).
    # group 1: mb 1's activation arrives at 5, during F0, and waits for F1 (which stashes
    # it); the sent gradient of mb 1 until 13 (B1, B0), of mb 0 until 15 (B0, U).
    assert runtime.memory_by_action == ((100, 200, 100, 100, 0), (100, 0, 100, 200, 100))
    assert runtime.peak_memory == (200, 200)


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
    for lo, hi in [(0.0, None), (2.5, 7.0), (3.0, 3.0)]:
        each = sum(tl.busy(g, lo, hi) for g in range(tl.num_groups))
        assert tl.total_busy(lo, hi) == each
    with pytest.raises(ScheduleError, match="not a pdjax timeline"):
        Timeline.from_json("{}")
    with pytest.raises(ScheduleError, match="timeline JSON is malformed"):
        Timeline.from_json('{"format": "pdjax.timeline/1", "name": "x"}')


# ----------------------------------------------------------------------------- the command


def test_cli_compares_all_schedules_as_json(capsys):
    code = run_command(
        "simulate", "--unit-costs", "1,1,1", "--stages", "4", "--schedule", "all", "--json"
    )
    assert code == 0
    rows = {r["schedule"]: r for r in json.loads(capsys.readouterr().out)["schedules"]}
    assert list(rows) == [
        "gpipe",
        "1f1b",
        "pipedream",
        "2bw",
        "interleaved",
        "zb-h1",
        "zb-h2",
        "zb-v",
    ]
    assert rows["1f1b"]["bubble_fraction"] == pytest.approx(3 / 11)
    assert rows["zb-h1"]["step_time"] == pytest.approx(3 * 8 + 3)
    # one step: zb-h2's parallelogram idles P - 1 per stage like zb-h1 (its gain is across
    # steps), zb-v's chunks halve it
    assert rows["zb-h2"]["step_time"] == pytest.approx(3 * 8 + 3)
    assert rows["zb-v"]["step_time"] == pytest.approx(3 * 8 + 3 / 2)
    assert rows["zb-v"]["num_stages"] == 8 and rows["zb-v"]["num_groups"] == 4
    assert rows["interleaved"]["step_time"] == pytest.approx(3 * 8 + 9 / 2)
    assert rows["pipedream"]["bubble_fraction"] == pytest.approx(0.0, abs=1e-12)
    assert rows["pipedream"]["num_microbatches"] == 32  # the default stream: 4 M


def test_cli_table_and_pictures(tmp_path, capsys):
    trace, png = tmp_path / "out.json", tmp_path / "out.png"
    code = run_command(
        "simulate",
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
    assert "zb-h1" in out and "zb-h2" in out and "zb-v" in out
    assert "not run: 2bw needs" in out  # M = 2 < P = 3
    assert "not run: interleaved with chunks=2" in out
    assert json.loads(trace.read_text())["traceEvents"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_single_schedule_options(capsys):
    unit = ("simulate", "--unit-costs", "1,1,1")
    run_command(*unit, "--stages", "3", "--schedule", "pipedream", "--stream", "12")
    assert "steady state, stream N=12" in capsys.readouterr().out
    run_command(*unit, "--stages", "2", "--schedule", "pipedream", "--vertical-sync")
    assert "pipedream (vsync)" in capsys.readouterr().out
    run_command(*unit, "--stages", "2", "--schedule", "pipedream", "--no-weight-stashing")
    assert "pipedream (no stash)" in capsys.readouterr().out
    run_command(*unit, "--stages", "2", "--schedule", "interleaved", "--chunks", "3")
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
        run_command("simulate", *argv)


def test_cli_missing_plan_file_is_a_clear_error():
    with pytest.raises(PlanError, match=r"cannot read plan plan\.json"):
        run_command("simulate", "--plan", "plan.json", "--profile", "profile.json")


def test_posted_receives_start_transfers_when_the_receiver_reaches_the_action():
    """1F1B, P = 2, M = 2, F = 1, B = 2 (I 1 + W 1), every transfer 1 s. Sent eagerly, the
    second activation crosses while stage 1 computes (makespan 11); posted by the receiver
    when it reaches the action (pdjax's runtime across processes on CPU), it crosses after
    stage 1's first backward, and the last gradient after stage 0's first (makespan 12)."""
    from pdjax.schedules import generate
    from pdjax.simulator import PipelineCosts, StageCosts, simulate

    stage = StageCosts(forward=1.0, input_grad=1.0, weight_grad=1.0, activation_bytes=100)
    sched = generate("1f1b", 2, 2)
    eager = PipelineCosts.build([stage, stage], link_bandwidth=100.0)
    posted = dataclasses.replace(eager, posted_receives=True)
    assert simulate(sched, eager).makespan == pytest.approx(11.0)
    sim = simulate(sched, posted)
    assert sim.makespan == pytest.approx(12.0)
    moves = sorted((t.start, t.end) for t in sim.timeline.transfers)
    assert moves == [(1.0, 2.0), (5.0, 6.0), (5.0, 6.0), (9.0, 10.0)]
    assert PipelineCosts.build([stage, stage], posted_receives=True).posted_receives
