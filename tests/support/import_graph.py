"""The import graph of the functrans package, read from its source (no import is executed).

``graph()`` maps each module of the package to the package modules it imports, each edge marked
"top" (a module-level import: runs when the module is imported) or "late" (an import inside a
function: runs when that function is first called).  ``cycles()`` lists the strongly connected
components of more than one module, counting both kinds of edge: a late import hides a cycle from
the interpreter, not from a reader.  Run ``python -m tests.support.import_graph`` to print both.
"""
from __future__ import annotations

import ast
import pathlib
import sys
from typing import Dict, List, Set, Tuple

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = "functrans"


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> Dict[str, pathlib.Path]:
    return {_module_name(p): p for p in sorted((ROOT / PACKAGE).rglob("*.py"))}


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _late_nodes(tree: ast.AST) -> Set[int]:
    late: Set[int] = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            for inner in ast.walk(fn):
                if isinstance(inner, (ast.Import, ast.ImportFrom)):
                    late.add(id(inner))
    return late


def graph() -> Dict[str, Dict[str, str]]:
    """{module: {imported package module: 'top' or 'late'}}."""
    mods = modules()
    out: Dict[str, Dict[str, str]] = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        late = _late_nodes(tree)
        is_package = path.name == "__init__.py"
        edges: Dict[str, str] = {}
        for node in ast.walk(tree):
            targets: List[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, is_package, node)
                # ``from . import x`` imports the submodule x when there is one
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                           for a in node.names]
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if not t or t == name or not t.startswith(PACKAGE):
                    continue
                kind = "late" if id(node) in late else "top"
                if edges.get(t) != "top":
                    edges[t] = kind
        out[name] = edges
    return out


def _is_parent(a: str, b: str) -> bool:
    return b.startswith(a + ".")


def cycles(g: Dict[str, Dict[str, str]] = None) -> List[List[str]]:
    """Strongly connected components with more than one module (Tarjan).  A package's
    ``__init__`` importing its own submodules, and a submodule importing a sibling through
    the package, are not cycles of interest: edges from a package to its own submodules are
    left out."""
    g = graph() if g is None else g
    adj = {m: [t for t in e if not _is_parent(m, t)] for m, e in g.items()}
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    out: List[List[str]] = []
    counter = [0]
    sys.setrecursionlimit(10000)

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in adj.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(adj):
        if v not in index:
            visit(v)
    return out


def late_imports() -> List[Tuple[str, str]]:
    return [(m, t) for m, e in graph().items() for t, k in sorted(e.items()) if k == "late"]


def main() -> None:
    g = graph()
    for m in sorted(g):
        edges = ", ".join(t.removeprefix(PACKAGE + ".") + ("*" if k == "late" else "")
                          for t, k in sorted(g[m].items()))
        print(f"{m.removeprefix(PACKAGE + '.') or PACKAGE}: {edges}")
    print("\n(* = a function-local import)")
    cs = cycles(g)
    print(f"\n{len(cs)} import cycle(s)")
    for c in cs:
        print("  " + " <-> ".join(x.removeprefix(PACKAGE + ".") for x in c))
    print(f"{len(late_imports())} function-local import(s) of package modules")


if __name__ == "__main__":
    main()
