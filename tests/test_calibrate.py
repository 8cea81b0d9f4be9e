"""pdjax.calibrate: measured stages, links and all-reduces as plain data; what plan and
simulate make of them; refusals of a calibration for another model, plan or devices."""

from __future__ import annotations

import dataclasses
import itertools
import json
import threading

import jax
import optax
import pytest
from cli_helpers import run_command
from fixed_calibration import fixed_calibration

from pdjax.calibrate import (
    AllReduceMeasure,
    Calibration,
    StageMeasure,
    calibrate,
    fit_latency_bandwidth,
    measure_stages,
    model_fingerprint,
    neighbours,
    rank_plans,
    with_timeout,
)
from pdjax.errors import CalibrationError
from pdjax.models import get_model
from pdjax.partition import Topology, costs_from_plan, evaluate_partition
from pdjax.profile import LayerProfile, Profile


def _profile(n: int = 4) -> Profile:
    layers = [
        LayerProfile(f"l{i}", forward_seconds=1e-3, backward_seconds=2e-3, output_bytes=1000,
                     param_bytes=4000)
        for i in range(n)
    ]  # fmt: skip
    return Profile.chain(layers, batch_size=8)


def _plan(stages=((0, 1, 1), (2, 3, 1)), workers=2):
    return evaluate_partition(_profile(), Topology.flat(workers, 1e6), list(stages),
                              schedule="pipedream", microbatch_size=8)  # fmt: skip


def test_fit_recovers_latency_and_bandwidth():
    sizes = [1e3, 1e4, 1e5, 1e6]
    secs = [2e-4 + n / 5e8 for n in sizes]
    lat, bw = fit_latency_bandwidth(sizes, secs)
    assert lat == pytest.approx(2e-4, rel=1e-6) and bw == pytest.approx(5e8, rel=1e-6)
    with pytest.raises(CalibrationError, match="two distinct sizes"):
        fit_latency_bandwidth([10, 10], [1.0, 1.0])


def test_json_round_trip_and_bad_files(tmp_path):
    cal = fixed_calibration(allreduces=(AllReduceMeasure((0, 1), 1e-3, 1e9, (4, 8), (1e-3, 1e-3)),))
    path = cal.save(tmp_path / "cal.json")
    assert Calibration.load(path) == cal
    (tmp_path / "other.json").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(CalibrationError, match="not a pdjax calibration"):
        Calibration.load(tmp_path / "other.json")
    with pytest.raises(CalibrationError, match="no calibration file"):
        Calibration.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(CalibrationError, match="not valid JSON"):
        Calibration.load(tmp_path / "bad.json")


def test_a_calibration_for_another_model_plan_or_devices_is_refused():
    cal = fixed_calibration()
    cal.check(layers=[f"l{i}" for i in range(4)], microbatch_size=8, plan=_plan())
    with pytest.raises(CalibrationError, match="the model has 3 layers, the calibration 4"):
        cal.check(layers=["l0", "l1", "l2"])
    with pytest.raises(CalibrationError, match="layer 2 is 'conv'"):
        cal.check(layers=["l0", "l1", "conv", "l3"])
    with pytest.raises(CalibrationError, match="layer 1 has 8 parameter bytes"):
        cal.check(param_bytes=[4000, 8, 4000, 4000])
    with pytest.raises(CalibrationError, match="microbatch of 16 samples wanted"):
        cal.check(microbatch_size=16)
    with pytest.raises(CalibrationError, match=r"devices \[2\] that the calibration did not"):
        cal.check(plan=_plan(((0, 1, 1), (2, 2, 1), (3, 3, 1)), workers=3))
    with pytest.raises(CalibrationError, match=r"stages \['0-2 x1', '3-3 x1'\]"):
        cal.check(plan=_plan(((0, 2, 1), (3, 3, 1))), require_stages=True)
    gpu = dataclasses.replace(cal, platform="gpu", device_kind="NVIDIA H200")
    with pytest.raises(CalibrationError, match="measured on gpu 'NVIDIA H200'"):
        gpu.check(devices=jax.devices()[:2])


def test_calibrated_costs_are_the_measured_ones():
    plan, cal = _plan(), fixed_calibration()
    costs = costs_from_plan(plan, _profile(), calibration=cal)
    s0, s1 = costs.stages
    assert (s0.forward, s0.backward, s0.update) == pytest.approx((0.010, 0.020, 0.004))
    assert (s1.forward, s1.backward, s1.update) == pytest.approx((0.030, 0.050, 0.002))
    assert costs.link_bandwidth == (1e6,) and costs.link_bandwidth_back == (5e5,)
    assert costs.link_latency == pytest.approx((2e-4,))
    assert s0.send_seconds == pytest.approx(2e-5) and s1.send_seconds == pytest.approx(4e-5)
    # bytes still come from the profile
    assert s0.activation_bytes == 1000 and s0.param_bytes == 8000


def test_unmeasured_stage_is_refused_or_priced_from_the_profile():
    plan = _plan(((0, 2, 1), (3, 3, 1)))
    cal = fixed_calibration()
    with pytest.raises(CalibrationError, match="were not measured"):
        costs_from_plan(plan, _profile(), calibration=cal)
    costs = costs_from_plan(plan, _profile(), calibration=cal, partial=True)
    plain = costs_from_plan(plan, _profile())
    for got, want in zip(costs.stages, plain.stages, strict=True):
        assert got.forward == pytest.approx(2.0 * want.forward)  # the profile ratio
        assert got.backward == pytest.approx(2.0 * want.backward)


def test_simulator_plays_the_calibrated_costs():
    """One worker: the stage's forward + backward + update per microbatch, exactly."""
    from pdjax.schedules import generate
    from pdjax.simulator import simulate

    plan = evaluate_partition(_profile(), Topology.flat(1, 1e6), [(0, 3, 1)],
                              schedule="pipedream", microbatch_size=8)  # fmt: skip
    costs = costs_from_plan(plan, _profile(), calibration=fixed_calibration(devices=(0,)))
    sim = simulate(generate("pipedream", 1, 10), costs)
    assert sim.makespan == pytest.approx(10 * (0.040 + 0.070 + 0.006))


def test_planner_uses_the_calibrated_stage_seconds():
    cal = fixed_calibration()
    fn = cal.stage_seconds("pipedream")
    assert fn(0, 1, 1, "split") == pytest.approx(0.010 + 0.020 + 0.004)
    assert fn(1, 3, 1, "split") is None
    assert cal.stage_seconds("1f1b", 4)(2, 3, 1, "split") == pytest.approx(0.08 + 0.002 / 4)
    plan = evaluate_partition(_profile(), Topology.flat(2, 1e9), [(0, 1, 1), (2, 3, 1)],
                              schedule="pipedream", microbatch_size=8,
                              stage_seconds=fn)  # fmt: skip
    # the slowest stage (2-3: 82 ms with its update) bounds the pipeline
    assert plan.time_per_microbatch >= 0.082


def test_rank_plans_puts_the_measured_fastest_first():
    """The profile says 0-1 / 2-3 is balanced; the calibration says stage 2-3 is slow and
    0-2 / 3-3 is balanced: the re-ranking follows the measurement."""
    base = fixed_calibration()
    extra = (
        StageMeasure(0, 2, 1, "split", forward=0.02, backward=0.03, update=0.001),
        StageMeasure(3, 3, 1, "split", forward=0.02, backward=0.03, update=0.001),
    )
    cal = dataclasses.replace(base, stages=base.stages + extra)
    plans = [_plan(), _plan(((0, 2, 1), (3, 3, 1)))]
    ranked = rank_plans(plans, _profile(), cal)
    assert [r.plan.stages[0].last_layer for r in ranked] == [2, 1]
    assert ranked[0].simulated < ranked[1].simulated


def test_neighbours_move_each_cut_by_one():
    plan = _plan(((0, 1, 1), (2, 2, 1), (3, 3, 1)), workers=3)
    got = neighbours(plan)
    assert [(0, 0, 1), (1, 2, 1), (3, 3, 1)] in got
    assert [(0, 2, 1), (3, 2, 1), (3, 3, 1)] not in got  # an empty stage is not a plan
    assert [(0, 1, 1), (2, 3, 1), (4, 3, 1)] not in got
    assert len(got) == 1


def test_a_link_that_does_not_answer_fails_in_time_naming_it():
    """The error comes while the measurement is still blocked (it is never released here),
    not when it ends: ordering, not a clock, is what is checked."""
    never = threading.Event()
    with pytest.raises(CalibrationError, match=r"link 3 -> 5 could not be measured within"):
        with_timeout("link 3 -> 5", 0.2, never.wait)
    assert not never.is_set()
    blocked = [t for t in threading.enumerate() if t.name == "pdjax-calibrate link 3 -> 5"]
    assert blocked and blocked[0].is_alive(), "the measurement should still be blocked"
    never.set()  # lets the left-behind thread end


def test_measure_and_calibrate_a_tiny_model():
    spec = get_model("mlp", "tiny")
    sample = spec.sample_batch(8)
    L = len(spec.layers)
    got = measure_stages(spec.layers, sample, spec.loss, optax.sgd(0.1),
                         [(0, 1, 1, "split"), (2, L - 1, 2, "split"),
                          (2, L - 1, 2, "round-robin")], repeats=2)  # fmt: skip
    assert [(m.first, m.last, m.replicas, m.rows) for m in got] == [
        (0, 1, 1, 8), (2, L - 1, 2, 4), (2, L - 1, 2, 8)
    ]  # fmt: skip
    assert all(m.forward > 0 and m.backward >= 0 and m.update > 0 for m in got)
    with pytest.raises(CalibrationError, match="must be a multiple of 3"):
        measure_stages(spec.layers, sample, spec.loss, optax.sgd(0.1), [(0, 1, 3, "split")])
    devices = jax.devices()[:2]
    cal = calibrate(spec.layers, sample, spec.loss, optax.sgd(0.1), [(0, 1, 2, "split")],
                    devices=devices, repeats=2, sizes=(4096, 65536))  # fmt: skip
    assert cal.model == model_fingerprint(spec.layers, sample[0])
    assert cal.stage(0, L - 1) is not None  # the whole model is always measured
    assert cal.stage(0, 1, 2, "split").allreduce > 0
    assert {(ln.src, ln.dst) for ln in cal.links} == {(0, 1), (1, 0)}
    assert all(ln.bandwidth > 0 and ln.latency >= 0 for ln in cal.links)
    assert cal.allreduce([1, 0]).bandwidth > 0


@pytest.mark.parametrize("versions", [1, 3])
def test_the_update_is_timed_after_the_backward_on_its_gradient(monkeypatch, versions):
    """As the runtime runs them: each U takes the gradient the B just before it made
    (donated) and the newest weights, and B reads the oldest of ``versions`` versions
    kept alive (the weights U replaced are not dropped at once)."""
    from pdjax.pipeline import Stage

    calls: list[tuple[str, tuple, object]] = []
    build = Stage.program

    def program(self, kind, flags=frozenset()):
        fn = build(self, kind, flags)
        if kind not in ("B", "U"):
            return fn

        def recorded(*args):
            out = fn(*args)
            calls.append((kind, args, out))
            return out

        return recorded

    monkeypatch.setattr(Stage, "program", program)
    spec = get_model("mlp", "tiny")
    sample = spec.sample_batch(8)
    (m,) = measure_stages(spec.layers, sample, spec.loss, optax.sgd(0.1), [(1, 2, 1, "split")],
                          repeats=4, warmup=1, versions=versions)  # fmt: skip
    assert m.backward > 0 and m.update > 0
    kinds = "".join(k for k, _, _ in calls)
    assert kinds == "BU" * 5
    written = []  # the weights each U wrote
    for i in range(0, len(calls), 2):
        (_, b_args, b_out), (_, u_args, u_out) = calls[i], calls[i + 1]
        assert u_args[0] is b_out[0]  # the gradient B made
        # donated: its buffers hold the new weights
        assert all(a.is_deleted() for a in jax.tree.leaves(u_args[0]))
        if written:
            assert u_args[1] is written[-1]  # U replaces the newest weights
            back = written[-versions] if len(written) >= versions else None
            if back is not None:
                assert b_args[0] is back  # B reads the oldest version held
        written.append(u_out[0])
    with pytest.raises(CalibrationError, match="versions must be"):
        measure_stages(spec.layers, sample, spec.loss, optax.sgd(0.1), [(0, 1, 1, "split")],
                       versions=0)  # fmt: skip


def test_the_command_line_calibrates_and_plan_and_simulate_read_it(tmp_path, capsys):
    """``pdjax calibrate`` end to end: a plan's stages, links and replicated all-reduce
    measured on this machine's devices and written as JSON that ``pdjax plan`` and
    ``pdjax simulate`` read; ``--refine`` writes the plan it ranks best."""
    from pdjax.profile import Profile

    def cli(command, *args):  # a failure raises its own error, not an exit status
        return run_command(command, *(str(a) for a in args))

    prof, plan, cal, best = (tmp_path / f for f in ("p.json", "plan.json", "c.json", "b.json"))
    mlp = ("--model", "mlp", "--microbatch-size", 4, "--repeats", 1)
    assert cli("profile", "--model", "mlp", "--batch-size", 4, "--device-model", "h100",
               "--out", prof) == 0  # fmt: skip
    # stage 0 on devices 0 and 1 (its all-reduce is measured), stage 1 on device 2
    cut = [(0, 1, 2), (2, 3, 1)]
    topology = Topology.flat(3, 1.25e9)
    evaluate_partition(Profile.load(prof), topology, cut, schedule="1f1b", microbatch_size=4).save(
        plan
    )
    assert cli("calibrate", *mlp, "--plan", plan, "--devices", 3, "--out", cal) == 0
    got = Calibration.load(cal)
    assert got.microbatch_size == 4 and got.devices == (0, 1, 2)
    assert set(cut) <= {(s.first, s.last, s.replicas) for s in got.stages}
    assert all(s.forward > 0 and s.backward > 0 and s.update > 0 for s in got.stages)
    # every pair of the plan's devices, both ways
    assert {(link.src, link.dst) for link in got.links} == set(itertools.permutations(range(3), 2))
    assert all(link.bandwidth > 0 for link in got.links)
    assert [a.devices for a in got.allreduces] == [(0, 1)]
    capsys.readouterr()
    assert cli("plan", "--profile", prof, "--workers", 3, "--calibration", cal, "--json") == 0
    assert json.loads(capsys.readouterr().out)["stages"]
    assert cli("simulate", "--plan", plan, "--profile", prof, "--calibration", cal,
               "--schedule", "1f1b", "--microbatches", 4, "--json") == 0  # fmt: skip
    assert "1f1b" in json.dumps(json.loads(capsys.readouterr().out))
    assert cli("calibrate", *mlp, "--profile", prof, "--refine", "--devices", 2,
               "--schedule", "1f1b", "--microbatches", 2, "--out", tmp_path / "r.json",
               "--plan-out", best) == 0  # fmt: skip
    assert json.loads(best.read_text())["stages"]
