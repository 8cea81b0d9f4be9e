"""``pipedream``'s ``in_flight="paper"``: PipeDream's own count of microbatches in flight,
``NOAM = ceil(W / n_0)`` groups at the input stage (``W`` workers, ``n_0`` of them at the
input stage), beside the default ``"full-rate"`` count.

The counts, the staleness and the refusals are checked against values written here from
the derivation in ``pdjax/schedules/inflight.py::paper_in_flight`` (not read from it); the
throughput against the closed forms of a serialised group; the runtime against the
delayed-update recurrence of ``tests/reference.py``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from reference import Dense32, DenseDropout, delayed_training, random_stream, replica_plan, xent

from pdjax.errors import PipelineError, ScheduleError
from pdjax.layers import sequential
from pdjax.pipeline import Pipeline
from pdjax.schedules import Schedule, ScheduleSpec, generate, paper_in_flight, pipedream, validate
from pdjax.schedules.validate import expected_in_flight
from pdjax.simulator import PipelineCosts, StageCosts, simulate, stream_length, unit_costs

#: replicas -> groups in flight per stage, paper and full-rate, from the derivation:
#: q_0 = NOAM; a later stage keeps PipeDream's ceil(W_s / n_s) unless the stage before it,
#: holding n_{s-1} q_{s-1} microbatches from the start of one of its groups, cannot feed
#: that many whole groups at every alignment.
#: - 1-3-1: NOAM 5. Stage 1 would keep ceil(4/3) = 2 groups, but 5 microbatches hold one
#:   group of 3: (5, 1, 1). Full rate: (9, 2, 1).
#: - 2-2: NOAM ceil(4/2) = 2 groups of 2; stage 1 keeps 1: (2, 1), as full rate.
#: - 1-2-1: NOAM 4; 4 microbatches hold PipeDream's 2 groups of 2: (4, 2, 1). Full: (6, 2, 1).
#: - 3-1: NOAM ceil(4/3) = 2 groups of 3: (2, 1), as full rate.
#: - 2-3-1: NOAM ceil(6/2) = 3 groups of 2 = 6 microbatches; a group of 3 starting in the
#:   middle of one of stage 0's groups leaves 5: one group, (3, 1, 1). Full: (6, 2, 1).
COUNTS = {
    (1, 3, 1): ((5, 1, 1), (9, 2, 1)),
    (2, 2): ((2, 1), (2, 1)),
    (1, 2, 1): ((4, 2, 1), (6, 2, 1)),
    (3, 1): ((2, 1), (2, 1)),
    (2, 3, 1): ((3, 1, 1), (6, 2, 1)),
}
SHAPES = list(COUNTS)


def _schedule(replicas, in_flight, N=None):
    P = len(replicas)
    if N is None:
        N = stream_length("pipedream", P, replicas=replicas, replication="round-robin")
    return generate(
        "pipedream", P, 1, stream=N, replicas=replicas, replication="round-robin",
        in_flight=in_flight,
    )  # fmt: skip


def _peak_in_flight(s: Schedule, group: int) -> int:
    """The most microbatches in flight on ``group``, counted by walking its actions."""
    held = peak = 0
    for a in s.actions[group]:
        if a.kind == "F":
            held += len(s.covers(a))
        elif a.kind == "B":
            held -= len(s.covers(a))
        peak = max(peak, held)
    return peak


def _staleness(s: Schedule, stage: int) -> list[int]:
    """Per update of ``stage``: the updates between the version its gradient was computed
    with (its group's ``B``) and the version it is applied to (``U`` reads it)."""
    n = s.group_size(stage)
    used = {a.mb // n: a.version for a in s.actions[stage] if a.kind == "B"}
    return [a.version - used[a.mb] for a in s.actions[stage] if a.kind == "U"]


@pytest.mark.parametrize("replicas", SHAPES)
def test_paper_schedules_validate_and_hold_noam_at_the_input_stage(replicas):
    paper, full = _schedule(replicas, "paper"), _schedule(replicas, "full-rate")
    validate(paper)
    assert paper.in_flight == "paper" and full.in_flight == "full-rate"
    n0 = replicas[0]
    noam = math.ceil(sum(replicas) / n0)
    assert paper.in_flight_bound[0] == noam * n0
    assert _peak_in_flight(paper, 0) == noam * n0  # reached, not just declared
    q_paper, q_full = COUNTS[replicas]
    assert paper.in_flight_bound == tuple(q * n for q, n in zip(q_paper, replicas, strict=True))
    assert full.in_flight_bound == tuple(q * n for q, n in zip(q_full, replicas, strict=True))
    assert paper_in_flight(replicas) == q_paper
    for g in range(len(replicas)):
        assert _peak_in_flight(paper, g) == paper.in_flight_bound[g]
    assert Schedule.from_json(paper.to_json()) == paper
    # the text of a full-rate schedule is as before the option existed
    assert '"in_flight"' in paper.to_json() and '"in_flight"' not in full.to_json()


@pytest.mark.parametrize("replicas", SHAPES)
def test_each_stage_is_q_s_minus_one_updates_stale(replicas):
    """Update ``u`` of stage ``s`` applies group ``u``'s gradient, computed at version
    ``max(0, u - q_s + 1)``, to version ``u``: ``q_s - 1`` updates stale in the steady
    state (1-3-1: 4, 0, 0 against full rate's 8, 1, 0)."""
    for mode, q in zip(("paper", "full-rate"), COUNTS[replicas], strict=True):
        s = _schedule(replicas, mode)
        for st in range(len(replicas)):
            stale = _staleness(s, st)
            assert max(stale) == q[st] - 1, (mode, st)
            assert stale[q[st] - 1 :] == [q[st] - 1] * (len(stale) - q[st] + 1)
            assert s.version_bound[st] == q[st]


def test_generator_and_validator_agree_on_every_small_shape():
    """The generator's closed form (``paper_in_flight``) and the validator's search
    (``expected_in_flight``, which plays each pair of neighbouring stages' orders) give
    the same counts, and refuse the same shapes, for every 2-4 stages of 1-4 replicas."""
    refused = 0
    for P in (2, 3, 4):
        for replicas in itertools.product(range(1, 5), repeat=P):
            period = math.lcm(*replicas)
            N = period * -(-4 * sum(replicas) // period)
            full = _schedule(replicas, "full-rate", N=N)
            relabelled = dataclasses.replace(full, in_flight="paper")
            try:
                q = paper_in_flight(replicas)
            except ScheduleError:
                refused += 1
                with pytest.raises(ScheduleError, match="no in-flight counts"):
                    expected_in_flight(relabelled, 0)
                continue
            assert q[0] == math.ceil(sum(replicas) / replicas[0])
            # never more than full rate keeps, at any stage
            assert all(
                a * n <= b for a, n, b in zip(q, replicas, full.in_flight_bound, strict=True)
            )
            expected = tuple(expected_in_flight(relabelled, d) for d in range(P))
            assert expected == tuple(a * n for a, n in zip(q, replicas, strict=True))
            assert _schedule(replicas, "paper", N=N).in_flight_bound == expected
    assert 0 < refused < 4**4 // 4


def test_without_round_robin_stages_both_counts_are_p_minus_s():
    paper = pipedream(4, 12, in_flight="paper")
    validate(paper)
    assert paper.in_flight_bound == (4, 3, 2, 1) == pipedream(4, 12).in_flight_bound
    assert paper.actions == pipedream(4, 12).actions


def test_what_paper_refuses_and_what_the_validator_rejects():
    # Stage 2's group {4, 5} needs stage 1's groups 0..4 and 5..9 forwarded, so stage 0
    # holds microbatches 0..9 before it can run a backward: 10, above NOAM = 8.
    with pytest.raises(ScheduleError, match=r"NOAM is 8 .* at least 10 .*in_flight='full-rate'"):
        _schedule((1, 5, 2), "paper", N=40)
    with pytest.raises(ScheduleError, match="extra_in_flight=0"):
        pipedream(3, 15, replicas=(1, 3, 1), replication="round-robin", extra_in_flight=1,
                  in_flight="paper")  # fmt: skip
    with pytest.raises(ScheduleError, match="extra_in_flight=0"):
        pipedream(3, 6, extra_in_flight=1, in_flight="paper")
    with pytest.raises(ScheduleError, match="in_flight must be one of"):
        pipedream(3, 6, in_flight="noam")
    with pytest.raises(ScheduleError, match="in_flight='paper' is an option of pipedream"):
        generate("1f1b", 2, 4, in_flight="paper")
    paper, full = _schedule((1, 3, 1), "paper"), _schedule((1, 3, 1), "full-rate")
    # full-rate counts labelled paper, and paper counts labelled full-rate (5 < the 6 the
    # full-rate order needs at stage 0)
    for wrong in (dataclasses.replace(full, in_flight="paper"),
                  dataclasses.replace(paper, in_flight="full-rate")):  # fmt: skip
        with pytest.raises(ScheduleError, match="in_flight_bound"):
            validate(wrong)
    # the versions are recomputed from the paper counts: stage 0's backward of microbatch
    # 8 at full rate's version max(0, 8 - 9 + 1) = 0 instead of paper's 4
    acts = list(paper.actions[0])
    at = acts.index(next(a for a in acts if a.kind == "B" and a.mb == 8))
    assert acts[at].version == 4
    acts[at] = acts[at]._replace(version=0)
    stale = dataclasses.replace(paper, actions=(tuple(acts), *paper.actions[1:]))
    with pytest.raises(ScheduleError, match="requires version 4"):
        validate(stale)
    with pytest.raises(ScheduleError, match="no in-flight counts"):
        validate(dataclasses.replace(_schedule((1, 5, 2), "full-rate", N=40), in_flight="paper"))


def _costs(fb):
    """Per replica and microbatch ``(forward, backward)`` seconds per stage, free links."""
    return PipelineCosts.build([StageCosts(f, b / 2, b / 2) for f, b in fb])


#: a realistic uneven profile per microbatch and replica (seconds): a light input stage, a
#: heavy replicated middle, a lighter output stage
UNEVEN = ((0.5, 1.2), (1.1, 2.0), (0.7, 1.5))


@pytest.mark.parametrize("fb", [((1.0, 2.0),) * 3, UNEVEN], ids=["unit", "uneven"])
def test_1_3_1_paper_serialises_each_group_of_the_middle_stage(fb):
    """Full rate runs at the bottleneck stage, ``max_s (f_s + b_s)`` per microbatch.
    With paper's ``q = (5, 1, 1)`` stage 1 holds one group of 3 at a time: each group
    runs its forward, stage 2's three microbatches one after another, its backward, and
    then stage 0's backward of the group's first microbatch and the forward that
    completes the next group: ``(3 (f_1 + b_1) + 3 (f_2 + b_2) + f_0 + b_0) / 3`` per
    microbatch (7 with unit costs against 3)."""
    replicas = (1, 3, 1)
    costs = _costs(fb) if fb != ((1.0, 2.0),) * 3 else unit_costs(3)
    full = simulate(_schedule(replicas, "full-rate"), costs)
    paper = simulate(_schedule(replicas, "paper"), costs)
    assert full.steady_state and paper.steady_state
    (f0, b0), (f1, b1), (f2, b2) = fb
    bottleneck = max(f + b for f, b in fb)
    serial = (3 * (f1 + b1) + 3 * (f2 + b2) + f0 + b0) / 3
    assert full.time_per_microbatch == pytest.approx(bottleneck)
    assert paper.time_per_microbatch == pytest.approx(max(bottleneck, serial))
    assert paper.time_per_microbatch > full.time_per_microbatch


@pytest.mark.parametrize(
    "fb", [((1.0, 2.0),) * 2, ((0.6, 1.4), (1.0, 2.1))], ids=["unit", "uneven"]
)
def test_2_2_paper_is_the_full_rate_schedule(fb):
    """2-2: NOAM = 2 groups of 2, which is also the full-rate count: the same actions,
    the same time per microbatch."""
    paper, full = _schedule((2, 2), "paper"), _schedule((2, 2), "full-rate")
    assert paper.actions == full.actions
    costs = _costs(fb)
    assert simulate(paper, costs).time_per_microbatch == pytest.approx(
        simulate(full, costs).time_per_microbatch
    )


# ----------------------------------------------------------------------------- runtime


@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_paper_round_robin_equals_its_recurrence(opt_name):
    """1-3-1 with ``in_flight="paper"``: group ``g`` of stage ``s`` runs forward and
    backward at version ``max(0, g - q_s + 1)`` with ``q = (5, 1, 1)`` (written here), the
    backward at the forward's version; each group's update applies its mean gradient. The
    full-rate versions, ``q = (9, 2, 1)``, give another result."""
    bounds, replicas = ((0, 1), (1, 3), (3, 4)), (1, 3, 1)
    layers = sequential(Dense32(), DenseDropout(), Dense32(), nn.Dense(10))
    opt = optax.sgd(0.1) if opt_name == "sgd" else optax.adam(1e-2)
    N = 3 * 3 * math.lcm(*replicas)  # at least 3P groups at every stage
    stream = random_stream(N)
    spec = ScheduleSpec("pipedream", in_flight="paper", replication="round-robin")
    pipe = Pipeline(layers, replica_plan(bounds, replicas), xent, opt, schedule=spec)
    assert pipe.spec.in_flight == "paper"
    sched = pipe.schedule(N)
    assert sched.in_flight == "paper" and sched.in_flight_bound == (5, 3, 1)
    state = pipe.init(jax.random.key(0), stream[0][0])
    start = pipe.variables(state)
    state, metrics = pipe.run(state, stream)
    q = (5, 1, 1)
    assert metrics.peak_versions == q
    assert state.updates == tuple(N // n for n in replicas)

    def reference(counts):
        return delayed_training(
            layers,
            xent,
            opt,
            start,
            stream,
            bounds=bounds,
            version_of=lambda s, k: max(0, k // replicas[s] - counts[s] + 1),
            rng=state.rng,
            M=list(replicas),
        )

    got = [list(p) for p in state.params]
    jax.tree.map(
        lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6), got, reference(q)
    )
    other = reference((9, 2, 1))
    gap = max(
        float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
        for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(other), strict=True)
    )
    assert gap > 1e-4


def test_pipeline_options_check_in_flight():
    """The spec checks the option once, when it is made (a PipelineError as before)."""
    assert ScheduleSpec("pipedream", in_flight="paper").in_flight == "paper"
    with pytest.raises(PipelineError, match="option of pipedream, not of 2bw"):
        ScheduleSpec("2bw", in_flight="paper")
    with pytest.raises(PipelineError, match="pass one of them"):
        ScheduleSpec("pipedream", extra_in_flight=1, in_flight="paper")
    with pytest.raises(PipelineError, match="in_flight must be one of"):
        ScheduleSpec("pipedream", in_flight="noam")


def test_pipeline_refuses_an_in_flight_it_cannot_run():
    """The constructor checks the option before it builds anything."""
    layers = sequential(Dense32(), nn.Dense(10))
    plan = replica_plan(((0, 1), (1, 2)), (1, 1))
    with pytest.raises(PipelineError, match="in_flight must be one of"):
        Pipeline(
            layers, plan, xent, optax.sgd(0.1), schedule=ScheduleSpec("pipedream", in_flight="noam")
        )
    with pytest.raises(PipelineError, match="option of pipedream, not of 1f1b"):
        Pipeline(
            layers, plan, xent, optax.sgd(0.1), schedule=ScheduleSpec("1f1b", in_flight="paper")
        )


def test_train_takes_in_flight_for_pipedream_only():
    """``pdjax train --in-flight`` (TrainConfig.options): checked before any work."""
    from pdjax.apps.train import TrainConfig

    paper = {"in_flight": "paper"}
    cfg = TrainConfig(schedule="pipedream", options=paper, replication="round-robin")
    assert "paper in flight" in cfg.label and cfg.spec.in_flight == "paper"
    with pytest.raises(PipelineError, match="option of pipedream"):
        TrainConfig(schedule="1f1b", options=paper)
    with pytest.raises(PipelineError, match="option of pipedream, not of schedule='dp'"):
        TrainConfig(schedule="dp", options=paper)
    with pytest.raises(PipelineError, match="in_flight must be one of"):
        TrainConfig(schedule="pipedream", options={"in_flight": "noam"})
    with pytest.raises(PipelineError, match="options must be a dict of schedule options"):
        TrainConfig(schedule="pipedream", options={"vsync": True})
