"""``pdjax plan --calibration``: a calibration's measured links price the cuts and
all-reduces of each topology level (the slowest link crossing it), in place of
``--bandwidths``, which is refused next to them; a calibration without links keeps the
``--bandwidths`` pricing."""

from __future__ import annotations

import itertools

import pytest
from fixed_calibration import fixed_calibration

from pdjax.apps.cli import main
from pdjax.calibrate import LinkMeasure
from pdjax.partition import Plan, Topology, plan_pipedream
from pdjax.profile import LayerProfile, Profile


@pytest.fixture
def profile(tmp_path) -> Profile:
    # large activations: a cut's transfer time matters at the calibration's slow links
    layers = [
        LayerProfile(f"l{i}", forward_seconds=1e-3, backward_seconds=2e-3, output_bytes=4000,
                     param_bytes=4000)
        for i in range(4)
    ]  # fmt: skip
    prof = Profile.chain(layers, batch_size=8)
    prof.save(tmp_path / "p.json")
    return prof


def _plan(tmp_path, cal, *args: str) -> tuple[int, Plan | None]:
    cal.save(tmp_path / "cal.json")
    out = tmp_path / "plan.json"
    out.unlink(missing_ok=True)
    argv = ["plan", "--profile", str(tmp_path / "p.json"), "--calibration",
            str(tmp_path / "cal.json"), "--out", str(out), *args]  # fmt: skip
    code = main(argv)
    return code, Plan.load(out) if code == 0 else None


def test_the_measured_links_price_the_level_the_slowest_one_wins(tmp_path, profile):
    cal = fixed_calibration()  # 0 -> 1: 1e-4 s + n / 1e6 B/s; 1 -> 0: 3e-4 s + n / 5e5 B/s
    code, plan = _plan(tmp_path, cal, "--workers", "2", "--schedule", "1f1b")
    assert code == 0 and plan is not None
    (level,) = plan.topology.levels
    assert (level.bandwidth, level.latency) == (5e5, 3e-4)
    assert plan.topology.name == "calibrated"
    # the plan is the optimizer's on that topology with the calibration's hooks
    expected = plan_pipedream(
        profile,
        Topology.from_levels([2], [5e5], latencies=[3e-4]),
        schedule="1f1b",
        stage_seconds=cal.stage_seconds("1f1b", 2),
        allreduce_seconds=cal.allreduce_function(),
    )
    assert plan.time_per_microbatch == pytest.approx(expected.time_per_microbatch, rel=1e-12)
    assert [(s.first_layer, s.last_layer, s.replicas) for s in plan.stages] == [
        (s.first_layer, s.last_layer, s.replicas) for s in expected.stages
    ]
    # on the default 10 Gbit/s the same calibration's stages are priced differently
    assert main(["plan", "--profile", str(tmp_path / "p.json"), "--workers", "2", "--schedule",
                 "1f1b", "--out", str(tmp_path / "b.json")]) == 0  # fmt: skip
    assert Plan.load(tmp_path / "b.json").topology.levels[0].bandwidth == 1.25e9


def test_each_level_takes_the_links_that_cross_it(tmp_path, profile):
    def link(a: int, b: int) -> LinkMeasure:
        inner = a // 2 == b // 2  # devices 0, 1 and 2, 3 share the inner level
        bandwidth = (8e9 if inner else 1e9) - 1e8 * (a + b)
        return LinkMeasure(a, b, latency=1e-6 * (a + 2 * b), bandwidth=bandwidth)

    links = tuple(link(a, b) for a, b in itertools.permutations(range(4), 2))
    cal = fixed_calibration(devices=(0, 1, 2, 3), links=links)
    code, plan = _plan(tmp_path, cal, "--levels", "2x2", "--schedule", "1f1b")
    assert code == 0 and plan is not None
    inner, outer = plan.topology.levels
    assert inner.bandwidth == 8e9 - 1e8 * 5 and inner.latency == pytest.approx(1e-6 * 8)
    assert outer.bandwidth == 1e9 - 1e8 * 4 and outer.latency == pytest.approx(1e-6 * 7)
    # a level of one worker joins no devices: it keeps its bandwidth, unused
    code, plan = _plan(tmp_path, fixed_calibration(), "--levels", "2x1", "--schedule", "1f1b")
    assert code == 0 and plan is not None
    assert [lvl.bandwidth for lvl in plan.topology.levels] == [5e5, 1.25e9]


def test_bandwidths_next_to_measured_links_are_refused(tmp_path, profile, capsys):
    code, _ = _plan(tmp_path, fixed_calibration(), "--workers", "2", "--bandwidths", "1e9")
    assert code == 2
    err = capsys.readouterr().err
    assert "holds measured links" in err and "drop --bandwidths" in err
    assert "drop --calibration" in err
    code, _ = _plan(tmp_path, fixed_calibration(), "--preset", "cluster-c")
    assert code == 2
    assert "--workers or --levels instead of --preset" in capsys.readouterr().err


def test_a_calibration_without_links_keeps_the_bandwidths(tmp_path, profile):
    code, plan = _plan(
        tmp_path, fixed_calibration(links=()), "--workers", "2", "--bandwidths", "3e8"
    )
    assert code == 0 and plan is not None
    assert plan.topology.levels[0].bandwidth == 3e8 and plan.topology.name == ""


def test_devices_or_levels_the_links_do_not_cover_are_refused(tmp_path, profile, capsys):
    four = dict(devices=(0, 1, 2, 3))
    code, _ = _plan(tmp_path, fixed_calibration(), "--workers", "3")
    assert code == 2
    assert "[2] were not measured" in capsys.readouterr().err
    # links only inside the pairs 0-1 and 2-3: nothing measured across the outer level
    inside = tuple(LinkMeasure(a, b, 1e-5, 1e9) for a, b in [(0, 1), (1, 0), (2, 3), (3, 2)])
    code, _ = _plan(tmp_path, fixed_calibration(links=inside, **four), "--levels", "2x2")
    assert code == 2
    err = capsys.readouterr().err
    assert "no link across level 1" in err and "between devices 0 and 2" in err
