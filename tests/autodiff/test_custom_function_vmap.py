"""autograd.Function under vmap: the user's vmap staticmethod, generate_vmap_rule, and the errors,
each checked against torch.func (and the loop oracle) on the same inputs."""
import numpy as np
import pytest
import torch
import torch.func as tf

import functrans as ft
from functrans.errors import UnsupportedUnderVmap
from tests.autodiff.test_custom_function_and_checkpoint import SinGenerated
from tests.support.oracles import assert_same, loop_oracle, make_batch

pytestmark = pytest.mark.usefixtures("float64")


def to_np(t):
    return t.detach().cpu().numpy()


class NumpySin(torch.autograd.Function):
    """NumPy forward; backward and jvp call NumpyCos, itself NumPy-backed with a vmap rule."""

    @staticmethod
    def forward(x):
        return torch.as_tensor(np.sin(to_np(x)), device=x.device)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])
        ctx.save_for_forward(inputs[0])

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * NumpyCos.apply(x)

    @staticmethod
    def jvp(ctx, t):
        (x,) = ctx.saved_tensors
        return t * NumpyCos.apply(x)

    @staticmethod
    def vmap(info, in_dims, x):
        return NumpySin.apply(x), in_dims[0]


class NumpyCos(torch.autograd.Function):
    @staticmethod
    def forward(x):
        return torch.as_tensor(np.cos(to_np(x)), device=x.device)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return -g * NumpySin.apply(x)

    @staticmethod
    def vmap(info, in_dims, x):
        return NumpyCos.apply(x), in_dims[0]


class NumpyCubeMul(torch.autograd.Function):
    """x ** 3 * y and 2 * y, computed by NumPy; the vmap rule moves batch dims to the END of
    the physical output (out_dim -1) and returns None for the second output when y is not
    batched."""

    @staticmethod
    def forward(x, y):
        xn, yn = to_np(x), to_np(y)
        return torch.as_tensor(xn ** 3 * yn), torch.as_tensor(2 * yn)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, g1, g2):
        x, y = ctx.saved_tensors
        gx = (3 * x ** 2 * y * g1).sum_to_size(x.shape) if ctx.needs_input_grad[0] else None
        gy = (x ** 3 * g1).sum_to_size(y.shape) + 2 * g2 if ctx.needs_input_grad[1] else None
        return gx, gy

    @staticmethod
    def vmap(info, in_dims, x, y):
        xd, yd = in_dims
        calls.append((info.batch_size, info.randomness, in_dims))
        x = x.movedim(xd, -1) if xd is not None else x.unsqueeze(-1).expand(
            *x.shape, info.batch_size)
        y_b = y.movedim(yd, -1) if yd is not None else y.unsqueeze(-1)
        out1, out2 = NumpyCubeMul.apply(x, y_b)
        if yd is None:
            return (out1, out2.squeeze(-1)), (-1, None)
        return (out1, out2), (-1, -1)


calls = []


def cube_mul_ref(x, y):
    return x ** 3 * y, 2 * y


class NoisyScale(torch.autograd.Function):
    """x * (1 + noise): the vmap rule draws one noise per example or one shared, by
    info.randomness, as a user rule would."""

    @staticmethod
    def forward(x):
        return x * (1 + torch.randn(x.shape, dtype=x.dtype))

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        raise AssertionError("not differentiated in these tests")

    @staticmethod
    def vmap(info, in_dims, x):
        calls.append((info.batch_size, info.randomness))
        x = x.movedim(in_dims[0], 0)
        if info.randomness == "different":
            noise = torch.randn(info.batch_size, *x.shape[1:], dtype=x.dtype)
        else:
            noise = torch.randn(x.shape[1:], dtype=x.dtype)
        return x * (1 + noise), 0


def test_numpy_function_under_vmap_matches_torch_func_and_the_loop():
    X = make_batch(torch.randn(3, 4), 1, 5)
    actual = ft.vmap(NumpySin.apply, in_dims=1)(X)
    assert_same(actual, tf.vmap(NumpySin.apply, in_dims=1)(X))
    assert_same(actual, loop_oracle(NumpySin.apply, [1], 5, X))
    assert_same(ft.vmap(NumpySin.apply, in_dims=1, out_dims=2)(X),
                tf.vmap(NumpySin.apply, in_dims=1, out_dims=2)(X))


@pytest.mark.parametrize("in_dims", [(0, 0), (1, None), (None, 0), (-1, 1)])
def test_in_dims_with_none_and_tuple_out_dims(in_dims):
    x, y = torch.randn(3, 2), torch.randn(3, 2)
    args = [a if d is None else make_batch(a, d, 4) for a, d in zip((x, y), in_dims)]
    calls.clear()
    actual = ft.vmap(NumpyCubeMul.apply, in_dims=in_dims)(*args)
    expected_dims = tuple(None if d is None else d % 3 for d in in_dims)
    assert calls[0] == (4, "error", expected_dims)
    assert_same(actual, tf.vmap(NumpyCubeMul.apply, in_dims=in_dims)(*args))
    assert_same(actual, loop_oracle(cube_mul_ref, in_dims, 4, *args))
    if in_dims[1] is None:
        # the rule's out_dim None: the second output is the same for every example
        assert_same(ft.vmap(NumpyCubeMul.apply, in_dims=in_dims, out_dims=(0, None))(*args)[1],
                    2 * y)


@pytest.mark.parametrize("randomness", ["different", "same"])
def test_info_batch_size_and_randomness(randomness):
    X = torch.randn(6, 3)
    calls.clear()
    torch.manual_seed(0)
    actual = ft.vmap(NoisyScale.apply, randomness=randomness)(X)
    assert calls == [(6, randomness)]
    torch.manual_seed(0)
    expected = tf.vmap(NoisyScale.apply, randomness=randomness)(X)
    assert_same(actual, expected)
    ratio = actual / X
    assert torch.allclose(ratio[0], ratio[1]) == (randomness == "same")


def test_nested_vmap_through_the_vmap_staticmethod():
    X = torch.randn(4, 3, 2)
    for f in (NumpySin.apply, SinGenerated.apply):
        actual = ft.vmap(ft.vmap(f, in_dims=1), in_dims=2)(X)
        assert_same(actual, tf.vmap(tf.vmap(f, in_dims=1), in_dims=2)(X))
        assert_same(actual, X.sin().permute(2, 1, 0))
    x, y = torch.randn(3, 2), torch.randn(3, 2)
    Xb, Yb = make_batch(make_batch(x, 0, 4), 1, 3), make_batch(y, 0, 3)
    inner = lambda a, b: ft.vmap(NumpyCubeMul.apply, in_dims=(0, None))(a, b)
    inner_ref = lambda a, b: tf.vmap(NumpyCubeMul.apply, in_dims=(0, None))(a, b)
    assert_same(ft.vmap(inner, in_dims=(1, 0))(Xb, Yb), tf.vmap(inner_ref, in_dims=(1, 0))(Xb, Yb))


@pytest.mark.parametrize("f", [NumpySin.apply, SinGenerated.apply], ids=["vmap_rule", "generated"])
def test_vmap_of_grad_jvp_jacrev_jacfwd(f):
    X, T = torch.randn(5, 3), torch.randn(5, 3)
    loss = lambda a: f(a).sum()
    assert_same(ft.vmap(ft.grad(loss))(X), tf.vmap(tf.grad(loss))(X))
    assert_same(ft.vmap(ft.jacrev(f))(X), tf.vmap(tf.jacrev(f))(X))
    if f is NumpySin.apply:  # SinGenerated has no jvp staticmethod (torch.func refuses)
        assert_same(ft.vmap(lambda a, t: ft.jvp(f, (a,), (t,)))(X, T),
                    tf.vmap(lambda a, t: tf.jvp(f, (a,), (t,)))(X, T))
        assert_same(ft.vmap(ft.jacfwd(f))(X), tf.vmap(tf.jacfwd(f))(X))
    assert_same(ft.vmap(ft.grad(ft.grad(lambda a: f(a).sum())))(X[:, 0]), -X[:, 0].sin())


def test_transforms_around_the_vmap_staticmethod():
    X = torch.randn(5, 3)
    f = NumpySin.apply
    assert_same(ft.grad(lambda a: ft.vmap(f)(a).sum())(X),
                tf.grad(lambda a: tf.vmap(f)(a).sum())(X))
    assert_same(ft.jacrev(ft.vmap(f))(X[0]), tf.jacrev(tf.vmap(f))(X[0]))
    assert_same(ft.jacfwd(ft.vmap(f))(X[0]), tf.jacfwd(tf.vmap(f))(X[0]))
    assert_same(ft.jacrev(f)(X[0]), tf.jacrev(f)(X[0]))
    x, y = torch.randn(3, 2), torch.randn(3, 2)
    Xb = make_batch(x, 0, 4)
    g = lambda a, b: ft.vmap(NumpyCubeMul.apply, in_dims=(0, None))(a, b)[0].sum()
    g_ref = lambda a, b: tf.vmap(NumpyCubeMul.apply, in_dims=(0, None))(a, b)[0].sum()
    assert_same(ft.grad(g, argnums=(0, 1))(Xb, y), tf.grad(g_ref, argnums=(0, 1))(Xb, y))


def test_vmap_of_grad_with_an_unbatched_argument():
    x, y = torch.randn(3, 2), torch.randn(3, 2)
    Yb = make_batch(y, 0, 4)
    loss = lambda a, b: NumpyCubeMul.apply(a, b)[0].sum() + NumpyCubeMul.apply(a, b)[1].sum()
    for argnums in ((0, 1), 0, 1):  # the backward reads ctx.needs_input_grad
        assert_same(ft.vmap(ft.grad(loss, argnums=argnums), in_dims=(None, 0))(x, Yb),
                    tf.vmap(tf.grad(loss, argnums=argnums), in_dims=(None, 0))(x, Yb))


class NoRule(torch.autograd.Function):
    @staticmethod
    def forward(x):
        return x * 2

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return 2 * g


class BothRules(SinGenerated):
    @staticmethod
    def vmap(info, in_dims, x):
        return x.sin(), in_dims[0]


class BadReturn(NoRule):
    @staticmethod
    def vmap(info, in_dims, x):
        return x * 2


class BadOutDims(NoRule):
    @staticmethod
    def vmap(info, in_dims, x):
        return x * 2, (0, 0)


class OldStyle(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.exp() * 2

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * x.exp() * 2


def test_clear_errors_where_torch_func_raises():
    X = torch.randn(4, 3)
    with pytest.raises(UnsupportedUnderVmap,
                       match="NoRule has no vmap support.*generate_vmap_rule"):
        ft.vmap(NoRule.apply)(X)
    with pytest.raises(RuntimeError, match="does not have vmap support"):
        tf.vmap(NoRule.apply)(X)
    with pytest.raises(UnsupportedUnderVmap, match="both generate_vmap_rule=True and its own"):
        ft.vmap(BothRules.apply)(X)
    with pytest.raises(RuntimeError, match="both generate_vmap_rule=True"):
        tf.vmap(BothRules.apply)(X)
    with pytest.raises(UnsupportedUnderVmap, match=r"must return a tuple \(output, out_dims\)"):
        ft.vmap(BadReturn.apply)(X)
    with pytest.raises(UnsupportedUnderVmap, match=r"out_dims=\(0, 0\), which does not match"):
        ft.vmap(BadOutDims.apply)(X)
    # outside vmap, and on unbatched tensors inside one, a Function runs as in PyTorch
    assert_same(NoRule.apply(X), X * 2)
    assert_same(ft.vmap(lambda a: a + NoRule.apply(X[0]))(X), X + X[0] * 2)


def test_old_style_function_keeps_working_under_vmap():
    X = torch.randn(4, 3)
    assert_same(ft.vmap(OldStyle.apply)(X), X.exp() * 2)
    assert_same(ft.vmap(ft.grad(lambda a: OldStyle.apply(a).sum()))(X), X.exp() * 2)
    with pytest.raises(RuntimeError, match="setup_context"):  # torch.func refuses it
        tf.vmap(OldStyle.apply)(X)


class WeightedSumGenerated(torch.autograd.Function):
    """Two outputs, one of them independent of w; setup_context stores a shape (which must be
    the per-example shape under vmap) and backward expands to it."""
    generate_vmap_rule = True

    @staticmethod
    def forward(x, w):
        return (x * w).sum(0), x.sum()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)
        ctx.x_shape = inputs[0].shape

    @staticmethod
    def backward(ctx, g, g2):
        x, w = ctx.saved_tensors
        return g.expand(ctx.x_shape) * w + g2, g * x


@pytest.mark.parametrize("in_dims", [(0, None), (1, 0), (None, 0)])
@pytest.mark.parametrize("k", [0, 1])
def test_grad_of_vmap_through_generate_vmap_rule(in_dims, k):
    x, w = torch.randn(5, 3), torch.randn(3)
    X, Wb = [a if d is None else make_batch(a, d, 4) for a, d in zip((x, w), in_dims)]
    f = WeightedSumGenerated.apply
    assert_same(ft.vmap(f, in_dims=in_dims)(X, Wb), tf.vmap(f, in_dims=in_dims)(X, Wb))
    loss = lambda a, b: ft.vmap(f, in_dims=in_dims)(a, b)[k].pow(2).sum()
    loss_ref = lambda a, b: tf.vmap(f, in_dims=in_dims)(a, b)[k].pow(2).sum()
    assert_same(ft.grad(loss, argnums=(0, 1))(X, Wb), tf.grad(loss_ref, argnums=(0, 1))(X, Wb))


def test_transforms_around_generate_vmap_rule():
    X = torch.randn(5, 3)
    f = SinGenerated.apply
    assert_same(ft.grad(lambda a: ft.vmap(f)(a).sum())(X),
                tf.grad(lambda a: tf.vmap(f)(a).sum())(X))
    assert_same(ft.jacrev(ft.vmap(f))(X[:2]), tf.jacrev(tf.vmap(f))(X[:2]))
    assert_same(ft.grad(lambda a: ft.vmap(ft.vmap(f))(a).sum())(X),
                tf.grad(lambda a: tf.vmap(tf.vmap(f))(a).sum())(X))
    X3 = X.reshape(5, 3, 1)
    assert_same(ft.vmap(ft.grad(lambda a: ft.vmap(f)(a).sum()))(X3),
                tf.vmap(tf.grad(lambda a: tf.vmap(f)(a).sum()))(X3))
    inner = lambda a: ft.vmap(ft.grad(lambda b: f(b).sum()))(a).sum()
    inner_ref = lambda a: tf.vmap(tf.grad(lambda b: f(b).sum()))(a).sum()
    assert_same(ft.grad(inner)(X), tf.grad(inner_ref)(X))
    # torch.func's hessian of this fails inside its vmapified jvp; analytic reference
    assert_same(ft.hessian(lambda a: ft.vmap(f)(a).sum())(X[:2]),
                torch.diag(-X[:2].sin().flatten()).reshape(2, 3, 2, 3))


def test_grad_of_vmap_through_an_unbatched_output_of_the_vmap_staticmethod():
    x, y = torch.randn(3, 2), torch.randn(3, 2)
    Xb = make_batch(x, 0, 4)
    g = lambda a, b: ft.vmap(NumpyCubeMul.apply, in_dims=(0, None))(a, b)[1].pow(2).sum()
    g_ref = lambda a, b: tf.vmap(NumpyCubeMul.apply, in_dims=(0, None))(a, b)[1].pow(2).sum()
    assert_same(ft.grad(g, argnums=1)(Xb, y), tf.grad(g_ref, argnums=1)(Xb, y))
    assert_same(ft.grad(g, argnums=1)(Xb, y), 4 * 4 * 2 * y)


def test_old_style_function_under_a_transform_outside_the_vmap_is_refused_clearly():
    X = torch.randn(4, 3)
    with pytest.raises(UnsupportedUnderVmap, match="vmap staticmethod or generate_vmap_rule"):
        ft.grad(lambda a: ft.vmap(OldStyle.apply)(a).sum())(X)
    # the new-style equivalent is differentiated from outside the vmap
    assert_same(ft.grad(lambda a: ft.vmap(NumpySin.apply)(a).sum())(X), X.cos())
