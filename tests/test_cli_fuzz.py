"""The CLI's numeric options, fuzzed: every run succeeds, or exits 2 with one line on stderr
naming the option (argparse's own errors: a usage line, then ``error: argument --x``),
never a traceback, never a run that no bound stops (a hang guard), never output in a
half-made folder.

Cheap commands (plan on a small bundled profile, simulate on unit costs) run in-process
with any value; train, bench, profile and calibrate only with values refused before any
work starts."""

import contextlib
import json
import signal
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from pdjax.apps.cli import main

#: A hang guard, not a speed check: the bounds keep a valid run to seconds (the largest
#: simulate takes about 30 s on a busy 2-core machine); a run past this is one no bound
#: stopped.
TIMEOUT = 600

#: No deadline (a run's time is bounded by TIMEOUT); no "explain" phase, whose tracing
#: slows a failing run many times over.
FUZZ = dict(
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
)

SPECIAL = [
    "0", "-1", "-5", "nan", "NaN", "inf", "-inf", "1e308", "-1e308", "1e3", "2.5", "abc",
    "", " ", "99999999999999999999", "9" * 5000, "0x10", "1_000",
]  # fmt: skip

values = st.one_of(
    st.sampled_from(SPECIAL),
    st.integers(-(10**3), 10**3).map(str),
    st.integers(-(2**70), 2**70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
)
#: Values no bounded option of train, bench, profile or calibrate accepts.
REFUSED = st.one_of(
    st.sampled_from(["-1", "-5", "nan", "inf", "-inf", "abc", "", "9" * 5000]),
    st.integers(-(2**70), -1).map(str),
    st.integers(2**40, 2**70).map(str),
    st.sampled_from(["nan", "inf", "-inf"]),
)
REFUSED_LR = st.one_of(
    st.sampled_from(["0", "-1", "nan", "inf", "-inf", "abc", ""]),
    st.floats(max_value=0.0).map(repr),
)


@contextlib.contextmanager
def time_limit(seconds: int):
    def fail(*_):
        raise TimeoutError(f"a CLI run took more than {seconds} s")

    old = signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@contextlib.contextmanager
def fresh_dir():
    """A new empty folder per hypothesis example (``tmp_path`` is shared by them)."""
    with tempfile.TemporaryDirectory() as d:
        yield Path(d)


def run_cli(argv, capsys):
    """``main(argv)``'s exit status and stderr; SystemExit (argparse) counts as a status."""
    capsys.readouterr()
    with time_limit(TIMEOUT):
        try:
            rc = main(argv)
        except SystemExit as e:
            rc = e.code
    captured = capsys.readouterr()
    run_cli.out = captured.out  # the last run's stdout
    return rc, captured.err


def check_outcome(rc, err, option, *, refused=False):
    assert "Traceback" not in err
    assert rc in ((2,) if refused else (0, 2)), (rc, err)
    if rc == 2:
        lines = err.strip().splitlines()
        assert lines, "exit 2 without a message"
        if lines[-1].startswith("pdjax ") and ": error: argument " not in lines[-1]:
            assert len(lines) == 1, err  # pdjax's own errors: one line
        assert ": error: " in lines[-1], err
        if refused or option in lines[-1]:
            assert option in lines[-1], err
        else:  # a value in bounds the library refuses says so in the option's words
            words = [w for w in option.strip("-").split("-") if len(w) > 3]
            assert any(w in lines[-1].lower() for w in words), err


PLAN = ["plan", "--profile", "pipedream:alexnet", "--workers", "2"]
PLAN_OPTIONS = [
    ("--workers", []),
    ("--stages", ["--partitioner", "uniform"]),
    ("--memory-limit", []),
    ("--microbatches", []),
    ("--microbatch-size", []),
    ("--optimizer-state-factor", []),
    ("--bandwidths", []),
]


@pytest.mark.parametrize(("option", "extra"), PLAN_OPTIONS)
@settings(max_examples=12, **FUZZ)
@given(value=values)
def test_plan_numeric_options(option, extra, value, capsys):
    argv = [a for a in PLAN if option != "--workers" or a not in ("--workers", "2")]
    with fresh_dir() as d:
        out = d / "new" / "plan.json"
        rc, err = run_cli([*argv, *extra, option, value, "--out", str(out)], capsys)
        check_outcome(rc, err, option)
        if rc == 2:
            assert not out.exists() and not out.parent.exists()


@settings(max_examples=10, **FUZZ)
@given(value=values)
def test_plan_auto_batch_size(value, capsys):
    argv = [*PLAN, "--schedule", "auto", "--batch-size", value]
    check_outcome(*run_cli(argv, capsys), "--batch-size")


SIMULATE = ["simulate", "--unit-costs", "1,1,1", "--stages", "2", "--microbatches", "2"]
SIMULATE_OPTIONS = ["--stages", "--microbatches", "--steps", "--chunks", "--stream"]


@pytest.mark.parametrize("option", SIMULATE_OPTIONS)
@settings(max_examples=12, **FUZZ)
@given(value=values, schedule=st.sampled_from(["1f1b", "interleaved", "pipedream", "all"]))
def test_simulate_numeric_options(option, value, schedule, capsys):
    with fresh_dir() as d:
        # in a folder that exists: this test is about the numbers; a trace into folders
        # not made yet is test_output_paths_are_checked_before_any_work's
        out = d / "trace.json"
        argv = [*SIMULATE, "--schedule", schedule, option, value, "--trace", str(out)]
        rc, err = run_cli(argv, capsys)
        check_outcome(rc, err, option)
        if rc == 2:
            assert not out.exists()


@settings(max_examples=15, **FUZZ)
@given(costs=st.lists(values, min_size=1, max_size=4).map(",".join))
def test_simulate_unit_costs(costs, capsys):
    argv = ["simulate", "--unit-costs", costs, "--stages", "2", "--microbatches", "2"]
    check_outcome(*run_cli(argv, capsys), "--unit-costs")


REFUSED_ONLY = [
    (["train"], o)
    for o in (
        "--devices", "--epochs", "--batch-size", "--microbatches", "--chunks", "--lr", "--seed",
        "--target-accuracy", "--extra-in-flight", "--seq-len", "--num-processes",
        "--process-id", "--local-processes",
    )
] + [
    (["bench"], o)
    for o in (
        "--devices", "--batch-size", "--microbatches", "--chunks", "--steps", "--repeats",
        "--seed",
    )
] + [
    (["bench", "--cluster"], o) for o in ("--fast-rate", "--repeats", "--seed")
] + [
    (["profile", "--model", "mlp"], o)
    for o in ("--batch-size", "--efficiency", "--repeats", "--seed")
] + [
    (["calibrate", "--model", "mlp", "--refine", "--out", "c.json"], o)
    for o in ("--microbatch-size", "--lr", "--devices", "--microbatches", "--repeats", "--seed")
]  # fmt: skip


@pytest.mark.parametrize(("base", "option"), REFUSED_ONLY)
@settings(max_examples=8, **FUZZ)
@given(data=st.data())
def test_expensive_commands_refuse_bad_values_up_front(base, option, data, capsys):
    value = data.draw(REFUSED if option != "--lr" else REFUSED_LR)  # any lr > 0 is valid
    with fresh_dir() as d:
        out = d / "new"
        argv = [*base, option, value]
        if base[0] == "calibrate" and option != "--microbatch-size":
            argv += ["--microbatch-size", "2"]
        if base[0] in ("train", "bench"):
            argv += ["--out", str(out)]
        rc, err = run_cli(argv, capsys)
        check_outcome(rc, err, option, refused=True)
        assert not out.exists()


# -- the tester's cases, each refused with the bound and why, before any work ---------------


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        ([*PLAN[:3], "--workers", "4000"], ["--workers", "<= 512", "O(L^2 W^2)"]),
        ([*PLAN[:3], "--workers", "999999999"], ["--workers", "<= 512"]),
        ([*PLAN[:3], "--levels", "100x100"], ["--levels", "10,000", "512"]),
        (
            ["plan", "--profile", "pipedream:densenet121", "--workers", "256"],
            ["--workers (L^2 W^2)", "429 layers on 256 devices"],
        ),
        ([*PLAN[:3], "--workers", "64", "--schedule", "auto"], ["--workers", "32"]),
        ([*PLAN, "--bandwidths", "-5"], ["--bandwidths", "must be a positive finite number"]),
        ([*PLAN, "--bandwidths", "nan"], ["--bandwidths", "must be a positive finite number"]),
        ([*PLAN, "--memory-limit", "inf"], ["--memory-limit", "finite"]),
        (
            [*SIMULATE[:5], "--microbatches", "100000000"],
            ["--microbatches", "<= 100000"],
        ),
        (
            [*SIMULATE[:5], "--microbatches", "60000"],
            ["--microbatches x --steps x --stages", "120,000", "100,000"],
        ),
        (
            [*SIMULATE[:5], "--schedule", "interleaved", "--chunks", "50000"],
            ["--chunks", "<= 256"],
        ),
        ([*SIMULATE[:3], "--stages", "99999999999"], ["--stages", "<= 512"]),
        (
            [*SIMULATE[:5], "--schedule", "interleaved", "--microbatches", "30000"],
            ["--microbatches x --steps x --stages x --chunks", "120,000", "100,000"],
        ),
        ([*SIMULATE[:1], "--unit-costs", "inf,1,1", "--stages", "2"], ["--unit-costs"]),
        (["train", "--devices", "100000"], ["--devices", "<= 512", "jax_num_cpu_devices"]),
        (["bench", "--devices", "100000"], ["--devices", "<= 512"]),
        (["bench", "--cluster", "--rates", "-5"], ["--rates", "must be a positive finite number"]),
        (["bench", "--cluster", "--rates", "100,nan"], ["--rates", "'nan'"]),
        (["bench", "--cluster", "--fast-rate", "inf"], ["--fast-rate", "finite"]),
        (["train", "--lr", "nan"], ["--lr", "> 0"]),
        (["train", "--target-accuracy", "1.5"], ["--target-accuracy", "<= 1"]),
        (["train", "--seed", "-1"], ["--seed", ">= 0", "32-bit"]),
        (["profile", "--model", "mlp", "--batch-size", "10000000"], ["--batch-size", "4096"]),
    ],
)
def test_unbounded_work_is_refused_with_the_bound(argv, words, capsys, tmp_path):
    rc, err = run_cli([*argv, *(["--out", str(tmp_path / "o")] if argv[0] == "train" else [])],
                      capsys)  # fmt: skip
    assert rc == 2, err
    assert len(err.strip().splitlines()) == 1 and err.startswith(f"pdjax {argv[0]}: error: ")
    for word in words:
        assert word in err, (word, err)
    assert not (tmp_path / "o").exists()


def test_several_schedules_share_the_bound(capsys):
    """--schedule all: the passes of every schedule count together; those past the bound
    are rows saying why, and the run stays short."""
    argv = [*SIMULATE[:5], "--schedule", "all", "--microbatches", "30000", "--json"]
    rc, err = run_cli(argv, capsys)
    assert rc == 0, err
    rows = {r["name"]: r for r in json.loads(run_cli.out)["schedules"]}
    assert "error" not in rows["gpipe"]  # 60,000 passes
    assert "60,000 by the schedules before it" in rows["1f1b"]["error"]


def test_sizes_below_the_bounds_still_run(capsys):
    """The bounds refuse what cannot finish, not ordinary sizes."""
    rc, err = run_cli([*SIMULATE[:5], "--microbatches", "2000", "--json"], capsys)
    assert rc == 0, err
    rc, err = run_cli([*PLAN[:3], "--levels", "4x4", "--bandwidths", "1e10,1.25e9"], capsys)
    assert rc == 0, err


def test_output_paths_are_checked_before_any_work(tmp_path, capsys):
    from pdjax.apps.cli import main

    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    unit = ["simulate", "--unit-costs", "1,1,1", "--stages", "2", "--schedule", "1f1b"]
    for argv, option in [
        ([*unit, "--trace", str(tmp_path)], "--trace"),
        ([*unit, "--png", str(blocker / "g.png")], "--png"),
        ([*unit, "--write-csv", str(blocker / "x" / "s.csv")], "--write-csv"),
        (
            ["plan", "--profile", "pipedream:vgg16", "--workers", "2", "--out", str(tmp_path)],
            "--out",
        ),
    ]:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert option in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    # a folder that does not exist yet is made
    trace = tmp_path / "new" / "deeper" / "t.json"
    assert main([*unit, "--trace", str(trace)]) == 0
    assert trace.is_file()
