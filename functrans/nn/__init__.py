"""Working with nn.Modules: functional_call, stacking models (stack_module_state, Ensemble),
BatchNorm under vmap (replace_all_batch_norm_modules_), DP-SGD (``functrans.nn.dp``,
with Poisson sampling and privacy accounting).

Imports: stateless, stacking, batch_norm, dp.
"""
from .batch_norm import replace_all_batch_norm_modules_
from .stateless import functional_call
from .stacking import Ensemble, stack_module_state
from . import dp
from .dp import (PoissonSampler, PrivacyLedger, add_gaussian_noise, assign_grads, clip_and_sum,
                 dp_sgd_grads, noise_for_epsilon, per_sample_grads, poisson_data_loader,
                 privacy_spent, surrogate_loss)

__all__ = ["functional_call", "stack_module_state", "Ensemble", "replace_all_batch_norm_modules_",
           "dp", "dp_sgd_grads", "per_sample_grads", "clip_and_sum", "add_gaussian_noise",
           "assign_grads", "surrogate_loss", "PoissonSampler", "poisson_data_loader",
           "privacy_spent", "noise_for_epsilon", "PrivacyLedger"]
