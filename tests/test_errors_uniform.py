"""Errors are functrans's own and worded the same way everywhere.

* Every ``raise`` of a builtin exception class in the package is listed below with a reason
  (an AST walk over ``functrans/``); everything else raises a ``FunctransError`` subclass that
  is also the builtin type users caught before (``except ValueError`` keeps working).
* Every transform's message opens with the call echoed (``errors.transform_call``).
* ``chunk_size`` is validated once (``errors.check_chunk_size``): a bool is refused everywhere.
* ``ForwardModeAroundVmap`` lives in ``functrans.errors``; autodiff's level bookkeeping lives
  in ``functrans.autodiff.levels``.
* ``config.warn_on_fallback`` is per thread.
"""
import ast
import builtins
import importlib
import pathlib
import threading
import warnings

import pytest
import torch
from torch import nn

import functrans as ft
from functrans import _levels, config, errors
from functrans.autodiff import levels as autodiff_levels
from functrans.batching import fallback
from functrans.errors import (FunctransError, TransformArgumentError, TransformKeyError,
                              TransformTypeError)
from functrans.nn import dp

PACKAGE = pathlib.Path(ft.__file__).parent
_BUILTIN_EXCEPTIONS = {name for name in dir(builtins)
                       if isinstance(getattr(builtins, name), type)
                       and issubclass(getattr(builtins, name), BaseException)}

_EAGER = "mirrors eager's own error for the same per-example call"
# (file relative to functrans/, enclosing function, builtin class) -> why it stays builtin.
ALLOWED_BUILTIN_RAISES = {
    ("_levels.py", "pushed", "AssertionError"):
        "internal invariant: the level stack was corrupted (a functrans bug, not a misuse)",
    ("batching/helpers.py", "normalize_dim", "IndexError"):
        "mirrors eager's 'Dimension out of range' IndexError for the same per-example dim",
    ("batching/registry.py", "_check_cast", "RuntimeError"):
        "mirrors eager's RuntimeError for an out= tensor the result cannot be cast to",
    ("batching/above_dispatch.py", "_split_scalar_index", "IndexError"):
        "mirrors eager's IndexError for a bad index (two ellipses, too many indices)",
    ("batching/rules/padding.py", "constant_pad_nd_rule", "RuntimeError"): _EAGER,
    ("batching/rules/random.py", "_check_enough_categories", "RuntimeError"): _EAGER,
    ("batching/above_dispatch.py", "narrow_with_batched_start", "RuntimeError"): _EAGER,
    ("batching/above_dispatch.py", "narrow_with_batched_start", "IndexError"): _EAGER,
    ("batching/rules/views.py", "t_rule", "RuntimeError"): _EAGER,
    ("batching/rules/views.py", "expand_rule", "RuntimeError"): _EAGER,
    ("batching/rules/views.py", "cat_rule", "RuntimeError"): _EAGER,
    ("batching/rules/views.py", "block_diag_rule", "RuntimeError"): _EAGER,
    ("batching/rules/views.py", "_check_window", "RuntimeError"): _EAGER,
}


def _builtin_raises():
    """(file, enclosing function qualname, class, line) of every ``raise X(...)``/``raise X``
    in the package whose X is a builtin exception class."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        scope = []

        class Visitor(ast.NodeVisitor):
            def _scoped(self, node):
                scope.append(node.name)
                self.generic_visit(node)
                scope.pop()

            visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scoped

            def visit_Raise(self, node):
                exc = node.exc
                target = exc.func if isinstance(exc, ast.Call) else exc
                if isinstance(target, ast.Name) and target.id in _BUILTIN_EXCEPTIONS:
                    found.append((rel, ".".join(scope), target.id, node.lineno))
                self.generic_visit(node)

        Visitor().visit(tree)
    return found


def test_no_builtin_exception_raised_outside_the_whitelist():
    found = _builtin_raises()
    assert found, "the AST walk found no raise at all: it is not reading the package"
    unexpected = [f"functrans/{rel}:{line} in {fn}(): raise {cls}"
                  for rel, fn, cls, line in found if (rel, fn, cls) not in ALLOWED_BUILTIN_RAISES]
    assert not unexpected, (
        "raise a functrans.errors type (a FunctransError that also subclasses the builtin "
        "users catch), or whitelist it with a reason:\n" + "\n".join(unexpected))


def test_whitelist_has_no_stale_entries():
    seen = {(rel, fn, cls) for rel, fn, cls, _ in _builtin_raises()}
    stale = sorted(set(ALLOWED_BUILTIN_RAISES) - seen)
    assert not stale, f"whitelisted raises that no longer exist (remove them): {stale}"


def test_every_error_class_is_a_functrans_error_and_keeps_its_builtin_base():
    classes = [v for v in vars(errors).values() if isinstance(v, type)
               and issubclass(v, BaseException) and not issubclass(v, Warning)]
    assert len(classes) >= 9
    for cls in classes:
        assert issubclass(cls, FunctransError), cls
        assert issubclass(cls, RuntimeError), cls  # `except RuntimeError` keeps working
    assert issubclass(TransformArgumentError, ValueError)
    assert issubclass(TransformTypeError, TypeError)
    assert issubclass(TransformKeyError, KeyError)
    assert issubclass(errors.MissingDependencyError, ImportError)


def test_transform_call_formats_the_call():
    def f(x):
        return x
    assert errors.transform_call("jacrev", f, argnums=0) == "jacrev(f, argnums=0)"
    assert errors.transform_call("vmap", lambda x: x, in_dims=(0, None), out_dims=0) == \
        "vmap(<lambda>, in_dims=(0, None), out_dims=0)"
    assert errors.transform_call("jvp", "f", "primals", "tangents") == \
        "jvp(f, primals, tangents)"
    assert errors.transform_call("stack_module_state", "models") == "stack_module_state(models)"
    assert errors.transform_call("functional_call", nn.Linear(2, 2), "dicts") == \
        "functional_call(Linear, dicts)"


# --- every transform's message opens with the call echoed ---------------------------------

def loss(w):
    return (w ** 2).sum()


def vec(w):
    return w.sin()


_W = torch.randn(3)
_IW = torch.arange(3)


def _dp_problem():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    x, y = torch.randn(4, 3), torch.randn(4, 2)
    return model, nn.functional.mse_loss, (x, y)


def _bad_calls():
    model, loss_fn, batch = _dp_problem()
    m = nn.Linear(3, 2)
    return {
        "vmap": (lambda: ft.vmap(vec, in_dims=(0, 0))(_W.expand(2, 3)),
                 "vmap(vec, in_dims=(0, 0), out_dims=0): ", TransformArgumentError),
        "vmap_construction": (lambda: ft.vmap(vec, in_dims="0"),
                              "vmap(vec, in_dims='0', out_dims=0): ", TransformArgumentError),
        "grad": (lambda: ft.grad(vec)(_W), "grad(vec, argnums=0): ", TransformArgumentError),
        "grad_and_value": (lambda: ft.grad_and_value(loss, argnums=1)(_W),
                           "grad_and_value(loss, argnums=1): ", TransformArgumentError),
        "vjp": (lambda: ft.vjp(loss, _IW), "vjp(loss, *primals): ", TransformArgumentError),
        "vjp_fn": (lambda: ft.vjp(vec, _W)[1](torch.ones(4)), "vjp(vec, *primals): ",
                   TransformArgumentError),
        "jvp": (lambda: ft.jvp(vec, _W, _W), "jvp(vec, primals, tangents): ",
                TransformArgumentError),
        "jvp_strict": (lambda: ft.jvp(lambda a: torch.ones(2), (_W,), (_W,), strict=True),
                       "jvp(<lambda>, primals, tangents, strict=True): ",
                       TransformArgumentError),
        "linearize": (lambda: ft.linearize(vec, _IW), "linearize(vec, *primals): ",
                      TransformArgumentError),
        "linearize_jvp_fn": (lambda: ft.linearize(vec, _W)[1](torch.ones(4)),
                             "linearize(vec, *primals)'s jvp_fn: ", TransformArgumentError),
        "jacrev": (lambda: ft.jacrev(vec, argnums=2)(_W), "jacrev(vec, argnums=2): ",
                   TransformArgumentError),
        "jacfwd": (lambda: ft.jacfwd(vec)(_IW), "jacfwd(vec, argnums=0): ",
                   TransformArgumentError),
        "jacfwd_randomness": (lambda: ft.jacfwd(vec, randomness="sometimes"),
                              "jacfwd(vec, argnums=0): ", TransformArgumentError),
        "hessian": (lambda: ft.hessian(loss, argnums=1)(_W), "hessian(loss, argnums=1): ",
                    TransformArgumentError),
        "functional_call": (lambda: ft.functional_call(m, {"weight": 1.0}, (_W,)),
                            "functional_call(Linear, parameter_and_buffer_dicts): ",
                            TransformArgumentError),
        "functional_call_strict": (lambda: ft.functional_call(m, {}, (_W,), strict=True),
                                   "functional_call(Linear, parameter_and_buffer_dicts, "
                                   "strict=True): ", TransformArgumentError),
        "stack_module_state": (lambda: ft.stack_module_state([]),
                               "stack_module_state(models): ", TransformArgumentError),
        "Ensemble": (lambda: ft.Ensemble([m, m])(torch.randn(3, 3), shared=False),
                     "Ensemble(models)(*args, shared=False): ", TransformArgumentError),
        "functionalize": (lambda: ft.functionalize(vec, remove="views"),
                          "functionalize(vec, remove='views'): ", TransformArgumentError),
        "functionalize_write_back": (
            lambda: ft.functionalize(lambda a: a.transpose_(0, 1))(torch.randn(2, 3)),
            "functionalize(<lambda>, remove='mutations'): ", FunctransError),
        "dp_sgd_grads": (lambda: dp.dp_sgd_grads(model, loss_fn, batch, max_norm=1.0,
                                                 noise_multiplier=-1.0),
                         "dp_sgd_grads(model, loss_fn, batch, max_norm=1.0, "
                         "noise_multiplier=-1.0): ", TransformArgumentError),
        "dp_sgd_grads_batch": (lambda: dp.dp_sgd_grads(model, loss_fn, [1, 2], max_norm=1.0,
                                                       noise_multiplier=1.0),
                               "dp_sgd_grads(model, loss_fn, batch, max_norm=1.0, "
                               "noise_multiplier=1.0): ", TransformTypeError),
        "per_sample_grads": (lambda: dp.per_sample_grads(model, loss_fn, (batch[0], batch[1][:3])),
                             "per_sample_grads(model, loss_fn, batch): ", TransformArgumentError),
        "clip_and_sum": (lambda: dp.clip_and_sum({}, 1.0), "clip_and_sum(per_sample, "
                         "max_norm=1.0): ", TransformArgumentError),
        "add_gaussian_noise": (lambda: dp.add_gaussian_noise({}, 1.0, seed=0,
                                                             generator=torch.Generator()),
                               "add_gaussian_noise(grads, std=1.0): ", TransformArgumentError),
        "assign_grads": (lambda: dp.assign_grads(model, {"nope": torch.zeros(1)}),
                         "assign_grads(model, grads): ", TransformKeyError),
        "rearrange": (lambda: ft.rearrange([1, 2], "a -> a"),
                      "rearrange(tensor, pattern, **axes_lengths): ", TransformTypeError),
    }


@pytest.mark.parametrize("name", list(_bad_calls()))
def test_message_opens_with_the_call(name):
    call, opening, exc_type = _bad_calls()[name]
    with pytest.raises(exc_type) as info:
        call()
    assert type(info.value) is exc_type, f"{type(info.value).__name__}: {info.value}"
    msg = str(info.value)
    assert msg.startswith(opening), msg
    assert len(msg) > len(opening) + 20, "the message must say what was wrong and what to do"
    assert _levels.stack() == []


def test_dp_sgd_errors_are_still_value_and_type_errors():
    model, loss_fn, batch = _dp_problem()
    with pytest.raises(ValueError, match="max_norm"):
        dp.dp_sgd_grads(model, loss_fn, batch, max_norm=0.0, noise_multiplier=1.0)
    with pytest.raises(TypeError, match="batch must be a tensor"):
        dp.per_sample_grads(model, loss_fn, "not a batch")
    with pytest.raises(KeyError):
        dp.assign_grads(model, {"nope": torch.zeros(1)})


# --- one chunk_size check -------------------------------------------------------------------

@pytest.mark.parametrize("bad", [True, False, 0, -1, 2.0, "2"])
@pytest.mark.parametrize("api", [ft.vmap, ft.jacrev, ft.jacfwd, ft.hessian])
def test_chunk_size_refused_alike(api, bad):
    with pytest.raises(TransformArgumentError) as info:
        api(loss, chunk_size=bad)
    name = api.__name__
    msg = str(info.value)
    expected = (f"{name}(loss, in_dims=0, out_dims=0)" if name == "vmap"
                else f"{name}(loss, argnums=0)")
    assert msg.startswith(f"{expected}: chunk_size must be None, a positive int or 'auto', got "
                          f"{bad!r} ({type(bad).__name__})."), msg


def test_chunk_size_true_refused_by_vmap_and_jacrev():
    for api in (ft.vmap, ft.jacrev):
        with pytest.raises(TransformArgumentError, match=r"got True \(bool\)"):
            api(vec, chunk_size=True)
    # a valid chunk_size still works
    torch.testing.assert_close(ft.jacrev(vec, chunk_size=1)(_W), torch.diag(_W.cos()))


# --- ForwardModeAroundVmap and the autodiff levels -----------------------------------------

def test_forward_mode_around_vmap_lives_in_errors():
    # (the public functions shadow these submodules' names as attributes of their packages)
    jvp_module = importlib.import_module("functrans.autodiff.jvp")
    functionalize_module = importlib.import_module("functrans.functionalization")
    assert issubclass(errors.ForwardModeAroundVmap, FunctransError)
    assert "jvp" in errors.ForwardModeAroundVmap.__doc__
    assert jvp_module.ForwardModeAroundVmap is errors.ForwardModeAroundVmap
    assert functionalize_module.ForwardModeAroundVmap is errors.ForwardModeAroundVmap
    # and jvp still catches it: a vmap inside jvp's forward-AD level retries by double-vjp
    x, t = torch.randn(2, 3), torch.randn(2, 3)
    _, tangent = ft.jvp(lambda a: ft.vmap(torch.sin)(a), (x,), (t,))
    torch.testing.assert_close(tangent, x.cos() * t)


def test_autodiff_level_bookkeeping_lives_in_autodiff():
    assert not hasattr(_levels, "claim_forward_ad") and not hasattr(_levels, "release_forward_ad")
    assert "order" not in _levels.Level.__slots__
    imported = [n.module or "" for n in ast.walk(ast.parse((PACKAGE / "_levels.py").read_text()))
                if isinstance(n, ast.ImportFrom)] + \
        [a.name for n in ast.walk(ast.parse((PACKAGE / "_levels.py").read_text()))
         if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in imported if "autodiff" in m], imported
    seen = []
    ft.jacfwd(lambda a: (seen.append([(lv.kind, lv.order) for lv in _levels.stack()
                                      if isinstance(lv, autodiff_levels.AutodiffLevel)])
                         or a.sin()))(_W)
    assert seen and all(kind in ("grad", "jvp") for kind, _ in seen[0])
    assert autodiff_levels.claim_forward_ad()
    try:
        assert not autodiff_levels.claim_forward_ad()   # one dual level per process
        with torch.autograd.forward_ad.dual_level():
            assert _levels.forward_ad_state() == "mine"
            other = []
            t = threading.Thread(target=lambda: other.append(_levels.forward_ad_state()))
            t.start()
            t.join()
            assert other == ["other"]
    finally:
        autodiff_levels.release_forward_ad()
    with torch.autograd.forward_ad.dual_level():
        assert _levels.forward_ad_state() == "user"
    assert _levels.forward_ad_state() == "none"


# --- config.warn_on_fallback is per thread --------------------------------------------------

@torch.library.custom_op("functrans_test_errors::triple_cumsum", mutates_args=())
def _triple_cumsum(x: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(x, 0) * 3


_OP = torch.ops.functrans_test_errors.triple_cumsum


def _fallback_warnings_in(thread_setting):
    """Run the fallback in a fresh thread with ``warn_on_fallback = thread_setting``: the
    PerformanceWarnings it emitted there, and what the thread read."""
    out = {}

    def body():
        out["initial"] = config.warn_on_fallback
        config.warn_on_fallback = thread_setting
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ft.vmap(_OP)(torch.randn(2, 3))
        out["perf"] = [w for w in caught if issubclass(w.category, ft.PerformanceWarning)]
        out["final"] = config.warn_on_fallback

    t = threading.Thread(target=body)
    t.start()
    t.join()
    return out


def test_warn_on_fallback_is_thread_local():
    fallback._warned.discard(_OP.default)
    assert config.warn_on_fallback is True
    config.warn_on_fallback = False
    try:
        out = _fallback_warnings_in(True)
        assert out["initial"] is True, "the main thread's setting leaked into a new thread"
        assert len(out["perf"]) == 1 and "triple_cumsum" in str(out["perf"][0].message)
        assert config.warn_on_fallback is False, "the thread's setting leaked into the main one"
    finally:
        config.warn_on_fallback = True
    fallback._warned.discard(_OP.default)
    out = _fallback_warnings_in(False)
    assert out["perf"] == [] and out["final"] is False
    assert config.warn_on_fallback is True


def test_warn_on_fallback_concurrent_threads_keep_their_own_setting():
    barrier = threading.Barrier(2)
    seen = {}

    def body(value):
        config.warn_on_fallback = value
        barrier.wait()          # both threads have set theirs before either reads
        seen[value] = config.warn_on_fallback

    threads = [threading.Thread(target=body, args=(v,)) for v in (True, False)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {True: True, False: False}


def test_fallback_warnings_context_manager():
    fallback._warned.discard(_OP.default)
    with config.fallback_warnings(False):
        assert config.warn_on_fallback is False
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ft.vmap(_OP)(torch.randn(2, 3))
        assert not [w for w in caught if issubclass(w.category, ft.PerformanceWarning)]
    assert config.warn_on_fallback is True
    with pytest.warns(ft.PerformanceWarning, match="triple_cumsum"):
        ft.vmap(_OP)(torch.randn(2, 3))
