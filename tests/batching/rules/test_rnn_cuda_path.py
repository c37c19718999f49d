"""nn.LSTM / nn.GRU under vmap on CUDA take PyTorch's native path, not cuDNN's ``_cudnn_rnn``
(Note [RNN initial state] in functrans/batching/above_dispatch.py).

Without a GPU: the decision (``needs_native_path``) and the flag handling of the ``torch._VF``
wrapper, with CPU tensors (nothing changes) and with fake CUDA tensors (FakeTensorMode makes
``device="cuda"`` tensors on a CPU-only build), through a wrapper around a recording stand-in
for the entry point.  With a GPU: per-sample gradients of GRU and LSTM on CUDA against a loop
of torch.autograd.grad, strict.
"""
import pytest
import torch
from torch import _VF
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import functional_call

import functrans as ft
from functrans.batching import above_dispatch
from functrans.batching.randomness import draws_random, random_error
from tests.support.oracles import assert_same

cudnn = torch.backends.cudnn
_C_GRU = torch._C._VariableFunctions.gru      # the unwrapped entry point


def _fake_cuda(*shape):
    with FakeTensorMode(allow_non_fake_inputs=True):
        return torch.empty(*shape, device="cuda")


def _flags():
    """Every cuDNN setting the wrapper must leave alone (read without the legacy allow_tf32
    getter, which raises when conv and RNN TF32 settings differ)."""
    out = dict(benchmark=torch._C._get_cudnn_benchmark(),
               deterministic=torch._C._get_cudnn_deterministic(),
               conv=cudnn.conv.fp32_precision, rnn=cudnn.rnn.fp32_precision,
               all=torch._C._get_fp32_precision_getter("cuda", "all"))
    if cudnn.is_available():
        out["benchmark_limit"] = torch._C._cuda_get_cudnn_benchmark_limit()
    return out


def _recording(seen, result=None):
    """A stand-in for ``_VF.gru``: records cuDNN's ``enabled`` flag and the other flags while it
    runs; runs the real GRU unless given a ``result``."""
    def original(*args, **kwargs):
        seen.append((torch._C._get_cudnn_enabled(), _flags()))
        return _C_GRU(*args, **kwargs) if result is None else result
    return original


def test_fake_cuda_tensors_report_cuda():
    t = _fake_cuda(2, 3)
    assert t.is_cuda and t.device.type == "cuda"


def test_decision_is_no_on_cpu_and_outside_vmap():
    x, h, w = torch.randn(5, 2, 3), torch.zeros(1, 2, 4), [_fake_cuda(12, 3)]
    x_cuda, w_cpu = _fake_cuda(5, 2, 3), torch.randn(12, 3)
    assert not above_dispatch.needs_native_path("gru", (x, h, w))       # nothing batched
    seen = []

    def f(x):
        assert not above_dispatch.needs_native_path("gru", (x, h, [w_cpu]))
        assert above_dispatch.needs_native_path("gru", (x, h, w))
        assert above_dispatch.needs_native_path("lstm", (x, (h, h), w))
        assert not above_dispatch.needs_native_path("gru_cell", (x, h, w[0]))   # no cuDNN there
        assert not above_dispatch.needs_native_path("gru", (x_cuda, h, w))   # none batched
        seen.append(True)
        return x

    ft.vmap(f)(torch.randn(3, 5, 2, 3))
    assert seen


def test_cpu_gru_under_vmap_grad_keeps_cudnn_flags(monkeypatch):
    """The real GRU on the CPU, under vmap(grad), through the wrapper: cuDNN stays enabled during
    the call (no change on the CPU), and the gradients are right."""
    seen = []
    monkeypatch.setattr(_VF, "gru", above_dispatch.hook_rnn_entry_point("gru", _recording(seen)))
    torch.manual_seed(0)
    m = torch.nn.GRU(3, 4)
    params = {k: v.detach() for k, v in m.named_parameters()}
    loss = lambda p, x: (functional_call(m, p, (x,))[0] ** 2).sum()   # noqa: E731
    xs = torch.randn(3, 5, 2, 3)
    before = (torch._C._get_cudnn_enabled(), _flags())
    with ft.config.strict_fallback():
        got = ft.vmap(ft.grad(loss), in_dims=(None, 0))(params, xs)
    assert seen and all(s == before for s in seen)
    assert (torch._C._get_cudnn_enabled(), _flags()) == before
    ref = []
    for x in xs:
        p = {k: v.clone().requires_grad_() for k, v in params.items()}
        ref.append(dict(zip(p, torch.autograd.grad(loss(p, x), list(p.values())))))
    assert_same(got, {k: torch.stack([r[k] for r in ref]) for k in params}, rtol=1e-4, atol=1e-5)


@pytest.fixture
def restore_cudnn():
    saved = torch._C._get_cudnn_enabled(), cudnn.conv.fp32_precision, cudnn.rnn.fp32_precision
    yield
    torch._C._set_cudnn_enabled(saved[0])
    cudnn.conv.fp32_precision, cudnn.rnn.fp32_precision = saved[1:]


@pytest.mark.parametrize("name", ["gru", "lstm", "rnn_tanh", "rnn_relu"])
@pytest.mark.parametrize("setup", ["default", "cudnn_off", "mixed_tf32"])
def test_fake_cuda_call_under_vmap_disables_only_cudnn(name, setup, restore_cudnn):
    if setup == "cudnn_off":
        torch._C._set_cudnn_enabled(False)
    if setup == "mixed_tf32":   # torch.backends.cudnn.flags() itself raises in this setting
        cudnn.conv.fp32_precision, cudnn.rnn.fp32_precision = "tf32", "ieee"
    enabled, flags = torch._C._get_cudnn_enabled(), _flags()
    seen = []
    hooked = above_dispatch.hook_rnn_entry_point(name, _recording(seen, result=(0, 0)))
    w = [_fake_cuda(4, 3), _fake_cuda(4, 4)]
    h = torch.zeros(1, 2, 4)
    hx = (h, h) if name == "lstm" else h

    def f(x):
        hooked(x, hx, w, False, 1, 0.0, True, False, False)
        return x

    ft.vmap(f)(torch.randn(3, 5, 2, 3))
    assert seen == [(False, flags)]                        # cuDNN off during the call only
    assert (torch._C._get_cudnn_enabled(), _flags()) == (enabled, flags)   # restored


def test_fake_cuda_flags_restored_when_the_call_raises(restore_cudnn):
    def original(*args, **kwargs):
        assert not torch._C._get_cudnn_enabled()
        raise RuntimeError("boom")
    hooked = above_dispatch.hook_rnn_entry_point("gru", original)
    w = [_fake_cuda(4, 3)]

    def f(x):
        hooked(x, torch.zeros(1, 2, 4), w, False, 1, 0.0, True, False, False)
        return x

    assert torch._C._get_cudnn_enabled()
    with pytest.raises(RuntimeError, match="boom"):
        ft.vmap(f)(torch.randn(3, 5, 2, 3))
    assert torch._C._get_cudnn_enabled()


def test_fake_cuda_outside_vmap_or_unbatched_keeps_cudnn():
    seen = []
    hooked = above_dispatch.hook_rnn_entry_point("gru", _recording(seen, result=(0, 0)))
    args = (_fake_cuda(5, 2, 3), torch.zeros(1, 2, 4), [_fake_cuda(4, 3)], False, 1, 0.0, True,
            False, False)
    hooked(*args)
    ft.vmap(lambda y: (hooked(*args), y)[1])(torch.randn(3))   # under vmap, nothing batched
    assert [s[0] for s in seen] == [True, True]


def test_cudnn_rnn_draws_only_with_dropout_in_training():
    op = torch.ops.aten._cudnn_rnn.default
    args = [None] * 16
    names = [a.name for a in op._schema.arguments]
    i_dropout, i_train = names.index("dropout"), names.index("train")
    for dropout, train, draws in [(0.0, True, False), (0.5, False, False), (0.5, True, True)]:
        args[i_dropout], args[i_train] = dropout, train
        assert draws_random(op, args, {}) is draws
    msg = str(random_error(op))
    assert "cuDNN's RNN kernel" in msg and "dropout" in msg
    assert "cuDNN" not in str(random_error(torch.ops.aten.bernoulli.default))


# --------------------------------------------------------------------------- on a GPU

@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("cell", [torch.nn.GRU, torch.nn.LSTM])
@pytest.mark.parametrize("layers,bidir", [(1, False), (2, True)])
def test_cuda_per_sample_grads_match_the_loop(cell, layers, bidir):
    torch.manual_seed(0)
    m = cell(3, 5, num_layers=layers, bidirectional=bidir, batch_first=True).cuda()
    params = {k: v.detach() for k, v in m.named_parameters()}
    loss = lambda p, x: (functional_call(m, p, (x,))[0] ** 2).sum()   # noqa: E731
    xs = torch.randn(4, 2, 6, 3, device="cuda")
    enabled = cudnn.enabled
    with cudnn.flags(enabled=enabled, benchmark=cudnn.benchmark,
                     deterministic=cudnn.deterministic, allow_tf32=False), \
            ft.config.strict_fallback():
        got = ft.vmap(ft.grad(loss), in_dims=(None, 0))(params, xs)
        ref = []
        for x in xs:
            p = {k: v.clone().requires_grad_() for k, v in params.items()}
            ref.append(dict(zip(p, torch.autograd.grad(loss(p, x), list(p.values())))))
    assert cudnn.enabled == enabled
    assert_same(got, {k: torch.stack([r[k] for r in ref]) for k in params}, rtol=1e-4, atol=1e-5)
