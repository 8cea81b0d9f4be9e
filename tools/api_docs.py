"""Build pdjax's HTML API reference with pdoc, and fail on any warning.

Run as ``python tools/api_docs.py [--out build/api]`` (``make docs``), or with ``--check``
(``make lint``): rendered without the source views and search index into a temporary
folder, kept nowhere. See docs/api.md.

It renders every public module of pdjax (no name part starting with ``_``; ``pdjax.apps``
too, the applications on the library), one page each, from Google-style docstrings. pdoc
itself would stop at what a package's ``__all__`` names: the modules are listed here.

What it adds to ``pdoc -d google``, through pdoc's template filters and before rendering:

* Sphinx roles (``:func:`~pdjax.x.y```, ``:class:``, ``:mod:``, ``:meth:``, ``:attr:``,
  ``:data:``, ``:exc:``; ``~``, ``!``, ``title <target>``) become code spans of their
  target (``:func:`` and ``:meth:`` with ``()``), which pdoc links: a dotted name from
  anywhere, a bare name in the docstring's own module and class. A bare target pdoc
  leaves is linked here where exactly one documented object of pdjax has that qualified
  name (``Plan``, ``Profile.content_hash``), as Sphinx would; ``~`` shows the last name;
* a dataclass's or NamedTuple's generated ``__init__`` gets its fields' annotations
  evaluated in the modules that declare them (pdoc would look in the wrong one);
* it fails (exit status 1) on any warning that pdoc or an import gives (but the two in
  ``KNOWN``, about optax's and argparse's types), and on any role naming a ``pdjax.``
  target that is not documented (misspelt, moved or private), each listed with its page.
  Roles to bare names that stay unlinked (another package's, ambiguous, undocumented)
  are counted, and listed with ``--bare``.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import re
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, ForwardRef

import pdoc
import pdoc.doc
import pdoc.docstrings
import pdoc.render
import pdoc.render_helpers
from markupsafe import Markup

ROLES = {"func", "meth", "class", "mod", "data", "attr", "exc", "obj", "const"}
CALLABLE_ROLES = {"func", "meth"}
# :role:`target`, :py:role:`target`; the target may span lines in a docstring
ROLE = re.compile(r":(?:py:)?(?P<role>[a-z]+):`(?P<body>[^`]+)`")
TITLED = re.compile(r"(?s)(?P<title>.*?)\s*<(?P<target>[^<>]+)>")
# a name left unlinked in a rendered docstring: <code>x.y</code>, <code>f()</code>
UNLINKED = re.compile(r"<code>([A-Za-z_][\w.]*(?:\(\))?)</code>")
# a linked one: <code><a href="...">x.y</a></code>
LINKED = re.compile(r'<code><a href="(?P<href>[^"]*)">(?P<name>[\w.]+(?:\(\))?)</a></code>')


# warnings about others' code, which the reference shows as written
KNOWN = [
    # optax.OptState is a recursive alias (ForwardRef('ArrayTree')) only optax can evaluate
    r"^Error parsing type annotation .*Import of ArrayTree failed: name 'ArrayTree' is not",
    # generic in typeshed only: argparse._SubParsersAction[...] fails at run time
    r"^Error parsing type annotation argparse\._SubParsersAction\[",
]


def public_modules(package: str = "pdjax") -> list[str]:
    """Every module of ``package`` whose name has no part starting with ``_``, sorted."""
    root = __import__(package)
    names = [package]
    for info in pkgutil.walk_packages(root.__path__, f"{package}."):
        if not any(part.startswith("_") for part in info.name.split(".")):
            names.append(info.name)
    return sorted(names)


def roles_to_markdown(
    docstring: str, targets: set[str] | None = None, short: set[str] | None = None
) -> str:
    """Turn Sphinx roles into code spans of their targets, which pdoc links.

    ``targets``, if given, collects the targets (without ``()``); ``short`` those written
    with ``~`` (shown by their last name, once linked).

    >>> roles_to_markdown(":func:`~pdjax.profile.profile` and :class:`Plan <pdjax.Plan>`")
    '`pdjax.profile.profile()` and `pdjax.Plan`'
    >>> roles_to_markdown(":meth:`Schedule.grid`, :math:`x`")
    '`Schedule.grid()`, :math:`x`'
    >>> short = set()
    >>> roles_to_markdown(":class:`~pdjax.Plan`, :func:`!pdjax.profile`", short=short), short
    ('`pdjax.Plan`, `pdjax.profile()`', {'pdjax.Plan'})
    """

    def replace(m: re.Match[str]) -> str:
        role, body = m["role"], m["body"]
        if role not in ROLES:
            return m[0]
        titled = TITLED.fullmatch(body)
        target = titled["target"] if titled else body
        target = re.sub(r"\s+", "", target).lstrip("!")
        tilde = target.startswith("~")
        target = target.lstrip("~").removesuffix("()")
        if targets is not None:
            targets.add(target)
        if tilde and short is not None:
            short.add(target)
        return f"`{target}()`" if role in CALLABLE_ROLES else f"`{target}`"

    return ROLE.sub(replace, docstring)


class _Roles:
    """pdoc's ``to_markdown`` and ``linkify`` filters, with Sphinx roles.

    The template runs a docstring through ``to_markdown``, then ``linkify``. The first turns
    the docstring's roles into code spans and notes their targets; the second lets pdoc
    link them, then links a bare target pdoc left (pdoc looks a bare name up in the
    docstring's own module and class only) where exactly one documented object of pdjax
    has that qualified name (``Plan``, ``Profile.content_hash``), as Sphinx would, and notes
    the targets still unlinked.
    """

    def __init__(self, to_markdown: Any, linkify: Any) -> None:
        self.to_markdown_filter, self.linkify_filter = to_markdown, linkify
        self.targets: set[str] = set()  # the roles' targets in the current docstring
        self.short: set[str] = set()  # those written with ~
        self.unlinked: set[str] = set()  # "page.namespace: `target`"
        self.index: dict[str, list[tuple[str, str, int]]] | None = None

    def to_markdown(self, context: Any, docstring: str) -> str:
        self.targets, self.short = set(), set()
        markdown = roles_to_markdown(docstring, self.targets, self.short)
        return str(self.to_markdown_filter(context, markdown))

    def linkify(self, context: Any, code: str, namespace: str = "", shorten: bool = True) -> Markup:
        html = str(self.linkify_filter(context, code, namespace=namespace, shorten=shorten))
        here = context["module"].modulename
        where = here + (f".{namespace}" if namespace else "")

        def link(m: re.Match[str]) -> str:
            name = m[1].removesuffix("()")
            if name not in self.targets or any(p.startswith("_") for p in name.split(".")):
                return m[0]
            found = self._index(context).get(name, [])
            if len({obj for _, _, obj in found}) != 1:  # none, or several objects
                self.unlinked.add(f"{where}: `{name}`")
                return m[0]
            # a variable's pdoc cannot trace: its deepest page (where it is defined)
            module, qualname, _ = max(found, key=lambda f: f[0].count("."))
            href = f"{pdoc.render_helpers.relative_link(here, module)}#{qualname}"
            return f'<code><a href="{href}">{m[1]}</a></code>'

        def shorten_tilde(m: re.Match[str]) -> str:
            name = m["name"].removesuffix("()")
            if name not in self.short:
                return m[0]
            return f'<code><a href="{m["href"]}">{m["name"].rpartition(".")[2]}</a></code>'

        return Markup(LINKED.sub(shorten_tilde, UNLINKED.sub(link, html)))

    def _index(self, context: Any) -> dict[str, list[tuple[str, str, int]]]:
        """Qualified name -> (page, qualified name, object id) of each documented object
        of that name where it is defined (pdoc's ``taken_from``; every page that holds a
        variable)."""
        if self.index is None:
            self.index = {}
            for module in context["all_modules"].values():
                for doc in _walk(module):
                    here = (module.modulename, doc.qualname)
                    if doc.taken_from == here and context["is_public"](doc).strip():
                        self.index.setdefault(doc.qualname, []).append((*here, id(doc.obj)))
        return self.index

    def install(self) -> None:
        # both take the template's context first, as pdoc's own do (jinja's pass_context)
        passed = self.linkify_filter.jinja_pass_arg
        self.to_markdown.__func__.jinja_pass_arg = passed  # type: ignore[attr-defined]
        self.linkify.__func__.jinja_pass_arg = passed  # type: ignore[attr-defined]
        pdoc.render.env.filters["to_markdown"] = self.to_markdown
        pdoc.render.env.filters["linkify"] = self.linkify


def _walk(namespace: Any) -> Any:
    """The members of a pdoc module or class, and of their classes, recursively."""
    for doc in namespace.members.values():
        yield doc
        if isinstance(doc, pdoc.doc.Class):
            yield from _walk(doc)


def _annotations_where_written(modules: list[str]) -> None:
    """Evaluate the annotations of generated ``__init__``/``__new__`` where they were written.

    A dataclass's ``__init__`` and a NamedTuple's ``__new__`` carry their fields'
    annotations as strings (``from __future__ import annotations``); pdoc evaluates them in
    the module of the class, or of no module for a NamedTuple's ``__new__``, and so cannot
    find a name that a field inherited from another module's class uses (``Layer`` in
    ``LayerSequence``), nor ``PyTree`` in a NamedTuple. Each is evaluated here in the module
    of the class that declares the field; what fails is left to pdoc.
    """
    for name in modules:
        for cls in list(vars(importlib.import_module(name)).values()):
            if not (isinstance(cls, type) and cls.__module__ == name):
                continue
            written: dict[str, Any] = {}
            for base in reversed(cls.__mro__):
                module = sys.modules.get(base.__module__)
                for field, annotation in vars(base).get("__annotations__", {}).items():
                    if isinstance(annotation, ForwardRef):  # a NamedTuple's
                        annotation = annotation.__forward_arg__
                    if isinstance(annotation, str) and module is not None:
                        try:
                            written[field] = eval(annotation, vars(module))
                        except Exception:
                            written.pop(field, None)
            for method in ("__init__", "__new__"):
                function = getattr(cls, method) if method in vars(cls) else None
                code = getattr(function, "__code__", None)
                if code is None or code.co_filename != "<string>":  # not generated
                    continue
                annotations = function.__annotations__
                for field, annotation in annotations.items():
                    if isinstance(annotation, str | ForwardRef) and field in written:
                        annotations[field] = written[field]


def build(out: Path, full: bool = True) -> tuple[list[str], list[str]]:
    """Render the reference into ``out`` (emptied first).

    Returns the warnings (pdoc's and imports', and roles naming a ``pdjax.`` target that
    pdoc could not link), and the roles naming a bare target (``:class:`Plan```) it could
    not link: pdoc looks a bare name up in the docstring's own module and class only.
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        unlinked = _render(out, full)
    found = [
        f"{w.category.__name__}: {w.message}"
        for w in caught
        if not any(re.search(known, str(w.message)) for known in KNOWN)
    ]
    qualified = [f"{u} not found" for u in unlinked if u.split("`")[1].startswith("pdjax.")]
    bare = [f"{u} not found here" for u in unlinked if not u.split("`")[1].startswith("pdjax.")]
    return found + qualified, bare


def _render(out: Path, full: bool) -> list[str]:
    modules = public_modules()
    _annotations_where_written(modules)
    env = pdoc.render.env
    checks = _Roles(env.filters["to_markdown"], env.filters["linkify"])
    checks.install()
    pdoc.render.configure(
        docformat="google",
        footer_text=f"pdjax {sys.modules['pdjax'].__version__}",
        show_source=full,
        search=full,
    )
    if out.exists():
        shutil.rmtree(out)
    # pdoc.pdoc(*modules) would also add each package's submodules that its __all__ names
    # (a second time: warnings); render exactly these
    docs = {name: pdoc.doc.Module.from_name(name) for name in modules}
    for name, module in docs.items():
        page = out / f"{name.replace('.', '/')}.html"
        page.parent.mkdir(parents=True, exist_ok=True)
        page.write_text(pdoc.render.html_module(module, docs), encoding="utf-8")
    (out / "index.html").write_text(pdoc.render.html_index(docs), encoding="utf-8")
    if full:
        (out / "search.js").write_text(pdoc.render.search_index(docs), encoding="utf-8")
    return sorted(checks.unlinked)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("build/api"), help="(build/api)")
    parser.add_argument(
        "--check",
        action="store_true",
        help="only check: render without source and search into a temporary folder (halves "
        "the time), keep nothing",
    )
    parser.add_argument(
        "--bare",
        action="store_true",
        help="also list the roles not naming pdjax.… that are left unlinked",
    )
    args = parser.parse_args(argv)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) if args.check else args.out
        found, bare = build(out, full=not args.check)
        pages = sum(1 for _ in out.rglob("*.html"))
    seconds = time.perf_counter() - start
    for line in found:
        print(f"warning: {line}", file=sys.stderr)
    for line in bare if args.bare else []:
        print(f"note: {line}", file=sys.stderr)
    where = "checked" if args.check else f"in {args.out}/"
    print(
        f"API reference: {pages} pages {where} ({seconds:.0f} s), {len(found)} warnings; "
        f"{len(bare)} roles to other packages' or undocumented names left unlinked "
        "(--bare lists them)"
    )
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
