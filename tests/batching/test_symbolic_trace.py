"""functrans transforms traced by make_fx's symbolic mode (sizes traced as SymInts).

``functrans.compile(dynamic=True)`` needs one graph for every batch size: ``make_fx(...,
tracing_mode="symbolic")`` over the transform stack.  Each case is traced at one size and the
graph is replayed at two other sizes against eager functrans and torch.func.  Symbolic tracing
runs the engine on FakeTensors, whose device is read through Python (``prim.device``, an op
outside the C++ dispatcher); that query used to make the registry raise inside a noexcept
C++ path (autograd's ``Node::add_input_metadata``), which aborted the process.
"""
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import functrans as ft
from functrans.batching import registry
from functrans.batching.op_schema import decomposes_above_dispatch
from functrans.errors import UnsupportedUnderVmap

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _tanh_layer(w, x):
    return torch.tanh(w @ x)


def _loss(w, x, y):
    return ((torch.tanh(w @ x) - y) ** 2).sum()


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def _per_sample_grads(tf, model):
    def loss(p, x, y):
        return F.mse_loss(tf.functional_call(model, p, (x,)), y)
    return tf.vmap(tf.grad(loss), in_dims=(None, 0, 0))


# name -> (the transform built from a torch.func-like namespace, arguments at size n).
# vmap cases: n is the batch size; the others have no batch dim: n is x's size (W is 3 x n).
_W = torch.randn(3, 8)
_MODEL = _model()
_PARAMS = {k: v.detach() for k, v in _MODEL.named_parameters()}
CASES = {
    "vmap_grad": (lambda tf: tf.vmap(tf.grad(_loss), in_dims=(None, 0, 0)),
                  lambda n: (_W, torch.randn(n, 8), torch.randn(n, 3))),
    "jacrev": (lambda tf: tf.jacrev(_tanh_layer, argnums=1),
               lambda n: (torch.randn(3, n), torch.randn(n))),
    "jacfwd": (lambda tf: tf.jacfwd(_tanh_layer, argnums=1),
               lambda n: (torch.randn(3, n), torch.randn(n))),
    "hessian": (lambda tf: tf.hessian(_tanh_layer, argnums=1),
                lambda n: (torch.randn(3, n), torch.randn(n))),
    "vmap_jacrev": (lambda tf: tf.vmap(tf.jacrev(_tanh_layer, argnums=1), in_dims=(None, 0)),
                    lambda n: (_W, torch.randn(n, 8))),
    "per_sample_grads": (lambda tf: _per_sample_grads(tf, _MODEL),
                         lambda n: (_PARAMS, torch.randn(n, 8), torch.randn(n, 3))),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_symbolic_trace_replays_at_other_sizes(name):
    make, args_at = CASES[name]
    fn, ref = make(ft), make(torch.func)
    gm = make_fx(fn, tracing_mode="symbolic")(*args_at(7))
    # The sizes are graph values, not constants: one graph serves every size.
    assert any(n.target is torch.ops.aten.sym_size.int for n in gm.graph.nodes)
    for n in (4, 11):
        args = args_at(n)
        got = gm(*args)
        torch.testing.assert_close(got, fn(*args))
        torch.testing.assert_close(got, ref(*args))


def test_prim_device_gets_an_entry_instead_of_raising():
    # A FakeTensor's device is read through Python: prim.device reaches the vmap level's mode.
    # It is not a dispatcher op; asking the dispatcher about its kernels raises.
    op = torch.ops.prim.device.default
    assert not decomposes_above_dispatch(op)
    assert registry.entry(op).how == "none"
    assert decomposes_above_dispatch(torch.ops.aten.matmul.default)


def _run_python(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-X", "faulthandler", "-c", textwrap.dedent(code)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_reported_vmap_grad_trace_does_not_abort():
    # The reported abort: the batched grad's AccumulateGrad reads the FakeTensor weight's
    # device; a process that aborts never reaches the prints.
    res = _run_python("""
        import torch, functrans as ft
        from torch.fx.experimental.proxy_tensor import make_fx
        w = torch.randn(3, 8)
        def loss(w, x, y):
            return ((torch.tanh(w @ x) - y) ** 2).sum()
        f = ft.vmap(ft.grad(loss), in_dims=(None, 0, 0))
        gm = make_fx(f, tracing_mode="symbolic")(w, torch.randn(64, 8), torch.randn(64, 3))
        xs, ys = torch.randn(10, 8), torch.randn(10, 3)
        print("replay", torch.allclose(gm(w, xs, ys), f(w, xs, ys)))
    """)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "replay True" in res.stdout


def test_untraceable_case_raises_a_python_exception():
    # A Python number read from a batched value has no per-example answer: the engine's own
    # error, raised through the symbolic trace like in eager.
    def loss(w, x):
        return torch.tanh(w @ x).sum() * float(x.sum())

    with pytest.raises(UnsupportedUnderVmap, match="float"):
        make_fx(ft.vmap(ft.grad(loss), in_dims=(None, 0)), tracing_mode="symbolic")(
            _W, torch.randn(5, 8))


def test_vmap_hessian_never_aborts_the_process():
    # vmap(hessian(f)) traces on PyTorch 2.13, but its graph does not replay: FakeTensor gives
    # tanh_backward of two expanded inputs other strides than the CPU kernel does, so a view
    # the trace recorded is refused at replay (torch.func stops earlier, at trace time).
    # Whatever PyTorch does, the outcome is a Python exception or a correct graph, never an
    # abort.
    res = _run_python("""
        import torch, functrans as ft
        from torch.fx.experimental.proxy_tensor import make_fx
        w = torch.randn(3, 8)
        fn = ft.vmap(ft.hessian(lambda w, x: torch.tanh(w @ x), argnums=1), in_dims=(None, 0))
        try:
            gm = make_fx(fn, tracing_mode="symbolic")(w, torch.randn(7, 8))
            xs = torch.randn(5, 8)
            print("replay", torch.allclose(gm(w, xs), fn(w, xs), atol=1e-5))
        except Exception as e:
            print("raised", type(e).__name__)
    """)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "raised" in res.stdout or "replay True" in res.stdout, res.stdout
