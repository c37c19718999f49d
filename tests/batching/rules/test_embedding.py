"""embedding / embedding_dense_backward / _embedding_bag vs the loop oracle (every in_dims
choice, vmap∘vmap, strict), and per-example gradients of an embedding model vs torch.func."""
import pytest
import torch
import torch.nn.functional as F

import functrans as ft
from tests.support.oracles import bdim_choices, check_vmap, check_vmap_all_bdims

g = torch.Generator().manual_seed(0)
W = torch.randn(10, 4, generator=g)
IDX = torch.tensor([[1, 9, 0], [4, 4, 7]])
BAG = torch.tensor([3, 0, 9, 9, 2, 5])


@pytest.mark.parametrize("f, args", [
    (lambda w, i: F.embedding(i, w), [W, IDX]),
    (lambda w, i: F.embedding(i, w, padding_idx=4), [W, IDX]),
    (lambda w, i: F.embedding(i, w), [W, torch.tensor(3)]),
    (lambda w, i: F.embedding_bag(i, w, torch.tensor([0, 2, 2])), [W, BAG]),
    (lambda w, i: F.embedding_bag(i, w, torch.tensor([0, 1, 6]), mode="max",
                                  include_last_offset=True), [W, BAG]),
    (lambda w, i: F.embedding_bag(i.view(2, 3), w, mode="mean", padding_idx=9), [W, BAG]),
    (lambda w, i, p: F.embedding_bag(i, w, torch.tensor([0, 4]), per_sample_weights=p, mode="sum"),
     [W, BAG, torch.randn(6, generator=g)]),
])
def test_forward_matches_loop(f, args):
    bag = "embedding_bag" in f.__code__.co_names
    if not bag:
        check_vmap_all_bdims(f, args)
        return
    for dims in bdim_choices(len(args)):
        check_vmap(f, args, dims)


def test_embedding_bag_auxiliary_outputs_match_loop():
    op = torch.ops.aten._embedding_bag
    for mode in (0, 1, 2):
        f = lambda w, i: op(w, i, torch.tensor([0, 2, 2, 4]), False, mode, False, None, False, 9)
        for dims in [(None, 0), (-1, None), (0, 0)]:
            check_vmap(f, [W, torch.tensor([3, 9, 9, 0, 1, 9])], dims)


@pytest.mark.parametrize("kwargs", [{}, {"padding_idx": 4}, {"scale_grad_by_freq": True},
                                    {"padding_idx": 0, "scale_grad_by_freq": True}])
@pytest.mark.parametrize("in_dims", [(None, 0), (0, 0), (0, None)])
def test_embedding_per_example_gradients(kwargs, in_dims):
    """vmap(grad) reaches embedding_dense_backward with a batched gradient and batched (or
    shared) indices; grad(vmap) differentiates the physical forward."""
    def loss(w, i):
        return (F.embedding(i, w, **kwargs) ** 2).sum()
    w = W if in_dims[0] is None else W + 0.1 * torch.randn(3, 10, 4, generator=g)
    i = IDX if in_dims[1] is None else torch.randint(0, 10, (3, 2, 3), generator=g)
    # scale_grad_by_freq: the forward declines (the table requires grad), the backward is batched
    with ft.config.strict_fallback(not kwargs.get("scale_grad_by_freq", False)):
        got = ft.vmap(ft.grad(loss), in_dims=in_dims)(w, i)
    want = torch.func.vmap(torch.func.grad(loss), in_dims=in_dims)(w, i)
    torch.testing.assert_close(got, want)
    if not kwargs.get("scale_grad_by_freq") and in_dims[0] is not None:
        outer = lambda w: ft.vmap(loss, in_dims=in_dims)(w, i).sum()
        with ft.config.strict_fallback():
            got = ft.grad(outer)(w)
        # reference: a loop of autograd (torch.func gives the padding row a gradient here)
        wr = w.clone().requires_grad_()
        total = sum(loss(wr[b], i if in_dims[1] is None else i[b]) for b in range(3))
        torch.testing.assert_close(got, torch.autograd.grad(total, wr)[0])


def test_per_sample_gradients_of_an_embedding_model():
    """A bag-of-embeddings classifier: per-example gradients of every parameter."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(20, 8, padding_idx=0)
    head = torch.nn.Linear(8, 3)
    params = {"emb": emb.weight.detach(), "w": head.weight.detach(), "b": head.bias.detach()}
    tokens = torch.randint(0, 20, (5, 7))
    labels = torch.randint(0, 3, (5,))

    def loss(p, toks, y):
        h = F.embedding(toks, p["emb"], padding_idx=0).mean(0)
        return F.cross_entropy(F.linear(h, p["w"], p["b"]), y)

    with ft.config.strict_fallback():
        got = ft.vmap(ft.grad(loss), in_dims=(None, 0, 0))(params, tokens, labels)
    want = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, tokens, labels)
    for k in params:
        torch.testing.assert_close(got[k], want[k])


@pytest.mark.filterwarnings("ignore:There is a performance drop")
@pytest.mark.parametrize("mode, kwargs", [("sum", {}), ("mean", {"padding_idx": 2}),
                                          ("max", {"include_last_offset": True}),
                                          ("sum", {"padding_idx": 2, "include_last_offset": True})])
@pytest.mark.parametrize("in_dims", [(None, 0), (0, None)])
def test_embedding_bag_per_example_gradients(mode, kwargs, in_dims):
    """vmap(grad) of embedding_bag reaches _embedding_bag_backward: batched indices (each
    example's own rows and bags) or a batched table (the batch along the features)."""
    offsets = torch.tensor([0, 2, 5]) if kwargs.get("include_last_offset") else \
        torch.tensor([0, 2, 2])

    def loss(w, i):
        return (F.embedding_bag(i, w, offsets, mode=mode, **kwargs) ** 2).sum()
    w = W if in_dims[0] is None else W + 0.1 * torch.randn(3, 10, 4, generator=g)
    i = torch.tensor([3, 2, 2, 7, 3]) if in_dims[1] is None else \
        torch.stack([torch.tensor([3, 2, 2, 7, 3]), torch.randint(0, 10, (5,), generator=g),
                     torch.tensor([2, 2, 9, 9, 0])])
    with ft.config.strict_fallback():
        got = ft.vmap(ft.grad(loss), in_dims=in_dims)(w, i)
    want = torch.func.vmap(torch.func.grad(loss), in_dims=in_dims)(w, i)
    torch.testing.assert_close(got, want)


@pytest.mark.filterwarnings("ignore:There is a performance drop")
@pytest.mark.parametrize("in_dims", [(0, 0, None), (0, None, 0), (None, 0, 0), (0, None, None)])
def test_embedding_bag_per_sample_weights_gradients(in_dims):
    """vmap(grad) with respect to per_sample_weights reaches
    _embedding_bag_per_sample_weights_backward."""
    offsets = torch.tensor([0, 2, 2])

    def loss(p, i, w):
        return (F.embedding_bag(i, w, offsets, per_sample_weights=p, mode="sum",
                                padding_idx=2) ** 2).sum()
    p = torch.randn(5, generator=g)
    i = torch.tensor([3, 2, 2, 7, 3])
    args = [torch.stack([a + k for k in range(3)]) if d is not None else a
            for a, d in zip([p, i, W], in_dims)]
    with ft.config.strict_fallback():
        got = ft.vmap(ft.grad(loss), in_dims=in_dims)(*args)
    want = torch.func.vmap(torch.func.grad(loss), in_dims=in_dims)(*args)
    torch.testing.assert_close(got, want)
