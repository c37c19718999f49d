"""Upsampling: upsample_nearest{1,2,3}d, _upsample_nearest_exact{1,2,3}d, upsample_linear1d,
upsample_bilinear2d, _upsample_bilinear2d_aa, upsample_bicubic2d, _upsample_bicubic2d_aa,
upsample_trilinear3d and all their backward ops (``.default`` overloads; the ``.vec`` ones are
CompositeImplicitAutograd and arrive here as ``.default``).

Invariant: the kernels need the full ``[N, C, *spatial]`` input and interpolate each plane on its
own, so the vmap batch folds into ``N`` (``[B, N, ...] -> [B*N, ...]``, see
``spatial.fold_into_n_rule``); the backward ops' ``input_size`` (``[N, C, *spatial]``) gets
``B*N`` to match.  Other ranks are declined, so the loop fallback raises PyTorch's error.
"""
from __future__ import annotations

import torch

from ..registry import registrar
from .spatial import fold_into_n_rule

aten = torch.ops.aten
register_batch_rule = registrar("upsample")   # the rules below live in this file

_UPSAMPLES = {  # name -> number of spatial dims
    "upsample_nearest1d": 1, "upsample_nearest2d": 2, "upsample_nearest3d": 3,
    "_upsample_nearest_exact1d": 1, "_upsample_nearest_exact2d": 2,
    "_upsample_nearest_exact3d": 3, "upsample_linear1d": 1, "upsample_bilinear2d": 2,
    "_upsample_bilinear2d_aa": 2, "upsample_bicubic2d": 2, "_upsample_bicubic2d_aa": 2,
    "upsample_trilinear3d": 3,
}

for _name, _spatial in _UPSAMPLES.items():
    _fwd = getattr(aten, _name).default
    _bwd = getattr(aten, _name + "_backward").default
    register_batch_rule(_fwd, fold_into_n_rule(_fwd, (_spatial + 2,)))
    register_batch_rule(_bwd, fold_into_n_rule(_bwd, (_spatial + 2,), size_arg="input_size"))
