"""Linear-algebra solver / factorization rules vs the loop oracle (every in_dims choice,
vmap∘vmap, strict) and per-sample gradients vs torch.func."""
import pytest
import torch

import functrans as ft
from tests.support.oracles import assert_same, check_vmap_all_bdims

g = torch.Generator().manual_seed(0)
N = 4


def randn(*shape, dtype=torch.float64):
    return torch.randn(*shape, generator=g, dtype=dtype)


def spd(x):
    """A well-conditioned symmetric positive definite matrix (stack) built from ``x``."""
    eye = torch.eye(x.shape[-1], dtype=x.dtype)
    return x @ x.mT + x.shape[-1] * eye


A = randn(N, N) + N * torch.eye(N, dtype=torch.float64)       # well-conditioned, general
A2 = randn(2, N, N) + N * torch.eye(N, dtype=torch.float64)   # a stack of them
X = randn(N, N)                                               # spd(X) is SPD
RECT = randn(5, 3)
Bm = randn(N, 2)
Bv = randn(N)


# --- one matrix in -----------------------------------------------------------------------------

@pytest.mark.parametrize("fn", [
    lambda a: torch.linalg.svd(a, full_matrices=False),
    lambda a: torch.linalg.svd(a, full_matrices=True),
    torch.linalg.svdvals,
    lambda a: torch.svd(a, compute_uv=False),
    torch.linalg.pinv, torch.pinverse,
    torch.linalg.qr, lambda a: torch.linalg.qr(a, mode="complete"),
    lambda a: torch.linalg.qr(a, mode="r"), torch.geqrf,
    torch.linalg.matrix_rank, lambda a: torch.linalg.norm(a, "nuc"),
], ids=["svd", "svd_full", "svdvals", "svd_no_uv", "pinv", "pinverse", "qr", "qr_complete",
        "qr_r", "geqrf", "matrix_rank", "nuc"])
def test_rectangular_factorizations(fn):
    check_vmap_all_bdims(fn, [RECT])


@pytest.mark.parametrize("fn", [
    torch.linalg.inv, torch.linalg.inv_ex, torch.linalg.lu_factor, torch.linalg.lu_factor_ex,
    torch.linalg.lu, torch.linalg.det, torch.linalg.slogdet, torch.linalg.eig,
    torch.linalg.eigvals, torch.linalg.matrix_exp, torch.linalg.cond, torch.trace,
    lambda a: torch.linalg.matrix_power(a, 3), lambda a: torch.linalg.matrix_power(a, -2),
    lambda a: torch.linalg.pinv(a, hermitian=False, atol=torch.tensor(0.5, dtype=a.dtype)),
], ids=["inv", "inv_ex", "lu_factor", "lu_factor_ex", "lu", "det", "slogdet", "eig", "eigvals",
        "matrix_exp", "cond", "trace", "matrix_power", "matrix_power_neg", "pinv_atol"])
def test_square_ops(fn):
    check_vmap_all_bdims(fn, [A])


@pytest.mark.parametrize("fn", [
    torch.linalg.inv, torch.linalg.det, torch.linalg.slogdet, torch.linalg.matrix_exp,
    torch.linalg.lu_factor, torch.linalg.eigvals,
], ids=["inv", "det", "slogdet", "matrix_exp", "lu_factor", "eigvals"])
def test_square_ops_on_stacks(fn):
    check_vmap_all_bdims(fn, [A2])


@pytest.mark.parametrize("fn", [
    torch.linalg.cholesky, lambda s: torch.linalg.cholesky(s, upper=True),
    torch.linalg.cholesky_ex, torch.cholesky, torch.linalg.eigh, torch.linalg.eigvalsh,
    lambda s: torch.linalg.eigh(s, UPLO="U"), lambda s: torch.linalg.pinv(s, hermitian=True),
    torch.linalg.ldl_factor, torch.linalg.ldl_factor_ex, torch.logdet,
    lambda s: torch.cholesky_inverse(torch.linalg.cholesky(s)),
    lambda s: torch.cholesky_inverse(torch.linalg.cholesky(s, upper=True), upper=True),
], ids=["cholesky", "cholesky_upper", "cholesky_ex", "torch_cholesky", "eigh", "eigvalsh",
        "eigh_U", "pinv_hermitian", "ldl_factor", "ldl_factor_ex", "logdet",
        "cholesky_inverse", "cholesky_inverse_upper"])
def test_symmetric_ops(fn):
    check_vmap_all_bdims(lambda x: fn(spd(x)), [X])


def test_pinv_with_batched_tolerances():
    f = lambda a, atol, rtol: torch.linalg.pinv(a, atol=atol, rtol=rtol)
    check_vmap_all_bdims(f, [RECT, torch.tensor(0.3, dtype=torch.float64),
                             torch.tensor(0.01, dtype=torch.float64)])
    # a tolerance with more batch dims than the matrix broadcasts the result
    check_vmap_all_bdims(lambda a, atol: torch.linalg.pinv(a, atol=atol),
                         [RECT, torch.tensor([0.1, 1.0], dtype=torch.float64)])


def test_placeholder_outputs_and_lu_unpack():
    check_vmap_all_bdims(lambda a: torch.linalg.svd(a)[1], [RECT])
    check_vmap_all_bdims(lambda a: torch.ops.aten._linalg_svd(a, False, False), [RECT])
    check_vmap_all_bdims(lambda a: torch.ops.aten._linalg_eigh(a, "L", False), [spd(X)])
    for data, piv in ((True, True), (False, True), (True, False), (False, False)):
        f = lambda lu, p: torch.lu_unpack(lu, p, unpack_data=data, unpack_pivots=piv)
        LU, pivots = torch.linalg.lu_factor(A)
        check_vmap_all_bdims(f, [LU, pivots], nested=data and piv)


# --- solves ------------------------------------------------------------------------------------

@pytest.mark.parametrize("left", [True, False])
@pytest.mark.parametrize("a,b", [(A, Bm), (A, Bv), (A2, Bm), (A2, Bv), (A2, randn(2, N)),
                                 (A, randn(3, N, 2)), (A, randn(N, N))],
                         ids=["mat", "vec", "stack_mat", "stack_vec", "stack_batched_vec",
                              "batched_B", "square_B"])
def test_solve(a, b, left):
    if not left:
        b = b.mT if b.dim() > 1 else b
        if b.dim() == 1 or b.shape == a.shape[:-1] or b.shape[-1] != a.shape[-1]:
            pytest.skip("eager refuses these shapes with left=False")
    check_vmap_all_bdims(lambda x, y: torch.linalg.solve(x, y, left=left), [a, b])
    check_vmap_all_bdims(lambda x, y: torch.linalg.solve_ex(x, y, left=left), [a, b],
                         nested=False)


@pytest.mark.parametrize("upper", [True, False])
@pytest.mark.parametrize("left", [True, False])
@pytest.mark.parametrize("unitriangular", [True, False])
def test_solve_triangular(upper, left, unitriangular):
    b = randn(N, 3) if left else randn(3, N)
    f = lambda a, y: torch.linalg.solve_triangular(a, y, upper=upper, left=left,
                                                   unitriangular=unitriangular)
    check_vmap_all_bdims(f, [A, b])
    check_vmap_all_bdims(f, [A2, b], nested=False)


@pytest.mark.parametrize("transpose", [True, False])
def test_triangular_solve(transpose):
    f = lambda y, a: torch.triangular_solve(y, a, upper=False, transpose=transpose)
    check_vmap_all_bdims(f, [Bm, A])
    check_vmap_all_bdims(f, [randn(3, N, 2), A2[:1]], nested=False)


@pytest.mark.parametrize("left,adjoint", [(True, False), (True, True), (False, False),
                                          (False, True)])
def test_lu_solve(left, adjoint):
    LU, pivots = torch.linalg.lu_factor(A)
    b = Bm if left else Bm.mT
    f = lambda lu, p, y: torch.linalg.lu_solve(lu, p, y, left=left, adjoint=adjoint)
    check_vmap_all_bdims(f, [LU, pivots, b])
    LU2, pivots2 = torch.linalg.lu_factor(A2)
    check_vmap_all_bdims(f, [LU2, pivots2, b], nested=False)
    check_vmap_all_bdims(lambda y, lu, p: torch.lu_solve(y, lu, p), [Bm, LU, pivots],
                         nested=False)


@pytest.mark.parametrize("upper", [True, False])
def test_cholesky_solve_and_ldl_solve(upper):
    L = torch.linalg.cholesky(spd(X), upper=upper)
    check_vmap_all_bdims(lambda y, l: torch.cholesky_solve(y, l, upper=upper), [Bm, L])
    check_vmap_all_bdims(lambda y, l: torch.cholesky_solve(y, l, upper=upper),
                         [randn(3, N, 2), L], nested=False)
    LD, pivots = torch.linalg.ldl_factor(spd(X))
    check_vmap_all_bdims(lambda ld, p, y: torch.linalg.ldl_solve(ld, p, y),
                         [LD, pivots, Bm])


def test_householder_product_and_ormqr():
    a, tau = torch.geqrf(RECT)
    check_vmap_all_bdims(torch.linalg.householder_product, [a, tau])
    for left, transpose in ((True, False), (True, True), (False, False)):
        c = randn(5, 2) if left else randn(2, 5)
        check_vmap_all_bdims(lambda v, t, y: torch.ormqr(v, t, y, left=left,
                                                         transpose=transpose), [a, tau, c])


def test_tensorinv_and_tensorsolve():
    t = randn(N, 2, 2) + torch.eye(N, dtype=torch.float64).view(N, 2, 2) * N
    check_vmap_all_bdims(lambda x: torch.linalg.tensorinv(x, ind=1), [t])
    check_vmap_all_bdims(torch.linalg.tensorsolve, [t, randn(N)])


# --- cross, trace, renorm, distances -----------------------------------------------------------

def test_cross():
    x, y = randn(4, 3), randn(4, 3)
    check_vmap_all_bdims(torch.linalg.cross, [x, y])
    check_vmap_all_bdims(lambda a, b: torch.linalg.cross(a, b, dim=0), [x.mT, y.mT])
    check_vmap_all_bdims(lambda a, b: torch.cross(a, b, dim=1), [x, y])
    check_vmap_all_bdims(torch.linalg.cross, [x, randn(1, 3)])   # broadcasting
    check_vmap_all_bdims(torch.linalg.cross, [randn(3), randn(3)])


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_renorm(dim):
    check_vmap_all_bdims(lambda x: torch.renorm(x, 2, dim, 1.0), [randn(3, 4, 2)])
    check_vmap_all_bdims(lambda x: torch.renorm(x, 1, 0, 0.5), [randn(5, 1)])
    with pytest.raises(RuntimeError):  # eager needs 2 dims: declined, the loop raises
        ft.vmap(lambda x: torch.renorm(x, 2, 0, 1.0))(randn(3, 5))


def test_trace_integer():
    check_vmap_all_bdims(torch.trace, [torch.arange(12).view(3, 4)])


@pytest.mark.parametrize("p", [0.0, 1.0, 2.0, 3.0, float("inf")])
def test_cdist_pdist(p):
    check_vmap_all_bdims(lambda a, b: torch.cdist(a, b, p=p), [randn(5, 3), randn(4, 3)])
    check_vmap_all_bdims(lambda a, b: torch.cdist(a, b, p=p), [randn(2, 5, 3), randn(4, 3)],
                         nested=False)
    check_vmap_all_bdims(lambda a: torch.nn.functional.pdist(a, p=p), [randn(5, 3)])


def test_cdist_large_uses_matmul_path():
    check_vmap_all_bdims(torch.cdist, [randn(30, 3), randn(27, 3)], nested=False)


def test_too_small_operands_give_eager_errors():
    for fn in (torch.linalg.inv, torch.linalg.det, torch.trace, torch.linalg.svd):
        with pytest.raises(RuntimeError):
            ft.vmap(fn)(randn(3, 4))
    with pytest.raises(RuntimeError):
        ft.vmap(torch.linalg.solve)(randn(3, N), randn(3, N))


def test_singular_matrix_error_under_vmap():
    singular = torch.stack([A, torch.zeros(N, N, dtype=torch.float64)])
    with pytest.raises(torch.linalg.LinAlgError):
        ft.vmap(torch.linalg.inv)(singular)
    # the _ex variants report it in info instead
    with ft.config.strict_fallback():
        _, info = ft.vmap(torch.linalg.inv_ex)(singular)
    assert info[0] == 0 and info[1] > 0


# --- gradients ---------------------------------------------------------------------------------

def _per_sample_grads(f, args, in_dims):
    with ft.config.strict_fallback():
        ours = ft.vmap(ft.grad(f, argnums=tuple(range(len(args)))), in_dims=in_dims)(*args)
    ref = torch.func.vmap(torch.func.grad(f, argnums=tuple(range(len(args)))),
                          in_dims=in_dims)(*args)
    assert_same(ours, ref, rtol=1e-7, atol=1e-9)


GRAD_FNS = {
    "solve": lambda a, b: torch.linalg.solve(a, b).square().sum(),
    "solve_left_false": lambda a, b: torch.linalg.solve(a, b.mT, left=False).sin().sum(),
    "inv": lambda a, b: (torch.linalg.inv(a) @ b).sum(),
    "slogdet": lambda a, b: torch.linalg.slogdet(a)[1] + b.sum(),
    "det": lambda a, b: torch.linalg.det(a) * b.sum(),
    "eigh": lambda a, b: torch.linalg.eigh(spd(a))[0].log().sum() + (b * b).sum(),
    "eigh_vectors": lambda a, b: (torch.linalg.eigh(spd(a))[1].abs() * a).sum() + b.sum(),
    "cholesky": lambda a, b: torch.cholesky_solve(b, torch.linalg.cholesky(spd(a))).sum(),
    "svd": lambda a, b: torch.linalg.svdvals(a).sum() * b.mean(),
    "qr": lambda a, b: torch.linalg.qr(a)[1].diagonal().abs().sum() + b.sum(),
    "lu_solve": lambda a, b: torch.linalg.lu_solve(*torch.linalg.lu_factor(a), b).sum(),
    "solve_triangular": lambda a, b: torch.linalg.solve_triangular(
        a.triu(), b, upper=True).cos().sum(),
    "matrix_exp": lambda a, b: (torch.linalg.matrix_exp(0.1 * a) @ b).sum(),
    "pinv": lambda a, b: (torch.linalg.pinv(a) @ b).square().sum(),
    "trace": lambda a, b: torch.trace(a @ a) + b.sum(),
    "cdist": lambda a, b: torch.cdist(a, b.mT).sum(),
    "pdist": lambda a, b: torch.nn.functional.pdist(a).sum() + b.sum(),
    "renorm": lambda a, b: torch.renorm(a, 2, 0, 1.0).sum() * b.sum(),
    "cross": lambda a, b: torch.linalg.cross(a[:2, :3], b.mT[:, :3]).square().sum(),
}


@pytest.mark.parametrize("name", list(GRAD_FNS))
@pytest.mark.parametrize("in_dims", [(0, 0), (0, None), (None, 0), (-1, -1)],
                         ids=["both", "A_only", "B_only", "last_dims"])
def test_per_sample_gradients(name, in_dims):
    """``(-1, -1)`` makes the per-example A non-contiguous (see Note [contiguity of A])."""
    a = torch.stack([A + 0.1 * randn(N, N) for _ in range(3)]).movedim(0, in_dims[0]) \
        if in_dims[0] is not None else A
    b = torch.stack([Bm + 0.1 * randn(N, 2) for _ in range(3)]).movedim(0, in_dims[1]) \
        if in_dims[1] is not None else Bm
    _per_sample_grads(GRAD_FNS[name], (a, b), in_dims)


@pytest.mark.parametrize("name", ["solve", "det", "slogdet"])
def test_gradients_with_transposed_examples(name):
    """A per-example A that is a transposed view: the kernel factors A, not A^T."""
    f = GRAD_FNS[name]
    batch = torch.stack([A + 0.1 * randn(N, N) for _ in range(3)])
    with ft.config.strict_fallback():
        ours = ft.vmap(ft.grad(lambda a, b: f(a.mT, b)))(batch, Bm.expand(3, N, 2))
    exp = torch.stack([torch.autograd.grad(f(a.mT, Bm), a)[0]
                       for a in batch.clone().requires_grad_()])
    assert_same(ours, exp, rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("name", ["solve", "solve_left_false", "det", "slogdet"])
def test_gradients_with_strided_batch(name):
    """Contiguous examples in a non-contiguous batch (batch stride 2*N*N): the kernel must
    factor A^T, as the backward formula will assume (Note [contiguity of A])."""
    f = GRAD_FNS[name]
    batch = (randn(6, N, N) + N * torch.eye(N, dtype=torch.float64))[::2]
    with ft.config.strict_fallback():
        ours = ft.vmap(ft.grad(f), in_dims=(0, None))(batch, Bm)
    exp = torch.stack([torch.autograd.grad(f(a, Bm), a)[0]
                       for a in batch.clone().requires_grad_()])
    assert_same(ours, exp, rtol=1e-7, atol=1e-9)


def test_jvp_under_vmap():
    """Not strict: forward AD also reaches _new_zeros_with_same_feature_meta (factories.py),
    and linalg_solve_jvp computes shapes on meta tensors (prims ops); both loop for now."""
    f = lambda a: (torch.linalg.slogdet(a)[1], torch.linalg.solve(a, Bm),
                   torch.linalg.eigvalsh(spd(a)), torch.linalg.inv(a))
    batch = torch.stack([A + 0.1 * randn(N, N) for _ in range(3)])
    tangents = randn(3, N, N)
    with ft.config.strict_fallback(False):
        ours = ft.vmap(lambda a, t: ft.jvp(f, (a,), (t,)))(batch, tangents)
    ref = torch.func.vmap(lambda a, t: torch.func.jvp(f, (a,), (t,)))(batch, tangents)
    assert_same(ours, ref, rtol=1e-7, atol=1e-9)


def test_per_sample_gaussian_log_likelihood_vs_torch_func():
    """Per-sample gradients of a multivariate-normal log-likelihood with a learned Cholesky
    factor (cholesky, solve_triangular, logdet of the covariance), as in a GP / VAE loss."""
    params = {"L_raw": randn(N, N) * 0.3, "mu": randn(N)}
    xs = randn(6, N)

    def nll(p, x):
        cov = spd(p["L_raw"])
        L = torch.linalg.cholesky(cov)
        z = torch.linalg.solve_triangular(L, (x - p["mu"]).unsqueeze(-1), upper=False)
        return 0.5 * z.square().sum() + 0.5 * torch.logdet(cov)

    with ft.config.strict_fallback():
        ours = ft.vmap(ft.grad(nll), in_dims=(None, 0))(params, xs)
    ref = torch.func.vmap(torch.func.grad(nll), in_dims=(None, 0))(params, xs)
    assert_same(ours, ref, rtol=1e-7, atol=1e-9)
