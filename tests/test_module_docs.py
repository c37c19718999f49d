"""Every module's docstring says what it may import, and its imports keep to it.

The convention (stated in ARCHITECTURE.md, "Module docstrings"):

* the module docstring has exactly one line that starts with ``Imports:``; the statement runs
  from there to the first blank line (it may wrap) and ends at its first full stop (a ``.``
  followed by a space, a line end or nothing): what follows is free text;
* text in parentheses is ignored (a reason, a note), so is a trailing ``.``;
* what is left is a comma-separated list of module names, or the single word ``nothing``;
* a name is relative to the module's package and the packages around it, looked up from the
  innermost out: in ``functrans/batching/dispatch.py``, ``registry`` is
  ``functrans.batching.registry`` and ``errors`` is ``functrans.errors``; in
  ``functrans/nn/dp.py``, ``autodiff.grad`` is ``functrans.autodiff.grad``;
* the rules files (``functrans/batching/rules/*.py``) share one line: the one of
  ``rules/__init__.py``.

The check: every package module a module imports (module-level or inside a function, as
``tests/support/import_graph.py`` reads them) is named by its Imports line, and every name on
the line is a module of the package (no stale names).  Listing a module that is not imported
is allowed: the line says what a module MAY import.
"""
from __future__ import annotations

import ast
import functools
import re
from typing import Dict, List, Optional, Set, Tuple

import pytest

from tests.support import import_graph

PACKAGE = import_graph.PACKAGE
RULES = f"{PACKAGE}.batching.rules"
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def _strip_parens(text: str) -> str:
    out, depth = [], 0
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth = max(depth - 1, 0)
        elif depth == 0:
            out.append(ch)
    return "".join(out)


def parse_imports_line(doc: Optional[str]) -> Tuple[Optional[List[str]], str]:
    """``(names, problem)``: the names of the docstring's Imports line, or None and why not."""
    if not doc:
        return None, "no module docstring"
    lines = doc.splitlines()
    starts = [i for i, line in enumerate(lines) if line.lstrip().startswith("Imports:")]
    if not starts:
        return None, "no line starting with 'Imports:' in the module docstring"
    if len(starts) > 1:
        return None, f"{len(starts)} lines start with 'Imports:' (one is expected)"
    para = []
    for line in lines[starts[0]:]:
        if not line.strip():
            break
        para.append(line.strip())
    text = _strip_parens(" ".join(para)[len("Imports:"):])
    text = re.split(r"\.(?:\s|$)", text, maxsplit=1)[0]
    items = [x.strip() for x in text.split(",")]
    if items == ["nothing"]:
        return [], ""
    bad = [x for x in items if not _NAME.fullmatch(x)]
    if bad:
        return None, (f"the Imports line lists {bad!r}, which are not module names (free text "
                      "goes in parentheses or after the first full stop)")
    return items, ""


def _package_of(module: str, path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def resolve(name: str, package: str, modules: Set[str]) -> Optional[str]:
    """The package module ``name`` names, looked up from ``package`` outwards."""
    prefix = package
    while True:
        full = f"{prefix}.{name}" if prefix else name
        if full in modules:
            return full
        if not prefix:
            return None
        prefix = prefix.rpartition(".")[0]


def _docstring(path) -> Optional[str]:
    return ast.get_docstring(ast.parse(path.read_text(), str(path)), clean=True)


def _is_rules_file(module: str) -> bool:
    return module.startswith(RULES + ".")


@functools.lru_cache(maxsize=None)
def allowed_imports() -> Dict[str, Tuple[Optional[Set[str]], str]]:
    """{module: (the package modules its Imports line names, or None; the problem if None)}."""
    mods = import_graph.modules()
    names = set(mods)
    out: Dict[str, Tuple[Optional[Set[str]], str]] = {}
    for module, path in mods.items():
        owner = RULES if _is_rules_file(module) else module
        items, problem = parse_imports_line(_docstring(mods[owner]))
        where = "" if owner == module else f" (the rules files' line is {owner}'s)"
        if items is None:
            out[module] = (None, problem + where)
            continue
        package = _package_of(owner, mods[owner])
        resolved, stale = set(), []
        for item in items:
            target = resolve(item, package, names)
            if target is None:
                stale.append(item)
            else:
                resolved.add(target)
        out[module] = (None, f"the Imports line names {stale!r}, which are not modules of "
                             f"the package{where}") if stale else (resolved, "")
    return out


def test_the_parser_on_examples():
    """The parsing rules of the module docstring, on small docstrings."""
    assert parse_imports_line("Title.\n\nImports: errors, batched_tensor.\n") == \
        (["errors", "batched_tensor"], "")
    # wrapped, with notes in parentheses (even across lines) and free text after the full stop
    assert parse_imports_line("T.\n\nImports: errors, functionalization (its state: is a\n"
                              "functionalize active?), registry.  Never the mode.\n") == \
        (["errors", "functionalization", "registry"], "")
    assert parse_imports_line("Imports: nothing (torch only).") == ([], "")
    assert parse_imports_line("Imports: autodiff.grad, nn.stateless") == \
        (["autodiff.grad", "nn.stateless"], "")
    assert parse_imports_line("Imports: errors only")[0] is None   # free text needs ( )
    assert parse_imports_line("A docstring without it.")[0] is None
    assert parse_imports_line(None)[0] is None
    assert parse_imports_line("Imports: a.\nImports: b.")[0] is None
    mods = {"functrans", "functrans.errors", "functrans.batching", "functrans.batching.registry",
            "functrans.autodiff.grad"}
    assert resolve("registry", "functrans.batching", mods) == "functrans.batching.registry"
    assert resolve("errors", "functrans.batching", mods) == "functrans.errors"
    assert resolve("autodiff.grad", "functrans.nn", mods) == "functrans.autodiff.grad"
    assert resolve("functrans", "functrans", mods) == "functrans"
    assert resolve("functionalize", "functrans.batching", mods) is None


@functools.lru_cache(maxsize=None)
def _graph():
    return import_graph.graph()


def _cases():
    return sorted(import_graph.modules())


@pytest.mark.parametrize("module", _cases())
def test_imports_are_named_by_the_docstring(module):
    allowed, problem = allowed_imports()[module]
    assert allowed is not None, f"{module}: {problem}"
    imported = _graph()[module]
    missing = sorted(t for t in imported if t not in allowed)
    assert not missing, (
        f"{module} imports {[m.removeprefix(PACKAGE + '.') for m in missing]}, which its "
        f"docstring's Imports line does not name"
        + (" (rules files: the line of functrans/batching/rules/__init__.py)"
           if _is_rules_file(module) else "")
        + ".  Add them to the line (names relative to the module's package), or drop the "
          "import.")


def test_every_module_is_checked():
    """The parametrised test above covers every module the import graph knows."""
    assert len(_cases()) > 60
    assert f"{RULES}.reductions" in _cases() and f"{PACKAGE}.nn.dp" in _cases()
