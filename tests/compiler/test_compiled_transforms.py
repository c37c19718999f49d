"""The transform workloads again, through ``functrans.compile`` with each backend available here
(replay; inductor on CPU), against eager functrans and torch.func.

Each workload is ``work(m, *args)`` with ``m`` the transform module (functrans or torch.func).
A compiled ``work(functrans, ...)`` is called three times: the first call is the trace (its
outputs are the eager run's), the second replays the cached graph on the same tensors, the
third replays it on new values of the same shapes.  Every answer is compared with eager
functrans on the same values and with torch.func; ``cache_info()`` must show one graph built by
the requested backend (no silent eager run, no fallback to another backend) and two hits.

Inductor compiles each graph for seconds to a minute on this CPU, so the default run takes it on
``INDUCTOR_DEFAULT`` (vmap(hessian), where torch.compile over torch.func crashes, and two small
graphs); every other workload runs through inductor under the ``sweep`` marker.
"""
import copy

import pytest
import torch
import torch.func as tf
import torch.nn as nn
import torch.nn.functional as F

import functrans as ft
from tests.autodiff.test_transforms import f_scalar, f_two, f_vec
from tests.support.oracles import assert_same

TOL = {"replay": dict(rtol=1e-9, atol=1e-10), "inductor": dict(rtol=1e-7, atol=1e-9)}


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()


MLP = _mlp()
ENSEMBLE = [_mlp() for _ in range(3)]


def _params(model):
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _per_sample_loss(m):
    def loss(params, x, y):
        out = m.functional_call(MLP, params, (x.unsqueeze(0),))
        return F.cross_entropy(out, y.unsqueeze(0))
    return loss


def _ntk(m, params, x1, x2):
    def f(p, x):
        return m.functional_call(MLP, p, (x.unsqueeze(0),)).squeeze(0)

    j1 = m.vmap(m.jacrev(f), (None, 0))(params, x1)
    j2 = m.vmap(m.jacrev(f), (None, 0))(params, x2)
    return sum(torch.einsum("Naf,Mbf->NMab", a.flatten(2), b.flatten(2))
               for a, b in zip(j1.values(), j2.values()))


def _ensemble(m, params, x):
    base = copy.deepcopy(ENSEMBLE[0]).to("meta")
    return m.vmap(lambda p, xx: m.functional_call(base, p, (xx,)), in_dims=(0, None))(params, x)


def _train_step(m, params, x, y):
    """A step calling several transforms: per-sample grads clipped, a loss gradient with aux,
    a JVP along the update and the Hessian-vector product of a scalar function of x."""
    loss = _per_sample_loss(m)
    per = m.vmap(m.grad(loss), in_dims=(None, 0, 0))(params, x, y)
    norms = torch.stack([g.flatten(1).norm(dim=1) for g in per.values()]).norm(dim=0)
    scale = (1.0 / (norms + 1e-6)).clamp(max=1.0)
    clipped = {k: (g * scale.view(-1, *[1] * (g.dim() - 1))).mean(0) for k, g in per.items()}

    def total(p):
        out = m.functional_call(MLP, p, (x,))
        return F.cross_entropy(out, y), out
    grads, (value, out) = m.grad_and_value(total, has_aux=True)(params)
    new = {k: params[k] - 0.1 * (grads[k] + clipped[k]) for k in params}
    _, dvalue = m.jvp(lambda p: total(p)[0], (params,), ({k: -g for k, g in grads.items()},))
    hvp = m.jvp(m.grad(f_scalar), (x[0],), (x[1],))[1]
    return new, value, dvalue, out, hvp


def _g(seed):
    return torch.Generator().manual_seed(seed)


def _vec_inputs(seed):
    g = _g(seed)
    return (torch.randn(4, generator=g, dtype=torch.float64),
            torch.randn(3, 4, generator=g, dtype=torch.float64),
            torch.randn(5, 4, generator=g, dtype=torch.float64),
            torch.randn(4, generator=g, dtype=torch.float64))


def _model_inputs(seed):
    g = _g(seed)
    params = {k: v + 0.1 * torch.randn(v.shape, generator=g, dtype=v.dtype)
              for k, v in _params(MLP).items()}
    return (params, torch.randn(5, 4, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (5,), generator=g))


def _ntk_inputs(seed):
    g = _g(seed)
    params = _model_inputs(seed)[0]
    return (params, torch.randn(3, 4, generator=g, dtype=torch.float64),
            torch.randn(2, 4, generator=g, dtype=torch.float64))


def _ensemble_inputs(seed):
    g = _g(seed)
    params, _ = ft.stack_module_state(ENSEMBLE)
    params = {k: (v.detach() + 0.1 * torch.randn(v.shape, generator=g, dtype=v.dtype))
              for k, v in params.items()}
    return params, torch.randn(5, 4, generator=g, dtype=torch.float64)


# name -> (work(m, *args), inputs(seed))
WORKLOADS = {
    "vmap": (lambda m, x, w, X, t: m.vmap(f_vec)(X), _vec_inputs),
    "vmap_in_out_dims_chunk": (
        lambda m, x, w, X, t: m.vmap(lambda a, b, c: (a * b.sum() + a.sin() * c, a.cumsum(0)),
                                     in_dims=(1, None, 0), out_dims=(1, 0), chunk_size=2)(
            X.T, w, X.flip(1)), _vec_inputs),
    "grad": (lambda m, x, w, X, t: m.grad(f_scalar)(x), _vec_inputs),
    "grad_and_value_has_aux": (
        lambda m, x, w, X, t: m.grad_and_value(lambda a, b: (f_two(a, b), a.cos() * b),
                                               argnums=(0, 1), has_aux=True)(x, w),
        _vec_inputs),
    "vjp_fn_called_inside": (
        lambda m, x, w, X, t: (lambda o: (o[0], o[1](t), o[1](t.flip(0))))(m.vjp(f_vec, x)),
        _vec_inputs),
    "jvp": (lambda m, x, w, X, t: m.jvp(f_vec, (x,), (t,)), _vec_inputs),
    "linearize": (lambda m, x, w, X, t: (lambda o: (o[0], o[1](t), o[1](x)))(
        m.linearize(f_vec, x)), _vec_inputs),
    "jacrev": (lambda m, x, w, X, t: m.jacrev(lambda a, b: torch.tanh(b @ a),
                                             argnums=(0, 1))(x, w), _vec_inputs),
    "jacfwd": (lambda m, x, w, X, t: m.jacfwd(f_vec)(x), _vec_inputs),
    "hessian": (lambda m, x, w, X, t: m.hessian(f_scalar)(x), _vec_inputs),
    "vmap_grad_per_sample_mlp": (
        lambda m, params, x, y: m.vmap(m.grad(_per_sample_loss(m)), in_dims=(None, 0, 0))(
            params, x, y), _model_inputs),
    "vmap_jacrev": (lambda m, x, w, X, t: m.vmap(m.jacrev(f_vec))(X), _vec_inputs),
    "vmap_hessian": (lambda m, x, w, X, t: m.vmap(m.hessian(f_scalar))(X), _vec_inputs),
    "ntk": (_ntk, _ntk_inputs),
    "ensemble_stack_module_state": (_ensemble, _ensemble_inputs),
    "training_step": (_train_step, _model_inputs),
}


INDUCTOR_DEFAULT = ("vmap_hessian", "jacrev", "vjp_fn_called_inside")


def _cases():
    for name in WORKLOADS:
        yield pytest.param(name, "replay", id=f"{name}-replay")
        marks = () if name in INDUCTOR_DEFAULT else (pytest.mark.sweep,)
        yield pytest.param(name, "inductor", id=f"{name}-inductor", marks=marks)


@pytest.mark.parametrize("name,backend", list(_cases()))
def test_compiled_matches_eager_and_torch_func(name, backend):
    work, inputs = WORKLOADS[name]
    compiled = ft.compile(lambda *a: work(ft, *a), backend=backend)
    tol = TOL[backend]
    args = inputs(0)
    expected = work(ft, *args)
    assert_same(expected, work(tf, *args), **TOL["replay"], msg="eager functrans vs torch.func")
    for call in ("trace", "replay"):
        assert_same(compiled(*args), expected, **tol, msg=f"{name} ({call})")
    new = inputs(1)
    expected_new = work(ft, *new)
    assert_same(compiled(*new), expected_new, **tol, msg=f"{name} (new values)")
    assert_same(expected_new, work(tf, *new), **TOL["replay"])
    info = compiled.cache_info()
    assert (info.misses, info.hits, info.eager_calls) == (1, 2, 0), str(info)
    assert [e.backend for e in info.entries] == [backend], str(info)
    assert not info.entries[0].notes, str(info)     # no fallback from inductor to replay
    assert info.entries[0].ops > 0
