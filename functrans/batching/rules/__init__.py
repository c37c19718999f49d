"""Importing this package registers every built-in batching rule, one module per op family.

Each rules file starts with ``register_batch_rule = registrar("<its name>")`` (``registry.py``),
so every rule knows the file it lives in; ARCHITECTURE.md ("How to add a batching rule") walks
through writing one.  This docstring's Imports line covers the package and every rules file:
the package imports its files, and a rules file may import the engine modules listed after them
and a sibling rules file (``activations`` reuses ``pointwise``'s rule; ``padding``, ``pooling``
and ``upsample`` use ``spatial``'s helpers).

Imports: activations, attention, autograd_ops, conv, data_dependent, embedding, factories, fft,
histograms, indexing, linalg, linalg_solvers, losses, norms, padding, pointwise, pooling, random,
reductions, rnn, sorting, sparse, spatial, upsample, views (this package's files), helpers,
registry, op_schema, batched_tensor, guards, errors (never dispatch, mode or fallback: a rule
calls ops, and the dispatcher routes them).
"""
from . import pointwise, reductions, views, linalg, factories, random  # noqa: F401
from . import autograd_ops, conv, data_dependent, indexing, losses, padding  # noqa: F401
from . import fft, pooling, sorting  # noqa: F401
from . import linalg_solvers, embedding, norms, upsample, spatial  # noqa: F401
from . import attention, activations, histograms, rnn  # noqa: F401
from . import sparse  # noqa: F401
