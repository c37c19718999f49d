"""randomness='error' | 'different' | 'same' for every random op, behaviour checked against the
definition (torch.vmap draws from the RNG in another order, so values cannot be compared)."""
import pytest
import torch
import torch.nn.functional as F

from functrans import _levels, vmap
from functrans.errors import UnsupportedUnderVmap

B = 64
X = torch.rand(B, 5) * 0.8 + 0.1  # batched probabilities / positive values, all different

# (name, per-example function of x): each draws random numbers
OPS = {
    "rand_like": lambda x: torch.rand_like(x),
    "randn_like": lambda x: torch.randn_like(x),
    "randint_like": lambda x: torch.randint_like(x, 0, 1000),
    "bernoulli_p": lambda x: torch.bernoulli(torch.full_like(x, 0.5)),
    "uniform_": lambda x: torch.empty_like(x).uniform_(-1, 1),
    "normal_": lambda x: torch.empty_like(x).normal_(),
    "exponential_": lambda x: torch.empty_like(x).exponential_(),
    "cauchy_": lambda x: torch.empty_like(x).cauchy_(),
    "log_normal_": lambda x: torch.empty_like(x).log_normal_(),
    "geometric_": lambda x: torch.empty_like(x).geometric_(0.5),
    "random_": lambda x: torch.empty_like(x).random_(0, 1000),
    "randn_factory": lambda x: torch.randn(5) + x * 0,
    "rand_factory": lambda x: x * 0 + torch.rand(5),
    "randint_factory": lambda x: x * 0 + torch.randint(0, 1000, (5,)),
    "normal_factory": lambda x: x * 0 + torch.normal(0.0, 1.0, (5,)),
    "dropout": lambda x: F.dropout(torch.ones_like(x), 0.5, training=True),
}
# value-dependent: the inputs differ per example
VALUE_OPS = {
    "bernoulli": lambda x: torch.bernoulli(x),
    "normal_tensor": lambda x: torch.normal(x * 0, torch.ones_like(x)),
    "dropout_x": lambda x: F.dropout(x, 0.5, training=True),
    "poisson": lambda x: torch.poisson(x * 10),
    "multinomial": lambda x: torch.multinomial(x, 3),
}


@pytest.mark.parametrize("name", list(OPS) + list(VALUE_OPS))
def test_error_mode_raises_with_a_fix(name):
    f = {**OPS, **VALUE_OPS}[name]
    with pytest.raises(UnsupportedUnderVmap, match="randomness='different'.*randomness='same'"):
        vmap(f)(X)
    assert _levels.stack() == []
    with pytest.raises(RuntimeError):  # torch.vmap refuses too
        torch.vmap(f)(X)


@pytest.mark.parametrize("name", list(OPS))
def test_same_shares_and_different_differs(name):
    f = OPS[name]
    same = vmap(f, randomness="same")(X)
    assert same.shape == (B, 5)
    assert (same == same[0]).all(), "randomness='same' must give every example the same draw"
    diff = vmap(f, randomness="different")(X)
    assert diff.shape == (B, 5)
    assert not (diff == diff[0]).all(), "randomness='different' must differ across examples"
    if name != "bernoulli_p":  # torch.vmap refuses 'same' with a batched input; functrans doesn't
        assert torch.vmap(f, randomness="same")(X).shape == same.shape


@pytest.mark.parametrize("name", list(VALUE_OPS))
def test_value_dependent_different(name):
    out = vmap(VALUE_OPS[name], randomness="different")(X)
    ref = torch.vmap(VALUE_OPS[name], randomness="different")(X)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert not (out == out[0]).all()


def test_distributions_are_right():
    torch.manual_seed(0)
    p = torch.full((4000,), 0.3)
    draws = vmap(torch.bernoulli, randomness="different")(p)
    assert abs(draws.mean().item() - 0.3) < 0.03
    y = vmap(lambda a: F.dropout(a, 0.25, training=True), randomness="different")(torch.ones(2000, 8))
    kept = y[y != 0]
    assert torch.allclose(kept, torch.full_like(kept, 1 / 0.75))
    assert abs((y != 0).float().mean().item() - 0.75) < 0.03
    z = vmap(lambda a: torch.randn_like(a), randomness="different")(torch.zeros(4000, 2))
    assert abs(z.mean().item()) < 0.05 and abs(z.std().item() - 1) < 0.05


def test_same_with_value_dependent_inputs_shares_the_random_numbers():
    torch.manual_seed(0)
    x = torch.stack([torch.ones(1000), torch.full((1000,), 2.0)])
    out = vmap(lambda a: F.dropout(a, 0.5, training=True), randomness="same")(x)
    assert torch.equal(out[0] != 0, out[1] != 0), "one mask for the whole batch"
    assert torch.allclose(out[1], out[0] * 2)
    n = vmap(lambda m: torch.normal(m, torch.ones_like(m)), randomness="same")(x)
    assert torch.allclose(n[1] - n[0], torch.ones(1000))
    b = vmap(torch.bernoulli, randomness="same")(torch.stack([torch.full((500,), 0.2),
                                                              torch.full((500,), 0.9)]))
    assert (b[0] <= b[1]).all(), "shared uniforms: p=0.2 fires only where p=0.9 fires"
    with pytest.raises(UnsupportedUnderVmap, match="randomness='same'"):
        vmap(lambda a: torch.poisson(a), randomness="same")(x)


def test_inplace_random_fill_of_unbatched_tensor():
    with pytest.raises(UnsupportedUnderVmap, match="not batched.*empty_like"):
        vmap(lambda a: a + torch.empty(5).uniform_(), randomness="different")(X)
    out = vmap(lambda a: a * 0 + torch.empty(5).uniform_(), randomness="same")(X)
    assert (out == out[0]).all()


def test_nested_levels_apply_their_own_randomness():
    x = torch.zeros(3, 4, 5)
    out = vmap(vmap(lambda a: torch.rand_like(a), randomness="same"), randomness="different")(x)
    assert (out == out[:, :1]).all(), "inner 'same': equal across the inner batch"
    assert not (out[0] == out[1]).all(), "outer 'different': differs across the outer batch"
    out = vmap(vmap(lambda a: torch.randn(5) + a, randomness="different"), randomness="same")(x)
    assert (out == out[:1]).all() and not (out[:, 0] == out[:, 1]).all()


def test_chunked_same_is_the_same_across_chunks():
    out = vmap(lambda a: torch.rand_like(a), randomness="same", chunk_size=5)(X)
    assert (out == out[0]).all()


def test_attention_without_dropout_is_not_random():
    q = torch.randn(4, 2, 3, 8)
    out = vmap(lambda a: F.scaled_dot_product_attention(a, a, a))(q)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, q, q))
