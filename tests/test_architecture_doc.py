"""ARCHITECTURE.md stays true: its code blocks run, and what it names exists.

* Every ```python block runs, in order, in one namespace (the walk-through's example, and the
  worked example of "How to add a batching rule", which registers a rule for a custom op and
  checks it against the loop under strict_fallback); the rules it registers are removed after.
* Every ``functrans/...py`` / ``tests/...py`` path and every file name such as ``dispatch.py``
  written in backticks is a file of the repository.
* Every ``name()`` in backticks (a dotted name followed by empty parentheses: the doc writes
  calls of other libraries with their arguments) resolves to a callable of the package: as an
  attribute chain from ``functrans`` when it starts with ``functrans.``, else from one of the
  package's modules (``registry.entry()``, ``top_level()``, ``VmapLevelMode.__torch_dispatch__()``)
  or from ``tests/support/oracles.py`` (``check_vmap_all_bdims()``).
* Every ``Note [...]`` it cites exists in the package's source.
* The import layering it states (the modules without package imports, and the engine core's
  order) holds in the import graph.
"""
from __future__ import annotations

import importlib
import pathlib
import re

import functrans
from functrans.batching import registry
from tests.support import import_graph, oracles

ROOT = import_graph.ROOT
DOC = ROOT / "ARCHITECTURE.md"
PACKAGE = import_graph.PACKAGE


def _text() -> str:
    return DOC.read_text()


def _backticked():
    return re.findall(r"`([^`\n]+)`", _text())


def test_code_blocks_run():
    blocks = re.findall(r"```python\n(.*?)```", _text(), re.S)
    assert len(blocks) >= 2, "the walk-through example and the worked rule example"
    before = set(registry.registered_ops())
    ns = {}
    try:
        for code in blocks:
            exec(compile(code, str(DOC), "exec"), ns)
        op = ns["op"]   # the worked example's custom op, with its rule registered
        assert registry.entry(op).how == "rule" and registry.family_of(op) == "custom"
        assert ns["out"].shape == (5, 4)
    finally:
        added = set(registry.registered_ops()) - before
        registry.unregister_batch_rule(list(added))
    assert added, "the worked example registers a rule"
    assert functrans.batching_coverage(ns["op"]) == "fallback"   # and it is gone again


def test_paths_and_file_names_exist():
    text = _text()
    paths = set(re.findall(r"\b((?:functrans|tests)/[\w/]*\.py)\b", text))
    assert f"{PACKAGE}/batching/dispatch.py" in paths
    missing = sorted(p for p in paths if not (ROOT / p).is_file())
    files = [p.relative_to(ROOT).as_posix() for d in (PACKAGE, "tests")
             for p in (ROOT / d).rglob("*.py")]
    names = {t for t in _backticked() if t.endswith(".py") and not re.search(r"[<\s]|\.\.\.", t)}
    assert "registry.py" in names
    missing += sorted(n for n in names
                      if not any(f == n or f.endswith("/" + n) for f in files))
    assert not missing, f"ARCHITECTURE.md names files that do not exist: {missing}"


def _package_modules():
    """The package's modules, and the test oracles the rule-writing guide names."""
    return [importlib.import_module(m) for m in sorted(import_graph.modules())
            if not m.endswith(".__main__")] + [oracles]


def _resolve(dotted: str, modules):
    parts = dotted.split(".")
    starts = [(functrans, parts[1:])] if parts[0] == PACKAGE else \
        [(m, parts) for m in modules]
    for obj, chain in starts:
        for part in chain:
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if obj is not None and callable(obj):
            return obj
    return None


def test_named_functions_resolve():
    calls = sorted({t[:-2] for t in _backticked()
                    if re.fullmatch(r"[A-Za-z_][\w.]*\(\)", t)})
    assert {"dispatch", "registry.entry", "top_level"} <= set(calls)
    modules = _package_modules()
    missing = [c + "()" for c in calls if _resolve(c, modules) is None]
    assert not missing, f"ARCHITECTURE.md names functions the package does not have: {missing}"


def test_the_name_check_catches_a_wrong_name():
    modules = _package_modules()
    assert _resolve("registry.entry", modules) is registry.entry
    assert _resolve("functrans.batching_rules", modules) is functrans.batching_rules
    assert _resolve("registry.no_such_function", modules) is None
    assert _resolve("functrans.no_such_function", modules) is None


def test_cited_notes_exist():
    notes = set(re.findall(r"Note \[([^\]]+)\]", _text()))
    assert "autograd on physical values" in notes
    source = "\n".join(p.read_text() for p in (ROOT / PACKAGE).rglob("*.py"))
    missing = sorted(n for n in notes if f"Note [{n}]" not in source)
    assert not missing, f"ARCHITECTURE.md cites notes the source does not have: {missing}"


# The layering ARCHITECTURE.md states ("Import layering"), checked against the import graph.
BOTTOM = ["errors", "_levels", "_pytree", "batching.op_schema", "batching.helpers",
          "batching.known_fallbacks", "compiler.dynamo_entry"]
# config imports errors only (its max_memory raises TransformArgumentError)
ON_ERRORS_ONLY = ["config"]
ENGINE_ORDER = ["batched_tensor", "randomness", "registry", "guards", "decompositions",
                "fallback", "functionalization", "dispatch", "mode", "chunking", "api"]
_LATE_EDGE = ("batching.batched_tensor", "batching.dispatch")


def _full(name: str) -> str:
    top = {"functionalization"}
    return f"{PACKAGE}.{name}" if "." in name or name in top or name in BOTTOM + ON_ERRORS_ONLY \
        else f"{PACKAGE}.batching.{name}"


def test_stated_layering_holds():
    text = " ".join(_text().split())
    assert "no package imports: " + ", ".join(
        f"`{n.replace('.', '/')}.py`" for n in BOTTOM) in text
    assert ", ".join(ENGINE_ORDER) in text
    graph = import_graph.graph()
    for name in BOTTOM:
        assert graph[_full(name)] == {}, f"{name} imports {sorted(graph[_full(name)])}"
    assert "`config.py` imports only `errors.py`" in text
    for name in ON_ERRORS_ONLY:
        assert set(graph[_full(name)]) <= {_full("errors")}, \
            f"{name} imports {sorted(graph[_full(name)])}"
    allowed = {_full(n) for n in BOTTOM + ON_ERRORS_ONLY}
    for name in ENGINE_ORDER:
        module = _full(name)
        extra = sorted(t for t, kind in graph[module].items() if t not in allowed and not (
            kind == "late" and (module, t) == tuple(f"{PACKAGE}.{x}" for x in _LATE_EDGE)))
        assert not extra, f"{name} imports {extra}, which ARCHITECTURE.md lists after it"
        allowed.add(module)


def test_readme_layout_names_every_module():
    """README.md's layout block (the ``functrans/`` tree) names every module of the package:
    a file by its name, a rules file by its family."""
    readme = (ROOT / "README.md").read_text()
    block = re.search(rf"\n```\n({PACKAGE}/\n.*?)```", readme, re.S).group(1)
    words = set(re.findall(r"[\w.]+", block))
    missing = []
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        rel = path.relative_to(ROOT / PACKAGE)
        if path.name == "__init__.py" and len(rel.parts) > 1:
            continue   # a subpackage is named by its folder
        name = path.stem if rel.parts[:2] == ("batching", "rules") else path.name
        if name not in words:
            missing.append(rel.as_posix())
    assert not missing, f"README.md's layout block does not name {missing}"
