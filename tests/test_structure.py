"""The package structure stays as docs/architecture.md draws it: packages import only the
layers below them (no cycles, also not through imports inside functions), no module
branches on a schedule's name outside the schedules package, no underscore name is
imported from another module, and the library never reaches into the repository's
benchmarks (their harness is not installed: tests/test_wheel.py).

Read by parsing the sources (nothing is imported), so every import counts, wherever it is.
"""

from __future__ import annotations

import ast
import functools
import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdjax.schedules import SCHEDULES

ROOT = Path(__file__).resolve().parent.parent
PDJAX = ROOT / "pdjax"

# The foundation any part may import: errors, precision policies, processes, and the
# private helper modules at the top (pdjax/_*.py).
FOUNDATION = {"pdjax.errors", "pdjax.precision", "pdjax.distributed", "pdjax.mesh"}

# Per part of the library, the parts it may import besides itself and the foundation. The
# lower a part, the fewer it may import; the runtime (pdjax.pipeline) sits beside the
# planner and the simulator and meets them only through data: the plan types
# (pdjax.plan) and the schedules, with their timeline, below all three.
MAY_IMPORT: dict[str, set[str]] = {
    "pdjax.layers": set(),
    "pdjax.export": {"pdjax.layers"},
    "pdjax.models": {"pdjax.layers"},
    "pdjax.profile": {"pdjax.layers"},
    "pdjax.schedules": set(),
    "pdjax.plan": {"pdjax.schedules", "pdjax.profile"},
    "pdjax.simulator": {"pdjax.schedules"},
    # the planner's three rooms, each reading only those below it: the cost model, the
    # search that makes plans, the choosing among them by simulation
    "pdjax.partition.pricing": {"pdjax.schedules", "pdjax.plan", "pdjax.profile"},
    "pdjax.partition.search": {
        "pdjax.schedules",
        "pdjax.plan",
        "pdjax.profile",
        "pdjax.partition.pricing",
    },
    "pdjax.partition.choosing": {
        "pdjax.schedules",
        "pdjax.plan",
        "pdjax.profile",
        "pdjax.simulator",
        "pdjax.partition.pricing",
        "pdjax.partition.search",
    },
    "pdjax.partition": {
        "pdjax.schedules",
        "pdjax.plan",
        "pdjax.simulator",
        "pdjax.profile",
        "pdjax.partition.pricing",
        "pdjax.partition.search",
        "pdjax.partition.choosing",
    },
    "pdjax.pipeline": {"pdjax.layers", "pdjax.export", "pdjax.schedules", "pdjax.plan"},
    "pdjax.runners": {"pdjax.layers", "pdjax.pipeline"},
    "pdjax.calibrate": {
        "pdjax.layers",
        "pdjax.profile",
        "pdjax.schedules",
        "pdjax.plan",
        "pdjax.simulator",
        "pdjax.partition",
        "pdjax.pipeline",
    },
}
# pdjax/__init__.py re-exports the public names of any part but the applications;
# pdjax.apps may import everything, and nothing imports it but itself.


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@functools.cache
def _sources() -> dict[str, tuple[Path, ast.Module]]:
    out = {}
    for path in sorted(PDJAX.rglob("*.py")):
        if "__pycache__" not in path.parts:
            out[_module_name(path)] = (path, ast.parse(path.read_text(), str(path)))
    return out


def _imports(module: str, path: Path, tree: ast.Module) -> Iterator[tuple[str, str, int]]:
    """(imported module, imported name or "", line) for every import in ``tree``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, "", node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                yield target, alias.name, node.lineno


def _part(module: str) -> str:
    """The part of the library a module belongs to (the longest key it falls under)."""
    keys = [*MAY_IMPORT, *FOUNDATION, "pdjax.apps"]
    best = max((k for k in keys if module == k or module.startswith(k + ".")), key=len, default="")
    return best or module


def _within(target: str, allowed: set[str]) -> bool:
    return any(target == a or target.startswith(a + ".") for a in allowed)


def _imported_modules() -> Iterator[tuple[str, str, str, int]]:
    """(importer, its file, the pdjax module it imports, line); ``from pdjax.x import y``
    counts as importing ``pdjax.x.y`` when that is a module."""
    sources = _sources()
    for module, (path, tree) in sources.items():
        for target, name, line in _imports(module, path, tree):
            if not target.startswith("pdjax"):
                continue
            full = f"{target}.{name}" if name and f"{target}.{name}" in sources else target
            yield module, str(path.relative_to(ROOT)), full, line


def test_every_part_imports_only_the_layers_below_it() -> None:
    wrong = []
    for module, where, target, line in _imported_modules():
        part = _part(module)
        if part in ("pdjax", "pdjax.__main__", "pdjax.apps") or target == "pdjax":
            if part != "pdjax.apps" and _part(target) == "pdjax.apps" and part != "pdjax.__main__":
                wrong.append(f"{where}:{line} imports {target} (nothing imports the apps)")
            continue
        if _part(target) == part or _part(target) in FOUNDATION:
            continue
        if target.rpartition(".")[2].startswith("_") and target.count(".") == 1:
            continue  # the private helper modules at the top: pdjax/_*.py
        allowed = MAY_IMPORT.get(part)
        if allowed is None:
            allowed = {"pdjax.layers"} if part.startswith("pdjax._") else set()
        if not _within(target, allowed):
            wrong.append(f"{where}:{line} ({part}) imports {target}")
    assert not wrong, "imports across the layers:\n" + "\n".join(wrong)


def test_no_import_cycle_between_packages() -> None:
    edges: dict[str, set[str]] = {}
    for module, _, target, _ in _imported_modules():
        a, b = _part(module), _part(target)
        if a != b and a not in ("pdjax",) and b != "pdjax":
            edges.setdefault(a, set()).add(b)
    # depth-first search for a cycle
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = 2
        path.pop()
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            pytest.fail("import cycle: " + " -> ".join(cycle))


# Schedule names that may appear in a branch outside pdjax/schedules, each with its reason
# ("path:name": why). None today: the cluster benchmark's runner labels ('pipedream' beside
# 'dp' and 'single') left with its harness for benchmarks/harness/.
NAME_BRANCHES_ALLOWED: dict[str, str] = {
    # the planner's own pricing knobs per schedule, kept with the planner (issue 45: planner
    # facts leave ScheduleKind): a table keyed by name, read once into SCHEDULE_TRAITS
    **{
        f"pdjax/partition/pricing/traits.py:{n}": "the planner's table"
        for n in ("gpipe", "interleaved", "zb-h2", "zb-v")
    },
}


def _docstring_nodes(tree: ast.Module) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    return ids


def _branch_literals(tree: ast.Module) -> Iterator[tuple[str, int]]:
    """Schedule names used to decide something: compared, tested for membership, used as a
    dict key or a match pattern."""
    names = set(SCHEDULES)

    def constants(node: ast.AST) -> Iterator[ast.Constant]:
        if isinstance(node, ast.Constant) and node.value in names:
            yield node
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            for elt in node.elts:
                yield from constants(elt)

    for node in ast.walk(tree):
        found: Iterator[ast.Constant] = iter(())
        if isinstance(node, ast.Compare):
            found = itertools.chain(constants(node.left), *map(constants, node.comparators))
        elif isinstance(node, ast.Dict):
            found = itertools.chain(*(constants(k) for k in node.keys if k is not None))
        elif isinstance(node, ast.MatchValue):
            found = constants(node.value)
        for c in found:
            yield str(c.value), c.lineno


def test_no_module_branches_on_a_schedule_name_outside_the_schedules_package() -> None:
    found = []
    for module, (path, tree) in _sources().items():
        if module.startswith("pdjax.schedules"):
            continue
        where = str(path.relative_to(ROOT))
        for name, line in _branch_literals(tree):
            if f"{where}:{name}" not in NAME_BRANCHES_ALLOWED:
                found.append(f"{where}:{line} branches on {name!r}")
    assert not found, (
        "read a field of the schedule (pdjax.schedules) instead of its name:\n" + "\n".join(found)
    )


def test_the_branch_check_sees_a_branch() -> None:
    """The check above finds the forms it looks for (so its silence means something)."""
    code = (
        "if s == 'zb-v': pass\n"
        "x = 1 if name in ('pipedream', '2bw') else 2\n"
        "d = {'interleaved': 1}\n"
        "match n:\n    case '1f1b': pass\n"
        "def f(schedule='gpipe'): 'zb-h1 is fine in a docstring'\n"
    )
    got = sorted(_branch_literals(ast.parse(code)))
    assert got == [("1f1b", 5), ("2bw", 2), ("interleaved", 3), ("pipedream", 2), ("zb-v", 1)]


def test_no_underscore_name_is_imported_from_another_module() -> None:
    sources = _sources()
    found = []
    for module, (path, tree) in sources.items():
        for target, name, line in _imports(module, path, tree):
            if not target.startswith("pdjax") or not name.startswith("_") or name.startswith("__"):
                continue
            if f"{target}.{name}" in sources:
                continue  # a private module, imported as a module
            found.append(f"{path.relative_to(ROOT)}:{line} imports {name} from {target}")
    assert not found, (
        "a name used by other modules is public in its (possibly private) module:\n"
        + "\n".join(found)
    )


#: Top-level packages of the repository that are not installed: the library names none of
#: them, in an import or as a module path in a string (``importlib``, ``python -m``).
NOT_INSTALLED = ("benchmarks", "tests", "tools", "examples")


def _reaches_outside(module: str, path: Path, tree: ast.Module) -> Iterator[tuple[str, int]]:
    """(what, line) for every import of, and every string naming a module of, a package of
    :data:`NOT_INSTALLED` (docstrings aside: they may point at a script)."""

    def outside(name: str) -> bool:
        return name.split(".")[0] in NOT_INSTALLED

    for target, name, line in _imports(module, path, tree):
        if outside(target):
            yield f"imports {target}" + (f".{name}" if name else ""), line
    docs = _docstring_nodes(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            text = node.value.strip()
            if "." in text and " " not in text and outside(text.split(":")[0]):
                yield f"names {text!r}", node.lineno


def test_the_library_never_reaches_into_the_benchmarks() -> None:
    """No module under pdjax/ imports ``benchmarks`` (the harness: the cluster, emulated
    links) or another folder of the repository that the wheel does not ship."""
    found = [
        f"{path.relative_to(ROOT)}:{line} {what}"
        for module, (path, tree) in _sources().items()
        for what, line in _reaches_outside(module, path, tree)
    ]
    assert not found, "the installed pdjax cannot import these:\n" + "\n".join(found)


def test_the_benchmarks_check_sees_an_import() -> None:
    code = (
        '"""python -m benchmarks.harness.cluster is fine in a docstring."""\n'
        "import benchmarks.harness.netem\n"
        "from benchmarks.harness import cluster\n"
        "def f():\n    from tests import reference\n"
        "M = 'benchmarks.harness.cluster_tta:cluster_spec'\n"
        "ok = ('benchmarks/results', 'pdjax.apps.bench', 'a benchmarks.x b')\n"
    )
    got = sorted(line for _, line in _reaches_outside("pdjax.x", PDJAX / "x.py", ast.parse(code)))
    assert got == [2, 3, 5, 6]


def test_the_runtime_meets_the_planner_and_the_simulator_only_through_data() -> None:
    """pdjax.pipeline imports neither pdjax.partition nor pdjax.simulator (issue 45):
    the plan types and the timeline it reads sit below all three."""
    assert not {"pdjax.partition", "pdjax.simulator"} & MAY_IMPORT["pdjax.pipeline"]
    bad = [
        f"{where}:{line} {module} imports {target}"
        for module, where, target, line in _imported_modules()
        if _part(module) == "pdjax.pipeline"
        and _within(target, {"pdjax.partition", "pdjax.simulator"})
    ]
    assert not bad, bad
