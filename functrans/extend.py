"""The rule-author API: everything needed to add a batching rule for an op (yours or ATen's).

>>> import torch
>>> from functrans.extend import register_batch_rule, move_bdim_to_front
>>> @register_batch_rule(torch.ops.aten.trace.default)          # doctest: +SKIP
... def trace_rule(info, in_dims, x):
...     x = move_bdim_to_front(x, in_dims[0])
...     return x.diagonal(dim1=1, dim2=2).sum(-1), 0

A rule receives this level's physical values (``info.batch_size`` examples stacked at the
``in_dims`` dims) and returns physical outputs with their batch dims.  Test it with
``functrans.config.strict_fallback()`` so that a pass proves the rule ran.

Imports: errors, batching.helpers, batching.registry.
"""
from .errors import PerformanceWarning, UnsupportedUnderVmap
from .batching.helpers import (ensure_bdim_front, first_bdim, keep_bdim_rule, logical_rank,
                               match_bdim, move_bdim_to_front, normalize_dim, pad_to_rank,
                               physical_dim)
from .batching.registry import (Decline, family_of, register_batch_rule, register_tag_rule,
                                registered_ops)

__all__ = ["register_batch_rule", "Decline", "register_tag_rule", "registered_ops", "family_of",
           "move_bdim_to_front", "ensure_bdim_front", "physical_dim", "normalize_dim",
           "pad_to_rank", "logical_rank", "match_bdim", "first_bdim", "keep_bdim_rule",
           "PerformanceWarning", "UnsupportedUnderVmap"]
