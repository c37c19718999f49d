"""Data-dependent ops under vmap (see functrans/batching/rules/data_dependent.py): per-example
results of one shape are stacked (checked against a for-loop over DIFFERENT examples, and
torch.func where it batches them); ragged results raise an error naming the op, the shapes and
the fix.  Also the as_strided family under nested vmap (rules/views.py) and take."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import functrans as ft
from functrans.errors import PerformanceWarning, UnsupportedUnderVmap
from tests.support.oracles import loop_oracle


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PerformanceWarning)
        return fn(*args, **kwargs)


def _same(got, expected):
    for g, e in zip(torch.utils._pytree.tree_leaves(got),
                    torch.utils._pytree.tree_leaves(expected)):
        torch.testing.assert_close(g, e)


# Batches of DIFFERENT examples whose results have one shape (same number of nonzeros, same
# number of distinct values, same repeat totals, same max value).
_NZ = torch.tensor([[0., 2., 0., 3.], [5., 0., 1., 0.], [0., 0., 4., 7.]])
_UNIQ = torch.tensor([[3, 1, 3, 2], [9, 9, 4, 5], [0, 7, 7, 8]])
_CONSEC = torch.tensor([[1, 1, 2, 3], [4, 5, 5, 6], [7, 8, 9, 9]])
_BINS = torch.tensor([[0, 3, 1, 3], [3, 2, 2, 0], [1, 1, 3, 3]])
_REPEATS = torch.tensor([[1, 2, 0], [0, 0, 3], [2, 1, 0]])
_VALS = torch.tensor([[1., 2., 3.], [4., 5., 6.], [7., 8., 9.]])

SAME_SHAPE = [
    ("nonzero", lambda a: torch.nonzero(a), (_NZ,), True),
    ("argwhere", lambda a: torch.argwhere(a.view(2, 2)), (_NZ,), True),
    ("unique", lambda a: torch.unique(a, return_inverse=True, return_counts=True), (_UNIQ,),
     False),
    ("unique_dim", lambda a: torch.unique(a.view(2, 2), dim=1), (_UNIQ,), False),
    ("unique_consecutive", lambda a: torch.unique_consecutive(a, return_counts=True),
     (_CONSEC,), False),
    ("bincount", lambda a: torch.bincount(a), (_BINS,), False),
    ("bincount_weights", lambda a, w: torch.bincount(a, w), (_BINS, torch.randn(3, 4)), False),
    ("repeat_interleave", lambda r, v: torch.repeat_interleave(v, r), (_REPEATS, _VALS), False),
    ("masked_select_batched_mask", lambda a: torch.masked_select(a, a != 0), (_NZ,), True),
]


@pytest.mark.parametrize("name,f,args,diff", SAME_SHAPE, ids=[c[0] for c in SAME_SHAPE])
def test_same_shape_results_are_stacked(name, f, args, diff):
    dims = (0,) * len(args)
    expected = loop_oracle(f, dims, 3, *args)
    _same(_quiet(ft.vmap(f), *args), expected)
    # batch not first, and nested vmap (2 x 3 examples, all with one result shape)
    moved = [a.movedim(0, -1) for a in args]
    _same(_quiet(ft.vmap(f, in_dims=(-1,) * len(args)), *moved), expected)
    nested = [torch.stack([a, a.flip(0)]) for a in args]
    expected2 = loop_oracle(lambda *b: loop_oracle(f, dims, 3, *b), dims, 2, *nested)
    _same(_quiet(ft.vmap(ft.vmap(f)), *nested), expected2)


RAGGED = [
    ("aten.nonzero", lambda a: a.nonzero(), torch.tensor([[1., 0.], [1., 1.]]),
     "nonzero_static"),
    ("aten._unique2", lambda a: torch.unique(a), torch.tensor([[1, 1], [1, 2]]), "sort"),
    ("aten.unique_consecutive", lambda a: torch.unique_consecutive(a),
     torch.tensor([[1, 1], [1, 2]]), "sort"),
    ("aten.bincount", lambda a: torch.bincount(a), torch.tensor([[1, 1], [1, 3]]), "minlength"),
    ("aten.masked_select", lambda a: torch.masked_select(a, a > 0),
     torch.tensor([[1., -1.], [1., 1.]]), "torch.where"),
    ("aten.repeat_interleave", lambda a: torch.repeat_interleave(a),
     torch.tensor([[1, 1], [1, 2]]), "repeats sum"),
]


@pytest.mark.parametrize("op,f,x,fix", RAGGED, ids=[c[0] for c in RAGGED])
def test_ragged_results_raise_a_clear_error(op, f, x, fix):
    with pytest.raises(UnsupportedUnderVmap) as info:
        _quiet(ft.vmap(f), x)
    msg = str(info.value)
    assert op in msg and "different shapes" in msg and "example 0: [" in msg
    assert fix in msg and "torch.nested" in msg
    with pytest.raises(UnsupportedUnderVmap, match="different shapes"):   # nested too
        _quiet(ft.vmap(ft.vmap(f)), torch.stack([x, x]))


def test_strict_fallback_and_warning_for_data_dependent_ops():
    # a loop on purpose: strict mode refuses it and says why; the warning quotes the reason
    with ft.config.strict_fallback(), pytest.raises(UnsupportedUnderVmap,
                                                    match="on purpose.*depends on the values"):
        ft.vmap(torch.nonzero)(_NZ)
    from functrans.batching import fallback
    fallback._warned.discard(torch.ops.aten.nonzero.default)
    with pytest.warns(PerformanceWarning, match="no batching rule on purpose"):
        ft.vmap(torch.nonzero)(_NZ)


def test_masked_select_with_an_unbatched_mask_is_a_rule():
    x = torch.randn(4, 2, 3)
    mask = torch.tensor([[True], [False]])          # broadcast against each example
    f = lambda a: torch.masked_select(a, mask)
    with ft.config.strict_fallback():
        got = ft.vmap(f)(x)
        got_moved = ft.vmap(f, in_dims=1)(x.movedim(0, 1))
        got_nested = ft.vmap(ft.vmap(f))(x.view(2, 2, 2, 3))
    expected = loop_oracle(f, (0,), 4, x)
    _same(got, expected)
    _same(got_moved, expected)
    _same(got_nested, expected.view(2, 2, -1))
    _same(got, torch.func.vmap(f)(x))
    # a mask with more dims than the example
    m3 = torch.rand(2, 2, 3) > 0.5
    g = lambda a: torch.masked_select(a, m3)
    with ft.config.strict_fallback():
        _same(ft.vmap(g)(x), loop_oracle(g, (0,), 4, x))


def test_combinations_is_batched():
    x = torch.randn(4, 5)
    for r, wr in ((2, False), (3, False), (2, True)):
        f = lambda a: torch.combinations(a, r, with_replacement=wr)
        with ft.config.strict_fallback():
            got = ft.vmap(f)(x)
            got2 = ft.vmap(ft.vmap(f))(x.view(2, 2, 5))
        _same(got, loop_oracle(f, (0,), 4, x))
        _same(got2, loop_oracle(f, (0,), 4, x).view(2, 2, *got.shape[1:]))
        _same(got, torch.func.vmap(f)(x))


def test_masked_select_under_vmap_of_grad_and_vjp():
    x = torch.randn(3, 4)
    mask = torch.tensor([[True, False, True, False], [False, True, True, False],
                         [True, True, False, False]])       # 2 per example: one shape
    loss = lambda a, m: (torch.masked_select(a, m) ** 3).sum()
    got = _quiet(ft.vmap(ft.grad(loss)), x, mask)
    expected = torch.stack([torch.func.grad(loss)(a, m) for a, m in zip(x, mask)])
    _same(got, expected)
    unb = mask[0]
    got = ft.vmap(ft.grad(loss), in_dims=(0, None))(x, unb)
    _same(got, torch.func.vmap(torch.func.grad(loss), in_dims=(0, None))(x, unb))
    ct = torch.randn(3, 2)
    f = lambda a, m, c: ft.vjp(lambda t: torch.masked_select(t, m), a)[1](c)[0]
    got = _quiet(ft.vmap(f), x, mask, ct)
    _same(got, loop_oracle(lambda a, m, c: torch.zeros(4).masked_scatter(m, c), (0, 0, 0), 3,
                           x, mask, ct))


def test_lstsq_and_ctc_loss_run_per_example():
    A, B = torch.randn(3, 5, 3), torch.randn(3, 5, 2)
    f = lambda a, b: torch.linalg.lstsq(a, b)
    got = _quiet(ft.vmap(f), A, B)
    _same(tuple(got), tuple(loop_oracle(lambda a, b: tuple(f(a, b)), (0, 0), 3, A, B)))
    sol = lambda a, b: torch.linalg.lstsq(a, b).solution.pow(2).sum()
    _same(_quiet(ft.vmap(ft.grad(sol)), A, B),
          torch.stack([torch.func.grad(sol)(a, b) for a, b in zip(A, B)]))
    lp = torch.randn(3, 6, 2, 4).log_softmax(-1)      # examples: (T=6, N=2, C=4)
    tg = torch.randint(1, 4, (3, 2, 3))
    ctc = lambda l, t: F.ctc_loss(l, t, [6, 5], [3, 2])
    _same(_quiet(ft.vmap(ctc), lp, tg), loop_oracle(ctc, (0, 0), 3, lp, tg))


def test_as_strided_family_under_nested_vmap():
    y = torch.randn(2, 3, 3, 3)
    f = lambda a: a.as_strided((2, 2), (1, 2), 1)
    fresh = lambda h: (lambda *a: h(*[t.clone() for t in a]))   # an example is a fresh tensor
    nested = lambda h, *a, d=(0,): loop_oracle(lambda *b: loop_oracle(fresh(h), d, 3, *b), d,
                                               2, *a)
    with ft.config.strict_fallback():
        _same(ft.vmap(ft.vmap(f))(y), nested(f, y))
        cp = lambda a: torch.as_strided_copy(a, (2, 2), (1, 2), 1)
        _same(ft.vmap(ft.vmap(cp))(y), nested(cp, y))
        g = lambda a, s: torch.as_strided_scatter(a, s, (2, 2), (1, 3), 2)
        s = torch.randn(2, 3, 2, 2)
        _same(ft.vmap(ft.vmap(g))(y, s), nested(g, y, s, d=(0, 0)))
        _same(ft.vmap(g)(y[0], s[0]), loop_oracle(fresh(g), (0, 0), 3, y[0], s[0]))
    _same(ft.vmap(ft.grad(lambda a: f(a).pow(2).sum()))(y[0].clone()),
          torch.func.vmap(torch.func.grad(lambda a: f(a).pow(2).sum()))(y[0]))
    # the nested result is a view (Note [as_strided under vmap]): a write through it reaches
    # each example, as in torch.func and the loop
    def write(a):
        v = a.as_strided((2,), (1,), 0)
        v.mul_(2)
        return a
    ours, ref = y.clone(), y.clone()
    with ft.config.strict_fallback():
        ft.vmap(ft.vmap(write))(ours)
    torch.func.vmap(torch.func.vmap(write))(ref)
    _same(ours, ref)
    _same(ours, torch.stack([torch.stack([write(a.clone()) for a in b]) for b in y]))
    # an interleaved batch: each example viewed as example 0 is, as in torch.func
    x = y[0].movedim(0, -1).contiguous()
    _same(ft.vmap(f, in_dims=-1)(x), torch.func.vmap(f, in_dims=-1)(x))


def test_take_under_nested_vmap():
    x = torch.randn(2, 3, 4, 5)
    idx = torch.randint(-20, 20, (2, 3, 6))
    f = lambda a, i: torch.take(a, i)
    with ft.config.strict_fallback():
        got = ft.vmap(ft.vmap(f))(x, idx)
        got2 = ft.vmap(ft.vmap(f, in_dims=(0, None)), in_dims=(0, None))(x, idx[0, 0])
    _same(got, loop_oracle(lambda a, i: loop_oracle(f, (0, 0), 3, a, i), (0, 0), 2, x, idx))
    _same(got2, torch.func.vmap(torch.func.vmap(f, in_dims=(0, None)),
                                in_dims=(0, None))(x, idx[0, 0]))


def test_stft_and_istft_under_nested_vmap():
    # stft frames its padded input with as_strided: under vmap∘vmap the innermost physical
    # tensor holds only its examples (a size-1 dim's stride is arbitrary and must not count).
    window = torch.hann_window(8)
    f = lambda a: torch.stft(a, 8, return_complex=True, window=window)  # noqa: E731
    g = lambda s: torch.istft(s, 8, window=window)  # noqa: E731
    xs = torch.randn(2, 3, 20)
    out = ft.vmap(ft.vmap(f))(xs)
    ref = torch.stack([torch.stack([f(r.clone()) for r in row]) for row in xs])
    torch.testing.assert_close(out, ref)
    back = ft.vmap(ft.vmap(g))(out)
    torch.testing.assert_close(back, torch.stack([torch.stack([g(r) for r in row]) for row in out]))
    torch.testing.assert_close(ft.vmap(f, in_dims=1)(xs[0].T.contiguous()),
                               torch.stack([f(r.clone()) for r in xs[0]]))
