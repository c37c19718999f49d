"""Finds uses of the reference library (torch.func & co.) in Python source, read with ``ast``.

functrans must never run on ``torch.func``, ``torch.vmap``, ``functorch``, ``torch._functorch``,
``torch._C._functorch`` or ``torch.autograd.functional`` (which uses functorch inside): they are
what the tests compare against.  This module looks at what the CODE does, not at its words, so a
docstring or a comment may name torch.func.  A use is any of:

* an ``import`` or ``from ... import`` of a forbidden module or of a name in one, at module level
  or inside a function (``from torch import func``, ``from torch import vmap``,
  ``from torch.autograd import functional``, ``import torch._functorch.apis``);
* a call ``importlib.import_module("...")`` / ``import_module("...")`` / ``__import__("...")``
  whose first argument is a literal string naming a forbidden module;
* an attribute chain that reaches one (``torch.func.grad``, ``torch.vmap(f)``, ``T.func`` after
  ``import torch as T``, ``autograd.functional`` after ``from torch import autograd``), or
  ``getattr(torch, "func")`` with a literal name.

``uses(source)`` returns ``[(line, what)]`` for one source text; ``package_uses(root)`` walks a
folder.  ``aliases``/``dotted`` (the dotted name an attribute chain reaches, through the
source's imports) serve other ast checks too (tests/test_import_graph.py).  Imports only ``ast``
and ``pathlib``.
"""
from __future__ import annotations

import ast
import pathlib
from typing import Dict, List, Tuple

FORBIDDEN = ("torch.func", "torch.vmap", "functorch", "torch._functorch", "torch._C._functorch",
             "torch.autograd.functional")


def forbidden(dotted: str) -> bool:
    """Whether a dotted name is (inside) a forbidden module or is ``torch.vmap``."""
    return any(dotted == f or dotted.startswith(f + ".") for f in FORBIDDEN)


def aliases(tree: ast.AST) -> Dict[str, str]:
    """Local name -> the dotted module/object it is bound to by an import anywhere in the
    source (scopes are not told apart: a name bound to torch somewhere counts everywhere)."""
    out: Dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    out[a.asname] = a.name
                else:  # ``import torch.autograd`` binds ``torch``
                    root = a.name.split(".")[0]
                    out.setdefault(root, root)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for a in node.names:
                if a.name != "*":
                    out[a.asname or a.name] = f"{node.module}.{a.name}"
    return out


def dotted(node: ast.AST, names: Dict[str, str]) -> str:
    """``a.b.c`` of a chain of Attribute nodes on a Name, with the Name resolved through the
    imports; "" when the chain does not start at a Name."""
    parts: List[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return ""
    parts.append(names.get(node.id, node.id))
    return ".".join(reversed(parts))


def _literal(node: ast.AST) -> str:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else ""


def uses(source: str, filename: str = "<string>") -> List[Tuple[int, str]]:
    """[(line, description)] of every use of a forbidden module in ``source``."""
    tree = ast.parse(source, filename)
    names = aliases(tree)
    hits: List[Tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            hits += [(node.lineno, f"import {a.name}") for a in node.names if forbidden(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if forbidden(node.module):
                hits.append((node.lineno, f"from {node.module} import ..."))
            else:
                hits += [(node.lineno, f"from {node.module} import {a.name}")
                         for a in node.names if forbidden(f"{node.module}.{a.name}")]
        elif isinstance(node, ast.Call) and node.args:
            callee = dotted(node.func, names)
            first = _literal(node.args[0])
            if callee in ("importlib.import_module", "import_module", "__import__") and \
                    forbidden(first):
                hits.append((node.lineno, f"{callee}({first!r})"))
            elif callee == "getattr" and len(node.args) >= 2:
                target = dotted(node.args[0], names)
                name = _literal(node.args[1])
                if target and name and forbidden(f"{target}.{name}"):
                    hits.append((node.lineno, f"getattr({target}, {name!r})"))
        elif isinstance(node, ast.Attribute):
            chain = dotted(node, names)
            # report the shortest forbidden chain once (torch.func, not also torch.func.grad)
            if forbidden(chain) and not forbidden(dotted(node.value, names)):
                hits.append((node.lineno, chain))
    return sorted(set(hits))


def package_uses(root: pathlib.Path) -> List[str]:
    """``path:line: what`` for every use under ``root`` (every ``*.py`` file)."""
    out = []
    for path in sorted(root.rglob("*.py")):
        for line, what in uses(path.read_text(), str(path)):
            out.append(f"{path.relative_to(root.parent)}:{line}: {what}")
    return out
