"""Batching rules of functrans/batching/rules/views.py against the for-loop oracle.

Every case runs over every in_dims choice and nested (``check_vmap_all_bdims``, strict: no
fallback).  Float cases are also checked under autograd, through vmap (``grad(vmap(f))``) and
inside it (``vmap(grad(f))``, which batches the backward ops: select_backward, slice_backward,
...).  Views are checked to alias their input (in-place writes through them reach the caller's
tensor), and the CompositeImplicitAutograd ops users call (reshape, flatten, movedim, chunk...)
are checked to run through these rules.
"""
import pytest
import torch

import functrans
from functrans.batching.op_schema import decomposes_above_dispatch
from functrans.batching.registry import find_rule
from functrans.errors import UnsupportedUnderVmap
from tests.support.oracles import (assert_same, check_vmap, check_vmap_all_bdims, loop_oracle,
                                    make_batch)

aten = torch.ops.aten

# (id, per-example function, example shape)
CASES = [
    # view / _unsafe_view / reshape family
    ("view", lambda t: t.view(-1), (2, 3)),
    ("view_split_dim", lambda t: t.view(2, 1, 3), (6,)),
    ("view_0d_to_1", lambda t: t.view(1), ()),
    ("view_1_to_0d", lambda t: t.view(()), (1,)),
    ("view_dtype_same_size", lambda t: t.view(torch.int32), (2, 3)),
    ("reshape", lambda t: t.reshape(3, -1), (2, 3)),
    ("reshape_after_transpose", lambda t: t.t().reshape(-1), (2, 3)),
    ("reshape_0d", lambda t: t.reshape(1), ()),
    ("reshape_to_0d", lambda t: t.reshape(()), (1, 1)),
    ("flatten", lambda t: t.flatten(), (2, 1, 3)),
    ("flatten_range", lambda t: t.flatten(-2, -1), (2, 1, 3)),
    ("flatten_0d", lambda t: t.flatten(), ()),
    ("unflatten", lambda t: t.unflatten(-1, (3, 1)), (2, 3)),
    ("contiguous", lambda t: t.t().contiguous(), (2, 3)),
    ("view_as", lambda t: t.view_as(torch.empty(3, 2)), (2, 3)),
    # permute / transpose / t / movedim / swapaxes
    ("permute", lambda t: t.permute(2, 0, 1), (2, 1, 3)),
    ("permute_neg", lambda t: t.permute(-1, -3, -2), (2, 1, 3)),
    ("permute_0d", lambda t: t.permute(()), ()),
    ("transpose", lambda t: t.transpose(0, -1), (2, 1, 3)),
    ("transpose_0d", lambda t: t.transpose(0, -1), ()),
    ("t", lambda t: t.t(), (2, 3)),
    ("t_1d", lambda t: t.t(), (3,)),
    ("t_0d", lambda t: t.t(), ()),
    ("mT", lambda t: t.mT, (2, 1, 3)),
    ("movedim", lambda t: t.movedim(0, -1), (2, 1, 3)),
    ("movedim_list", lambda t: torch.movedim(t, (0, 1), (-1, 0)), (2, 1, 3)),
    ("swapaxes", lambda t: t.swapaxes(-1, 0), (2, 3)),
    # expand
    ("expand", lambda t: t.expand(4, 2, 3), (2, 3)),
    ("expand_minus1", lambda t: t.expand(2, -1, 3), (1, 3)),
    ("expand_size1", lambda t: t.expand(2, 4, 3), (1, 3)),
    ("expand_0d", lambda t: t.expand(2, 3), ()),
    ("expand_as", lambda t: t.expand_as(torch.empty(5, 2, 3)), (2, 1)),
    # unsqueeze / squeeze
    ("unsqueeze0", lambda t: t.unsqueeze(0), (2, 3)),
    ("unsqueeze_mid", lambda t: t.unsqueeze(1), (2, 3)),
    ("unsqueeze_end", lambda t: t.unsqueeze(-1), (2, 3)),
    ("unsqueeze_neg", lambda t: t.unsqueeze(-3), (2, 3)),
    ("unsqueeze_0d", lambda t: t.unsqueeze(0), ()),
    ("unsqueeze_0d_neg", lambda t: t.unsqueeze(-1), ()),
    ("squeeze", lambda t: t.squeeze(), (1, 2, 1, 3)),
    ("squeeze_all_ones", lambda t: t.squeeze(), (1, 1)),
    ("squeeze_dim", lambda t: t.squeeze(-2), (2, 1, 3)),
    ("squeeze_dim_not1", lambda t: t.squeeze(0), (2, 1, 3)),
    ("squeeze_dims", lambda t: t.squeeze((0, -1)), (1, 2, 1)),
    ("squeeze_0d", lambda t: t.squeeze(), ()),
    ("squeeze_0d_dim", lambda t: t.squeeze(-1), ()),
    ("squeeze_unsqueeze_chain", lambda t: t.unsqueeze(0).squeeze(1).unsqueeze(-1).squeeze(0),
     (1, 3)),
    # select / slice / narrow / indexing with ints and slices
    ("select", lambda t: t.select(1, 2), (2, 3)),
    ("select_neg", lambda t: t.select(-2, -1), (2, 3, 1)),
    ("index_int", lambda t: t[1], (2, 3)),
    ("slice", lambda t: t[:, 1:], (2, 3)),
    ("slice_step", lambda t: t[::2, -2:], (5, 3)),
    ("slice_empty", lambda t: t[3:], (2, 3)),
    ("narrow", lambda t: t.narrow(-1, 1, 2), (2, 3)),
    ("index_none_ellipsis", lambda t: t[None, ..., 0], (2, 3)),
    # unbind / split / chunk
    ("unbind", lambda t: t.unbind(), (2, 3)),
    ("unbind_neg", lambda t: t.unbind(-1), (2, 3)),
    ("split", lambda t: t.split(2), (5, 3)),
    ("split_dim", lambda t: t.split(2, -1), (2, 3)),
    ("split_list", lambda t: t.split([1, 3, 1]), (5, 2)),
    ("split_with_sizes", lambda t: torch.split_with_sizes(t, [2, 1], -1), (2, 3)),
    ("unsafe_split", lambda t: torch.unsafe_split(t, 2, 1), (2, 3)),
    ("unsafe_split_with_sizes", lambda t: torch.unsafe_split_with_sizes(t, [1, 1], 0), (2, 3)),
    ("chunk", lambda t: t.chunk(2, -1), (2, 3)),
    ("tensor_split", lambda t: t.tensor_split([1, 2], 0), (4, 3)),
    # diagonal / unfold
    ("diagonal", lambda t: t.diagonal(), (3, 3)),
    ("diagonal_offset", lambda t: t.diagonal(1, -1, 0), (2, 3, 4)),
    ("diagonal_neg_offset", lambda t: t.diagonal(-1, 0, 2), (2, 3, 4)),
    ("diag_embed_free", lambda t: torch.diagonal(t, 0, -2, -1), (2, 3, 3)),
    ("unfold", lambda t: t.unfold(-1, 2, 1), (2, 5)),
    ("unfold_step", lambda t: t.unfold(0, 2, 2), (5, 3)),
    ("unfold_0d", lambda t: t.unfold(0, 1, 1), ()),
    ("unfold_0d_empty", lambda t: t.unfold(0, 0, 1), ()),
    # copying shape ops
    ("repeat", lambda t: t.repeat(2, 1, 3), (2, 3)),
    ("repeat_same_rank", lambda t: t.repeat(1, 2), (2, 3)),
    ("repeat_0d", lambda t: t.repeat(2), ()),
    ("repeat_0d_empty", lambda t: t.repeat(()), ()),
    ("flip", lambda t: t.flip(-1), (2, 3)),
    ("flip_dims", lambda t: t.flip(0, 2), (2, 1, 3)),
    ("flip_0d", lambda t: t.flip(0), ()),
    ("fliplr", lambda t: t.fliplr(), (2, 3)),
    ("roll", lambda t: t.roll(1, -1), (2, 3)),
    ("roll_dims", lambda t: t.roll((1, -2), (0, 1)), (2, 3)),
    ("roll_flat", lambda t: t.roll(2), (2, 3)),
    ("roll_flat_0d", lambda t: t.roll(1), ()),
    ("tril", lambda t: t.tril(), (3, 4)),
    ("tril_batched_example", lambda t: t.tril(1), (2, 3, 4)),
    ("triu", lambda t: t.triu(-1), (3, 4)),
    ("triu_batched_example", lambda t: t.triu(), (2, 3, 3)),
    ("tril_", lambda t: t.clone().tril_(), (3, 4)),
    ("triu_", lambda t: t.clone().triu_(1), (2, 3, 4)),
    # cat / stack of one batched argument
    ("cat", lambda t: torch.cat([t, t.sin()], -1), (2, 3)),
    ("cat_dim0", lambda t: torch.cat([t, t[:1]]), (2, 3)),
    ("stack", lambda t: torch.stack([t, t.sin()], -1), (2, 3)),
    ("stack_0d", lambda t: torch.stack([t, t]), ()),
    ("hstack", lambda t: torch.hstack([t, t]), (2, 3)),
    ("vstack_1d", lambda t: torch.vstack([t, t]), (3,)),
    ("atleast_2d", lambda t: torch.atleast_2d(t), ()),
]

NONDIFF = {"view_dtype_same_size"}


def _flat_sum_sq(out):
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return torch.stack([(o.double() ** 2).sum() for o in outs]).sum()


def _ids(cases):
    return [c[0] for c in cases]


@pytest.mark.parametrize("name,f,shape", CASES, ids=_ids(CASES))
def test_view_ops(name, f, shape):
    check_vmap_all_bdims(f, [torch.randn(shape)])


@pytest.mark.parametrize("name,f,shape", [c for c in CASES if c[0] not in NONDIFF],
                         ids=_ids([c for c in CASES if c[0] not in NONDIFF]))
def test_view_ops_autograd(name, f, shape):
    for bdim in (0, -1):
        x = make_batch(torch.randn(shape, dtype=torch.float64), bdim, 3)
        # inside vmap: the backward ops are batched by the rules
        with functrans.config.strict_fallback(True):
            actual = functrans.vmap(functrans.grad(lambda t: _flat_sum_sq(f(t))),
                                    in_dims=bdim)(x)
        expected = loop_oracle(
            lambda t: torch.autograd.grad(_flat_sum_sq(f(t)), t)[0], [bdim], 3,
            x.detach().requires_grad_())
        assert_same(actual, expected, msg=f"vmap(grad) {name} bdim={bdim}")
        # through vmap: autograd records the physical ops
        xr = x.detach().requires_grad_()
        with functrans.config.strict_fallback(True):
            out = functrans.vmap(f, in_dims=bdim)(xr)
        g, = torch.autograd.grad(_flat_sum_sq(out), xr)
        xl = x.detach().requires_grad_()
        gl, = torch.autograd.grad(_flat_sum_sq(loop_oracle(f, [bdim], 3, xl)), xl)
        assert_same(g, gl, msg=f"grad(vmap) {name} bdim={bdim}")


@pytest.mark.parametrize("name,f,shape", [c for c in CASES if c[0] not in NONDIFF],
                         ids=_ids([c for c in CASES if c[0] not in NONDIFF]))
def test_view_ops_forward_ad(name, f, shape):
    x = make_batch(torch.randn(shape, dtype=torch.float64), 0, 3)
    v = make_batch(torch.randn(shape, dtype=torch.float64) + 1, 0, 3)
    with functrans.config.strict_fallback(True):
        got = functrans.vmap(lambda p, t: functrans.jvp(f, (p,), (t,)))(x, v)
    assert_same(got, loop_oracle(lambda p, t: torch.func.jvp(f, (p,), (t,)), [0, 0], 3, x, v))


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool])
@pytest.mark.parametrize("name,f,shape", [c for c in CASES if "dtype" not in c[0] and
                                          "cat" not in c[0] and "stack" not in c[0]],
                         ids=_ids([c for c in CASES if "dtype" not in c[0] and
                                   "cat" not in c[0] and "stack" not in c[0]]))
def test_view_ops_integer_and_bool(name, f, shape, dtype):
    x = torch.randint(0, 5, shape).to(dtype)
    check_vmap(f, [x], [0])
    check_vmap(f, [x], [-1])


# --- several tensors: cat / stack of batched and unbatched -------------------------------------

MULTI = [
    ("cat", lambda a, b: torch.cat([a, b], 0), [(2, 3), (1, 3)]),
    ("cat_neg", lambda a, b: torch.cat([a, b, a], -1), [(2, 3), (2, 1)]),
    ("cat_legacy_empty", lambda a, b: torch.cat([a, b], 1), [(2, 3), (0,)]),
    ("cat_legacy_empty_first", lambda a, b: torch.cat([b, a]), [(2, 3), (0,)]),
    ("stack", lambda a, b: torch.stack([a, b]), [(2, 3), (2, 3)]),
    ("stack_neg", lambda a, b: torch.stack([a, b, a], -1), [(2, 3), (2, 3)]),
    ("stack_0d", lambda a, b: torch.stack([a, b], -1), [(), ()]),
    ("expand_as_other", lambda a, b: a.expand_as(b), [(1, 3), (2, 3)]),
    ("view_as_other", lambda a, b: a.view_as(b), [(2, 3), (3, 2)]),
    ("reshape_as_other", lambda a, b: a.t().reshape_as(b), [(2, 3), (6,)]),
]


@pytest.mark.parametrize("name,f,shapes", MULTI, ids=_ids(MULTI))
def test_multi_tensor(name, f, shapes):
    check_vmap_all_bdims(f, [torch.randn(s) for s in shapes])


def test_cat_promotes_types_across_batched_and_unbatched():
    a, b = torch.randn(3, 2, 2), torch.randn(2, 1, dtype=torch.float64)
    check_vmap(lambda x, y: torch.cat([x, y], -1), [a[0], b], [0, None])
    ints = torch.randint(0, 4, (2, 3))
    check_vmap(lambda x, y: torch.cat([x, y]), [ints, torch.randn(1, 3)], [0, None])
    # a skipped legacy-empty tensor still takes part in promotion
    check_vmap(lambda x, y: torch.cat([x, y]), [torch.randn(2, 3),
                                                 torch.empty(0, dtype=torch.float64)], [0, None])


def test_cat_and_stack_autograd_with_mixed_inputs():
    a = make_batch(torch.randn(2, 3, dtype=torch.float64), 0, 3).requires_grad_()
    w = torch.randn(1, 3, dtype=torch.float64, requires_grad=True)
    f = lambda x, y: torch.cat([x, y, torch.stack([x[0], y[0]])], 0)
    with functrans.config.strict_fallback(True):
        out = functrans.vmap(f, in_dims=(0, None))(a, w)
    got = torch.autograd.grad(_flat_sum_sq(out), (a, w))
    want = torch.autograd.grad(_flat_sum_sq(loop_oracle(f, [0, None], 3, a, w)), (a, w))
    assert_same(got, want)


# --- functions applied to a batch directly: rules against torch's own vmap --------------------

def test_matches_torch_vmap_on_same_inputs():
    x = make_batch(torch.randn(2, 3, 4), 1, 5)
    fs = [lambda t: t.permute(2, 0, 1).reshape(4, -1)[1:, ::2],
          lambda t: t.unsqueeze(1).expand(2, 5, 3, 4).flatten(1, 2).diagonal(0, 0, 1),
          lambda t: torch.cat(t.split([1, 2], 1)[::-1], 1).flip(0).roll(1, 1).tril(),
          lambda t: torch.stack(t.unbind(-1), 0).movedim(0, -1).squeeze().mT.repeat(1, 2, 1)]
    for f in fs:
        with functrans.config.strict_fallback(True):
            got = functrans.vmap(f, in_dims=1)(x)
        assert_same(got, torch.vmap(f, in_dims=1)(x))


def test_batch_size_one_and_non_contiguous_physical_inputs():
    f = lambda t: t.transpose(0, 1).reshape(-1).view(3, 3).select(0, 1)[::2].unsqueeze(0)
    check_vmap(f, [torch.randn(3, 3)], [0], size=1)
    x = torch.randn(3, 6, 3)[:, ::2, :]  # physical (3, 3, 3), not contiguous
    with functrans.config.strict_fallback(True):
        for bdim in (0, 1, 2):
            assert_same(functrans.vmap(f, in_dims=bdim)(x), loop_oracle(f, [bdim], 3, x))


# --- aliasing: in-place writes through views reach the input ----------------------------------

ALIASING = [
    ("view", lambda t: t.view(-1)),
    ("reshape_contiguous", lambda t: t.reshape(-1)),
    ("flatten", lambda t: t.flatten()),
    ("permute", lambda t: t.permute(1, 0)),
    ("transpose", lambda t: t.transpose(0, 1)),
    ("t", lambda t: t.t()),
    ("unsqueeze", lambda t: t.unsqueeze(1)),
    ("squeeze", lambda t: t.unsqueeze(0).squeeze(0)),
    ("select", lambda t: t.select(1, 0)),
    ("slice", lambda t: t[:, 1:]),
    ("narrow", lambda t: t.narrow(0, 1, 1)),
    ("unbind", lambda t: t.unbind(1)[1]),
    ("split", lambda t: t.split(1, 0)[0]),
    ("split_with_sizes", lambda t: t.split([1, 2], -1)[1]),
    ("chunk", lambda t: t.chunk(3, -1)[2]),
    ("diagonal", lambda t: t.diagonal()),
    ("unfold", lambda t: t.unfold(1, 2, 1)),
    ("movedim", lambda t: t.movedim(0, 1)),
]


# A bdim in the middle of the physical layout cannot stay a view through flattening views: see
# Note [view after moving the bdim] (torch's own vmap raises there).
FLATTENING = {"view", "reshape_contiguous", "flatten"}


@pytest.mark.parametrize("name,view,bdim", [
    pytest.param(name, view, bdim, id=f"{name}-{bdim}") for name, view in ALIASING
    for bdim in (0, 1, -1) if not (bdim == 1 and name in FLATTENING)])
def test_inplace_write_through_view(name, view, bdim):
    def f(t):
        t = t.clone()
        view(t).add_(1)
        return t

    x = make_batch(torch.randn(2, 3), bdim, 4)
    with functrans.config.strict_fallback(True):
        got = functrans.vmap(f, in_dims=bdim)(x)
    assert_same(got, loop_oracle(f, [bdim], 4, x))
    # and a write through a view of the caller's own tensor reaches it
    y = x.clone()
    z = x.clone()
    with functrans.config.strict_fallback(True):
        functrans.vmap(lambda t: view(t).mul_(2), in_dims=bdim)(y)
    for i in range(4):
        view(z.select(bdim, i)).mul_(2)
    assert_same(y, z)


def test_view_physically_impossible_after_moving_bdim_reshapes():
    # See Note [view after moving the bdim]: with bdim 1 of a contiguous (2, 3, 4), no strided
    # view flattens an example; the rule reshapes and the values are right.
    x = torch.randn(2, 3, 4)
    with functrans.config.strict_fallback(True):
        got = functrans.vmap(lambda t: (t * 2).view(-1), in_dims=1)(x)
    assert_same(got, loop_oracle(lambda t: (t * 2).reshape(-1), [1], 3, x))
    # ... while a physical view stays a view, whichever dim the batch is in
    x = torch.randn(3, 4, 1)
    with functrans.config.strict_fallback(True):
        out = functrans.vmap(lambda t: t.view(3), in_dims=1)(x)
    assert_same(out, x[:, :, 0].t())
    assert out._base is x or out._base is x._base
    # a wrong number of elements raises eager's error
    with pytest.raises(RuntimeError, match=r"shape '\[4\]' is invalid for input of size 2"):
        functrans.vmap(lambda t: t.view(4), in_dims=1)(torch.randn(2, 3, 1))


def test_inplace_tril_triu_write_into_input():
    for op, bdim in ((torch.Tensor.tril_, 0), (torch.Tensor.triu_, -1), (torch.Tensor.tril_, 1)):
        x = make_batch(torch.randn(3, 3), bdim, 4)
        y = x.clone()
        with functrans.config.strict_fallback(True):
            functrans.vmap(lambda t: op(t, 1), in_dims=bdim)(y)
        want = loop_oracle(lambda t: op(t.clone(), 1), [bdim], 4, x, out_dim=bdim % 3)
        assert_same(y, want, msg=str(op))


def test_view_as_real_and_complex():
    c = torch.randn(2, 3, dtype=torch.complex64)
    check_vmap_all_bdims(torch.view_as_real, [c])
    # per example the last dim must have stride 1 (else eager refuses): the batch goes first
    check_vmap(torch.view_as_complex, [torch.randn(3, 2)], [0])
    check_vmap(lambda t: functrans.vmap(torch.view_as_complex)(t), [torch.randn(2, 3, 2)], [0])
    check_vmap_all_bdims(lambda t: torch.view_as_complex(torch.view_as_real(t)).conj_physical(), [c])
    # aliasing: a write through view_as_real reaches the complex input
    x = make_batch(c, 0, 3)
    with functrans.config.strict_fallback(True):
        functrans.vmap(lambda t: torch.view_as_real(t)[..., 0].zero_())(x)
    assert (x.real == 0).all()


def test_view_dtype_changing_element_size():
    f = lambda t: t.view(torch.int16)
    check_vmap(f, [torch.randn(2, 3)], [0])
    check_vmap(f, [torch.randn(2, 3)], [1])
    check_vmap(lambda t: t.view(torch.float64), [torch.randn(2, 4)], [0])
    # each example of a batch at the last dim has a last stride of 3: eager refuses too
    with pytest.raises(RuntimeError, match="must be 1"):
        functrans.vmap(f, in_dims=-1)(torch.randn(2, 3, 3))


def test_reshape_alias_direct():
    f = lambda t: aten._reshape_alias.default(t, [6], [1])
    check_vmap(f, [torch.randn(2, 3)], [0])
    # an example that is not contiguous: _reshape_alias is an as_strided, refused like it
    with pytest.raises(functrans.errors.UnsupportedUnderVmap, match="storage offsets"):
        functrans.vmap(f, in_dims=-1)(torch.randn(2, 3, 4))


# --- backward ops issued by autograd, called directly -----------------------------------------

BACKWARD = [
    ("select_backward", lambda g: aten.select_backward(g, [2, 3, 4], -2, 1), (2, 4)),
    ("slice_backward", lambda g: aten.slice_backward(g, [2, 5], -1, 1, 5, 2), (2, 2)),
    ("diagonal_backward", lambda g: aten.diagonal_backward(g, [2, 3, 4], 1, -1, 0), (3, 1)),
    ("unfold_backward", lambda g: aten.unfold_backward(g, [2, 5], 1, 2, 1), (2, 4, 2)),
]


@pytest.mark.parametrize("name,f,shape", BACKWARD, ids=_ids(BACKWARD))
def test_backward_ops(name, f, shape):
    check_vmap_all_bdims(f, [torch.randn(shape)])


def test_second_order_through_views():
    f = lambda t: (t.t().reshape(-1)[1:].unsqueeze(0).expand(2, -1) ** 3).sum()
    x = make_batch(torch.randn(2, 3, dtype=torch.float64), 0, 3)
    with functrans.config.strict_fallback(True):
        got = functrans.vmap(functrans.jacrev(functrans.grad(f)))(x)
    assert_same(got, torch.func.vmap(torch.func.hessian(f))(x))


# --- errors per example, as eager raises them -------------------------------------------------

ERRORS = [
    ("select_0d", lambda t: t.select(0, 0), (), IndexError, "0-dim"),
    ("slice_0d", lambda t: aten.slice.Tensor(t, 0, 0, 1), (), IndexError, "0-dim"),
    ("unbind_0d", lambda t: t.unbind(0), (), IndexError, "no dimensions"),
    ("split_0d", lambda t: t.split(1), (), RuntimeError, "1-dimensional"),
    ("roll_0d", lambda t: t.roll(1, 0), (), IndexError, "no dimensions"),
    ("diagonal_1d", lambda t: t.diagonal(), (3,), IndexError, "out of range"),
    ("tril_1d", lambda t: t.tril(), (3,), RuntimeError, "at least 2 dimensions"),
    ("cat_0d", lambda t: torch.cat([t, t]), (), RuntimeError, "zero-dimensional"),
    ("t_3d", lambda t: t.t(), (2, 2, 2), RuntimeError, "<= 2 dimensions"),
    ("unfold_0d_too_big", lambda t: t.unfold(0, 2, 1), (), RuntimeError, "maximum size"),
    ("squeeze_bad_dim", lambda t: t.squeeze(2), (2, 1), IndexError, "out of range"),
    ("unsqueeze_bad_dim", lambda t: t.unsqueeze(3), (2, 1), IndexError, "out of range"),
    ("transpose_0d_bad", lambda t: t.transpose(0, 1), (), IndexError, "out of range"),
    ("expand_leading_minus1", lambda t: t.expand(-1, 3), (3,), RuntimeError, "leading"),
    ("repeat_too_few", lambda t: t.repeat(2), (2, 3), RuntimeError, "repeat dims"),
    ("view_bad_numel", lambda t: t.view(4), (2, 3), RuntimeError, "invalid for input"),
    ("view_dtype_0d", lambda t: t.view(torch.int16), (), RuntimeError, "cannot be 0"),
    ("permute_0d_bad", lambda t: t.permute(0), (), RuntimeError, "number of dimensions"),
]


@pytest.mark.parametrize("name,f,shape,exc,match", ERRORS, ids=_ids(ERRORS))
def test_errors_match_eager(name, f, shape, exc, match):
    with pytest.raises(exc, match=match):
        f(torch.randn(shape))
    for bdim in (0, -1):
        with pytest.raises(exc, match=match), functrans.config.strict_fallback(True):
            functrans.vmap(f, in_dims=bdim)(make_batch(torch.randn(shape), bdim, 3))


# --- which ops these rules own -----------------------------------------------------------------

OWNED = [aten.view.default, aten.view.dtype, aten._unsafe_view.default,
         aten._reshape_alias.default, aten.permute.default, aten.transpose.int, aten.t.default,
         aten.expand.default, aten.unsqueeze.default, aten.squeeze.default, aten.squeeze.dim,
         aten.squeeze.dims, aten.select.int, aten.slice.Tensor, aten.unbind.int,
         aten.split.Tensor, aten.split_with_sizes.default, aten.unsafe_split.Tensor,
         aten.unsafe_split_with_sizes.default, aten.cat.default, aten.stack.default,
         aten.diagonal.default, aten.unfold.default, aten.repeat.default, aten.flip.default,
         aten.roll.default, aten.tril.default, aten.triu.default, aten.tril_.default,
         aten.triu_.default, aten.view_as_real.default, aten.view_as_complex.default,
         aten.select_backward.default, aten.slice_backward.default,
         aten.diagonal_backward.default, aten.unfold_backward.default]


@pytest.mark.parametrize("op", OWNED, ids=str)
def test_owned_ops_have_a_views_rule(op):
    assert not decomposes_above_dispatch(op)
    how, rule = find_rule(op)
    assert how == "rule" and rule.__module__ == "functrans.batching.rules.views"


def test_errors_under_nested_vmap():
    x = torch.randn(2, 3)
    for f, exc in ((lambda t: t.select(0, 0), IndexError), (lambda t: t.unbind(0), IndexError),
                   (lambda t: t.view(2), RuntimeError)):
        with pytest.raises(exc), functrans.config.strict_fallback(True):
            functrans.vmap(functrans.vmap(f), in_dims=1)(x)


INPLACE_VIEWS = [
    ("unsqueeze_", lambda t: t.unsqueeze_(-1), (2, 3)),
    ("squeeze_", lambda t: t.squeeze_(), (2, 1, 3)),
    ("squeeze_dim", lambda t: t.squeeze_(1), (2, 1, 3)),
    ("transpose_", lambda t: t.transpose_(0, -1), (2, 3)),
    ("t_", lambda t: t.t_(), (2, 3)),
]


@pytest.mark.parametrize("name,f,shape", INPLACE_VIEWS, ids=_ids(INPLACE_VIEWS))
def test_inplace_view_ops(name, f, shape):
    # the dispatcher runs these as the out-of-place rule and rebinds the wrapper
    def g(t):
        t = t.clone()
        f(t)
        return t
    check_vmap(g, [torch.randn(shape)], [0])
    check_vmap(g, [torch.randn(shape)], [-1])


# ---- as_strided: PyTorch's TestVmapOperators.test_as_strided -------------------------------

def _as_strided_layouts(B0=5):
    """The 9 input layouts of PyTorch's test: storage offsets, strided and moved batch dims."""
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return [r(B0, 2, 3), r(B0, 3, 2).transpose(1, 2), r(3, 2, B0).movedim(-1, 0).transpose(1, 2),
            r(2, B0, 2, 3)[1], r(2, 2, B0, 3)[1].movedim(1, 0), r(B0, 2, 4, 3, 7)[:, :, 0, :, 0],
            r(2, 4, B0, 3, 7).movedim(2, 0)[:, :, 0, :, 0], r(B0, 2, 4, 3, 7)[:, :, 2, :, 1],
            r(2, 4, 3, 7, B0).movedim(-1, 0)[:, :, 2, :, 1]]


@pytest.mark.parametrize("layout", range(9))
def test_as_strided_of_pytorchs_test_matches_torch_func_and_the_loop(layout):
    """expand / transpose / select / diagonal / slice written as as_strided, bdim 0 and -1: 10
    cases per layout, 90 in all (functrans refused 60 of them): each gives torch.func's view,
    which is the loop over each example's own view at the offset relative to example 0."""
    x = _as_strided_layouts()[layout]
    S0, S1 = x.stride()[1:]
    off = x.storage_offset()
    cases = [([5, 5, 2, 3], [0, 0, S0, S1], off, lambda t: t.expand(5, 5, 2, 3)),
             ([3, 2], [S1, S0], off, lambda t: t.transpose(0, 1)),
             ([2], [S0], off + S1, lambda t: t[:, 1]),
             ([2], [S0 + S1], off, lambda t: t.diagonal()),
             ([2], [S1 * 2], off, lambda t: t[0, ::2])]
    for size, stride, offset, view in cases:
        f = lambda t: t.as_strided(size, stride, offset)  # noqa: E731
        for bdim, xs in ((0, x), (-1, x.movedim(0, -1))):
            with functrans.config.strict_fallback():
                got = functrans.vmap(f, in_dims=bdim)(xs)
            assert got.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()  # a view
            assert_same(got, torch.func.vmap(f, in_dims=bdim)(xs))
            assert_same(got, torch.func.vmap(view, in_dims=bdim)(xs))
            assert_same(got, torch.stack([e.as_strided(size, stride, offset + e.storage_offset()
                                                       - x.storage_offset())
                                          for e in xs.movedim(bdim, 0)]))


def test_as_strided_nested_and_refusals_of_pytorchs_test():
    B0, B1 = 5, 7
    x = torch.randn(B1, B0, 2, 3)
    S0, S1 = x.stride()[2:]
    f = lambda t: t.as_strided([5, 5, 2, 3], [0, 0, S0, S1])  # noqa: E731
    with functrans.config.strict_fallback():
        got = functrans.vmap(functrans.vmap(f), in_dims=1)(x)
    assert_same(got, torch.func.vmap(torch.func.vmap(f), in_dims=1)(x))
    assert_same(got, x.movedim(1, 0)[:, :, None, None].expand(B0, B1, 5, 5, 2, 3))
    with pytest.raises(RuntimeError, match="size and stride must have the same length"):
        functrans.vmap(lambda t: t.as_strided([1, 1, 1], [1, 1]))(
            torch.randn(B0, 2, 3).transpose(0, 1))
    # windows outside each example's memory: refused, as torch.func refuses them
    outside = [(lambda t: t.as_strided([3], [1], 1), torch.randn(B0, 3), r"\[1, 3\].*\[0, 2\]"),
               (lambda t: t.as_strided([4, 4], [4, 1], 0), torch.randn(B0, 3, 5),
                r"\[0, 15\].*\[0, 14\]"),
               (lambda t: t.as_strided([3], [1], B0 * 3 - 1), torch.randn(2, B0, 3)[1],
                r"\[14, 16\].*\[15, 17\]"),
               (lambda t: t.as_strided([3], [1]), torch.randn(B0, 0, 3),
                r"\[0, 2\], but each example of x has no elements")]
    for g, xs, where in outside:
        with pytest.raises(RuntimeError, match="not supported inside of vmap"):
            torch.func.vmap(g)(xs)
        with pytest.raises(UnsupportedUnderVmap, match=r"vmap: x.as_strided\(.*reads storage "
                                                       r"elements " + where):
            functrans.vmap(g)(xs)
    with pytest.raises(UnsupportedUnderVmap, match="reads storage elements"):
        functrans.vmap(functrans.vmap(lambda t: t.as_strided([4, 4], [4, 1], 0)))(
            torch.randn(B0, B1, 3, 5))


@pytest.mark.parametrize("op", ["as_strided", "as_strided_copy"])
def test_as_strided_of_expanded_examples_layout_expanded(op):
    """Layout ``expanded`` (issue 25): each example expanded (stride 0) from its first row,
    different per example, in a batch that tiles its storage, one block of 9 elements per
    example.  An example stands for a fresh tensor (its clone(): 9 elements, the row three
    times), but its memory holds the row once: the window (4 storage elements) reaches past the
    example's memory (3), which has no per-example meaning, so it is refused (an earlier rule
    had windowed the block, a wrong answer); the same values stacked contiguously give the
    loop's answer."""
    fn = getattr(torch, op)
    f = lambda t: fn(t, (2, 2), (1, 2), 0)   # noqa: E731
    full = torch.randn(3, 3, 3, generator=torch.Generator().manual_seed(2))
    x = full.narrow(1, 0, 1).expand(3, 3, 3)    # example k: full[k, 0] repeated 3 times
    want = loop_oracle(lambda t: f(t.clone()), (0,), 3, x)
    with pytest.raises(functrans.errors.UnsupportedUnderVmap, match="reads storage elements"):
        functrans.vmap(f)(x)
    assert_same(functrans.vmap(f)(x.contiguous()), want)


@pytest.mark.parametrize("in_dims", [(-1, 0), (-1, None), (None, -1), (0, 0)])
def test_view_of_an_interleaved_batch_also_under_fake_tensors(in_dims):
    """kron ends in ``_unsafe_view`` of a product whose batch dim sits among the example's dims
    (in_dims=-1): the batch-first view fails and the rule lays the batch over each example's
    view (or copies).  Under FakeTensorMode (torch.compile tracing, the fake-GPU device audit)
    that failure is a ValueError from PyTorch's Python reference, not the kernels'
    RuntimeError; it must take the same way, with the loop's shapes."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    a, b = torch.randn(5, 5), torch.randn(10, 20)
    batched = [x if d is None else make_batch(x, d, 3) for x, d in zip((a, b), in_dims)]
    expected = loop_oracle(torch.kron, in_dims, 3, *batched)
    with functrans.config.strict_fallback():
        assert_same(functrans.vmap(torch.kron, in_dims=in_dims)(*batched), expected)
    with FakeTensorMode() as mode:
        fakes = [mode.from_tensor(x) for x in batched]
        with functrans.config.strict_fallback():
            out = functrans.vmap(torch.kron, in_dims=in_dims)(*fakes)
    assert out.shape == expected.shape and out.dtype == expected.dtype
