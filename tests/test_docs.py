"""The documents the code cites exist: every ``docs/<file>.md`` (and ``#section``) named in
``pdjax/`` and ``tests/`` is in the repository with that section, nothing cites the design
document that lived outside it, and the "where each rule is tested" table of
``docs/semantics.md#where-each-rule-is-tested`` names tests that exist. Pure text, no JAX.
"""

from __future__ import annotations

import doctest
import functools
import importlib.util
import re
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
SOURCES = ("pdjax", "tests")
TEXT_SUFFIXES = {".py", ".md", ".txt", ".csv", ".json", ".toml", ".cfg", ".ini", ".yaml"}

CITATION = re.compile(r"(?<![\w/.-])docs/([\w.-]+\.md)(?:#([\w-]+))?")
OLD = "DESIGN" + ".md"  # spelled apart so that this file does not cite it
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$")
LINK = re.compile(r"\]\(([\w.-]*\.md)?#([\w-]+)\)")


@functools.cache
def _sources() -> tuple[tuple[Path, str], ...]:
    """Every text file under ``pdjax/`` and ``tests/``, with its text (read once)."""
    return tuple(
        (path, path.read_text(encoding="utf-8", errors="replace"))
        for top in SOURCES
        for path in sorted((ROOT / top).rglob("*"))
        if path.is_file() and path.suffix in TEXT_SUFFIXES and "__pycache__" not in path.parts
    )


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation but ``-`` and ``_``
    dropped, spaces to ``-``.

    >>> slug("The schedules at a glance"), slug("`zb-h1`"), slug("extra_in_flight")
    ('the-schedules-at-a-glance', 'zb-h1', 'extra_in_flight')
    """
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@functools.cache
def anchors(doc: Path) -> frozenset[str]:
    """The anchors of ``doc``'s headings (outside code blocks), with GitHub's ``-1``, ``-2``
    suffixes for repeated ones."""
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in doc.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        match = None if fenced else HEADING.match(line)
        if match:
            base = slug(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            out.add(base if count == 0 else f"{base}-{count}")
    return frozenset(out)


def test_cited_docs_and_sections_exist():
    missing = []
    cited = 0
    for path, text in _sources():
        for match in CITATION.finditer(text):
            name, section = match.groups()
            where = f"{path.relative_to(ROOT)}: docs/{name}{'#' + section if section else ''}"
            doc = DOCS / name
            cited += 1
            if not doc.is_file():
                missing.append(f"{where}: no such file")
            elif section and section not in anchors(doc):
                missing.append(f"{where}: no such section")
    assert not missing, "\n".join(missing)
    assert cited, "nothing in pdjax/ or tests/ cites docs/ (the search pattern is wrong)"
    # links between the documents' own sections resolve too
    for doc in sorted(DOCS.glob("*.md")):
        for target, section in LINK.findall(doc.read_text(encoding="utf-8")):
            linked = DOCS / target if target else doc
            assert linked.is_file(), f"{doc.name}: link to missing {target}"
            assert section in anchors(linked), f"{doc.name}: link to missing #{section}"


def test_nothing_cites_the_old_design_document():
    citing = [
        f"{path.relative_to(ROOT)}:{number}"
        for path, text in _sources()
        for number, line in enumerate(text.splitlines(), 1)
        if OLD in line
    ]
    assert not citing, f"cite docs/semantics.md instead of {OLD}: {', '.join(citing)}"


def test_the_tested_rules_table_names_existing_tests():
    """Each row's cells name ``tests/<file>.py`` and then the tests in it."""
    doc = (DOCS / "semantics.md").read_text(encoding="utf-8")
    table = doc.split("### Where each rule is tested", 1)[1].split("\n#", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and "`tests/" in line]
    assert rows
    absent = []
    for row in rows:
        current = None
        for token in re.findall(r"`([^`]+)`", row):
            if token.startswith("tests/") and token.endswith(".py"):
                current = ROOT / token
                assert current.is_file(), f"{token} does not exist"
                source = current.read_text(encoding="utf-8")
            elif current is not None and re.fullmatch(r"test_\w+", token):
                if not re.search(rf"^\s*def {token}\(", source, re.MULTILINE):
                    absent.append(f"{current.relative_to(ROOT)}::{token}")
    assert not absent, "no such tests: " + ", ".join(absent)


def _where_the_tests_are() -> str:
    """The text of ``docs/architecture.md#where-the-tests-are`` (to the next ``## ``)."""
    doc = (DOCS / "architecture.md").read_text(encoding="utf-8")
    assert "\n## Where the tests are\n" in doc, "docs/architecture.md has no 'Where the tests are'"
    return doc.split("\n## Where the tests are\n", 1)[1].split("\n## ", 1)[0]


def _glob(pattern: str) -> re.Pattern[str]:
    """A row's ``pdjax/...`` path as a pattern: ``*`` stays within one folder."""
    return re.compile(re.escape(pattern).replace(r"\*", "[^/]*"))


def test_the_tests_table_covers_every_test_file_and_module():
    """Every ``tests/test_*.py`` is described and listed under a module group, every test
    file the section names exists, and every ``.py`` under ``pdjax/`` is in a row."""
    section = _where_the_tests_are()
    by_module = section.split("### By module", 1)[1].split("\n### ", 1)[0]
    described = section.split("### The test files", 1)[1]
    rows = [line for line in by_module.splitlines() if line.startswith("| ") and "`test_" in line]
    assert rows, "no rows under 'By module'"
    patterns: list[str] = []
    listed: set[str] = set()
    for row in rows:
        first, *_, last = row.strip("|").split(" | ")
        patterns += re.findall(r"`(pdjax/[^`]*\.py)`", first)
        listed |= set(re.findall(r"`(test_\w+\.py)`", last))
    descriptions = {
        match
        for line in described.splitlines()
        for match in re.findall(r"^\| `(test_\w+\.py)` \| \S", line)
    }
    named = set(re.findall(r"(?<![\w/])(?:tests/)?(test_\w+\.py)", section))
    actual = {path.name for path in (ROOT / "tests").glob("test_*.py")}
    assert not named - actual, f"the section names missing tests: {sorted(named - actual)}"
    assert not actual - descriptions, f"not described: {sorted(actual - descriptions)}"
    assert not actual - listed, f"under no module group: {sorted(actual - listed)}"
    modules = sorted(
        path.relative_to(ROOT).as_posix()
        for path in (ROOT / "pdjax").rglob("*.py")
        if "__pycache__" not in path.parts
    )
    compiled = [_glob(pattern) for pattern in patterns]
    uncovered = [name for name in modules if not any(p.fullmatch(name) for p in compiled)]
    assert not uncovered, f"modules in no row: {uncovered}"
    stale = [p.pattern for p in compiled if not any(p.fullmatch(name) for name in modules)]
    assert not stale, f"rows naming no module: {stale}"


def _docs_site() -> types.ModuleType:
    """``tools/docs_site.py``, the documentation site's Sphinx extension (docs/api.md)."""
    spec = importlib.util.spec_from_file_location("docs_site", ROOT / "tools" / "docs_site.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["docs_site"] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_the_reference_documents_each_object_once_and_links_its_other_names(tmp_path, monkeypatch):
    """The site's API reference (the whole build, warning-free, is ``make lint``'s): an
    object is documented on its defining module's page, a value on the deepest page that
    binds it, a package's page links what it re-exports, and a role to an exported name
    finds the home."""
    site = _docs_site()
    assert doctest.testmod(site).failed == 0
    package = tmp_path / "sitepkg"
    package.mkdir()
    (package / "__init__.py").write_text(
        '"""A package."""\nfrom sitepkg.inner import LIMIT, Thing, make\n'
        '__all__ = ["LIMIT", "Thing", "make"]\n'
    )
    (package / "inner.py").write_text(
        '"""Its module."""\nimport os\nLIMIT = 3\n\n\nclass Thing:\n    """A thing."""\n\n\n'
        'def make():\n    """Make one."""\n\n\ndef _hidden():\n    pass\n'
    )
    (package / "_private.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(tmp_path)
    modules = site.public_modules("sitepkg")
    assert modules == ["sitepkg", "sitepkg.inner"]
    assert site.members(importlib.import_module("sitepkg.inner")) == ["LIMIT", "Thing", "make"]
    home = site.homes(modules)
    inner = site.module_page("sitepkg.inner", home)
    assert ":members: Thing, make" in inner and ".. autodata:: LIMIT" in inner
    outer = site.module_page("sitepkg", home)
    assert ":members:" not in outer and "autodata" not in outer
    assert "* :py:obj:`~sitepkg.inner.Thing`" in outer
    assert "* :py:obj:`~sitepkg.inner.LIMIT`" in outer
    monkeypatch.setattr(site, "ALIASES", site.aliases(modules, home))
    assert site._home_of("sitepkg.Thing.method") == "sitepkg.inner.Thing.method"
    assert site._home_of("sitepkg.LIMIT") == "sitepkg.inner.LIMIT"
    readme = "[b](docs" + "/b.md) [a](docs" + "/a.md#x)"  # split: not cited documents
    assert site.guides(readme, ["a", "b", "c"]) == ["b", "a", "c"]
