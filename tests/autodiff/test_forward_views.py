"""Forward AD through lazy views of UNBATCHED primals whose tangents are batched, and reverse mode
through the views of empty tensors, checked against a for-loop of plain forward/reverse AD and
against torch.func.

* ``torch.fft.ifft`` / ``ihfft`` (a real input) and ``hfft`` take a lazy ``.conj()`` of an
  intermediate.  With the primal unbatched and the tangent batched (``vmap(jvp(f),
  in_dims=(None, 0))``, i.e. ``jacfwd``, or the other way round) the primal's conj view has a conj
  bit and the batched tangent's conj is materialised, and PyTorch's forward AD used to fail with
  its internal assert "has_fw_view ... same layout as primal".  jvp now takes the exact
  double-vjp route there.
* ``linalg.eig`` of an empty matrix under ``vmap(vjp)``: its backward writes (``fill_``) into a
  fresh empty tensor, and every empty storage has address 0, so the record of materialised conj
  views took it for a write into ``L.conj()``'s base and refused it.
"""
from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fwAD

import functrans as ft
from tests.support.oracles import perturb_like

B = 3


def _ref_jvp(f, x, t):
    with fwAD.dual_level():
        out = f(fwAD.make_dual(x, t))
        p, tt = fwAD.unpack_dual(out)
        return p.clone(), tt.clone()


def _examples(x, seed):
    return torch.stack([perturb_like(x, seed + i) for i in range(B)])


FFTS = {
    "fft.ifft": lambda x: torch.fft.ifft(x),
    "fft.ihfft": lambda x: torch.fft.ihfft(x),
    "fft.hfft": lambda x: torch.fft.hfft(x),
    "fft.hfft2": lambda x: torch.fft.hfft2(x),
    "fft.hfftn": lambda x: torch.fft.hfftn(x, dim=(0, 1)),
    "fft.ihfft2": lambda x: torch.fft.ihfft2(x),
    "fft.ihfftn": lambda x: torch.fft.ihfftn(x, dim=(0, 1)),
}


@pytest.mark.parametrize("name", list(FFTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fft_jvp_unbatched_primal_batched_tangent(name, dtype):
    f = FFTS[name]
    x = perturb_like(torch.ones(4, 5, dtype=dtype), 1)
    T = _examples(x, 10)
    out_p, out_t = ft.vmap(lambda t: ft.jvp(f, (x,), (t,)), in_dims=0)(T)
    refs = [_ref_jvp(f, x, T[i].clone()) for i in range(B)]
    for i, (p, t) in enumerate(refs):
        torch.testing.assert_close(out_p[i], p)
        torch.testing.assert_close(out_t[i], t)
    tf_p, tf_t = torch.func.vmap(lambda t: torch.func.jvp(f, (x,), (t,)))(T)
    torch.testing.assert_close(out_t, tf_t)


@pytest.mark.parametrize("name", ["fft.ifft", "fft.hfft", "fft.ihfft"])
def test_fft_jvp_batched_primal_unbatched_tangent(name):
    f = FFTS[name]
    X = _examples(torch.ones(4, 5, dtype=torch.float64), 20)
    t = perturb_like(X[0], 30)
    out_p, out_t = ft.vmap(lambda x: ft.jvp(f, (x,), (t,)))(X)
    for i in range(B):
        p, tt = _ref_jvp(f, X[i].clone(), t)
        torch.testing.assert_close(out_p[i], p)
        torch.testing.assert_close(out_t[i], tt)


@pytest.mark.parametrize("name", ["fft.ifft", "fft.hfft", "fft.ihfft"])
def test_fft_jacfwd_matches_torch_func(name):
    f = FFTS[name]
    x = perturb_like(torch.ones(6, dtype=torch.float64), 3)
    g = (lambda v: torch.view_as_real(f(v).resolve_conj())) if name != "fft.hfft" else f
    torch.testing.assert_close(ft.jacfwd(g)(x), torch.func.jacfwd(g)(x))
    torch.testing.assert_close(ft.jacfwd(g)(x), torch.func.jacrev(g)(x))


def test_fft_vmap_jvp_of_real_input_no_internal_assert():
    # The user's view: no PyTorch internal assert, whatever is batched.
    x = torch.randn(5)
    for in_dims, args in (((None, 0), (x, torch.randn(B, 5))),
                          ((0, None), (torch.randn(B, 5), x)),
                          ((0, 0), (torch.randn(B, 5), torch.randn(B, 5)))):
        out = ft.vmap(lambda a, b: ft.jvp(torch.fft.ifft, (a,), (b,)), in_dims=in_dims)(*args)
        loop = [_ref_jvp(torch.fft.ifft, (args[0] if in_dims[0] is None else args[0][i]).clone(),
                         (args[1] if in_dims[1] is None else args[1][i]).clone())
                for i in range(B)]
        torch.testing.assert_close(out[1], torch.stack([t for _, t in loop]))


def test_jvp_still_raises_other_runtime_errors():
    # The double-vjp retry is for the layout assert only: a real error still reaches the user.
    def f(x):
        raise RuntimeError("a user error")
    with pytest.raises(RuntimeError, match="a user error"):
        ft.vmap(lambda t: ft.jvp(f, (torch.ones(2),), (t,)))(torch.ones(B, 2))


@pytest.mark.parametrize("n", [0, 3])
def test_eig_vmap_vjp_with_batched_primal(n):
    # vmap over vjp with the primal batched inside: n = 0 is the empty matrix whose backward
    # writes into an empty tensor (refused before as a write into a materialised conj view).
    A = torch.stack([perturb_like(torch.ones(n, n, dtype=torch.float64), 40 + i)
                     for i in range(B)])
    def eig(m):  # |V| is independent of each eigenvector's phase: a well-defined loss
        lo, ve = torch.linalg.eig(m)
        return lo, ve.abs()

    L, V = eig(A[0])
    CL = torch.stack([perturb_like(L, 50 + i) for i in range(B)])
    CV = torch.stack([perturb_like(V, 60 + i) for i in range(B)])

    def vjp_of(a, cl, cv):
        out, fn = ft.vjp(eig, a)
        return fn((cl, cv))[0]

    got = ft.vmap(vjp_of)(A, CL, CV)
    for i in range(B):
        a = A[i].clone().requires_grad_()
        lo, ve = eig(a)
        (want,) = torch.autograd.grad((lo, ve), a, (CL[i], CV[i]), allow_unused=True)
        want = torch.zeros_like(a) if want is None else want
        torch.testing.assert_close(got[i], want)


def test_write_into_empty_tensor_beside_a_conj_copy():
    # An empty tensor's storage never counts as the storage of a materialised conj view.
    def f(z):
        zc = z.conj()                        # materialised under vmap, recorded
        e = torch.empty(0, dtype=z.dtype)    # a fresh empty tensor: its storage address is 0
        e.fill_(1.0)
        w = z.new_zeros(0)
        w.fill_(2.0)
        return zc.real + e.numel() + w.numel()
    Z = torch.randn(B, 4, dtype=torch.complex128)
    torch.testing.assert_close(ft.vmap(f)(Z), Z.conj().real)


def test_write_into_conj_copy_base_still_refused():
    def f(z):
        zc = z.conj()
        z.mul_(2)
        return zc
    with pytest.raises(ft.UnsupportedUnderVmap, match="conj"):
        ft.vmap(f)(torch.randn(B, 4, dtype=torch.complex128))


# quantile / nanquantile (CompositeImplicitAutograd): with a dispatch mode active (vmap pushes
# one) ATen's quantile takes its in-place ``lerp_`` branch, whose tangent formula writes the
# batched tangent of ``q`` into the unbatched tangent of the input; vmap refuses that write, and
# jvp now takes the double-vjp route instead.
QUANTILES = {
    "quantile": lambda x, q: torch.quantile(x, q),
    "nanquantile": lambda x, q: torch.nanquantile(x, q),
    "quantile_dim": lambda x, q: torch.quantile(x, q, dim=1, keepdim=True),
    "nanquantile_nearest": lambda x, q: torch.nanquantile(x, q, dim=0,
                                                           interpolation="linear"),
}


@pytest.mark.parametrize("name", list(QUANTILES))
@pytest.mark.parametrize("in_dims", [(None, None, None, 0), (None, None, 0, None),
                                     (None, None, 0, 0), (None, 0, None, 0), (0, 0, 0, 0)])
def test_quantile_vmap_jvp_matches_loop(name, in_dims):
    f = QUANTILES[name]
    x = perturb_like(torch.ones(3, 4, dtype=torch.float64), 5)
    q = torch.tensor([0.03, 0.4, 0.9], dtype=torch.float64)
    tx, tq = perturb_like(x, 6), perturb_like(q, 7)
    base = (x, q, tx, tq)
    args = [b if d is None else _examples(b, 70 + 10 * k) if k != 1 else
            torch.stack([(q + 0.02 * i).clamp(0, 1) for i in range(B)])
            for k, (b, d) in enumerate(zip(base, in_dims))]
    out_p, out_t = ft.vmap(lambda a, b, c, d: ft.jvp(f, (a, b), (c, d)), in_dims=in_dims)(*args)
    for i in range(B):
        xi, qi, txi, tqi = [a if d is None else a[i].clone() for a, d in zip(args, in_dims)]
        with fwAD.dual_level():
            o = f(fwAD.make_dual(xi, txi), fwAD.make_dual(qi, tqi))
            p, t = fwAD.unpack_dual(o)
        torch.testing.assert_close(out_p[i], p)
        torch.testing.assert_close(out_t[i], t)


def test_users_own_write_into_unbatched_still_refused_under_jvp():
    # The retry on the double-vjp route is for tangent formulas: a function that writes a
    # batched value into an unbatched buffer itself still gets vmap's error.
    def f(x):
        buf = torch.zeros(3, dtype=x.dtype)
        buf.copy_(x)
        return buf
    with pytest.raises(ft.UnsupportedUnderVmap, match="in-place operation"):
        ft.vmap(lambda x, t: ft.jvp(f, (x,), (t,)))(torch.randn(B, 3), torch.randn(B, 3))
