"""The package never uses the reference implementation as its engine."""
import pathlib

import pytest
import torch
import torch.func as TF

import functrans
from functrans.errors import TransformArgumentError
from tests.support import reference_imports


def test_package_never_uses_the_reference_engine():
    """An ast check of every module of the package: no import (module-level or inside a
    function), no ``importlib.import_module``/``__import__`` of a literal name, no attribute use
    of torch.func & co. (see tests/support/reference_imports.py).  Docstrings and comments may
    name them."""
    root = pathlib.Path(functrans.__file__).parent
    hits = reference_imports.package_uses(root)
    assert not hits, "functrans must not use torch.func & co.:\n" + "\n".join(hits)


@pytest.mark.parametrize("source", [
    '"""Built like torch.func.vmap; never imports functorch."""\nimport torch\n',
    "# torch.func.grad is the reference\nx = 'torch.func'\n",
    "import torch\ny = torch.autograd.grad\nz = torch.ops.aten.sin\n",
    "from torch import autograd\ng = autograd.grad\n",
    "import importlib\nm = importlib.import_module('torch.fx')\n",
    "import torch\nf = getattr(torch, 'fx')\n",
], ids=["docstring", "comment-and-string", "other-torch-attributes", "autograd-alias",
        "import_module-other", "getattr-other"])
def test_reference_checker_passes_code_that_only_names_it(source):
    assert reference_imports.uses(source) == []


@pytest.mark.parametrize("source, expected", [
    ("from torch.func import vmap\n", (1, "from torch.func import ...")),
    ("import functorch\n", (1, "import functorch")),
    ("import torch.func as TF\n", (1, "import torch.func")),
    ("from torch import vmap\n", (1, "from torch import vmap")),
    ("from torch import func\n", (1, "from torch import func")),
    ("from torch._C import _functorch\n", (1, "from torch._C import _functorch")),
    ("from torch.autograd import functional\n", (1, "from torch.autograd import functional")),
    ("def f():\n    import torch._functorch.apis\n", (2, "import torch._functorch.apis")),
    ("import importlib\nm = importlib.import_module('torch.func')\n",
     (2, "importlib.import_module('torch.func')")),
    ("from importlib import import_module\ndef f():\n    return import_module('functorch')\n",
     (3, "importlib.import_module('functorch')")),
    ("m = __import__('torch.autograd.functional')\n",
     (1, "__import__('torch.autograd.functional')")),
    ("import torch\ndef f(g):\n    return torch.vmap(g)\n", (3, "torch.vmap")),
    ("import torch as T\nh = T.func.hessian\n", (2, "torch.func")),
    ("import torch\nb = torch._C._functorch.is_batchedtensor\n", (2, "torch._C._functorch")),
    ("from torch import autograd\nj = autograd.functional.jacobian\n",
     (2, "torch.autograd.functional")),
    ("import torch\nv = getattr(torch, 'vmap')\n", (2, "getattr(torch, 'vmap')")),
], ids=["from-torch.func", "import-functorch", "import-as", "from-torch-import-vmap",
        "from-torch-import-func", "from-torch._C", "from-autograd-import-functional",
        "function-local", "import_module", "from-importlib-local", "dunder-import",
        "torch.vmap-attribute", "aliased-attribute", "torch._C._functorch-attribute",
        "autograd-alias-attribute", "getattr-literal"])
def test_reference_checker_flags_uses(source, expected):
    assert expected in reference_imports.uses(source)


def test_all_and_signatures_match_torch_func():
    import inspect
    import torch.func
    names = ["vmap", "grad", "grad_and_value", "vjp", "jvp", "linearize", "jacrev", "jacfwd",
             "hessian", "functional_call", "stack_module_state", "replace_all_batch_norm_modules_"]
    assert set(names) <= set(functrans.__all__)
    for name in names:
        ours = inspect.signature(getattr(functrans, name)).parameters
        ref = inspect.signature(getattr(torch.func, name)).parameters
        # Every torch.func parameter (except private ones) exists, same kind, same default.
        for p in ref.values():
            if p.name.startswith("_"):
                continue
            assert p.name in ours, f"{name} lacks parameter {p.name}"
            assert ours[p.name].kind == p.kind, f"{name}({p.name}) kind differs"
            assert ours[p.name].default == p.default, f"{name}({p.name}) default differs"
        assert getattr(functrans, name).__module__ == "functrans"


def test_extend_module_exports_work():
    from functrans import extend
    for name in extend.__all__:
        assert hasattr(extend, name)


# ---- every public parameter has an effect or is validated --------------------------------
#
# PARAMETER_CHECKS maps "callable.parameter" to a check that exercises it: the result changes
# with it (compared with torch.func where there is a counterpart), or a bad value is refused.
# test_every_public_parameter_has_a_check fails when a public signature gains a parameter that
# no check exercises, so an accepted-but-ignored parameter cannot slip in unnoticed.

PARAMETER_CHECKS = {}


def _checks(*names):
    def register(fn):
        for n in names:
            assert n not in PARAMETER_CHECKS, n
            PARAMETER_CHECKS[n] = fn
        return fn
    return register


def _public_callables():
    """name -> callable for every public function/class of functrans and functrans.nn, plus the
    functions the transforms return (vjp_fn, linearize's jvp_fn) and Ensemble.__call__."""
    import functrans.nn as fnn
    out = {}
    for mod, prefix in ((functrans, ""), (fnn, "nn.")):
        for name in mod.__all__:
            obj = getattr(mod, name)
            if not callable(obj) or (isinstance(obj, type) and issubclass(
                    obj, (BaseException, Warning))):
                continue
            key = name if getattr(obj, "__module__", "").startswith("functrans") and \
                prefix == "" or name in functrans.__all__ else prefix + name
            out.setdefault(key, obj)
    x = torch.ones(2)
    out["vjp_fn"] = functrans.vjp(torch.sin, x)[1]
    out["linearize.jvp_fn"] = functrans.linearize(torch.sin, x)[1]
    out["Ensemble.__call__"] = functrans.Ensemble.__call__
    return out


def _parameters(obj):
    import inspect
    sig = inspect.signature(obj.__init__ if isinstance(obj, type) else obj)
    return [p for p in sig.parameters if p != "self"]


def test_every_public_parameter_has_a_check():
    wanted = {f"{name}.{p}" for name, obj in _public_callables().items()
              for p in _parameters(obj)}
    missing = sorted(wanted - set(PARAMETER_CHECKS))
    stale = sorted(set(PARAMETER_CHECKS) - wanted)   # a check for a parameter that is gone
    assert not missing, f"public parameters with no check (ignored?): {missing}"
    assert not stale, f"checks for parameters that no longer exist: {stale}"


def _t(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _close(a, b, **kw):
    torch.testing.assert_close(a, b, **kw)


# -- transforms ---------------------------------------------------------------------------

@_checks("vmap.func", "vmap.in_dims", "vmap.out_dims")
def _vmap_dims():
    x, y = _t(3, 4), _t(4, 3, seed=1)  # 3 examples of 4 elements
    f = lambda a, b: a * b  # noqa: E731
    for (a, b), ind, outd in (((x, y), (0, 1), 0), ((x.t(), y.t()), (1, 0), 1),
                              ((x, y[:, 0]), (0, None), -1)):
        ours = functrans.vmap(f, in_dims=ind, out_dims=outd)(a, b)
        _close(ours, TF.vmap(f, in_dims=ind, out_dims=outd)(a, b))
        assert ours.shape[outd] == 3
    _close(functrans.vmap(torch.cos)(x), x.cos())


@_checks("vmap.randomness", "jacfwd.randomness")
def _randomness():
    x = torch.zeros(4, 3)
    f = lambda a: a + torch.rand(3)  # noqa: E731
    with pytest.raises(Exception, match="randomness"):
        functrans.vmap(f)(x)
    same = functrans.vmap(f, randomness="same")(x)
    assert torch.equal(same[0], same[1])
    diff = functrans.vmap(f, randomness="different")(x)
    assert not torch.equal(diff[0], diff[1])
    with pytest.raises(TransformArgumentError, match="randomness"):
        functrans.vmap(f, randomness="sometimes")
    g = lambda a: a * torch.rand(()).add(1)  # noqa: E731
    with pytest.raises(Exception, match="randomness"):
        functrans.jacfwd(g)(torch.ones(3))
    j = functrans.jacfwd(g, randomness="same")(torch.ones(3))
    assert torch.allclose(j, j[0, 0] * torch.eye(3))
    jd = functrans.jacfwd(g, randomness="different")(torch.ones(3))
    assert len(set(jd.diagonal().tolist())) > 1


@_checks("vmap.chunk_size", "jacrev.chunk_size", "jacfwd.chunk_size", "hessian.chunk_size",
         "Ensemble.chunk_size")
def _chunk_size():
    calls = []

    def f(a):
        calls.append(a.shape)
        return a.sin()
    x = _t(6, 3)
    _close(functrans.vmap(f, chunk_size=4)(x), x.sin())
    assert len(calls) == 2  # two chunks: 4 + 2
    for api in (functrans.vmap, functrans.jacrev, functrans.jacfwd, functrans.hessian):
        with pytest.raises(TransformArgumentError, match="chunk_size"):
            api(torch.sin, chunk_size=0)
    h = lambda a: (a.sin() ** 2).sum()  # noqa: E731
    for api, ref in ((functrans.jacrev, TF.jacrev), (functrans.jacfwd, TF.jacfwd),
                     (functrans.hessian, TF.hessian)):
        fn = torch.sin if api is not functrans.hessian else h
        _close(api(fn, chunk_size=2)(x[0]), ref(fn)(x[0]))
        with functrans.config.max_memory(64):      # "auto": chunks that fit 64 bytes
            _close(api(fn, chunk_size="auto")(x[0]), ref(fn)(x[0]))
    calls.clear()
    with functrans.config.max_memory(64):
        _close(functrans.vmap(f, chunk_size="auto")(x), x.sin())
    assert len(calls) > 3  # the probes' calls on fake tensors, then the chunks
    m = torch.nn.Linear(3, 2)
    ens = functrans.Ensemble([m, torch.nn.Linear(3, 2)], chunk_size=1)
    _close(ens(x), functrans.Ensemble([m, ens.members()[1]])(x))
    with pytest.raises(TransformArgumentError, match="chunk_size"):
        functrans.Ensemble([m], chunk_size=0)(x)


@_checks("grad.func", "grad.argnums", "grad.has_aux", "grad_and_value.func",
         "grad_and_value.argnums", "grad_and_value.has_aux")
def _grad_params():
    x, y = _t(3), _t(3, seed=1)
    f = lambda a, b: ((a * b).sin().sum(), a.mean())  # noqa: E731
    for ours, ref in ((functrans.grad, TF.grad), (functrans.grad_and_value, TF.grad_and_value)):
        for argnums in (0, 1, (0, 1)):
            _close(ours(f, argnums=argnums, has_aux=True)(x, y),
                   ref(f, argnums=argnums, has_aux=True)(x, y))
        with pytest.raises(TransformArgumentError, match="scalar"):
            ours(f)(x, y)  # has_aux=False: a pair is not a scalar
        with pytest.raises(TransformArgumentError, match="argnums"):
            ours(f, argnums=2)(x, y)


@_checks("vjp.func", "vjp.primals", "vjp.has_aux")
def _vjp_params():
    x, y = _t(3), _t(3, seed=1)
    f = lambda a, b: ((a * b).sin(), a.mean())  # noqa: E731
    o1, fn1, aux1 = functrans.vjp(f, x, y, has_aux=True)
    o2, fn2, aux2 = TF.vjp(f, x, y, has_aux=True)
    _close((o1, aux1, fn1(torch.ones(3))), (o2, aux2, fn2(torch.ones(3))))
    o1, fn1 = functrans.vjp(f, x, y)  # has_aux=False: both outputs differentiated
    _close(fn1((torch.ones(3), torch.ones(()))), TF.vjp(f, x, y)[1]((torch.ones(3),
                                                                       torch.ones(()))))


@_checks("vjp_fn.cotangents", "vjp_fn.retain_graph", "vjp_fn.create_graph")
def _vjp_fn_params():
    x = _t(3).requires_grad_()
    _, fn = functrans.vjp(torch.sin, x)
    _close(fn(2 * torch.ones(3))[0].detach(), 2 * x.cos().detach())
    assert fn(torch.ones(3), True, True)[0].requires_grad
    assert not fn(torch.ones(3), True, False)[0].requires_grad
    fn(torch.ones(3), False)
    with pytest.raises(RuntimeError, match="second time"):
        fn(torch.ones(3))


@_checks("jvp.func", "jvp.primals", "jvp.tangents", "jvp.strict", "jvp.has_aux")
def _jvp_params():
    x, t = _t(3), _t(3, seed=1)
    f = lambda a: (a.sin(), a.detach())  # noqa: E731
    _close(functrans.jvp(f, (x,), (t,)), TF.jvp(f, (x,), (t,)))
    with pytest.raises(TransformArgumentError, match="strict=True"):
        functrans.jvp(f, (x,), (t,), strict=True)
    g = lambda a: (a.sin(), {"aux": a})  # noqa: E731
    _close(functrans.jvp(g, (x,), (t,), has_aux=True), TF.jvp(g, (x,), (t,), has_aux=True))


@_checks("linearize.func", "linearize.primals", "linearize.jvp_fn.tangents")
def _linearize_params():
    x, t = _t(3), _t(3, seed=1)
    out, jvp_fn = functrans.linearize(torch.sin, x)
    _close((out, jvp_fn(t)), TF.jvp(torch.sin, (x,), (t,)))
    with pytest.raises(TransformArgumentError, match="shape"):
        jvp_fn(torch.ones(2))


@_checks("jacrev.func", "jacrev.argnums", "jacrev.has_aux", "jacfwd.func", "jacfwd.argnums",
         "jacfwd.has_aux", "hessian.func", "hessian.argnums", "hessian.has_aux")
def _jacobian_params():
    x, y = _t(3), _t(3, seed=1)
    f = lambda a, b: ((a * b).sin(), a.sum())  # noqa: E731
    s = lambda a, b: ((a * b).sin().sum() * a.sum(), b.mean())  # noqa: E731
    ref_hessian = lambda fn, argnums=0, has_aux=False: TF.jacfwd(  # noqa: E731
        TF.jacrev(fn, argnums, has_aux=has_aux), argnums, has_aux=has_aux)
    for ours, ref, fn in ((functrans.jacrev, TF.jacrev, f), (functrans.jacfwd, TF.jacfwd, f),
                          (functrans.hessian, ref_hessian, s)):
        for argnums in (0, 1, (0, 1)):
            _close(ours(fn, argnums=argnums, has_aux=True)(x, y),
                   ref(fn, argnums=argnums, has_aux=True)(x, y))
        _close(ours(fn, argnums=1)(x, y), ref(fn, argnums=1)(x, y))


# -- modules ------------------------------------------------------------------------------

@_checks("functional_call.module", "functional_call.parameter_and_buffer_dicts",
         "functional_call.args", "functional_call.kwargs", "functional_call.tie_weights",
         "functional_call.strict")
def _functional_call_params():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(2, 2, bias=False)
            self.b = torch.nn.Linear(2, 2, bias=False)
            self.b.weight = self.a.weight  # tied

        def forward(self, x, scale=1.0):
            return self.b(x) * scale
    m, x = M(), _t(2)
    w = {"a.weight": torch.eye(2)}
    for kw in ({}, {"tie_weights": False}):
        _close(functrans.functional_call(m, w, (x,), {"scale": 3.0}, **kw),
               TF.functional_call(m, w, (x,), {"scale": 3.0}, **kw))
    assert torch.equal(functrans.functional_call(m, w, x), x)  # args as a single tensor
    assert not torch.equal(functrans.functional_call(m, w, x, tie_weights=False), x)
    with pytest.raises(Exception, match="b.weight|missing|strict"):
        functrans.functional_call(m, w, (x,), tie_weights=False, strict=True)
    with pytest.raises(TransformArgumentError, match="nn.Module"):
        functrans.functional_call(lambda v: v, w, (x,))


@_checks("stack_module_state.models", "Ensemble.models", "Ensemble.randomness",
         "Ensemble.__call__.args", "Ensemble.__call__.shared", "Ensemble.__call__.kwargs")
def _stacking_params():
    ms = [torch.nn.Linear(3, 2) for _ in range(2)]
    ours, ref = functrans.stack_module_state(ms), TF.stack_module_state(ms)
    _close(ours, ref)
    xs = _t(2, 5, 3)
    ens = functrans.Ensemble(ms)
    shared = ens(xs[0])
    _close(shared, torch.stack([m(xs[0]) for m in ms]))
    _close(ens(xs, shared=False), torch.stack([m(x) for m, x in zip(ms, xs)]))
    with pytest.raises(TransformArgumentError, match="shared=False"):
        ens(_t(3, 5, 3), shared=False)
    class K(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(3))

        def forward(self, x, *, scale):
            return x * self.w * scale
    _close(functrans.Ensemble([K(), K()])(xs[0], scale=2.0), 2 * xs[0].expand(2, 5, 3))
    drop = [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5)) for _ in "ab"]
    drop[1].load_state_dict(drop[0].state_dict())
    with pytest.raises(Exception, match="randomness"):
        functrans.Ensemble(drop)(torch.ones(8))
    out = functrans.Ensemble(drop, randomness="same")(torch.ones(8))
    assert torch.equal(out[0], out[1])
    out = functrans.Ensemble(drop, randomness="different")(torch.ones(8))
    assert not torch.equal(out[0], out[1])


@_checks("replace_all_batch_norm_modules_.root")
def _replace_bn_params():
    m = torch.nn.Sequential(torch.nn.BatchNorm1d(3))
    assert functrans.replace_all_batch_norm_modules_(m) is m
    assert m[0].running_mean is None and not m[0].track_running_stats


@_checks("batching_coverage.op")
def _coverage_params():
    assert functrans.batching_coverage(torch.ops.aten.sum.dim_IntList) == "rule"
    assert functrans.batching_coverage(torch.ops.aten.matmul.default) == "composite"


@_checks("functionalize.func", "functionalize.remove")
def _functionalize_params():
    def f(a):
        b = a.clone()
        b.add_(1)
        return b.view(-1)
    x = _t(2, 2)
    for remove in ("mutations", "mutations_and_views"):
        _close(functrans.functionalize(f, remove=remove)(x),
               TF.functionalize(f, remove=remove)(x))
    ops = []

    class Record(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))
    for remove in ("mutations", "mutations_and_views"):
        with Record():
            functrans.functionalize(f, remove=remove)(x)
    assert "add_" not in ops and "view_copy" in ops  # views removed only when asked
    with pytest.raises(TransformArgumentError, match="remove"):
        functrans.functionalize(f, remove="views")


@_checks("rearrange.tensor", "rearrange.pattern", "rearrange.axes_lengths")
def _rearrange_params():
    x = _t(6, 4)   # einops is in the dev extra (its absence: tests/test_rearrange.py)
    _close(functrans.rearrange(x, "a b -> b a"), x.t())
    _close(functrans.rearrange(x, "(a1 a2) b -> a1 a2 b", a1=2), x.view(2, 3, 4))
    with pytest.raises(TypeError, match="tensor"):
        functrans.rearrange([x], "a b -> b a")


@_checks("debug_unwrap.tensor", "debug_unwrap.recurse")
def _debug_unwrap_params():
    x = _t(2, 3, 4)
    plain = _t(4)
    assert functrans.debug_unwrap(plain) is plain          # a plain tensor comes back unchanged
    seen = {}

    def inner(row):
        seen["all"] = functrans.debug_unwrap(row)
        seen["one"] = functrans.debug_unwrap(row, recurse=False)
        return row

    functrans.vmap(functrans.vmap(inner))(x)
    assert type(seen["all"]) is torch.Tensor and seen["all"].shape == (2, 3, 4)
    assert type(seen["one"]) is not torch.Tensor            # one level: still the outer wrapper
    assert functrans.debug_unwrap(seen["one"]).shape == (2, 3, 4)


# -- DP-SGD (functrans.nn) ----------------------------------------------------------------

def _dp_setup():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    x, y = _t(4, 3), torch.tensor([0, 1, 1, 0])
    loss = torch.nn.functional.cross_entropy
    return model, loss, (x, y)


@_checks("nn.per_sample_grads.model", "nn.per_sample_grads.loss_fn", "nn.per_sample_grads.batch",
         "nn.per_sample_grads.randomness")
def _per_sample_params():
    from functrans.nn import per_sample_grads
    model, loss, batch = _dp_setup()
    g = per_sample_grads(model, loss, batch)
    for i in range(4):
        model.zero_grad()
        loss(model(batch[0][i:i + 1]), batch[1][i:i + 1]).backward()
        _close(g["weight"][i], model.weight.grad)
    drop = torch.nn.Sequential(torch.nn.Dropout(0.5), torch.nn.Linear(3, 2))
    with pytest.raises(Exception, match="randomness"):
        per_sample_grads(drop, loss, batch, randomness="error")
    with pytest.raises(TypeError, match="batch"):
        per_sample_grads(model, loss, "not a batch")


@_checks("nn.clip_and_sum.per_sample", "nn.clip_and_sum.max_norm")
def _clip_params():
    from functrans.nn import clip_and_sum
    g = {"w": torch.tensor([[3.0, 4.0], [0.3, 0.4]])}
    sums, norms = clip_and_sum(g, 1.0)
    _close(norms, torch.tensor([5.0, 0.5]))
    _close(sums["w"], torch.tensor([3.0, 4.0]) / (5 + 1e-6) + torch.tensor([0.3, 0.4]))
    assert not torch.allclose(clip_and_sum(g, 10.0)[0]["w"], sums["w"])
    with pytest.raises(ValueError, match="max_norm"):
        clip_and_sum(g, 0.0)


@_checks("nn.add_gaussian_noise.grads", "nn.add_gaussian_noise.std",
         "nn.add_gaussian_noise.generator", "nn.add_gaussian_noise.seed")
def _noise_params():
    from functrans.nn import add_gaussian_noise
    g = {"w": torch.zeros(1000)}
    assert torch.equal(add_gaussian_noise(g, 0.0)["w"], g["w"])
    a = add_gaussian_noise(g, 2.0, seed=1)["w"]
    assert abs(a.std().item() - 2.0) < 0.2
    _close(add_gaussian_noise(g, 2.0, generator=torch.Generator().manual_seed(1))["w"], a)
    assert not torch.equal(add_gaussian_noise(g, 2.0, seed=2)["w"], a)
    with pytest.raises(ValueError, match="not both"):
        add_gaussian_noise(g, 1.0, generator=torch.Generator(), seed=1)


@_checks("nn.assign_grads.model", "nn.assign_grads.grads", "nn.assign_grads.accumulate")
def _assign_params():
    from functrans.nn import assign_grads
    model = torch.nn.Linear(2, 1)
    g = {"weight": torch.ones(1, 2)}
    assign_grads(model, g)
    assign_grads(model, g, accumulate=True)
    _close(model.weight.grad, 2 * torch.ones(1, 2))
    assign_grads(model, g)
    _close(model.weight.grad, torch.ones(1, 2))
    assert model.bias.grad is None
    with pytest.raises(KeyError, match="nope"):
        assign_grads(model, {"nope": torch.ones(1)})


@_checks("nn.surrogate_loss.model", "nn.surrogate_loss.grads", "nn.surrogate_loss.scale",
         "nn.surrogate_loss.anchor")
def _surrogate_params():
    from functrans.nn import surrogate_loss
    model = torch.nn.Linear(2, 1)
    g = {"weight": torch.tensor([[1.0, 2.0]])}
    surrogate_loss(model, g, scale=3.0).backward()
    _close(model.weight.grad, 3 * g["weight"])
    model.zero_grad()
    anchor = model(torch.ones(2))
    loss = surrogate_loss(model, g, anchor=anchor)
    assert loss.grad_fn is not None
    loss.backward()
    _close(model.weight.grad, g["weight"])
    _close(model.bias.grad, torch.zeros(1))  # reached through the anchor, with zeros


@_checks(*(f"nn.dp_sgd_grads.{p}" for p in (
    "model", "loss_fn", "batch", "max_norm", "noise_multiplier", "generator", "seed",
    "reduction", "distributed", "process_group", "noise_rank", "return_norms", "randomness",
    "method")))
def _dp_sgd_params():
    import torch.distributed as dist
    from functrans.nn import clip_and_sum, dp_sgd_grads, per_sample_grads
    model, loss, batch = _dp_setup()
    clean = clip_and_sum(per_sample_grads(model, loss, batch), 0.5)[0]
    out = dp_sgd_grads(model, loss, batch, max_norm=0.5, noise_multiplier=0.0)
    _close(out, clean)
    noisy, norms = dp_sgd_grads(model, loss, batch, max_norm=0.5, noise_multiplier=1.0, seed=3,
                                return_norms=True)
    assert norms.shape == (4,)
    assert not torch.allclose(noisy["weight"], clean["weight"])
    _close(dp_sgd_grads(model, loss, batch, max_norm=0.5, noise_multiplier=1.0,
                        generator=torch.Generator().manual_seed(3)), noisy)
    mean = dp_sgd_grads(model, loss, batch, max_norm=0.5, noise_multiplier=0.0,
                        reduction="mean")
    _close(mean["weight"], clean["weight"] / 4)
    with pytest.raises(ValueError, match="reduction"):
        dp_sgd_grads(model, loss, batch, max_norm=0.5, noise_multiplier=0.0, reduction="avg")
    with pytest.raises(ValueError, match="noise_multiplier"):
        dp_sgd_grads(model, loss, batch, max_norm=0.5, noise_multiplier=-1.0)
    # method: ghost clipping gives the same clipped sum; an unknown method is refused
    _close(dp_sgd_grads(model, loss, batch, max_norm=0.5, noise_multiplier=0.0,
                        method="ghost"), clean)
    with pytest.raises(ValueError, match="method"):
        dp_sgd_grads(model, loss, batch, max_norm=0.5, noise_multiplier=0.0, method="fast")
    drop = torch.nn.Sequential(torch.nn.Dropout(0.5), torch.nn.Linear(3, 2))
    with pytest.raises(Exception, match="randomness"):
        dp_sgd_grads(drop, loss, batch, max_norm=0.5, noise_multiplier=0.0, randomness="error")
    # distributed / process_group / noise_rank on a one-process gloo group
    if dist.is_initialized() or not dist.is_available():
        pytest.skip("a process group is already initialised")  # pragma: no cover
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        group = dist.new_group([0])
        _close(dp_sgd_grads(model, loss, batch, max_norm=0.5, noise_multiplier=1.0, seed=3,
                            distributed=True), noisy)
        _close(dp_sgd_grads(model, loss, batch, max_norm=0.5, noise_multiplier=1.0, seed=3,
                            process_group=group), noisy)
        _close(dp_sgd_grads(model, loss, batch, max_norm=0.5, noise_multiplier=1.0, seed=3,
                            process_group=group, method="ghost"), noisy)
        # noise_rank is not this rank: no noise added here
        _close(dp_sgd_grads(model, loss, batch, max_norm=0.5, noise_multiplier=1.0, seed=3,
                            distributed=True, noise_rank=1), clean)
    finally:
        dist.destroy_process_group()


@_checks(*(f"nn.privacy_spent.{p}" for p in (
    "noise_multiplier", "sample_rate", "steps", "delta", "accountant")),
    *(f"nn.noise_for_epsilon.{p}" for p in (
        "target_epsilon", "sample_rate", "steps", "delta", "accountant", "epsilon_tolerance")),
    "nn.PrivacyLedger.accountant")
def _privacy_params():
    from functrans.nn import PrivacyLedger, noise_for_epsilon, privacy_spent
    with pytest.raises(TransformArgumentError, match="accountant must be one of"):
        privacy_spent(noise_multiplier=1.0, sample_rate=0.1, steps=1, delta=1e-5,
                      accountant="x")
    pytest.importorskip("opacus")
    base = dict(noise_multiplier=1.0, sample_rate=0.02, steps=100, delta=1e-5)
    eps = privacy_spent(**base)
    for name, value in (("noise_multiplier", 2.0), ("sample_rate", 0.01), ("steps", 50),
                        ("delta", 1e-3), ("accountant", "prv")):   # each lowers ε
        assert 0 < privacy_spent(**{**base, name: value}) < eps, name
    plan = dict(target_epsilon=2.0, sample_rate=0.02, steps=100, delta=1e-5)
    sigma = noise_for_epsilon(**plan)
    for name, value in (("target_epsilon", 4.0), ("sample_rate", 0.01), ("steps", 50),
                        ("delta", 1e-3), ("accountant", "prv")):   # each needs less noise
        assert 0 < noise_for_epsilon(**{**plan, name: value}) < sigma, name
    assert noise_for_epsilon(**plan, epsilon_tolerance=0.5) != sigma
    for accountant in ("rdp", "prv"):
        ledger = PrivacyLedger(accountant)
        ledger.step(noise_multiplier=1.0, sample_rate=0.02, steps=100)
        assert ledger.epsilon(1e-5) == privacy_spent(**base, accountant=accountant)


@_checks(*(f"nn.PoissonSampler.{p}" for p in (
    "num_samples", "sample_rate", "steps", "generator", "seed")),
    *(f"nn.poisson_data_loader.{p}" for p in (
        "dataset", "sample_rate", "steps", "generator", "seed", "collate_fn",
        "loader_kwargs")))
def _poisson_params():
    from functrans.nn import PoissonSampler, poisson_data_loader
    batches = [i.tolist() for i in PoissonSampler(40, 0.25, steps=6, seed=1)]
    assert len(batches) == 6 and all(0 <= v < 40 for b in batches for v in b)
    assert len(PoissonSampler(40, 0.25)) == 4
    assert batches == [i.tolist() for i in PoissonSampler(
        40, 0.25, steps=6, generator=torch.Generator().manual_seed(1))]
    assert batches != [i.tolist() for i in PoissonSampler(40, 0.25, steps=6, seed=2)]
    assert sum(map(len, PoissonSampler(40, 0.9, steps=6, seed=1))) > \
        sum(map(len, batches)) > 0
    with pytest.raises(TransformArgumentError, match="num_samples"):
        PoissonSampler(0, 0.5)
    data = torch.utils.data.TensorDataset(torch.arange(40))
    loader = poisson_data_loader(data, sample_rate=0.25, steps=6, seed=1)
    assert [b[0].tolist() for b in loader] == batches
    assert [b[0].tolist() for b in poisson_data_loader(
        data, sample_rate=0.25, steps=6, generator=torch.Generator().manual_seed(1))] == batches
    assert len(poisson_data_loader(data, sample_rate=0.5)) == 2
    assert len(poisson_data_loader(data, sample_rate=0.25, seed=2, steps=6)) == 6
    counted = poisson_data_loader(data, sample_rate=0.25, steps=6, seed=1,
                                  collate_fn=lambda rows: len(rows))
    assert list(counted) == [len(b) for b in batches]
    pinned = poisson_data_loader(data, sample_rate=0.25, steps=1, seed=1, num_workers=0,
                                 pin_memory=False)
    assert pinned.num_workers == 0
    with pytest.raises(TransformArgumentError, match="batch_size"):
        poisson_data_loader(data, sample_rate=0.25, batch_size=4)


@_checks("compile.fn", "compile.backend", "compile.dynamic", "compile.strict",
         "compile.cache_size")
def _compile_params():
    def f(x, scale=1.0):
        return functrans.vmap(lambda r: torch.tanh(r).sum())(x) * scale
    x = _t(5, 3)
    compiled = functrans.compile(f)
    _close(compiled(x), f(x))
    _close(compiled(x, 2.0), f(x, 2.0))
    with pytest.raises(TransformArgumentError, match="expected a function"):
        functrans.compile(3)
    with pytest.raises(TransformArgumentError, match="'replay', 'inductor', 'cudagraphs'"):
        functrans.compile(f, backend="nope")
    if not torch.cuda.is_available():   # cudagraphs on CPU tensors: replayed, with the reason
        with pytest.warns(functrans.CompileWarning, match="cudagraphs"):
            out = functrans.compile(f, backend="cudagraphs")(x)
        _close(out, f(x))
    for dynamic, misses in ((True, 1), (False, 3)):
        c = functrans.compile(f, dynamic=dynamic)
        for n in (5, 7, 9):
            _close(c(_t(n, 3)), f(_t(n, 3)))
        info = c.cache_info()   # dynamic: the first call's static graph and a symbolic one
        assert info.misses == misses, info
        assert [e.symbolic for e in info.entries] == ([False, True] if dynamic else [False] * 3)
    with pytest.raises(TransformArgumentError, match="dynamic"):
        functrans.compile(f, dynamic="yes")

    def branch(x):                  # a graph break: allowed under strict=True
        return x * 2 if x.sum() > 0 else x
    _close(functrans.compile(branch, strict=True)(x), branch(x))

    def read_back(x):               # a read no graph can guard
        return x * len(x.numpy())
    with pytest.warns(functrans.CompileWarning, match="numpy"):
        _close(functrans.compile(read_back)(x), read_back(x))
    with pytest.raises(functrans.UntraceableError, match="test_public_api.py"):
        functrans.compile(read_back, strict=True)(x)
    with pytest.raises(TransformArgumentError, match="strict"):
        functrans.compile(f, strict=1)
    small = functrans.compile(f, cache_size=1, dynamic=False)
    for n in (2, 3, 2):
        small(_t(n, 3))
    assert len(small.cache_info().entries) == 1 and small.cache_info().misses == 3
    with pytest.raises(TransformArgumentError, match="cache_size"):
        functrans.compile(f, cache_size=0)


@_checks("explain.fn", "explain.args", "explain.kwargs")
def _explain_params():
    def f(x, scale=1.0):
        return torch.tanh(x) * scale
    text = str(functrans.explain(f, _t(4, 3), scale=2.5))
    assert "graph:" in text and "tanh" in text and "shape (4, 3)" in text
    assert "2.5" in text                      # the keyword argument is a guarded value
    assert "runs eagerly" in str(functrans.explain(lambda x: x.numpy(), _t(2)))


@pytest.mark.parametrize("check", sorted(set(PARAMETER_CHECKS.values()),
                                         key=lambda f: f.__name__),
                         ids=lambda f: f.__name__.strip("_"))
def test_public_parameter_check(check):
    check()

