"""The CLI's numeric options, fuzzed: every run succeeds, or exits 2 with one line on stderr
naming the option (argparse's own errors: a usage line, then ``error: argument --x``),
never a traceback, never a run that no bound stops (a hang guard), never output in a
half-made folder.

Cheap commands (plan on a small bundled profile, simulate on unit costs) run in-process
with any value; train, bench, profile and calibrate only with values refused before any
work starts."""

import argparse
import contextlib
import ctypes
import functools
import json
import os
import signal
import stat
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
def time_limit(seconds: int, error: BaseException | None = None):
    """Raises ``error`` (default: a TimeoutError) in the block if it runs past ``seconds``."""

    def fail(*_):
        raise error or TimeoutError(f"a CLI run took more than {seconds} s")

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


# -- every option of every command: prefixes, empty strings and hostile paths (issue 33) ----
#
# Each example runs in a fresh folder (also the current one) holding a file, a read-only
# folder, a link to a file elsewhere and a link to nothing; a path option gets an empty or
# blank path, a new file, the folder, the file, a path under the file, either link, a file
# in the read-only folder (run without CAP_DAC_OVERRIDE when the tests run as root, where a
# folder's permissions would not stop a write: see ``unprivileged``), a NUL character, a
# name too long or one that cannot be encoded. Every
# run exits 0, or 2 with one line naming the option or the path (or argparse's usage and
# error line); nothing outside the command's outputs is written or deleted, and nothing at
# all when it is refused. Expensive commands (profile, calibrate, train, bench) get only
# what is refused before any work.

#: Options that name a file or folder the command writes.
OUTPUTS = {"--out", "--trace", "--png", "--write-csv", "--plan-out", "--checkpoint-dir",
           "--tensorboard"}  # fmt: skip
KINDS = ("empty", "blank", "new", "folder", "file", "under-file", "symlink", "dangling",
         "read-only", "nul", "long", "unencodable")  # fmt: skip
#: The kinds refused before any work, for an output and for an input of an expensive
#: command (a folder output may be the fresh folder itself, or a new one: a run).
REFUSED_OUTPUT = frozenset(KINDS) - {"new", "file", "folder"}
REFUSED_FOLDER = frozenset(KINDS) - {"new", "folder"}
REFUSED_INPUT = frozenset(KINDS) - {"file", "symlink"}


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]  # fmt: skip


#: Linux's capability interface of 64-bit sets (two ``_CapData``); CAP_DAC_OVERRIDE is
#: the capability that lets root write where a folder's mode bits say no.
_CAPABILITY_VERSION_3 = 0x20080522
_CAP_DAC_OVERRIDE = 1


def _capabilities(set_to: "ctypes.Array[_CapData] | None" = None) -> "ctypes.Array[_CapData]":
    """This thread's capability sets (``capget``), or sets them (``capset``); OSError where
    the system has no such calls (not Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        call = libc.capset if set_to is not None else libc.capget
    except (OSError, AttributeError) as e:
        raise OSError(f"no capget/capset here: {e}") from e
    header = _CapHeader(_CAPABILITY_VERSION_3, 0)  # pid 0: the calling thread
    data = set_to if set_to is not None else (_CapData * 2)()
    if call(ctypes.byref(header), data) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return data


@contextlib.contextmanager
def unprivileged(enabled: bool = True):
    """Runs the block so that a folder's mode bits deny writing when this process runs as
    root (as CI does) and ``enabled``: CAP_DAC_OVERRIDE leaves the calling thread's
    effective capabilities (it stays permitted, and is put back after). Only writing is
    concerned: root keeps its ids, so it still owns, and may write, what it made (the
    tests' folders, the compilation cache), and keeps CAP_DAC_READ_SEARCH, so it reads and
    enters any folder, wherever the checkout, the virtual environment or the data live
    (a 0700 folder of another user included). (``os.access`` answers with the real id's
    permitted capabilities, and still says yes: pdjax checks by writing.)

    Capabilities belong to a thread: the in-process command runs on this one, and threads
    it starts inherit the sets it has then. Skips where root cannot drop the capability
    (a system without Linux capabilities)."""
    if not enabled or os.geteuid() != 0:
        yield
        return
    try:
        saved = _capabilities()
    except OSError as e:
        pytest.skip(f"cannot drop CAP_DAC_OVERRIDE ({e}): a read-only folder does not stop root")
    dropped = (_CapData * 2)()
    ctypes.memmove(dropped, saved, ctypes.sizeof(saved))
    dropped[0].effective &= ~(1 << _CAP_DAC_OVERRIDE)
    _capabilities(dropped)
    try:
        yield
    finally:
        _capabilities(saved)


def test_unprivileged_makes_only_a_read_only_folder_unwritable(tmp_path):
    """Inside ``unprivileged``, what a command needs stays readable wherever it lives (a
    0700 folder, as ``mktemp -d`` makes, of root's or, when root, of another user's), a
    folder of its own stays writable, and only a read-only folder refuses a new file;
    afterwards, root writes there again (issue 44: a clone in a 0700 folder)."""
    private, ro = tmp_path / "private", tmp_path / "ro"
    private.mkdir(mode=0o700)
    (private / "data.txt").write_text("mine")
    (tmp_path / "own").mkdir()
    ro.mkdir()
    os.chmod(ro, 0o555)
    os.chmod(tmp_path, 0o700)
    if os.geteuid() == 0:  # another user's: root reads it only with CAP_DAC_READ_SEARCH
        os.chown(private / "data.txt", 65534, 65534)
        os.chown(private, 65534, 65534)
    try:
        with unprivileged():
            assert (private / "data.txt").read_text() == "mine"
            (tmp_path / "own" / "new.txt").write_text("x")
            with pytest.raises(PermissionError):
                tempfile.mkstemp(dir=ro)
            with pytest.raises(PermissionError):
                (ro / "new.txt").write_text("x")
        if os.geteuid() == 0:
            (ro / "new.txt").write_text("x")  # put back: root's permissions again
            (ro / "new.txt").unlink()
    finally:
        os.chmod(ro, 0o755)


@contextlib.contextmanager
def hostile_dir():
    """A fresh folder per example (the current folder meanwhile), with the hostile paths
    and a plan of PLAN in ``inputs/``; only ``ro/`` is read-only."""
    with fresh_dir() as d, contextlib.chdir(d):
        (d / "file.txt").write_text("x")
        (d / "outside").mkdir()
        (d / "outside" / "target.json").write_text("{}")
        (d / "link").symlink_to(d / "outside" / "target.json")
        (d / "dangling").symlink_to(d / "outside" / "none.json")
        (d / "inputs").mkdir()
        (d / "inputs" / "plan.json").write_text(_plan_json())
        (d / "ro").mkdir()
        os.chmod(d / "ro", 0o555)
        try:
            yield d
        finally:
            os.chmod(d / "ro", 0o755)


@functools.cache
def _plan_json() -> str:
    with fresh_dir() as d:
        assert main([*PLAN, "--json", "--out", str(d / "p.json")]) == 0
        return (d / "p.json").read_text()


def hostile_path(d: Path, kind: str, name: str = "x.json") -> str:
    return {
        "empty": "",
        "blank": "  ",
        "new": str(d / "new" / name),
        "folder": str(d),
        "file": str(d / "file.txt"),
        "under-file": str(d / "file.txt" / name),
        "symlink": str(d / "link"),
        "dangling": str(d / "dangling"),
        "read-only": str(d / "ro" / name),
        "nul": f"{d}/a\0b",
        "long": str(d / ("x" * 300) / name),
        "unencodable": f"{d}/a\ud800b",  # a lone surrogate: no file system encoding holds it
    }[kind]


def snapshot(d: Path) -> dict[str, tuple[int, int, int, str | None]]:
    """Every entry under ``d`` (links not followed): type, size, mtime, link target."""
    found = {}
    for root, dirs, files in os.walk(d):
        for name in dirs + files:
            path = os.path.join(root, name)
            st = os.lstat(path)
            target = os.readlink(path) if stat.S_ISLNK(st.st_mode) else None
            found[os.path.relpath(path, d)] = (stat.S_IFMT(st.st_mode), st.st_size,
                                               st.st_mtime_ns, target)  # fmt: skip
    return found


def check_writes(d: Path, before: dict, rc: object, outputs: list[str]) -> None:
    """Nothing changed under ``d`` when refused; else only ``outputs`` and the folders
    made for them."""
    after = snapshot(d)
    changed = {p for p in before.keys() | after.keys() if before.get(p) != after.get(p)}
    if rc != 0:
        assert not changed, f"a refused run changed {sorted(changed)}"
        return
    allowed = set()
    for out in outputs:
        rel = Path(os.path.relpath(Path(out).absolute(), d))
        allowed |= {str(rel), *(str(p) for p in rel.parents if str(p) != ".")}
    assert changed <= allowed, f"wrote {sorted(changed - allowed)} beside {outputs}"
    assert before.keys() <= after.keys(), "deleted something"


def check_refusal(rc: object, err: str, names: list[str]) -> None:
    """Exit 0, or 2 with one line (argparse's: its usage, then one error line) naming one
    of ``names``; never a traceback."""
    assert "Traceback" not in err, err
    assert rc in (0, 2), (rc, err)
    if rc == 2:
        lines = err.strip().splitlines()
        assert lines and ": error: " in lines[-1], err
        if not lines[0].startswith("usage: "):
            assert len(lines) == 1, err  # pdjax's own: one line
        elif "unrecognized arguments:" in lines[-1]:
            return  # argparse's, naming them (an empty one too, as nothing)
        assert any(n and n in lines[-1] for n in names), (names, err)


#: ``(command, argv before the path, option, argv after, kinds)``: every path option; the
#: expensive commands' only with the kinds refused before any work.
PATH_CASES = [
    ("plan", PLAN, "--out", [], KINDS),
    ("plan", ["plan", "--workers", "2"], "--profile", [], KINDS),
    ("plan", PLAN, "--calibration", [], KINDS),
    ("simulate", SIMULATE, "--trace", [], KINDS),
    ("simulate", SIMULATE, "--png", [], KINDS),
    ("simulate", SIMULATE, "--write-csv", [], KINDS),
    ("simulate", SIMULATE, "--schedule-csv", [], KINDS),
    ("simulate", ["simulate"], "--plan", ["--profile", "pipedream:alexnet"], KINDS),
    ("simulate", ["simulate", "--plan", "inputs/plan.json"], "--profile", [], KINDS),
    ("simulate", ["simulate", "--plan", "inputs/plan.json", "--profile", "pipedream:alexnet"],
     "--calibration", [], KINDS),
    ("profile", ["profile", "--model", "mlp"], "--out", [], REFUSED_OUTPUT),
    ("calibrate", ["calibrate", "--model", "mlp", "--microbatch-size", "2", "--refine",
                   "--profile", "pipedream:alexnet"], "--out", [], REFUSED_OUTPUT),
    ("calibrate", ["calibrate", "--model", "mlp", "--microbatch-size", "2", "--refine",
                   "--profile", "pipedream:alexnet", "--out", "c.json"], "--plan-out", [],
     REFUSED_OUTPUT),
    ("calibrate", ["calibrate", "--model", "mlp", "--microbatch-size", "2", "--out", "c.json"],
     "--plan", [], REFUSED_INPUT),
    ("calibrate", ["calibrate", "--model", "mlp", "--microbatch-size", "2", "--out", "c.json",
                   "--refine"], "--profile", [], REFUSED_INPUT),
    ("calibrate", ["calibrate", "--model", "mlp", "--microbatch-size", "2", "--out", "c.json",
                   "--refine", "--profile", "pipedream:alexnet"], "--calibration", [],
     REFUSED_INPUT),
    *[("train", ["train", "--devices", "2", "--epochs", "1", "--plan", "even"], option, [],
       REFUSED_FOLDER) for option in ("--out", "--checkpoint-dir", "--tensorboard")],
    ("train", ["train", "--devices", "2", "--epochs", "1"], "--plan", [], REFUSED_INPUT),
    ("train", ["train", "--devices", "2", "--epochs", "1", "--plan", "even"], "--dataset", [],
     REFUSED_INPUT),
    ("bench", ["bench", "--devices", "2"], "--plan", [], REFUSED_INPUT),
    ("generate", ["generate", "--prompt", "a"], "--checkpoint", [], REFUSED_INPUT),
]  # fmt: skip


def test_path_cases_cover_every_path_option():
    from pdjax.apps.cli import build_parser
    from pdjax.apps.commands import PathOption

    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    every = {
        (name, s)
        for name, sub in subparsers.choices.items()
        for a in sub._actions
        if isinstance(a, PathOption)
        for s in a.option_strings
    }
    assert {(c[0], c[2]) for c in PATH_CASES} == every


@pytest.mark.parametrize(
    ("command", "before", "option", "after", "kinds"),
    PATH_CASES,
    ids=[f"{c[0]}{c[2]}" for c in PATH_CASES],
)
@settings(max_examples=12, **FUZZ)
@given(data=st.data())
def test_every_path_option_of_every_command(command, before, option, after, kinds, data,
                                            capsys):  # fmt: skip
    kind = data.draw(st.sampled_from(sorted(kinds)), label="kind")
    with hostile_dir() as d:
        path = hostile_path(
            d, kind, {"--png": "x.png", "--write-csv": "x.csv"}.get(option, "x.json")
        )
        argv = [*before, option, path, *after]
        old = snapshot(d)
        with unprivileged(kind == "read-only"):
            rc, err = run_cli(argv, capsys)
        check_refusal(rc, err, [option, path, Path(path).name if path.strip() else ""])
        if frozenset(kinds) != frozenset(KINDS):  # an expensive command: refused up front
            assert rc == 2, (kind, err)
        check_writes(d, old, rc, [path] if option in OUTPUTS else [])


#: Values for any option: numbers in and out of bounds, words, empty and blank strings.
WORDS = ["0", "1", "2", "-1", "nan", "1e308", "abc", "", " ", "all", "auto", "even"]
#: Expensive commands get this after the option drawn, refused while parsing, so that
#: nothing runs whatever the option drawn does.
POISON = {"profile": ["--seed", "-1"], "calibrate": ["--seed", "-1"],
          "train": ["--seed", "-1"], "bench": ["--seed", "-1"],
          "generate": ["--step", "-1"]}  # fmt: skip
BASES = {
    "plan": PLAN,
    "simulate": SIMULATE,
    "profile": ["profile", "--model", "mlp"],
    "calibrate": ["calibrate", "--model", "mlp", "--microbatch-size", "2", "--refine",
                  "--profile", "pipedream:alexnet", "--out", "c.json"],
    "train": ["train"],
    "bench": ["bench"],
    "generate": ["generate", "--checkpoint", "ckpt", "--prompt", "a"],
}  # fmt: skip


@pytest.mark.parametrize("command", list(BASES))
@settings(max_examples=40, **FUZZ)
@given(data=st.data())
def test_every_option_of_every_command(command, data, capsys):
    """Any option of the command, spelled out or cut short (argparse would take a prefix
    as the option), with a word, a number or a hostile path."""
    from pdjax.apps.cli import build_parser

    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    options = sorted({s for a in subparsers.choices[command]._actions for s in a.option_strings
                      if s.startswith("--") and s != "--help"})  # fmt: skip
    option = data.draw(st.sampled_from(options), label="option")
    cut = data.draw(st.integers(3, len(option)), label="cut")
    spelled = option[:cut]
    # (no unencodable name: argparse echoes it, and pytest's capture, unlike sys.stderr,
    # cannot write it)
    kind = data.draw(st.sampled_from(["word", *KINDS[:-1]]), label="kind")
    with hostile_dir() as d:
        value = data.draw(st.sampled_from(WORDS)) if kind == "word" else hostile_path(d, kind)
        # a prefix is refused while parsing (nothing runs); an option is followed by the
        # poison of an expensive command
        poison = POISON.get(command, []) if spelled in options else []
        argv = [*BASES[command], spelled, value, *poison]
        old = snapshot(d)
        with unprivileged(kind == "read-only"):
            rc, err = run_cli(argv, capsys)
        names = [spelled, value, Path(value).name if value.strip() else "", *poison[:1]]
        check_refusal(rc, err, names)
        if spelled not in options:  # a prefix: refused, never read as the option
            assert rc == 2 and f"unrecognized arguments: {spelled}" in err, err
        if command in POISON:
            assert rc == 2, err
        outputs = [value] if option in OUTPUTS and spelled == option else []
        check_writes(d, old, rc, outputs)
