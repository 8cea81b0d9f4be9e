"""The command line against hostile input (issue 33): option prefixes, which argparse would
read as the option they abbreviate; the workers' command line of ``train
--local-processes``; a model factory or module that raises or exits; empty paths; output
folders that cannot be written, even as root; and a launcher killed outright (its
workers' watch of the launcher's pipe; the process tests are in test_process_faults.py).

Nothing here trains: every command either is refused while parsing or before any work, or
is a cheap one."""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
from test_cli_fuzz import unprivileged  # root without CAP_DAC_OVERRIDE: modes then apply

from pdjax.apps.cli import build_parser, main
from pdjax.apps.commands import COMMANDS, check_writable
from pdjax.errors import OptionError, PdjaxError

#: Each command's required options (with values that pass), so that an unknown option is
#: what argparse reports.
REQUIRED = {
    "profile": ["--model", "mlp"],
    "calibrate": ["--model", "mlp", "--microbatch-size", "2", "--refine", "--out", "c.json"],
    "plan": ["--profile", "pipedream:alexnet", "--workers", "2"],
    "simulate": [],
    "train": [],
    "bench": [],
    "generate": ["--checkpoint", "ckpt", "--prompt", "a"],
}


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _long_options(parser: argparse.ArgumentParser) -> list[str]:
    return sorted(
        s for a in parser._actions for s in a.option_strings if s.startswith("--") and s != "--"
    )


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[object, str]:
    capsys.readouterr()
    try:
        rc: object = main(argv)
    except SystemExit as e:
        rc = e.code
    return rc, capsys.readouterr().err


# -- 1. option prefixes ---------------------------------------------------------------------


def test_no_parser_takes_abbreviations():
    """The top parser and each command's, as build_parser makes them and as each command
    registers itself alone (add_parser does not pass allow_abbrev on by itself)."""
    parser = build_parser()
    assert parser.allow_abbrev is False
    assert set(_subparsers(parser)) == set(COMMANDS)
    for name, sub in _subparsers(parser).items():
        assert sub.allow_abbrev is False, name
    for name in COMMANDS:
        alone = argparse.ArgumentParser(prog="pdjax")
        module = importlib.import_module(f"pdjax.apps.commands.{name}")
        module.register(alone.add_subparsers(dest="command"))
        assert _subparsers(alone)[name].allow_abbrev is False, name


def _prefixes(options: list[str]) -> list[tuple[str, str]]:
    """``(option, prefix)``: each option cut by one character, and cut to the shortest
    prefix that no other option shares (what argparse would take for it)."""
    out = []
    for option in options:
        others = [o for o in options if o != option]
        shortest = next(
            (
                option[:k]
                for k in range(3, len(option) + 1)
                if not any(o.startswith(option[:k]) for o in others)
            ),
            option,  # the start of another option: argparse would take no prefix of it
        )
        for prefix in {option[:-1], shortest}:
            if len(prefix) > 2 and prefix != option and prefix not in options:
                out.append((option, prefix))
    return out


@pytest.mark.parametrize("command", COMMANDS)
def test_every_option_prefix_is_refused(command, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    options = _long_options(_subparsers(build_parser())[command])
    cases = _prefixes(options)
    assert len(cases) >= len(options) // 2
    for option, prefix in cases:
        for argv in ([prefix, "1"], [f"{prefix}=1"]):
            rc, err = _run([command, *REQUIRED[command], *argv], capsys)
            assert rc == 2, (option, argv, err)
            last = err.strip().splitlines()[-1]
            assert "error: unrecognized arguments: " in last and prefix in last, (option, err)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("argv", "prefix"),
    [
        (["--local", "2"], "--local"),
        (["--local-proc", "2"], "--local-proc"),
        (["--local-processes=2", "--pin"], "--pin"),
        (["--local-p=2"], "--local-p=2"),
    ],
)
def test_launcher_option_prefixes_are_refused_not_launched(argv, prefix, capsys, monkeypatch):
    import pdjax.distributed

    def launched(*args, **kwargs):
        raise AssertionError("a prefix launched processes")

    monkeypatch.setattr(pdjax.distributed, "launch_local", launched)
    rc, err = _run(["train", *argv], capsys)
    assert rc == 2
    last = err.strip().splitlines()[-1]
    assert last.startswith("pdjax: error: unrecognized arguments: ") and prefix in last, err


def test_the_top_parser_refuses_a_prefix_of_version(capsys):
    rc, err = _run(["--vers", "simulate"], capsys)
    assert rc == 2 and "unrecognized arguments: --vers" in err


# -- 1. the workers' command line ------------------------------------------------------------


def test_workers_get_no_launcher_option_in_any_spelling():
    from pdjax.apps.commands.train import worker_argv

    argv = [
        "train", "--local-processes", "2", "--devices", "4", "--local-processes=3",
        "--pin-cores", "--plan", "even", "--compare=--local-processes", "--out", "o",
    ]  # fmt: skip
    assert worker_argv(argv) == [
        "train", "--devices", "4", "--plan", "even", "--compare=--local-processes", "--out", "o",
    ]  # fmt: skip
    assert worker_argv(["train", "--local-processes"]) == ["train"]  # no value: nothing more


def test_workers_get_what_main_was_given_not_sys_argv(monkeypatch, tmp_path):
    """``main(argv)`` from Python: the workers run ``argv``, whatever ``sys.argv`` holds."""
    import pdjax.distributed

    calls = []

    def launch(argv, n, **kwargs):
        calls.append((list(argv), n, kwargs))
        return 0

    monkeypatch.setattr(pdjax.distributed, "launch_local", launch)
    monkeypatch.setattr(sys, "argv", ["pytest", "train", "--local-processes", "9", "--seed", "7"])
    for var in ("PDJAX_COORDINATOR", "JAX_COORDINATOR_ADDRESS"):
        monkeypatch.delenv(var, raising=False)
    out = str(tmp_path / "o")
    given = ["train", "--local-processes=2", "--pin-cores", "--devices", "4", "--plan", "even"]
    assert main([*given, "--out", out]) == 0
    assert calls == [
        (
            ["-m", "pdjax", "train", "--devices", "4", "--plan", "even", "--out", out],
            2,
            {"pin": True, "cpu_devices": 2},
        )
    ]
    assert not (tmp_path / "o").exists()


def test_a_launched_worker_does_not_launch_again(monkeypatch, capsys):
    import pdjax.distributed

    monkeypatch.setattr(pdjax.distributed, "launch_local", None)  # not reached
    monkeypatch.setenv("PDJAX_COORDINATOR", "127.0.0.1:1234")
    rc, err = _run(["train", "--local-processes", "2"], capsys)
    assert rc == 2
    assert err.strip().splitlines() == [
        "pdjax train: error: --local-processes: this process is already one of a "
        "multi-process run (PDJAX_COORDINATOR or JAX_COORDINATOR_ADDRESS is set) and would "
        "start processes of its own; drop --local-processes, or unset those variables"
    ]


# -- 2. a launcher killed outright: the pipe its workers watch -------------------------------


def test_a_worker_watching_its_launchers_pipe_sees_it_close():
    from pdjax.distributed import LAUNCHER_PIPE_ENV, Lifeline, watch_launcher

    line = Lifeline()
    try:
        env = dict(line.env)
        gone = threading.Event()
        assert watch_launcher(env, on_death=gone.set)
        assert LAUNCHER_PIPE_ENV not in env  # not handed on to this process's children
        assert not gone.is_set()
    finally:
        os.close(line._write)  # what the kernel does when the launcher dies
    assert gone.wait(10), "the watcher did not see the launcher's pipe close"
    os.close(line.read)


def test_a_worker_takes_no_other_file_for_its_launchers_pipe(tmp_path):
    """A grandchild that inherited the variable but not the pipe: the number is another
    file's (or none), and nothing is watched."""
    from pdjax.distributed import LAUNCHER_PIPE_ENV, watch_launcher

    read, write = os.pipe()
    try:
        inode = os.fstat(read).st_ino
        with open(tmp_path / "f", "wb") as f:
            for token in (f"{f.fileno()}:{inode}", f"{read}:{inode + 1}", "999999:1", "x:y"):
                env = {LAUNCHER_PIPE_ENV: token}
                assert not watch_launcher(env, on_death=pytest.fail), token
                assert env == {}
        assert not watch_launcher({}, on_death=pytest.fail)
    finally:
        os.close(read)
        os.close(write)


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_a_launched_command_dies_with_its_launcher_and_checks_it_is_still_there():
    """orphan_proof's few lines: the kernel's parent-death signal is SIGKILL in the command
    they exec; and a process whose launcher is already gone does not run the command."""
    from pdjax.distributed import orphan_proof

    show = "import ctypes; s = ctypes.c_int(); ctypes.CDLL(None).prctl(2, ctypes.byref(s)); "
    show += "print(s.value)"
    cmd = orphan_proof([sys.executable, "-c", show])
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "9", done.stderr  # SIGKILL
    i = cmd.index(str(os.getpid()))
    cmd[i] = "1"  # as if the launcher had died before the prctl: not our parent
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stdout == "", done.stderr


# -- 3. a model factory that fails -----------------------------------------------------------

FACTORIES = {
    "raises_at_import": "raise ValueError('bad\\nimport')\n",
    "exits_at_import": "import sys\nsys.exit(3)\n",
    "exits_quietly_at_import": "import sys\nsys.exit()\n",
    "factories": """
import sys

def raises(config="tiny"):
    return {"tiny": 1}[config]

def exits():
    sys.exit("bye")

def interrupted():
    raise KeyboardInterrupt

def sampler_raises():
    import flax.linen as nn
    import optax

    def sample(n):
        raise RuntimeError("no data")

    return {"layers": [nn.Dense(2)], "loss": optax.l2_loss, "sample_batch": sample}
""",
    "interrupted_at_import": "raise KeyboardInterrupt\n",
}


@pytest.fixture
def factories(tmp_path, monkeypatch):
    """The modules of :data:`FACTORIES` in a fresh current directory."""
    for name, text in FACTORIES.items():
        (tmp_path / f"{name}.py").write_text(text)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    for name in FACTORIES:
        monkeypatch.delitem(sys.modules, name, raising=False)
    yield tmp_path
    for name in FACTORIES:
        sys.modules.pop(name, None)


@pytest.mark.parametrize(
    ("ref", "words"),
    [
        (
            "raises_at_import:build",
            [
                "importing 'raises_at_import' failed: ValueError: bad import",
                "raises_at_import.py:1",
            ],
        ),
        ("raises_at_import.py:build", ["ValueError: bad import"]),
        ("exits_at_import:build", ["importing 'exits_at_import' failed", "sys.exit(3)"]),
        ("exits_quietly_at_import:build", ["SystemExit: it called sys.exit()"]),
        (
            "factories:raises",
            ["the factory factories:raises failed: KeyError: 'huge'", "factories.py:5"],
        ),
        ("factories:exits", ["the factory factories:exits failed", "sys.exit('bye')"]),
        ("factories:sampler_raises", ["sample_batch(2) failed: RuntimeError: no data"]),
    ],
)
def test_a_failing_factory_or_module_is_one_line(factories, capsys, ref, words):
    rc, err = _run(["profile", "--model", ref, "--config", "huge", "--json"], capsys)
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pdjax profile: error: ") and ref in lines[0]
    for word in [*words, "; see the traceback with PDJAX_DEBUG=1"]:
        assert word in lines[0], (word, lines[0])


def test_pdjax_debug_shows_the_factorys_traceback(factories, capsys, monkeypatch):
    monkeypatch.setenv("PDJAX_DEBUG", "1")
    rc, err = _run(["profile", "--model", "factories:raises", "--config", "huge"], capsys)
    assert rc == 2
    assert "Traceback" in err and 'return {"tiny": 1}[config]' in err and "KeyError" in err
    assert "The above exception was the direct cause" in err
    assert err.strip().splitlines()[-1].startswith("pdjax profile: error: --model ")


@pytest.mark.parametrize("ref", ["factories:interrupted", "interrupted_at_import:build"])
def test_ctrl_c_in_a_factory_still_interrupts(factories, ref):
    from pdjax.models import get_model

    with pytest.raises(KeyboardInterrupt):
        get_model(ref)


# -- 4. empty paths ----------------------------------------------------------------------------

#: Every option that takes a path, per command: each is a PathOption.
PATH_OPTIONS = {
    "profile": {"--out"},
    "calibrate": {"--plan", "--profile", "--calibration", "--out", "--plan-out"},
    "plan": {"--profile", "--out", "--calibration"},
    "simulate": {
        "--plan", "--profile", "--schedule-csv", "--write-csv", "--trace", "--png",
        "--calibration",
    },
    "train": {"--dataset", "--plan", "--checkpoint-dir", "--out", "--tensorboard"},
    "bench": {"--plan"},
    "generate": {"--checkpoint"},
}  # fmt: skip


def test_every_path_option_is_a_path_option():
    from pdjax.apps.commands import PathOption

    for name, sub in _subparsers(build_parser()).items():
        found = {s for a in sub._actions if isinstance(a, PathOption) for s in a.option_strings}
        assert found == PATH_OPTIONS[name], name


EMPTY_CASES = [
    (command, option, value)
    for command, options in PATH_OPTIONS.items()
    for option in sorted(options)
    for value in ("", "  ")
]


@pytest.mark.parametrize(("command", "option", "value"), EMPTY_CASES)
def test_an_empty_path_is_refused_not_read_as_off(
    command, option, value, capsys, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    base = REQUIRED[command]
    if command == "calibrate":  # --plan and --refine are exclusive, and --out is one of them
        base = ["--model", "mlp", "--microbatch-size", "2"]
        base += [] if option == "--plan" else ["--refine"]
        base += [] if option == "--out" else ["--out", "c.json"]
    rc, err = _run([command, *base, option, value], capsys)
    assert rc == 2
    assert err.strip().splitlines() == [
        f"pdjax {command}: error: {option} {value!r}: "
        f"{'an empty' if not value else 'a blank'} path; give a path, or leave {option} out"
    ]
    assert list(tmp_path.iterdir()) == []


def test_names_no_file_system_takes_are_refused_while_parsing(capsys):
    for value, words in [
        ("a\0b", "NUL character"),
        ("d/" + "x" * 300, "300 bytes long"),
        ("a\ud800b", "not a name this system can encode"),
    ]:
        rc, err = _run(["simulate", "--trace", value], capsys)
        assert rc == 2 and words in err and len(err.strip().splitlines()) == 1, err


def test_the_path_checks_refuse_what_names_no_file():
    from pdjax.apps.commands import check_readable

    for check in (check_writable, check_readable):
        for value in ("", "  ", "a\0b", "a\ud800b"):
            with pytest.raises(OptionError, match="--x"):
                check("--x", value)


# -- 5. output paths that cannot be written, checked by writing ------------------------------


@pytest.fixture
def shared_dir():
    """A folder that anyone may enter (in the system's temporary folder, which anyone
    may), with a read-only folder and a writable one in it."""
    with tempfile.TemporaryDirectory() as name:
        root = Path(name)
        os.chmod(root, 0o711)
        for sub, mode in (("ro", 0o555), ("rw", 0o777)):
            (root / sub).mkdir()
            os.chmod(root / sub, mode)
        yield root
        os.chmod(root / "ro", 0o755)  # to be removed


def test_a_read_only_folder_is_refused_even_where_os_access_says_yes(shared_dir):
    with unprivileged():
        assert os.access(shared_dir / "ro", os.W_OK) == (os.getuid() == 0)  # real id: root's
        with pytest.raises(OptionError, match=r"--out .*: cannot write in .*ro \(Permission"):
            check_writable("--out", str(shared_dir / "ro" / "new" / "p.json"))
        with pytest.raises(OptionError, match=r"cannot write in"):
            check_writable("--out", str(shared_dir / "ro"), folder=True)
        check_writable("--out", str(shared_dir / "rw" / "new" / "p.json"))  # a writable one
        check_writable("--out", str(shared_dir / "rw" / "folder"), folder=True)
    assert sorted(p.name for p in (shared_dir / "rw").iterdir()) == []  # no probe left


def test_the_commands_refuse_a_read_only_folder_before_any_work(shared_dir, capsys):
    out = str(shared_dir / "ro" / "x.json")
    cases = [
        (["plan", *REQUIRED["plan"], "--out", out], "--out"),
        (["simulate", "--unit-costs", "1,1,1", "--stages", "2", "--trace", out], "--trace"),
        (["profile", "--model", "mlp", "--out", out], "--out"),
    ]
    for argv, option in cases:
        with unprivileged():
            rc, err = _run(argv, capsys)
        assert rc == 2, err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and option in lines[0] and "cannot write in" in lines[0], err
    assert list((shared_dir / "ro").iterdir()) == []


def test_output_paths_that_are_links_files_or_too_long_are_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    (tmp_path / "link").symlink_to(tmp_path / "file")
    (tmp_path / "dangling").symlink_to(tmp_path / "none")
    (tmp_path / "adir").mkdir()
    cases = [
        (tmp_path / "link", False, "symbolic link"),
        (tmp_path / "dangling", False, "symbolic link"),
        (tmp_path / "dangling" / "x", False, "link to nothing"),
        (tmp_path / "file" / "x", False, "is not a folder"),
        (tmp_path / "adir", False, "that is a folder"),
        (tmp_path / "file", True, "that is a file"),
        (tmp_path / "link", True, "symbolic link"),
        (tmp_path / ("x" * 300), False, "File name too long"),
    ]
    for path, folder, words in cases:
        with pytest.raises(PdjaxError, match=words):
            check_writable("--out", str(path), folder=folder)
    assert (tmp_path / "file").read_text() == "x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir", "dangling", "file", "link"]


def test_bench_writes_no_files_and_refuses_a_missing_plan(capsys, tmp_path):
    # the cluster benchmark, which wrote into --out, is benchmarks/cluster/run.py now
    rc, err = _run(["bench", "--out", str(tmp_path / "o")], capsys)
    assert rc == 2 and "unrecognized arguments: --out" in err
    rc, err = _run(["bench", "--plan", str(tmp_path / "none.json")], capsys)
    assert rc == 2 and "--plan" in err and "No such file" in err
    assert list(tmp_path.iterdir()) == []


def test_calibrate_refuses_inputs_it_cannot_read_before_any_work(capsys, tmp_path):
    base = ["calibrate", "--model", "mlp", "--microbatch-size", "2", "--out", str(tmp_path / "c")]
    for argv, option in [
        (["--plan", str(tmp_path)], "--plan"),
        (["--refine", "--profile", str(tmp_path / "none.json")], "--profile"),
        (
            ["--refine", "--profile", "pipedream:alexnet", "--calibration", str(tmp_path)],
            "--calibration",
        ),
    ]:
        rc, err = _run([*base, *argv], capsys)
        assert rc == 2 and f"pdjax calibrate: error: {option} " in err, err
    assert list(tmp_path.iterdir()) == []


# -- train's optimizer of your own and --min-stages: refused as one line (issue 36) ---------

OPTIMIZERS = """
import sys

import optax

def raises(learning_rate):
    raise ValueError("bad\\nrate")

def exits():
    sys.exit("bye")

def not_one():
    return "adam"

def plain():
    return optax.sgd(0.1)
"""


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--optimizer", "opts:raises"], ["opts:raises failed: ValueError: bad rate",
                                          "PDJAX_DEBUG=1"]),
        (["--optimizer", "opts:exits"], ["opts:exits failed", "sys.exit('bye')"]),
        (["--optimizer", "opts:not_one"], ["gave a str, not an optax.GradientTransformation"]),
        (["--optimizer", "opts:missing"], ["opts has no attribute 'missing'"]),
        (["--optimizer", "opts:plain", "--lr-schedule", "warmup-cosine"],
         ["takes no learning_rate"]),
        (["--optimizer", "no_such_module:make"], ["no module 'no_such_module' on the path"]),
        (["--min-stages", "3"], ["--min-stages 3 needs at least 3 devices"]),
        (["--min-stages", "2", "--plan", "even"], ["--plan even makes none"]),
        (["--min-stages", "2", "--schedule", "dp"], ["--schedule dp"]),
        (["--min-stages", "0"], ["--min-stages must be >= 1"]),
    ],
)  # fmt: skip
def test_train_refuses_a_broken_optimizer_or_min_stages_as_one_line(
    tmp_path, monkeypatch, capsys, extra, words
):
    (tmp_path / "opts.py").write_text(OPTIMIZERS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "opts", raising=False)
    argv = ["train", "--model", "mlp", "--devices", "2", "--epochs", "1", "--out", "o", *extra]
    rc, err = _run(argv, capsys)
    sys.modules.pop("opts", None)
    assert rc == 2 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pdjax train: error: "), err
    for word in words:
        assert word in lines[0], (word, lines[0])
    assert not (tmp_path / "o").exists()
