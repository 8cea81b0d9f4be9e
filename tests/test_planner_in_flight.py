"""The planner and ``pipedream``'s ``in_flight="paper"`` (PipeDream's own groups in flight),
and the planner and the length of a runtime call (``pdjax train`` calls an epoch at once).

- The simulator prices a paper candidate as the paper schedule, generated and simulated
  here directly: time, peak memory, peak in flight; the peaks in flight are the
  validator's own recomputation of paper's counts, and so are the dynamic program's exact
  counts (``exact_in_flight``).
- The dynamic program's round-trip bound is Little's law over microbatches: 3 for a 1-3-1
  round-robin plan with unit costs, 4 with paper's counts, where the paper schedule runs
  at 7 (``tests/test_in_flight_paper.py`` derives the 7); so ``plan_pipedream`` refuses
  paper with round-robin stages and ``evaluate_partition`` records its bound as a lower
  bound.
- ``plan_auto`` searches ``in_flight``, returns the faster, records the other, and skips
  what the schedule refuses (paper with ``extra_in_flight``; paper on replicas 1-5-2) with
  the reason.
- A memory limit that the default call fits and an epoch-long call does not: the
  planners refuse (or choose another plan) once told the call's length, and ``pdjax
  train``'s planning tells them.
"""

from __future__ import annotations

import dataclasses
import importlib
import types

import jax
import pytest

from pdjax.apps import data as data_lib
from pdjax.apps.train import TrainConfig, planning
from pdjax.apps.train.config import CALL_STEPS
from pdjax.apps.train.loop import _calls
from pdjax.errors import PipelineError, PlanError, ScheduleError
from pdjax.partition import (
    Plan,
    Topology,
    auto_choice,
    costs_from_plan,
    evaluate_partition,
    plan_auto,
    plan_pipedream,
)
from pdjax.partition.choosing.auto import evaluate_candidate
from pdjax.partition.choosing.candidates import Candidate, price
from pdjax.partition.pricing import cost
from pdjax.profile import LayerProfile, Profile
from pdjax.schedules import ScheduleSpec, generate, validate
from pdjax.schedules.validate import expected_in_flight
from pdjax.simulator import simulate, stream_length

#: round-robin shapes and paper's groups in flight (tests/test_in_flight_paper.py derives
#: them): where they differ from full rate's, and where they do not (2-2, 3-1)
PAPER = {
    (1, 3, 1): (5, 1, 1),
    (2, 2): (2, 1),
    (1, 2, 1): (4, 2, 1),
    (3, 1): (2, 1),
    (2, 3, 1): (3, 1, 1),
}


def _profile(P, *, uneven=False, batch=6):
    """``P`` layers, one per stage; ``uneven``: different costs and bytes per layer."""
    layers = [
        LayerProfile(
            f"l{i}",
            forward_seconds=(1.0 + 0.4 * (i % 3)) * 1e-3 if uneven else 1e-3,
            backward_seconds=(2.0 + 0.7 * (i % 2)) * 1e-3 if uneven else 2e-3,
            param_bytes=(3 + i) * 10**5 if uneven else 0,
            output_bytes=(1 + i) * 10**4 if uneven else 0,
            residual_bytes=(4 + 2 * i) * 10**5 if uneven else 0,
        )
        for i in range(P)
    ]
    return Profile.chain(layers, batch_size=batch)


def _rr_plan(profile, replicas, in_flight="full-rate"):
    """A round-robin ``pipedream`` plan of one layer per stage."""
    stages = [(i, i, r) for i, r in enumerate(replicas)]
    return evaluate_partition(
        profile,
        Topology.flat(sum(replicas), 1e9),
        stages,
        schedule="pipedream",
        num_microbatches=1,
        replication="round-robin",
        in_flight=in_flight,
    )


# -- the simulator's pricing ------------------------------------------------------------


@pytest.mark.parametrize("uneven", [False, True], ids=["unit", "uneven"])
@pytest.mark.parametrize("replicas", list(PAPER), ids=lambda r: "-".join(map(str, r)))
def test_paper_pricing_is_the_paper_schedule_simulated(replicas, uneven):
    profile = _profile(len(replicas), uneven=uneven)
    plan = _rr_plan(profile, replicas)
    seconds, peaks, in_flight = price(plan, profile, "pipedream", in_flight="paper")
    N = stream_length("pipedream", len(replicas), replicas=replicas, replication="round-robin")
    sched = generate(
        "pipedream", len(replicas), 1, stream=N, replicas=replicas,
        replication=plan.replication, in_flight="paper",
    )  # fmt: skip
    validate(sched)
    sim = simulate(sched, costs_from_plan(plan, profile))
    assert seconds == pytest.approx(sim.time_per_microbatch / plan.microbatch_size, rel=1e-12)
    assert peaks == tuple(float(b) for b in sim.peak_memory)
    assert in_flight == tuple(sim.peak_in_flight)
    # evaluate_candidate gives the same figures
    assert evaluate_candidate(plan, profile, "pipedream", in_flight="paper") == (seconds, peaks)
    # peak in flight: the validator's paper counts, q_s n_s, and the planner's exact counts
    validated = tuple(expected_in_flight(sched, g) for g in range(len(replicas)))
    assert (
        in_flight
        == validated
        == tuple(q * n for q, n in zip(PAPER[replicas], replicas, strict=True))
    )
    exact = cost.exact_in_flight("pipedream", replicas, plan.replication, 1, "paper")
    assert tuple(c for c, _ in exact) == validated
    assert tuple(v for _, v in exact) == PAPER[replicas]  # versions: q_s
    full = price(plan, profile, "pipedream")
    if PAPER[replicas] == cost.groups_in_flight(replicas):
        assert full == (seconds, peaks, in_flight)
    else:  # fewer groups: less memory at the input stage, and slower
        assert full[0] < seconds
        assert full[1][0] > peaks[0] if uneven else full[1][0] == peaks[0] == 0.0


def test_in_flight_is_ignored_by_schedules_without_the_option():
    profile = _profile(3)
    plan = evaluate_partition(
        profile, Topology.flat(3, 1e9), [(0, 0, 1), (1, 1, 1), (2, 2, 1)], schedule="1f1b",
        num_microbatches=4,
    )  # fmt: skip
    assert price(plan, profile, "1f1b", in_flight="paper") == price(plan, profile, "1f1b")


def test_1_3_1_round_trips_full_and_paper():
    """Unit costs: the dynamic program's round-trip bound is 3 at full rate and 4 with
    paper's counts (Little's law), the simulator 3 and 7 per sample."""
    profile = Profile.chain(
        [
            LayerProfile(f"l{i}", forward_seconds=f, backward_seconds=2 * f)
            for i, f in enumerate((1.0, 3.0, 1.0))  # per device: 3, 9 / 3, 3 per microbatch
        ],
        batch_size=1,
    )
    full = _rr_plan(profile, (1, 3, 1))
    paper = _rr_plan(profile, (1, 3, 1), in_flight="paper")
    assert full.time_per_microbatch == pytest.approx(3.0)
    assert paper.time_per_microbatch == pytest.approx(4.0)
    assert paper.options["round_trip"] == "lower bound" and paper.schedule.in_flight == "paper"
    assert "round_trip" not in full.options and full.schedule.in_flight == "full-rate"
    assert full.in_flight == (9, 6, 1) and paper.in_flight == (5, 3, 1)
    assert price(full, profile, "pipedream")[0] == pytest.approx(3.0)
    assert price(paper, profile, "pipedream", in_flight="paper")[0] == pytest.approx(7.0)


def test_dynamic_program_prices_paper_only_without_round_robin():
    profile, topology = _profile(3, uneven=True), Topology.flat(5, 1e9)
    with pytest.raises(PlanError, match="in_flight='paper' cannot be planned"):
        plan_pipedream(profile, topology, in_flight="paper")
    with pytest.raises(PlanError, match="in_flight='paper' is an option of pipedream"):
        plan_pipedream(profile, topology, schedule="1f1b", in_flight="paper")
    with pytest.raises(PlanError, match="in_flight must be one of"):
        plan_pipedream(profile, topology, in_flight="half")
    split = plan_pipedream(profile, topology, replication="split", in_flight="paper")
    same = plan_pipedream(profile, topology, replication="split")
    assert split.stages == same.stages and split.schedule.in_flight == "paper"
    assert same.schedule.in_flight == "full-rate"
    # 1-5-2: paper deadlocks; refused by the counts with what to pass instead
    with pytest.raises(PlanError, match="pass in_flight='full-rate'"):
        _rr_plan(_profile(3), (1, 5, 2), in_flight="paper")


# -- plan_auto ---------------------------------------------------------------------------


def _auto(profile, devices, **kw):
    kw.setdefault("extra_in_flight", (0,))
    return plan_auto(
        profile, Topology.flat(devices, 1e9), schedules=["pipedream"], allow_stale=True,
        batch_size=6, microbatches=[1], **kw,
    )  # fmt: skip


def test_plan_auto_returns_the_faster_in_flight_and_records_the_other():
    profile = _profile(3, uneven=True)
    full = _auto(profile, 5)
    paper = _auto(profile, 5, in_flight=("paper",))
    both = _auto(profile, 5, in_flight=("full-rate", "paper"))
    times = {
        o: auto_choice(p)["time_per_sample"] for o, p in (("full-rate", full), ("paper", paper))
    }
    chosen = auto_choice(both)
    assert chosen["time_per_sample"] == min(times.values())
    assert chosen["in_flight_option"] == min(times, key=times.__getitem__)
    assert auto_choice(full)["in_flight_option"] == "full-rate"
    assert auto_choice(paper)["in_flight_option"] == "paper"
    assert both.schedule.in_flight == chosen["in_flight_option"]
    other = "paper" if chosen["in_flight_option"] == "full-rate" else "full-rate"
    alt = both.options["alternatives"][f"pipedream in_flight={other}"]
    assert alt["in_flight_option"] == other and alt["time_per_sample"] == times[other]
    # the paper choice is simulated as paper: its peaks in flight are paper's counts
    c = auto_choice(paper)
    replicas = tuple(r for _, _, r in c["stages"])
    modes = ["round-robin" if r > 1 else "split" for r in replicas]
    exact = cost.exact_in_flight("pipedream", replicas, modes, 1, "paper")
    assert c["in_flight"] == [n for n, _ in exact]
    fields = {f.name for f in dataclasses.fields(Candidate)}
    again = Candidate(**{k: v for k, v in c.items() if k in fields})
    assert again.label.startswith("pipedream in_flight=paper M=1")


def test_plan_auto_skips_what_paper_refuses_with_the_reason():
    profile = _profile(3, uneven=True)
    plan = _auto(profile, 8, in_flight=("full-rate", "paper"), extra_in_flight=(0, 1))
    refused = plan.options["refused"]
    assert "extra_in_flight=1" in refused["pipedream in_flight=paper +1"]
    # 1-5-2 (and every other shape where NOAM cannot hold the groups) is skipped
    assert "cannot run round-robin groups" in refused["pipedream in_flight=paper"]
    for c in plan.options["alternatives"].values():
        assert "none" in c or not (c["in_flight_option"] == "paper" and c["extra_in_flight"])
    with pytest.raises(PlanError, match="in_flight must list values of"):
        _auto(profile, 3, in_flight=("paper", "most"))


def test_pdjax_plan_searches_in_flight(tmp_path, capsys):
    from pdjax.apps.cli import main
    from pdjax.partition import Plan

    path, out = tmp_path / "p.json", tmp_path / "plan.json"
    _profile(3, uneven=True).save(path)
    argv = ["plan", "--profile", str(path), "--workers", "5", "--schedule", "auto"]
    argv += ["--allow-stale", "--microbatches", "6", "--batch-size", "6"]
    assert main([*argv, "--in-flight", "full-rate", "paper", "--out", str(out)]) == 0
    plan = Plan.load(out)
    text = " ".join(capsys.readouterr().out.split())
    assert "in_flight=p" in text  # (rich wraps and cuts the label in its column)
    chosen, alt = auto_choice(plan), plan.options["alternatives"]
    assert chosen["in_flight_option"] == "full-rate"  # faster on this profile
    assert alt["pipedream in_flight=paper"]["in_flight_option"] == "paper"
    assert alt["pipedream in_flight=paper"]["time_per_sample"] > chosen["time_per_sample"]
    assert main(["plan", "--profile", str(path), "--workers", "5", "--in-flight", "paper"]) == 2
    assert "options of --schedule auto" in capsys.readouterr().err


# -- the call's length -------------------------------------------------------------------


def _input_heavy(L=4, batch=8):
    """The model's input far larger than its weights: the inputs a call places up front
    decide the first stage's memory."""
    layers = [
        LayerProfile(
            f"l{i}",
            forward_seconds=1e-3,
            backward_seconds=2e-3,
            param_bytes=10**5,
            input_bytes=4 * 10**6 if i == 0 else 10**4,
            output_bytes=10**4,
            residual_bytes=10**4,
        )
        for i in range(L)
    ]
    return Profile.chain(layers, batch_size=batch)


def test_plan_auto_holds_the_limit_for_the_callers_call_length():
    """A limit the simulated stream (and the default call) fits but a call of 20 steps
    does not: told the call, plan_auto refuses, naming the call."""
    profile = _input_heavy()
    kw = dict(schedules=["1f1b"], microbatches=[4], batch_size=8, straight=True, remat=False)
    free = plan_auto(profile, Topology.flat(2, 1e9), **kw)
    long = plan_auto(profile, Topology.flat(2, 1e9), samples_per_call=160, **kw)
    held = auto_choice(long)["call_memory"]
    assert auto_choice(free)["call_memory"] == [] and auto_choice(long)["samples_per_call"]
    # the simulator's stream holds one step's inputs; the call 20 steps' (80 microbatches)
    assert held[0] > 5 * auto_choice(free)["peak_memory"]
    cap = 2 * auto_choice(free)["peak_memory"]
    fits = plan_auto(profile, Topology.flat(2, 1e9, memory_per_device=cap), **kw)
    assert auto_choice(fits)["fits"]
    with pytest.raises(PlanError, match="for calls of 160 samples"):
        plan_auto(profile, Topology.flat(2, 1e9, memory_per_device=cap), samples_per_call=160, **kw)
    with pytest.raises(PlanError, match="less than one step"):
        plan_auto(profile, Topology.flat(2, 1e9), samples_per_call=4, **kw)


def test_an_epoch_is_trained_in_calls_of_at_most_call_steps():
    ds = data_lib.digits(seed=0)
    for schedule, M, call_steps, epoch_steps in (
        ("pipedream", 4, None, None),
        ("1f1b", 4, 3, None),
        ("1f1b", 3, 2, 7),
        ("pipedream", 2, 100, None),
    ):
        cfg = TrainConfig(
            schedule=schedule, devices=4, microbatches=M, batch_size=48,
            call_steps=call_steps, epoch_steps=epoch_steps,
        )  # fmt: skip
        n = planning.epoch_microbatches(cfg, ds.num_train)
        calls = _calls(n, cfg.calls)
        assert sum(calls) == n and max(calls) == planning.call_microbatches(cfg, ds.num_train)
        assert all(c <= (call_steps or CALL_STEPS) * M for c in calls)
        if epoch_steps is not None:
            assert n == epoch_steps * M
        elif schedule == "pipedream":  # updates per microbatch: the whole pass
            assert n == ds.num_train // cfg.microbatch_size
        else:  # whole steps only
            assert n == ds.num_train // cfg.batch_size * M


@pytest.fixture
def capped(monkeypatch):
    """``Topology.from_devices`` with a memory limit (CPU devices report none)."""
    real = Topology.from_devices
    box = {}

    def with_limit(devices=None, **kw):
        return real(devices, memory_per_device=box.get("cap"), **kw)

    monkeypatch.setattr(Topology, "from_devices", staticmethod(with_limit))
    return box


def test_train_planning_refuses_a_plan_that_does_not_fit_a_call(monkeypatch, capped):
    profile = _input_heavy(batch=12)
    monkeypatch.setattr(
        importlib.import_module("pdjax.profile"), "profile", lambda *a, **k: profile
    )
    cfg = TrainConfig(
        schedule="pipedream", devices=2, microbatches=1, batch_size=12, plan="auto", straight=True
    )
    spec = types.SimpleNamespace(layers=None)
    calls = planning.call_microbatches(cfg, 1437)  # the digits training split
    assert calls == CALL_STEPS
    devices = jax.devices()[:2]
    short = plan_pipedream(
        profile, Topology.from_devices(devices), schedule="pipedream", num_microbatches=1,
        straight=True, replication="split",
    )  # fmt: skip
    capped["cap"] = 1.5 * max(short.memory_per_device)
    plan = planning.plan_of(cfg, spec, None)  # the default call fits
    assert plan.fits_memory
    with pytest.raises((PlanError, PipelineError), match="no configuration fits"):
        planning.plan_of(cfg, spec, None, calls=calls)


def test_resolve_auto_plans_for_the_longest_call(monkeypatch):
    seen = {}

    def fake_plan_auto(profile, topology, **kw):
        seen.update(kw)
        raise PlanError("stop here")

    monkeypatch.setattr(importlib.import_module("pdjax.partition"), "plan_auto", fake_plan_auto)
    monkeypatch.setattr(importlib.import_module("pdjax.profile"), "profile", lambda *a, **k: None)
    monkeypatch.setattr(importlib.import_module("pdjax.apps.bench"), "host_costs", lambda *a: None)
    ds = data_lib.digits(seed=0)
    cfg = TrainConfig(schedule="auto", devices=2, batch_size=32)
    spec = types.SimpleNamespace(layers=None)
    with pytest.raises(PlanError, match="stop here"):
        planning.resolve_auto(cfg, spec, ds)
    assert seen["samples_per_call"] == CALL_STEPS * 32  # call_steps steps of batch_size
    cfg = TrainConfig(schedule="auto", devices=2, batch_size=32, epoch_steps=3, call_steps=5)
    with pytest.raises(PlanError, match="stop here"):
        planning.resolve_auto(cfg, spec, ds)
    assert seen["samples_per_call"] == 3 * 32  # an epoch is shorter than a call


def test_auto_choice_carries_the_in_flight_option(tmp_path):
    made = _rr_plan(_profile(3), (1, 3, 1), in_flight="paper")
    diagnostics = {"time_per_sample": made.time_per_microbatch}  # what plan_auto keeps
    plan = dataclasses.replace(made, options={**made.options, "auto": diagnostics})
    assert plan.schedule == ScheduleSpec("pipedream", microbatches=1, in_flight="paper")
    cfg = TrainConfig(schedule="auto", devices=2, batch_size=32, allow_stale=True)
    assert planning.auto_choice(cfg, plan, tmp_path / "p.json").spec.in_flight == "paper"
    # a format-1 file written before the option: its choice names no in_flight_option
    data = plan.to_dict()
    chosen = {"schedule": "pipedream", "microbatches": 1, "extra_in_flight": 0}
    data.update(format="pdjax.plan/1", schedule="pipedream", num_microbatches=1)
    data["options"] = {**made.options, "auto": {**chosen, **diagnostics}}
    old = Plan.from_dict(data)
    assert old.schedule.in_flight == "full-rate"
    assert planning.auto_choice(cfg, old, tmp_path / "p.json").spec.in_flight == "full-rate"
    data["options"]["auto"]["in_flight_option"] = "paper"  # written with it
    new = Plan.from_dict(data)
    assert planning.auto_choice(cfg, new, tmp_path / "p.json").spec.in_flight == "paper"


def test_paper_shapes_refused_by_the_schedule_are_refused_by_the_planner():
    for replicas in ((1, 5, 2),):
        with pytest.raises(PlanError):
            cost.groups_in_flight(replicas, "paper")
        plan = _rr_plan(_profile(3), replicas)
        with pytest.raises(ScheduleError):
            price(plan, _profile(3), "pipedream", in_flight="paper")


def test_pdjax_train_plans_for_its_longest_call(monkeypatch):
    """The training loop asks for the plan of its longest runtime call (what it runs)."""
    from pdjax.apps.train import loop, train

    seen = {}

    class Stop(Exception):
        pass

    def fake_plan_of(cfg, spec, sample, calls=None):
        seen.update(cfg=cfg, calls=calls)
        raise Stop

    monkeypatch.setattr(loop, "plan_of", fake_plan_of)
    cfg = TrainConfig(
        model="cnn", dataset="digits", schedule="pipedream", devices=2, plan="auto",
        straight=True, epochs=1, microbatches=4, batch_size=64,
    )  # fmt: skip
    with pytest.raises(Stop):
        train(cfg)
    ds = data_lib.digits(seed=cfg.seed)
    assert planning.epoch_microbatches(seen["cfg"], ds.num_train) == 89
    assert seen["calls"] == planning.call_microbatches(seen["cfg"], ds.num_train) == 64
