"""Zero bubble with more memory (``zb-h2``) and the V schedule (``zb-v``): generated,
validated, simulated against the papers' formulas, and run by the runtime.

Papers: Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024: ZB-H1, ZB-H2) and "Pipeline
Parallelism with Controllable Memory" (2024: ZB-V). With ``F = I = W`` their bubble is the
idle time of a stage between its first and its last action of a step (the start-up wait of
stage ``s`` is filled by the previous step once updates need no global synchronisation,
which pdjax's per-stage updates do not): 1F1B ``3 (P - 1)``, ZB-H1 ``P - 1``, ZB-H2 and ZB-V
``0``. Peak activation memory: 1F1B ``P`` microbatches of a stage, ZB-H1 the same, ZB-H2
``2P - 1``, ZB-V the same as 1F1B (``2P`` chunks of half a stage).
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from reference import flush_training

import pdjax
from pdjax.errors import PipelineError, ScheduleError
from pdjax.partition import StagePlan
from pdjax.pipeline import Pipeline, even_stages
from pdjax.schedules import (
    Schedule,
    ScheduleSpec,
    generate,
    interleaved,
    one_f_one_b,
    stage_groups,
    validate,
    zb_h1,
    zb_h2,
    zb_v,
)
from pdjax.simulator import (
    PipelineCosts,
    StageCosts,
    chrome_trace,
    plot_gantt,
    simulate,
    unit_costs,
)

# ----------------------------------------------------------------------------- helpers


def _spans(sim, group):
    """(first start, last end) of the group's compute (``U`` costs nothing here)."""
    mine = [sp for sp in sim.timeline.spans if sp.group == group and sp.action.kind != "U"]
    return min(sp.start for sp in mine), max(sp.end for sp in mine)


def _paper_bubble(sim, work):
    """The papers' bubble: the most any group idles between its first and last action."""
    return max(b - a for a, b in (_spans(sim, g) for g in range(sim.schedule.num_groups))) - work


def _in_flight(schedule, until="W"):
    """Per device group, the most microbatch-stages whose F has run and whose ``until``
    (``W``: the stash is dropped; ``I``: the input gradient is made) has not, counted from
    the action lists alone."""
    out = []
    for group in schedule.actions:
        count = peak = 0
        for a in group:
            count += a.kind == "F"
            peak = max(peak, count)
            count -= a.kind == until
        out.append(peak)
    return out


def _chunk_costs(P, **kw):
    """``zb-v``'s 2P chunks with every chunk's F = I = W = 1 (the papers' unit)."""
    return PipelineCosts.build([StageCosts(1.0, 1.0, 1.0, **kw)] * (2 * P))


GRID = [(P, M) for P in (1, 2, 3, 4, 5, 8) for M in (2 * P - 1, 2 * P, 3 * P + 1)]

# ----------------------------------------------------------------------------- the generators


def test_zb_h2_order_is_warm_up_then_input_grad_deferred_weight_grad_forward():
    """Stage s: 2(P - s) - 1 forwards, then per microbatch j: I(j), W(j - 2s), next F
    (M = 2P - 1; with fewer microbatches W waits min(2s, M - P + s))."""
    s = zb_h2(3, 5)
    assert [" ".join(map(str, g)) for g in s.actions] == [
        "0F0 0F1 0F2 0F3 0F4 0I0 0W0 0I1 0W1 0I2 0W2 0I3 0W3 0I4 0W4 0U0",
        "1F0 1F1 1F2 1I0 1F3 1I1 1F4 1I2 1W0 1I3 1W1 1I4 1W2 1W3 1W4 1U0",
        "2F0 2I0 2F1 2I1 2F2 2I2 2F3 2I3 2F4 2I4 2W0 2W1 2W2 2W3 2W4 2U0",
    ]
    validate(s)
    assert " ".join(map(str, zb_h2(3, 4).actions[2])) == (
        "2F0 2I0 2F1 2I1 2F2 2I2 2F3 2I3 2W0 2W1 2W2 2W3 2U0"
    )


def test_zb_v_places_stages_in_a_v():
    s = zb_v(3, 5)
    assert s.num_stages == 6 and s.num_groups == 3 and s.chunks == 2
    assert s.stage_device == (0, 1, 2, 2, 1, 0) == stage_groups("zb-v", 3, 2)
    assert [s.stages_of(g) for g in range(3)] == [(0, 5), (1, 4), (2, 3)]
    # group 1: 2(P - d) - 1 = 3 first-chunk forwards, d = 1 (second, first) pair, P - d = 2
    # F I W of the second chunk, the steady F I W of each chunk, then the drain
    assert " ".join(map(str, s.actions[1])) == (
        "1F0 1F1 1F2 4F0 1F3 4F1 4I0 4W0 4F2 4I1 4W1 1F4 1I0 1W0 4F3 4I2 4W2 1I1 1W1 4F4 "
        "4I3 4W3 1I2 4I4 1I3 1W2 1I4 1W3 4W4 1W4 1U0 4U0"
    )
    validate(s)
    assert Schedule.from_json(s.to_json()) == s


@pytest.mark.parametrize("P", range(1, 7))
def test_every_size_validates_with_exact_memory_bounds(P):
    for M in range(1, 3 * P + 3):
        for steps in (1, 2):
            h2, v = zb_h2(P, M, steps=steps), zb_v(P, M, steps=steps)
            validate(h2)
            validate(v)
            assert h2.in_flight_bound == (min(2 * P - 1, M),) * P
            assert v.in_flight_bound == (min(2 * P, 2 * M),) * P
            assert h2.version_bound == (1,) * P and v.version_bound == (1,) * (2 * P)
        # zb-h2 reaches its bound at every stage; the input gradients wait as in the paper
        assert _in_flight(zb_h2(P, M)) == [min(2 * P - 1, M)] * P
        assert _in_flight(zb_h2(P, M), until="I") == [min(2 * (P - s) - 1, M) for s in range(P)]
        if M >= 2 * P - 1:
            assert _in_flight(zb_v(P, M)) == [2 * P] * P


def test_flush_semantics_every_action_of_step_t_uses_version_t():
    for s in (zb_h2(3, 5, steps=3), zb_v(2, 4, steps=3)):
        validate(s)
        assert s.num_steps == 3
        M = s.microbatches_per_step
        for group in s.actions:
            for a in group:
                assert a.version == (a.mb if a.kind == "U" else a.mb // M)
            assert sum(a.kind == "U" for a in group) == 3 * s.chunks


def test_generate_and_the_schedule_list():
    from pdjax.schedules import SCHEDULES

    assert {"zb-h2", "zb-v"} <= set(SCHEDULES)
    assert generate("zb-h2", 3, 6, steps=2) == zb_h2(3, 6, steps=2)
    assert generate("zb-v", 3, 6, steps=2) == zb_v(3, 6, steps=2)
    assert generate("zb-v", 2, 4, replicas=(2, 3)).replicas == (2, 3)
    validate(generate("zb-v", 2, 4, num_layers=8))


# ----------------------------------------------------------------------------- the bubble


@pytest.mark.parametrize("P,M", GRID)
def test_zb_h2_is_a_parallelogram_with_zero_bubble(P, M):
    """F = I = W = 1, M >= 2P - 1: stage s busy without a gap from s to 3M + s; one step
    takes 3M + P - 1 and k steps 3Mk + P - 1 (each stage's next step starts where its
    previous one ends); the paper's bubble (P - 1)(T_F + T_B - 2 T_W) = 0."""
    costs = unit_costs(P)
    sim = simulate(zb_h2(P, M), costs)
    assert [_spans(sim, s) for s in range(P)] == [(s, 3 * M + s) for s in range(P)]
    assert _paper_bubble(sim, 3 * M) == 0
    for k in (1, 2, 3):
        sim = simulate(zb_h2(P, M, steps=k), costs)
        assert sim.makespan == 3 * M * k + P - 1
        assert sim.step_time == (3 * M * k + P - 1) / k
        assert sim.bubble_fraction == pytest.approx((P - 1) / (3 * M * k + P - 1), rel=1e-12)
        for s in range(P):  # idle s before, P - 1 - s after, once for all k steps
            assert sim.timeline.busy(s, 0.0, sim.makespan) == 3 * M * k


@pytest.mark.parametrize("P,M", GRID)
def test_zb_v_is_zero_bubble_in_chunk_units(P, M):
    """Every chunk F = I = W = 1, M >= 2P - 1: group d busy without a gap from d to 6M + d;
    one step 6M + P - 1, k steps 6Mk + P - 1."""
    sim = simulate(zb_v(P, M), _chunk_costs(P))
    assert [_spans(sim, d) for d in range(P)] == [(d, 6 * M + d) for d in range(P)]
    assert _paper_bubble(sim, 6 * M) == 0
    for k in (1, 2, 3):
        sim = simulate(zb_v(P, M, steps=k), _chunk_costs(P))
        assert sim.makespan == 6 * M * k + P - 1
        assert sim.bubble_fraction == pytest.approx((P - 1) / (6 * M * k + P - 1), rel=1e-12)


@pytest.mark.parametrize("P,M", GRID)
def test_bubble_fractions_against_1f1b_and_zb_h1(P, M):
    """The same work per device group (``unit_costs(P, chunks=2)`` halves each chunk):
    idle per group in a step 3(P - 1) for 1F1B, P - 1 for ZB-H1 and ZB-H2, (P - 1) / 2 for
    ZB-V; the papers' bubble (inside a stage's span) 3(P - 1), P - 1, 0, 0."""
    work = 3 * M
    expected = {
        "1f1b": (one_f_one_b(P, M), unit_costs(P), 3 * (P - 1), 3 * (P - 1)),
        "zb-h1": (zb_h1(P, M), unit_costs(P), P - 1, P - 1),
        "zb-h2": (zb_h2(P, M), unit_costs(P), P - 1, 0),
        "zb-v": (zb_v(P, M), unit_costs(P, chunks=2), (P - 1) / 2, 0),
    }
    for name, (schedule, costs, idle, paper) in expected.items():
        sim = simulate(schedule, costs)
        assert sim.step_time == work + idle, name
        assert sim.bubble_fraction == pytest.approx(idle / (work + idle), rel=1e-12), name
        assert _paper_bubble(sim, work) == paper, name


def test_numbers_at_p4_m8():
    """The table in the report (P = 4, M = 8, F = I = W = 1, one step and two)."""
    P, M = 4, 8
    one = {
        "1f1b": simulate(one_f_one_b(P, M), unit_costs(P)),
        "zb-h1": simulate(zb_h1(P, M), unit_costs(P)),
        "zb-h2": simulate(zb_h2(P, M), unit_costs(P)),
        "zb-v": simulate(zb_v(P, M), unit_costs(P, chunks=2)),
        "interleaved": simulate(interleaved(P, M, 2), unit_costs(P, chunks=2)),
    }
    assert {k: s.step_time for k, s in one.items()} == {
        "1f1b": 33.0,
        "zb-h1": 27.0,
        "zb-h2": 27.0,
        "zb-v": 25.5,
        "interleaved": 28.5,
    }
    assert one["1f1b"].bubble_fraction == pytest.approx(9 / 33, rel=1e-12)
    assert one["zb-h2"].bubble_fraction == pytest.approx(3 / 27, rel=1e-12)
    assert one["zb-v"].bubble_fraction == pytest.approx(3 / 51, rel=1e-12)
    two = {
        name: simulate(generate(name, P, M, steps=2), unit_costs(P, chunks=c)).bubble_fraction
        for name, c in [("zb-h1", 1), ("zb-h2", 1), ("zb-v", 2)]
    }
    assert two == pytest.approx({"zb-h1": 6 / 54, "zb-h2": 3 / 51, "zb-v": 3 / 99}, rel=1e-12)


def test_short_steps_still_run_and_do_no_worse_than_zb_h1():
    """Below M = 2P - 1 the warm-up cannot fill the wait: a bubble, never worse than ZB-H1
    per step (zb-h2) nor than 1F1B (zb-v)."""
    for P in (2, 3, 4, 6):
        for M in range(1, 2 * P - 1):
            h1 = simulate(zb_h1(P, M), unit_costs(P)).step_time
            assert simulate(zb_h2(P, M), unit_costs(P)).step_time <= h1
            f = simulate(one_f_one_b(P, M), unit_costs(P)).step_time
            assert simulate(zb_v(P, M), unit_costs(P, chunks=2)).step_time <= f


# ----------------------------------------------------------------------------- memory


@pytest.mark.parametrize("P", [1, 2, 3, 4, 6])
def test_zb_v_peak_activations_equal_1f1b_peak(P):
    """The paper: ZB-V's peak activation memory is 1F1B's (``P`` microbatches of a stage at
    1F1B's first stage): ``2P`` chunk-microbatches of half a stage on every group. Per
    group it is spread evenly, where 1F1B holds ``P - s`` at stage ``s``."""
    stash = 1000
    plan = PipelineCosts.build([StageCosts(1.0, 1.0, 1.0, stash_bytes=stash)] * P)
    for M in range(1, 3 * P + 2):
        f1b = simulate(one_f_one_b(P, M), plan).peak_memory
        v = simulate(zb_v(P, M), plan.v_shape()).peak_memory
        assert max(v) <= max(f1b) == min(P, M) * stash
        if M >= P:
            assert max(v) == max(f1b)
        if M >= 2 * P - 1:
            assert v == (P * stash,) * P
            assert f1b == tuple((P - s) * stash for s in range(P))
        # in chunks: at most 2P per group
        assert all(m <= 2 * P * (stash // 2) for m in v)


def test_zb_h2_peak_activations():
    """ZB-H2 keeps ``min(2P - 1, M)`` stashes at every stage until their W (pdjax's runtime
    reads the forward's residuals in W): up to 2P - 1, the paper's (2P - 1) M_B at stage
    0, about twice 1F1B's P."""
    stash = 1000
    for P in (1, 2, 4, 5):
        costs = PipelineCosts.build([StageCosts(1.0, 1.0, 1.0, stash_bytes=stash)] * P)
        for M in (1, P, 2 * P - 1, 3 * P):
            sim = simulate(zb_h2(P, M), costs)
            assert sim.peak_in_flight == (min(2 * P - 1, M),) * P
            assert sim.peak_memory == (min(2 * P - 1, M) * stash,) * P


def test_runtime_memory_counts_both_chunks_of_a_group():
    """``memory_model="runtime"`` with zb-v: group 0 holds stage 0's inputs and the last
    stage's targets from the start; each group holds both chunks' weights; the cotangents
    waiting for W are counted over both chunks."""
    P, M = 3, 5
    s = zb_v(P, M)
    inputs = PipelineCosts.build(
        [StageCosts(1.0, 1.0, 1.0, input_bytes=100)] * P, memory_model="runtime"
    ).v_shape()
    assert [st.input_bytes for st in inputs.stages] == [100, 0, 0, 0, 0, 100]
    mem = simulate(s, inputs).memory_by_action
    assert mem[0][0] == (M - 1) * 100 + M * 100  # the first F reads input 0; all targets
    assert max(mem[0]) == mem[0][0] and max(mem[1]) == 0 == max(mem[2])

    weights = PipelineCosts.build([StageCosts(1.0, 1.0, 1.0, param_bytes=200)] * P).v_shape()
    assert simulate(s, weights).peak_memory == (200,) * P  # 2 chunks x 100, one version

    cot = PipelineCosts.build(
        [StageCosts(1.0, 1.0, 1.0, cotangent_bytes=20)] * P, memory_model="runtime"
    ).v_shape()
    sim = simulate(s, cot)
    for g, group in enumerate(s.actions):  # count I-done, W-not-yet over both chunks
        waiting, expected = 0, []
        for a in group:
            waiting += a.kind == "I"
            expected.append(waiting * 10)
            waiting -= a.kind == "W"
        assert list(sim.memory_by_action[g]) == expected


def test_v_shape_costs_put_each_chunk_on_its_group():
    plan = PipelineCosts.build(
        [
            StageCosts(2.0, 4.0, 6.0, activation_bytes=10, param_bytes=8),
            StageCosts(4.0, 4.0, 4.0, activation_bytes=30, param_bytes=4),
            StageCosts(6.0, 2.0, 2.0, param_bytes=2),
        ],
        link_bandwidth=[1.0, 2.0],
        link_bandwidth_back=[3.0, 4.0],
        link_latency=[0.5, 0.25],
        allreduce_bandwidth=[5.0, 6.0, 7.0],
    )
    v = plan.v_shape()
    assert [st.forward for st in v.stages] == [1.0, 2.0, 3.0, 3.0, 2.0, 1.0]
    assert [st.param_bytes for st in v.stages] == [4, 2, 1, 1, 2, 4]
    # down the cuts 0, 1; the turn on group 2; back up the cuts 1, 0
    assert [st.activation_bytes for st in v.stages] == [10, 30, 30, 30, 10, 0]
    assert v.link_bandwidth == (1.0, 2.0, float("inf"), 4.0, 3.0)
    assert v.link_bandwidth_back == (3.0, 4.0, float("inf"), 2.0, 1.0)
    assert v.link_latency == (0.5, 0.25, 0.0, 0.25, 0.5)
    assert v.allreduce_bandwidth == (5.0, 6.0, 7.0, 7.0, 6.0, 5.0)
    # an activation going back up travels at the cut's gradient bandwidth
    costs = dataclasses.replace(plan, link_latency=0.0).v_shape()
    tl = simulate(zb_v(3, 5), costs).timeline
    up = [t for t in tl.transfers if t.action.kind == "F" and t.action.stage == 4]
    assert up and all(t.end - t.start == pytest.approx(10 / 3.0) for t in up)
    with pytest.raises(ScheduleError, match=r"costs.v_shape\(\) for zb-v"):
        simulate(zb_v(3, 5), plan)


# ----------------------------------------------------------------------------- pictures


def test_gantt_chart_and_trace(tmp_path):
    pytest.importorskip("matplotlib")
    sims = [
        simulate(zb_h2(4, 8), unit_costs(4)),
        simulate(zb_v(4, 8), unit_costs(4, chunks=2)),
    ]
    png = tmp_path / "zb.png"
    plot_gantt([s.timeline for s in sims], png, dpi=50)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    trace = chrome_trace([s.timeline for s in sims])
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == sum(len(s.timeline.spans) for s in sims)
    # zb-v's second chunk of group 0 (stage 7, the last) runs on group 0's row
    assert any(e["name"] == "7F0" and e["tid"] == 0 for e in spans)


# ----------------------------------------------------------------------------- bad parameters


def test_bad_parameters_raise_schedule_errors():
    cases = [
        (lambda: zb_h2(0, 4), r"num_stages \(P\) must be an integer >= 1"),
        (lambda: zb_v(2, 0), r"num_microbatches \(M\) must be an integer >= 1"),
        (lambda: zb_v(2, 4, steps=0), "steps must be an integer >= 1"),
        (lambda: zb_v(4, 8, num_layers=12), r"2P = 8 equal stages .* num_layers=12"),
        (lambda: generate("zb-v", 2, 4, chunks=3), "zb-v runs two chunks .* chunks must be 2"),
        (
            lambda: generate("zb-h2", 2, 4, replicas=(2, 1), replication="round-robin"),
            "zb-h2 has no round-robin form",
        ),
        (
            lambda: generate("zb-v", 2, 4, replicas=(2, 1), replication="round-robin"),
            "zb-v has no round-robin form",
        ),
    ]
    for make, message in cases:
        with pytest.raises(ScheduleError, match=message):
            make()
    v, h2 = zb_v(2, 4), zb_h2(2, 4)
    broken = [
        (dataclasses.replace(v, stage_device=(0, 1, 0, 1)), r"must be \[0, 1, 1, 0\] \(the V"),
        (dataclasses.replace(h2, num_stages=4), "only interleaved and zb-v put several"),
        (dataclasses.replace(h2, in_flight_bound=(4, 4)), "zb-h2 holds at most 3"),
        (
            dataclasses.replace(
                v,
                num_stages=6,
                stage_device=(0, 1, 1, 0, 0, 1),
                version_bound=(1,) * 6,
            ),
            "zb-v puts two stages",
        ),
    ]
    for schedule, message in broken:
        with pytest.raises(ScheduleError, match=message):
            validate(schedule)


def _model(depth=8, width=8):
    class Block(nn.Module):
        width: int

        @nn.compact
        def __call__(self, x):
            return jnp.tanh(nn.Dense(self.width)(x))

    return pdjax.sequential(*[Block(width) for _ in range(depth - 1)], nn.Dense(3))


def _loss(out, y):
    return jnp.mean((out - y) ** 2)


def _plan(schedule, layers, P, replicas=1, chunks=None):
    chunks = chunks or (2 if schedule == "zb-v" else 1)
    where = stage_groups(schedule, P, chunks)
    return tuple(
        StagePlan(
            s.first_layer,
            s.last_layer,
            tuple(range(where[i] * replicas, (where[i] + 1) * replicas)),
        )
        for i, s in enumerate(even_stages(len(layers), P * chunks))
    )


def test_bad_pipelines_fail_before_device_work():
    layers = _model()
    opt = optax.sgd(0.1)
    with pytest.raises(PipelineError, match=r"zb-v needs an even number 2P of stages .* has 3"):
        Pipeline(layers, even_stages(len(layers), 3), _loss, opt, schedule=ScheduleSpec("zb-v"))
    with pytest.raises(PipelineError, match=r"zb-v runs two chunks .* chunks must be 2, got 3"):
        Pipeline(
            layers, even_stages(len(layers), 6), _loss, opt, schedule=ScheduleSpec("zb-v", chunks=3)
        )
    with pytest.raises(PipelineError, match="option of interleaved, not of zb-h2"):
        Pipeline(
            layers,
            even_stages(len(layers), 4),
            _loss,
            opt,
            schedule=ScheduleSpec("zb-h2", chunks=2),
        )
    # interleaved's placement (stage s on stage s % P's devices) is not the V
    wrong = _plan("interleaved", layers, 2, chunks=2)
    with pytest.raises(
        PipelineError, match=r"zb-v stage 2 must use the devices of stage 1 \(\(1,\)"
    ):
        Pipeline(layers, wrong, _loss, opt, schedule=ScheduleSpec("zb-v"))
    with pytest.raises(PipelineError, match="round-robin replication runs with gpipe"):
        Pipeline(
            layers,
            _plan("zb-v", layers, 2, replicas=2),
            _loss,
            opt,
            schedule=ScheduleSpec("zb-v", microbatches=2, replication="round-robin"),
        )
    pipe = Pipeline(
        layers, _plan("zb-v", layers, 2), _loss, opt, schedule=ScheduleSpec("zb-v", microbatches=3)
    )
    assert pipe.chunks == 2 and pipe.num_groups == 2 and pipe.stage_device == (0, 1, 1, 0)
    assert pipe.schedule(3).stage_device == (0, 1, 1, 0)
    assert [st.devices for st in pipe.stages] == [pipe.stages[g].devices for g in pipe.stage_device]


# ----------------------------------------------------------------------------- transparency


def _check_transparent(schedule, P, M, replicas=1, steps=2, per_replica=2):
    layers = _model()
    opt = optax.sgd(0.05, momentum=0.9)
    mb = per_replica * replicas
    key = jax.random.key(0)
    x = jax.random.normal(key, (mb * M * steps, 5))
    y = jax.random.normal(jax.random.fold_in(key, 1), (mb * M * steps, 3))
    pipe = Pipeline(
        layers,
        _plan(schedule, layers, P, replicas),
        _loss,
        opt,
        schedule=ScheduleSpec(schedule, microbatches=M),
    )
    state = pipe.init(jax.random.key(3), x[:mb])
    variables = pipe.variables(state)
    microbatches = [(x[k * mb : (k + 1) * mb], y[k * mb : (k + 1) * mb]) for k in range(M * steps)]
    losses = []
    for t in range(steps):
        batch = (x[t * mb * M : (t + 1) * mb * M], y[t * mb * M : (t + 1) * mb * M])
        state, metrics = pipe.step(state, batch)
        losses += [float(v) for v in metrics.losses]
        assert metrics.peak_versions == (1,) * len(pipe.stages)
    ref_params, _, ref_losses = flush_training(
        layers, _loss, opt, variables, microbatches, M=M, rng=state.rng
    )
    np.testing.assert_allclose(losses, [float(v) for v in ref_losses], rtol=1e-5)
    got = [v["params"] for v in pipe.variables(state)]
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, ref_params
    )
    assert state.updates == (steps,) * len(pipe.stages)
    return pipe


@pytest.mark.parametrize(
    "schedule,P,M,replicas",
    [
        ("zb-h2", 2, 3, 1),
        ("zb-h2", 2, 4, 2),
        ("zb-h2", 4, 7, 1),
        ("zb-h2", 4, 4, 2),
        ("zb-v", 2, 3, 1),
        ("zb-v", 2, 2, 2),
        ("zb-v", 4, 7, 1),
        ("zb-v", 4, 4, 2),
    ],
)
def test_runtime_equals_gradient_accumulation(schedule, P, M, replicas):
    pipe = _check_transparent(schedule, P, M, replicas)
    if schedule == "zb-v":  # stage s on the devices of group min(s, 2P - 1 - s)
        for s, st in enumerate(pipe.stages):
            g = min(s, 2 * P - 1 - s)
            assert [d.id for d in st.devices] == list(range(g * replicas, (g + 1) * replicas))


def test_tied_embedding_on_both_ends_of_the_v():
    """zb-v puts the first and the last stage on group 0: a language model's embedding and
    its tied output head share devices (their exchange at each update stays on them) and
    train as one parameter, as in sequential training."""
    from test_tied import _check_against_reference, _layers

    v4 = [
        StagePlan(0, 0, (0,)),
        StagePlan(1, 2, (1,)),
        StagePlan(3, 3, (1,)),
        StagePlan(4, 4, (0,)),
    ]
    pipe = _check_against_reference(_layers(), v4, lambda: optax.adam(1e-2), "zb-v", 3)
    assert dict(pipe.tied_stages)["wte"] == (0, 3)
    assert pipe.stages[0].devices == pipe.stages[3].devices


@pytest.mark.parametrize("schedule", ["zb-h2", "zb-v"])
def test_global_norm_clipping_equals_sequential_training(schedule):
    """An optimizer coupled through the gradients' global norm (each update waits for every
    stage's sum of squares) still trains as one model, the V included."""
    layers = _model(depth=4)
    opt = optax.chain(optax.clip_by_global_norm(0.05), optax.sgd(0.1))
    M, mb = 3, 2
    key = jax.random.key(1)
    x = jax.random.normal(key, (2 * M * mb, 5))
    y = jax.random.normal(jax.random.fold_in(key, 1), (2 * M * mb, 3))
    pipe = Pipeline(
        layers,
        _plan(schedule, layers, 2),
        _loss,
        opt,
        schedule=ScheduleSpec(schedule, microbatches=M),
    )
    state = pipe.init(jax.random.key(3), x[:mb])
    variables = pipe.variables(state)
    for t in range(2):
        state, _ = pipe.step(
            state, (x[t * M * mb : (t + 1) * M * mb], y[t * M * mb : (t + 1) * M * mb])
        )
    assert pipe.coupled
    mbs = [(x[k * mb : (k + 1) * mb], y[k * mb : (k + 1) * mb]) for k in range(2 * M)]
    ref, _, _ = flush_training(layers, _loss, opt, variables, mbs, M=M, rng=state.rng)
    got = [v["params"] for v in pipe.variables(state)]
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, ref)
