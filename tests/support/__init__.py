"""Test support: the modules that tests, benchmarks and reports import; no tests live here.

* ``oracles`` -- the for-loop oracle (the definition of vmap), batch builders that draw
  DIFFERENT examples, ``check_vmap``/``check_vmap_all_bdims`` and ``assert_same``.
* ``opinfo_sweep`` -- vmap and vmap∘vmap of every op of PyTorch's OpInfo ``op_db`` against the
  for-loop oracle, beside torch.vmap; its known failures (``XFAILS``) and the fast subset run by
  tests/batching/test_opinfo_sweep.py.  ``python -m tests.support.opinfo_sweep --help``.
* ``opinfo_autodiff`` -- vjp, jvp, vmap∘vjp and vmap∘jvp of the same ops against plain autograd
  / forward AD (tests/autodiff/test_opinfo_autodiff.py).
  ``python -m tests.support.opinfo_autodiff --help``.
* ``layouts`` -- the physical layouts the sweeps present a batch in (stacked, batch dim moved,
  transposed, channels_last, expanded) and the check of which inputs an op writes in place.
* ``side_by_side`` -- the two sweeps as one table, functrans beside torch.func.
  ``python -m tests.support.side_by_side --help``.
* ``misuse_catalogue`` -- common mistakes with their expected errors, run by
  tests/test_misuse_catalogue.py and printed as docs/misuse.md
  (``python -m tests.support.misuse_catalogue --markdown``).
* ``import_graph`` -- the package's import graph read from its source (module-level and
  function-local edges, cycles), for tests/test_import_graph.py.
  ``python -m tests.support.import_graph`` prints it.
* ``reference_imports`` -- an ast finder of uses of torch.func & co. (imports, dynamic imports,
  attribute chains), for tests/test_public_api.py.

Support modules import the package, torch and each other, never a test module.
"""
