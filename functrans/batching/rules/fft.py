"""FFT kernels (issue 4): _fft_c2c, _fft_r2c, _fft_c2r — what every ``torch.fft.*`` function
reaches.  Invariant: the transformed dims are logical dims translated to physical ones; the
bdim stays where it is (the kernels transform only the dims they are given)."""
from __future__ import annotations

import torch

from ..helpers import logical_rank, physical_dim
from ..registry import registrar

aten = torch.ops.aten
register_batch_rule = registrar("fft")   # the rules below live in this file


def _fft_rule_for(op):
    def rule(info, in_dims, x, dim, *args, **kwargs):
        b, r = in_dims[0], logical_rank(x, in_dims[0])
        return op(x, [physical_dim(d, b, r) for d in dim], *args, **kwargs), b
    rule.__name__ = f"fft_rule[{op}]"
    return rule


for _op in (aten._fft_c2c.default, aten._fft_r2c.default, aten._fft_c2r.default):
    register_batch_rule(_op, _fft_rule_for(_op))
