"""The matmul family against the loop oracle (every in_dims choice, vmap∘vmap, strict) and under
autograd; per-sample gradients of an MLP against torch.func."""
import pytest
import torch
import torch.nn.functional as F

import functrans as ft
from tests.oracles import assert_same, check_vmap_all_bdims

g = torch.Generator().manual_seed(0)


def r(*shape):
    return torch.randn(*shape, generator=g)


CASES = {
    "mm": (torch.mm, [r(2, 3), r(3, 4)]),
    "bmm": (torch.bmm, [r(2, 2, 3), r(2, 3, 4)]),
    "mv": (torch.mv, [r(2, 3), r(3)]),
    "dot": (torch.dot, [r(3), r(3)]),
    "vdot": (torch.vdot, [r(3), r(3)]),
    "addmm": (lambda s, a, b: torch.addmm(s, a, b, beta=0.5, alpha=2), [r(2, 4), r(2, 3), r(3, 4)]),
    "addmm_bias": (lambda s, a, b: torch.addmm(s, a, b), [r(4), r(2, 3), r(3, 4)]),
    "addmm_beta0": (lambda s, a, b: torch.addmm(s, a, b, beta=0), [r(2, 4), r(2, 3), r(3, 4)]),
    "addmv": (lambda s, a, b: torch.addmv(s, a, b, alpha=3), [r(2), r(2, 3), r(3)]),
    "baddbmm": (lambda s, a, b: torch.baddbmm(s, a, b, beta=2), [r(2, 2, 4), r(2, 2, 3), r(2, 3, 4)]),
    "addbmm": (torch.addbmm, [r(2, 4), r(5, 2, 3), r(5, 3, 4)]),
    "addr": (lambda s, a, b: torch.addr(s, a, b, beta=2), [r(2, 3), r(2), r(3)]),
    "matmul_1d_2d": (torch.matmul, [r(3), r(3, 4)]),
    "matmul_3d_2d": (torch.matmul, [r(2, 2, 3), r(3, 4)]),
    "matmul_broadcast": (torch.matmul, [r(2, 1, 2, 3), r(4, 3, 2)]),
    "linear": (lambda x, w, b: F.linear(x, w, b), [r(3), r(4, 3), r(4)]),
    "linear_3d": (lambda x, w: F.linear(x, w), [r(2, 5, 3), r(4, 3)]),
    "outer": (torch.outer, [r(2), r(3)]),
    "einsum": (lambda a, b: torch.einsum("ij,jk->ik", a, b), [r(2, 3), r(3, 4)]),
    "einsum_batch": (lambda a, b: torch.einsum("bij,bjk->bik", a, b), [r(2, 2, 3), r(2, 3, 4)]),
    "tensordot": (lambda a, b: torch.tensordot(a, b, dims=([1], [0])), [r(2, 3), r(3, 4)]),
    "inner": (torch.inner, [r(2, 3), r(4, 3)]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_loop(name):
    f, args = CASES[name]
    check_vmap_all_bdims(f, args)


@pytest.mark.parametrize("name", ["mm", "bmm", "mv", "dot", "addmm_bias", "linear", "matmul_broadcast"])
def test_gradients_through_vmap_strict(name):
    f, args = CASES[name]
    batched = [torch.stack([a + 0.1 * i for i in range(3)]).requires_grad_() if k == 0 else
               a.clone().requires_grad_() for k, a in enumerate(args)]
    with ft.config.strict_fallback():
        out = ft.vmap(f, in_dims=(0,) + (None,) * (len(args) - 1))(*batched)
        grads = torch.autograd.grad(out.sum(), batched)
    loop = torch.stack([f(batched[0][i], *batched[1:]) for i in range(3)])
    expected = torch.autograd.grad(loop.sum(), batched)
    assert_same(grads, expected)


def test_per_sample_gradients_of_an_mlp_vs_torch_func():
    params = {"w1": r(8, 5), "b1": r(8), "w2": r(3, 8), "b2": r(3)}
    xs, ys = r(6, 5), r(6, 3)

    def loss(p, x, y):
        h = torch.tanh(F.linear(x, p["w1"], p["b1"]))
        return ((F.linear(h, p["w2"], p["b2"]) - y) ** 2).mean()

    with ft.config.strict_fallback():
        ours = ft.vmap(ft.grad(loss), in_dims=(None, 0, 0))(params, xs, ys)
    ref = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, xs, ys)
    assert_same(ours, ref, rtol=1e-5, atol=1e-6)
