"""Sparse-layout ops under vmap.

A BatchedTensor reports its example's strides, so it can hold a strided or a sparse COO value
(``to_sparse`` under vmap and vmap of vmap stack the examples as extra sparse dims; the loop
fallback does that), but not a sparse compressed one (CSR/CSC/BSR/BSC have no strides).
``torch.sparse.sampled_addmm`` always returns a sparse CSR tensor, so it cannot run under vmap:
its rule raises a clear error that names the batched-CSR route PyTorch has natively (a 3-D CSR
``input`` with 3-D ``mat1`` / ``mat2``) instead of letting PyTorch's "Sparse CSR tensors do not
have is_contiguous" reach the user from the loop's stacking.
"""
from __future__ import annotations

import torch

from ...errors import UnsupportedUnderVmap
from ..registry import registrar

aten = torch.ops.aten
register_batch_rule = registrar("sparse")   # the rules below live in this file


@register_batch_rule(aten.sparse_sampled_addmm.default)
def sparse_sampled_addmm_rule(info, in_dims, *args, **kwargs):
    raise UnsupportedUnderVmap(
        "vmap: torch.sparse.sampled_addmm returns a sparse CSR tensor, and a batched "
        "(vmapped) sparse CSR tensor cannot be represented: compressed sparse layouts have no "
        "strides to carry a batch dimension. Call it outside vmap with the batch as a leading "
        "dimension instead, which PyTorch supports natively: input a 3-D sparse CSR tensor "
        "(batch, m, n) with the same sparsity pattern per batch element, mat1 (batch, m, k) "
        "and mat2 (batch, k, n); or compute densely under vmap: "
        "beta * input.to_dense() + alpha * (mat1 @ mat2) * (input.to_dense() != 0).")
