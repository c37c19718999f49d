"""functrans._pytree's tree_flatten/tree_unflatten: their direct answers for a tensor and flat
tuples/lists of tensors are PyTorch's own, and every other tree goes to PyTorch."""
import collections

import pytest
import torch
import torch.utils._pytree as pytree

from functrans._pytree import tree_flatten, tree_unflatten

a, b = torch.randn(2), torch.randn(3)
Pair = collections.namedtuple("Pair", "x y")

TREES = [a, (a,), (a, b), [a, b], [], (), (a, 1.0), (a, None), Pair(a, b), {"w": a},
         ((a, b), b), torch.nn.Parameter(torch.randn(2)), (torch.nn.Parameter(a), b),
         tuple(torch.randn(1) for _ in range(20))]


@pytest.mark.parametrize("tree", TREES, ids=lambda t: type(t).__name__)
def test_flatten_matches_pytorch(tree):
    leaves, spec = tree_flatten(tree)
    ref_leaves, ref_spec = pytree.tree_flatten(tree)
    assert spec == ref_spec
    assert len(leaves) == len(ref_leaves)
    assert all(x is y for x, y in zip(leaves, ref_leaves))
    # either unflatten takes either spec, and rebuilds the same kind of tree
    rebuilt = tree_unflatten(leaves, spec)
    ref = pytree.tree_unflatten(ref_leaves, ref_spec)
    assert type(rebuilt) is type(ref)
    assert pytree.tree_flatten(rebuilt)[1] == ref_spec
    assert type(tree_unflatten(ref_leaves, ref_spec)) is type(ref)
    assert type(pytree.tree_unflatten(leaves, spec)) is type(ref)


def test_unflatten_with_a_wrong_number_of_leaves_is_pytorchs_error():
    _, spec = tree_flatten((a, b))
    with pytest.raises(ValueError):
        tree_unflatten([a], spec)
