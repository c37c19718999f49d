"""Sphinx configuration of functrans's documentation site.

Build:  bash scripts/docs.sh   (= bash scripts/setup.sh docs, then
        .venv/bin/sphinx-build -W --keep-going -b html docs docs/_build/html)

Sources: the pages under docs/ (MyST markdown), the API reference from the docstrings
(autodoc + napoleon, so both Google-style "Args:/Returns:/Example:" sections and the older
reST-style docstrings render), the notebooks of notebooks/ (rendered by MyST-NB from their
stored outputs, never executed here; copied in by ``_sync_notebooks`` below), docs/misuse.md
(included by errors.md) and the README's benchmark tables (parsed into a page and plots by
docs/_ext/bench_page.py when the build starts).
"""
from __future__ import annotations

import filecmp
import shutil
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))            # the checkout's functrans and benchmarks packages
sys.path.insert(0, str(DOCS / "_ext"))

import functrans  # noqa: E402

project = "functrans"
author = "the functrans authors"
copyright = "functrans authors"
release = version = functrans.__version__

extensions = [
    "myst_nb",                 # MyST markdown pages and .ipynb notebooks
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",     # Google-style Args:/Returns:/Example: sections
    "sphinx.ext.viewcode",
    "bench_page",              # docs/_ext/bench_page.py: the benchmark page from the README
]

# --- notebooks -------------------------------------------------------------------------------
# The notebooks live in notebooks/ (stored with their outputs by notebooks/build.py).  Sphinx
# only reads sources under docs/, so every notebooks/*.ipynb is copied to docs/notebooks/ (a
# git-ignored folder) when this file is loaded, i.e. before Sphinx looks for its sources.  A copy
# is made only when the content changed, so a warm build does not re-read them; a copy whose
# notebook was removed is deleted.  (Symlinks checked into git would also work on Linux, but a
# new notebook would then need a new link by hand, and Windows checkouts turn them into text.)
NOTEBOOKS_SRC = ROOT / "notebooks"
NOTEBOOKS_DST = DOCS / "notebooks"


def _sync_notebooks() -> None:
    NOTEBOOKS_DST.mkdir(exist_ok=True)
    wanted = {p.name: p for p in sorted(NOTEBOOKS_SRC.glob("*.ipynb"))}
    if not wanted:
        raise RuntimeError(f"docs: no notebooks found in {NOTEBOOKS_SRC}")
    for stale in NOTEBOOKS_DST.glob("*.ipynb"):
        if stale.name not in wanted:
            stale.unlink()
    for name, src in wanted.items():
        dst = NOTEBOOKS_DST / name
        if not dst.exists() or not filecmp.cmp(src, dst, shallow=False):
            shutil.copy2(src, dst)


_sync_notebooks()

nb_execution_mode = "off"      # rendered from the outputs stored in the notebooks
nb_merge_streams = True

# --- MyST ------------------------------------------------------------------------------------
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3       # docs/misuse.md links its entries as [id](#id)

# --- autodoc ---------------------------------------------------------------------------------
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_format = "short"
autodoc_preserve_defaults = True
autodoc_default_options = {"show-inheritance": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

# --- sources ---------------------------------------------------------------------------------
source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}
# misuse.md is included by errors.md and _generated/ by benchmarks.md, not pages of their own.
exclude_patterns = ["_build", "_generated", "misuse.md", "**.ipynb_checkpoints"]
suppress_warnings = ["myst.header"]   # notebooks start at "#" then skip to "###" in places

# --- HTML ------------------------------------------------------------------------------------
html_theme = "furo"
html_title = f"functrans {release}"
html_static_path: list = []
