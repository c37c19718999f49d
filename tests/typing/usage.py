"""A user's strictly typed code against functrans's public API.

``mypy --strict`` checks this file (``[tool.mypy] files`` in pyproject.toml, run by
``scripts/typecheck.sh``): annotated user code type-checks against functrans's annotations,
``assert_type`` pins what the public functions are declared to return, and the
``type: ignore[...]`` lines show that a wrong call IS an error (mypy's ``warn_unused_ignores``,
on under ``strict``, would fail if it were not).  ``tests/typing/test_usage.py`` also runs it,
so the code is real, not only well typed.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, Sequence, Tuple

import torch
from torch import nn
from typing_extensions import assert_type

import functrans as ft
from functrans.compiler import CompiledFunction

Params = Dict[str, torch.Tensor]


def loss(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return (x @ w).pow(2).sum()


def per_example_grads(w: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
    # transforms map arbitrary callables: the transformed function returns Any, which a user
    # narrows by annotating the variable
    g: torch.Tensor = ft.vmap(ft.grad(loss), in_dims=(None, 0))(w, xs)
    return g


def jacobian_and_hessian(w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    f = lambda v: v.sin().sum()  # noqa: E731
    jac_fn = ft.jacrev(torch.sin)
    assert_type(jac_fn, Callable[..., Any])
    j: torch.Tensor = jac_fn(w)
    h: torch.Tensor = ft.hessian(f)(w)
    return j, h


def vjp_and_jvp(w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    out, vjp_fn = ft.vjp(torch.sin, w)
    (g,) = vjp_fn(torch.ones_like(out))
    _, t = ft.jvp(torch.sin, (w,), (torch.ones_like(w),))
    assert isinstance(g, torch.Tensor) and isinstance(t, torch.Tensor)
    return g, t


def ensemble_outputs(models: Sequence[nn.Module], x: torch.Tensor) -> torch.Tensor:
    params, buffers = ft.stack_module_state(models)
    assert_type(params, Params)
    skeleton = models[0]

    def run(p: Params, b: Params, xi: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = ft.functional_call(skeleton, (p, b), (xi,))
        return y

    out: torch.Tensor = ft.vmap(run, in_dims=(0, 0, None))(params, buffers, x)
    return out


def compiled(w: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
    step = ft.compile(ft.vmap(ft.grad(loss), in_dims=(None, 0)))
    assert_type(step, CompiledFunction)
    decorate = ft.compile(backend="replay", dynamic=True)   # the decorator form
    assert_type(decorate, Callable[[Callable[..., Any]], CompiledFunction])
    g: torch.Tensor = step(w, xs)
    return g


if TYPE_CHECKING:   # wrong calls mypy must reject (never run)
    ft.vmap(loss, chunk_size="4")  # type: ignore[arg-type]
    ft.jacrev(loss, argnums="0")  # type: ignore[arg-type]
    ft.stack_module_state(nn.Linear(2, 2))  # type: ignore[arg-type]
    ft.replace_all_batch_norm_modules_(torch.ones(2))  # type: ignore[arg-type]


def main() -> None:
    w, xs = torch.ones(3), torch.ones(4, 2, 3)
    assert per_example_grads(w, xs).shape == (4, 3)
    j, h = jacobian_and_hessian(torch.zeros(3))
    assert j.shape == (3, 3) and h.shape == (3, 3)
    g, t = vjp_and_jvp(torch.zeros(3))
    assert torch.equal(g, torch.ones(3)) and torch.equal(t, torch.ones(3))
    models = [nn.Linear(3, 2) for _ in range(2)]
    assert ensemble_outputs(models, torch.ones(5, 3)).shape == (2, 5, 2)
    assert torch.allclose(compiled(w, xs), per_example_grads(w, xs))


if __name__ == "__main__":
    main()
