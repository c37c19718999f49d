"""A BatchedTensor that escaped its vmap, differentiated by PLAIN autograd afterwards.

Dispatch exempts dead vmap levels while the autograd engine runs a node (functrans's own
wrap/unwrap Functions re-wrap cotangents to a returned vmap's level in backward, which is
legitimate).  So a backward that STARTS at an escaped tensor computes: what it produces is a
BatchedTensor of the dead level (stored in ``w.grad`` or returned by ``autograd.grad``), never a
plain tensor with a wrong value, and every later use of it raises EscapedBatchedTensorError."""
import pytest
import torch

import functrans as ft
from functrans.errors import EscapedBatchedTensorError
from functrans.batching.batched_tensor import BatchedTensor

D = torch.float64


def _leak(w_shape=(3,)):
    w = torch.full(w_shape, 2.0, dtype=D, requires_grad=True)
    leaked = []

    def f(x):
        y = torch.sin(x * w)
        leaked.append(y)
        return y

    ft.vmap(f)(torch.randn(2, 3, dtype=D, generator=torch.Generator().manual_seed(0)))
    return w, leaked[0]


def test_ops_on_escaped_tensor_raise_before_backward():
    w, y = _leak()
    with pytest.raises(EscapedBatchedTensorError):
        y.sum().backward()
    with pytest.raises(EscapedBatchedTensorError):
        y * torch.ones(3, dtype=D, requires_grad=True)
    assert w.grad is None


@pytest.mark.parametrize("w_shape", [(3,), ()])
def test_backward_from_escaped_tensor_yields_no_plain_wrong_value(w_shape):
    w, y = _leak(w_shape)
    y.backward(torch.ones(3, dtype=D))       # computes: dead levels are exempt in the engine
    assert type(w.grad) is BatchedTensor and not w.grad.level.alive
    with pytest.raises(EscapedBatchedTensorError):
        w.grad + 1
    with pytest.raises(EscapedBatchedTensorError):
        torch.optim.SGD([w], lr=0.1).step()
    with pytest.raises(EscapedBatchedTensorError):
        torch.nn.utils.clip_grad_norm_([w], 1.0)

    w, y = _leak(w_shape)
    (g,) = torch.autograd.grad(y, w, torch.ones(3, dtype=D))
    assert type(g) is BatchedTensor and not g.level.alive
    with pytest.raises(EscapedBatchedTensorError):
        g.sum()


def test_backward_from_escaped_tensor_into_existing_grad_raises():
    w, y = _leak()
    w.grad = torch.zeros(3, dtype=D)
    with pytest.raises(Exception, match="batched value"):   # UnsupportedUnderVmap (in-place)
        y.backward(torch.ones(3, dtype=D))


@pytest.mark.xfail(strict=True, reason="LIMITATION: the backward pass itself does not refuse an "
                   "escaped BatchedTensor (only the later use of its result does)")
def test_backward_from_escaped_tensor_raises_at_once():
    w, y = _leak()
    with pytest.raises(EscapedBatchedTensorError):
        y.backward(torch.ones(3, dtype=D))


def test_backward_from_escaped_tensor_does_not_reach_vmap_inputs():
    """The vmap's input is differentiated through physical values (Note [autograd on physical
    values]), so a backward from the escaped wrapper never writes a plain value into X.grad."""
    X = torch.randn(2, 3, dtype=D, requires_grad=True)
    w = torch.full((3,), 2.0, dtype=D, requires_grad=True)
    leaked = []
    ft.vmap(lambda x: leaked.append(torch.sin(x * w)) or leaked[-1])(X)
    leaked[0].backward(torch.ones(3, dtype=D))
    assert X.grad is None
    assert type(w.grad) is BatchedTensor and not w.grad.level.alive
