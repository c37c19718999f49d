"""Working with nn.Modules: functional_call, stacking models (stack_module_state, Ensemble),
BatchNorm under vmap (replace_all_batch_norm_modules_)."""
from .batch_norm import replace_all_batch_norm_modules_
from .functional_call import functional_call
from .stacking import Ensemble, stack_module_state

__all__ = ["functional_call", "stack_module_state", "Ensemble", "replace_all_batch_norm_modules_"]
