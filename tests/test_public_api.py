"""The package never uses the reference implementation as its engine."""
import pathlib
import re
import subprocess
import sys

import functrans

FORBIDDEN = re.compile(r"(^|[^A-Za-z0-9_])(torch\.func|torch\.vmap|functorch|torch\._functorch|"
                       r"_C\._functorch|torch\.autograd\.functional)([^A-Za-z0-9_]|$)")


def test_package_source_never_mentions_the_reference_engine():
    root = pathlib.Path(functrans.__file__).parent
    hits = []
    for path in root.rglob("*.py"):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if FORBIDDEN.search(line):
                hits.append(f"{path.relative_to(root.parent)}:{n}: {line.strip()}")
    assert not hits, "functrans must not use torch.func & co.:\n" + "\n".join(hits)


def test_package_imports_no_reference_module():
    import ast
    root = pathlib.Path(functrans.__file__).parent
    bad = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            bad += [f"{path.name}: {n}" for n in names if FORBIDDEN.search(n) or
                    n in ("torch.func", "torch.autograd.functional") or n.startswith("functorch")]
    assert not bad, bad
