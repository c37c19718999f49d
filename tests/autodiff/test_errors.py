"""Autodiff errors name the API the user called, the argument, and the fix."""
import re

import pytest
import torch

import functrans as ft
from functrans import _levels
from functrans.errors import TransformArgumentError


def raises(pattern, fn, exc=TransformArgumentError):
    with pytest.raises(exc) as info:
        fn()
    assert re.search(pattern, str(info.value), re.S), str(info.value)
    assert _levels.stack() == []


x = torch.randn(3)


def test_grad_non_scalar_output():
    raises(r"^grad\(.*scalar \(0-d\) tensor, got shape \(3,\).*vjp or jacrev",
           lambda: ft.grad(torch.sin)(x))


def test_argnums_errors():
    raises(r"grad\(.*argnums=2 is out of range.*\[-1, 0\]", lambda: ft.grad(torch.sum, argnums=2)(x))
    raises(r"jacrev.*argnums=5 is out of range", lambda: ft.jacrev(torch.sin, argnums=5)(x))
    raises(r"grad\(.*args\[1\] is a int, not a tensor",
           lambda: ft.grad(lambda a, n: a.sum() * n, argnums=1)(x, 3))
    raises(r"argnums must be an int or a tuple", lambda: ft.grad(torch.sum, argnums=[0])(x))
    raises(r"dtype torch.int64.*floating point", lambda: ft.grad(lambda a: a.sum())(torch.arange(3)))


def test_has_aux_not_a_pair():
    raises(r"^grad\(.*has_aux=True.*pair \(output, aux\)",
           lambda: ft.grad(lambda a: a.sum(), has_aux=True)(x))
    raises(r"^vjp\(<lambda>, \*primals\): with has_aux=True", lambda: ft.vjp(lambda a: a, x, has_aux=True))


def test_cotangent_checks_name_vjp():
    out, fn = ft.vjp(torch.sin, x)
    raises(r"^vjp\(sin, \*primals\): vjp_fn got a cotangent of shape \(4,\).*output of shape \(3,\)",
           lambda: fn(torch.ones(4)))
    raises(r"^vjp\(sin, \*primals\): vjp_fn got a cotangent of dtype torch.float64", lambda: fn(torch.ones(3, dtype=torch.float64)))
    raises(r"^vjp\(sin, \*primals\): vjp_fn expects cotangents with the structure", lambda: fn((torch.ones(3),)))


def test_jvp_checks():
    raises(r"^jvp\(sin, primals, tangents\): primals must be a tuple", lambda: ft.jvp(torch.sin, x, (x,)))
    raises(r"^jvp\(sin, primals, tangents\): the tangent for primals\[0\] has shape \(2,\)",
           lambda: ft.jvp(torch.sin, (x,), (torch.ones(2),)))
    raises(r"^jvp\(sin, primals, tangents\): tangents must have the same structure", lambda: ft.jvp(torch.sin, (x,), (x, x)))
    # another floating dtype is accepted, as by torch.func; a complex or integer one is not
    raises(r"^jvp\(sin, primals, tangents\): the tangent for primals\[0\] has dtype torch.complex64",
           lambda: ft.jvp(torch.sin, (x,), (x.to(torch.complex64),)))
    raises(r"^jvp\(sin, primals, tangents\): the tangent for primals\[0\] has dtype torch.int64",
           lambda: ft.jvp(torch.sin, (x,), (x.long(),)))


def test_chunk_size_checks_name_the_api():
    raises(r"^jacrev\(sin, argnums=0\): chunk_size must be None, a positive int or 'auto'", lambda: ft.jacrev(torch.sin, chunk_size=0))
    raises(r"^jacfwd\(sin, argnums=0\): chunk_size", lambda: ft.jacfwd(torch.sin, chunk_size=-1))
    raises(r"^hessian\(sum, argnums=0\): chunk_size", lambda: ft.hessian(torch.sum, chunk_size=0))


def test_jacobian_errors_say_jacrev_not_vjp():
    raises(r"^jacrev\(<lambda>, argnums=0\): the function must return tensors",
           lambda: ft.jacrev(lambda a: (a, 3))(x))


def test_level_stack_clean_after_user_exception():
    def boom(a):
        raise KeyError("user bug")
    for transform in (lambda: ft.grad(boom)(x), lambda: ft.vjp(boom, x),
                      lambda: ft.jvp(boom, (x,), (x,)), lambda: ft.jacrev(boom)(x),
                      lambda: ft.jacfwd(boom)(x), lambda: ft.hessian(boom)(x),
                      lambda: ft.vmap(ft.grad(boom))(torch.randn(2, 3))):
        with pytest.raises(KeyError):
            transform()
        assert _levels.stack() == []
    torch.testing.assert_close(ft.grad(lambda a: (a * a).sum())(x), 2 * x)
