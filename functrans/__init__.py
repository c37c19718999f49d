"""functrans: composable function transforms for PyTorch, on a batching-rule dispatcher.

The public API mirrors PyTorch's functional transforms (same names and signatures).
"""
from .errors import (EscapedBatchedTensorError, FunctransError, PerformanceWarning,
                     TransformArgumentError, UnsupportedUnderVmap)
from .vmap.api import vmap
from . import config

vmap.__module__ = "functrans"

__all__ = ["vmap", "config", "FunctransError", "TransformArgumentError", "UnsupportedUnderVmap",
           "EscapedBatchedTensorError", "PerformanceWarning"]
__version__ = "0.1.0"
