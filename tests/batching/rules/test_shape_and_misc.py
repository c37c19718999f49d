"""Rules for shape ops that copy (diag_embed, rot90, narrow_copy, block_diag), elementwise ops
PyTorch does not tag pointwise (rsub, complex, polar), nonzero_static, and linspace/logspace
with tensor endpoints: loop oracle, every in_dims choice, vmap∘vmap, strict."""
import pytest
import torch

import functrans as ft
from tests.support.oracles import assert_same, check_vmap, check_vmap_all_bdims

g = torch.Generator().manual_seed(0)
A = torch.randn(3, 4, generator=g)


@pytest.mark.parametrize("offset, d1, d2", [(0, -2, -1), (1, 0, 2), (-1, 2, 0)])
def test_diag_embed_diag_diagflat(offset, d1, d2):
    check_vmap_all_bdims(lambda x: torch.diag_embed(x, offset, d1, d2), [A])
    check_vmap_all_bdims(lambda x: torch.diag(x[0], offset), [A])
    check_vmap_all_bdims(lambda x: torch.diagflat(x, offset), [A])


@pytest.mark.parametrize("k, dims", [(1, (0, 1)), (2, (1, 0)), (-1, (0, 2)), (3, (-1, -2))])
def test_rot90(k, dims):
    check_vmap_all_bdims(lambda x: torch.rot90(x, k, dims), [torch.randn(2, 3, 4, generator=g)])


def test_narrow_copy_and_its_errors():
    check_vmap_all_bdims(lambda x: torch.narrow_copy(x, -1, 1, 2), [A])
    with pytest.raises(RuntimeError, match="cannot be applied to a 0-dim tensor"):  # eager's
        ft.vmap(lambda x: torch.narrow_copy(x, 0, 0, 1))(torch.randn(3))


def test_block_diag_mixed_ranks_and_dtypes():
    blocks = [A, torch.randn(2, generator=g), torch.tensor(2.0), torch.arange(4).view(2, 2)]
    check_vmap_all_bdims(lambda *b: torch.block_diag(*b), blocks)


def test_rsub_complex_polar():
    B = torch.rand(3, 4, generator=g) + 0.5
    check_vmap_all_bdims(lambda x, y: torch.rsub(x, y, alpha=2), [A, B])
    check_vmap_all_bdims(lambda x: torch.rsub(x, 3.0), [A])
    check_vmap_all_bdims(torch.complex, [A, B])
    check_vmap_all_bdims(torch.polar, [B, A])


@pytest.mark.parametrize("size", [0, 2, 5, 20])
def test_nonzero_static(size):
    x = torch.tensor([[0.0, 1.5, 0.0, 2.0], [3.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 4.0]])
    check_vmap_all_bdims(lambda t: torch.nonzero_static(t, size=size, fill_value=-7), [x])
    check_vmap(lambda t: torch.nonzero_static(t, size=size), [torch.tensor(1.0)], [0])


@pytest.mark.parametrize("steps", [0, 1, 2, 7, 10])
def test_linspace_logspace_tensor_endpoints(steps):
    s, e = torch.tensor(-1.5), torch.tensor(2.5)
    check_vmap_all_bdims(lambda a, b: torch.linspace(a, b, steps), [s, e])
    check_vmap_all_bdims(lambda a: torch.linspace(a, 4.0, steps), [s])
    check_vmap_all_bdims(lambda a, b: torch.logspace(a, b, steps, base=2.0), [s, e])
    check_vmap_all_bdims(lambda b: torch.logspace(0.5, b, steps, dtype=torch.float64), [e])
    check_vmap_all_bdims(lambda b: torch.linspace(-2.0, b, steps), [e])
    check_vmap_all_bdims(lambda a: torch.logspace(a, 1.0, steps), [s])


def test_linspace_with_tensor_endpoints_is_made_on_the_default_device_as_in_eager():
    # eager reads the endpoints as numbers and makes the result on `device` or the default
    # device, wherever the endpoints live (issue 17: the rule used the endpoints' device)
    s = torch.tensor([-1.0, 0.5, 2.0])
    f = lambda a: torch.linspace(a, 3.0, 5)  # noqa: E731
    with torch.device("meta"):
        got, expected = ft.vmap(f)(s), torch.stack([f(a) for a in s])
    assert got.device == expected.device == torch.device("meta") and got.shape == (3, 5)
    g = lambda a: torch.logspace(a, 1.0, 4, device="meta")  # noqa: E731
    assert ft.vmap(g)(s).device.type == "meta"


def test_integer_linspace_declines_to_the_correct_loop():
    s = torch.tensor([0.0, 1.0, 2.0])
    f = lambda a: torch.linspace(a, 10, 4, dtype=torch.int64)
    with pytest.warns(ft.PerformanceWarning), ft.record_fallbacks() as report:
        got = ft.vmap(f)(s)
    assert_same(got, torch.stack([f(a) for a in s]))
    assert any("linspace" in name for name in report.ops)
