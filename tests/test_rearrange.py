"""functrans.rearrange: einops patterns against einops itself, under vmap (per-example
patterns, against a loop and the reference vmap) and under grad."""
import pytest
import torch

import functrans
from tests.support.oracles import assert_same, loop_oracle

import einops  # noqa: E402  (in the dev extra: a missing one fails, it never skips)

CASES = [
    ((2, 3, 4, 5), "b c h w -> b (h w) c", {}),
    ((6, 3), "(b1 b2) c -> b1 b2 c", {"b1": 2}),
    ((2, 3, 4), "... c -> c ...", {}),
    ((3, 4), "h w -> h 1 w ()", {}),
    ((3, 1, 4), "h 1 w -> w h", {}),
]


@pytest.mark.parametrize("shape,pattern,lengths", CASES)
def test_matches_einops_and_vmap_matches_loop(shape, pattern, lengths):
    x = torch.randn(shape)
    assert_same(functrans.rearrange(x, pattern, **lengths), einops.rearrange(x, pattern, **lengths))
    X = torch.randn(3, *shape)
    f = lambda t: functrans.rearrange(t, pattern, **lengths)  # noqa: E731
    g = lambda t: einops.rearrange(t, pattern, **lengths)  # noqa: E731
    assert_same(functrans.vmap(f)(X), loop_oracle(g, (0,), 3, X))
    assert_same(functrans.vmap(f, in_dims=1)(X.movedim(0, 1)), torch.func.vmap(g)(X))


def test_under_grad_and_per_example_grad():
    x = torch.randn(2, 3, 4)
    w = torch.randn(4, 6)
    loss = lambda x: (functrans.rearrange(x, "a b c -> (a b) c") @ w).sin().sum()  # noqa: E731
    ref = lambda x: (einops.rearrange(x, "a b c -> (a b) c") @ w).sin().sum()  # noqa: E731
    assert_same(functrans.grad(loss)(x), torch.func.grad(ref)(x))
    X = torch.randn(5, 2, 3, 4)
    assert_same(functrans.vmap(functrans.grad(loss))(X), torch.func.vmap(torch.func.grad(ref))(X))


def test_bad_arguments():
    with pytest.raises(TypeError, match="torch.Tensor"):
        functrans.rearrange([1, 2], "a -> a")
    with pytest.raises(TypeError, match="pattern"):
        functrans.rearrange(torch.randn(2), 3)


def test_missing_einops_names_the_extra(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "einops", None)
    with pytest.raises(ImportError, match=r"functrans\[einops\]"):
        functrans.rearrange(torch.randn(2, 3), "a b -> b a")
