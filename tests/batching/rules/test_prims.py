"""Elementwise prims under vmap (they reach it through Python reference implementations, e.g.
the meta path of a forward-AD formula): loop oracle, every in_dims choice, strict."""
import pytest
import torch

import functrans as ft
from functrans.batching.rules.pointwise import ELEMENTWISE_PRIMS
from tests.support.oracles import assert_same, check_vmap_all_bdims

prims = torch.ops.prims
g = torch.Generator().manual_seed(0)
POS = torch.rand(2, 3, generator=g) + 0.5           # in every float prim's domain
INT = torch.randint(1, 6, (2, 3), generator=g)
INTS = {"bitwise_not", "bitwise_and", "bitwise_or", "bitwise_xor", "gcd", "shift_left",
        "shift_right_arithmetic"}
BINARY = {"add", "atan2", "bitwise_and", "bitwise_or", "bitwise_xor", "div", "eq", "fmax", "fmin",
          "fmod", "gcd", "ge", "gt", "hypot", "igamma", "igammac", "le", "lt", "maximum",
          "minimum", "mul", "ne", "nextafter", "pow", "remainder", "shift_left",
          "shift_right_arithmetic", "sub", "zeta"}


@pytest.mark.parametrize("name", [n for n in ELEMENTWISE_PRIMS
                                  if n not in ("where", "convert_element_type")])
def test_elementwise_prim(name):
    op = getattr(prims, name)
    x = INT if name in INTS else (POS * 0.5 if name in ("acos", "asin", "atanh", "erf_inv",
                                                          "ndtri") else POS)
    if name in BINARY:
        y = (INT.flip(0) % 3 if name.startswith("shift") else INT.flip(0)) if name in INTS \
            else POS.flip(0) + 1
        check_vmap_all_bdims(lambda a, b: op(a, b), [x, y])
    else:
        check_vmap_all_bdims(lambda a: op(a), [x])


def test_where_and_convert_element_type():
    check_vmap_all_bdims(lambda c, a, b: prims.where(c, a, b), [POS > 0.9, POS, POS.flip(1)])
    check_vmap_all_bdims(lambda a: prims.convert_element_type(a, torch.float64), [POS])


def test_vmap_of_jvp_of_solve_runs_by_rules():
    A = torch.randn(3, 4, 4, generator=g) + 4 * torch.eye(4)
    T, B = torch.randn(3, 4, 4, generator=g), torch.randn(4, 2, generator=g)
    f = lambda a, t: ft.jvp(lambda x: torch.linalg.solve(x, B), (a,), (t,))
    with ft.config.strict_fallback():
        got = ft.vmap(f)(A, T)
    ref = torch.func.vmap(lambda a, t: torch.func.jvp(lambda x: torch.linalg.solve(x, B),
                                                      (a,), (t,)))(A, T)
    assert_same(got, ref, rtol=1e-4, atol=1e-5)


def test_zero_dim_operands_and_vmap_of_jvp_of_nanmean():
    check_vmap_all_bdims(lambda a, b: prims.mul(a, b), [POS, torch.tensor(2.0)])
    x = torch.randn(3, 4, dtype=torch.float64, generator=g)
    x[0, 1] = float("nan")
    t = torch.randn(3, 4, dtype=torch.float64, generator=g)
    f = lambda a, b: ft.jvp(torch.nanmean, (a,), (b,))
    with ft.config.strict_fallback():
        got = ft.vmap(f)(x, t)
    assert_same(got, torch.func.vmap(lambda a, b: torch.func.jvp(
        torch.nanmean, (a,), (b,)))(x, t))
