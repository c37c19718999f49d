"""RNNs under vmap: the mkldnn_rnn_layer rules (nn.LSTM on CPU) vs the loop oracle (strict), and
per-sample / ensemble gradients of nn.LSTM, nn.GRU, nn.RNN and the cells vs a loop of
torch.autograd.grad (and torch.func where torch.func works).

Cases that still need the loop fallback: none of the nn.LSTM cases below (ensembles of
batched weights run the rules' batched decomposition).
nn.GRU / nn.RNN / the cells / non-mkldnn nn.LSTM (float64, proj_size) with an unbatched initial
hidden state work through functrans' torch._VF hook (Note [RNN initial state] in rules/rnn.py).
"""
import pytest
import torch
from torch.func import functional_call, stack_module_state

import functrans as ft
from tests.support.oracles import assert_same, check_vmap, check_vmap_all_bdims

aten = torch.ops.aten
TOL = dict(rtol=1e-4, atol=1e-5)


def _params(m):
    return {k: v.detach() for k, v in m.named_parameters()}


def _loss(m):
    def loss(p, x, *h):
        hx = () if not h else ((tuple(h) if len(h) == 2 else h[0]),)
        out = functional_call(m, p, (x,) + hx)
        out = out[0] if isinstance(out, tuple) else out
        return (out ** 2).sum()
    return loss


def _loop_grads(loss, params, xs, hs, params_batched=False):
    rows = []
    for i in range(xs.shape[0]):
        p = {k: (v[i] if params_batched else v).clone().requires_grad_()
             for k, v in params.items()}
        g = torch.autograd.grad(loss(p, xs[i], *(h[i] for h in hs)), list(p.values()))
        rows.append(dict(zip(p, g)))
    return {k: torch.stack([r[k] for r in rows]) for k in params}


# --------------------------------------------------------------------------- the ATen op itself

H, F, T, N = 4, 3, 5, 2
g0 = torch.Generator().manual_seed(0)
W = [torch.randn(4 * H, F, generator=g0), torch.randn(4 * H, H, generator=g0),
     torch.randn(4 * H, generator=g0), torch.randn(4 * H, generator=g0)]
X = torch.randn(T, N, F, generator=g0)
HX, CX = torch.randn(N, H, generator=g0), torch.randn(N, H, generator=g0)


@pytest.mark.parametrize("reverse", [False, True])
def test_mkldnn_rnn_layer_forward_all_bdims(reverse):
    # .contiguous(): the eager kernel ignores strides, and the loop oracle's slices are strided
    f = lambda x, h, c: aten.mkldnn_rnn_layer(x.contiguous(), *W, h.contiguous(), c.contiguous(),
                                              reverse, [], 2, H, 1, True, False,
                                              False, False)[:3]
    if reverse:  # the other direction: one in_dims choice is enough
        check_vmap(f, [X, HX, CX], (0, -1, None))
    else:
        check_vmap_all_bdims(f, [X, HX, CX])


@pytest.mark.parametrize("reverse", [False, True])
def test_mkldnn_rnn_layer_batched_weights(reverse):
    """The ensemble decomposition, forward and vjp, for several in_dims choices."""
    def f(x, w_ih, w_hh, b_hh, h, gy):
        def layer(x, w_ih, w_hh, b_hh, h):
            return aten.mkldnn_rnn_layer(x.contiguous(), w_ih.contiguous(), w_hh.contiguous(),
                                         W[2], b_hh, h.contiguous(), CX, reverse, [], 2, H, 1,
                                         True, False, False, True)[:3]
        out, vjp_fn = ft.vjp(layer, x, w_ih, w_hh, b_hh, h)
        # no_grad: otherwise vjp builds a graph (create_graph) and PyTorch's composite
        # mkldnn_rnn_layer_differentiable_backward runs instead of the backward op
        with torch.no_grad():
            return out, vjp_fn((gy.contiguous(), out[1] * 0.5, out[2] * 0.25))

    gy = torch.randn(T, N, H, generator=g0)
    args = [X, W[0], W[1], W[3], HX, gy]
    for dims in [(None, 0, None, None, None, None), (0, -1, 0, 0, None, 0),
                 (None, None, -1, None, 0, -1), (-1, 0, None, 0, -1, None)]:
        check_vmap(f, args, dims, **TOL)


@pytest.mark.parametrize("reverse", [False, True])
def test_mkldnn_rnn_layer_backward_via_vjp(reverse):
    """vmap(vjp) of the layer: every gradient (input, 4 weights, hx, cx) per example.
    (has_biases=False is covered through nn.LSTM(bias=False): called raw, eager autograd
    itself rejects the kernel's bias-gradient shapes.)"""
    def f(x, h, c, gy, ghy):
        def layer(x, h, c, *ws):
            out = aten.mkldnn_rnn_layer(x.contiguous(), *ws, h.contiguous(), c.contiguous(),
                                        reverse, [], 2, H, 1, True, False, False, True)
            return out[0], out[1]
        _, vjp_fn = ft.vjp(layer, x, h, c, *W)
        with torch.no_grad():  # no create_graph (see test_mkldnn_rnn_layer_batched_weights)
            return vjp_fn((gy.contiguous(), ghy.contiguous()))

    gy, ghy = torch.randn(T, N, H, generator=g0), torch.randn(N, H, generator=g0)
    for dims in [(0, 0, 0, 0, 0), (0, None, None, None, None), (None, -1, None, 0, None),
                 (None, None, None, 0, -1), (-1, None, 0, None, 0)]:
        check_vmap(f, [X, HX, CX, gy, ghy], dims, **TOL)


# --------------------------------------------------------------------------- nn.LSTM

LSTM_CASES = [(1, False, False, False), (1, False, True, True), (1, True, False, True),
              (2, False, False, True), (2, True, True, False), (2, True, False, True)]


@pytest.mark.parametrize("layers,bidir,batch_first,with_h", LSTM_CASES)
def test_lstm_per_sample_grads_strict(layers, bidir, batch_first, with_h):
    torch.manual_seed(0)
    m = torch.nn.LSTM(3, 4, num_layers=layers, bidirectional=bidir, batch_first=batch_first)
    params, loss = _params(m), _loss(m)
    xs = torch.randn(3, 2, 5, 3)
    n = 2 if batch_first else 5
    hs = [torch.randn(3, layers * (1 + bidir), n, 4) for _ in range(2)] if with_h else []
    with ft.config.strict_fallback():
        got = ft.vmap(ft.grad(loss), in_dims=(None, 0) + (0,) * len(hs))(params, xs, *hs)
    assert_same(got, _loop_grads(loss, params, xs, hs), **TOL)


def test_lstm_without_bias_and_unbatched_h0_strict():
    torch.manual_seed(1)
    m = torch.nn.LSTM(3, 4, bias=False)
    params, loss = _params(m), _loss(m)
    xs, h, c = torch.randn(3, 5, 2, 3), torch.randn(1, 2, 4), torch.randn(1, 2, 4)
    with ft.config.strict_fallback():
        got = ft.vmap(ft.grad(loss), in_dims=(None, 0, None, None))(params, xs, h, c)
    hs = [h.expand(3, *h.shape), c.expand(3, *c.shape)]
    assert_same(got, _loop_grads(loss, params, xs, hs), **TOL)


def test_lstm_per_sample_grads_match_torch_func():
    torch.manual_seed(2)
    m = torch.nn.LSTM(3, 4, num_layers=2, bidirectional=True, batch_first=True)
    params, loss = _params(m), _loss(m)
    xs = torch.randn(4, 2, 6, 3)
    with ft.config.strict_fallback():
        ours = ft.vmap(ft.grad(loss), in_dims=(None, 0))(params, xs)
    ref = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, xs)
    assert_same(ours, ref, **TOL)


@pytest.mark.parametrize("x_batched", [False, True])
@pytest.mark.parametrize("bidir,with_h", [(False, False), (True, True)])
def test_lstm_ensemble_strict(x_batched, bidir, with_h):
    """Batched weights (4 stacked 2-layer LSTMs): the rules' batched decomposition, vs a loop."""
    torch.manual_seed(3)
    ms = [torch.nn.LSTM(3, 4, num_layers=2, bidirectional=bidir) for _ in range(4)]
    params = {k: v.detach() for k, v in stack_module_state(ms)[0].items()}
    loss = _loss(ms[0])
    xs = torch.randn(4, 5, 2, 3)
    hs = [torch.randn(4, 2 * (1 + bidir), 2, 4) for _ in range(2)] if with_h else []
    dims = (0, 0 if x_batched else None) + (0,) * len(hs)
    x_arg = xs if x_batched else xs[0]
    with ft.config.strict_fallback():
        got = ft.vmap(ft.grad(loss), in_dims=dims)(params, x_arg, *hs)
    exp = _loop_grads(loss, params, xs if x_batched else xs[0].expand(4, *xs[0].shape), hs,
                      params_batched=True)
    assert_same(got, exp, **TOL)


def test_lstm_ensemble_forward_and_bias_free_strict():
    torch.manual_seed(7)
    ms = [torch.nn.LSTM(3, 4, bias=False, batch_first=True) for _ in range(3)]
    params = {k: v.detach() for k, v in stack_module_state(ms)[0].items()}
    loss, xs = _loss(ms[0]), torch.randn(3, 2, 5, 3)
    with ft.config.strict_fallback():
        got = ft.vmap(ft.grad(loss))(params, xs)
        out = ft.vmap(lambda p, x: functional_call(ms[0], p, (x,))[0])(params, xs)
    assert_same(got, _loop_grads(loss, params, xs, [], params_batched=True), **TOL)
    assert_same(out, torch.stack([m(x)[0] for m, x in zip(ms, xs)]).detach(), **TOL)


def test_lstm_dropout_randomness():
    torch.manual_seed(4)
    m = torch.nn.LSTM(3, 4, num_layers=2, dropout=0.5)
    x = torch.randn(5, 2, 3)
    f = lambda x: m(x)[0]
    with pytest.raises(ft.UnsupportedUnderVmap, match="randomness"):
        ft.vmap(f)(x.expand(3, *x.shape))
    out = ft.vmap(f, randomness="different")(x.expand(3, *x.shape))
    assert out.shape == (3, 5, 2, 4) and torch.isfinite(out).all()
    assert not torch.equal(out[0], out[1])  # each example drew its own dropout mask
    m.eval()
    with ft.config.strict_fallback():
        assert_same(ft.vmap(f)(x.expand(3, *x.shape)), f(x).expand(3, 5, 2, 4), **TOL)


# --------------------------------------------------------------------------- GRU / RNN / cells

@pytest.mark.parametrize("cls,kw", [(torch.nn.GRU, {}), (torch.nn.RNN, {}),
                                    (torch.nn.RNN, {"nonlinearity": "relu"})])
@pytest.mark.parametrize("layers,bidir,batch_first", [(1, False, False), (2, True, True)])
def test_gru_rnn_per_sample_grads_with_batched_h0(cls, kw, layers, bidir, batch_first):
    torch.manual_seed(5)
    m = cls(3, 4, num_layers=layers, bidirectional=bidir, batch_first=batch_first, **kw)
    params, loss = _params(m), _loss(m)
    xs = torch.randn(3, 2, 5, 3)
    hs = [torch.randn(3, layers * (1 + bidir), 2 if batch_first else 5, 4)]
    with ft.config.strict_fallback():
        got = ft.vmap(ft.grad(loss), in_dims=(None, 0, 0))(params, xs, *hs)
    assert_same(got, _loop_grads(loss, params, xs, hs), **TOL)


@pytest.mark.parametrize("cls", [torch.nn.LSTMCell, torch.nn.GRUCell, torch.nn.RNNCell])
def test_cells_per_sample_grads_with_batched_state_vs_torch_func(cls):
    torch.manual_seed(6)
    m = cls(3, 4)
    params, loss = _params(m), _loss(m)
    xs = torch.randn(3, 2, 3)
    hs = [torch.randn(3, 2, 4) for _ in range(2 if cls is torch.nn.LSTMCell else 1)]
    dims = (None, 0) + (0,) * len(hs)
    with ft.config.strict_fallback():
        got = ft.vmap(ft.grad(loss), in_dims=dims)(params, xs, *hs)
    assert_same(got, _loop_grads(loss, params, xs, hs), **TOL)
    assert_same(got, torch.func.vmap(torch.func.grad(loss), in_dims=dims)(params, xs, *hs),
                **TOL)


@pytest.mark.parametrize("cls", [torch.nn.GRU, torch.nn.RNN, torch.nn.GRUCell])
def test_unbatched_initial_state_vs_loop(cls):
    # No h0: the module creates unbatched zeros; functrans batches them before the C++
    # decomposition adds batched gates into them in place (Note [RNN initial state]).
    m = cls(3, 4)
    params, loss = _params(m), _loss(m)
    xs = torch.randn(3, 5, 2, 3)[:, 0]
    with ft.config.strict_fallback():
        got = ft.vmap(ft.grad(loss), in_dims=(None, 0))(params, xs)
    assert_same(got, _loop_grads(loss, params, xs, []), **TOL)


@pytest.mark.parametrize("make,x_shape", [
    (lambda: torch.nn.GRU(3, 4, num_layers=2, bidirectional=True, batch_first=True), (3, 2, 5, 3)),
    (lambda: torch.nn.RNN(3, 4, nonlinearity="relu"), (3, 5, 2, 3)),
    (lambda: torch.nn.RNN(3, 4), (3, 5, 3)),  # unbatched sequence per example
    (lambda: torch.nn.LSTM(3, 4, num_layers=2).double(), (3, 5, 2, 3)),  # not the mkldnn path
    (lambda: torch.nn.LSTM(3, 4, proj_size=2), (3, 5, 2, 3)),
    (lambda: torch.nn.LSTMCell(3, 4), (3, 2, 3)),
    (lambda: torch.nn.GRUCell(3, 4), (3, 2, 3)),
    (lambda: torch.nn.RNNCell(3, 4), (3, 2, 3))])
def test_unbatched_h0_works_strict(make, x_shape):
    torch.manual_seed(8)
    m = make()
    params, loss = _params(m), _loss(m)
    xs = torch.randn(x_shape, dtype=next(m.parameters()).dtype)
    with ft.config.strict_fallback():
        got = ft.vmap(ft.grad(loss), in_dims=(None, 0))(params, xs)
    assert_same(got, _loop_grads(loss, params, xs, []), **TOL)


def test_gru_ensemble_strict():
    torch.manual_seed(9)
    ms = [torch.nn.GRU(3, 4, num_layers=2) for _ in range(4)]
    params = {k: v.detach() for k, v in stack_module_state(ms)[0].items()}
    loss, xs = _loss(ms[0]), torch.randn(4, 5, 2, 3)
    with ft.config.strict_fallback():
        got = ft.vmap(ft.grad(loss))(params, xs)
    assert_same(got, _loop_grads(loss, params, xs, [], params_batched=True), **TOL)


# --------------------------------------------------------------------------- fused CUDA cells
# _thnn_fused_lstm_cell / _thnn_fused_gru_cell have CUDA kernels only.  To test the rules' row
# folding on CPU, the module fixture registers stand-in CPU kernels (the cell math, with a
# row-wise workspace like the CUDA one) for the duration of these tests.

def _fake_lstm_cell(ig, hg, cx, ib=None, hb=None):
    gates = ig + hg + (0 if ib is None else ib + hb)
    i, f, g, o = gates.chunk(4, 1)
    i, f, g, o = i.sigmoid(), f.sigmoid(), g.tanh(), o.sigmoid()
    cy = f * cx + i * g
    return o * cy.tanh(), cy, torch.cat([i, f, g, o], 1)


def _fake_lstm_cell_backward(ghy, gcy, cx, cy, ws, has_bias):
    i, f, g, o = ws.chunk(4, 1)
    tc = cy.tanh()
    dh = torch.zeros_like(cy) if ghy is None else ghy
    dc = (torch.zeros_like(cy) if gcy is None else gcy) + dh * o * (1 - tc * tc)
    d = torch.cat([dc * g * i * (1 - i), dc * cx * f * (1 - f), dc * i * (1 - g * g),
                   dh * tc * o * (1 - o)], 1)
    return d, dc * f, d.sum(0) if has_bias else d.new_zeros(d.shape[1])


def _fake_gru_cell(ig, hg, hx, ib=None, hb=None):
    ig, hg = (ig, hg) if ib is None else (ig + ib, hg + hb)
    (ir, iz, i_n), (hr, hz, hn) = ig.chunk(3, 1), hg.chunk(3, 1)
    r, z = (ir + hr).sigmoid(), (iz + hz).sigmoid()
    n = (i_n + r * hn).tanh()
    return (1 - z) * n + z * hx, torch.cat([r, z, n, hx, hn], 1)


def _fake_gru_cell_backward(ghy, ws, has_bias):
    r, z, n, hx, hn = ws.chunk(5, 1)
    dz = ghy * (hx - n) * z * (1 - z)
    dn = ghy * (1 - z) * (1 - n * n)
    dr = dn * hn * r * (1 - r)
    d_ig, d_hg = torch.cat([dr, dz, dn], 1), torch.cat([dr, dz, dn * r], 1)
    zeros = d_ig.new_zeros(d_ig.shape[1])
    return (d_ig, d_hg, ghy * z, d_ig.sum(0) if has_bias else zeros,
            d_hg.sum(0) if has_bias else zeros)


@pytest.fixture(scope="module")
def fake_fused_cells():
    lib = torch.library.Library("aten", "IMPL")
    for name, fn in [("_thnn_fused_lstm_cell", _fake_lstm_cell),
                     ("_thnn_fused_lstm_cell_backward_impl", _fake_lstm_cell_backward),
                     ("_thnn_fused_gru_cell", _fake_gru_cell),
                     ("_thnn_fused_gru_cell_backward", _fake_gru_cell_backward)]:
        lib.impl(name, fn, "CPU")
    yield
    lib._destroy()


def _cell_case(gates):
    g = torch.Generator().manual_seed(11)
    return [torch.randn(2, gates * 3, generator=g), torch.randn(2, gates * 3, generator=g),
            torch.randn(2, 3, generator=g)], [torch.randn(gates * 3, generator=g)
                                              for _ in range(2)]


@pytest.mark.parametrize("kind", ["lstm", "gru"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_fused_cells_forward_and_vjp(fake_fused_cells, kind, with_bias):
    op = aten._thnn_fused_lstm_cell if kind == "lstm" else aten._thnn_fused_gru_cell
    (ig, hg, state), (ib, hb) = _cell_case(4 if kind == "lstm" else 3)
    biases = (ib, hb) if with_bias else ()
    check_vmap_all_bdims(lambda a, b, c: op(a, b, c, *biases), [ig, hg, state], nested=False)

    def f(a, b, c, cot):
        out, vjp_fn = ft.vjp(lambda *t: op(*t)[:-1], a, b, c, *biases)
        with torch.no_grad():
            return vjp_fn(tuple(cot * (k + 1) for k in range(len(out))))

    cot = torch.randn(2, 3, generator=torch.Generator().manual_seed(12))
    for dims in [(0, 0, 0, 0), (None, None, None, 0), (0, None, -1, None), (None, -1, 0, -1)]:
        check_vmap(f, [ig, hg, state, cot], dims, **TOL)


def test_fused_cells_batched_biases_fall_back_correctly(fake_fused_cells):
    (ig, hg, cx), (ib, hb) = _cell_case(4)
    f = lambda a, c, b: aten._thnn_fused_lstm_cell(a, hg, c, b, hb)
    check_vmap(f, [ig, cx, ib], (0, None, 0), strict=False)
    with ft.config.strict_fallback(), pytest.raises(ft.UnsupportedUnderVmap):
        check_vmap(f, [ig, cx, ib], (0, None, 0))


@pytest.mark.parametrize("ensemble", [False, True])
def test_grad_of_vmap_lstm_strict(ensemble):
    """A transform outside the vmap differentiates the rules' physical ops."""
    torch.manual_seed(13)
    ms = [torch.nn.LSTM(3, 4, bidirectional=True) for _ in range(3 if ensemble else 1)]
    params = {k: v.detach() for k, v in stack_module_state(ms)[0].items()} if ensemble \
        else _params(ms[0])
    loss, xs = _loss(ms[0]), torch.randn(3, 5, 2, 3)
    total = lambda p: ft.vmap(loss, in_dims=(0 if ensemble else None, 0))(p, xs).sum()
    with ft.config.strict_fallback():
        got = ft.grad(total)(params)
    p = {k: v.clone().requires_grad_() for k, v in params.items()}
    exp = torch.autograd.grad(sum(loss({k: v[i] if ensemble else v for k, v in p.items()},
                                       xs[i]) for i in range(3)), list(p.values()))
    assert_same(got, dict(zip(p, exp)), **TOL)


def test_gradient_penalty_of_per_sample_grads_strict():
    """grad(vmap(grad)): the inner backward builds a graph (PyTorch's composite differentiable
    mkldnn backward runs on the wrappers), the outer one differentiates it."""
    torch.manual_seed(14)
    m = torch.nn.LSTM(3, 4)
    params, loss, xs = _params(m), _loss(m), torch.randn(3, 5, 2, 3)

    def penalty(p):
        g = ft.vmap(ft.grad(loss), in_dims=(None, 0))(p, xs)
        return sum((v ** 2).sum() for v in g.values())

    with ft.config.strict_fallback():
        got = ft.grad(penalty)(params)
    p = {k: v.clone().requires_grad_() for k, v in params.items()}
    total = sum(sum((g ** 2).sum() for g in torch.autograd.grad(
        loss(p, xs[i]), list(p.values()), create_graph=True)) for i in range(3))
    exp = dict(zip(p, torch.autograd.grad(total, list(p.values()))))
    assert_same(got, exp, rtol=1e-3, atol=1e-4)
