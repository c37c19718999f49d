"""``replace_all_batch_norm_modules_``: make every BatchNorm of a model usable under vmap.

In training mode, a BatchNorm module updates its running statistics in place.  Under vmap with
running stats that are NOT batched, each example would update the same buffers differently, so
vmap refuses it (the error names this function).  This function, like PyTorch's own, switches
every BatchNorm of ``root`` to not tracking running stats (``running_mean``/``running_var`` set
to None, ``track_running_stats=False``): training mode then uses the batch's statistics only.
The alternative that keeps running stats is to batch them: ``stack_module_state`` / ``Ensemble``
stack each member's buffers, and each member's stats are updated.

Imports: nothing (torch only).
"""
from __future__ import annotations

from torch import nn


def replace_all_batch_norm_modules_(root: nn.Module) -> nn.Module:
    """In place: every BatchNorm (``nn.modules.batchnorm._BatchNorm``) under ``root`` stops
    tracking running stats, so that ``root`` runs under ``vmap`` in training mode.

    ``running_mean``, ``running_var`` and ``num_batches_tracked`` are set to None and
    ``track_running_stats`` to False: training mode then normalises with each (per-example
    under vmap) batch's statistics only.  To keep running stats, batch them instead
    (``stack_module_state`` / ``Ensemble``).

    Args:
        root: the module to change (its submodules included).

    Returns:
        ``root`` itself, changed.

    Example:
        >>> import torch, functrans
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
        >>> _ = functrans.replace_all_batch_norm_modules_(net)
        >>> net[1].running_mean is None, net[1].track_running_stats
        (True, False)
        >>> functrans.vmap(net)(torch.randn(6, 5, 3)).shape   # 6 batches of 5, each normalised
        torch.Size([6, 5, 4])
    """
    for module in root.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.running_mean = None
            module.running_var = None
            module.num_batches_tracked = None
            module.track_running_stats = False
    return root
