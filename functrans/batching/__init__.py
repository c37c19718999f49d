"""The vmap engine: BatchedTensor, the level's dispatch mode, the dispatcher, the rule registry,
the fallback.  The files, in the order an op meets them:

  api.py             vmap(): arguments, batch size, chunking; pushes a level and its mode
  chunking.py        chunk_size="auto": a call's peak memory measured on fake tensors
  mode.py            the level's dispatch mode: the entry of every op under a vmap
  batched_tensor.py  the wrapper (value, bdim, level); top_level()
  dispatch.py        one op as named steps: level, entry, unwrap, guards, run, rewrap
  registry.py        one OpEntry per op: its rule and how it was found (incl. derived rules)
  guards.py          every refusal made before a rule runs; views vmap had to copy
  rules/             the batching rules, one file per op family (helpers.py: bdim arithmetic)
  decompositions.py  torch._decomp for ops without a rule
  fallback.py        the per-example loop (known_fallbacks.py: loops on purpose)
  randomness.py      what a random op means per example (policy only)
  above_dispatch.py  hooks that act before ATen (a batched 0-d index, an RNN's initial state)
  custom_function.py autograd.Function under vmap (vmap staticmethods, generate_vmap_rule)
  report.py          record_fallbacks(), batching_coverage(), batching_rules()
  op_schema.py       what is read from an op itself: names, written arguments, kernels
  compile_boundary.py torch.compile'd functions under vmap: eager, one warning, no graph breaks
  control_flow.py    torch.cond/while_loop/scan/associative_scan/map under every transform

Importing this package registers the built-in rules (``rules``) and installs, explicitly, the
patches functrans makes outside its own objects: the hooks of ``above_dispatch``,
``torch.autograd.Function.apply`` (``custom_function``), dynamo's frame strategy for the
engine's entry points (``compile_boundary``) and the control-flow operators' implementations
under functrans's transforms (``control_flow``).  Importing any single module of it
patches nothing.

Imports: api, batched_tensor, above_dispatch, compile_boundary, control_flow, custom_function,
rules.
"""
from . import above_dispatch, compile_boundary, control_flow, custom_function
from . import rules  # noqa: F401  (importing registers every built-in rule)
from .api import vmap
from .batched_tensor import BatchedTensor

above_dispatch.install()
custom_function.install()
compile_boundary.install()
control_flow.install()

__all__ = ["vmap", "BatchedTensor"]
