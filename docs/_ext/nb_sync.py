"""The notebooks of notebooks/ made visible to Sphinx, which reads sources under docs/ only.

``sync(src, dst)`` copies every ``src/*.ipynb`` into ``dst`` (docs/notebooks/, git-ignored)
when docs/conf.py is loaded, i.e. before Sphinx looks for its sources; docs/notebooks.md lists
them with a glob toctree, so a new notebook appears without an edit here.  A copy is made only
when the content changed (a warm build does not re-read them) and a copy whose notebook was
removed is deleted.  Symlinks checked into git would also work on Linux, but a new notebook
would need a new link by hand, and Windows checkouts turn links into text files.
"""
from __future__ import annotations

import filecmp
import shutil
from pathlib import Path
from typing import List


def sync(src: Path, dst: Path) -> List[str]:
    """Copy ``src/*.ipynb`` into ``dst``; returns the notebook names, sorted."""
    wanted = {p.name: p for p in sorted(src.glob("*.ipynb"))}
    if not wanted:
        raise RuntimeError(f"docs: no notebooks found in {src}")
    dst.mkdir(parents=True, exist_ok=True)
    for stale in dst.glob("*.ipynb"):
        if stale.name not in wanted:
            stale.unlink()
    for name, path in wanted.items():
        target = dst / name
        if not target.exists() or not filecmp.cmp(path, target, shallow=False):
            shutil.copy2(path, target)
    return sorted(wanted)
