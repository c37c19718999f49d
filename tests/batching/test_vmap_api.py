"""vmap's API against torch.vmap on the same inputs: in_dims/out_dims pytrees, kwargs,
unbatched outputs, nesting, chunk_size."""
from collections import namedtuple

import pytest
import torch
import torch.utils._pytree as pytree

import functrans
from functrans import vmap
from tests.support.oracles import assert_same


def both(f, *args, **vmap_kwargs):
    ours = vmap(f, **vmap_kwargs)(*args)
    ref = torch.vmap(f, **vmap_kwargs)(*args)
    assert_same(ours, ref)
    return ours


def test_int_negative_and_none_in_dims():
    x, y = torch.randn(4, 3), torch.randn(3, 4)
    both(torch.add, x, y, in_dims=(0, 1))
    both(torch.add, x, y, in_dims=(-2, -1))
    both(torch.mul, x, torch.randn(3), in_dims=(0, None))


def test_in_dims_nested_pytrees():
    x, y, z = torch.randn(5, 3), torch.randn(3, 5), torch.randn(3)
    f = lambda d, t: d["a"] * t[0] + d["b"] - t[1]
    both(f, {"a": x, "b": y}, (z, x), in_dims=({"a": 0, "b": 1}, (None, 0)))
    both(f, {"a": x, "b": x}, [z, x], in_dims=(0, [None, 0]))


def test_in_dims_dict_key_order_does_not_matter():
    # torch.vmap pairs dict in_dims with the argument by position, not by key, and returns a
    # transposed result here; functrans matches keys (the loop oracle is the reference).
    x, y = torch.randn(5, 3), torch.randn(3, 5)
    f = lambda d: d["a"] + d["b"]
    got = vmap(f, in_dims=({"b": 1, "a": 0},))({"a": x, "b": y})
    assert_same(got, x + y.T)


def test_namedtuple_and_registered_custom_node():
    Pair = namedtuple("Pair", "u v")
    x = torch.randn(4, 2)
    both(lambda p: p.u * p.v, Pair(x, x + 1), in_dims=(Pair(0, 0),))

    class Box:
        def __init__(self, a, b):
            self.a, self.b = a, b

    pytree.register_pytree_node(Box, lambda b: ([b.a, b.b], None), lambda c, _: Box(*c))
    try:
        out = vmap(lambda b: b.a - b.b, in_dims=(Box(0, None),))(Box(x, x[0]))
        assert_same(out, x - x[0])
    finally:
        pytree._deregister_pytree_node(Box) if hasattr(pytree, "_deregister_pytree_node") \
            else None


def test_kwargs_are_not_mapped():
    x, w = torch.randn(4, 3), torch.randn(3)
    f = lambda a, *, scale: a * scale
    assert_same(vmap(f)(x, scale=w), torch.vmap(f)(x, scale=w))


def test_out_dims_int_none_and_pytree():
    x = torch.randn(4, 3)
    both(lambda a: a * 2, x, out_dims=1)
    both(lambda a: a * 2, x, out_dims=-1)
    both(lambda a: (a * 2, a.sum(0, keepdim=True)), x, out_dims=(1, 0))
    w = torch.randn(3)
    both(lambda a: (a + 1, w), x, out_dims=(0, None))


def test_unbatched_output_is_expanded():
    x, w = torch.randn(4, 3), torch.randn(2)
    both(lambda a: w, x)
    # torch.vmap fails to expand an unbatched output along out_dim=1; functrans expands it.
    a, b = vmap(lambda a: (a, w * 2), out_dims=(0, 1))(x)
    assert_same(b, (w * 2).unsqueeze(1).expand(2, 4))


def test_non_tensor_output_with_out_dim_none():
    x = torch.randn(4, 3)
    assert vmap(lambda a: (a, 7), out_dims=(0, None))(x)[1] == 7


def test_nested_vmap_with_different_in_dims():
    x, y = torch.randn(2, 3, 5), torch.randn(5, 3)
    f = lambda a, b: a * b
    inner = lambda a, b: vmap(f, in_dims=(1, None))(a, b)
    ours = vmap(inner, in_dims=(0, None))(x, y[0])
    ref = torch.vmap(lambda a, b: torch.vmap(f, in_dims=(1, None))(a, b),
                     in_dims=(0, None))(x, y[0])
    assert_same(ours, ref)
    ours = vmap(vmap(f, in_dims=(1, 0)), in_dims=(2, 0))(x, y)
    ref = torch.vmap(torch.vmap(f, in_dims=(1, 0)), in_dims=(2, 0))(x, y)
    assert_same(ours, ref)


def test_triple_nesting():
    x = torch.randn(2, 3, 4, 5)
    f = lambda a: a.sin() * a
    assert_same(vmap(vmap(vmap(f)))(x), f(x))
    assert_same(vmap(vmap(vmap(f), in_dims=1), in_dims=3)(x),
                torch.vmap(torch.vmap(torch.vmap(f), in_dims=1), in_dims=3)(x))


@pytest.mark.parametrize("chunk_size", [1, 2, 3, 7, 100])
def test_chunk_size_gives_the_same_result(chunk_size):
    x, y = torch.randn(7, 3), torch.randn(3, 7)
    f = lambda a, b: (a * b, a - 1)
    expected = vmap(f, in_dims=(0, 1), out_dims=(1, 0))(x, y)
    got = vmap(f, in_dims=(0, 1), out_dims=(1, 0), chunk_size=chunk_size)(x, y)
    assert_same(got, expected)
    assert_same(got, torch.vmap(f, in_dims=(0, 1), out_dims=(1, 0), chunk_size=chunk_size)(x, y))


def test_batch_size_one_and_zero():
    x = torch.randn(1, 3)
    both(lambda a: a * 2 + 1, x)
    empty = torch.randn(0, 3)
    assert vmap(lambda a: a * 2 + 1)(empty).shape == (0, 3)


def test_inplace_on_batched_input_writes_through():
    x = torch.randn(4, 3)
    ref = x.clone()
    vmap(lambda a: a.mul_(2))(x)
    assert_same(x, ref * 2)


def test_grad_through_vmap():
    x = torch.randn(4, 3, requires_grad=True)
    w = torch.randn(3)
    out = vmap(lambda a: (a * w).sin())(x)
    g, = torch.autograd.grad(out.sum(), x)
    assert_same(g, (x * w).cos().detach() * w)


def test_forward_mode_through_vmap():
    import torch.autograd.forward_ad as fwAD
    x, t = torch.randn(4, 3), torch.randn(4, 3)
    primal, tangent = functrans.jvp(vmap(lambda a: a.sin() * 2), (x,), (t,))
    assert_same(primal, x.sin() * 2)
    assert_same(tangent, x.cos() * 2 * t)
    # A raw dual level around vmap cannot propagate closure tangents: refused with a pointer.
    with fwAD.dual_level():
        with pytest.raises(functrans.UnsupportedUnderVmap, match="functrans.jvp"):
            vmap(lambda a: a.sin())(fwAD.make_dual(x, t))


def test_public_signature_matches_torch_func():
    import inspect
    assert list(inspect.signature(functrans.vmap).parameters) == \
        list(inspect.signature(torch.func.vmap).parameters)


def test_on_every_device(device):
    """The engine on each available device (CUDA skips cleanly without a GPU)."""
    x = torch.randn(5, 3, 4, device=device)
    w = torch.randn(4, 2, device=device)
    f = lambda a: torch.softmax(a @ w, -1).sum(0) + a.mean()
    with functrans.config.strict_fallback():
        assert_same(vmap(f)(x), torch.vmap(f)(x))
        assert_same(vmap(vmap(f), in_dims=1)(x.unsqueeze(0).expand(2, 5, 3, 4).transpose(0, 1)),
                    torch.vmap(torch.vmap(f), in_dims=1)(
                        x.unsqueeze(0).expand(2, 5, 3, 4).transpose(0, 1)))
    out = vmap(lambda a: torch.rand_like(a), randomness="different")(x)
    assert out.device == x.device
