"""The wheel ships the library and nothing else: ``pip wheel`` builds it (offline, with the
build backend installed beside the tests) and its files are exactly pdjax/'s: the package,
its shipped data and the command line, never the repository's benchmarks (their harness:
the cluster, emulated links), tests, tools or examples."""

from __future__ import annotations

import configparser
import importlib.util
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[zipfile.ZipFile]:
    if importlib.util.find_spec("hatchling") is None:  # a failure, not a skip: CI must build
        pytest.fail("the build backend is missing: pip install -e '.[test]' installs hatchling")
    out = tmp_path_factory.mktemp("wheel")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--no-index", "--no-cache-dir", "-q", "-w", str(out), str(ROOT)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    (path,) = out.glob("pdjax-*.whl")
    with zipfile.ZipFile(path) as z:
        yield z


def _library_files() -> set[str]:
    """Every file of pdjax/ in this tree, less Python's caches."""
    return {
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "pdjax").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    }


def test_the_wheel_holds_the_library_and_its_command_line(wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    for must in (
        "pdjax/__init__.py",
        "pdjax/pipeline/__init__.py",
        "pdjax/schedules/__init__.py",
        "pdjax/apps/cli.py",
        "pdjax/apps/commands/bench.py",  # pdjax bench: a user's tool (their model, devices)
        "pdjax/apps/bench.py",
        "pdjax/profile/pipedream_profiles/vgg16/graph.txt",  # data: pipedream:vgg16
    ):
        assert must in names, must
    # every file of pdjax/, no more
    assert {n for n in names if not n.startswith("pdjax-")} == _library_files()
    (info,) = {n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info")}
    entry = configparser.ConfigParser()
    entry.read_string(wheel.read(f"{info}/entry_points.txt").decode())
    assert entry["console_scripts"]["pdjax"] == "pdjax.apps.cli:main"


#: Names no path in the wheel has a part of (a folder, or a module less its ``.py``): the
#: repository's other folders, the moved harness's modules, Python's caches.
NOT_SHIPPED = {
    "benchmarks", "tests", "tools", "examples", "conftest",
    "cluster", "cluster_tta", "netem",
    "__pycache__",
}  # fmt: skip


def test_the_wheel_holds_no_benchmark_harness_tests_or_tools(wheel: zipfile.ZipFile) -> None:
    names = wheel.namelist()
    (info,) = {n.split("/")[0] for n in names} - {"pdjax"}  # pdjax/ and its metadata only
    assert info.startswith("pdjax-") and info.endswith(".dist-info"), info
    for n in names:
        parts = {part.removesuffix(".py") for part in n.split("/")}
        assert not parts & NOT_SHIPPED and not n.endswith(".pyc"), n
