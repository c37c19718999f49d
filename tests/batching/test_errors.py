"""Every user error under vmap: its type, that it names what happened and what to do, and
that the level stack is empty afterwards (the conftest fixture checks that after each test)."""
import re

import pytest
import torch

import functrans
from functrans import vmap
from functrans.errors import (EscapedBatchedTensorError, TransformArgumentError,
                              UnsupportedUnderVmap)


def raises(exc, pattern, fn):
    with pytest.raises(exc) as info:
        fn()
    assert re.search(pattern, str(info.value), re.S), str(info.value)
    return info.value


x = torch.randn(4, 3)


def test_item_and_bool_and_control_flow():
    raises(UnsupportedUnderVmap, r"\.item\(\).*torch\.where", lambda: vmap(lambda a: a.sum().item())(x))
    # examples whose sums have both signs (a branch they all take the same way is answered:
    # Note [a branch every example takes the same way]); a random x was flaky here
    mixed = torch.tensor([[1., 2., 3.], [0., 1., 1.], [-1., 0., 2.], [2., 2., 2.]])
    raises(UnsupportedUnderVmap, r"_local_scalar_dense.*torch\.where",
           lambda: vmap(lambda a: a if a.sum() > 1 else -a)(mixed))
    raises(UnsupportedUnderVmap, "disagree.*torch.where",
           lambda: vmap(lambda a: a * 2 if a[0] else a)(mixed))


@pytest.mark.parametrize("f", [lambda a: a.nonzero(), lambda a: a[a > 0],
                               lambda a: torch.masked_select(a, a > 0),
                               lambda a: torch.unique(a)])
def test_dynamic_shape_ops(f):
    # examples whose results have different shapes (same-shape results are stacked: see
    # tests/batching/test_data_dependent_parity.py)
    ragged = torch.tensor([[1., -2., 3.], [4., 5., 6.], [-1., -1., 2.], [0., 1., 1.]])
    raises(UnsupportedUnderVmap, r"shape depends on the values.*torch\.where",
           lambda: vmap(f)(ragged))


def test_inplace_into_unbatched_tensor():
    def f(a):
        buf = torch.zeros(3)
        buf.add_(a)
        return buf
    raises(UnsupportedUnderVmap, r"add_.*not batched.*zeros_like", lambda: vmap(f)(x))

    def g(a):
        buf = torch.zeros(3)
        buf.copy_(a)
        return buf
    raises(UnsupportedUnderVmap, r"copy_.*zeros_like", lambda: vmap(g)(x))


def test_mismatched_batch_sizes_name_every_argument():
    err = raises(TransformArgumentError, r"disagree on batch size",
                 lambda: vmap(lambda a, d: a + d["w"], in_dims=(0, {"w": 1}))(
                     x, {"w": torch.randn(3, 5)}))
    msg = str(err)
    assert "args[0] (in_dim=0): size 4" in msg
    assert "args[1]['w'] (in_dim=1): size 5" in msg


def test_in_dims_errors():
    raises(TransformArgumentError, r"out of range.*args\[0\].*\[-2, 1\]",
           lambda: vmap(torch.sin, in_dims=2)(x))
    raises(TransformArgumentError, r"in_dims has 2 entries.*1 positional",
           lambda: vmap(torch.sin, in_dims=(0, 0))(x))
    raises(TransformArgumentError, r"in_dims\[0\].*does not match the structure",
           lambda: vmap(lambda t: t[0], in_dims=((0, 0, 0),))((x, x)))
    raises(TransformArgumentError, r"args\[1\].*int, not a tensor.*None",
           lambda: vmap(lambda a, n: a * n, in_dims=(0, 0))(x, 3))
    raises(TransformArgumentError, r"no input is mapped", lambda: vmap(torch.sin, in_dims=None)(x))
    raises(TransformArgumentError, r"in_dims must be an int, None.*'a'",
           lambda: vmap(torch.sin, in_dims="a"))
    raises(TransformArgumentError, r"0-d tensor cannot be mapped",
           lambda: vmap(torch.sin)(torch.tensor(1.0)))


def test_out_dims_errors():
    raises(TransformArgumentError, r"out_dims=\(0, 0\) does not match the structure",
           lambda: vmap(lambda a: a, out_dims=(0, 0))(x))
    raises(TransformArgumentError, r"out_dim=5 is out of range",
           lambda: vmap(lambda a: a, out_dims=5)(x))
    raises(TransformArgumentError, r"out_dim is None for output.*depends on the mapped",
           lambda: vmap(lambda a: a, out_dims=None)(x))
    raises(TransformArgumentError, r"returned a int at output\[1\].*out_dim to None",
           lambda: vmap(lambda a: (a, 3))(x))


def test_other_argument_errors():
    raises(TransformArgumentError, "randomness must be one of", lambda: vmap(torch.sin, randomness="x"))
    raises(TransformArgumentError, "chunk_size must be None, a positive int or 'auto'",
           lambda: vmap(torch.sin, chunk_size=0))


def test_escaped_batched_tensor_raises():
    leaked = []
    vmap(lambda a: leaked.append(a * 2) or a)(x)
    raises(EscapedBatchedTensorError, r"already returned.*escaped", lambda: leaked[0] + 1)
    raises(EscapedBatchedTensorError, r"escaped", lambda: leaked[0].sum())


def test_random_op_under_randomness_error():
    raises(UnsupportedUnderVmap, r"randomness='error'.*'different'.*'same'",
           lambda: vmap(lambda a: a + torch.randn(3))(x))
    raises(UnsupportedUnderVmap, r"randomness", lambda: vmap(lambda a: torch.rand_like(a))(x))


def test_tolist_and_numpy():
    raises(UnsupportedUnderVmap, r"\.tolist\(\).*outside vmap", lambda: vmap(lambda a: a.tolist())(x))
    raises(UnsupportedUnderVmap, r"\.numpy\(\).*outside vmap", lambda: vmap(lambda a: a.numpy())(x))


def test_inplace_metadata_change_works():
    def f(a):
        a.unsqueeze_(0)
        a.transpose_(0, 1)
        a.squeeze_()
        return a
    torch.testing.assert_close(vmap(f)(x.clone()), x)
    # as_strided_ that keeps the values (same shape and strides) is eager's no-op; one that
    # changes which elements an example holds has no batched form and is refused
    torch.testing.assert_close(vmap(lambda a: a.as_strided_((3,), (1,)))(x.clone()), x)
    raises(UnsupportedUnderVmap, r"as_strided_.*",
           lambda: vmap(lambda a: a.as_strided_((2,), (2,)))(x.clone()))


def test_next_call_works_after_an_error():
    with pytest.raises(UnsupportedUnderVmap):
        vmap(lambda a: a.sum().item())(x)
    assert functrans._levels.stack() == []
    torch.testing.assert_close(vmap(torch.sin)(x), x.sin())


def test_user_errors_keep_their_type_and_say_where():
    with pytest.raises(RuntimeError) as info:
        vmap(lambda a: a + torch.ones(5))(x)
    assert "must match the size" in str(info.value)  # eager's own message, type kept
    assert "functrans: while batching aten.add.Tensor" in "".join(info.value.__notes__)
