"""Faulty files: profiles, plans, calibrations and graph.txt files that are malformed, wrong
or cut short, and output paths that cannot be written. Each gives a pdjax error naming the
file and the field (or line), never a raw traceback or a silently wrong result."""

from __future__ import annotations

import copy
import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_cli_fuzz import unprivileged  # root without CAP_DAC_OVERRIDE: modes then apply

from pdjax.apps.commands import simulate as simulate_command
from pdjax.calibrate import AllReduceMeasure, Calibration, LinkMeasure, StageMeasure
from pdjax.errors import CalibrationError, GraphFormatError, PdjaxError, PlanError, ProfileError
from pdjax.partition import (
    Plan,
    Topology,
    costs_from_plan,
    evaluate_partition,
    plan_pipedream,
    plan_uniform,
)
from pdjax.profile import LayerProfile, Profile, read_graph_txt

_VGG_GRAPH = Path(Profile.load("pipedream:vgg16").meta["source"])


def _layer(i: int, scale: float = 1.0) -> LayerProfile:
    """A layer with every field filled, so mutations reach each kind of field."""
    return LayerProfile(
        name=f"l{i}",
        kind="Dense",
        forward_flops=1e6 * (i + 1),
        backward_flops=2e6 * (i + 1),
        forward_bytes_accessed=3e5,
        backward_bytes_accessed=6e5,
        param_bytes=4096 * (i + 1),
        state_bytes=0,
        input_bytes=512,
        output_bytes=512,
        residual_bytes=128,
        peak_bytes=8192,
        forward_seconds=1e-3 * (i + 1) * scale,
        backward_seconds=2e-3 * (i + 1) * scale,
        output_shape="f32[4, 32]",
        input_grad_flops=1e6,
        weight_grad_flops=1e6,
        input_grad_seconds=1e-3,
        weight_grad_seconds=1e-3,
    )


def _profile(scale: float = 1.0) -> Profile:
    # A DAG (a skip edge 0 -> 2) of four layers.
    return Profile(
        layers=tuple(_layer(i, scale) for i in range(4)),
        edges=((0, 1), (1, 2), (2, 3), (0, 2)),
        batch_size=4,
        time_source="model:test",
        meta={"model": "test"},
    )


@pytest.fixture(scope="module")
def prof() -> Profile:
    return _profile()


@pytest.fixture(scope="module")
def plan(prof) -> Plan:
    return plan_uniform(prof, Topology.flat(4, 1e9), num_stages=2, replicas=2)


# -- A: mutated JSON gives ProfileError / PlanError, nothing else -----------------------


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path into a JSON value (the root included)."""
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*prefix, i))
    return out


_DROP = object()
_REPLACEMENTS = [
    "x",
    "",
    None,
    [],
    [1, 2, 3],
    {},
    {"a": 1},
    -1,
    -2.5,
    0,
    math.nan,
    math.inf,  # what json.loads gives for 1e999
    -math.inf,
    10**400,
    2**70,
    True,
    1.5,
    _DROP,
]


def _mutate(data: dict, path: tuple, new: Any) -> Any:
    data = copy.deepcopy(data)
    if not path:
        return None if new is _DROP else new
    parent = data
    for key in path[:-1]:
        parent = parent[key]
    if new is _DROP:
        del parent[path[-1]]
    else:
        parent[path[-1]] = new
    return data


def _mutations(base: dict) -> st.SearchStrategy:
    one = st.tuples(st.sampled_from(_paths(base)), st.sampled_from(_REPLACEMENTS))
    return st.lists(one, min_size=1, max_size=2)


def _apply(base: dict, mutations: list) -> Any:
    data = base
    for path, new in mutations:
        try:
            data = _mutate(data, path, new)
        except (KeyError, IndexError, TypeError):  # an earlier mutation removed the path
            pass
    return data


_PROFILE_DICT = _profile().to_dict()


@settings(max_examples=300, deadline=None)
@given(_mutations(_PROFILE_DICT))
def test_mutated_profile_json_gives_profile_error_or_a_sound_profile(mutations):
    data = _apply(_PROFILE_DICT, mutations)
    try:
        loaded = Profile.from_dict(data, "profile p.json")
    except ProfileError as e:
        assert str(e).startswith("profile p.json")
        return
    # Accepted: it must be usable and write back as strict JSON (no NaN, no inf).
    Profile.from_json(loaded.to_json())
    str(loaded)
    loaded.cut_bytes()
    loaded.content_hash()


_PLAN_DICT = plan_uniform(_profile(), Topology.flat(4, 1e9), num_stages=2, replicas=2).to_dict()


@settings(max_examples=300, deadline=None)
@given(_mutations(_PLAN_DICT))
def test_mutated_plan_fields_give_plan_error_or_a_sound_plan(mutations):
    data = _apply(_PLAN_DICT, mutations)
    try:
        loaded = Plan.from_dict(data, "plan p.json")
    except PlanError as e:
        assert str(e).startswith("plan p.json")
        return
    Plan.from_json(loaded.to_json())
    loaded.describe()
    assert all(st.in_flight >= 1 and st.replicas >= 1 for st in loaded.stages)
    assert loaded.num_microbatches >= 1


def test_bad_field_names_the_file_and_the_field_path(prof, tmp_path):
    data = prof.to_dict()
    data["layers"][3]["forward_seconds"] = "fast"
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match=r"p\.json.*layers\[3\]\.forward_seconds.*string"):
        Profile.load(path)


@pytest.mark.parametrize("text", ["", "  \n", "null", "[1, 2, 3]", "7", '"profile"', "1e999"])
def test_a_profile_that_is_not_a_json_object_is_refused(tmp_path, text):
    path = tmp_path / "p.json"
    path.write_text(text)
    with pytest.raises(ProfileError, match=rf"{path}.*(empty|JSON object)"):
        Profile.load(path)


def test_graph_txt_with_bytes_that_are_not_utf8_names_file_and_line(tmp_path):
    lines = _VGG_GRAPH.read_bytes().splitlines(keepends=True)
    path = tmp_path / "graph.txt"
    path.write_bytes(lines[0] + b"node99 -- \xff\xfe -- junk\n" + b"".join(lines[1:]))
    for read in (Profile.load, read_graph_txt):
        with pytest.raises(GraphFormatError, match=rf"{path}:2: .*not UTF-8"):
            read(path)


def test_graph_txt_with_an_infinite_number_names_file_and_line(tmp_path):
    lines = _VGG_GRAPH.read_text().splitlines(keepends=True)
    head, _, rest = lines[2].partition("forward_compute_time=")
    lines[2] = f"{head}forward_compute_time=1e999,{rest.split(',', 1)[1]}"
    path = tmp_path / "graph.txt"
    path.write_text("".join(lines))
    for read in (Profile.load, read_graph_txt):
        with pytest.raises(GraphFormatError, match=rf"{path}:3: .*finite"):
            read(path)


# -- B: wrong values from files are refused ---------------------------------------------


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("forward_seconds", -0.3, r"layers\[1\]\.forward_seconds: must be at least 0"),
        ("backward_seconds", math.nan, r"layers\[1\]\.backward_seconds: expected a finite"),
        ("output_bytes", -512, r"layers\[1\]\.output_bytes: must be at least 0"),
        ("param_bytes", math.inf, r"layers\[1\]\.param_bytes: expected an integer"),
    ],
)
def test_negative_or_non_finite_costs_are_refused(prof, field, value, match):
    data = prof.to_dict()
    data["layers"][1][field] = value
    with pytest.raises(ProfileError, match=match):
        Profile.from_json(json.dumps(data), "profile p.json")


@pytest.mark.parametrize(
    "edit,match",
    [
        (
            lambda d: d["schedule"].update(microbatches=0),
            r"schedule: microbatches must be an integer >= 1, got 0",
        ),
        (
            lambda d: d["schedule"].update(microbatches=-4),
            r"schedule: microbatches must be an integer >= 1, got -4",
        ),
        (lambda d: d["stages"][1].update(in_flight=-1), r"stages\[1\]\.in_flight"),
        (lambda d: d["stages"][0].update(replicas=0), r"stages\[0\]\.replicas"),
        (lambda d: d["stages"][0].update(devices=[]), r"stages\[0\]\.devices"),
        (lambda d: d["stages"][0].update(devices=[0, 0]), r"stages\[0\]\.devices.*twice"),
        (lambda d: d["stages"][1].update(devices=[2, 9]), r"device 9 is not one of"),
        (lambda d: d["stages"][1].update(first_layer=3), "contiguously"),
        (lambda d: d["stages"].reverse(), "contiguously"),
        (lambda d: d["stages"][1].update(last_layer=1), r"last_layer 1 is before"),
        (lambda d: d.update(time_per_microbatch=-0.3), "time_per_microbatch: must be at least"),
        (lambda d: d["topology"]["levels"][0].update(workers=0), r"levels\[0\]\.workers"),
        (lambda d: d.update(memory_limit=-1.0), "memory_limit"),
    ],
)
def test_wrong_plan_values_are_refused(plan, edit, match):
    data = plan.to_dict()
    edit(data)
    with pytest.raises(PlanError, match=match) as info:
        Plan.from_dict(data, "plan p.json")
    assert str(info.value).startswith("plan p.json")


def _cut(lines: list[str], keep: int) -> str:
    return "".join(lines[:keep])


def test_graph_txt_cut_at_a_line_boundary_is_refused(tmp_path):
    lines = _VGG_GRAPH.read_text().splitlines(keepends=True)
    nodes = sum(1 for line in lines if line.startswith("node"))
    path = tmp_path / "graph.txt"
    # Cut after the node lines (every edge lost), in the middle of the nodes, and in the
    # middle of the edges.
    for keep in (nodes, nodes // 2, nodes + (len(lines) - nodes) // 2):
        path.write_text(_cut(lines, keep))
        for read in (Profile.load, read_graph_txt):
            with pytest.raises(GraphFormatError, match=rf"{path}: node node\d+ .*not connected"):
                read(path)
    path.write_text("".join(lines))
    assert len(read_graph_txt(path).layers) == nodes  # the whole file reads


def test_plan_records_its_profile_and_refuses_another(prof, tmp_path):
    other = _profile(scale=7.0)  # another model: same layer count, other times
    assert len(other.layers) == len(prof.layers)
    assert other.content_hash() != prof.content_hash()
    made = plan_uniform(prof, Topology.flat(2, 1e9))
    assert made.profile_hash == prof.content_hash()
    made.check_profile(prof)
    with pytest.raises(PlanError, match=r"plan q\.json was made from another profile.*re-plan"):
        made.check_profile(other, plan_file="q.json", profile_file="other.json")
    # the hash survives the file, and the command that reads both files checks it
    plan_path, good, bad = tmp_path / "q.json", tmp_path / "good.json", tmp_path / "bad.json"
    made.save(plan_path)
    prof.save(good)
    other.save(bad)
    assert Plan.load(plan_path).profile_hash == made.profile_hash
    simulate_command.costs_from_files(str(plan_path), str(good))
    with pytest.raises(PlanError, match=rf"{plan_path}.*{bad}.*pdjax plan --profile {bad}"):
        simulate_command.costs_from_files(str(plan_path), str(bad))


def test_profile_hash_ignores_labels_and_round_trips(prof, tmp_path):
    assert Profile.from_json(prof.to_json()).content_hash() == prof.content_hash()
    # the same graph.txt read from two paths: meta["source"] differs, the hash does not
    copy_path = tmp_path / "graph.txt"
    copy_path.write_bytes(_VGG_GRAPH.read_bytes())
    assert read_graph_txt(copy_path).content_hash() == read_graph_txt(_VGG_GRAPH).content_hash()


def test_plans_without_a_hash_still_load_and_check(plan, prof):
    data = plan.to_dict()
    del data["profile_hash"]  # a plan file from before hashes
    old = Plan.from_dict(data)
    assert old.profile_hash is None
    old.check_profile(_profile(scale=3.0))  # nothing to compare: accepted


def test_plan_command_records_the_profile_hash(tmp_path):
    from pdjax.apps.cli import main

    out = tmp_path / "plan.json"
    assert main(["plan", "--profile", "pipedream:vgg16", "--workers", "2", "--out", str(out)]) == 0
    vgg = Profile.load("pipedream:vgg16")
    assert Plan.load(out).profile_hash == vgg.content_hash()
    # the planner records it too (build_plan), not only the command; with_profile_hash
    # stamps a copy with another profile's
    planned = plan_pipedream(vgg, Topology.flat(2, 1e9))
    assert planned.profile_hash == vgg.content_hash()
    other = Profile.load("pipedream:alexnet")
    assert planned.with_profile_hash(other).profile_hash == other.content_hash()
    assert planned.profile_hash == vgg.content_hash()  # a copy: the plan is unchanged


# -- C: output paths --------------------------------------------------------------------


def test_save_does_not_follow_a_symlink_planted_at_the_old_temp_name(plan, prof, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    for obj, name in ((prof, "p.json"), (plan, "plan.json")):
        out = tmp_path / name
        planted = tmp_path / (name + ".tmp")
        planted.symlink_to(victim)
        obj.save(out)
        assert victim.read_text() == "precious"
        assert planted.is_symlink() and not out.is_symlink()
        assert type(obj).load(out) == obj
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "p.json",
        "p.json.tmp",
        "plan.json",
        "plan.json.tmp",
        "victim.txt",
    ]


def test_saved_files_get_the_usual_permissions(plan, tmp_path):
    out = tmp_path / "plan.json"
    plan.save(out)
    mask = os.umask(0o022)
    os.umask(mask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~mask


def test_a_directory_or_an_uncreatable_parent_gives_a_one_line_error(plan, prof, tmp_path):
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("")
    for out in (tmp_path / "adir", tmp_path / "afile" / "sub" / "plan.json"):
        with pytest.raises(PlanError, match=rf"cannot write plan {out}") as info:
            plan.save(out)
        assert "\n" not in str(info.value)
        with pytest.raises(ProfileError, match=rf"cannot write profile {out}"):
            prof.save(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir", "afile"]
    assert not list((tmp_path / "adir").iterdir())


def test_a_read_only_directory_gives_an_error(plan, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with (
            unprivileged(),
            pytest.raises(PlanError, match=rf"cannot write plan {ro / 'plan.json'}"),
        ):
            plan.save(ro / "plan.json")
    finally:
        ro.chmod(0o700)
    assert not list(ro.iterdir())


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temp_file(plan, monkeypatch, tmp_path):
    out = tmp_path / "plan.json"
    out.write_text("old")

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(PlanError, match=rf"cannot write plan {out}: No space left"):
        plan.save(out)
    assert out.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]


def test_the_cli_reports_an_unwritable_output(tmp_path, capsys):
    from pdjax.apps.cli import main

    argv = ["plan", "--profile", "pipedream:vgg16", "--workers", "2", "--out", str(tmp_path)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"--out {tmp_path}: that is a folder" in err  # refused before planning
    assert "Traceback" not in err


# -- D: calibration files (pdjax calibrate's output, read by plan and simulate) -----------


def _calibration() -> Calibration:
    """A calibration of the 4-layer model on 3 devices with every field filled: stages (one
    replicated, with its all-reduce), links both ways with their points, an all-reduce fit."""
    points = {"sizes": (4096, 65536), "seconds": (1e-4, 6e-4)}
    links = tuple(
        LinkMeasure(a, b, latency=1e-4, bandwidth=1e8, send_seconds=2e-5, **points)
        for a in range(3)
        for b in range(3)
        if a != b
    )
    return Calibration(
        model={"layers": [f"l{i}" for i in range(4)], "param_bytes": [4096, 8192, 12288, 16384]},
        microbatch_size=4, devices=(0, 1, 2), platform="cpu", device_kind="cpu", optimizer="sgd",
        stages=(
            StageMeasure(0, 1, 2, "split", 0.01, 0.02, 0.004, allreduce=3e-4, rows=2),
            StageMeasure(2, 3, 1, "split", 0.03, 0.05, 0.002, rows=4),
            StageMeasure(0, 3, 1, "split", 0.04, 0.07, 0.006, rows=4),
        ),
        links=links,
        allreduces=(AllReduceMeasure((0, 1), 1e-4, 1e9, **points),),
        profile_ratio=2.0,
    )  # fmt: skip


_CALIBRATION_DICT = json.loads(json.dumps(_calibration().to_json()))
_CAL_PLAN = evaluate_partition(
    _profile(), Topology.flat(3, 1e9), [(0, 1, 2), (2, 3, 1)], schedule="1f1b", microbatch_size=4
)


@pytest.fixture(scope="module")
def cal_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("calibrations")


def _numbers(value: Any) -> list[Any]:
    """Every number in a JSON value."""
    if isinstance(value, dict):
        return [n for v in value.values() for n in _numbers(v)]
    if isinstance(value, list | tuple):
        return [n for v in value for n in _numbers(v)]
    return [value] if isinstance(value, int | float) and not isinstance(value, bool) else []


_BYTE_EDITS = st.tuples(
    st.integers(0, len(json.dumps(_CALIBRATION_DICT)) - 1),
    st.sampled_from([None, b"\xff", b"\x80", b'"', b"}", b"-", b"9", b"\x00", b"e9", b" "]),
)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.one_of(_mutations(_CALIBRATION_DICT), _BYTE_EDITS))
def test_mutated_calibration_gives_calibration_error_or_a_sound_calibration(cal_dir, mutation):
    """Every damaged calibration file is refused naming the file and what to do, or reads
    as a calibration whose numbers are finite and non-negative and that plan and simulate
    use without a raw exception; never another exception."""
    text = json.dumps(_CALIBRATION_DICT).encode()
    if isinstance(mutation, tuple):  # bytes: cut the file (None) or overwrite some
        at, new = mutation
        text = text[:at] if new is None else text[:at] + new + text[at + len(new) :]
    else:
        text = json.dumps(_apply(_CALIBRATION_DICT, mutation)).encode()
    path = cal_dir / "cal.json"
    path.write_bytes(text)
    try:
        cal = Calibration.load(path)
    except CalibrationError as e:
        assert str(e).startswith(f"calibration {path}") or str(e).startswith(f"{path}:"), e
        assert "pdjax calibrate" in str(e), e
        return
    numbers = _numbers(cal.to_json())
    assert all(math.isfinite(n) and n >= 0 for n in numbers), cal
    assert Calibration.from_json(json.loads(json.dumps(cal.to_json()))) == cal
    cal.stage_seconds("1f1b", 4)(0, 1, 2, "split")
    cal.allreduce_function()(4096.0, 2)
    try:
        costs_from_plan(_CAL_PLAN, _profile(), calibration=cal, partial=True)
    except PdjaxError as e:
        assert isinstance(e, CalibrationError | PlanError), e


@pytest.mark.parametrize(
    "path,value,match",
    [
        (("stages", 1, "forward"), -0.03, r"stages\[1\]\.forward: must be at least 0"),
        (("stages", 0, "backward"), -math.inf, r"stages\[0\]\.backward: expected a finite"),
        (("links", 2, "bandwidth"), 0, r"links\[2\]\.bandwidth: must be above 0"),
        (("links", 0, "latency"), "fast", r"links\[0\]\.latency: expected a number, got str"),
        (("microbatch_size",), 0, "microbatch_size: must be at least 1"),
        (("stages", 0, "replicas"), 1.5, r"stages\[0\]\.replicas: expected an integer"),
        (("model", "param_bytes", 0), "big", r"model\.param_bytes\[0\]: expected an integer"),
        (("stages", 2, "last"), 4, r"stages\[2\]\.last: layer 4 is past"),
        (("links", 0, "dst"), 7, r"links\[0\]\.dst: device 7 is not among"),
        (("stages", 2), _CALIBRATION_DICT["stages"][1], r"stages\[2\]: .*measured twice"),
        (("speed",), 1, r"top level: unknown fields \['speed'\]"),
        (("profile_ratio",), 0.0, "profile_ratio: must be above 0"),
        (("version",), True, "version true"),
    ],
)
def test_wrong_calibration_values_are_refused_naming_the_field(cal_dir, path, value, match):
    data = _mutate(_CALIBRATION_DICT, path, value)
    path = cal_dir / "wrong.json"
    path.write_text(json.dumps(data))
    with pytest.raises(CalibrationError, match=match) as info:
        Calibration.load(path)
    assert str(info.value).startswith(f"calibration {path}")
    assert str(info.value).endswith("re-create it with pdjax calibrate")


def test_a_calibration_that_is_not_utf8_names_the_file_and_line(cal_dir):
    path = cal_dir / "latin1.json"
    text = json.dumps(_CALIBRATION_DICT, indent=1).encode()
    path.write_bytes(text.replace(b'"cpu"', b'"c\xe9"', 1))  # Latin-1, not UTF-8
    with pytest.raises(
        CalibrationError, match=rf"{path}:\d+: calibration is not UTF-8.*pdjax calibrate"
    ):
        Calibration.load(path)


def test_a_real_calibration_file_reads_back_equal(cal_dir):
    cal = _calibration()
    assert Calibration.load(cal.save(cal_dir / "good.json")) == cal
    costs_from_plan(_CAL_PLAN, _profile(), calibration=cal)
