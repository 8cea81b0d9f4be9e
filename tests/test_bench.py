"""``pdjax bench``: every schedule and DP measured, next to the simulator's prediction."""

import io
import math
import os

import pytest
from rich.console import Console

from pdjax.apps.bench import BENCH_SCHEDULES, bench, format_table
from pdjax.apps.cli import main


@pytest.fixture(scope="module")
def result():
    return bench("mlp", devices=2, batch_size=8, microbatches=4, plan="even", steps=1, repeats=1)


def test_every_schedule_and_dp_has_positive_numbers(result):
    assert [r.name for r in result.rows] == [*BENCH_SCHEDULES, "dp"]
    for r in result.rows:
        assert r.error is None, (r.name, r.error)
        assert r.samples_per_second > 0 and r.predicted_samples_per_second > 0, r.name
        assert math.isfinite(r.ratio) and r.ratio > 0, r.name
        assert r.host_seconds_per_action > 0 and r.actions > 0, r.name
    assert result.row("1f1b").stages == "2 stages x1"
    assert result.row("dp").stages == "1 stage x2"
    # one optimizer step of 8 samples per repeat, whatever the schedule
    assert {r.samples for r in result.rows} == {8}
    # pipedream updates every microbatch at each of 2 stages: 4 x (F + B + U) x 2
    assert result.row("pipedream").actions == 24


def test_table_and_json_name_every_row(result):
    out = io.StringIO()
    Console(file=out, width=200).print(result.header(), format_table(result))
    text = out.getvalue()
    assert "thread pool" in text and "measured / predicted" in text
    for name in (*BENCH_SCHEDULES, "dp"):
        assert name in text
    data = result.to_dict()
    assert [r["name"] for r in data["rows"]] == [*BENCH_SCHEDULES, "dp"]
    assert all(r["ratio"] > 0 for r in data["rows"])


def test_a_schedule_that_cannot_run_gets_a_row_with_the_reason():
    # 2bw needs M >= P microbatches per step: 2 stages, M = 1
    r = bench(
        "mlp",
        devices=2,
        batch_size=2,
        microbatches=1,
        plan="even",
        steps=1,
        repeats=1,
        schedules=["2bw"],
    )
    (row,) = r.rows
    assert row.name == "2bw" and row.error and math.isnan(row.samples_per_second)


def test_cli_errors_exit_with_status_2(capsys):
    argv = ["bench", "--model", "mlp", "--devices", "2", "--batch-size", "6"]
    assert main([*argv, "--microbatches", "4"]) == 2
    assert "not a multiple of microbatches" in capsys.readouterr().err
    assert main([*argv, "--microbatches", "2", "--schedules", "1f1b,fast"]) == 2
    assert "unknown, repeated or no schedules" in capsys.readouterr().err


def test_shared_pool_prediction_is_the_work_over_the_pool_concurrency():
    """On in-process CPU devices the prediction is at least the devices' summed busy
    seconds over the measured concurrency of their shared pool; elsewhere the makespan."""
    import jax

    from pdjax.apps.bench import pool_concurrency, predicted_call_seconds
    from pdjax.models import get_model
    from pdjax.schedules import generate
    from pdjax.simulator import simulate, unit_costs

    spec = get_model("mlp", "tiny")
    c = pool_concurrency(spec, spec.sample_batch(8), jax.devices()[:2], rounds=4)
    assert 1.0 <= c <= max(2.0, float(len(os.sched_getaffinity(0))))
    assert pool_concurrency(spec, spec.sample_batch(8), jax.devices()[:1]) == 1.0
    sim = simulate(generate("1f1b", 4, 8), unit_costs(4))
    work = 8 * 4 * 3  # every microbatch: F = 1, B = 2 at each of 4 stages
    devs = jax.devices()[:4]
    assert predicted_call_seconds(sim, devs, 1.0) == pytest.approx(max(sim.makespan, work))
    assert predicted_call_seconds(sim, devs, 4.0) == pytest.approx(
        sim.makespan
    )  # the pipeline bound
    assert predicted_call_seconds(sim, devs[:1], 1.0) == sim.makespan
