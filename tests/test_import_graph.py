"""The package's import graph is a tree but for one documented edge, every module resolves by
its dotted name, and importing a rules module patches nothing.

The graph is read from the source by tests/support/import_graph.py (``python -m
tests.support.import_graph`` prints it): an edge is "top" (a module-level import) or "late" (an
import inside a function).  A late import hides a cycle from the interpreter, not from a reader,
so cycles are counted over both kinds.
"""
import ast
import json
import subprocess
import sys

from tests.support import import_graph
from tests.support.reference_imports import aliases, dotted

PACKAGE = import_graph.PACKAGE
RULES_DIR = import_graph.ROOT / PACKAGE / "batching" / "rules"

# (importer, imported): the only function-local imports allowed to close a cycle.
ALLOWED_LATE_IMPORTS = {
    ("functrans.batching.batched_tensor", "functrans.batching.dispatch"):
        "BatchedTensor.__torch_dispatch__ hands every op to the dispatcher, and the dispatcher "
        "builds BatchedTensors: the wrapper type and the engine that runs ops on it need each "
        "other.  batched_tensor imports dispatch on the first dispatch, so the type can be "
        "imported (by rules, by the autodiff wrappers) without the engine.",
}

# (importer, imported) -> why this import is inside a function.  Every function-local import
# of a package module must be listed here with its reason; start from the allowed cycle edge.
LATE_IMPORT_BUDGET = dict(ALLOWED_LATE_IMPORTS)

# The names the rules modules must leave alone at import: hooks on them are set by
# functrans.batching.above_dispatch.install().
VF_RNN_ENTRY_POINTS = ("lstm", "gru", "rnn_tanh", "rnn_relu", "lstm_cell", "gru_cell",
                       "rnn_tanh_cell", "rnn_relu_cell")


def _short(name: str) -> str:
    return name.removeprefix(PACKAGE + ".")


def _describe_cycle(graph, component) -> str:
    members = set(component)
    edges = sorted((a, b, kind) for a in component for b, kind in graph[a].items()
                   if b in members and not import_graph._is_parent(a, b))
    lines = ["  cycle: " + ", ".join(_short(m) for m in component)]
    lines += [f"    {_short(a)} -> {_short(b)} ({kind})" for a, b, kind in edges]
    return "\n".join(lines)


def test_no_import_cycle_but_the_allowed_late_imports():
    graph = import_graph.graph()
    pruned = {m: {t: k for t, k in edges.items()
                  if not (k == "late" and (m, t) in ALLOWED_LATE_IMPORTS)}
              for m, edges in graph.items()}
    cycles = import_graph.cycles(pruned)
    assert not cycles, (
        f"{len(cycles)} import cycle(s) in the package (function-local imports count; the "
        f"edges of ALLOWED_LATE_IMPORTS are left out).  Each cycle with its edges, top = a "
        f"module-level import, late = an import inside a function:\n"
        + "\n".join(_describe_cycle(pruned, c) for c in cycles))


def test_allowed_late_imports_are_present_and_late():
    graph = import_graph.graph()
    stale = [f"{_short(a)} -> {_short(b)}: "
             + ("a module-level import now" if graph.get(a, {}).get(b) == "top" else "gone")
             for a, b in ALLOWED_LATE_IMPORTS if graph.get(a, {}).get(b) != "late"]
    assert not stale, "ALLOWED_LATE_IMPORTS lists edges that are not function-local imports " \
        "(update the list):\n  " + "\n  ".join(stale)
    assert all(reason.strip() for reason in ALLOWED_LATE_IMPORTS.values())


def test_function_local_imports_are_within_the_budget():
    late = import_graph.late_imports()
    over = [f"{_short(a)} -> {_short(b)}" for a, b in late if (a, b) not in LATE_IMPORT_BUDGET]
    stale = [f"{_short(a)} -> {_short(b)}" for a, b in LATE_IMPORT_BUDGET
             if (a, b) not in set(late)]
    assert all(reason.strip() for reason in LATE_IMPORT_BUDGET.values())
    assert not over and not stale, (
        f"{len(late)} function-local import(s) of package modules; "
        f"{len(over)} not in LATE_IMPORT_BUDGET (move them to module level, or list them with "
        f"the reason they must be late):\n  " + "\n  ".join(over)
        + (("\nbudget entries that are no longer function-local imports:\n  "
            + "\n  ".join(stale)) if stale else ""))


def test_the_import_graph_sees_every_import():
    """The graph reads import statements: a dynamic import (importlib.import_module,
    __import__) would be an edge it cannot see."""
    hits = []
    for name, path in import_graph.modules().items():
        tree = ast.parse(path.read_text(), str(path))
        names = aliases(tree)
        hits += [f"{name}:{node.lineno}" for node in ast.walk(tree)
                 if isinstance(node, ast.Call) and dotted(node.func, names) in
                 ("importlib.import_module", "import_module", "__import__")]
    assert not hits, f"dynamic imports in the package: {hits}"


_RESOLVE = r"""
import importlib, json, sys
bad = []
for name in json.loads(sys.argv[1]):
    try:
        mod = importlib.import_module(name)
    except Exception as e:
        bad.append(f"{name}: importlib.import_module raised {type(e).__name__}: {e}")
        continue
    obj = sys.modules[name.split(".")[0]]
    for part in name.split(".")[1:]:
        obj = getattr(obj, part, None)
    if obj is not mod:
        bad.append(f"{name}: attribute access from the top package gives {obj!r}, not the module")
    parent, _, leaf = name.rpartition(".")
    if parent:
        ns = {}
        try:
            exec(f"from {parent} import {leaf}", ns)
        except Exception as e:
            bad.append(f"{name}: 'from {parent} import {leaf}' raised {type(e).__name__}: {e}")
        else:
            if ns[leaf] is not mod:
                bad.append(f"{name}: 'from {parent} import {leaf}' gives {ns[leaf]!r}, "
                           f"not the module")
print(json.dumps(bad))
"""


def test_every_module_resolves_by_its_dotted_name():
    """In a fresh interpreter: importlib.import_module(name), attribute access from the top
    package (functrans.batching.registry) and ``from functrans.batching import registry`` all
    give the module (a package attribute of the same name, such as a function re-exported by
    the package, would shadow it)."""
    names = sorted(n for n in import_graph.modules() if not n.endswith(".__main__"))
    assert "functrans.batching.registry" in names
    proc = subprocess.run([sys.executable, "-c", _RESOLVE, json.dumps(names)],
                          capture_output=True, text=True, timeout=240,
                          cwd=str(import_graph.ROOT))
    assert proc.returncode == 0, proc.stderr[-3000:]
    bad = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not bad, f"{len(bad)} of {len(names)} modules do not resolve:\n  " + "\n  ".join(bad)


def _torch_mutations(source: str, filename: str = "<string>"):
    """[(line, what)]: setattr/delattr on a torch object, and assignments or deletions of torch
    attributes (names resolved through the source's imports)."""
    tree = ast.parse(source, filename)
    names = aliases(tree)

    def is_torch(node) -> bool:
        chain = dotted(node, names)
        return chain == "torch" or chain.startswith("torch.")

    def targets(node):
        if isinstance(node, (ast.Tuple, ast.List)):
            for e in node.elts:
                yield from targets(e)
        elif isinstance(node, ast.Starred):
            yield from targets(node.value)
        else:
            yield node

    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in ("setattr", "delattr") and node.args and is_torch(node.args[0]):
            hits.append((node.lineno, f"{node.func.id}({dotted(node.args[0], names)}, ...)"))
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            tgts = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            for t in (x for tgt in tgts for x in targets(tgt)):
                if isinstance(t, ast.Attribute) and is_torch(t):
                    hits.append((node.lineno, f"del {dotted(t, names)}"
                                 if isinstance(node, ast.Delete) else f"{dotted(t, names)} = ..."))
    return sorted(hits)


def test_torch_mutation_finder():
    """The ast check below, on small sources: what it must flag and what it must let pass."""
    cases = {
        "from torch import _VF\ndef f():\n    setattr(_VF, 'lstm', g)\n": [(3, "setattr")],
        "import torch\ntorch._VF.gru = g\n": [(2, "torch._VF.gru = ...")],
        "import torch as T\nT.Tensor.foo, y = 1, 2\n": [(2, "torch.Tensor.foo = ...")],
        "import torch\ndelattr(torch.nn.functional, 'relu')\n": [(2, "delattr")],
        "from torch import _VF\ndel _VF.lstm\n": [(2, "del torch._VF.lstm")],
        "import torch\nx = torch.zeros(2)\nx.foo = 1\nsetattr(self, 'a', torch.ones(1))\n": [],
    }
    for source, want in cases.items():
        got = _torch_mutations(source)
        assert len(got) == len(want), (source, got)
        for (line, what), (wline, wwhat) in zip(got, want):
            assert line == wline and what.startswith(wwhat), (source, got)


def test_rules_modules_patch_nothing_in_torch():
    """Importing a rules module must change nothing in torch: the hooks that act before ATen
    (the RNN entry points of torch._VF, ...) are set by an explicit install() in
    functrans/batching/above_dispatch.py, not at a rules module's import."""
    hits = [f"{p.relative_to(import_graph.ROOT)}:{line}: {what}"
            for p in sorted(RULES_DIR.rglob("*.py"))
            for line, what in _torch_mutations(p.read_text(), str(p))]
    assert not hits, "rules modules that patch torch (move the hook to above_dispatch.install):" \
        "\n  " + "\n  ".join(hits)


_INSTALL = r"""
import importlib, json
import torch
names = json.loads(__import__("sys").argv[1])
mod = importlib.import_module("functrans.batching.above_dispatch")
assert callable(getattr(mod, "install", None)), "above_dispatch has no install()"
first = {n: getattr(torch._VF, n, None) for n in names}
mod.install()
second = {n: getattr(torch._VF, n, None) for n in names}
print(json.dumps(sorted(n for n in names if first[n] is not second[n])))
"""


def test_above_dispatch_install_exists_and_is_idempotent():
    """functrans.batching.above_dispatch exists and has install(); the package has installed
    the hooks once it is imported, so a second install() changes no RNN entry point of
    torch._VF (no hook wrapped twice)."""
    proc = subprocess.run([sys.executable, "-c", _INSTALL, json.dumps(VF_RNN_ENTRY_POINTS)],
                          capture_output=True, text=True, timeout=240,
                          cwd=str(import_graph.ROOT))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rewrapped = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not rewrapped, f"a second install() re-wrapped torch._VF entry points: {rewrapped}"
