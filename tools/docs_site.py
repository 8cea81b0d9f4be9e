"""pdjax's documentation site: a Sphinx extension that ``docs/conf.py`` loads.

The site (``make docs``, into ``build/docs``; docs/api.md) is the README as its front page,
the guides of ``docs/``, the benchmark tables of ``benchmarks/results/`` and the API
reference, built by Sphinx from the repository's root with MyST (Markdown) and autodoc
(Google-style docstrings through napoleon; their Sphinx roles are Sphinx's own). This
extension adds what Sphinx leaves to each project:

* the API reference's pages: one per public module of pdjax (no name part starting with
  ``_``; ``pdjax_api_exclude`` leaves some out), written into ``docs/reference/`` (git-
  ignored) when the build starts. Each object is documented once, in its *home*: the
  module that defines it, or, for an object whose defining module has no page (a private
  one) or for a value, the deepest public module that exports it. A package's page lists
  what its ``__all__`` re-exports, linked to their homes;
* cross-references as pdoc and Sphinx users write them: a role to a re-exported name
  (``:class:`~pdjax.Plan```, ``:func:`pdjax.partition.plan_auto```) links to the object's
  home, and a bare name that Sphinx does not find from where it is written (``Plan`` in
  another module, ``Profile.content_hash``) links where exactly one documented object has
  that qualified name. A role naming a ``pdjax.`` target that is documented nowhere
  (misspelt, moved or private) is a warning, and so fails the build; roles to other
  packages' names stay code, as without the extension;
* the navigation: the README gets a hidden table of contents (the guides in the order its
  links name them, then the others, the API reference and the benchmark tables), so that
  README.md itself stays plain Markdown for GitHub, and the site an ``index.html``;
* the fuzzy search of Sphinx's Python domain through an index (:class:`PythonDomain`),
  napoleon kept off values' docstrings (:data:`AS_WRITTEN`), and the warnings that
  ``pdjax_known_warnings`` lets through (:func:`known_warnings`).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import logging as logging_
import pkgutil
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sphinx.domains.python
from docutils import nodes  # type: ignore[import-untyped]
from sphinx.addnodes import pending_xref
from sphinx.application import Sphinx
from sphinx.domains.python import ObjectEntry
from sphinx.environment import BuildEnvironment
from sphinx.util import logging
from sphinx.util.logging import get_node_location
from sphinx.util.nodes import make_refnode

logger = logging.getLogger(__name__)

#: A value's repr longer than this is left out of its entry (a registry's dict).
VALUE_CHARS = 200

#: Where the reference's pages are written, relative to the source folder (git-ignored).
REFERENCE = "docs/reference"


def public_modules(package: str = "pdjax", exclude: tuple[str, ...] = ()) -> list[str]:
    """Every module of ``package`` with no name part starting with ``_`` and not under a
    name of ``exclude``, sorted."""

    def excluded(name: str) -> bool:
        return any(name == e or name.startswith(f"{e}.") for e in exclude)

    root = importlib.import_module(package)
    names = [package]
    for info in pkgutil.walk_packages(root.__path__, f"{package}.", onerror=lambda _: None):
        parts = info.name.split(".")
        if not any(p.startswith("_") for p in parts) and not excluded(info.name):
            names.append(info.name)
    return sorted(names)


@dataclass(frozen=True)
class Home:
    """Where an object is documented: its page's module and its full name there."""

    module: str
    target: str


def _defined(module: Any) -> list[str]:
    """The public names a module's own source binds at its top level (also under ``if``
    and ``try``), in source order: what it defines, not what it imports."""
    try:
        tree = ast.parse(inspect.getsource(module))
    except (OSError, TypeError):
        return []
    names: list[str] = []

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.append(node.name)
            elif isinstance(node, ast.Assign):
                names.extend(t.id for t in node.targets if isinstance(t, ast.Name))
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.append(node.target.id)
            elif isinstance(node, ast.If | ast.Try):
                visit(node.body)
                visit(node.orelse)

    visit(tree.body)
    return [n for n in dict.fromkeys(names) if not n.startswith("_")]


def members(module: Any) -> list[str]:
    """What a module's page may document: the names of its ``__all__``, or else the public
    names its source defines (pdoc's choice too). Modules are left out."""
    names = getattr(module, "__all__", None)
    chosen = [str(n) for n in names] if names is not None else _defined(module)
    return [n for n in chosen if hasattr(module, n) and not inspect.ismodule(getattr(module, n))]


def _key(name: str, obj: Any) -> tuple[str, int]:
    """An object's identity across modules: its id, with the name it is bound to for a
    scalar (equal ints and strings may be one object under unrelated names)."""
    scalar = obj is None or isinstance(obj, int | float | complex | str | bytes)
    return (name, id(obj)) if scalar else ("", id(obj))


def homes(modules: list[str]) -> dict[tuple[str, int], Home]:
    """The home of every object that a module of ``modules`` documents (:func:`members`),
    by :func:`_key`: the module that defines it (``__module__``) where that documents it,
    else, of those that document it, one whose source binds the name (not an import), the
    deepest, then by name."""
    loaded = {name: importlib.import_module(name) for name in modules}
    exporters: dict[tuple[str, int], list[tuple[str, str]]] = {}
    objects: dict[tuple[str, int], Any] = {}
    binds: set[tuple[str, str]] = set()
    for name, module in loaded.items():
        binds |= {(name, defined) for defined in _defined(module)}
        for export in members(module):
            obj = getattr(module, export)
            exporters.setdefault(_key(export, obj), []).append((name, export))
            objects[_key(export, obj)] = obj
    found: dict[tuple[str, int], Home] = {}
    for key, where in exporters.items():
        obj = objects[key]
        defined = getattr(obj, "__module__", None)
        qualname = getattr(obj, "__qualname__", None)
        if isinstance(qualname, str) and (defined, qualname.split(".")[0]) in where:
            found[key] = Home(str(defined), f"{defined}.{qualname}")
            continue
        page, export = max(where, key=lambda w: (w in binds, w[0].count("."), w[0]))
        found[key] = Home(page, f"{page}.{export}")
    return found


#: Each documented name that is not its object's home (``pdjax.Plan``) -> the home's
#: (``pdjax.plan.plan.Plan``); set when the build starts.
ALIASES: dict[str, str] = {}


def aliases(modules: list[str], home: dict[tuple[str, int], Home]) -> dict[str, str]:
    """Every ``module.name`` of ``modules``' members whose home is elsewhere -> the home."""
    found = {}
    for name in modules:
        module = importlib.import_module(name)
        for export in members(module):
            target = home[_key(export, getattr(module, export))].target
            if target != f"{name}.{export}":
                found[f"{name}.{export}"] = target
    return found


def _is_code(obj: Any) -> bool:
    return inspect.isclass(obj) or inspect.isroutine(obj)


def module_page(name: str, home: dict[tuple[str, int], Home]) -> str:
    """The reST source of ``name``'s page: its docstring and the members at home there,
    then links to those it exports from their homes elsewhere."""
    module = importlib.import_module(name)
    here, elsewhere = [], []
    for export in members(module):
        place = home[_key(export, getattr(module, export))]
        if place.module == name:
            here.append(export)
        else:
            elsewhere.append(place.target)
    # autodoc's :members: takes classes and functions, and only values with a docstring:
    # each value is an autodata of its own, its value shown where it is short
    code = [n for n in here if _is_code(getattr(module, n))]
    # in no table of contents (the index links them): a sidebar of every module on every
    # page cost a third of the build's time
    lines = [":orphan:", "", name, "=" * len(name), "", f".. automodule:: {name}"]
    if code:
        lines += [f"   :members: {', '.join(code)}", "   :undoc-members:", "   :imported-members:"]
    lines.append("")
    for value in (n for n in here if n not in code):
        lines.append(f"   .. autodata:: {value}")
        if len(repr(getattr(module, value))) > VALUE_CHARS:
            lines.append("      :no-value:")
        lines.append("")
    if elsewhere:
        lines += ["Exported here, documented in their modules:", ""]
        lines += [f"* :py:obj:`~{target}`" for target in elsewhere]
        lines.append("")
    return "\n".join(lines)


def _write(path: Path, text: str) -> None:
    """Write ``text`` unless the file holds it already (Sphinx rereads changed files)."""
    if not path.is_file() or path.read_text(encoding="utf-8") != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def write_reference(app: Sphinx) -> None:
    """Write the reference's pages and its index into ``docs/reference/``."""
    modules = public_modules("pdjax", tuple(app.config.pdjax_api_exclude))
    home = homes(modules)
    ALIASES.clear()
    ALIASES.update(aliases(modules, home))
    folder = Path(app.srcdir) / REFERENCE
    wanted = {f"{name}.rst" for name in modules} | {"index.rst"}
    for stale in folder.glob("*.rst") if folder.is_dir() else []:
        if stale.name not in wanted:
            stale.unlink()
    for name in modules:
        _write(folder / f"{name}.rst", module_page(name, home))
    index = [
        "API reference",
        "=============",
        "",
        "Every public module of pdjax, one page each, from its docstrings (how they are "
        "read, and what is left out: :doc:`/docs/api`).",
        "",
        *(f"* :py:mod:`{name}`" for name in modules),
        "",
    ]
    _write(folder / "index.rst", "\n".join(index))


def guides(readme: str, docs: list[str]) -> list[str]:
    """The guides (``docs/<name>.md`` names) in the order the README first links them,
    then the others in alphabetical order.

    >>> guides("see [a](docs/cli.md) and [b](docs/api.md#x), [c](docs/cli.md)", ["api", "cli", "x"])
    ['cli', 'api', 'x']
    """
    linked = list(dict.fromkeys(re.findall(r"\]\(docs/([\w-]+)\.md", readme)))
    return [g for g in linked if g in docs] + sorted(set(docs) - set(linked))


def add_navigation(app: Sphinx, docname: str, source: list[str]) -> None:
    """Give the front page (README.md) the site's tables of contents, hidden."""
    if docname != app.config.root_doc:
        return
    root = Path(app.srcdir)
    docs = [p.stem for p in (root / "docs").glob("*.md") if p.stem != "index"]
    tables = [p.relative_to(root).with_suffix("").as_posix() for p in app.config.pdjax_tables]
    toc = ["", "```{toctree}", ":hidden:", ":caption: Guides", ""]
    toc += [f"docs/{g}" for g in guides(source[0], docs)]
    toc += ["```", "", "```{toctree}", ":hidden:", ":caption: Reference", ""]
    toc += [f"{REFERENCE}/index", "```", ""]
    if tables:
        toc += ["```{toctree}", ":hidden:", ":caption: Benchmark tables", ""]
        toc += [*sorted(tables), "```", ""]
    source[0] += "\n".join(toc)


def _home_of(target: str) -> str:
    """``target`` named at its object's home: ``pdjax.Plan.stages`` ->
    ``pdjax.plan.plan.Plan.stages`` (:data:`ALIASES`); else, for a class or function
    that a module imports without exporting it, where it is defined; else ``target``.

    >>> ALIASES["pdjax.Plan"] = "pdjax.plan.plan.Plan"
    >>> _home_of("pdjax.Plan.stages"), _home_of("pdjax.Planner")
    ('pdjax.plan.plan.Plan.stages', 'pdjax.Planner')
    """
    parts = target.split(".")
    for cut in range(len(parts), 0, -1):
        home = ALIASES.get(".".join(parts[:cut]))
        if home is not None:
            return ".".join([home, *parts[cut:]])
    for cut in range(len(parts) - 1, 0, -1) if parts[0] == "pdjax" else ():
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for i in range(cut, len(parts)):
            obj = getattr(obj, parts[i], None)
            defined = getattr(obj, "__module__", None)
            if _is_code(obj) and isinstance(defined, str):
                return ".".join([defined, obj.__qualname__, *parts[i + 1 :]])
        break
    return target


def resolve(
    app: Sphinx, env: BuildEnvironment, node: pending_xref, contnode: nodes.TextElement
) -> nodes.reference | None:
    """Link what Sphinx's Python domain left: a re-exported name, a bare name that one
    documented object has; warn on an explicit role naming an undocumented ``pdjax.``
    target (a private one, ``pdjax._jsonio``, stays code)."""
    if node.get("refdomain") != "py":
        return None
    domain: Any = env.get_domain("py")
    kind, target = node["reftype"], node["reftarget"].removesuffix("()")
    moved = _home_of(target)
    if moved != target:
        found = domain.find_obj(env, "", "", moved, kind, 0)
    else:
        found = domain.find_obj(env, node.get("py:module"), node.get("py:class"), target, kind, 1)
    if len({entry.node_id for _, entry in found}) == 1:
        name, entry = found[0]
        return make_refnode(
            app.builder, node["refdoc"], entry.docname, entry.node_id, contnode, name
        )
    private = any(part.startswith("_") for part in target.split("."))
    if target.startswith("pdjax.") and "refexplicit" in node and not private:
        logger.warning(
            "%s role to %s: documented nowhere (misspelt, moved or private?)",
            kind,
            target,
            location=node,
            type="pdjax",
            subtype="ref",
        )
    return None


class PythonDomain(sphinx.domains.python.PythonDomain):
    """Sphinx's Python domain, with its "fuzzy" search (a name that documented objects end
    with: the type of an argument, ``:mod:`.stages```) looked up in an index rather than
    by a scan of every object (half of the build's time without it), and, where several
    objects end with the name, the nearest taken: the one sharing the longest dotted prefix
    with the module (and class) it is written in (``.stages`` in a module of
    ``pdjax.pipeline.executor`` is ``pdjax.pipeline.executor.stages``)."""

    _suffixes: tuple[int, dict[str, list[str]]] = (-1, {})

    def _by_suffix(self) -> dict[str, list[str]]:
        """Every dotted suffix of every object's name (``Plan``, ``plan.Plan``) -> the
        names; made again whenever objects were added."""
        if self._suffixes[0] != len(self.objects):
            index: dict[str, list[str]] = {}
            for full in self.objects:
                parts = full.split(".")
                for i in range(1, len(parts)):
                    index.setdefault(".".join(parts[i:]), []).append(full)
            self._suffixes = (len(self.objects), index)
        return self._suffixes[1]

    def find_obj(
        self,
        env: BuildEnvironment,
        modname: str,
        classname: str,
        name: str,
        type: str | None,
        searchmode: int = 0,
    ) -> list[tuple[str, ObjectEntry]]:
        name = name.removesuffix("()")
        if searchmode != 1 or not name:
            return super().find_obj(env, modname, classname, name, type, searchmode)
        kinds = list(self.object_types) if type is None else self.objtypes_for_role(type)
        if kinds is None:
            return []
        exact = [f"{modname}.{classname}.{name}" if modname and classname else ""]
        exact += [f"{modname}.{name}" if modname else "", name]
        for full in exact:
            if full in self.objects and self.objects[full].objtype in kinds:
                return [(full, self.objects[full])]
        found = [
            (full, self.objects[full])
            for full in self._by_suffix().get(name, [])
            if self.objects[full].objtype in kinds
        ]
        if len(found) < 2:
            return found
        found = [f for f in found if not f[1].aliased] or found
        here = [p for p in (modname or "").split(".") + (classname or "").split(".") if p]

        def shared(candidate: str) -> int:
            count = 0
            for a, b in zip(here, candidate.split("."), strict=False):
                if a != b:
                    break
                count += 1
            return count

        nearest = max(shared(f[0]) for f in found)
        return [f for f in found if shared(f[0]) == nearest]


def skip_field_aliases(
    app: Sphinx, what: str, name: str, obj: Any, skip: bool, options: Any
) -> bool | None:
    """Leave out a NamedTuple's generated field docs ("Alias for field number 0"): the
    class's ``Attributes:`` section describes its fields."""
    doc = getattr(obj, "__doc__", None)
    if isinstance(doc, str) and doc.startswith("Alias for field number"):
        return True
    return None


#: What napoleon leaves as written: a value's or property's docstring, which it would read
#: as Google's ``type: description`` ("The planner's replication option: ..." made a type).
AS_WRITTEN = frozenset({"data", "attribute", "property"})


_HELD: list[list[str]] = []  # the docstring between the two listeners


def hold_values(
    app: Sphinx, what: str, name: str, obj: Any, options: Any, lines: list[str]
) -> None:
    """Before napoleon: take a value's docstring out of its reach (:data:`AS_WRITTEN`)."""
    if what in AS_WRITTEN:
        _HELD.append(lines[:])
        lines.clear()


def restore_values(
    app: Sphinx, what: str, name: str, obj: Any, options: Any, lines: list[str]
) -> None:
    """After napoleon: put the value's docstring back."""
    if what in AS_WRITTEN:
        lines[:] = _HELD.pop()


def title_tables(app: Sphinx, docname: str, source: list[str]) -> None:
    """Give a benchmark table without a title (a script's output) its path as title."""
    if not docname.startswith("benchmarks/results/"):
        return
    first = next((line for line in source[0].splitlines() if line.strip()), "")
    if not first.startswith("# "):
        source[0] = f"# `{docname}.md`\n\n{source[0]}"


class _Known(logging_.Filter):
    """Drops the warnings that ``pdjax_known_warnings`` lists, before Sphinx counts them."""

    def __init__(self, known: list[tuple[str, str]]) -> None:
        super().__init__()
        self.known = [(re.compile(where), re.compile(what)) for where, what in known]

    def filter(self, record: logging_.LogRecord) -> bool:
        location = getattr(record, "location", None)
        if isinstance(location, nodes.Node):
            location = get_node_location(location)
        where, what = str(location), record.getMessage()
        return not any(w.search(where) and m.search(what) for w, m in self.known)


def known_warnings(app: Sphinx) -> None:
    """Keep the warnings that ``pdjax_known_warnings`` lists (docs/conf.py says why each)
    from failing the build: a filter on Sphinx's warning handler, ahead of its counter."""
    if not app.config.pdjax_known_warnings:
        return
    for handler in logging_.getLogger(logging.NAMESPACE).handlers:
        if isinstance(handler, logging.WarningStreamHandler):
            handler.filters.insert(0, _Known(app.config.pdjax_known_warnings))


def front_door(app: Sphinx, exception: Exception | None) -> None:
    """An ``index.html`` that sends a browser to the front page (the README's)."""
    if exception is not None or app.builder.format != "html" or app.config.root_doc == "index":
        return
    page = f"{app.config.root_doc}.html"
    (Path(app.outdir) / "index.html").write_text(
        f'<!DOCTYPE html>\n<meta charset="utf-8">\n<title>{app.config.project}</title>\n'
        f'<meta http-equiv="refresh" content="0; url={page}">\n'
        f'<link rel="canonical" href="{page}">\n<a href="{page}">{page}</a>\n',
        encoding="utf-8",
    )


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_config_value("pdjax_api_exclude", [], "env")
    app.add_config_value("pdjax_tables", [], "env")
    app.add_config_value("pdjax_known_warnings", [], "env")
    app.add_domain(PythonDomain, override=True)
    app.connect("builder-inited", known_warnings)
    app.connect("builder-inited", write_reference)
    app.connect("source-read", add_navigation)
    app.connect("source-read", title_tables)
    app.connect("missing-reference", resolve)
    app.connect("build-finished", front_door)
    app.connect("autodoc-skip-member", skip_field_aliases)
    # napoleon's listener has the default priority, 500
    app.connect("autodoc-process-docstring", hold_values, priority=400)
    app.connect("autodoc-process-docstring", restore_values, priority=600)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
