"""functional_call, stack_module_state, Ensemble and replace_all_batch_norm_modules_ against
torch.func's (same inputs, same answers, same errors where torch.func has them)."""
import pytest
import torch
import torch.func as tf
from torch import nn

import functrans as ft
from tests.support.oracles import assert_same


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 3)
        self.b.weight = self.a.weight          # tied
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, x, shift=0.0):
        return self.b(self.a(x)) * self.scale + shift


def _state(m):
    return {k: v.detach().clone() for k, v in m.named_parameters()}, \
        {k: v.clone() for k, v in m.named_buffers()}


def test_matches_torch_func_with_one_or_two_dicts_args_and_kwargs():
    torch.manual_seed(0)
    m = Tied()
    p, b = _state(m)
    p = {k: v + 1 for k, v in p.items()}
    x = torch.randn(4, 3)
    for dicts in ((p, b), [p, b], {**p, **b}):
        assert_same(ft.functional_call(m, dicts, (x,), {"shift": 1.5}),
                    tf.functional_call(m, dicts, (x,), {"shift": 1.5}))
    assert_same(ft.functional_call(m, p, x), tf.functional_call(m, p, x))  # a bare argument
    assert_same(m(x), Tied.forward(m, x))  # the module is restored
    assert m.a.weight is m.b.weight and isinstance(m.a.weight, nn.Parameter)


def test_tied_weights():
    m = Tied()
    x = torch.randn(2, 3)
    w = torch.randn(3, 3)
    for tie in (True, False):
        assert_same(ft.functional_call(m, {"a.weight": w}, x, tie_weights=tie),
                    tf.functional_call(m, {"a.weight": w}, x, tie_weights=tie))
    with pytest.raises(ValueError, match="tied"):
        ft.functional_call(m, {"a.weight": w, "b.weight": w + 1}, x)
    ft.functional_call(m, {"a.weight": w, "b.weight": w + 1}, x, tie_weights=False)


def test_errors_name_the_keys():
    m = Tied()
    p, b = _state(m)
    with pytest.raises(ValueError, match=r"a\.bias.*more than one"):
        ft.functional_call(m, (p, {"a.bias": p["a.bias"]}), torch.randn(3))
    with pytest.raises(ValueError, match=r"missing key\(s\): \['scale'\]"):
        ft.functional_call(m, p, torch.randn(3), strict=True)
    with pytest.raises(ValueError, match=r"unexpected key\(s\): \['nope'\]"):
        ft.functional_call(m, {**p, **b, "nope": torch.ones(1)}, torch.randn(3), strict=True)
    ft.functional_call(m, {**p, **b}, torch.randn(3), strict=True)
    with pytest.raises(ValueError, match="must be a tensor"):
        ft.functional_call(m, {"a.bias": 3.0}, torch.randn(3))
    with pytest.raises(ValueError, match="not a submodule"):
        ft.functional_call(m, {"zz.weight": torch.ones(1)}, torch.randn(3))


def test_restores_the_module_after_an_exception():
    m = Tied()
    before = dict(m.named_parameters())
    with pytest.raises(RuntimeError):
        ft.functional_call(m, {"a.weight": torch.randn(5, 5)}, torch.randn(3))
    assert dict(m.named_parameters()) == before


def test_per_sample_grads_and_buffers_updated_in_place():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 1)).eval()
    p, b = _state(m)
    xs, ys = torch.randn(6, 3), torch.randn(6, 1)
    loss = lambda p, x, y: ((ft.functional_call(m, (p, b), x[None]) - y) ** 2).sum()
    ref_loss = lambda p, x, y: ((tf.functional_call(m, (p, b), x[None]) - y) ** 2).sum()
    with ft.config.strict_fallback():
        got = ft.vmap(ft.grad(loss), in_dims=(None, 0, 0))(p, xs, ys)
    assert_same(got, tf.vmap(tf.grad(ref_loss), in_dims=(None, 0, 0))(p, xs, ys))
    m.train()
    mean0 = b["1.running_mean"].clone()
    ft.functional_call(m, (p, b), torch.randn(5, 3))
    assert not torch.equal(b["1.running_mean"], mean0)   # the passed buffer was updated


def test_stack_module_state_matches_torch_func_and_is_optimizable():
    models = [nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)) for _ in range(3)]
    params, buffers = ft.stack_module_state(models)
    ref_p, ref_b = tf.stack_module_state(models)
    assert_same(params, ref_p)
    assert_same(buffers, ref_b)
    assert all(p.is_leaf and p.requires_grad for p in params.values())
    assert not any(b.requires_grad for b in buffers.values())
    torch.optim.SGD(params.values(), lr=0.1)  # leaves an optimizer accepts


def test_stack_module_state_errors():
    with pytest.raises(ValueError, match="at least one model"):
        ft.stack_module_state([])
    with pytest.raises(ValueError, match="one class"):
        ft.stack_module_state([nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2))])
    with pytest.raises(ValueError, match="training mode and some in eval"):
        ft.stack_module_state([nn.Linear(2, 2), nn.Linear(2, 2).eval()])
    with pytest.raises(ValueError, match=r"'weight' has different shapes"):
        ft.stack_module_state([nn.Linear(2, 2), nn.Linear(2, 3)])
    frozen = nn.Linear(2, 2)
    frozen.weight.requires_grad_(False)
    with pytest.raises(ValueError, match="requires grad in some models"):
        ft.stack_module_state([nn.Linear(2, 2), frozen])


def test_ensemble_shared_and_per_member_minibatches_and_a_training_step():
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 2)) for _ in range(4)]
    ens = ft.Ensemble(models)
    x, xs = torch.randn(5, 3), torch.randn(4, 5, 3)
    with ft.config.strict_fallback():
        assert_same(ens(x), torch.stack([m(x) for m in models]), rtol=1e-5, atol=1e-6)
        assert_same(ens(xs, shared=False), torch.stack([m(a) for m, a in zip(models, xs)]),
                    rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="number of members"):
        ens(torch.randn(3, 5, 3), shared=False)
    # one optimizer step on the stacked leaves == a step per model
    opt = torch.optim.SGD(ens.parameters(), lr=0.1, momentum=0.9)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
    for _ in range(2):
        opt.zero_grad()
        ens(x).pow(2).sum().backward()
        opt.step()
        for m, o in zip(models, opts):
            o.zero_grad()
            m(x).pow(2).sum().backward()
            o.step()
    for i, m in enumerate(ens.members()):
        assert_same(dict(m.named_parameters()), dict(models[i].named_parameters()),
                    rtol=1e-5, atol=1e-6)


def test_ensemble_of_members_without_parameters():
    """An Ensemble of nn.ReLU() members raised "no input is mapped"; it runs now, as the loop
    over members does, and as torch.func's stack_module_state + vmap does for buffer-only
    members (with no state at all torch.func has nothing to map and refuses)."""
    x, xs = torch.randn(5, 3), torch.randn(4, 5, 3)
    relus = [nn.ReLU() for _ in range(4)]
    with ft.config.strict_fallback():
        ens = ft.Ensemble(relus)
        assert_same(ens(x), torch.stack([m(x) for m in relus]))
        assert_same(ens(xs, shared=False), torch.stack([m(a) for m, a in zip(relus, xs)]))
        assert_same(ft.Ensemble(relus, chunk_size=3)(x), torch.stack([m(x) for m in relus]))
        assert len(ens.members()) == 4
    with pytest.raises(ValueError, match="Expected at least one Tensor"):
        p, b = tf.stack_module_state(relus)
        tf.vmap(lambda p, b, a: tf.functional_call(relus[0], (p, b), (a,)),
                in_dims=(0, 0, None))(p, b, x)
    # buffers only (BatchNorm without affine, training): as torch.func, and as the loop
    norms = [nn.BatchNorm1d(3, affine=False) for _ in range(4)]
    p, b = tf.stack_module_state(norms)
    ref = tf.vmap(lambda p, b, a: tf.functional_call(norms[0], (p, b), (a,)),
                  in_dims=(0, 0, None))(p, b, x)
    with ft.config.strict_fallback():
        assert_same(ft.Ensemble(norms)(x), ref)
    assert_same(ref, torch.stack([m(x) for m in norms]))
    # random members: one draw per member with randomness='different', one for all with 'same'
    drop = [nn.Dropout(0.5) for _ in range(4)]
    ones = torch.ones(50)
    out = ft.Ensemble(drop, randomness="different")(ones)
    assert out.shape == (4, 50) and not torch.equal(out[0], out[1])
    assert set(out.unique().tolist()) <= {0.0, 2.0}
    out = ft.Ensemble(drop, randomness="same")(ones)
    assert all(torch.equal(out[0], o) for o in out)
    with pytest.raises(RuntimeError, match="randomness='error'"):
        ft.Ensemble(drop)(ones)


def test_batch_norm_under_vmap_options():
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)) for _ in range(3)]
    x = torch.randn(6, 3)
    # stacked running stats: each member's stats are updated, as a loop over the models does
    ens = ft.Ensemble(models)
    out = ens(x)
    ref = torch.stack([m(x) for m in models])
    assert_same(out, ref, rtol=1e-5, atol=1e-6)
    for i, m in enumerate(models):
        assert_same(ens.buffers["1.running_mean"][i], m[1].running_mean, rtol=1e-5, atol=1e-6)
    # unbatched running stats + a batched input in training mode: a clear error with options
    m = models[0]
    p, b = _state(m)
    f = lambda xb: ft.functional_call(m, (p, b), xb)
    with pytest.raises(ft.UnsupportedUnderVmap,
                       match="running.*replace_all_batch_norm_modules_.*stack_module_state"):
        ft.vmap(f)(torch.randn(2, 6, 3))
    # ...and replace_all_batch_norm_modules_ removes the running stats, as torch.func's does
    m2 = ft.replace_all_batch_norm_modules_(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)))
    assert m2[1].running_mean is None and not m2[1].track_running_stats
    p2 = {k: v.detach() for k, v in m2.named_parameters()}
    xs = torch.randn(2, 6, 3)
    with ft.config.strict_fallback():
        got = ft.vmap(lambda xb: ft.functional_call(m2, p2, xb))(xs)
    assert_same(got, torch.stack([m2(a) for a in xs]), rtol=1e-5, atol=1e-6)
