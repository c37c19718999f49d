"""Importing this package registers every built-in batching rule, one module per op family."""
from . import pointwise, reductions, views, linalg, factories, random  # noqa: F401
from . import autograd_ops, conv, data_dependent, indexing, losses, padding  # noqa: F401
from . import fft, pooling, sorting  # noqa: F401
from . import linalg_solvers, embedding, norms, upsample, spatial  # noqa: F401
from . import attention, activations, histograms, rnn  # noqa: F401
from . import sparse  # noqa: F401
