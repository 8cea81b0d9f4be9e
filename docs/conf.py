"""Sphinx's settings for pdjax's documentation site (docs/api.md): run from the repository's
root, ``sphinx-build -c docs . build/docs`` (``make docs``)."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]

import pdjax  # noqa: E402

project = "pdjax"
release = version = pdjax.__version__
copyright = "pdjax's authors"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "docs_site",
]

# the front page is the README; the guides, the reference and the benchmark tables around it
root_doc = "README"
include_patterns = ["README.md", "docs/*.md", "docs/reference/*.rst", "benchmarks/results/**.md"]
# (what Sphinx need not walk through: it looks for sources in every other folder)
exclude_patterns = [".*", "build", "out", "pdjax", "tests", "examples", "tools", "**/__pycache__"]
pdjax_tables = sorted((ROOT / "benchmarks" / "results").rglob("*.md"))
# moving out of the package into benchmarks/ (not part of the library's reference)
pdjax_api_exclude = [
    "pdjax.apps.cluster",
    "pdjax.apps.netem",
    "pdjax.apps.bench_host",
    "pdjax.apps.bench_report",
    "pdjax.apps.cluster_tta",
]

# Markdown: GitHub's anchors for headings, so that links written for GitHub resolve here
myst_heading_anchors = 6
myst_enable_extensions = ["colon_fence"]

# the reference: Google-style docstrings, members in source order, one page per module
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# a class's Attributes: section as a field list, not entries of their own (autodoc gives
# each field one: two would be duplicates)
napoleon_use_ivar = True
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_typehints_format = "short"

html_theme = "furo"
html_title = f"pdjax {release}"
html_show_sourcelink = False

# Warnings let through, each (where, what) a pattern: in files another change is rewriting
pdjax_known_warnings: list[tuple[str, str]] = []
