"""functrans: composable function transforms for PyTorch, on a batching-rule dispatcher.

The public API mirrors PyTorch's functional transforms (same names and signatures).

Imports: errors, config, batching.api, batching.batched_tensor, batching.report, autodiff.grad,
autodiff.vjp, autodiff.jvp, autodiff.jacobians, nn, functionalization, einops, compiler (the
public API is re-exported from them).
"""
from .errors import (CompileWarning, EscapedBatchedTensorError, FunctransError, PerformanceWarning,
                     TransformArgumentError, UnsupportedUnderVmap, UntraceableError)
from .batching.api import vmap
from .batching.batched_tensor import debug_unwrap
from .autodiff.grad import grad, grad_and_value
from .autodiff.vjp import vjp
from .autodiff.jvp import jvp, linearize
from .autodiff.jacobians import jacrev, jacfwd, hessian
from .batching.report import FallbackReport, batching_coverage, batching_rules, record_fallbacks
from .nn import Ensemble, functional_call, replace_all_batch_norm_modules_, stack_module_state
from .functionalization import functionalize
from .einops import rearrange
from .compiler import compile, compile_report, explain
from . import config

for _f in (vmap, grad, grad_and_value, vjp, jvp, linearize, jacrev, jacfwd, hessian,
           functional_call, stack_module_state, replace_all_batch_norm_modules_, functionalize,
           rearrange, debug_unwrap, compile, compile_report, explain):
    _f.__module__ = "functrans"
del _f

__all__ = ["vmap", "grad", "grad_and_value", "vjp", "jvp", "linearize", "jacrev", "jacfwd",
           "hessian", "functional_call", "stack_module_state", "replace_all_batch_norm_modules_",
           "debug_unwrap",
           "Ensemble", "config", "record_fallbacks", "FallbackReport", "batching_coverage",
           "batching_rules", "FunctransError", "TransformArgumentError", "UnsupportedUnderVmap",
           "EscapedBatchedTensorError", "PerformanceWarning", "functionalize", "rearrange", "compile",
           "compile_report", "explain", "CompileWarning", "UntraceableError"]
__version__ = "0.1.0"
