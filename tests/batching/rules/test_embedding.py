"""embedding / embedding_dense_backward / _embedding_bag vs the loop oracle (every in_dims
choice, vmap∘vmap, strict), and per-example gradients of an embedding model vs torch.func."""
import re

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


@pytest.mark.parametrize("op", [torch.ops.aten._embedding_bag,
                                torch.ops.aten._embedding_bag_forward_only])
@pytest.mark.parametrize("offsets, include_last, valid", [
    ([0, 2, 2], False, True), ([0, 6, 6], False, True), ([0, 2, 6], True, True),
    ([1, 2], False, False), ([0, 7], False, False), ([0, 4, 2], False, False),
    ([0, 2, 4], True, False), ([0, 2, 7], True, False)])
def test_embedding_bag_offsets_are_not_read_back(op, offsets, include_last, valid):
    """Batched indices fold the examples' bags into one call with offsets computed on the device
    (never read on the host: a sync the loop does not make).  Whatever the offsets, vmap gives
    the loop's outputs (all four, exactly) or eager's error: offsets eager rejects (first not 0,
    past the end, unsorted) and include_last_offset with offsets[-1] != n (where the CPU kernel
    reads the last offset for the sum but not for mean's bag size or max) make the folded call
    raise, and the rule declines to the loop.  Valid offsets take the folded call (strict)."""
    from tests.support.device_audit import syncs_of
    n = 6
    for mode in (0, 1, 2):
        for pad in (-1, 2):
            def f(w, i):
                return op(w, i, torch.tensor(offsets), False, mode, False, None, include_last,
                          pad)
            for w_dim in (None, 0):
                w = W if w_dim is None else torch.randn(3, 10, 4, generator=g)
                i = torch.randint(0, 10, (3, n), generator=g)
                try:
                    ref = [f(w if w_dim is None else w[b], i[b]) for b in range(3)]
                    expected, error = [torch.stack(t) for t in zip(*ref)], None
                except RuntimeError as e:
                    error = str(e).splitlines()[0]
                vm = ft.vmap(f, in_dims=(w_dim, 0))
                if error is not None:
                    with pytest.raises(RuntimeError, match=re.escape(error)):
                        vm(w, i)
                    continue
                with ft.config.strict_fallback(valid):
                    assert syncs_of(lambda: vm(w, i)) == {}
                    actual = vm(w, i)
                for a, e in zip(actual, expected):
                    assert a.shape == e.shape and a.dtype == e.dtype and torch.equal(a, e), \
                        (mode, pad, w_dim)


@pytest.mark.parametrize("offsets", [[0, 2, 2, 6], [0, 6, 6], [0, 2, 0, 3, 6]])
def test_embedding_bag_backward_rebuilds_offset2bag_as_eager(offsets):
    """A forward that skipped offset2bag (CPU, mode sum) leaves the backward to rebuild it from
    the offsets: the rule does it on the device as eager's backward does (``make_offset2bag``),
    for unsorted offsets too (the forward accepts some unchecked; reading them on the host to
    check would be a sync)."""
    op = torch.ops.aten._embedding_bag_backward
    nb = len(offsets)
    empty, zeros = torch.empty(0, dtype=torch.long), torch.zeros(nb, dtype=torch.long)

    def f(grad, i):  # offset2bag, bag_size and max_indices as the CPU forward gives them
        return op(grad, i, torch.tensor(offsets), empty, zeros, zeros, 10, False, 0, False,
                  None, -1)
    for dims in [(0, 0), (None, 0)]:
        check_vmap(f, [torch.randn(nb, 4, generator=g), torch.tensor([3, 9, 0, 2, 2, 7])], dims)


@pytest.mark.parametrize("op", [torch.ops.aten._embedding_bag,
                                torch.ops.aten._embedding_bag_forward_only])
@pytest.mark.parametrize("include_last", [False, True])
def test_embedding_bag_folded_call_under_fake_tensors(op, include_last):
    """The folded call reads no offsets, so it runs on fake tensors (torch.compile tracing, the
    fake-GPU device audit) too, whose meta kernels shape the outputs a mode does not use as
    CUDA does (max_indices empty, bag_size one per offset): each output has the loop's shape."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from tests.support.oracles import loop_oracle
    meta = lambda outs: [(tuple(t.shape), t.dtype) for t in outs]  # noqa: E731
    for mode in (0, 1, 2):
        for w_dim in (None, 0):
            with FakeTensorMode(allow_non_fake_inputs=True):
                w = torch.randn(10, 4) if w_dim is None else torch.randn(3, 10, 4)
                i = torch.randint(0, 10, (3, 6))
                offsets = torch.tensor([0, 2, 6] if include_last else [0, 2, 2])

                def f(w, i):
                    return op(w, i, offsets, False, mode, False, None, include_last, 2)
                expected = loop_oracle(f, (w_dim, 0), 3, w, i)
                with ft.config.strict_fallback():
                    actual = ft.vmap(f, in_dims=(w_dim, 0))(w, i)
            assert meta(actual) == meta(expected), (mode, w_dim)
