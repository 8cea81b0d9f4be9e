"""The Plan: JSON round trip, rendering, validation; and the ``pdjax plan`` command."""

from __future__ import annotations

import dataclasses
import json

import pytest
from cli_helpers import run_command

from pdjax.errors import GraphFormatError, PdjaxError, PlanError
from pdjax.partition import Plan, StagePlan, Topology, plan_pipedream, plan_uniform
from pdjax.profile import Profile


@pytest.fixture(scope="module")
def vgg() -> Profile:
    return Profile.load("pipedream:vgg16")


@pytest.fixture(scope="module")
def plans(vgg) -> list[Plan]:
    return [
        plan_pipedream(vgg, Topology.flat(4, 1.25e9), cost_model="pipedream-code"),
        plan_pipedream(vgg, Topology.preset("cluster-a"), schedule="1f1b", memory_limit=1.6e10),
        plan_pipedream(vgg, Topology.from_devices(), straight=True, fewer_machines=True),
        plan_uniform(vgg, Topology.flat(3, 1e9), cost_model="paper", microbatch_size=32),
    ]


def test_json_round_trip_is_exact(plans, tmp_path):
    for i, plan in enumerate(plans):
        again = Plan.from_json(plan.to_json())
        assert again == plan
        assert again.to_json() == plan.to_json()
        path = tmp_path / f"p{i}" / "plan.json"
        plan.save(path)
        assert Plan.load(path) == plan
        assert not path.with_name("plan.json.tmp").exists()


def test_json_fields(plans):
    data = json.loads(plans[0].to_json())
    assert data["format"] == "pdjax.plan/2"
    assert data["config"] == "3-1"
    assert data["cost_model"] == "pipedream-code" and data["schedule"]["kind"] == "pipedream"
    assert data["schedule"] == plans[0].schedule.to_dict()
    assert data["schedule"]["microbatches"] == plans[0].num_microbatches
    assert "num_microbatches" not in data
    assert data["noam"] == 2
    assert data["stages"][0] == {
        "first_layer": 0,
        "last_layer": 17,
        "replicas": 3,
        "devices": [0, 1, 2],
        "in_flight": 2,
        "compute_seconds": plans[0].stages[0].compute_seconds,
        "memory_bytes": plans[0].stages[0].memory_bytes,
        "replication": "split",
    }
    for key in (
        "time_per_microbatch",
        "single_device_time",
        "data_parallel_time",
        "speedup_over_single_device",
        "speedup_over_data_parallel",
        "topology",
        "options",
        "memory_limit",
        "microbatch_size",
    ):
        assert key in data
    assert data["topology"]["levels"][0] == {
        "workers": 4,
        "bandwidth": 1.25e9,
        "name": "",
        "latency": 0.0,
    }


def test_describe(plans):
    text = plans[0].describe()
    first = text.splitlines()[0]
    assert first == "3-1: stage 0 = layers 0-17 x3, stage 1 = layers 18-40 x1"
    assert str(plans[0]) == text
    assert "NOAM 2" in text and "speedup" in text and "pipedream-code" in text
    assert plans[0].stage_of_layer(17) == 0 and plans[0].stage_of_layer(18) == 1
    with pytest.raises(PlanError):
        plans[0].stage_of_layer(41)


def test_derived_values(plans):
    plan = plans[0]
    assert plan.num_stages == 2 and plan.num_devices == 4 and plan.replicas == (3, 1)
    assert plan.speedup_over_single_device == pytest.approx(
        plan.single_device_time / plan.time_per_microbatch
    )
    assert plan.speedup_over_data_parallel == pytest.approx(
        plan.data_parallel_time / plan.time_per_microbatch
    )
    assert plan.stages[0].layers == range(0, 18) and plan.stages[0].num_layers == 18
    assert plans[1].memory_limit == 1.6e10 and plans[1].fits_memory


def test_plan_validation(plans):
    plan = plans[0]
    s0, s1 = plan.stages
    with pytest.raises(PlanError, match="contiguously"):
        dataclasses.replace(plan, stages=(s0, dataclasses.replace(s1, first_layer=19)))
    with pytest.raises(PlanError, match="hold two stages"):
        dataclasses.replace(plan, stages=(s0, dataclasses.replace(s1, devices=(2,))))
    with pytest.raises(PlanError, match="not 40"):
        dataclasses.replace(plan, stages=(s0, dataclasses.replace(s1, last_layer=39)))
    with pytest.raises(PlanError, match="no devices"):
        StagePlan(0, 1, (), in_flight=1, compute_seconds=0.0, memory_bytes=0.0)
    with pytest.raises(PlanError, match="not a pdjax plan"):
        Plan.from_json('{"format": "other"}')
    data = json.loads(plan.to_json())
    del data["noam"]
    with pytest.raises(PlanError, match="noam"):
        Plan.from_dict(data)


def test_over_the_limit_is_shown(vgg):
    plan = plan_uniform(vgg, Topology.flat(2, 1e9, memory_per_device=1e9))
    assert not plan.fits_memory
    assert "EXCEEDS" in plan.describe()


# -- the command ----------------------------------------------------------------------


def test_cli_workers_json(capsys, tmp_path):
    out = tmp_path / "plan.json"
    argv = ["--profile", "pipedream:vgg16", "--workers", "8", "--bandwidths", "1.25e9"]
    argv += ["--cost-model", "pipedream-code", "--json", "--out", str(out)]
    assert run_command("plan", *argv) == 0
    printed = Plan.from_json(capsys.readouterr().out)
    assert printed.config == "7-1"
    assert Plan.load(out) == printed


def test_cli_levels_human(capsys):
    argv = ["--profile", "pipedream:vgg16", "--levels", "4x4", "--bandwidths", "1e10,1.25e9"]
    assert run_command("plan", *argv, "--cost-model", "paper", "--schedule", "1f1b") == 0
    text = capsys.readouterr().out
    assert "12-2-1-1" in text and "stage 0 = layers 0-31 x12" in text and "1f1b" in text


def test_cli_graph_txt_and_options(capsys, tmp_path):
    graph = tmp_path / "graph.txt"
    graph.write_text(
        "node1 -- Input -- forward_compute_time=0.0, backward_compute_time=0.0, "
        "activation_size=100.0, parameter_size=0.0\n"
        "node2 -- Linear -- forward_compute_time=2.0, backward_compute_time=4.0, "
        "activation_size=10.0, parameter_size=400.0\n"
        "node3 -- Linear -- forward_compute_time=1.0, backward_compute_time=2.0, "
        "activation_size=10.0, parameter_size=400.0\n"
        "\tnode1 -- node2\n\tnode2 -- node3\n"
    )
    argv = ["--profile", str(graph), "--workers", "4", "--straight", "--fewer-machines"]
    assert run_command("plan", *argv, "--json") == 0
    plan = Plan.from_json(capsys.readouterr().out)
    assert plan.config == "1-1" and plan.options["straight"] and plan.options["fewer_machines"]
    argv = ["--profile", str(graph), "--workers", "2", "--partitioner", "uniform", "--stages", "2"]
    assert run_command("plan", *argv, "--json", "--microbatch-size", "1") == 0
    assert Plan.from_json(capsys.readouterr().out).partitioner == "uniform"


def test_cli_preset(capsys):
    assert (
        run_command("plan", "--profile", "pipedream:vgg16", "--preset", "cluster-a", "--json") == 0
    )
    assert Plan.from_json(capsys.readouterr().out).topology.name == "cluster-a"


@pytest.mark.parametrize(
    "argv,error,match",
    [
        (["--workers", "4", "--bandwidths", "0"], PlanError, "bandwidth must be a positive"),
        (["--workers", "4", "--bandwidths=-1e9"], PlanError, "bandwidth must be a positive"),
        (["--levels", "4x4", "--bandwidths", "1e10"], PlanError, "1 values for 2 level"),
        (["--levels", "4x4", "--bandwidths", "1e10,x"], PlanError, "comma-separated"),
        (["--levels", "4y4"], PlanError, "innermost first"),
        (["--workers", "4", "--memory-limit", "1e6"], PlanError, "smallest limit that works"),
        (["--workers", "64", "--straight"], PlanError, "needs 64 stages"),
        (["--preset", "cluster-a", "--bandwidths", "1e9"], PlanError, "drop --bandwidths"),
        (["--workers", "4", "--stages", "2"], PlanError, "simpler partitioners"),
        (
            ["--workers", "4", "--partitioner", "uniform", "--stages", "9"],
            PlanError,
            "9 stages x 1 replicas need 9 devices",
        ),
    ],
)
def test_cli_bad_input(argv, error, match):
    with pytest.raises(error, match=match):
        run_command("plan", "--profile", "pipedream:vgg16", *argv)


def test_cli_malformed_graph_txt_names_file_and_line(tmp_path):
    graph = tmp_path / "graph.txt"
    graph.write_text(
        "node1 -- Input -- forward_compute_time=0.0, backward_compute_time=0.0, "
        "activation_size=100.0, parameter_size=0.0\n"
        "node2 -- Linear -- forward_compute_time=two\n"
    )
    with pytest.raises(GraphFormatError, match=rf"{graph}:2: not a node line"):
        run_command("plan", "--profile", str(graph), "--workers", "2")


def test_cli_main_reports_errors(capsys):
    from pdjax.apps.cli import main

    assert main(["plan", "--profile", "pipedream:vgg16", "--workers", "0"]) == 2
    assert "--workers must be >= 1" in capsys.readouterr().err
    assert issubclass(PlanError, PdjaxError)
