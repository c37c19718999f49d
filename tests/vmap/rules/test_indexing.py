"""gather / scatter / scatter_add / index_select vs the loop oracle (every in_dims choice,
vmap∘vmap, strict), integer advanced indexing (batched, correct), boolean masks (clear error)."""
import pytest
import torch

import functrans as ft
from tests.oracles import check_vmap_all_bdims

g = torch.Generator().manual_seed(0)
X = torch.randn(3, 4, generator=g)
IDX = torch.tensor([[0, 2], [1, 1], [3, 0]])


@pytest.mark.parametrize("f, args", [
    (lambda x, i: torch.gather(x, 1, i), [X, IDX]),
    (lambda x, i: torch.gather(x, -1, i), [X, IDX]),
    (lambda x, i: torch.gather(x, 0, i), [X, IDX[:2]]),
    (lambda x, i: torch.gather(x, 0, i), [torch.tensor(2.0), torch.tensor(0)]),
    (lambda x, i, s: torch.scatter(x, 1, i, s), [X, IDX, torch.randn(3, 2, generator=g)]),
    (lambda x, i: torch.scatter(x, 1, i, 7.0), [X, IDX]),
    (lambda x, i, s: torch.scatter_add(x, 1, i, s), [X, IDX, torch.randn(3, 2, generator=g)]),
    (lambda x, i: torch.index_select(x, 1, i), [X, torch.tensor([3, 0, 0])]),
    (lambda x, i: torch.index_select(x, 0, i), [X, torch.tensor([2])]),
    (lambda x, i: torch.index_select(x, 0, i), [torch.tensor(5.0), torch.tensor(0)]),
    (lambda x, i: torch.index_select(x, 0, i), [torch.tensor(5.0), torch.tensor([0])]),
])
def test_matches_loop(f, args):
    check_vmap_all_bdims(f, args)


def test_inplace_scatter_into_batched_self():
    from tests.oracles import check_vmap
    f = lambda x, i, s: x.clone().scatter_(1, i, s)
    for dims in [(0, 0, 0), (0, None, 0), (-1, 0, None), (0, None, None)]:
        check_vmap(f, [X, IDX, torch.randn(3, 2, generator=g)], dims)


def test_integer_advanced_indexing_is_batched_and_bool_masks_raise():
    x, i = torch.randn(4, 5), torch.randint(0, 5, (4, 3))
    torch.testing.assert_close(ft.vmap(lambda a, j: a[j])(x, i),
                               torch.stack([a[j] for a, j in zip(x, i)]))
    with pytest.raises(ft.UnsupportedUnderVmap, match="shape depends on the values"):
        ft.vmap(lambda a: a[a > 0])(x)
