"""``pdjax plan --schedule auto``: what it prints is the chosen configuration as the
simulator priced it (not the dynamic program's pricing, which only prunes), and
``--calibration`` prices the search with measured stages and links."""

from __future__ import annotations

import re

import pytest
from fixed_calibration import fixed_calibration

from pdjax.apps.cli import main
from pdjax.partition import Plan, auto_choice
from pdjax.partition.choosing.auto import evaluate_candidate
from pdjax.profile import LayerProfile, Profile


def _profile(path, n=6):
    # activations dominate memory: the schedule's in-flight count decides the peak
    layers = [
        LayerProfile(f"l{i}", forward_seconds=(1 + i % 3) * 1e-3,
                     backward_seconds=(2 + i % 2) * 1e-3, param_bytes=4 * 10**6,
                     output_bytes=10**5, residual_bytes=(20 + 10 * (i % 2)) * 10**6)
        for i in range(n)
    ]  # fmt: skip
    profile = Profile.chain(layers, batch_size=8)
    profile.save(path)
    return profile


def _printed(out):
    """The summary's figures, from the printed text (rich may wrap it)."""
    text = " ".join(out.split())
    found = re.search(
        r"\(simulated\): \S+ \S+ per sample; in flight \[([^\]]*)\]; peak memory \S+ \S+ per "
        r"device \(([0-9.e+]+) bytes; per stage [^)]*\)(; fits the limit of ([0-9.e+]+) bytes)?",
        text,
    )
    assert found, text
    # per stage's devices, "a+b" where they hold two virtual stages (interleaved, zb-v)
    in_flight = sorted(int(x) for part in found.group(1).split(", ") for x in part.split("+"))
    limit = float(found.group(4)) if found.group(4) else None
    return in_flight, float(found.group(2)), limit


def test_the_printed_plan_is_the_chosen_configuration_simulated(tmp_path, capsys):
    path, out = tmp_path / "p.json", tmp_path / "plan.json"
    _profile(path)
    argv = ["plan", "--profile", str(path), "--workers", "3", "--schedule", "auto"]
    argv += ["--microbatches", "6"]  # one M: quick
    assert main([*argv, "--out", str(out)]) == 0
    free = Plan.load(out)
    chosen = auto_choice(free)
    in_flight, peak, limit = _printed(capsys.readouterr().out)
    assert peak == pytest.approx(chosen["peak_memory"], rel=1e-3) and limit is None
    assert in_flight == sorted(chosen["in_flight"])
    # a limit below the free choice's peak: the accepted plan's printed peak fits it
    cap = 0.9 * chosen["peak_memory"]
    assert main([*argv, "--memory-limit", f"{cap:.6e}", "--out", str(out)]) == 0
    tight = auto_choice(Plan.load(out))
    in_flight, peak, limit = _printed(capsys.readouterr().out)
    assert limit == pytest.approx(cap, rel=1e-3) and tight["memory_limit"] == pytest.approx(cap)
    assert peak == pytest.approx(tight["peak_memory"], rel=1e-3)
    assert tight["peak_memory"] <= cap and tight["fits"]
    assert in_flight == sorted(tight["in_flight"])
    # the stages' own figures are the dynamic program's, priced for another schedule and
    # without the limit: this profile shows they differ from what the simulator says
    dp_peak = max(Plan.load(out).memory_per_device)
    assert dp_peak > cap


def test_schedule_auto_prices_its_search_with_a_calibration(tmp_path, capsys):
    layers = [
        LayerProfile(f"l{i}", forward_seconds=1e-3, backward_seconds=2e-3, output_bytes=1000,
                     param_bytes=4000)
        for i in range(4)
    ]  # fmt: skip
    profile = Profile.chain(layers, batch_size=8)
    profile.save(tmp_path / "p.json")
    cal = fixed_calibration()
    cal.save(tmp_path / "cal.json")
    argv = ["plan", "--profile", str(tmp_path / "p.json"), "--workers", "2", "--schedule",
            "auto", "--straight", "--calibration", str(tmp_path / "cal.json")]  # fmt: skip
    out = tmp_path / "plan.json"
    assert main([*argv, "--microbatches", "3", "--out", str(out)]) == 0
    plan = Plan.load(out)
    chosen = auto_choice(plan)
    assert chosen["calibrated"] and plan.microbatch_size == 8 and chosen["microbatches"] == 3
    # the recorded time is the calibrated simulation's, which the profile's differs from
    measured, _ = evaluate_candidate(plan, profile, chosen["schedule"], calibration=cal)
    guessed, _ = evaluate_candidate(plan, profile, chosen["schedule"])
    assert chosen["time_per_sample"] == pytest.approx(measured, rel=1e-12)
    assert measured != pytest.approx(guessed, rel=1e-3)
    capsys.readouterr()
    # a batch of calibrated microbatches, or a refusal that says why
    assert main([*argv, "--batch-size", "32", "--out", str(out)]) == 0
    assert auto_choice(Plan.load(out))["microbatches"] == 4
    assert main([*argv, "--batch-size", "12"]) == 2
    assert "must be a multiple of 8" in capsys.readouterr().err
    assert main([*argv, "--batch-size", "32", "--microbatches", "2"]) == 2
    assert "makes 4 of them, not --microbatches 2" in capsys.readouterr().err
    assert main([*argv, "--microbatch-size", "4"]) == 2
    assert "microbatch of 4 samples wanted" in capsys.readouterr().err


def test_the_slower_than_one_device_warning_reads_the_simulated_choice(tmp_path):
    import dataclasses

    from pdjax.apps.commands.plan import slower_than_one_device
    from pdjax.partition import Topology, plan_auto
    from pdjax.plan.plan import AUTO_DECISION

    plan = plan_auto(_profile(tmp_path / "p.json"), Topology.flat(2, 1e9), memory_limit=None)
    one = plan.single_device_time / plan.microbatch_size  # seconds per sample on one device

    def with_time(per_sample):
        # options["auto"] keeps plan_auto's diagnostics: those of its record but the decision
        kept = {k: v for k, v in auto_choice(plan).items() if k not in AUTO_DECISION}
        auto = {**kept, "time_per_sample": per_sample}
        return dataclasses.replace(plan, options={**plan.options, "auto": auto})

    assert slower_than_one_device(with_time(0.5 * one)) is None
    warning = slower_than_one_device(with_time(2 * one))
    assert warning is not None and "SLOWER than one device" in warning
    assert "(2x the time)" in warning
