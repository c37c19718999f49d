"""BatchedTensor metadata, levels and the dispatcher's lookup order."""
import torch

from functrans import _levels, vmap
from functrans.batching import registry
from functrans.batching.batched_tensor import BatchedTensor


def test_logical_metadata_and_repr():
    seen = {}

    def f(a):
        seen["shape"], seen["stride"] = a.shape, a.stride()
        seen["dtype"], seen["device"] = a.dtype, a.device
        seen["type"], seen["repr"] = type(a), repr(a)
        seen["stack"] = list(_levels.stack())
        return a

    x = torch.randn(3, 4, 5).double()
    vmap(f, in_dims=1)(x)
    assert seen["shape"] == (3, 5) and seen["stride"] == (20, 1)
    assert seen["dtype"] == torch.float64 and seen["type"] is BatchedTensor
    assert "bdim=1" in seen["repr"] and "level=" in seen["repr"]
    assert len(seen["stack"]) == 1 and seen["stack"][0].batch_size == 4
    assert _levels.stack() == []


def test_levels_are_ordered_and_popped():
    ids = []
    vmap(lambda a: vmap(lambda b: ids.append([l.id for l in _levels.stack()]) or b)(a))(
        torch.randn(2, 3, 4))
    assert all(len(i) == 2 and i[0] < i[1] for i in ids)
    assert _levels.stack() == []


def test_level_popped_after_exception_in_user_code():
    def boom(a):
        raise KeyError("user bug")
    try:
        vmap(vmap(boom))(torch.randn(2, 3, 4))
    except KeyError:
        pass
    assert _levels.stack() == []


def test_pointwise_keeps_bdim_without_copy():
    seen = {}

    def f(a):
        out = a * 2
        seen["bdim"] = out.bdim
        return out

    vmap(f, in_dims=1)(torch.randn(3, 4))
    assert seen["bdim"] == 1


def test_lookup_order_prefers_overload_then_tag():
    how, rule = registry.find_rule(torch.ops.aten.sin.default)
    assert how == "tag" and rule is not None
    how, _ = registry.find_rule(torch.ops.aten.detach.default)
    assert how == "rule"
    how, _ = registry.find_rule(torch.ops.aten.reshape.default)
    assert how == "cia"


def test_registered_ops_listing():
    ops = registry.registered_ops()
    assert torch.ops.aten.detach.default in ops
    assert torch.ops.aten.detach.default in registry.registered_ops(family="autograd_ops")
    assert registry.family_of(torch.ops.aten.sin.default) == "pointwise"
