"""The pointwise rule's fast path for unbatched 0-d tensors (wrapped Python scalars, as in
``x * 0.5``): results and dtypes equal the for-loop oracle's, including the case where eager
promotes differently, 0-d examples beside a 0-d tensor of another dtype."""
import pytest
import torch

from tests.support.oracles import check_vmap_all_bdims

CASES = {
    "float_times_python_float": (lambda x: x * 0.5, [torch.randn(4, 3)]),
    "int_times_python_float": (lambda x: x * 0.5, [torch.arange(12).view(4, 3)]),
    "int_plus_python_int": (lambda x: x + 3, [torch.arange(6)]),
    "0d_float32_example_times_0d_float64": (
        lambda x, s: x * s, [torch.tensor(1.5), torch.tensor(2.0, dtype=torch.float64)]),
    "1d_float32_example_times_0d_float64": (
        lambda x, s: x * s, [torch.randn(3), torch.tensor(2.0, dtype=torch.float64)]),
    "0d_int_example_plus_0d_float": (lambda x, s: x + s, [torch.tensor(3), torch.tensor(0.25)]),
    "where_with_0d_others": (lambda c, x: torch.where(c, x, torch.tensor(0.0)),
                             [torch.tensor([True, False, True]), torch.randn(3)]),
    "inplace_scalar": (lambda x: x.clone().mul_(torch.tensor(2.0, dtype=torch.float64)),
                       [torch.randn(3)]),
}


@pytest.mark.parametrize("name", CASES)
def test_scalar_operands_match_the_loop(name):
    f, args = CASES[name]
    check_vmap_all_bdims(f, args)
