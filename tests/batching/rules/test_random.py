"""randomness='error' | 'different' | 'same' for every random op, checked against the definition:
shapes and dtypes against the loop, 'same' equal across the batch, 'different' not, value ranges
and rough moments, nesting per level, chunking, autograd.  torch.vmap draws from the RNG in
another order, so only its behaviour (raises or not, shapes) is compared, never its values.
Every test runs with the loop fallback disabled, so a rule (or the randomness mode) did the work.
"""
import pytest
import torch
import torch.nn.functional as F

import functrans
from functrans import _levels, vmap
from functrans.errors import UnsupportedUnderVmap
from tests.support.oracles import loop_oracle

B = 64
X = torch.rand(B, 5) * 0.8 + 0.1  # batched probabilities / positive values, all different


@pytest.fixture(autouse=True)
def _strict():
    with functrans.config.strict_fallback():
        yield


def _gen():
    return torch.Generator().manual_seed(3)


# Per-example functions of x (shape (5,), values in (0.1, 0.9)) whose random numbers do not
# depend on x's values: 'same' must give every example the same result.
OPS = {
    "rand_like": lambda x: torch.rand_like(x),
    "randn_like": lambda x: torch.randn_like(x),
    "rand_like_f64": lambda x: torch.rand_like(x, dtype=torch.float64),
    "randint_like": lambda x: torch.randint_like(x, 1000),
    "randint_like_low": lambda x: torch.randint_like(x, 5, 1000),
    "bernoulli_p": lambda x: torch.bernoulli(x, 0.5),
    "bernoulli_.float": lambda x: torch.empty_like(x).bernoulli_(0.5),
    "bernoulli_.Tensor_unbatched_p": lambda x: torch.empty_like(x).bernoulli_(torch.full((5,), .5)),
    "uniform_": lambda x: torch.empty_like(x).uniform_(-1, 1),
    "normal_": lambda x: torch.empty_like(x).normal_(),
    "exponential_": lambda x: torch.empty_like(x).exponential_(),
    "cauchy_": lambda x: torch.empty_like(x).cauchy_(),
    "log_normal_": lambda x: torch.empty_like(x).log_normal_(),
    "geometric_": lambda x: torch.empty_like(x).geometric_(0.5),
    "uniform": lambda x: torch.ops.aten.uniform(torch.empty_like(x), -1.0, 1.0),
    "exponential": lambda x: torch.ops.aten.exponential(torch.empty_like(x)),
    "cauchy": lambda x: torch.ops.aten.cauchy(torch.empty_like(x)),
    "log_normal": lambda x: torch.ops.aten.log_normal(torch.empty_like(x)),
    "geometric": lambda x: torch.ops.aten.geometric(torch.empty_like(x), 0.5),
    "rand_like.generator": lambda x: torch.rand_like(x, generator=_gen()) + torch.rand_like(x),
    "randn_like.generator": lambda x: torch.randn_like(x, generator=_gen()) + torch.randn_like(x),
    "randint_like.generator": lambda x: torch.randint_like(x, 1000, generator=_gen())
    + torch.randint_like(x, 1000),
    "randint_like.low_generator": lambda x: torch.randint_like(x, 5, 1000, generator=_gen())
    + torch.randint_like(x, 1000),
    "randint_like.Tensor": lambda x: torch.ops.aten.randint_like.Tensor(x, torch.tensor(1000)),
    "randint_like.Tensor_generator": lambda x: torch.ops.aten.randint_like.Tensor_generator(
        x, torch.tensor(1000), generator=_gen()) + torch.randint_like(x, 1000),
    "random_": lambda x: torch.empty_like(x).random_(),
    "random_.to": lambda x: torch.empty_like(x).random_(1000),
    "random_.from": lambda x: torch.empty_like(x).random_(5, 1000),
    "rand": lambda x: x * 0 + torch.rand(5),
    "rand_generator": lambda x: x * 0 + torch.rand(5, generator=_gen()) + torch.rand(5),
    "randn": lambda x: torch.randn(5) + x * 0,
    "randint": lambda x: x * 0 + torch.randint(1000, (5,)),
    "randint.low": lambda x: x * 0 + torch.randint(5, 1000, (5,)),
    "randperm": lambda x: x * 0 + torch.randperm(5),
    "normal.float_float": lambda x: x * 0 + torch.normal(0.0, 1.0, (5,)),
    "normal.Tensor_Tensor_unbatched": lambda x: x * 0 + torch.normal(torch.zeros(5),
                                                                     torch.ones(5)),
    "bernoulli_unbatched": lambda x: x * 0 + torch.bernoulli(torch.full((5,), 0.5)),
    "poisson_unbatched": lambda x: x * 0 + torch.poisson(torch.full((5,), 30.0)),
    "multinomial_unbatched": lambda x: x * 0 + torch.multinomial(torch.ones(7), 5),
    "rand_like_unbatched": lambda x: x * 0 + torch.rand_like(torch.ones(5)),
    "dropout": lambda x: F.dropout(torch.ones_like(x), 0.5, training=True),
    "nn.Dropout": lambda x: torch.nn.Dropout(0.5).train()(torch.ones_like(x)),
    "dropout2d": lambda x: F.dropout2d(torch.ones_like(x).view(1, 5, 1, 1).expand(3, 5, 2, 2),
                                       0.5, True),
    "alpha_dropout": lambda x: F.alpha_dropout(torch.ones_like(x), 0.5, training=True),
    "feature_alpha_dropout": lambda x: F.feature_alpha_dropout(
        torch.ones_like(x).view(1, 5, 1).expand(2, 5, 3), 0.5, training=True),
    "rrelu": lambda x: F.rrelu(-torch.ones_like(x), training=True),
    "rrelu_": lambda x: F.rrelu(-torch.ones_like(x), training=True, inplace=True),
}

# The random numbers meet per-example inputs: the results differ even under 'same'.
VALUE_OPS = {
    "bernoulli": lambda x: torch.bernoulli(x),
    "bernoulli.Tensor": lambda x: torch.ops.aten.bernoulli.Tensor(torch.zeros(3, 5), x),
    "bernoulli_.Tensor": lambda x: torch.zeros_like(x).expand(3, 5).clone().bernoulli_(x),
    "normal.Tensor_Tensor": lambda x: torch.normal(x, x),
    "normal.Tensor_float": lambda x: torch.normal(x, 2.0),
    "normal.float_Tensor": lambda x: torch.normal(1.0, x),
    "dropout": lambda x: F.dropout(x, 0.5, training=True),
    "dropout1d": lambda x: F.dropout1d(x.expand(3, 5), 0.5, training=True),
    "alpha_dropout": lambda x: F.alpha_dropout(x, 0.5, training=True),
    "native_dropout": lambda x: torch.native_dropout(x, 0.5, True)[0],
    "rrelu": lambda x: F.rrelu(x - 0.5, training=True),
    "multinomial": lambda x: torch.multinomial(x, 3),
    "multinomial_replacement": lambda x: torch.multinomial(x, 8, replacement=True),
    "multinomial_2d": lambda x: torch.multinomial(x.expand(4, 5), 5),
    "multinomial_2d_replacement": lambda x: torch.multinomial(x.expand(4, 5), 2, True),
}
# No way to share the random numbers across different inputs: 'same' raises.
NO_SAME_OPS = {
    "poisson": lambda x: torch.poisson(x * 10),
    "_standard_gamma": lambda x: torch._standard_gamma(x),
    "binomial": lambda x: torch.binomial(x * 10, x),
    "_sample_dirichlet": lambda x: torch._sample_dirichlet(x),
}
# torch.vmap refuses randomness='same' for these with a batched input; functrans shares the
# random numbers (dropout it shares too: one mask).
TORCH_VMAP_REFUSES_SAME = {"bernoulli", "bernoulli_.Tensor", "normal.Tensor_Tensor",
                           "normal.Tensor_float", "normal.float_Tensor", "multinomial",
                           "multinomial_replacement", "multinomial_2d",
                           "multinomial_2d_replacement"}
# torch.vmap's loop fallback for bernoulli.Tensor draws without checking randomness='error'
# (and it draws for the functional forms of the in-place samplers, and randint_like.Tensor)
TORCH_VMAP_MISSES_ERROR = {"bernoulli.Tensor", "fixed uniform", "fixed exponential",
                           "fixed cauchy", "fixed log_normal", "fixed geometric",
                           "fixed randint_like.Tensor"}
TORCH_VMAP_LACKS = {"rrelu", "rrelu_"}  # torch.vmap has no batching rule for rrelu
ALL = {**{"fixed " + k: f for k, f in OPS.items()}, **VALUE_OPS, **NO_SAME_OPS}


def _loop_like(f, out):
    ref = loop_oracle(f, [0], B, X)
    assert out.shape == ref.shape and out.dtype == ref.dtype


@pytest.mark.parametrize("name", list(ALL))
def test_error_mode_raises_with_a_fix(name):
    f = ALL[name]
    with pytest.raises(UnsupportedUnderVmap, match="randomness='different'.*randomness='same'"):
        vmap(f)(X)
    assert _levels.stack() == []
    if name not in TORCH_VMAP_MISSES_ERROR:
        with pytest.raises(RuntimeError):  # torch.vmap refuses too
            torch.vmap(f)(X)


def test_error_names_the_op():
    with pytest.raises(UnsupportedUnderVmap, match=r"aten\.randn\.default"):
        vmap(lambda x: x + torch.randn(5))(X)
    with pytest.raises(UnsupportedUnderVmap, match=r"aten\.bernoulli\.default"):
        vmap(torch.bernoulli)(X)


def test_deterministic_uses_of_random_ops_pass_in_error_mode():
    x = X - 0.5
    for f in (lambda a: F.dropout(a, 0.5, training=False), lambda a: F.dropout(a, 0.0),
              lambda a: F.rrelu(a, training=False),
              lambda a: torch.native_dropout(a, 0.5, False)[0]):
        torch.testing.assert_close(vmap(f)(x), loop_oracle(f, [0], B, x))


@pytest.mark.parametrize("name", list(OPS))
def test_same_shares_and_different_differs(name):
    f = OPS[name]
    same = vmap(f, randomness="same")(X)
    _loop_like(f, same)
    assert (same == same[0]).all(), "randomness='same' must give every example the same draw"
    diff = vmap(f, randomness="different")(X)
    _loop_like(f, diff)
    assert not (diff == diff[0]).all(), "randomness='different' must differ across examples"
    if name not in TORCH_VMAP_LACKS:
        ref = torch.vmap(f, randomness="different")(X)
        assert ref.shape == diff.shape and ref.dtype == diff.dtype


@pytest.mark.parametrize("name", list(VALUE_OPS) + list(NO_SAME_OPS))
def test_value_dependent_different(name):
    f = {**VALUE_OPS, **NO_SAME_OPS}[name]
    out = vmap(f, randomness="different")(X)
    _loop_like(f, out)
    if name not in TORCH_VMAP_LACKS:
        ref = torch.vmap(f, randomness="different")(X)
        assert out.shape == ref.shape and out.dtype == ref.dtype
    same_input = vmap(f, randomness="different")(X[:1].expand(B, 5))
    assert not (same_input == same_input[0]).all(), "equal inputs, yet independent draws"


@pytest.mark.parametrize("name", list(VALUE_OPS))
def test_value_dependent_same_shares_the_draw(name):
    f = VALUE_OPS[name]
    out = vmap(f, randomness="same")(X)
    _loop_like(f, out)
    equal = vmap(f, randomness="same")(X[:1].expand(B, 5).clone())
    assert (equal == equal[0]).all(), "equal inputs under 'same' must give equal results"
    if name in TORCH_VMAP_REFUSES_SAME:
        with pytest.raises(RuntimeError, match="same randomness"):
            torch.vmap(f, randomness="same")(X)


@pytest.mark.parametrize("name", list(NO_SAME_OPS))
def test_no_same_ops_raise_under_same(name):
    with pytest.raises(UnsupportedUnderVmap, match="randomness='same'.*randomness='different'"):
        vmap(NO_SAME_OPS[name], randomness="same")(X)
    assert _levels.stack() == []


@pytest.mark.parametrize("in_dim", [1, -1])
def test_batch_dim_not_first(in_dim):
    x = X.t().contiguous()  # (5, B): the batch is the last dim
    for f in (lambda a: torch.rand_like(a), torch.bernoulli, lambda a: a.clone().uniform_(),
              lambda a: F.dropout(a, 0.5, True), lambda a: torch.multinomial(a, 2, True),
              lambda a: torch.normal(a, 1.0)):
        for mode in ("different", "same"):
            out = vmap(f, in_dims=in_dim, randomness=mode)(x)
            ref = loop_oracle(f, [1], B, x)
            assert out.shape == ref.shape and out.dtype == ref.dtype


def test_distributions_are_right():
    p = torch.full((4000,), 0.3)
    draws = vmap(torch.bernoulli, randomness="different")(p)
    assert abs(draws.mean().item() - 0.3) < 0.03
    y = vmap(lambda a: F.dropout(a, 0.25, training=True),
             randomness="different")(torch.ones(2000, 8))
    kept = y[y != 0]
    assert torch.allclose(kept, torch.full_like(kept, 1 / 0.75))
    assert abs((y != 0).float().mean().item() - 0.75) < 0.03
    z = vmap(lambda a: torch.randn_like(a), randomness="different")(torch.zeros(4000, 2))
    assert abs(z.mean().item()) < 0.05 and abs(z.std().item() - 1) < 0.05
    u = vmap(lambda a: a + torch.rand(3), randomness="different")(torch.zeros(4000))
    assert 0 <= u.min() and u.max() < 1 and abs(u.mean().item() - 0.5) < 0.02
    r = vmap(lambda a: a.clone().random_(3, 7), randomness="different")(torch.zeros(4000))
    assert set(r.unique().tolist()) == {3, 4, 5, 6}
    perms = vmap(lambda a: a + torch.randperm(6), randomness="different")(torch.zeros(50))
    assert (perms.sort(-1).values == torch.arange(6.0)).all()
    n = vmap(lambda a: torch.poisson(a), randomness="different")(torch.full((4000,), 4.0))
    assert abs(n.mean().item() - 4.0) < 0.15
    rr = vmap(lambda a: F.rrelu(a, 0.1, 0.3, training=True), randomness="different")(
        -torch.ones(4000))
    assert (-0.3 <= rr).all() and (rr <= -0.1).all() and abs(rr.mean().item() + 0.2) < 0.01


def test_same_with_value_dependent_inputs_shares_the_random_numbers():
    x = torch.stack([torch.ones(1000), torch.full((1000,), 2.0)])
    out = vmap(lambda a: F.dropout(a, 0.5, training=True), randomness="same")(x)
    assert torch.equal(out[0] != 0, out[1] != 0), "one mask for the whole batch"
    assert torch.allclose(out[1], out[0] * 2)
    n = vmap(lambda m: torch.normal(m, torch.ones_like(m)), randomness="same")(x)
    assert torch.allclose(n[1] - n[0], torch.ones(1000))
    s = vmap(lambda sd: torch.normal(0.0, sd), randomness="same")(x)
    assert torch.allclose(s[1], 2 * s[0])
    b = vmap(torch.bernoulli, randomness="same")(torch.stack([torch.full((500,), 0.2),
                                                              torch.full((500,), 0.9)]))
    assert (b[0] <= b[1]).all(), "shared uniforms: p=0.2 fires only where p=0.9 fires"
    r = vmap(lambda a: F.rrelu(a, training=True), randomness="same")(-x)
    assert torch.allclose(r[1], 2 * r[0])


def test_multinomial_same_is_a_valid_sample():
    probs = torch.rand(B, 6)
    probs[:, 2] = 0
    out = vmap(lambda p: torch.multinomial(p, 5), randomness="same")(probs)
    assert ((out >= 0) & (out < 6)).all() and (out != 2).all()
    assert (out.sort(-1).values.diff(dim=-1) > 0).all(), "without replacement: distinct"
    # The shared noise is drawn through the outer level: 'different' outside makes it a
    # fresh sample per outer example, with the right frequencies.
    p = torch.tensor([0.1, 0.6, 0.3])
    for replacement in (False, True):
        draws = vmap(vmap(lambda q: torch.multinomial(q, 2, replacement), randomness="same"),
                     randomness="different")(p.expand(4000, 2, 3))
        assert (draws[:, 0] == draws[:, 1]).all()
        freq = torch.bincount(draws[:, 0, 0], minlength=3) / 4000.0
        torch.testing.assert_close(freq, p, atol=0.03, rtol=0)
    with pytest.raises(RuntimeError, match="cannot sample"):
        vmap(lambda q: torch.multinomial(q, 7), randomness="same")(probs)


def test_inplace_random_fill_of_unbatched_tensor():
    for fill in (lambda t: t.uniform_(), lambda t: t.normal_(), lambda t: t.bernoulli_(0.5),
                 lambda t: t.random_(), lambda t: t.exponential_()):
        with pytest.raises(UnsupportedUnderVmap, match="not batched.*empty_like"):
            vmap(lambda a: a + fill(torch.empty(5)), randomness="different")(X)
        assert _levels.stack() == []
        out = vmap(lambda a: a * 0 + fill(torch.empty(5)), randomness="same")(X)
        assert (out == out[0]).all()


@pytest.mark.parametrize("f", [lambda x: F.dropout(x, 0.5, training=True),
                               lambda x: F.dropout1d(x, 0.5, training=True),
                               lambda x: F.feature_alpha_dropout(x, 0.5, training=True),
                               lambda x: F.rrelu(-x, training=True)])
def test_dropout_of_an_unbatched_input(f):
    # an ensemble: the weights are mapped, the data is not; ATen's dropout fills
    # empty_like(x) in place, which must still draw per example under 'different'
    x, w = torch.ones(2, 6, 3), torch.ones(B)
    out = vmap(lambda wi: f(x) * wi, randomness="different")(w)
    assert out.shape == (B, 2, 6, 3) and not (out == out[0]).all()
    ref = torch.vmap(lambda wi: F.dropout(x, 0.5, True) * wi, randomness="different")(w)
    assert ref.shape == out.shape
    out = vmap(lambda wi: f(x) * wi, randomness="same")(w)
    assert (out == out[0]).all()
    nested = vmap(lambda _: vmap(lambda wi: f(x) * wi, randomness="same")(w[:4]),
                  randomness="different")(torch.zeros(5))
    assert (nested == nested[:, :1]).all() and not (nested == nested[:1]).all()


def test_empty_like_stays_unbatched_unless_randomness_is_different():
    x = torch.ones(5)
    for mode in ("error", "same"):
        out = vmap(lambda w: torch.empty_like(x).fill_(1.0), randomness=mode,
                   out_dims=None)(torch.ones(3))
        assert out.shape == (5,)
    out = vmap(lambda w: x.new_empty(2, 5).fill_(1.0) * w, randomness="different")(torch.ones(3))
    assert torch.equal(out, torch.ones(3, 2, 5))


NESTED = {**OPS, **{"value " + k: f for k, f in VALUE_OPS.items()}}


@pytest.mark.parametrize("name", list(NESTED))
def test_nested_levels_apply_their_own_randomness(name):
    f = NESTED[name]
    x = X[:1].expand(6, 4, 5).clone()  # equal inputs: only the randomness tells examples apart
    out = vmap(vmap(f, randomness="same"), randomness="different")(x)
    assert (out == out[:, :1]).all(), "inner 'same': equal across the inner batch"
    assert not (out == out[:1]).all(), "outer 'different': differs across the outer batch"
    out = vmap(vmap(f, randomness="different"), randomness="same")(x)
    assert (out == out[:1]).all(), "outer 'same': equal across the outer batch"
    assert not (out == out[:, :1]).all(), "inner 'different': differs across the inner batch"


def test_nested_with_batched_inner_inputs_only():
    # the input is mapped by the inner vmap only; the outer level sees the draws as unbatched
    x = torch.rand(4, 5)
    out = vmap(lambda _: vmap(lambda a: torch.bernoulli(a), randomness="different")(x),
               randomness="same")(torch.zeros(3))
    assert out.shape == (3, 4, 5) and (out == out[:1]).all()
    with pytest.raises(UnsupportedUnderVmap, match="randomness='error'"):
        vmap(lambda _: vmap(lambda a: torch.bernoulli(a), randomness="same")(x))(torch.zeros(3))
    assert _levels.stack() == []


@pytest.mark.parametrize("f", [lambda a: torch.rand_like(a),
                               lambda a: F.dropout(a, 0.5, training=True),
                               lambda a: a + torch.randn(5)])
def test_chunks(f):
    same = vmap(f, randomness="same", chunk_size=5)(X)
    assert ((same != 0) == (same[:1] != 0)).all(), "one dropout mask across all chunks"
    equal = vmap(f, randomness="same", chunk_size=5)(X[:1].expand(B, 5))
    assert (equal == equal[0]).all()
    diff = vmap(f, randomness="different", chunk_size=5)(X[:1].expand(B, 5))
    assert not (diff[:5] == diff[5:10]).all(), "chunks draw independently"


def test_dropout_gradients():
    x = X.clone().requires_grad_()
    for mode in ("different", "same"):
        y = vmap(lambda a: F.dropout(a, 0.25, training=True), randomness=mode)(x)
        (g,) = torch.autograd.grad(y.sum(), x)
        torch.testing.assert_close(g, (y != 0).float() / 0.75)
    g = vmap(functrans.grad(lambda a: F.dropout(a, 0.5, training=True).sum()),
             randomness="different")(X)
    assert set(g.unique().tolist()) == {0.0, 2.0} and not (g == g[0]).all()


def test_rrelu_and_normal_gradients():
    x = (X - 0.5).clone().requires_grad_()
    y = vmap(lambda a: F.rrelu(a, training=True), randomness="same")(x)
    (g,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(g, torch.where(x > 0, 1.0, y / x).detach())
    m, s = X.clone().requires_grad_(), (X + 1).requires_grad_()
    for mode in ("different", "same"):
        n = vmap(torch.normal, randomness=mode)(m, s)
        gm, gs = torch.autograd.grad(n.sum(), (m, s))
        # as torch.normal's own: it is not reparameterised
        assert not gm.any() and not gs.any()
    p = X.clone().requires_grad_()
    for mode in ("different", "same"):
        (gp,) = torch.autograd.grad(vmap(torch.bernoulli, randomness=mode)(p).sum(), p)
        assert not gp.any()


def test_attention_without_dropout_is_not_random():
    q = torch.randn(4, 2, 3, 8)
    out = vmap(lambda a: F.scaled_dot_product_attention(a, a, a))(q)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, q, q))
