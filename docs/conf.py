"""Sphinx configuration of functrans's documentation site.

Build:  bash scripts/docs.sh   (= bash scripts/setup.sh docs, then
        .venv/bin/sphinx-build -W --keep-going -b html docs docs/_build/html)

Sources: the pages under docs/ (MyST markdown), the API reference from the docstrings
(autodoc + napoleon, so both Google-style "Args:/Returns:/Example:" sections and the older
reST-style docstrings render), the notebooks of notebooks/ (rendered by MyST-NB from their
stored outputs, never executed here; copied in by docs/_ext/nb_sync.py), docs/misuse.md
(included by errors.md) and the README's benchmark tables (parsed into a page and plots by
docs/_ext/bench_page.py when the build starts).
"""
from __future__ import annotations

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))            # the checkout's functrans and benchmarks packages
sys.path.insert(0, str(DOCS / "_ext"))

import functrans  # noqa: E402
import nb_sync  # noqa: E402  (docs/_ext/nb_sync.py)

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
# notebooks/*.ipynb (stored with their outputs by notebooks/build.py) are copied into the
# git-ignored docs/notebooks/ now, before Sphinx looks for sources (docs/_ext/nb_sync.py says why
# a copy and not symlinks); docs/notebooks.md lists them with a glob.
nb_sync.sync(ROOT / "notebooks", DOCS / "notebooks")

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
# Sections the transforms' docstrings use beyond napoleon's own (rendered like "Note:").
napoleon_custom_sections = ["Shapes", "Shape"]

# --- sources ---------------------------------------------------------------------------------
source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}
# misuse.md is included by errors.md and _generated/ by benchmarks.md, not pages of their own.
exclude_patterns = ["_build", "_generated", "misuse.md", "**.ipynb_checkpoints"]

# --- HTML ------------------------------------------------------------------------------------
html_theme = "furo"
html_title = f"functrans {release}"
html_static_path: list = []
