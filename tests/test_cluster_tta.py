"""Time to accuracy on the cluster (benchmarks.harness.cluster_tta): real training runs in 2 worker
processes (loopback here: link emulation needs root and is exercised by the benchmark),
resumed from the results already saved, and the report's arithmetic."""

import json
import math

import pytest

from benchmarks.harness import cluster_tta
from benchmarks.harness.cluster import ClusterError
from benchmarks.harness.cluster_tta import TTAStudy, markdown, report, run_tta, summarize

# a small model on flattened digits; one epoch, so the runs are short
STUDY = TTAStudy(
    name="mlp-digits",
    dataset="digits",
    batch_size=64,
    learning_rate=3e-3,
    epochs=1,
    target=0.99,
    why="out of reach in one epoch",
)


def test_runs_train_in_two_processes_and_a_rerun_resumes(tmp_path, monkeypatch):
    """One worker and a 2-process 1f1b pipeline train the same sequential recurrence from
    the same weights and data order, so they end at the same test accuracy; every result
    is saved; a rerun launches nothing. (Data parallelism over processes trains like one
    process in tests/test_multiprocess.py and runs in tests/test_cluster.py; here it would
    add two worker launches and nothing else to check.)"""
    out = tmp_path / "tta"
    results = run_tta(out, studies=[STUDY], seeds=(0,), runners=("single", "1f1b"), emulate=False)
    by_runner = {r["runner"]: r for r in results}
    assert set(by_runner) == {"single", "1f1b"}
    for r in results:
        assert not r.get("error"), r.get("error")
        assert r["stopped"] == "epochs" and r["time_to_target"] is None
        assert len(r["history"]) == 1 and r["history"][0]["samples_per_second"] > 0
        assert r["predicted_seconds_per_sample"] > 0
    acc = {name: r["history"][0]["test_accuracy"] for name, r in by_runner.items()}
    assert acc["single"] > 0.5, acc  # it learned
    # the same recurrence, rounded differently: at most one of the 359 test images
    # may flip
    assert abs(acc["1f1b"] - acc["single"]) <= 1 / 359 + 1e-9, acc
    assert by_runner["1f1b"]["stages"].count("/") == 1  # a 2-stage pipeline
    assert (out / "mlp-digits" / "none" / "plan-1f1b.json").is_file()

    def no_launch(*args, **kwargs):
        raise AssertionError("a rerun launched workers again")

    monkeypatch.setattr("benchmarks.harness.cluster.launch", no_launch)
    monkeypatch.setattr("benchmarks.harness.cluster.profile_on_workers", no_launch)
    again = run_tta(out, studies=[STUDY], seeds=(0,), runners=("single", "1f1b"), emulate=False)
    assert again == results
    paths = report(out)
    text = (out / "tta.md").read_text()
    assert "| loopback | single | 1 worker, no link |" in text and "| loopback | 1f1b |" in text
    assert json.loads((out / "tta.json").read_text())[0]["study"] == "mlp-digits"
    assert len(paths) >= 2


def test_unknown_studies_and_runners_are_refused_before_any_work(tmp_path):
    with pytest.raises(ClusterError, match=r"unknown \['nope', 'gpipe'\]"):
        run_tta(tmp_path / "x", studies=["nope"], runners=("gpipe",), emulate=False)
    assert not (tmp_path / "x").exists()


def _result(runner, seed, tta, sps, link=100.0, pred=1.0, acc=0.96, error=None):
    epochs = [
        {"epoch": 1, "test_accuracy": acc, "seconds": 10.0, "samples_per_second": sps,
         "elapsed": 10.0}
    ]  # fmt: skip
    return {
        "study": "s",
        "settings": {"name": "s", "dataset": "digits", "batch_size": 128,
                     "learning_rate": 1e-3, "epochs": 5, "target": 0.95, "why": "w"},
        "runner": runner,
        "link_mbit": None if runner in ("single", "single-mb") else link,
        "seed": seed,
        "stages": "1 worker" if runner.startswith("single") else "0-3 / 4-7",
        "time_to_target": tta,
        "target_epoch": None if tta is None else 1,
        "history": [] if error else epochs,
        "predicted_seconds_per_sample": pred,
        "error": error,
    }  # fmt: skip


def test_the_summary_divides_what_it_says():
    results = [
        _result("single", 0, 20.0, 100.0, pred=2.0),
        _result("single-mb", 0, 5.0, 80.0, pred=2.5),
        _result("dp", 0, 40.0, 50.0, pred=4.0),
        _result("pipedream", 0, 10.0, 200.0, pred=1.0),
        _result("2bw", 0, None, 150.0, acc=0.9),
        _result("1f1b", 0, None, math.nan, error="worker 1 failed (exit 1):\nValueError: x"),
    ]
    rows = {r["runner"]: r for r in summarize(results)}
    assert list(rows) == ["single", "single-mb", "dp", "pipedream", "1f1b", "2bw"]
    p = rows["pipedream"]
    assert p["speedup_vs_dp"] == [4.0] and p["speedup_vs_single"] == [2.0]
    assert p["throughput_vs_dp"] == [4.0]
    assert p["predicted_throughput_vs_dp"] == 4.0 and p["predicted_throughput_vs_single"] == 2.0
    assert rows["2bw"]["speedup_vs_dp"] == [None] and rows["2bw"]["accuracy_at_stop"] == [0.9]
    assert rows["single"]["speedup_vs_dp"] == [2.0]
    assert rows["single-mb"]["speedup_vs_single"] == [4.0]  # one worker, per-microbatch updates
    assert "| 100 Mbit/s | single-mb | 1 worker, no link | 5.0 |" in markdown(list(rows.values()))
    text = markdown(list(rows.values()))
    assert "| 100 Mbit/s | pipedream | 0-3 / 4-7 | 10.0 | 1 | 200 | **4.00** | 2.00 |" in text
    assert "| 100 Mbit/s | 2bw | 0-3 / 4-7 | - | - | 150 | **-** |" in text
    assert "* 1f1b at 100 Mbit/s: ValueError: x" in text  # a failed run says why


def test_link_names():
    assert [cluster_tta.link_key(r) for r in (100.0, 1000.0, 10000.0, 2500.0, None)] == [
        "100M", "1G", "10G", "2500M", "none"
    ]  # fmt: skip


def test_a_pipeline_plan_that_is_not_two_stages_on_two_workers_is_refused():
    """A pipeline runner on a plan of one stage (or one worker) would be reported as a
    2-stage pipeline: the benchmark refuses it, naming where."""
    from pdjax.partition import Topology, evaluate_partition
    from pdjax.profile import LayerProfile, Profile

    layers = [LayerProfile(f"l{i}", forward_seconds=1e-3, backward_seconds=2e-3,
                           output_bytes=10) for i in range(4)]  # fmt: skip
    prof = Profile.chain(layers, batch_size=8)

    def plan(stages):
        return evaluate_partition(prof, Topology.flat(2, 1e9), stages, schedule="1f1b",
                                  num_microbatches=4, partitioner="manual")  # fmt: skip

    two = plan([(0, 1, 1), (2, 3, 1)])
    assert cluster_tta.two_stages(two, "here") is two
    for stages in ([(0, 3, 1)], [(0, 3, 2)]):
        with pytest.raises(ClusterError, match=r"^s on 100 Mbit/s, 1f1b: the planner's plan"):
            cluster_tta.two_stages(plan(stages), "s on 100 Mbit/s, 1f1b")
