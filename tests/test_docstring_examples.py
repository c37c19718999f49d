"""The examples in the public docstrings run, and print what they say (doctests).

One pytest item per docstring that has examples: every object in ``functrans.__all__`` (and,
for the ``config`` module there, its functions), plus the module-level doctests of the public
modules (``errors.transform_call``, ``extend``).  The objects are collected by object, not by
module, because ``functrans/__init__.py`` sets the public functions' ``__module__`` to
``"functrans"``, which a module-wide ``doctest.DocTestFinder`` would skip.

A second test: every public callable in ``functrans.__all__`` (functions and classes, not the
exception and warning classes, whose docstrings say when they are raised) has an example.
"""
from __future__ import annotations

import doctest
import importlib
import inspect
from typing import Any, Dict, List, Tuple

import pytest

import functrans

# Modules whose own (module-level) doctests run too; the public functions are found through
# ``functrans.__all__``.
_MODULES = ["functrans.errors", "functrans.extend"]
# Examples that need an optional package, by docstring name.
_NEEDS = {"rearrange": "einops"}
_FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _public_objects() -> Dict[str, Any]:
    return {name: getattr(functrans, name) for name in functrans.__all__}


def _collect() -> Dict[str, Tuple[doctest.DocTest, Dict[str, Any]]]:
    """name -> (doctest, the namespace it starts from): empty for the public objects (their
    examples import what they use), the module's for a module's own doctests."""
    finder = doctest.DocTestFinder(recurse=True, exclude_empty=True)
    tests: Dict[str, Tuple[doctest.DocTest, Dict[str, Any]]] = {}
    for name, obj in _public_objects().items():
        if inspect.ismodule(obj):   # functrans.config: its functions
            found = finder.find(obj, name, module=obj, globs={})
        else:
            found = finder.find(obj, name, module=False, globs={})
        for t in found:
            if t.examples:
                tests.setdefault(t.name, (t, {}))
    for mod_name in _MODULES:
        mod = importlib.import_module(mod_name)
        for t in finder.find(mod, mod_name):
            if t.examples:
                tests.setdefault(t.name, (t, dict(vars(mod))))
    return tests


_TESTS = _collect()


def test_the_public_docstrings_have_examples_collected() -> None:
    # The collection itself is checked: a change to it that found nothing would pass silently.
    for name in ("vmap", "grad", "jacrev", "jacfwd", "hessian", "functional_call",
                 "stack_module_state", "Ensemble", "compile"):
        assert name in _TESTS, f"no doctest collected for functrans.{name}"


@pytest.mark.parametrize("name", sorted(_TESTS))
def test_docstring_example(name: str) -> None:
    if name.split(".")[0] in _NEEDS:
        pytest.importorskip(_NEEDS[name.split(".")[0]])
    test, globs = _TESTS[name]
    test.globs = dict(globs)  # a fresh namespace for each run
    out: List[str] = []
    runner = doctest.DocTestRunner(optionflags=_FLAGS)
    result = runner.run(test, out=out.append, clear_globs=True)
    assert result.failed == 0, f"{name}: doctest failed\n" + "".join(out)
    assert result.attempted > 0  # (examples marked +SKIP are not attempted)


def _needs_example(obj: Any) -> bool:
    if inspect.isclass(obj):
        return not issubclass(obj, (BaseException, Warning))
    return callable(obj) and not inspect.ismodule(obj)


def test_every_public_callable_has_an_example() -> None:
    missing = [name for name, obj in _public_objects().items()
               if _needs_example(obj) and name not in _TESTS]
    assert not missing, (f"public callables without a doctest example in their docstring: "
                         f"{missing}. Add an 'Example:' section with >>> lines.")
