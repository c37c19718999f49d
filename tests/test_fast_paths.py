"""The eager engine's shortcuts around PyTorch's Python helpers give PyTorch's answers:
functrans._pytree's tree_flatten/tree_unflatten (a tensor and flat tuples/lists of tensors
answered directly, every other tree by PyTorch) and the pointwise rule's broadcast of shapes."""
import collections
import itertools

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


def test_pointwise_broadcast_shapes_is_torchs():
    from functrans.batching.rules.pointwise import _broadcast_shapes
    dims = [0, 1, 2, 3]
    shapes = [torch.Size(s) for r in range(4) for s in itertools.product(dims, repeat=r)]
    for a, b in itertools.product(shapes, repeat=2):
        for group in ([a], [a, b], [a, b, a[1:]]):
            try:
                ref = torch.broadcast_shapes(*group)
            except RuntimeError:
                with pytest.raises(RuntimeError):
                    _broadcast_shapes(group)
                continue
            assert _broadcast_shapes(group) == ref, group
