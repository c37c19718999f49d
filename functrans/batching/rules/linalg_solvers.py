"""Linear-algebra solvers, factorizations and related ops: ``_linalg_svd``, ``linalg_pinv``,
``linalg_inv_ex``, the LU / QR / Cholesky / LDL / eigen families, ``_linalg_solve_ex``, the
triangular solves, ``_linalg_det``, ``_linalg_slogdet``, ``linalg_matrix_exp``,
``linalg_cross``, ``trace``, ``renorm``, ``_cdist_forward`` / ``_cdist_backward`` and
``_pdist_forward`` / ``_pdist_backward``.  (Matrix products live in linalg.py.)

Every ``torch.linalg`` kernel already treats leading dims as batch dims, so the rules move the
batch dim to the front and call the same op once.  Invariants:
* every output (factors, pivots, LAPACK ``info``...) comes back with the batch dim first;
* an operand's logical rank is checked against the op's core rank (2 for a matrix, 1 for
  pivots / tau) before anything runs: a logical vector must never be read as a matrix whose
  rows are the batch; too small an operand is declined so the loop fallback raises eager's error;
* with several operands every one is put batch-first (an unbatched one as an expanded view) and
  padded with size-1 dims after the batch up to a common number of logical batch dims, so the
  op's own broadcasting sees ``[B, *batch, core]`` for each of them;
* placeholder outputs that an op returns as ``[0]``-shaped tensors (``compute_uv=False``,
  ``mode='r'``, ``unpack_data=False``...) become ``[B, 0]``, what stacking per-example ``[0]``s
  gives;
* ``_linalg_solve_ex``, ``_linalg_det`` and ``_linalg_slogdet`` factor ``A`` or ``A^T``
  depending on whether ``A`` is contiguous, and their backward formulas make the same test on
  the (logical) ``A`` they saved; the physical ``A`` is therefore made contiguous exactly when the
  logical one is (see Note [contiguity of A]);
* ``_linalg_solve_ex`` decides per example, from LOGICAL shapes, whether ``B`` is a vector;
* an unbatched coefficient matrix (or its factors) with batched right-hand sides is never
  expanded: the batch goes into B's columns and one solve runs (Note [folding the batch into
  B's columns]); those outputs that depend on A only (LU, pivots, info) stay unbatched;
* ``linalg_pinv``'s ``atol`` / ``rtol`` are keyword tensors: the rule takes their bdims
  (``batched_kwargs``) and aligns them with A's batch dims like any other operand;
* ``_pdist_forward`` / ``_pdist_backward`` (2-D inputs only) go through the batched
  ``_cdist_forward`` / ``_cdist_backward``; ``renorm`` folds the batch into its ``dim``.

Declined (the loop fallback runs them, and raises eager's error): operands of too small a
logical rank, ``linalg_cross`` operands of different ranks, ``trace`` / ``pdist`` of inputs that
are not 2-D, ``renorm`` of a 1-D input; single-input rules decline a batched extra tensor.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from ..helpers import (ensure_bdim_front, logical_rank, move_bdim_to_front, normalize_dim,
                       pad_to_rank)
from ..registry import Decline, registrar

aten = torch.ops.aten
register_batch_rule = registrar("linalg_solvers")   # the rules below live in this file

# Note [contiguity of A]
# ``_linalg_solve_ex(A, B)`` computes the LU factors of ``A^T`` (and solves with
# ``adjoint=True``) when ``A`` is contiguous and real, else those of ``A``; its backward
# formula re-reads ``A.is_contiguous()`` to know which factors it got.  Under
# ``vmap(grad(f))`` that ``A`` is the BatchedTensor, whose strides are the physical ones minus
# the batch dim.  So the physical ``A`` handed to the kernel must be contiguous iff those logical
# strides are: a batch-first view of a logically non-contiguous ``A`` is never contiguous, and
# a logically contiguous one is made contiguous with ``.contiguous()``.  ``_linalg_det`` and
# ``_linalg_slogdet`` follow the same pattern.


# ---------------------------------------------------------------------------------------------
# helpers

def _logical_shape(x: torch.Tensor, bdim: Optional[int]) -> Tuple[int, ...]:
    if bdim is None:
        return tuple(x.shape)
    return tuple(x.shape[:bdim]) + tuple(x.shape[bdim + 1:])


def _logically_contiguous(x: torch.Tensor, bdim: Optional[int]) -> bool:
    """``x.is_contiguous()`` of the per-example tensor (the physical strides minus the batch)."""
    if bdim is None:
        return x.is_contiguous()
    shape = _logical_shape(x, bdim)
    strides = x.stride()[:bdim] + x.stride()[bdim + 1:]
    if 0 in shape:
        return True
    expected = 1
    for size, stride in zip(reversed(shape), reversed(strides)):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _require_rank(x: torch.Tensor, bdim: Optional[int], core: int) -> int:
    """The logical rank of ``x``; Decline when it is below ``core``."""
    r = logical_rank(x, bdim)
    if r < core:
        raise Decline()
    return r


def _aligned(size: int, operands: Sequence[Tuple[torch.Tensor, Optional[int], int]]):
    """Batch-first views of ``(x, bdim, core_rank)`` operands, padded to a common number of
    logical batch dims.  Returns the views and, per operand, the number of size-1 dims added."""
    ranks = [_require_rank(x, d, core) for x, d, core in operands]
    batch_rank = max(r - core for r, (_, _, core) in zip(ranks, operands))
    views, pads = [], []
    for r, (x, d, core) in zip(ranks, operands):
        target = batch_rank + core
        views.append(pad_to_rank(ensure_bdim_front(x, d, size), target))
        pads.append(target - r)
    return views, pads


def _unpad(x: torch.Tensor, pad: int) -> torch.Tensor:
    """Remove the ``pad`` size-1 dims that ``_aligned`` added right after the batch dim."""
    return x.squeeze(tuple(range(1, pad + 1))) if pad else x


def _placeholder(x: torch.Tensor, size: int) -> torch.Tensor:
    """A ``[0]``-shaped output that was not computed, as a batch of such."""
    return x.new_empty((size, 0))


def _front_outputs(out, size: int, placeholders: Sequence[int] = ()):
    """All outputs batch-first (bdim 0); the listed ones are ``[0]`` placeholders."""
    if isinstance(out, torch.Tensor):
        return out, 0
    out = tuple(_placeholder(o, size) if i in placeholders else o for i, o in enumerate(out))
    return out, (0,) * len(out)


def _only_first_batched(in_dims) -> Optional[int]:
    if any(d is not None for d in in_dims[1:]) or in_dims[0] is None:
        raise Decline()
    return in_dims[0]


def _matrix_rule(op, placeholders=lambda *args, **kwargs: ()):
    """Rule for an op of one (batched) matrix argument that batches over leading dims."""
    def rule(info, in_dims, A, *args, **kwargs):
        bdim = _only_first_batched(in_dims)
        _require_rank(A, bdim, 2)
        out = op(move_bdim_to_front(A, bdim), *args, **kwargs)
        return _front_outputs(out, info.batch_size, placeholders(*args, **kwargs))
    rule.__name__ = f"{op.overloadpacket.__name__}_rule"
    return rule


def _unless(position: int, name: str, outputs: Sequence[int]):
    """Placeholders: ``outputs`` when the bool argument ``name`` (default True; ``position``
    counts the arguments after A) is False."""
    def placeholders(*args, **kwargs):
        value = args[position] if len(args) > position else kwargs.get(name, True)
        return () if value else outputs
    return placeholders


# ---------------------------------------------------------------------------------------------
# one matrix in, everything batched like it

_PLAIN_MATRIX_OPS = (
    aten.linalg_inv_ex.default,
    aten.linalg_lu_factor_ex.default, aten.linalg_eig.default, aten.geqrf.default,
    aten.linalg_cholesky_ex.default, aten.cholesky.default, aten.cholesky_inverse.default,
    aten.linalg_ldl_factor_ex.default, aten._linalg_eigvals.default,
)
for _op in _PLAIN_MATRIX_OPS:
    register_batch_rule(_op, _matrix_rule(_op))

# linalg_lu(A, *, pivot): P is a placeholder without pivoting.
register_batch_rule(aten.linalg_lu.default, _matrix_rule(
    aten.linalg_lu.default, lambda *a, pivot=True: () if pivot else (0,)))
# _linalg_svd(A, full_matrices, compute_uv, *, driver): U and Vh without compute_uv.
register_batch_rule(aten._linalg_svd.default, _matrix_rule(
    aten._linalg_svd.default, _unless(1, "compute_uv", (0, 2))))
# _linalg_eigh(A, UPLO, compute_v): eigenvectors without compute_v.
register_batch_rule(aten._linalg_eigh.default, _matrix_rule(
    aten._linalg_eigh.default, _unless(1, "compute_v", (1,))))
# linalg_qr(A, mode): Q in mode 'r'.
register_batch_rule(aten.linalg_qr.default, _matrix_rule(
    aten.linalg_qr.default,
    lambda *a, **k: (0,) if (a[0] if a else k.get("mode", "reduced")) == "r" else ()))


def pinv_rule(info, in_dims, A, *, atol=None, rtol=None, hermitian=False, _kw_dims=None):
    """``atol`` / ``rtol`` are keyword tensors that broadcast against A's batch shape; they
    may be batched (the dispatcher passes their bdims in ``_kw_dims``)."""
    kw_dims = _kw_dims or {}
    operands, names = [(A, in_dims[0], 2)], []
    for name, tol in (("atol", atol), ("rtol", rtol)):
        if tol is not None:
            operands.append((tol, kw_dims.get(name), 0))
            names.append(name)
    views, _ = _aligned(info.batch_size, operands)
    tols = dict(zip(names, views[1:]))
    return aten.linalg_pinv.atol_rtol_tensor(views[0], hermitian=hermitian, **tols), 0


register_batch_rule(aten.linalg_pinv.atol_rtol_tensor, pinv_rule, batched_kwargs=True)


@register_batch_rule(aten._linalg_check_errors.default)
def check_errors_rule(info, in_dims, infos, api_name, *, is_matrix):
    """Raises eager's error for the first failing example, with its batch index."""
    aten._linalg_check_errors.default(move_bdim_to_front(infos, in_dims[0]), api_name,
                                      is_matrix=False)
    return None, None


@register_batch_rule(aten.linalg_matrix_exp.default)
def matrix_exp_rule(info, in_dims, A):
    # The kernel fails on a non-contiguous input with several batch dims ("view size is not
    # compatible"): it gets the batch flattened into one dim.
    bdim = _only_first_batched(in_dims)
    _require_rank(A, bdim, 2)
    A_front = move_bdim_to_front(A, bdim)
    out = aten.linalg_matrix_exp.default(A_front.reshape((-1,) + A_front.shape[-2:]))
    return out.view(A_front.shape), 0


def _as_logically_contiguous(A_front: torch.Tensor, A: torch.Tensor, bdim) -> torch.Tensor:
    """See Note [contiguity of A]."""
    return A_front.contiguous() if _logically_contiguous(A, bdim) else A_front


def _det_like(op):
    def rule(info, in_dims, A):
        bdim = _only_first_batched(in_dims)
        _require_rank(A, bdim, 2)
        A_front = _as_logically_contiguous(move_bdim_to_front(A, bdim), A, bdim)
        return _front_outputs(op(A_front), info.batch_size)
    rule.__name__ = f"{op.overloadpacket.__name__}_rule"
    return rule


register_batch_rule(aten._linalg_det.default, _det_like(aten._linalg_det.default))
register_batch_rule(aten._linalg_slogdet.default, _det_like(aten._linalg_slogdet.default))


# ---------------------------------------------------------------------------------------------
# solves: several operands that broadcast their batch dims

def _is_vector_rhs(A_shape: Tuple[int, ...], B_shape: Tuple[int, ...]) -> bool:
    """``linalg.solve``'s per-example test: ``B`` is a (batch of) vector(s)."""
    return len(B_shape) == 1 or (len(B_shape) == len(A_shape) - 1 and B_shape == A_shape[:-1])


# Note [folding the batch into B's columns]
# With the coefficient matrix (or its factors) unbatched and ``left=True``, the examples'
# right-hand sides are columns of one bigger right-hand side: ``A X_i = B_i`` for all i is
# ``A [X_1 ... X_B] = [B_1 ... B_B]``.  So ``B`` of shape ``[B, *b, n, k]`` becomes
# ``[*b, n, k*B]`` and ONE solve runs with the unbatched ``A``: no copies of ``A``, and for
# ``_linalg_solve_ex`` one factorization instead of B.  The folded ``B`` is given at least
# ``A``'s rank (leading size-1 dims) so the kernel never reads it as a batch of vectors.

def _fold_columns(B: torch.Tensor, bdim, size: int, min_rank: int) -> torch.Tensor:
    folded = ensure_bdim_front(B, bdim, size).movedim(0, -1).flatten(-2)
    missing = min_rank - folded.dim()
    return folded.reshape((1,) * missing + tuple(folded.shape)) if missing > 0 else folded


def _unfold_columns(X: torch.Tensor, size: int) -> torch.Tensor:
    return X.unflatten(-1, (-1, size)).movedim(-1, 0)


@register_batch_rule(aten._linalg_solve_ex.default)
def solve_ex_rule(info, in_dims, A, B, *, left=True, check_errors=False):
    Ad, Bd = in_dims
    size = info.batch_size
    A_shape, B_shape = _logical_shape(A, Ad), _logical_shape(B, Bd)
    if len(A_shape) < 2 or len(B_shape) < 1:
        raise Decline()
    vector = _is_vector_rhs(A_shape, B_shape)
    if vector:
        # Solve with B as a one-column matrix and squeeze it after, as eager does (also with
        # left=False, where only 1x1 systems are compatible).
        B = ensure_bdim_front(B, Bd, size).unsqueeze(-1)
        Bd = 0
    if Ad is None and left:  # Note [folding the batch into B's columns]
        out = aten._linalg_solve_ex.default(A, _fold_columns(B, Bd, size, A.dim()),
                                            left=True, check_errors=check_errors)
        result = _unfold_columns(out[0], size)
        return (result.squeeze(-1) if vector else result,) + tuple(out[1:]), \
            (0, None, None, None)
    (A_front, B_front), (a_pad, _) = _aligned(size, [(A, Ad, 2), (B, Bd, 2)])
    A_front = _as_logically_contiguous(A_front, A, Ad)
    result, LU, pivots, info_ = aten._linalg_solve_ex.default(
        A_front, B_front, left=left, check_errors=check_errors)
    if vector:
        result = result.squeeze(-1)
    # LU, pivots and info have A's own batch shape (no broadcasting with B).
    return (result, _unpad(LU, a_pad), _unpad(pivots, a_pad), _unpad(info_, a_pad)), (0, 0, 0, 0)


def _solve_with(op, factors, B, Bd, size: int, fold: bool, **kwargs):
    """``op(*factors, B)``; ``factors`` are ``(tensor, bdim, core_rank)``.  ``fold``: the factors
    are unbatched and the system is ``A X = B`` (Note [folding the batch into B's columns])."""
    if fold:
        _require_rank(B, Bd, 2)
        rank = max(f.dim() for f, _, _ in factors)
        X = op(*(f for f, _, _ in factors), _fold_columns(B, Bd, size, rank), **kwargs)
        return _unfold_columns(X, size), 0
    views, _ = _aligned(size, list(factors) + [(B, Bd, 2)])
    return op(*views, **kwargs), 0


@register_batch_rule(aten.linalg_solve_triangular.default)
def solve_triangular_rule(info, in_dims, A, B, *, upper, left=True, unitriangular=False):
    return _solve_with(aten.linalg_solve_triangular.default, [(A, in_dims[0], 2)], B, in_dims[1],
                       info.batch_size, in_dims[0] is None and left, upper=upper, left=left,
                       unitriangular=unitriangular)


@register_batch_rule(aten.triangular_solve.default)
def triangular_solve_rule(info, in_dims, B, A, *args, **kwargs):
    (B_front, A_front), _ = _aligned(info.batch_size, [(B, in_dims[0], 2), (A, in_dims[1], 2)])
    out = aten.triangular_solve.default(B_front, A_front, *args, **kwargs)
    return tuple(out), (0, 0)


@register_batch_rule(aten.cholesky_solve.default)
def cholesky_solve_rule(info, in_dims, B, L, upper=False):
    op = lambda l, b, **kw: aten.cholesky_solve.default(b, l, **kw)  # noqa: E731  (B comes first)
    return _solve_with(op, [(L, in_dims[1], 2)], B, in_dims[0], info.batch_size,
                       in_dims[1] is None, upper=upper)


def _factored_solve_rule(op):
    """``op(factors, pivots, B, ...)``: factors and pivots share a batch shape; B broadcasts."""
    def rule(info, in_dims, F, pivots, B, **kwargs):
        fold = in_dims[0] is None and in_dims[1] is None and kwargs.get("left", True)
        return _solve_with(op, [(F, in_dims[0], 2), (pivots, in_dims[1], 1)], B, in_dims[2],
                           info.batch_size, fold, **kwargs)
    rule.__name__ = f"{op.overloadpacket.__name__}_rule"
    return rule


for _op in (aten.linalg_lu_solve.default, aten.linalg_ldl_solve.default):
    register_batch_rule(_op, _factored_solve_rule(_op))


# ---------------------------------------------------------------------------------------------
# ops whose operands must share one batch shape exactly (no broadcasting)

@register_batch_rule(aten.lu_unpack.default)
def lu_unpack_rule(info, in_dims, LU, pivots, unpack_data=True, unpack_pivots=True):
    (LU_front, p_front), _ = _aligned(info.batch_size, [(LU, in_dims[0], 2),
                                                        (pivots, in_dims[1], 1)])
    out = aten.lu_unpack.default(LU_front, p_front, unpack_data, unpack_pivots)
    placeholders = (() if unpack_pivots else (0,)) + (() if unpack_data else (1, 2))
    return _front_outputs(out, info.batch_size, placeholders)


@register_batch_rule(aten.linalg_householder_product.default)
def householder_product_rule(info, in_dims, V, tau):
    (V_front, tau_front), _ = _aligned(info.batch_size, [(V, in_dims[0], 2),
                                                         (tau, in_dims[1], 1)])
    return aten.linalg_householder_product.default(V_front, tau_front), 0


@register_batch_rule(aten.ormqr.default)
def ormqr_rule(info, in_dims, V, tau, C, *args, **kwargs):
    (V_front, tau_front, C_front), _ = _aligned(
        info.batch_size, [(V, in_dims[0], 2), (tau, in_dims[1], 1), (C, in_dims[2], 2)])
    return aten.ormqr.default(V_front, tau_front, C_front, *args, **kwargs), 0


# ---------------------------------------------------------------------------------------------
# cross products, trace, renorm, distances

@register_batch_rule(aten.linalg_cross.default)
def linalg_cross_rule(info, in_dims, x, y, *, dim=-1):
    rank = _require_rank(x, in_dims[0], 1)
    if logical_rank(y, in_dims[1]) != rank:
        raise Decline()  # eager refuses operands of different ranks: let the fallback say so
    X, Y = ensure_bdim_front(x, in_dims[0], info.batch_size), \
        ensure_bdim_front(y, in_dims[1], info.batch_size)
    return aten.linalg_cross.default(X, Y, dim=normalize_dim(dim, rank) + 1), 0


@register_batch_rule(aten.trace.default)
def trace_rule(info, in_dims, x):
    bdim = _only_first_batched(in_dims)
    if logical_rank(x, bdim) != 2:
        raise Decline()
    return torch.diagonal(move_bdim_to_front(x, bdim), 0, -2, -1).sum(-1), 0


@register_batch_rule(aten.renorm.default)
def renorm_rule(info, in_dims, x, p, dim, maxnorm):
    """The batch is folded into ``dim``: each (example, slice) pair is one sub-tensor."""
    bdim = _only_first_batched(in_dims)
    d = normalize_dim(dim, _require_rank(x, bdim, 2))  # eager needs 2 dims
    folded = move_bdim_to_front(x, bdim).movedim(0, d).flatten(d, d + 1)
    out = aten.renorm.default(folded, p, d, maxnorm)
    return out.unflatten(d, (info.batch_size, -1)), d


@register_batch_rule(aten._cdist_forward.default)
def cdist_forward_rule(info, in_dims, x1, x2, p, compute_mode):
    (X1, X2), _ = _aligned(info.batch_size, [(x1, in_dims[0], 2), (x2, in_dims[1], 2)])
    return aten._cdist_forward.default(X1, X2, p, compute_mode), 0


@register_batch_rule(aten._cdist_backward.default)
def cdist_backward_rule(info, in_dims, grad, x1, x2, p, cdist):
    views, _ = _aligned(info.batch_size, [(grad, in_dims[0], 2), (x1, in_dims[1], 2),
                                          (x2, in_dims[2], 2), (cdist, in_dims[4], 2)])
    G, X1, X2, D = (v.contiguous() for v in views)
    return aten._cdist_backward.default(G, X1, X2, p, D), 0


# ``_pdist_forward`` only takes a 2-D input.  A batch of examples ``[B, N, M]`` goes through the
# batched ``_cdist_forward(X, X)`` (without the matrix-product shortcut, so each distance is
# computed from the differences like pdist does) and keeps the pairs i < j, in pdist's order.
# The backward scatters the pair gradients into a symmetric [B, N, N] matrix: the gradient of
# ``cdist(X, X)`` with respect to its first argument then sums, for each point, the terms of
# the pairs it belongs to, which is pdist's gradient.
_NO_MM = 2  # cdist's compute_mode 'donot_use_mm_for_euclid_dist'


def _pair_index(n: int, device, transposed: bool = False) -> torch.Tensor:
    """Flat indices into an ``[n, n]`` matrix of its entries (i, j), i < j (or (j, i))."""
    i, j = torch.triu_indices(n, n, 1, device=device)
    return j * n + i if transposed else i * n + j


def _symmetric(values: torch.Tensor, n: int) -> torch.Tensor:
    """``[B, n(n-1)/2]`` pair values as a symmetric ``[B, n, n]`` matrix, zero diagonal."""
    full = values.new_zeros((values.shape[0], n * n))
    for transposed in (False, True):
        index = _pair_index(n, values.device, transposed).expand(values.shape[0], -1)
        full = full.scatter(1, index, values)
    return full.view(-1, n, n)


@register_batch_rule(aten._pdist_forward.default)
def pdist_forward_rule(info, in_dims, x, p=2.0):
    bdim = _only_first_batched(in_dims)
    if logical_rank(x, bdim) != 2:
        raise Decline()
    X = move_bdim_to_front(x, bdim)
    n = X.shape[1]
    full = aten._cdist_forward.default(X, X, p, _NO_MM).flatten(1)
    return full.index_select(1, _pair_index(n, X.device)), 0


@register_batch_rule(aten._pdist_backward.default)
def pdist_backward_rule(info, in_dims, grad, x, p, pdist):
    size = info.batch_size
    if logical_rank(x, in_dims[1]) != 2:
        raise Decline()
    X = ensure_bdim_front(x, in_dims[1], size).contiguous()
    n = X.shape[1]
    G = _symmetric(ensure_bdim_front(grad, in_dims[0], size), n)
    D = _symmetric(ensure_bdim_front(pdist, in_dims[3], size), n)
    return aten._cdist_backward.default(G, X, X, p, D), 0
