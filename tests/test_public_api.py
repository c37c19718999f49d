"""The package never uses the reference implementation as its engine."""
import pathlib
import re

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


def test_all_and_signatures_match_torch_func():
    import inspect
    import torch.func
    names = ["vmap", "grad", "grad_and_value", "vjp", "jvp", "linearize", "jacrev", "jacfwd",
             "hessian", "functional_call", "stack_module_state", "replace_all_batch_norm_modules_"]
    assert set(names) <= set(functrans.__all__)
    for name in names:
        ours = inspect.signature(getattr(functrans, name)).parameters
        ref = inspect.signature(getattr(torch.func, name)).parameters
        # Every torch.func parameter (except private ones) exists, same kind, same default.
        for p in ref.values():
            if p.name.startswith("_"):
                continue
            assert p.name in ours, f"{name} lacks parameter {p.name}"
            assert ours[p.name].kind == p.kind, f"{name}({p.name}) kind differs"
            assert ours[p.name].default == p.default, f"{name}({p.name}) default differs"
        assert getattr(functrans, name).__module__ == "functrans"


def test_extend_module_exports_work():
    from functrans import extend
    for name in extend.__all__:
        assert hasattr(extend, name)
